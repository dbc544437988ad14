//! What an engine owns, taken as it is: its memory as buffers, its stream as a stream
//! (`docs/embedding.md`).

use std::any::Any;

use crate::error::Result;
use crate::hal::Backend;
use crate::resource::BufferHandle;

use super::Device;

impl<B: Backend> Device<B> {
    /// Wrap `len` bytes of memory the caller allocated at `ptr` as a buffer of this instance,
    /// without a copy: host memory on the reference backend, a `CUdeviceptr` on CUDA, an ACL
    /// device pointer on Ascend. kda never frees the memory; it drops `owner` (the engine's
    /// tensor, or anything that keeps the memory alive) once the last handle to the buffer is
    /// gone, including the handles queued ops hold until they have run. A backend that cannot
    /// import memory returns [`Error::Unsupported`](crate::Error::Unsupported).
    ///
    /// # Safety
    /// The caller owes, for as long as `owner` is alive:
    /// - `ptr` points to `len` bytes of memory of this backend's kind and device, valid for
    ///   reads and writes, aligned to 4 bytes (the widest kda element);
    /// - the memory stays allocated (it is released only by dropping `owner`, or after it);
    /// - nothing outside kda touches those bytes while kda work on them may be running, unless
    ///   ordered against it: before a launch, the engine's writes are complete or ordered
    ///   before the launch on the same stream; after it, the engine reads or writes only once
    ///   the stream has reached that point (a synchronize, an event, or later work on the
    ///   same stream). Checked mode sees only kda's own work, not the engine's.
    pub unsafe fn import_buffer(
        &self,
        ptr: *mut u8,
        len: usize,
        owner: Box<dyn Any + Send + Sync>,
    ) -> Result<B::Buffer> {
        // SAFETY: the caller's contract above is the backend's.
        let buffer = unsafe { self.raw().import_buffer(ptr, len, owner) }?;
        if self.instrumentation().is_checked() {
            self.instrumentation().alloc(buffer.id(), len);
        }
        Ok(buffer)
    }

    /// Use a stream the caller created (an engine's `CUstream` or `aclrtStream`, as an integer)
    /// as a stream of this instance: kda queues its work on it, forks its auxiliary streams
    /// from it by an event and joins them back before a call returns, so the engine's ordering
    /// and its graph capture of that stream see kda's work as their own. kda never destroys the
    /// stream. Backends without foreign streams (the reference: there, the engine's stream is
    /// the calling thread) return [`Error::Unsupported`](crate::Error::Unsupported).
    ///
    /// # Safety
    /// `handle` is a live stream of this backend's device and context, and stays alive as long
    /// as any handle kda returned for it (or work queued on it) does.
    pub unsafe fn import_stream(&self, handle: usize) -> Result<B::Stream> {
        // SAFETY: the caller's contract above is the backend's.
        unsafe { self.raw().import_stream(handle) }
    }
}
