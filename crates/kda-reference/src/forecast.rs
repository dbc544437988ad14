//! The opt-in waiter of one-core-per-stream mode ([`WaitStrategy::Forecast`](crate::WaitStrategy)):
//! a worker waiting on another stream starts within microseconds of the awaited completion
//! without slowing the op it waits for.
//!
//! Why it exists (measured on the 2-vCPU development VM, K3 TP8 projection shapes, medians):
//! - plain sleeping on a condition variable costs one futex wake-up (50–70 µs here) per wait,
//!   enough to leave the BFG post-process *unhidden* at small T (hidden vector fraction 0.892 vs
//!   0.984 at T ∈ {1, 16}, 20 rounds): the vector work then runs before the QKV GEMM on the
//!   other stream starts instead of under it;
//! - polling through the whole awaited GEMM instead slows that GEMM: the T = 16 BFG GEMM alone
//!   31.0 ms, with a pause+yield poller on the other vCPU 34.6 ms (+12 %);
//! - sleeping through the forecast part and polling only the last 300 µs keeps both: hidden
//!   vector fraction 1.000 at T = 1, 16, 128 and 0.999 at 1024, and the serialised overlapped
//!   schedule at 0.999 of serial at T = 1 (300 rounds, `kda bench schedule`).
//!
//! It matters only for timing the schedules on a CPU, so it is off by default (waiters sleep)
//! and `kda run`, `kda trace` and `kda bench` turn it on. The worker running the awaited op
//! publishes when it started, how long the same kind of op took last time ([`Forecast`]) and
//! how far it has got (`crate::progress`); the waiter sleeps half the forecast remainder at a
//! time until the end is near, then polls.

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::MutexGuard;
use std::sync::PoisonError;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use kda_core::Op;

use crate::ReferenceBackend;
use crate::progress::Progress;
use crate::stream::{Shared, State};

/// How long, in all, a waiter polls during one wait before it sleeps. It polls only through
/// the tail of an op with a forecast, but through the whole of an op seen for the first time:
/// long enough for a projection GEMM at decode and small-prefill sizes; bounded, so a long wait
/// in an oversubscribed run still sleeps.
pub(crate) const SPIN_LIMIT: Duration = Duration::from_millis(50);

/// The op a worker is running: when it started, and how long this kind of op took last time.
#[derive(Copy, Clone, Debug)]
pub(crate) struct Running {
    pub(crate) start: Instant,
    pub(crate) expected: Option<Duration>,
}

/// A waiter polls once the awaited op is forecast to end within this; before, it sleeps. A
/// timed sleep overshoots by tens of microseconds, and waking a halted vCPU takes as long again.
const POLL_WINDOW: Duration = Duration::from_micros(300);

impl Running {
    /// When the op will end: extrapolated from its progress once it reports any, else from how
    /// long the same kind of op took last time; `None` when neither is known.
    pub(crate) fn forecast_end(&self, progress: &Progress) -> Option<Instant> {
        progress.forecast_end(self.start).or_else(|| self.expected.map(|e| self.start + e))
    }
}

/// How long each kind of op (its name, operand shapes and dtypes) last took on one stream.
#[derive(Default)]
pub(crate) struct Forecast(HashMap<u64, Duration>);

/// Kinds remembered at most; a stream that sees more starts over.
const MAX_FORECASTS: usize = 4096;

impl Forecast {
    pub(crate) fn signature(op: &Op<ReferenceBackend>) -> u64 {
        let mut h = DefaultHasher::new();
        op.name().hash(&mut h);
        for (param, t) in op.inputs().into_iter().chain(op.outputs()) {
            (param, t.shape(), t.dtype()).hash(&mut h);
        }
        h.finish()
    }

    pub(crate) fn expect(&self, signature: u64) -> Option<Duration> {
        self.0.get(&signature).copied()
    }

    pub(crate) fn learn(&mut self, signature: u64, took: Duration) {
        if self.0.len() >= MAX_FORECASTS {
            self.0.clear();
        }
        self.0.insert(signature, took);
    }
}

impl Shared {
    /// Wait until `completed >= target`: sleep through the forecast part of the running op, poll
    /// through its last moments, for up to `limit` of polling in all; returns the locked state.
    pub(crate) fn wait_forecast(&self, target: u64, limit: Duration) -> MutexGuard<'_, State> {
        let mut polled = Duration::ZERO;
        loop {
            // While the running op is forecast to go on for longer than the poll window, sleep
            // half the remainder (at most up to the window) and forecast again from fresher
            // progress; a completion of `target` (registered in `wake_at`) still wakes the
            // sleeper at once.
            let mut state = self.lock();
            let (seen, seen_progress) = loop {
                if state.completed >= target {
                    return state;
                }
                let now = Instant::now();
                let end = state.running.and_then(|r| r.forecast_end(&self.progress));
                match end.map(|end| end.saturating_duration_since(now)) {
                    Some(left) if left > POLL_WINDOW => {
                        state.wake_at = state.wake_at.min(target);
                        state = self
                            .changed
                            .wait_timeout(state, (left / 2).min(left - POLL_WINDOW))
                            .unwrap_or_else(PoisonError::into_inner)
                            .0;
                    }
                    _ => break (state.completed, self.progress.snapshot()),
                }
            };
            drop(state);
            if polled >= limit {
                return self.sleep_until_completed(target);
            }
            // Poll until `target` completes, or something changes that may give a forecast to
            // sleep by (an earlier item completes, the op reports progress), or the polling
            // budget is spent.
            let start = Instant::now();
            loop {
                let completed = self.completed.load(Ordering::Acquire);
                if completed >= target {
                    return self.lock();
                }
                let changed = completed != seen || self.progress.snapshot() != seen_progress;
                if changed || polled + start.elapsed() >= limit {
                    break;
                }
                // A few microseconds of pause instructions between yields: few system calls,
                // and little taken from a sibling hardware thread running the other stream.
                for _ in 0..64 {
                    std::hint::spin_loop();
                }
                std::thread::yield_now();
            }
            polled += start.elapsed();
        }
    }
}
