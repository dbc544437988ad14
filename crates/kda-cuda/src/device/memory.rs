//! Device memory, pinned staging memory, and host callbacks: the pieces whose lifetimes the
//! stream order decides.

use std::any::Any;
use std::cell::Cell;
use std::ffi::c_void;
use std::fmt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Mutex, PoisonError, RwLock};

use cudarc::driver::{CudaContext, DriverError, result, sys};

use crate::CudaError;

/// Map a driver error to [`CudaError`], naming the call.
pub(super) fn driver(call: &'static str) -> impl Fn(DriverError) -> CudaError {
    move |e| CudaError::Driver { call, message: e.to_string() }
}

/// kda's own stream captures (a graph being built, `graph.rs`) against the calls that wait for
/// the whole device (an instance's teardown with its context synchronisation, `Teardown` in
/// `mod.rs`; `cublasDestroy`, which synchronises the device): the driver invalidates a capture when another thread
/// synchronises the context while it is open, and every instance of a process shares the
/// device's primary context. Captures share the gate; a whole-device wait takes it alone.
static DEVICE_GATE: RwLock<()> = RwLock::new(());

thread_local! {
    /// This thread holds [`DEVICE_GATE`] (either way): nested calls run without taking it
    /// again (the lock is not re-entrant, and a thread's own capture is not another's).
    static HOLDING: Cell<bool> = const { Cell::new(false) };
}

/// Run `f` holding the gate (shared or alone), or as it is when this thread holds it already.
fn gated<R>(alone: bool, f: impl FnOnce() -> R) -> R {
    if HOLDING.with(Cell::get) {
        return f();
    }
    let shared = (!alone).then(|| DEVICE_GATE.read().unwrap_or_else(PoisonError::into_inner));
    let exclusive = alone.then(|| DEVICE_GATE.write().unwrap_or_else(PoisonError::into_inner));
    /// Clears [`HOLDING`] when `f` returns or unwinds.
    struct Held;
    impl Drop for Held {
        fn drop(&mut self) {
            HOLDING.with(|h| h.set(false));
        }
    }
    HOLDING.with(|h| h.set(true));
    let held = Held;
    let out = f();
    drop((held, shared, exclusive));
    out
}

/// Run `f`, a stream capture of kda's own, so that no other thread waits for the whole device
/// meanwhile (see [`DEVICE_GATE`]).
pub(super) fn capturing<R>(f: impl FnOnce() -> R) -> R {
    gated(false, f)
}

/// Run `f`, which waits for the whole device, once no other thread is inside [`capturing`].
pub(super) fn whole_device<R>(f: impl FnOnce() -> R) -> R {
    gated(true, f)
}

/// Run `f` with this thread's stream-capture mode relaxed: an allocation an op needs while an
/// engine captures its stream (`cuMemAlloc`, `cuMemHostAlloc`) is then allowed instead of
/// invalidating the engine's capture (in the default global mode the driver refuses them from
/// any thread while a capture is open). Outside a capture the mode changes nothing.
pub(super) fn relaxed_capture<R>(f: impl FnOnce() -> R) -> R {
    let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
    // SAFETY: exchanges this thread's mode with `mode`; restored below.
    let exchanged = unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) }.result().is_ok();
    let out = f();
    if exchanged {
        // SAFETY: puts back the mode the first exchange returned.
        let _ = unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) };
    }
    out
}

/// Device memory: `cuMemAlloc`'s, released with `cuMemFree` when dropped (`cuMemFree` waits for
/// the device work that may still use it, so dropping the last handle while kernels run is
/// safe), or an engine's (imported), never freed here.
pub(super) struct DeviceMemory {
    pub(super) ptr: u64,
    pub(super) bytes: usize,
    ctx: Arc<CudaContext>,
    /// What keeps an imported allocation alive, dropped with this value.
    foreign: Option<Box<dyn Any + Send + Sync>>,
}

impl fmt::Debug for DeviceMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceMemory")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("bytes", &self.bytes)
            .field("imported", &self.foreign.is_some())
            .finish()
    }
}

impl DeviceMemory {
    pub(super) fn new(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Self, CudaError> {
        if bytes == 0 {
            return Ok(Self { ptr: 0, bytes, ctx: ctx.clone(), foreign: None });
        }
        ctx.bind_to_thread().map_err(driver("cuCtxSetCurrent"))?;
        // SAFETY: a plain allocation in the bound context; the memory is only ever addressed
        // through views that `Op::validate` keeps within `bytes`.
        let ptr = relaxed_capture(|| unsafe { result::malloc_sync(bytes) }).map_err(|e| {
            if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
                CudaError::OutOfMemory { bytes }
            } else {
                driver("cuMemAlloc")(e)
            }
        })?;
        Ok(Self { ptr, bytes, ctx: ctx.clone(), foreign: None })
    }

