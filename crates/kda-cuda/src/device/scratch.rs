//! Stream-ordered scratch memory (GEMM staging, strided transfers, MX dequantisation), and the
//! arena that keeps what a CUDA graph capture allocates alive with the graph.
//!
//! Scratch comes from the device's memory pool (`cuMemAllocAsync` / `cuMemFreeAsync`) where the
//! pool works. Some container runtimes leave the pool unusable (the attribute says yes, the
//! first allocation fails), so the pool is probed once per instance; without it, scratch is
//! plain `cuMemAlloc` memory kept on a free list and reused once the event recorded at its
//! release has completed.
//!
//! While a thread replays a HAL graph into a CUDA stream capture ([`capture_scope`]), scratch
//! and pinned staging are plain allocations that the arena hands to the instantiated graph:
//! nothing is freed inside the capture (no free node, no `cuMemFree` while capturing), and the
//! memory lives exactly as long as the graph that uses it.

use std::cell::RefCell;
use std::sync::{Arc, Mutex, PoisonError};

use cudarc::driver::{CudaContext, CudaEvent, result, sys};

use super::memory::{DeviceMemory, OwnedPinned, driver};
use crate::CudaError;

/// What a capture allocated, owned by its graph.
#[derive(Debug)]
pub(super) enum Owned {
    Device(DeviceMemory),
    #[allow(dead_code, reason = "held only to be freed with its graph")]
    Pinned(OwnedPinned),
}

thread_local! {
    /// The open capture arena of this thread, if it is replaying a graph into a capture.
    static ARENA: RefCell<Option<Vec<Owned>>> = const { RefCell::new(None) };
}

/// Whether this thread is replaying a graph into a CUDA capture.
pub(super) fn capturing() -> bool {
    ARENA.with(|a| a.borrow().is_some())
}

/// Hand `owned` to the open capture's graph; gives it back when no capture is open.
pub(super) fn keep(owned: Owned) -> Option<Owned> {
    ARENA.with(|a| match a.borrow_mut().as_mut() {
        Some(arena) => {
            arena.push(owned);
            None
        }
        None => Some(owned),
    })
}

/// Run `f` with a capture arena open on this thread; returns its result and what it allocated.
pub(super) fn capture_scope<R>(f: impl FnOnce() -> R) -> (R, Vec<Owned>) {
    ARENA.with(|a| *a.borrow_mut() = Some(Vec::new()));
    // Closed again even if `f` panics, so a later eager op on this thread frees normally.
    struct Close;
    impl Drop for Close {
        fn drop(&mut self) {
            ARENA.with(|a| a.borrow_mut().take());
        }
    }
    let close = Close;
    let out = f();
    let owned = ARENA.with(|a| a.borrow_mut().take()).unwrap_or_default();
    drop(close);
    (out, owned)
}

/// A piece of scratch: its device address and, unless it came from the pool, its memory.
pub(super) struct Scratch {
    pub(super) ptr: u64,
    memory: Option<DeviceMemory>,
}

/// Free scratch blocks kept at most (the oldest completed ones are released beyond it).
const MAX_CACHED: usize = 64;

/// One instance's scratch allocator.
#[derive(Debug)]
pub(super) struct ScratchAllocator {
    ctx: Arc<CudaContext>,
    /// Whether the memory pool works on this device.
    pool: bool,
    /// Plain blocks released in stream order, each with the event its last use completes.
    cached: Mutex<Vec<(CudaEvent, DeviceMemory)>>,
}

impl ScratchAllocator {
    /// Probe the device's memory pool with one small stream-ordered allocation on `stream`.
    pub(super) fn new(ctx: &Arc<CudaContext>, stream: sys::CUstream) -> Self {
        Self { ctx: ctx.clone(), pool: pool_works(ctx, stream), cached: Mutex::new(Vec::new()) }
    }

