//! The emulated device's streams, events and captured models, in the emulator's own code.
//!
//! A stream is a worker thread running its queued tasks in submission order (hicann/runtime
//! `hicann/runtime/docs/zh/api_ref/07_event_management.md`: work on one stream runs in order, an
//! event's completion means every task recorded before it has run). An event record is a count
//! of the tasks its stream had been given; a wait queues, on the waiting stream, a task that
//! blocks until the recorded stream has completed that many. A failed task fails its stream: its
//! later tasks are skipped and the failure is reported by the next synchronize; a stream that
//! waits past a failed task of another stream fails too (the failure it depends on). Capture
//! records, instead of running, what is queued on the streams of the capture, and a model
//! replays the recorded tasks in the order they were captured (an order every recorded
//! dependency already respects) as one task of the stream it is executed on.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};

use kda_core::HostFn;

/// Why a stream's work stopped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Failure {
    /// One of its own tasks failed: the task's name and error.
    Own { task: &'static str, message: String },
    /// It waited past a failed task of another stream.
    Upstream { message: String },
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Own { task, message } => write!(f, "{task} failed: {message}"),
            Self::Upstream { message } => write!(f, "a stream it waits on failed: {message}"),
        }
    }
}

enum Item {
    Run { name: &'static str, f: HostFn },
    Wait { on: Arc<Shared>, mark: u64 },
}

#[derive(Default)]
struct State {
    queue: VecDeque<Item>,
    /// Items given to the stream so far, and items done (run, waited or skipped).
    submitted: u64,
    completed: u64,
    /// The first failure not yet reported, and the item count at which it happened.
    failure: Option<(Failure, u64)>,
    /// Failures already reported by a synchronize: the failure, the item count at which it
    /// happened and the count at its report (every item in between failed or was skipped). A
    /// wait on a position inside such a span still fails, whenever it runs.
    reported: Vec<(Failure, u64, u64)>,
    /// The last handle is gone: the worker drains the queue and exits.
    closed: bool,
}

#[derive(Default)]
struct Shared {
    state: Mutex<State>,
    changed: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn wait<'a>(&self, guard: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        self.changed.wait(guard).unwrap_or_else(PoisonError::into_inner)
    }
}

/// The worker: one item at a time, in order.
fn work(shared: &Arc<Shared>) {
    loop {
        let (item, failed) = {
            let mut s = shared.lock();
            loop {
                if let Some(item) = s.queue.pop_front() {
                    break (item, s.failure.is_some());
                }
                if s.closed {
                    return;
                }
                s = shared.wait(s);
            }
        };
        let outcome = if failed {
            None
        } else {
            match item {
                Item::Run { name, f } => {
                    f.call().err().map(|message| Failure::Own { task: name, message })
                }
                Item::Wait { on, mark } => {
                    let mut s = on.lock();
                    while s.completed < mark {
                        s = on.wait(s);
                    }
                    let reported =
                        s.reported.iter().find(|(_, at, end)| *at < mark && mark <= *end);
                    match (&s.failure, reported) {
                        (Some((f, at)), _) if *at < mark => {
                            Some(Failure::Upstream { message: f.to_string() })
                        }
                        (_, Some((f, _, _))) => Some(Failure::Upstream { message: f.to_string() }),
                        _ => None,
                    }
                }
            }
        };
        let mut s = shared.lock();
        if let Some(f) = outcome
            && s.failure.is_none()
        {
            let at = s.completed;
            s.failure = Some((f, at));
        }
        s.completed += 1;
        drop(s);
        shared.changed.notify_all();
    }
}

/// Closes the stream when the last handle goes.
struct Owner(Arc<Shared>);

impl Drop for Owner {
    fn drop(&mut self) {
        self.0.lock().closed = true;
        self.0.changed.notify_all();
    }
}

/// A stream handle; clones share the stream.
#[derive(Clone)]
pub(crate) struct Stream {
    owner: Arc<Owner>,
    /// The emulator's handle of the stream (what captures and models name it by).
    pub key: usize,
}

impl Stream {
    /// A new stream and its worker thread.
    pub(crate) fn new(key: usize) -> std::io::Result<Self> {
        let shared = Arc::new(Shared::default());
        let worker = Arc::clone(&shared);
        std::thread::Builder::new()
            .name(format!("acl-emu-stream-{key:#x}"))
            .spawn(move || work(&worker))?;
        Ok(Self { owner: Arc::new(Owner(shared)), key })
    }

