//! Streams as worker threads with FIFO queues, and events as snapshots of a stream's completion
//! counter.
//!
//! Each stream counts the items ever queued (`enqueued`) and finished (`completed`); items finish
//! strictly in order. Recording an event stores `(stream, enqueued)`; waiting on it queues an item
//! that blocks the waiting stream's worker until the recorded stream's `completed` reaches that
//! count. Because a record only ever names work that is already queued, waits cannot form a cycle.
//!
//! A worker waiting on another stream sleeps on that stream's condition variable until the
//! awaited item completes. Benchmarks of the overlapped schedule opt in to a waiter that starts
//! within microseconds of the completion instead (`crate::forecast`, [`WaitStrategy::Forecast`](crate::WaitStrategy::Forecast)).

use std::collections::VecDeque;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kda_core::{Error, EventHandle, EventId, Result, StreamHandle, StreamId, Validated};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::ReferenceBackend;
use crate::forecast::{Forecast, Running};
use crate::kernels::{self, Exec};
use crate::progress::{self, Progress};
use crate::timeline::Recorder;

/// Random delays before each queued item, to shake out ordering bugs in tests.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Jitter {
    pub seed: u64,
    pub max: Duration,
}

enum Item {
    /// An op, with its label when the backend records a timeline.
    Op(Box<Validated<ReferenceBackend>>, Option<Box<str>>),
    Wait {
        upstream: Arc<Shared>,
        target: u64,
    },
}

pub(crate) struct State {
    queue: VecDeque<Item>,
    enqueued: u64,
    pub(crate) completed: u64,
    /// The first execution failure not yet reported by `synchronize`, with the item's number.
    error: Option<(u64, Error)>,
    closing: bool,
    /// The smallest `completed` count a thread sleeping on this stream's completions waits
    /// for (`u64::MAX`: none). The worker signals completions only when one reaches it, so a
    /// `synchronize` sleeping on the last item is not woken, to contend for the lock, by every
    /// item before it.
    pub(crate) wake_at: u64,
    /// The op being run (set when waiters forecast, see `crate::forecast`).
    pub(crate) running: Option<Running>,
}

/// What a stream's handle, its worker and events recorded on it share.
pub(crate) struct Shared {
    pub(crate) id: StreamId,
    pub(crate) state: Mutex<State>,
    /// Signalled when an item is queued, when an item completes that a sleeper waits for
    /// (`State::wake_at`), or when the stream closes.
    pub(crate) changed: Condvar,
    /// `State::completed`, readable without the lock by waiters that poll.
    pub(crate) completed: AtomicU64,
    /// How far the running op has got (read by forecast waiters).
    pub(crate) progress: Arc<Progress>,
}

/// How a worker waits for another stream's work.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum WaitPolicy {
    /// Sleep on the upstream's condition variable.
    Block,
    /// Sleep through the forecast part of the awaited op, then poll, yielding the core between
    /// looks, for up to this long in all; then sleep (`crate::forecast`).
    Spin(Duration),
}

impl Shared {
    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave `State` inconsistent (every update is a
        // single assignment), so a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn wait_until(&self, mut done: impl FnMut(&State) -> bool) -> MutexGuard<'_, State> {
        let mut state = self.lock();
        while !done(&state) {
            state = self.changed.wait(state).unwrap_or_else(PoisonError::into_inner);
        }
        state
    }

    /// Sleep until `completed >= target`, registered in `wake_at` so the worker signals it.
    pub(crate) fn sleep_until_completed(&self, target: u64) -> MutexGuard<'_, State> {
        let mut state = self.lock();
        while state.completed < target {
            state.wake_at = state.wake_at.min(target);
            state = self.changed.wait(state).unwrap_or_else(PoisonError::into_inner);
        }
        state
    }

    /// Wait until `completed >= target` following `policy`; returns the locked state.
    fn wait_completed(&self, target: u64, policy: WaitPolicy) -> MutexGuard<'_, State> {
        match policy {
            WaitPolicy::Block => self.sleep_until_completed(target),
            WaitPolicy::Spin(limit) => self.wait_forecast(target, limit),
        }
    }
}

/// A reference-backend stream. Dropping the last handle lets the worker finish the queued work
/// and exit.
#[derive(Clone)]
pub struct RefStream(Arc<Handle>);

struct Handle {
    shared: Arc<Shared>,
    worker: Option<JoinHandle<()>>,
}

impl Drop for Handle {
    fn drop(&mut self) {
        self.shared.lock().closing = true;
        self.shared.changed.notify_all();
        if let Some(worker) = self.worker.take() {
            // The last handle can be dropped on the worker itself (a host function that owned
            // it); that thread exits on its own once `closing` is seen, and cannot join itself.
            if worker.thread().id() != std::thread::current().id() {
                // Work queued before the drop still completes; a worker that panicked has
                // already recorded its failure, so the join result carries nothing new.
                let _ = worker.join();
            }
        }
    }
}

