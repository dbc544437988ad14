//! How far the op a stream's worker is running has got, for waiters on other streams.
//!
//! A kernel that works in parts (GEMM weight blocks, output tiles) calls [`report`] after each;
//! the report lands in the progress of the stream whose worker runs the kernel (the worker
//! installs it in a thread-local), so kernels need no handle. Reports from any other thread (a
//! shared pool's) go nowhere. From the share done and when it was reached, a waiter extrapolates
//! when the op will end ([`Progress::forecast_end`]) and sleeps until just before then.

use std::cell::RefCell;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Fixed-point denominator of the share done (16 bits of the packed state).
const SHARE_ONE: u64 = u16::MAX as u64;
/// The packed state's time field: microseconds since the stream's epoch (48 bits: centuries).
const TIME_BITS: u32 = 48;

/// The progress of one stream's running op: the share done and when it was reported, packed in
/// one word so a reader sees a consistent pair.
#[derive(Debug)]
pub(crate) struct Progress {
    epoch: Instant,
    state: AtomicU64,
}

impl Progress {
    pub(crate) fn new() -> Self {
        Self { epoch: Instant::now(), state: AtomicU64::new(0) }
    }

    /// Forget the previous op's progress (its worker is about to start another).
    pub(crate) fn reset(&self) {
        self.state.store(0, Ordering::Relaxed);
    }

    fn record(&self, done: usize, total: usize) {
        if total == 0 {
            return;
        }
        let share = (done.min(total) as u64 * SHARE_ONE) / total as u64;
        let micros = (self.epoch.elapsed().as_micros() as u64) & ((1 << TIME_BITS) - 1);
        self.state.store(share << TIME_BITS | micros, Ordering::Relaxed);
    }

    /// The packed state, to notice a new report cheaply.
    pub(crate) fn snapshot(&self) -> u64 {
        self.state.load(Ordering::Relaxed)
    }

    /// When an op that started at `start` will end, extrapolated from the latest report at a
    /// constant rate; `None` before the first report.
    pub(crate) fn forecast_end(&self, start: Instant) -> Option<Instant> {
        let state = self.snapshot();
        let share = state >> TIME_BITS;
        if share == 0 {
            return None;
        }
        let reported = self.epoch + Duration::from_micros(state & ((1 << TIME_BITS) - 1));
        let elapsed = reported.checked_duration_since(start)?;
        Some(start + elapsed.mul_f64(SHARE_ONE as f64 / share as f64))
    }
}

thread_local! {
    /// The progress the current thread's reports go to (a stream worker's own).
    static CURRENT: RefCell<Option<Arc<Progress>>> = const { RefCell::new(None) };
}

/// Send this thread's reports to `progress` (a stream worker, once at its start).
pub(crate) fn install(progress: Arc<Progress>) {
    CURRENT.with(|current| *current.borrow_mut() = Some(progress));
}

/// `done` of `total` parts of the running op are finished.
pub(crate) fn report(done: usize, total: usize) {
    CURRENT.with(|current| {
        if let Some(progress) = current.borrow().as_ref() {
            progress.record(done, total);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_end_is_extrapolated_from_the_latest_report() {
        let p = Progress::new();
        let start = Instant::now();
        assert_eq!(p.forecast_end(start), None, "no report yet");
        std::thread::sleep(Duration::from_millis(4));
        p.record(1, 4);
        let reported = p.epoch + Duration::from_micros(p.snapshot() & ((1 << TIME_BITS) - 1));
        let end = p.forecast_end(start).expect("a forecast after a report");
        // A quarter done after `reported - start`: four times that in all (to the microsecond
        // the report keeps, and the 16-bit share).
        let expected = start + (reported - start) * 4;
        let error = end.max(expected) - end.min(expected);
        assert!(error < Duration::from_micros(20), "forecast off by {error:?}");
        p.reset();
        assert_eq!(p.forecast_end(start), None, "reset forgets the report");
    }

    #[test]
    fn reports_reach_only_the_installed_progress() {
        let p = Arc::new(Progress::new());
        report(1, 2);
        assert_eq!(p.snapshot(), 0, "nothing installed on this thread yet");
        let worker = Arc::clone(&p);
        std::thread::spawn(move || {
            install(worker);
            report(1, 2);
        })
        .join()
        .expect("the reporting thread");
        assert_eq!(p.snapshot() >> TIME_BITS, SHARE_ONE / 2);
        report(2, 2);
        assert_eq!(p.snapshot() >> TIME_BITS, SHARE_ONE / 2, "another thread's report");
    }
}
