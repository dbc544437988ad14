//! An engine's `aclrtStream` as a stream of this backend (`kda_core::Device::import_stream`,
//! docs/embedding.md#streams-the-engines-on-a-device): kda queues its work there, never
//! synchronizes it on its own, never destroys it, and releases what that work holds in stream
//! order through `kda_core::device::retention`, marked by events recorded on the stream.
//!
//! While an engine captures a stream (`aclmdlRICaptureGetInfo` says so, for the engine's stream
//! and for kda's auxiliary stream once it has waited on an event recorded inside the capture),
//! nothing on it is synchronized, queried or freed: what the captured work uses is pinned for
//! the stream's life, executors are made repeatable (the engine's model replays them), and
//! work that needs the host at run time (a download, a host function) is refused.

use std::any::Any;
use std::sync::{Arc, Mutex, PoisonError, Weak};

use kda_core::device::retention::{Capture, Retention};
use kda_core::{Error, Result, StreamId};

use super::acl::{RawEvent, RawStream, check};
use super::{AscendBackend, AscendStream, StreamInner};
use crate::error::AscendError;
use crate::sys;

/// What a stream's queued work holds: steps, descriptors, workspaces, staging, events, ops.
pub(crate) type Retained = Box<dyn Any + Send>;

/// A stream's [`Retention`], marked with `ACL_EVENT_CAPTURE_STREAM_PROGRESS` events.
pub(crate) type StreamRetention = Retention<RawEvent, Retained>;

/// The imported streams of one instance (weak: the handles own them).
pub(crate) type Imported = Mutex<Vec<Weak<StreamInner>>>;

/// Whether `stream` is being captured (`aclmdlRICaptureGetInfo`), by an engine or by kda.
pub(crate) fn capture_of(stream: sys::aclrtStream) -> std::result::Result<Capture, AscendError> {
    let mut status = sys::ACL_MODEL_RI_CAPTURE_STATUS_NONE;
    let mut model: sys::aclmdlRI = std::ptr::null_mut();
    // SAFETY: a live stream; both out-parameters are writable.
    check("aclmdlRICaptureGetInfo", unsafe {
        sys::aclmdlRICaptureGetInfo(stream, &mut status, &mut model)
    })?;
    Ok(match status {
        sys::ACL_MODEL_RI_CAPTURE_STATUS_NONE => Capture::None,
        sys::ACL_MODEL_RI_CAPTURE_STATUS_ACTIVE => Capture::Active,
        _ => Capture::Invalidated,
    })
}

/// The error for work that needs the host at run time under an engine's capture.
pub(crate) fn refused(feature: &'static str) -> Error {
    Error::Unsupported { backend: "ascend", feature: feature.into() }
}

fn bad_handle(expected: &str, actual: String) -> Error {
    Error::Param { op: "import_stream", param: "handle", expected: expected.into(), actual }
}

impl StreamInner {
    pub(super) fn retention(&self) -> std::sync::MutexGuard<'_, StreamRetention> {
        self.retention.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// This stream's capture; a stream the runtime cannot answer for is taken as captured (so
    /// nothing is queried or released on it).
    pub(crate) fn capture(&self) -> Capture {
        capture_of(self.raw.get()).unwrap_or(Capture::Invalidated)
    }

    /// Close the open batch behind a progress event recorded now, and drop the batches the
    /// stream has passed (never while it is captured: the caller checks).
    pub(crate) fn release_passed(&self) -> Result<()> {
        let mut retention = self.retention();
        if retention.needs_mark() {
            let event = RawEvent::progress()?;
            event.record(&self.raw)?;
            retention.mark(event);
        }
        let mut failed = None;
        let done = retention.collect(|e| match e.is_complete() {
            Ok(done) => done,
            Err(err) => {
                failed.get_or_insert(err);
                false
            }
        });
        drop(retention);
        drop(done);
        failed.map_or(Ok(()), |e| Err(e.into()))
    }
}