    /// An engine's allocation (checked by the caller, `crate::import`): never freed here;
    /// `owner` is dropped with this value.
    pub(super) fn import(
        ctx: &Arc<CudaContext>,
        ptr: u64,
        bytes: usize,
        owner: Box<dyn Any + Send + Sync>,
    ) -> Self {
        Self { ptr, bytes, ctx: ctx.clone(), foreign: Some(owner) }
    }

    /// Set every byte to zero and wait until that is done, so work queued later on any stream
    /// reads zeros (not what an earlier owner of the memory left, e.g. a stale failure record).
    /// The memset runs on a stream of its own, and only that stream is waited for: a context
    /// synchronisation (or `cuMemsetD8` on the legacy stream) would invalidate a capture open
    /// on another thread.
    pub(super) fn zero(&self) -> Result<(), CudaError> {
        if self.bytes == 0 {
            return Ok(());
        }
        let stream = self.ctx.new_stream().map_err(driver("cuStreamCreate"))?;
        // SAFETY: `ptr` holds `bytes` bytes of this context's memory; the memset is waited for
        // below, before the stream is dropped.
        unsafe { result::memset_d8_async(self.ptr, 0, self.bytes, stream.cu_stream()) }
            .map_err(driver("cuMemsetD8Async"))?;
        stream.synchronize().map_err(driver("cuStreamSynchronize"))
    }
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        if self.ptr == 0 || self.foreign.is_some() {
            return;
        }
        // A failure here (a context already torn down) leaves nothing to recover.
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `ptr` came from `cuMemAlloc` in this context and is freed once, here.
            let _ = unsafe { result::free_sync(self.ptr) };
        }
    }
}

/// Zero `bytes` bytes at `ptr` in the order of `stream` (a failure record, after
/// `synchronize` has read it).
pub(super) fn clear_on_stream(
    stream: sys::CUstream,
    ptr: u64,
    bytes: usize,
) -> Result<(), CudaError> {
    // SAFETY: `ptr` addresses `bytes` bytes of device memory owned by the caller's instance;
    // the memset is ordered after everything queued on `stream` so far.
    unsafe { result::memset_d8_async(ptr, 0, bytes, stream) }.map_err(driver("cuMemsetD8Async"))
}

/// Page-locked host memory, mapped into the device's address space.
#[derive(Debug)]
pub(super) struct Pinned {
    pub(super) host: *mut u8,
    pub(super) device: u64,
    pub(super) bytes: usize,
}

// SAFETY: the allocation is plain memory owned by this value; the pointer is not tied to the
// thread that allocated it (pinned allocations are portable).
unsafe impl Send for Pinned {}
// SAFETY: shared access only reads the pointers; the bytes behind them are accessed under the
// stream-order contract each user documents.
unsafe impl Sync for Pinned {}

impl Pinned {
    pub(super) fn new(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Self, CudaError> {
        ctx.bind_to_thread().map_err(driver("cuCtxSetCurrent"))?;
        let flags = sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP;
        // SAFETY: a fresh allocation of `bytes.max(1)` bytes; freed once in `free`.
        let host = relaxed_capture(|| unsafe { result::malloc_host(bytes.max(1), flags) })
            .map_err(driver("cuMemHostAlloc"))? as *mut u8;
        let mut device = 0;
        // SAFETY: `host` is a live mapped allocation; `device` receives its device address.
        let status =
            unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, host as *mut c_void, 0) };
        if status != sys::CUresult::CUDA_SUCCESS {
            // SAFETY: allocated above, not shared yet.
            let _ = unsafe { result::free_host(host as *mut c_void) };
            return Err(driver("cuMemHostGetDevicePointer")(DriverError(status)));
        }
        // SAFETY: `host` points to at least `bytes` writable bytes that nothing else uses yet.
        unsafe { std::ptr::write_bytes(host, 0, bytes) };
        Ok(Self { host, device, bytes })
    }

    /// Release the allocation (the context must be current and no stream may still use it).
    fn free(self) {
        // SAFETY: `host` came from `cuMemHostAlloc` and is freed once, here.
        let _ = unsafe { result::free_host(self.host as *mut c_void) };
    }
}

/// Reusable pinned staging buffers for uploads and downloads. Host callbacks return buffers
/// here (they may not call CUDA); the buffers are freed when the pool is dropped.
#[derive(Debug)]
pub(super) struct PinnedPool {
    ctx: Arc<CudaContext>,
    free: Mutex<Vec<Pinned>>,
}

/// Buffers smaller than this are rounded up, so small transfers share a few buffers.
const MIN_STAGING: usize = 64 << 10;

impl PinnedPool {
    pub(super) fn new(ctx: &Arc<CudaContext>) -> Self {
        Self { ctx: ctx.clone(), free: Mutex::new(Vec::new()) }
    }