    /// At least `bytes` bytes usable by work queued on `stream` from now on.
    pub(super) fn take(&self, stream: sys::CUstream, bytes: usize) -> Result<Scratch, CudaError> {
        let bytes = bytes.max(1);
        if capturing() {
            let memory = DeviceMemory::new(&self.ctx, bytes)?;
            let ptr = memory.ptr;
            let memory = match keep(Owned::Device(memory)) {
                Some(Owned::Device(memory)) => Some(memory),
                _ => None,
            };
            return Ok(Scratch { ptr, memory });
        }
        if self.pool {
            // SAFETY: stream-ordered allocation on a live stream of the bound context; used
            // only by work queued on this stream before `release`.
            let ptr = unsafe { result::malloc_async(stream, bytes) }
                .map_err(driver("cuMemAllocAsync"))?;
            return Ok(Scratch { ptr, memory: None });
        }
        let mut cached = self.cached.lock().unwrap_or_else(PoisonError::into_inner);
        let best = cached
            .iter()
            .enumerate()
            .filter(|(_, (event, m))| {
                m.bytes >= bytes && m.bytes <= 2 * bytes && event.is_complete()
            })
            .min_by_key(|(_, (_, m))| m.bytes)
            .map(|(i, _)| i);
        if let Some(i) = best {
            let (_, memory) = cached.swap_remove(i);
            return Ok(Scratch { ptr: memory.ptr, memory: Some(memory) });
        }
        drop(cached);
        let memory = DeviceMemory::new(&self.ctx, bytes)?;
        Ok(Scratch { ptr: memory.ptr, memory: Some(memory) })
    }

    /// Give `scratch` back once the work queued on `stream` so far has finished with it.
    pub(super) fn release(&self, stream: sys::CUstream, scratch: Scratch) -> Result<(), CudaError> {
        match scratch.memory {
            // Pool memory (or, in a capture, memory the graph owns).
            None if capturing() => Ok(()),
            None => {
                // SAFETY: allocated on this stream by `take`; every use was queued before this.
                unsafe { result::free_async(scratch.ptr, stream) }.map_err(driver("cuMemFreeAsync"))
            }
            Some(memory) => {
                let event = self.ctx.new_event(None).map_err(driver("cuEventCreate"))?;
                // SAFETY: a live event and stream of this context.
                unsafe { result::event::record(event.cu_event(), stream) }
                    .map_err(driver("cuEventRecord"))?;
                let mut cached = self.cached.lock().unwrap_or_else(PoisonError::into_inner);
                cached.push((event, memory));
                if cached.len() > MAX_CACHED
                    && let Some(i) = cached.iter().position(|(e, _)| e.is_complete())
                {
                    cached.remove(i);
                }
                Ok(())
            }
        }
    }
}

impl super::CudaBackend {
    /// Whether scratch comes from the device's memory pool (`cuMemAllocAsync`); false where the
    /// pool did not work and scratch is plain `cuMemAlloc` memory on a free list.
    pub fn uses_memory_pool(&self) -> bool {
        self.inner.scratch.pool
    }
}

/// One `cuMemAllocAsync` and its free on `stream`, synchronised: whether the pool works here.
fn pool_works(ctx: &Arc<CudaContext>, stream: sys::CUstream) -> bool {
    let attribute = sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED;
    if !ctx.attribute(attribute).is_ok_and(|v| v > 0) {
        return false;
    }
    if ctx.bind_to_thread().is_err() {
        return false;
    }
    // SAFETY: a one-byte stream-ordered allocation on a live stream, freed on the same stream
    // and waited for before returning.
    let works = unsafe {
        match result::malloc_async(stream, 1) {
            Ok(ptr) => {
                result::free_async(ptr, stream).is_ok()
                    && result::stream::synchronize(stream).is_ok()
            }
            Err(_) => false,
        }
    };
    if works {
        keep_pool_memory(ctx);
    }
    works
}

/// Let the device's pool keep what it has allocated (its default release threshold of zero
/// hands memory back at every synchronisation, so large scratch such as a dequantised weight
/// would be allocated afresh call after call). Best effort: the pool works either way.
fn keep_pool_memory(ctx: &Arc<CudaContext>) {
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: `pool` receives the default pool of the context's device.
    if unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) }.result().is_err() {
        return;
    }
    let mut threshold = u64::MAX;
    let attribute = sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD;
    let value = &mut threshold as *mut u64 as *mut std::ffi::c_void;
    // SAFETY: the release threshold is a u64 the driver reads from `value`.
    let _ = unsafe { sys::cuMemPoolSetAttribute(pool, attribute, value) };
}