impl std::fmt::Debug for RefStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RefStream({})", self.0.shared.id)
    }
}

impl StreamHandle for RefStream {
    fn id(&self) -> StreamId {
        self.0.shared.id
    }
}

impl RefStream {
    pub(crate) fn spawn(
        id: StreamId,
        exec: Exec,
        wait: WaitPolicy,
        jitter: Option<Jitter>,
        timeline: Option<Arc<Recorder>>,
    ) -> Result<Self> {
        let shared = Arc::new(Shared {
            id,
            state: Mutex::new(State {
                queue: VecDeque::new(),
                enqueued: 0,
                completed: 0,
                error: None,
                closing: false,
                wake_at: u64::MAX,
                running: None,
            }),
            changed: Condvar::new(),
            completed: AtomicU64::new(0),
            progress: Arc::new(Progress::new()),
        });
        let worker_shared = Arc::clone(&shared);
        let worker = std::thread::Builder::new()
            .name(format!("kda-ref-{id}"))
            .spawn(move || run_worker(&worker_shared, &exec, wait, jitter, timeline.as_deref()))
            .map_err(|e| Error::Backend {
                backend: "reference",
                message: format!("cannot start the worker thread of stream {id}: {e}"),
            })?;
        Ok(Self(Arc::new(Handle { shared, worker: Some(worker) })))
    }

    fn shared(&self) -> &Arc<Shared> {
        &self.0.shared
    }

    fn push(&self, item: Item) {
        let shared = self.shared();
        let mut state = shared.lock();
        state.queue.push_back(item);
        state.enqueued += 1;
        drop(state);
        shared.changed.notify_all();
    }

    /// Queue `op`; `label` is kept only when the timeline records it.
    pub(crate) fn submit(&self, op: Validated<ReferenceBackend>, label: Option<&str>) {
        self.push(Item::Op(Box::new(op), label.map(Box::from)));
    }

    /// Queue a wait for `snapshot` (nothing to do if it names this very stream).
    pub(crate) fn wait_for(&self, snapshot: &Snapshot) {
        if !Arc::ptr_eq(&snapshot.stream, self.shared()) {
            self.push(Item::Wait {
                upstream: Arc::clone(&snapshot.stream),
                target: snapshot.target,
            });
        }
    }

    /// The work queued so far, as an event snapshot.
    pub(crate) fn snapshot(&self) -> Snapshot {
        let target = self.shared().lock().enqueued;
        Snapshot { stream: Arc::clone(self.shared()), target }
    }

    /// Block until everything queued so far has finished; report and clear a pending failure.
    pub(crate) fn synchronize(&self) -> Result<()> {
        let shared = self.shared();
        let target = shared.lock().enqueued;
        let mut state = shared.sleep_until_completed(target);
        match state.error.take() {
            Some((_, error)) => Err(error),
            None => Ok(()),
        }
    }
}

/// An event's most recent record: "the first `target` items of `stream`".
#[derive(Clone)]
pub(crate) struct Snapshot {
    stream: Arc<Shared>,
    target: u64,
}

/// A reference-backend event.
#[derive(Clone)]
pub struct RefEvent(pub(crate) Arc<EventState>);

pub(crate) struct EventState {
    pub(crate) id: EventId,
    pub(crate) last: Mutex<Option<Snapshot>>,
}

impl std::fmt::Debug for RefEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RefEvent({})", self.0.id)
    }
}

impl EventHandle for RefEvent {
    fn id(&self) -> EventId {
        self.0.id
    }
}

impl RefEvent {
    pub(crate) fn new(id: EventId) -> Self {
        Self(Arc::new(EventState { id, last: Mutex::new(None) }))
    }

    pub(crate) fn set(&self, snapshot: Snapshot) {
        *self.0.last.lock().unwrap_or_else(PoisonError::into_inner) = Some(snapshot);
    }

    pub(crate) fn get(&self) -> Option<Snapshot> {
        self.0.last.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }
}

