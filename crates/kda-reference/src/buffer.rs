//! Host memory shared by every stream worker of a backend instance.
//!
//! A buffer is plain heap memory that several worker threads may touch at once. Two ops that
//! touch overlapping bytes, at least one writing, never run at the same time: the caller orders
//! them (the stream contract, which checked mode verifies), and where it does not,
//! [`crate::exclusion`] makes the later one wait. The kernels also rely on the façade's
//! validation having rejected outputs that overlap their own inputs or themselves.

use std::alloc::{self, Layout as AllocLayout};
use std::any::Any;
use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use bytemuck::Pod;
use kda_core::{BufferHandle, BufferId, Error, Layout, Result};

/// Alignment of every allocation: a cache line, and enough for any element type.
const ALIGN: usize = 64;
/// Buffers at least this large are aligned to, and advised to use, 2 MiB huge pages: streaming a
/// weight matrix through a GEMM otherwise spends a measurable share of its time on TLB misses
/// (numpy does the same for its arrays).
const HUGE_PAGE: usize = 2 << 20;
const HUGE_MIN_LEN: usize = 2 * HUGE_PAGE;
/// Alignment an imported pointer needs: the widest kda element (kernels make slices of it).
const IMPORT_ALIGN: usize = 4;

struct Storage {
    id: BufferId,
    ptr: NonNull<u8>,
    len: usize,
    /// `Some` for imported memory: the caller's keep-alive, dropped with the storage; the
    /// memory itself is never freed here.
    foreign: Option<Box<dyn Any + Send + Sync>>,
}

// SAFETY: `Storage` owns its allocation (or, imported, its owner is `Send + Sync` and the
// importer promised the memory is ours to touch); concurrent access goes through raw pointers in kernels,
// which the stream contract (see module docs) keeps free of data races.
unsafe impl Send for Storage {}
// SAFETY: as above; `&Storage` only hands out raw pointers.
unsafe impl Sync for Storage {}

impl Drop for Storage {
    fn drop(&mut self) {
        if self.len > 0 && self.foreign.is_none() {
            // SAFETY: allocated in `RefBuffer::new` with exactly this size and alignment.
            unsafe { alloc::dealloc(self.ptr.as_ptr(), alloc_layout(self.len)) };
        }
    }
}

fn alloc_layout(len: usize) -> AllocLayout {
    let align = if len >= HUGE_MIN_LEN { HUGE_PAGE } else { ALIGN };
    // `len` was validated against `isize::MAX` when allocating, so this cannot fail.
    AllocLayout::from_size_align(len, align).unwrap_or(AllocLayout::new::<u8>())
}

/// Ask the kernel to back a large allocation with huge pages (a hint; failure is harmless).
fn advise_huge_pages(ptr: NonNull<u8>, len: usize) {
    #[cfg(target_os = "linux")]
    if len >= HUGE_MIN_LEN {
        // SAFETY: `ptr..ptr + len` is one live allocation of ours; MADV_HUGEPAGE changes no
        // contents and cannot invalidate it.
        unsafe { libc::madvise(ptr.as_ptr().cast(), len, libc::MADV_HUGEPAGE) };
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (ptr, len);
}

/// A reference-backend buffer handle (shared ownership).
#[derive(Clone)]
pub struct RefBuffer(Arc<Storage>);

impl fmt::Debug for RefBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let imported = if self.0.foreign.is_some() { ", imported" } else { "" };
        write!(f, "RefBuffer({}, {} bytes{imported})", self.0.id, self.0.len)
    }
}

impl BufferHandle for RefBuffer {
    fn id(&self) -> BufferId {
        self.0.id
    }

    fn len_bytes(&self) -> usize {
        self.0.len
    }
}

impl RefBuffer {
    /// Allocate `len` zeroed bytes.
    pub(crate) fn new(id: BufferId, len: usize) -> Result<Self> {
        if len > isize::MAX as usize - HUGE_PAGE {
            return Err(Error::OutOfMemory { bytes: len });
        }
        let ptr = if len == 0 {
            NonNull::<u64>::dangling().cast()
        } else {
            // SAFETY: the layout has a non-zero size.
            let ptr = NonNull::new(unsafe { alloc::alloc(alloc_layout(len)) })
                .ok_or(Error::OutOfMemory { bytes: len })?;
            // Advise before the first touch, so the zeroing below faults in huge pages.
            advise_huge_pages(ptr, len);
            // SAFETY: `ptr` is a fresh allocation of `len` bytes.
            unsafe { ptr.as_ptr().write_bytes(0, len) };
            ptr
        };
        Ok(Self(Arc::new(Storage { id, ptr, len, foreign: None })))
    }

