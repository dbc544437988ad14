//! Optional op timing ([`crate::ReferenceOptions::timeline`]): each executed op's stream, label,
//! start and end, relative to the backend's creation; and each satisfied cross-stream wait.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use kda_core::StreamId;
use kda_core::timeline::{Span, Timeline, WaitEdge};

/// Where stream workers leave their spans.
#[derive(Debug)]
pub(crate) struct Recorder {
    epoch: Instant,
    log: Mutex<Log>,
}

#[derive(Debug, Default)]
struct Log {
    spans: Vec<Span>,
    waits: Vec<WaitEdge>,
    /// When each stream finished its item number `n` (1-based, as the workers count), so a
    /// wait can name the moment its dependency was met.
    finished: HashMap<(StreamId, u64), Duration>,
}

impl Recorder {
    pub(crate) fn new() -> Self {
        Self { epoch: Instant::now(), log: Mutex::new(Log::default()) }
    }

    fn log(&self) -> MutexGuard<'_, Log> {
        // Every update is a single push or insert, so a poisoned log is still consistent.
        self.log.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn since_epoch(&self, at: Instant) -> Duration {
        at.saturating_duration_since(self.epoch)
    }

    pub(crate) fn push(&self, stream: StreamId, label: &str, start: Instant, end: Instant) {
        let span = Span {
            stream,
            label: label.to_string(),
            start: self.since_epoch(start),
            end: self.since_epoch(end),
        };
        self.log().spans.push(span);
    }

    /// `stream` finished its item number `seq` now.
    pub(crate) fn finished(&self, stream: StreamId, seq: u64) {
        let now = self.since_epoch(Instant::now());
        self.log().finished.insert((stream, seq), now);
    }

    /// `stream` resumed now after a wait for item `target` of `upstream`; recorded only when
    /// that item finished while recording was on.
    pub(crate) fn waited(&self, stream: StreamId, upstream: StreamId, target: u64) {
        let resumed = self.since_epoch(Instant::now());
        let mut log = self.log();
        if let Some(&satisfied) = log.finished.get(&(upstream, target)) {
            log.waits.push(WaitEdge { upstream, satisfied, stream, resumed });
        }
    }

    pub(crate) fn snapshot(&self) -> Timeline {
        let log = self.log();
        Timeline::with_waits(log.spans.clone(), log.waits.clone())
    }

    pub(crate) fn clear(&self) {
        *self.log() = Log::default();
    }
}
