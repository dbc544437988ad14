//! Thin safe wrappers over the [`sys`](crate::sys) calls: error checking, per-thread device
//! binding, and owned handles that release themselves.

use std::cell::Cell;
use std::ffi::{CStr, c_void};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::error::AscendError;
use crate::sys;

/// Turn an ACL / aclnn return code into a typed error naming the function.
pub(crate) fn check(func: &'static str, code: sys::aclError) -> Result<(), AscendError> {
    if code == sys::ACL_SUCCESS {
        Ok(())
    } else {
        Err(AscendError::Acl { func, code, message: sys::recent_error() })
    }
}

/// Resolve the CANN table (feature `acl`: open the libraries; a missing library or required
/// symbol is [`AscendError::Load`]), then `aclInit` once per process (a second init is
/// reported by CANN and harmless).
fn init() -> Result<(), AscendError> {
    static INIT: OnceLock<Result<(), AscendError>> = OnceLock::new();
    INIT.get_or_init(|| {
        sys::bind_table()?;
        // SAFETY: a null config path is allowed ("no configuration").
        let code = unsafe { sys::aclInit(std::ptr::null()) };
        if code == sys::ACL_ERROR_REPEAT_INITIALIZE { Ok(()) } else { check("aclInit", code) }
    })
    .clone()
}

thread_local! {
    /// The device this thread's ACL context is bound to.
    static BOUND: Cell<Option<i32>> = const { Cell::new(None) };
}

/// Make `device` current on the calling thread (ACL contexts are per thread).
pub(crate) fn bind(device: i32) -> Result<(), AscendError> {
    if BOUND.with(Cell::get) == Some(device) {
        return Ok(());
    }
    init()?;
    // SAFETY: plain call with a device ordinal.
    check("aclrtSetDevice", unsafe { sys::aclrtSetDevice(device) })?;
    BOUND.with(|b| b.set(Some(device)));
    Ok(())
}

/// The SoC name the runtime reports.
pub(crate) fn soc_name() -> String {
    // SAFETY: returns null or a NUL-terminated static string owned by the runtime.
    let ptr = unsafe { sys::aclrtGetSocName() };
    if ptr.is_null() {
        return String::new();
    }
    // SAFETY: non-null, NUL-terminated.
    unsafe { CStr::from_ptr(ptr) }.to_string_lossy().into_owned()
}

/// An `aclrtStream` (stored as an address: the handle is an opaque token): kda's own, created
/// and destroyed here, or an engine's ([`RawStream::borrowed`]), never destroyed nor replaced.
/// kda's own handle can be replaced: a stream stopped by a failed task under
/// `ACL_STOP_ON_FAILURE` accepts no task again, so the HAL stream continues on a fresh ACL
/// stream ([`RawStream::replace`]).
#[derive(Debug)]
pub(crate) struct RawStream {
    handle: AtomicUsize,
    owned: bool,
}

impl RawStream {
    fn new_handle() -> Result<usize, AscendError> {
        let mut s: sys::aclrtStream = std::ptr::null_mut();
        // SAFETY: `s` is a valid out-parameter.
        check("aclrtCreateStream", unsafe { sys::aclrtCreateStream(&mut s) })?;
        // A failed task stops the stream's later tasks (the HAL's failure contract); CANN
        // applies the mode to every stream of the context.
        // SAFETY: a live stream.
        let mode = check("aclrtSetStreamFailureMode", unsafe {
            sys::aclrtSetStreamFailureMode(s, sys::ACL_STOP_ON_FAILURE)
        });
        if let Err(e) = mode {
            // SAFETY: created above, destroyed once.
            let _ = unsafe { sys::aclrtDestroyStream(s) };
            return Err(e);
        }
        Ok(s as usize)
    }

    pub(crate) fn create() -> Result<Self, AscendError> {
        Ok(RawStream { handle: AtomicUsize::new(Self::new_handle()?), owned: true })
    }

    /// An engine's stream: used as it is, never destroyed nor replaced by kda.
    pub(crate) fn borrowed(handle: usize) -> Self {
        RawStream { handle: AtomicUsize::new(handle), owned: false }
    }

    /// Whether kda created this stream (and destroys or replaces it).
    pub(crate) fn owned(&self) -> bool {
        self.owned
    }

    pub(crate) fn get(&self) -> sys::aclrtStream {
        self.handle.load(Ordering::Acquire) as sys::aclrtStream
    }

