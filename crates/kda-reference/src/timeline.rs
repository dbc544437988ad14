//! Optional op timing ([`crate::ReferenceOptions::timeline`]): each executed op's stream, label,
//! start and end, relative to the backend's creation.

use std::sync::{Mutex, PoisonError};
use std::time::Instant;

use kda_core::StreamId;
use kda_core::timeline::{Span, Timeline};

/// Where stream workers leave their spans.
#[derive(Debug)]
pub(crate) struct Recorder {
    epoch: Instant,
    spans: Mutex<Vec<Span>>,
}

impl Recorder {
    pub(crate) fn new() -> Self {
        Self { epoch: Instant::now(), spans: Mutex::new(Vec::new()) }
    }

    pub(crate) fn push(&self, stream: StreamId, label: &str, start: Instant, end: Instant) {
        let span = Span {
            stream,
            label: label.to_string(),
            start: start.saturating_duration_since(self.epoch),
            end: end.saturating_duration_since(self.epoch),
        };
        self.spans.lock().unwrap_or_else(PoisonError::into_inner).push(span);
    }

    pub(crate) fn snapshot(&self) -> Timeline {
        Timeline::new(self.spans.lock().unwrap_or_else(PoisonError::into_inner).clone())
    }

    pub(crate) fn clear(&self) {
        self.spans.lock().unwrap_or_else(PoisonError::into_inner).clear();
    }
}
