//! An engine's memory and stream (`docs/embedding.md`, `docs/cuda.md#engine-streams`): a
//! `CUdeviceptr` imported as a buffer (checked against what the driver says of it, never freed
//! by kda), a `CUstream` imported as a stream, and the stream-ordered release of what work on
//! such a stream uses (`kda_core::device::retention`), which never synchronizes, queries or
//! frees while an engine captures.

use std::any::Any;
use std::sync::{Arc, PoisonError};

use cudarc::driver::{CudaEvent as RawEvent, DriverError, result, sys};
use kda_core::Validated;
use kda_core::{Error, Op, Result};

use super::memory::{DeviceMemory, driver, relaxed_capture};
use super::scratch;
use super::{CudaBackend, CudaBuffer, CudaStream};
use crate::CudaError;
use crate::import::{self, MemoryType, PointerInfo, Route};
use kda_core::device::retention::{Capture, Retention};

/// A `CUstream` handle, kda's or an engine's.
#[derive(Copy, Clone, Debug)]
pub(super) struct RawStream(pub(super) sys::CUstream);

// SAFETY: a CUDA stream handle may be used from any thread of the process (the driver
// serialises calls on it); the handle itself is never mutated.
unsafe impl Send for RawStream {}
// SAFETY: as for `Send`.
unsafe impl Sync for RawStream {}

/// What a stream's queued work holds: op clones (their buffers), a capture's scratch and
/// staging, freed buffers.
pub(super) type Held = Box<dyn Any + Send>;

/// A stream's [`Retention`], marked with CUDA events.
pub(super) type StreamRetention = Retention<RawEvent, Held>;

/// `cuEventRecord` of `event` on `stream`.
pub(super) fn record_raw(event: &RawEvent, stream: sys::CUstream) -> Result<(), CudaError> {
    // SAFETY: a live event and a live stream of the current context.
    unsafe { result::event::record(event.cu_event(), stream) }.map_err(driver("cuEventRecord"))
}

/// `cuStreamWaitEvent`: later work on `stream` waits for `event`'s most recent record.
pub(super) fn wait_raw(stream: sys::CUstream, event: &RawEvent) -> Result<(), CudaError> {
    let flags = sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT;
    // SAFETY: a live stream and a live event of the current context.
    unsafe { result::stream::wait_event(stream, event.cu_event(), flags) }
        .map_err(driver("cuStreamWaitEvent"))
}

/// Whether `stream` is being captured into a CUDA graph (by kda or by an engine).
fn capture_of(stream: sys::CUstream) -> Result<Capture, CudaError> {
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: a live stream; `status` receives its capture status.
    unsafe { sys::cuStreamIsCapturing(stream, &mut status) }
        .result()
        .map_err(driver("cuStreamIsCapturing"))?;
    Ok(match status {
        sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE => Capture::None,
        sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE => Capture::Active,
        _ => Capture::Invalidated,
    })
}

/// One `cuPointerGetAttribute` answer of type `T`.
///
/// # Safety
/// `T` is the type the driver writes for `attribute`.
unsafe fn attribute<T: Default>(
    ptr: u64,
    attribute: sys::CUpointer_attribute,
) -> Result<T, DriverError> {
    let mut value = T::default();
    // SAFETY: `value` is a `T`, the type the caller says the driver writes for `attribute`.
    unsafe { sys::cuPointerGetAttribute((&mut value as *mut T).cast(), attribute, ptr) }
        .result()?;
    Ok(value)
}

/// What the driver says of the allocation holding `ptr`.
fn pointer_info(ptr: u64) -> Result<PointerInfo, Error> {
    use sys::CUpointer_attribute::*;
    let unknown = |e: DriverError| Error::Param {
        op: "import_buffer",
        param: "ptr",
        expected: "a CUdeviceptr the CUDA driver knows (cuMemAlloc, a memory pool, managed)".into(),
        actual: format!("{ptr:#x} (cuPointerGetAttribute: {e})"),
    };
    // SAFETY: each attribute's type as the driver API documents it: an unsigned int, an int,
    // a CUdeviceptr and a size_t.
    let info = unsafe {
        PointerInfo {
            memory: MemoryType::from_raw(
                attribute::<u32>(ptr, CU_POINTER_ATTRIBUTE_MEMORY_TYPE).map_err(unknown)?,
            ),
            device_ordinal: attribute::<i32>(ptr, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL)
                .map_err(unknown)?,
            range_start: attribute::<u64>(ptr, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR)
                .map_err(unknown)?,
            range_size: attribute::<usize>(ptr, CU_POINTER_ATTRIBUTE_RANGE_SIZE).map_err(unknown)?
                as u64,
        }
    };
    Ok(info)
}

impl CudaBackend {
    /// `Backend::import_buffer`: the engine's `CUdeviceptr` checked (`crate::import`) and
    /// wrapped; `cuMemFree` is never called on it, `owner` is dropped with the last handle.
    pub(super) fn import_engine_buffer(
        &self,
        ptr: u64,
        len: usize,
        owner: Box<dyn Any + Send + Sync>,
    ) -> Result<CudaBuffer> {
        self.bind()?;
        import::check_pointer(ptr, len)?;
        if len > 0 {
            import::check_allocation(ptr, len, &pointer_info(ptr)?, self.inner.ctx.ordinal())?;
        }
        let inner = &self.inner;
        let index = inner.next_buffer.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(CudaBuffer {
            id: kda_core::BufferId { instance: inner.instance, index },
            memory: Arc::new(DeviceMemory::import(&inner.ctx, ptr, len, owner)),
        })
    }