    /// Continue on a fresh ACL stream after this one stopped on a failed task; the stopped one
    /// is destroyed (its queued tasks were discarded by the runtime). An engine's stream is
    /// left as it is (the engine owns it and its recovery).
    pub(crate) fn replace(&self) -> Result<(), AscendError> {
        if !self.owned {
            return Ok(());
        }
        let fresh = Self::new_handle()?;
        let old = self.handle.swap(fresh, Ordering::AcqRel);
        // SAFETY: created by `aclrtCreateStream`, no longer reachable through `self`.
        let _ = unsafe { sys::aclrtDestroyStream(old as sys::aclrtStream) };
        Ok(())
    }
}

impl Drop for RawStream {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        // SAFETY: created by `aclrtCreateStream`, destroyed once; queued work still completes.
        let _ = unsafe { sys::aclrtDestroyStream(self.get()) };
    }
}

/// An owned event: `ACL_EVENT_SYNC` for the HAL's events (the only kind another stream may
/// wait on; a scarce resource), `ACL_EVENT_CAPTURE_STREAM_PROGRESS` for the allocator's reuse
/// markers, which are only queried.
#[derive(Debug)]
pub(crate) struct RawEvent(usize);

impl RawEvent {
    pub(crate) fn with_flag(flag: u32) -> Result<Self, AscendError> {
        let mut e: sys::aclrtEvent = std::ptr::null_mut();
        // SAFETY: `e` is a valid out-parameter.
        check("aclrtCreateEventExWithFlag", unsafe {
            sys::aclrtCreateEventExWithFlag(&mut e, flag)
        })?;
        Ok(RawEvent(e as usize))
    }

    /// An event other streams can wait on.
    pub(crate) fn create() -> Result<Self, AscendError> {
        Self::with_flag(sys::ACL_EVENT_SYNC)
    }

    /// A marker of a stream's progress, queried by the host (the allocator's reuse events).
    pub(crate) fn progress() -> Result<Self, AscendError> {
        Self::with_flag(sys::ACL_EVENT_CAPTURE_STREAM_PROGRESS)
    }

    pub(crate) fn get(&self) -> sys::aclrtEvent {
        self.0 as sys::aclrtEvent
    }

    /// Milliseconds from `self`'s completion to `end`'s (both `ACL_EVENT_TIME_LINE`).
    pub(crate) fn elapsed_ms(&self, end: &RawEvent) -> Result<f32, AscendError> {
        let mut ms = 0f32;
        // SAFETY: live events, a valid out-parameter.
        check("aclrtEventElapsedTime", unsafe {
            sys::aclrtEventElapsedTime(&mut ms, self.get(), end.get())
        })?;
        Ok(ms)
    }

    pub(crate) fn record(&self, stream: &RawStream) -> Result<(), AscendError> {
        // SAFETY: live event and stream.
        check("aclrtRecordEvent", unsafe { sys::aclrtRecordEvent(self.get(), stream.get()) })
    }

    /// Whether the work of the most recent record has completed.
    pub(crate) fn is_complete(&self) -> Result<bool, AscendError> {
        let mut status = sys::ACL_EVENT_RECORDED_STATUS_NOT_READY;
        // SAFETY: live event, valid out-parameter.
        check("aclrtQueryEventStatus", unsafe {
            sys::aclrtQueryEventStatus(self.get(), &mut status)
        })?;
        Ok(status == sys::ACL_EVENT_RECORDED_STATUS_COMPLETE)
    }
}

pub(crate) fn wait(stream: &RawStream, event: &RawEvent) -> Result<(), AscendError> {
    // SAFETY: live stream and event.
    check("aclrtStreamWaitEvent", unsafe { sys::aclrtStreamWaitEvent(stream.get(), event.get()) })
}

impl Drop for RawEvent {
    fn drop(&mut self) {
        // SAFETY: created by `aclrtCreateEventExWithFlag`, destroyed once.
        let _ = unsafe { sys::aclrtDestroyEvent(self.get()) };
    }
}

/// Pinned host memory (`aclrtMallocHost`): staging for asynchronous copies.
#[derive(Debug)]
pub(crate) struct HostMemory {
    ptr: usize,
}

impl HostMemory {
    pub(crate) fn alloc(len: usize) -> Result<Self, AscendError> {
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: valid out-parameter.
        check("aclrtMallocHost", unsafe { sys::aclrtMallocHost(&mut p, len.max(1)) })?;
        Ok(HostMemory { ptr: p as usize })
    }

    pub(crate) fn ptr(&self) -> *mut u8 {
        self.ptr as *mut u8
    }
}

impl Drop for HostMemory {
    fn drop(&mut self) {
        // SAFETY: allocated by `aclrtMallocHost`, freed once.
        let _ = unsafe { sys::aclrtFreeHost(self.ptr as *mut c_void) };
    }
}