fn run_worker(
    shared: &Shared,
    exec: &Exec,
    wait: WaitPolicy,
    jitter: Option<Jitter>,
    timeline: Option<&Recorder>,
) {
    let mut rng = jitter.map(|j| (ChaCha8Rng::seed_from_u64(j.seed ^ shared.id.index), j.max));
    let mut forecast = Forecast::default();
    progress::install(Arc::clone(&shared.progress));
    loop {
        let (item, seq, signature) = {
            let mut state = shared.wait_until(|s| !s.queue.is_empty() || s.closing);
            let Some(item) = state.queue.pop_front() else { return };
            // Published with the pop, so a waiter never sees this op running without its
            // forecast (and polls through it).
            let signature = match &item {
                Item::Op(op, _) if wait != WaitPolicy::Block => Some(Forecast::signature(op.op())),
                _ => None,
            };
            shared.progress.reset();
            state.running =
                signature.map(|s| Running { start: Instant::now(), expected: forecast.expect(s) });
            (item, state.completed + 1, signature)
        };
        if let Some((rng, max)) = rng.as_mut() {
            let micros = rng.random_range(0..=max.as_micros() as u64);
            std::thread::sleep(Duration::from_micros(micros));
        }
        let start = Instant::now();
        let failure = run_item(shared, item, seq, exec, wait, timeline);
        if let Some(signature) = signature {
            forecast.learn(signature, start.elapsed());
        }
        let mut state = shared.lock();
        state.running = None;
        if let Some(error) = failure {
            state.error.get_or_insert((seq, error));
        }
        if let Some(timeline) = timeline {
            timeline.finished(shared.id, seq);
        }
        state.completed = seq;
        // Published after the error, under the lock: a poller that sees `seq` and then takes
        // the lock finds the error of item `seq` too.
        shared.completed.store(seq, Ordering::Release);
        let wake = seq >= state.wake_at;
        if wake {
            state.wake_at = u64::MAX;
        }
        drop(state);
        if wake {
            shared.changed.notify_all();
        }
    }
}

/// Run one item; returns the failure to record, if any.
fn run_item(
    shared: &Shared,
    item: Item,
    seq: u64,
    exec: &Exec,
    wait: WaitPolicy,
    timeline: Option<&Recorder>,
) -> Option<Error> {
    match item {
        Item::Wait { upstream, target } => {
            let state = upstream.wait_completed(target, wait);
            if let Some(timeline) = timeline {
                timeline.waited(shared.id, upstream.id, target);
            }
            match &state.error {
                Some((failed_at, error)) if *failed_at <= target => Some(Error::DependencyFailed {
                    stream: shared.id,
                    upstream: upstream.id,
                    message: error.to_string(),
                }),
                _ => None,
            }
        }
        // After a failure, ops are skipped until `synchronize` reports it.
        Item::Op(..) if shared.lock().error.is_some() => None,
        Item::Op(op, label) => {
            let name = op.op().name();
            let _span = tracing::debug_span!("op", name, stream = %shared.id, seq).entered();
            let start = Instant::now();
            let outcome = catch_unwind(AssertUnwindSafe(|| kernels::execute(&op, exec)))
                .unwrap_or_else(|panic| Err(format!("kernel panicked: {}", panic_message(&panic))));
            if let (Some(timeline), Some(label)) = (timeline, label) {
                timeline.push(shared.id, &label, start, Instant::now());
            }
            outcome.err().map(|message| Error::OpFailed {
                op: name.to_string(),
                stream: shared.id,
                message,
            })
        }
    }
}

fn panic_message(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "test setup")]

    use kda_core::{DType, Device, Op};

    use super::*;

    fn gemm(b: &Device<ReferenceBackend>, m: usize) -> Op<ReferenceBackend> {
        let x = b.alloc(DType::BF16, &[m, 8]).unwrap();
        let w = b.alloc(DType::BF16, &[4, 8]).unwrap();
        let y = b.alloc(DType::F32, &[m, 4]).unwrap();
        Op::Gemm { x, w, y }
    }

    #[test]
    fn forecasts_are_per_kind_of_op() {
        let b = ReferenceBackend::new();
        let mut forecast = Forecast::default();
        let [small, other_small, large] =
            [gemm(&b, 2), gemm(&b, 2), gemm(&b, 3)].map(|op| Forecast::signature(&op));
        assert_eq!(small, other_small, "the same shapes on other buffers are the same kind");
        assert_ne!(small, large, "another shape is another kind");
        forecast.learn(small, Duration::from_millis(7));
        assert_eq!(forecast.expect(other_small), Some(Duration::from_millis(7)));
        assert_eq!(forecast.expect(large), None);
        forecast.learn(small, Duration::from_millis(9));
        assert_eq!(forecast.expect(small), Some(Duration::from_millis(9)), "the latest duration");
    }

    #[test]
    fn progress_outranks_history_in_the_forecast() {
        let start = Instant::now();
        let expected = Some(Duration::from_millis(40));
        let running = Running { start, expected };
        let progress = Arc::new(Progress::new());
        assert_eq!(running.forecast_end(&progress), Some(start + Duration::from_millis(40)));
        assert_eq!(Running { start, expected: None }.forecast_end(&progress), None);
        std::thread::sleep(Duration::from_millis(2));
        progress::install(Arc::clone(&progress));
        progress::report(1, 2);
        let end = running.forecast_end(&progress).unwrap();
        // Half done after about 2 ms: about 4 ms in all, not the 40 ms of last time.
        assert!(end < start + Duration::from_millis(20), "{:?}", end - start);
        assert!(end >= start + Duration::from_millis(4), "{:?}", end - start);
    }
}