impl AscendBackend {
    /// `Backend::import_stream`: the engine's `aclrtStream`, checked to be a stream the runtime
    /// knows and not being captured (`aclmdlRICaptureGetInfo`); ACL has no call naming a
    /// stream's context, so "of this backend's device" is the caller's contract.
    ///
    /// # Safety
    /// As `kda_core::Device::import_stream`.
    pub(super) unsafe fn import_engine_stream(&self, handle: usize) -> Result<AscendStream> {
        self.enter()?;
        if handle == 0 {
            // The default stream (null) is per thread in ACL: not one stream kda can order on.
            return Err(bad_handle("an aclrtStream the engine created (not null)", "null".into()));
        }
        let raw = handle as sys::aclrtStream;
        let capture = capture_of(raw).map_err(|e| {
            bad_handle("an aclrtStream of this device", format!("stream {handle:#x} ({e})"))
        })?;
        if !capture.allows_release() {
            return Err(bad_handle(
                "a stream that is not being captured (import it, and make one eager call, \
                 before the engine captures)",
                format!("stream {handle:#x}, under capture ({capture:?})"),
            ));
        }
        let id =
            StreamId { instance: self.inner.instance, index: Self::next(&self.inner.next_stream) };
        let stream = Arc::new(StreamInner::new(id, RawStream::borrowed(handle), true));
        let mut imported = self.inner.imported.lock().unwrap_or_else(PoisonError::into_inner);
        imported.retain(|s| s.strong_count() > 0);
        imported.push(Arc::downgrade(&stream));
        Ok(AscendStream { inner: stream })
    }

    /// Whether an engine is capturing one of the streams imported into this instance: then
    /// the allocator queries no reuse event.
    pub(crate) fn engine_capturing(&self) -> bool {
        let imported = self.inner.imported.lock().unwrap_or_else(PoisonError::into_inner);
        imported.iter().filter_map(Weak::upgrade).any(|s| !s.capture().allows_release())
    }
}

#[cfg(all(test, feature = "emulated"))]
#[allow(clippy::expect_used, clippy::unwrap_used, reason = "tests")]
mod tests {
    use kda_core::{DType, Device, Op};

    use super::*;
    use crate::options::AscendOptions;

    /// kda's auxiliary stream, forked from an engine's stream and joined back on every call
    /// (as the overlapped schedule does) and never synchronized: what its work holds is released
    /// in stream order too, so it does not grow with the number of calls.
    #[test]
    fn a_stream_forked_from_an_engines_stream_releases_in_stream_order() {
        let options = AscendOptions { checked: false, ..AscendOptions::default() };
        let b: Device<AscendBackend> = AscendBackend::with_options(options).unwrap();
        let mut raw: sys::aclrtStream = std::ptr::null_mut();
        // SAFETY: a valid out-parameter.
        assert_eq!(unsafe { sys::aclrtCreateStream(&mut raw) }, 0);
        // SAFETY: `raw` outlives `s` (destroyed at the end, after it).
        let s = unsafe { b.import_stream(raw as usize) }.unwrap();
        let aux = b.new_stream().unwrap();
        let (fork, join) = (b.new_event().unwrap(), b.new_event().unwrap());
        let t = b.alloc(DType::F32, &[64]).unwrap();
        for i in 0..20 {
            b.record(&fork, &s).unwrap();
            b.wait(&aux, &fork).unwrap();
            b.launch(&aux, Op::Fill { dst: t.clone(), value: f64::from(i) }).unwrap();
            b.record(&join, &aux).unwrap();
            b.wait(&s, &join).unwrap();
            // SAFETY: the engine's live stream.
            assert_eq!(unsafe { sys::aclrtSynchronizeStream(raw) }, 0);
        }
        let aux = &aux.inner;
        assert!(aux.state().in_flight.is_empty(), "the forked stream's work is not held to a sync");
        // Only the work since the last passed mark is held.
        let held = aux.retention().queued();
        assert!(held <= 8, "{held} items held on the forked stream after 20 calls");
        drop((s, t));
        // SAFETY: created above, destroyed once.
        unsafe { sys::aclrtDestroyStream(raw) };
    }
}
