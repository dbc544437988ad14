//! Device memory: a caching allocator with stream-ordered reuse.
//!
//! Freed blocks stay cached by size class. A block released by [`Backend::free`] on a stream
//! carries an event recorded there at the free; it is handed out again only once that event
//! has completed (the stream is past every use ordered before the free), as PyTorch's and
//! cubecl's caching allocators do. A block whose last handle simply drops is reusable at once:
//! queued work keeps its own handles until its stream is synchronized (see `StreamInner`).
//!
//! The reuse events are `ACL_EVENT_CAPTURE_STREAM_PROGRESS` events (only queried, never waited
//! on: the scarce SYNC events stay for the HAL's events), and none is queried while a capture
//! of this instance is open (no query or synchronize may run then): a block freed on a stream
//! is then simply not reused until the capture has ended.
//!
//! [`Backend::free`]: kda_core::Backend::free

use std::any::Any;
use std::ffi::c_void;
use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use kda_core::{BufferHandle, BufferId};

use super::acl::{RawEvent, check};
use crate::error::AscendError;
use crate::sys;

/// Allocation granularity: every block is a multiple of this, so freed blocks fit more requests.
pub(crate) const GRANULE: usize = 512;

/// A cached block and what must complete before it is reused.
#[derive(Debug)]
struct Cached {
    addr: usize,
    capacity: usize,
    ready: Option<RawEvent>,
    previous: BufferId,
}

/// The cache of one backend instance. Dropping it returns every cached block to the runtime.
#[derive(Debug, Default)]
pub(crate) struct Pool {
    cached: Mutex<Vec<Cached>>,
    /// Captures of this instance open now.
    captures: AtomicUsize,
}

/// A capture is open while this lives ([`Pool::capture_open`]).
#[derive(Debug)]
pub(crate) struct CaptureOpen<'a>(&'a Pool);