    fn shared(&self) -> &Arc<Shared> {
        &self.owner.0
    }

    fn push(&self, item: Item) {
        let mut s = self.shared().lock();
        s.queue.push_back(item);
        s.submitted += 1;
        drop(s);
        self.shared().changed.notify_all();
    }

    /// Queue `f` under `name`.
    pub(crate) fn run(&self, name: &'static str, f: HostFn) {
        self.push(Item::Run { name, f });
    }

    /// An event record: the stream's position now.
    pub(crate) fn mark(&self) -> Mark {
        Mark { on: Arc::clone(self.shared()), at: self.shared().lock().submitted }
    }

    /// Queue a wait for `mark` (an event recorded on any stream).
    pub(crate) fn wait(&self, mark: &Mark) {
        self.push(Item::Wait { on: Arc::clone(&mark.on), mark: mark.at });
    }

    /// Block until everything queued so far has been done; the failure that stopped the stream
    /// since the last synchronize, if any (taken: the stream runs what is queued after it).
    pub(crate) fn synchronize(&self) -> Result<(), Failure> {
        let shared = self.shared();
        let mut s = shared.lock();
        while s.completed < s.submitted {
            s = shared.wait(s);
        }
        match s.failure.take() {
            Some((f, at)) => {
                let end = s.completed;
                s.reported.push((f.clone(), at, end));
                Err(f)
            }
            None => Ok(()),
        }
    }
}

/// Where an event was recorded: a stream and its count of tasks at the record.
#[derive(Clone)]
pub(crate) struct Mark {
    on: Arc<Shared>,
    at: u64,
}

/// One task of a capture: which stream it was queued on, what it does.
enum Captured {
    Run {
        name: &'static str,
        f: HostFn,
    },
    /// A record of an event on the stream (which event: `Capture::records`).
    Record,
    /// A wait of the stream on an event recorded inside the capture.
    Wait {
        event: usize,
    },
}

/// Why a capture cannot end as a model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Unjoined {
    /// A stream of the capture has work the origin never waited for.
    NotJoined { stream: usize },
}

/// An open capture: what each of its streams queued, in call order.
pub(crate) struct Capture {
    pub origin: usize,
    members: HashSet<usize>,
    items: Vec<(usize, Captured)>,
    /// Events recorded inside the capture: the stream and the item index of the record.
    records: HashMap<usize, (usize, usize)>,
}

impl Capture {
    pub(crate) fn new(origin: usize) -> Self {
        Self {
            origin,
            members: HashSet::from([origin]),
            items: Vec::new(),
            records: HashMap::new(),
        }
    }

    /// Whether work on `stream` is captured.
    pub(crate) fn holds(&self, stream: usize) -> bool {
        self.members.contains(&stream)
    }

    pub(crate) fn run(&mut self, stream: usize, name: &'static str, f: HostFn) {
        self.items.push((stream, Captured::Run { name, f }));
    }

    pub(crate) fn record(&mut self, stream: usize, event: usize) {
        self.records.insert(event, (stream, self.items.len()));
        self.items.push((stream, Captured::Record));
    }

    /// A wait on an event recorded inside the capture: `stream` joins the capture.
    pub(crate) fn wait(&mut self, stream: usize, event: usize) {
        self.members.insert(stream);
        self.items.push((stream, Captured::Wait { event }));
    }

    /// The model, when every stream of the capture is joined back: the origin waited on an
    /// event recorded on it after its last task (hicann/runtime
    /// `include/external/acl/error_codes/rt_error_codes.h`, `ACL_ERROR_RT_STREAM_UNJOINED`).
    pub(crate) fn end(self) -> Result<Model, Unjoined> {
        for &stream in &self.members {
            if stream == self.origin {
                continue;
            }
            let last_work = self.items.iter().rposition(|(s, i)| {
                *s == stream && matches!(i, Captured::Run { .. } | Captured::Wait { .. })
            });
            let joined = self.items.iter().enumerate().any(|(at, (s, i))| match i {
                Captured::Wait { event } if *s == self.origin => {
                    self.records.get(event).is_some_and(|&(rs, ri)| {
                        rs == stream && last_work.is_none_or(|w| ri > w) && ri < at
                    })
                }
                _ => false,
            });
            if !joined {
                return Err(Unjoined::NotJoined { stream });
            }
        }
        let tasks = self
            .items
            .into_iter()
            .filter_map(|(_, i)| match i {
                Captured::Run { name, f } => Some((name, f)),
                Captured::Record | Captured::Wait { .. } => None,
            })
            .collect();
        Ok(Model { tasks: Arc::new(tasks) })
    }
}