    /// Host memory someone else owns, without a copy; `owner` is dropped with the last handle.
    ///
    /// # Safety
    /// As `kda_core::Device::import_buffer`: `ptr..ptr + len` stays valid for reads and writes,
    /// and untouched by others while kda work on it may run, as long as `owner` lives.
    pub(crate) unsafe fn import(
        id: BufferId,
        ptr: *mut u8,
        len: usize,
        owner: Box<dyn Any + Send + Sync>,
    ) -> Result<Self> {
        let misaligned = ptr.align_offset(IMPORT_ALIGN) != 0;
        let ptr = match NonNull::new(ptr) {
            Some(p) if !misaligned => p,
            _ if len == 0 => NonNull::<u64>::dangling().cast(),
            _ => {
                return Err(Error::Param {
                    op: "import_buffer",
                    param: "ptr",
                    expected: format!("a non-null pointer aligned to {IMPORT_ALIGN} bytes"),
                    actual: format!("{ptr:p}"),
                });
            }
        };
        if len > isize::MAX as usize {
            return Err(Error::OutOfMemory { bytes: len });
        }
        Ok(Self(Arc::new(Storage { id, ptr, len, foreign: Some(owner) })))
    }

    /// Typed pointer to element 0 of the buffer.
    fn base<T>(&self) -> *mut T {
        self.0.ptr.as_ptr().cast()
    }

    /// The elements of a contiguous view as a slice.
    ///
    /// # Safety
    /// `layout` is contiguous, has elements of `T`'s size and lies inside the buffer; no other thread
    /// writes those bytes while the slice lives (the stream contract).
    pub(crate) unsafe fn slice<T: Pod>(&self, layout: &Layout) -> &[T] {
        debug_assert!(layout.is_contiguous() && layout.dtype().size_bytes() == size_of::<T>());
        // SAFETY: in bounds and aligned (64-byte base, or 4-byte for imported memory, and an
        // element-sized offset) per the contract.
        unsafe { std::slice::from_raw_parts(self.base::<T>().add(layout.offset()), layout.numel()) }
    }

    /// The elements of a contiguous view as a mutable slice.
    ///
    /// # Safety
    /// As [`RefBuffer::slice`], and no other thread reads or writes those bytes while the slice
    /// lives.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn slice_mut<T: Pod>(&self, layout: &Layout) -> &mut [T] {
        debug_assert!(layout.is_contiguous() && layout.dtype().size_bytes() == size_of::<T>());
        // SAFETY: in bounds, aligned and exclusive per the contract.
        unsafe {
            std::slice::from_raw_parts_mut(self.base::<T>().add(layout.offset()), layout.numel())
        }
    }

    /// Read the elements of any view, in row-major order.
    ///
    /// # Safety
    /// `layout` has elements of `T`'s size and lies inside the buffer; no other thread writes its bytes
    /// meanwhile.
    pub(crate) unsafe fn gather<T: Pod>(&self, layout: &Layout) -> Vec<T> {
        if layout.is_contiguous() {
            // SAFETY: forwarded contract.
            return unsafe { self.slice::<T>(layout) }.to_vec();
        }
        let base = self.base::<T>();
        let (outer, run) = layout.runs();
        let mut out = Vec::with_capacity(layout.numel());
        for start in outer.offsets() {
            // SAFETY: each run of the view lies inside the buffer, elements `start ..
            // start + run` next to each other.
            out.extend_from_slice(unsafe { std::slice::from_raw_parts(base.add(start), run) });
        }
        out
    }

    /// Write `values` (row-major) into any view whose elements do not overlap each other.
    ///
    /// # Safety
    /// `layout` has elements of `T`'s size, lies inside the buffer and is non-overlapping; no other
    /// thread touches its bytes meanwhile.
    pub(crate) unsafe fn scatter<T: Pod>(&self, layout: &Layout, values: &[T]) {
        debug_assert_eq!(values.len(), layout.numel());
        if layout.is_contiguous() {
            // SAFETY: forwarded contract.
            unsafe { self.slice_mut::<T>(layout) }.copy_from_slice(values);
            return;
        }
        let base = self.base::<T>();
        let (outer, run) = layout.runs();
        for (start, v) in outer.offsets().zip(values.chunks(run.max(1))) {
            // SAFETY: each run of the view lies inside the buffer and no two overlap (the
            // contract), elements `start .. start + run` next to each other; exclusive per the
            // contract.
            unsafe { std::slice::from_raw_parts_mut(base.add(start), v.len()) }.copy_from_slice(v);
        }
    }

    /// Raw pointer to element `offset` of a `T` view, for kernels that pass strides to a GEMM.
    pub fn element_ptr<T>(&self, offset: usize) -> *mut T {
        self.base::<T>().wrapping_add(offset)
    }
}