impl Drop for CaptureOpen<'_> {
    fn drop(&mut self) {
        self.0.captures.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Pool {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Cached>> {
        self.cached.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A block of at least `bytes` bytes; `Some(previous)` when it reuses a freed buffer's memory.
    pub(crate) fn alloc(
        self: &Arc<Self>,
        id: BufferId,
        bytes: usize,
    ) -> Result<(AscendBuffer, Option<BufferId>), AscendError> {
        let capacity = bytes.max(1).div_ceil(GRANULE) * GRANULE;
        let reused = self.take_ready(capacity)?;
        let (addr, previous) = match reused {
            Some(c) => (c.addr, Some(c.previous)),
            None => (self.malloc(capacity)?, None),
        };
        let block = Block {
            addr,
            len: bytes,
            capacity,
            id,
            freed_on: Mutex::new(None),
            pool: Arc::clone(self),
            foreign: None,
        };
        Ok((AscendBuffer { block: Arc::new(block) }, previous))
    }

    /// Device memory the caller owns at `addr` (`kda_core::Device::import_buffer`): never
    /// cached nor freed here; `owner` is dropped with the last handle.
    pub(crate) fn import(
        self: &Arc<Self>,
        id: BufferId,
        addr: usize,
        len: usize,
        owner: Box<dyn Any + Send + Sync>,
    ) -> AscendBuffer {
        let block = Block {
            addr,
            len,
            capacity: len,
            id,
            freed_on: Mutex::new(None),
            pool: Arc::clone(self),
            foreign: Some(owner),
        };
        AscendBuffer { block: Arc::new(block) }
    }

    /// Mark a capture open until the guard drops: no reuse event is queried meanwhile.
    pub(crate) fn capture_open(&self) -> CaptureOpen<'_> {
        self.captures.fetch_add(1, Ordering::AcqRel);
        CaptureOpen(self)
    }

    /// Whether the free behind `ready` has completed; `false` without asking while a capture is
    /// open.
    fn completed(&self, ready: Option<&RawEvent>) -> Result<bool, AscendError> {
        match ready {
            None => Ok(true),
            Some(_) if self.captures.load(Ordering::Acquire) > 0 => Ok(false),
            Some(event) => event.is_complete(),
        }
    }

    /// A cached block of exactly `capacity` bytes whose free has completed.
    fn take_ready(&self, capacity: usize) -> Result<Option<Cached>, AscendError> {
        let mut cached = self.lock();
        for i in 0..cached.len() {
            if cached[i].capacity != capacity {
                continue;
            }
            let ready = self.completed(cached[i].ready.as_ref())?;
            if ready {
                return Ok(Some(cached.swap_remove(i)));
            }
        }
        Ok(None)
    }

    fn malloc(&self, capacity: usize) -> Result<usize, AscendError> {
        let attempt = || {
            let mut p: *mut c_void = std::ptr::null_mut();
            // SAFETY: valid out-parameter, non-zero size.
            let code =
                unsafe { sys::aclrtMalloc(&mut p, capacity, sys::ACL_MEM_MALLOC_HUGE_FIRST) };
            check("aclrtMalloc", code).map(|()| p as usize)
        };
        attempt().or_else(|_| {
            // Out of memory: return the completed cached blocks and try once more.
            self.release_ready()?;
            attempt()
        })
    }

    fn release_ready(&self) -> Result<(), AscendError> {
        let mut cached = self.lock();
        let mut kept = Vec::new();
        for c in cached.drain(..) {
            let done = self.completed(c.ready.as_ref())?;
            if done {
                // SAFETY: a block of ours, no longer referenced (its event completed).
                let _ = unsafe { sys::aclrtFree(c.addr as *mut c_void) };
            } else {
                kept.push(c);
            }
        }
        *cached = kept;
        Ok(())
    }

    fn give_back(&self, c: Cached) {
        self.lock().push(c);
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        for c in self.lock().drain(..) {
            // The instance is gone; so is every handle to its blocks.
            // SAFETY: a block of ours, freed once.
            let _ = unsafe { sys::aclrtFree(c.addr as *mut c_void) };
        }
    }
}

/// One allocation handed out by the pool.
pub(crate) struct Block {
    addr: usize,
    len: usize,
    capacity: usize,
    id: BufferId,
    /// Recorded by `free` on the freeing stream: reuse waits for it.
    freed_on: Mutex<Option<RawEvent>>,
    pool: Arc<Pool>,
    /// Imported memory's keep-alive: the block is the caller's, never returned to the cache.
    foreign: Option<Box<dyn Any + Send + Sync>>,
}

impl Drop for Block {
    fn drop(&mut self) {
        if self.foreign.is_some() {
            return;
        }
        let ready = self.freed_on.lock().unwrap_or_else(PoisonError::into_inner).take();
        self.pool.give_back(Cached {
            addr: self.addr,
            capacity: self.capacity,
            ready,
            previous: self.id,
        });
    }
}

/// An Ascend device buffer handle (shared ownership; the block returns to the cache when the
/// last handle, including those kept by queued work, is dropped).
#[derive(Clone)]
pub struct AscendBuffer {
    block: Arc<Block>,
}

impl fmt::Debug for AscendBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "AscendBuffer({}, {} bytes at {:#x})",
            self.block.id, self.block.len, self.block.addr
        )
    }
}

impl BufferHandle for AscendBuffer {
    fn id(&self) -> BufferId {
        self.block.id
    }

    fn len_bytes(&self) -> usize {
        self.block.len
    }
}

impl AscendBuffer {
    /// Device address of byte 0.
    pub(crate) fn addr(&self) -> usize {
        self.block.addr
    }

    /// Reuse after `event` completes (a stream-ordered free).
    pub(crate) fn free_after(&self, event: RawEvent) {
        *self.block.freed_on.lock().unwrap_or_else(PoisonError::into_inner) = Some(event);
    }
}