/// A captured model: its tasks in capture order.
#[derive(Clone)]
pub(crate) struct Model {
    tasks: Arc<Vec<(&'static str, HostFn)>>,
}

impl Model {
    /// The whole model as one task: each captured task in order, stopping at the first failure
    /// (named after the task that failed, as the runtime's report names the kernel).
    pub(crate) fn replay(&self) -> HostFn {
        let tasks = Arc::clone(&self.tasks);
        HostFn::new(move || {
            for (name, f) in tasks.iter() {
                f.call().map_err(|e| format!("{name} failed: {e}"))?;
            }
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn push(log: &Arc<Mutex<Vec<usize>>>, v: usize) -> HostFn {
        let log = Arc::clone(log);
        HostFn::new(move || {
            log.lock().unwrap_or_else(PoisonError::into_inner).push(v);
            Ok(())
        })
    }

    /// A stream runs its tasks in order; a wait orders another stream after a record.
    #[test]
    fn tasks_run_in_order_and_waits_order_streams() {
        let (a, b) = (Stream::new(1).expect("stream"), Stream::new(2).expect("stream"));
        let log = Arc::new(Mutex::new(Vec::new()));
        let gate = Arc::new(AtomicUsize::new(0));
        let g = Arc::clone(&gate);
        // `a` is held back until the test lets it go: `b`'s task must still come after it.
        a.run(
            "slow",
            HostFn::new(move || {
                while g.load(Ordering::Acquire) == 0 {
                    std::thread::yield_now();
                }
                Ok(())
            }),
        );
        a.run("a1", push(&log, 1));
        let mark = a.mark();
        b.wait(&mark);
        b.run("b2", push(&log, 2));
        gate.store(1, Ordering::Release);
        assert_eq!(b.synchronize(), Ok(()));
        assert_eq!(a.synchronize(), Ok(()));
        assert_eq!(*log.lock().unwrap_or_else(PoisonError::into_inner), vec![1, 2]);
    }

    /// A failed task skips its stream's later tasks and fails a stream that waits past it.
    #[test]
    fn a_failure_skips_later_tasks_and_reaches_waiting_streams() {
        let (a, b) = (Stream::new(1).expect("stream"), Stream::new(2).expect("stream"));
        let log = Arc::new(Mutex::new(Vec::new()));
        a.run("broken", HostFn::new(|| Err("boom".into())));
        a.run("after", push(&log, 1));
        b.wait(&a.mark());
        b.run("dependent", push(&log, 2));
        let own = Failure::Own { task: "broken", message: "boom".into() };
        assert_eq!(a.synchronize(), Err(own.clone()));
        assert_eq!(b.synchronize(), Err(Failure::Upstream { message: own.to_string() }));
        assert!(log.lock().unwrap_or_else(PoisonError::into_inner).is_empty());
    }

    /// A capture ends only with its forked stream joined back, and its model replays the
    /// captured tasks in capture order.
    #[test]
    fn a_capture_needs_the_join_and_replays_in_order() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let capture = |join: bool| {
            let mut c = Capture::new(1);
            c.run(1, "t1", push(&log, 1));
            c.record(1, 100);
            c.wait(2, 100);
            c.run(2, "t2", push(&log, 2));
            c.record(2, 101);
            if join {
                c.wait(1, 101);
            }
            c.run(1, "t3", push(&log, 3));
            c.end()
        };
        assert_eq!(capture(false).err(), Some(Unjoined::NotJoined { stream: 2 }));
        let model = capture(true).unwrap_or_else(|e| panic!("{e:?}"));
        let s = Stream::new(3).expect("stream");
        s.run("model", model.replay());
        s.run("model", model.replay());
        assert_eq!(s.synchronize(), Ok(()));
        assert_eq!(*log.lock().unwrap_or_else(PoisonError::into_inner), vec![1, 2, 3, 1, 2, 3]);
    }
}