    /// A buffer of at least `bytes` bytes, reused if one is free.
    pub(super) fn take(&self, bytes: usize) -> Result<Pinned, CudaError> {
        let mut free = self.free.lock().unwrap_or_else(PoisonError::into_inner);
        let best = free
            .iter()
            .enumerate()
            .filter(|(_, p)| p.bytes >= bytes)
            .min_by_key(|(_, p)| p.bytes)
            .map(|(i, _)| i);
        if let Some(i) = best {
            return Ok(free.swap_remove(i));
        }
        drop(free);
        Pinned::new(&self.ctx, bytes.max(MIN_STAGING))
    }

    pub(super) fn give(&self, buffer: Pinned) {
        self.free.lock().unwrap_or_else(PoisonError::into_inner).push(buffer);
    }
}

impl Drop for PinnedPool {
    fn drop(&mut self) {
        let buffers = std::mem::take(self.free.get_mut().unwrap_or_else(PoisonError::into_inner));
        if self.ctx.bind_to_thread().is_ok() {
            buffers.into_iter().for_each(Pinned::free);
        }
    }
}

/// A mapped pinned allocation that is freed when dropped (the per-stream mailboxes).
#[derive(Debug)]
pub(super) struct OwnedPinned {
    pub(super) pinned: Option<Pinned>,
    ctx: Arc<CudaContext>,
}

impl OwnedPinned {
    pub(super) fn new(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Self, CudaError> {
        Ok(Self { pinned: Some(Pinned::new(ctx, bytes)?), ctx: ctx.clone() })
    }

    pub(super) fn host(&self) -> *mut u8 {
        self.pinned.as_ref().map_or(std::ptr::null_mut(), |p| p.host)
    }

    pub(super) fn device(&self) -> u64 {
        self.pinned.as_ref().map_or(0, |p| p.device)
    }
}

impl Drop for OwnedPinned {
    fn drop(&mut self) {
        if let Some(p) = self.pinned.take()
            && self.ctx.bind_to_thread().is_ok()
        {
            p.free();
        }
    }
}

type Callback = Box<dyn FnOnce() + Send>;

/// The C entry point of every host callback: runs the boxed closure once.
unsafe extern "C" fn trampoline(data: *mut c_void) {
    // SAFETY: `data` is the `Box<Callback>` leaked by `enqueue_host`, which the driver hands to
    // exactly one call of this function.
    let callback = unsafe { Box::from_raw(data as *mut Callback) };
    // A panic must not unwind into the driver.
    let _ = catch_unwind(AssertUnwindSafe(callback));
}

/// Run `f` on a driver thread once the work queued on `stream` so far has finished
/// (`cuLaunchHostFunc`). `f` must not call CUDA, nor drop anything that does.
pub(super) fn enqueue_host(
    stream: sys::CUstream,
    f: impl FnOnce() + Send + 'static,
) -> Result<(), CudaError> {
    let boxed: Box<Callback> = Box::new(Box::new(f));
    let data = Box::into_raw(boxed) as *mut c_void;
    // SAFETY: `stream` is a live stream of the current context; `data` stays valid until the
    // trampoline reclaims it.
    let launched = unsafe { result::stream::launch_host_function(stream, trampoline, data) };
    if let Err(e) = launched {
        // SAFETY: the driver refused the callback, so `data` is still ours alone.
        drop(unsafe { Box::from_raw(data as *mut Callback) });
        return Err(driver("cuLaunchHostFunc")(e));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{capturing, whole_device};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Barrier};
    use std::time::Duration;

    /// A whole-device wait on another thread waits until an open capture has ended; on the
    /// capturing thread itself (or nested) it runs at once instead of deadlocking.
    #[test]
    fn whole_device_waits_never_overlap_another_threads_capture() {
        let open = Arc::new(AtomicBool::new(false));
        let started = Arc::new(Barrier::new(2));
        let capture = {
            let (open, started) = (Arc::clone(&open), Arc::clone(&started));
            std::thread::spawn(move || {
                capturing(|| {
                    open.store(true, Ordering::SeqCst);
                    started.wait();
                    std::thread::sleep(Duration::from_millis(200));
                    // Nested on the capturing thread: runs, no deadlock.
                    whole_device(|| capturing(|| ()));
                    open.store(false, Ordering::SeqCst);
                })
            })
        };
        started.wait();
        let overlapped = whole_device(|| open.load(Ordering::SeqCst));
        assert!(!overlapped, "the whole-device wait ran inside another thread's capture");
        capture.join().expect("the capture thread");
        // After a panic inside, the gate is free again.
        let _ = std::panic::catch_unwind(|| whole_device(|| panic!("inside")));
        let free = std::thread::spawn(|| capturing(|| true)).join().expect("thread");
        assert!(free && whole_device(|| true));
    }
}