    /// `Backend::import_stream`: the engine's `CUstream` (0: the legacy default stream), checked
    /// to be of this context and not under capture, with its cuBLAS handle made now, so no
    /// call inside an engine's capture has to make one.
    ///
    /// # Safety
    /// As `kda_core::Device::import_stream`.
    pub(super) unsafe fn import_engine_stream(&self, handle: usize) -> Result<CudaStream> {
        self.bind()?;
        let raw = handle as sys::CUstream;
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        if handle != 0 {
            // SAFETY: the caller promises a live stream; `ctx` receives its context.
            unsafe { sys::cuStreamGetCtx(raw, &mut ctx) }
                .result()
                .map_err(driver("cuStreamGetCtx"))?;
        }
        import::check_stream_context(handle, ctx as usize, self.inner.ctx.cu_ctx() as usize)?;
        if !capture_of(raw)?.allows_release() {
            return Err(Error::Param {
                op: "import_stream",
                param: "handle",
                expected: "a stream that is not being captured (import it, and make one eager \
                           call, before the engine captures)"
                    .into(),
                actual: format!("stream {handle:#x}, under capture"),
            });
        }
        let stream = self.stream_of(raw, None)?;
        self.blas(&stream)?;
        let mut imported = self.inner.imported.lock().unwrap_or_else(PoisonError::into_inner);
        imported.retain(|s| s.strong_count() > 0);
        imported.push(Arc::downgrade(&stream.inner));
        Ok(stream)
    }

    /// Whether an engine is capturing one of the streams imported into this instance: then
    /// nothing is queried or freed (either would invalidate the engine's capture).
    pub(super) fn engine_capturing(&self) -> bool {
        let imported = self.inner.imported.lock().unwrap_or_else(PoisonError::into_inner);
        imported
            .iter()
            .filter_map(std::sync::Weak::upgrade)
            .any(|s| capture_of(s.raw.0).map_or(true, |c| !c.allows_release()))
    }

    /// How an op on `stream` is queued (`crate::import::route`), and the stream's capture.
    fn op_route(&self, stream: &CudaStream, host_work: bool) -> Result<(Route, Capture)> {
        let kda_replay = scratch::capturing();
        let capture = if kda_replay { Capture::None } else { capture_of(stream.raw())? };
        let route = import::route(stream.is_imported(), kda_replay, capture, host_work);
        Ok((route, capture))
    }

    /// Whether `free` on `stream` must go through its retention.
    pub(super) fn retains(&self, stream: &CudaStream) -> Result<bool> {
        Ok(self.op_route(stream, false)?.0 != Route::Direct)
    }

    /// Keep `item` in `stream`'s retention (pinned if the stream is being captured).
    pub(super) fn retain(&self, stream: &CudaStream, item: Held) -> Result<()> {
        let capture = capture_of(stream.raw())?;
        stream.inner.retention.lock().unwrap_or_else(PoisonError::into_inner).hold(item, capture);
        Ok(())
    }

    /// `Err` if `stream` is being captured: `what` (a synchronize) would invalidate the capture.
    pub(super) fn refuse_in_capture(&self, stream: &CudaStream, what: &'static str) -> Result<()> {
        if scratch::capturing() || capture_of(stream.raw())?.allows_release() {
            return Ok(());
        }
        Err(Error::Unsupported { backend: "cuda", feature: what.into() })
    }

    /// After a synchronize of `stream`: release what its queued work held.
    pub(super) fn settle(&self, stream: &CudaStream) {
        if self.engine_capturing() {
            return;
        }
        let done = stream.inner.retention.lock().unwrap_or_else(PoisonError::into_inner).settle();
        drop(done);
    }

    /// Close `stream`'s open batch behind an event recorded now, and release the batches the
    /// stream has passed, unless an engine is capturing (then only the mark is recorded, or,
    /// on a capturing stream, nothing at all: the caller checks).
    fn release_passed(&self, stream: &CudaStream) -> Result<()> {
        let mut retention = stream.inner.retention.lock().unwrap_or_else(PoisonError::into_inner);
        if retention.needs_mark() {
            let event = self.inner.ctx.new_event(None).map_err(driver("cuEventCreate"))?;
            record_raw(&event, stream.raw())?;
            retention.mark(event);
        }
        if self.engine_capturing() {
            return Ok(());
        }
        let done = retention.collect(RawEvent::is_complete);
        drop(retention);
        drop(done);
        Ok(())
    }

    /// `submit` on `stream`: as it is on kda's own streams; through the stream's retention on an
    /// engine's stream or under an engine's capture (`kda_core::device::retention`). Inside a
    /// capture the op's scratch and staging are plain allocations pinned with it, and work that
    /// needs the host at run time (a download, a host function) is refused: a host function
    /// replayed by the engine's graph would run again without kda.
    pub(super) fn submit_ordered(
        &self,
        stream: &CudaStream,
        label: &str,
        op: Validated<Self>,
    ) -> Result<()> {
        let host_work = matches!(op.op(), Op::Download { .. } | Op::Host { .. });
        let (route, capture) = self.op_route(stream, host_work)?;
        match route {
            Route::Direct => return self.run(stream, label, &op),
            Route::Refused => {
                return Err(Error::Unsupported {
                    backend: "cuda",
                    feature: "a download or host function inside an engine's graph capture".into(),
                });
            }
            Route::Ordered | Route::Pinned => {}
        }
        let held = op.clone();
        let (result, owned) = if route == Route::Ordered {
            self.release_passed(stream)?;
            (self.run(stream, label, &op), Vec::new())
        } else {
            relaxed_capture(|| scratch::capture_scope(|| self.run(stream, label, &op)))
        };
        let mut retention = stream.inner.retention.lock().unwrap_or_else(PoisonError::into_inner);
        retention.hold(Box::new(held), capture);
        for o in owned {
            retention.hold(Box::new(o), capture);
        }
        result
    }
}
