//! The façade's recorder: checked mode (every call logged and analysed online, see
//! [`crate::sanitize`]) and graph capture, per backend instance.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

use super::capture::Capture;
use crate::error::{CaptureError, Error, Result};
use crate::graph::Graph;
use crate::hal::Validated;
use crate::resource::{BufferHandle, BufferId, EventId, InstanceId, Resources, StreamId};
use crate::sanitize::{Access, Analyzer, ByteRanges, Entry, ExclusiveUnits, Hazard};

/// One backend instance's recorder, analyser and capture state.
pub struct Instrumentation<B: Resources> {
    checked: bool,
    /// `checked` or a capture is open: the only thing the fast path reads.
    active: AtomicBool,
    state: Mutex<State<B>>,
}

struct State<B: Resources> {
    analyzer: Analyzer,
    log: Vec<Entry>,
    hazards: Vec<Hazard>,
    capture: Option<Capture<B>>,
}

impl<B: Resources> std::fmt::Debug for Instrumentation<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Instrumentation").field("checked", &self.checked).finish_non_exhaustive()
    }
}

impl<B: Resources> Instrumentation<B> {
    pub fn new(checked: bool) -> Self {
        Self {
            checked,
            active: AtomicBool::new(checked),
            state: Mutex::new(State {
                analyzer: Analyzer::new(),
                log: Vec::new(),
                hazards: Vec::new(),
                capture: None,
            }),
        }
    }

    /// Turn the exclusive-unit rules on or off for the calls recorded from now on (checked mode
    /// only). A backend whose streams share matrix units sets
    /// [`ExclusiveUnits::from_capabilities`] when it is built; tests set it explicitly.
    pub fn set_exclusive_units(&self, units: ExclusiveUnits) {
        self.lock().analyzer.set_exclusive_units(units);
    }

    /// The exclusive-unit rules in force.
    pub fn exclusive_units(&self) -> ExclusiveUnits {
        self.lock().analyzer.exclusive_units()
    }

    pub fn is_checked(&self) -> bool {
        self.checked
    }

    /// Whether any verb needs the slow path.
    pub fn is_active(&self) -> bool {
        self.active.load(Ordering::Relaxed)
    }

    fn lock(&self) -> MutexGuard<'_, State<B>> {
        // Every update leaves the state consistent, so a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The log recorded so far (empty unless checked).
    pub fn log(&self) -> Vec<Entry> {
        self.lock().log.clone()
    }

    /// Every hazard found so far.
    pub fn hazards(&self) -> Vec<Hazard> {
        self.lock().hazards.clone()
    }

    /// Append an entry in checked mode and analyse it; the first hazard is returned as an error.
    fn note(&self, state: &mut State<B>, entry: Entry) -> Result<()> {
        if !self.checked {
            return Ok(());
        }
        let hazards = state.analyzer.push(&entry);
        state.log.push(entry);
        for h in &hazards {
            tracing::error!("{h}");
        }
        let first = hazards.first().cloned();
        state.hazards.extend(hazards);
        match first {
            Some(h) => Err(Error::Hazard(Box::new(h))),
            None => Ok(()),
        }
    }

    /// A launch: captured, or recorded and (when hazard-free) submitted.
    pub(crate) fn launch(
        &self,
        stream: StreamId,
        label: &str,
        op: Validated<B>,
        submit: impl FnOnce(Validated<B>) -> Result<()>,
    ) -> Result<()> {
        let mut state = self.lock();
        if let Some(capture) = state.capture.as_mut().filter(|c| c.is_captured(stream)) {
            capture.launch(stream, label, op);
            return Ok(());
        }
        let access = |(param, t): (&'static str, &crate::tensor::Tensor<B>)| Access {
            param,
            buffer: t.buffer().id(),
            bytes: ByteRanges::of(t.layout()),
        };
        let entry = Entry::Launch {
            stream,
            label: label.to_string(),
            reads: op.op().inputs().into_iter().map(access).collect(),
            writes: op.op().outputs().into_iter().map(access).collect(),
            unit: op.op().unit(),
            flops: op.dims().flops(),
        };
        self.note(&mut state, entry)?;
        // Submitting under the lock keeps the log in the order the streams receive the work.
        submit(op)
    }

    pub(crate) fn record(
        &self,
        event: EventId,
        stream: StreamId,
        raw: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        let mut state = self.lock();
        if let Some(capture) = state.capture.as_mut() {
            if capture.is_captured(stream) {
                capture.record(event, stream);
                return Ok(());
            }
            capture.forget_event(event);
        }
        raw()?;
        self.note(&mut state, Entry::Record { stream, event })
    }

    pub(crate) fn wait(
        &self,
        stream: StreamId,
        event: EventId,
        raw: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        let mut state = self.lock();
        if let Some(capture) = state.capture.as_mut()
            && (capture.is_captured(stream) || capture.is_captured_event(event))
        {
            capture.wait(stream, event);
            return Ok(());
        }
        raw()?;
        self.note(&mut state, Entry::Wait { stream, event })
    }

    /// A host block on `stream` (`call` names it: "synchronize", "download").
    pub(crate) fn synchronize(
        &self,
        stream: StreamId,
        call: &'static str,
        raw: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        let mut state = self.lock();
        if let Some(capture) = state.capture.as_mut().filter(|c| c.is_captured(stream)) {
            return Err(capture.host_sync(stream, call).into());
        }
        // Logged before blocking, without holding the lock while blocked (a host function on
        // the stream may itself call the backend): later calls of this thread come after it.
        self.note(&mut state, Entry::Synchronize { stream })?;
        drop(state);
        raw()
    }

    pub(crate) fn alloc(&self, buffer: BufferId, bytes: usize) {
        let mut state = self.lock();
        // An allocation cannot conflict with anything, so `note` cannot fail here.
        let _ = self.note(&mut state, Entry::Alloc { buffer, bytes });
    }

    /// A buffer handed out on the memory of a freed one (by a caching allocator).
    pub(crate) fn reuse(&self, buffer: BufferId, previous: BufferId) -> Result<()> {
        let mut state = self.lock();
        self.note(&mut state, Entry::Reuse { buffer, previous })
    }

    pub(crate) fn free(
        &self,
        stream: StreamId,
        buffer: BufferId,
        raw: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        let mut state = self.lock();
        if let Some(capture) = state.capture.as_mut().filter(|c| c.is_captured(stream)) {
            return Err(capture.free(stream).into());
        }
        self.note(&mut state, Entry::Free { stream, buffer })?;
        raw()
    }

    pub(crate) fn begin_capture(&self, stream: StreamId) -> Result<()> {
        let mut state = self.lock();
        if let Some(open) = &state.capture {
            return Err(CaptureError::AlreadyCapturing { stream, origin: open.origin() }.into());
        }
        state.capture = Some(Capture::new(stream));
        self.active.store(true, Ordering::Relaxed);
        Ok(())
    }

    pub(crate) fn end_capture(&self, stream: StreamId, instance: InstanceId) -> Result<Graph<B>> {
        let mut state = self.lock();
        match state.capture.take() {
            Some(capture) if capture.origin() == stream => {
                self.active.store(self.checked, Ordering::Relaxed);
                Ok(capture.finish(instance)?)
            }
            other => {
                state.capture = other;
                Err(CaptureError::NotCapturing { stream }.into())
            }
        }
    }
}
