//! The emulated device's memory: its own zeroed host allocations, whose addresses are the device
//! addresses `aclrtMalloc` returns, and the resource types the emulator's tensor views and HAL
//! op descriptions (`kda_core::Op`, for validating what a launch describes) are made of.

use std::alloc::{self, Layout as AllocLayout};
use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use kda_core::{
    BufferHandle, BufferId, EventHandle, EventId, InstanceId, Resources, StreamHandle, StreamId,
};

/// Alignment of every allocation (what kda's kernels and the twin's GM checks assume of device
/// memory: at least 32 bytes).
const ALIGN: usize = 64;

struct Storage {
    id: BufferId,
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the storage is plain bytes; who reads and writes them when is the stream order's
// business, as on the device.
unsafe impl Send for Storage {}
// SAFETY: as above.
unsafe impl Sync for Storage {}

impl Drop for Storage {
    fn drop(&mut self) {
        // SAFETY: allocated in `DeviceBuffer::new` with exactly this layout.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), layout(self.len)) };
    }
}

fn layout(len: usize) -> AllocLayout {
    AllocLayout::from_size_align(len.max(1), ALIGN).unwrap_or(AllocLayout::new::<u64>())
}

/// One device allocation; clones share it, and it is freed with the last one (queued work holds
/// its own clones, so `aclrtFree` never pulls memory from under a task).
#[derive(Clone)]
pub struct DeviceBuffer(Arc<Storage>);

impl fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DeviceBuffer({}, {} bytes)", self.0.id, self.0.len)
    }
}

impl BufferHandle for DeviceBuffer {
    fn id(&self) -> BufferId {
        self.0.id
    }

    fn len_bytes(&self) -> usize {
        self.0.len
    }
}

impl DeviceBuffer {
    /// `len` zeroed bytes of the emulated device `instance`, or `None` when the host has no
    /// memory for them.
    pub fn new(instance: InstanceId, len: usize) -> Option<Self> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        if len > isize::MAX as usize - ALIGN {
            return None;
        }
        // SAFETY: the layout has a non-zero size.
        let ptr = NonNull::new(unsafe { alloc::alloc_zeroed(layout(len)) })?;
        let id = BufferId { instance, index: NEXT.fetch_add(1, Ordering::Relaxed) };
        Some(Self(Arc::new(Storage { id, ptr, len })))
    }

    /// The address of byte `offset` (the device address of the allocation plus `offset`).
    pub fn element_ptr<T>(&self, offset: usize) -> *mut T {
        self.0.ptr.as_ptr().wrapping_add(offset * size_of::<T>()).cast()
    }
}

/// The emulator's resource types: its own buffers; its op descriptions name no stream or event.
#[derive(Copy, Clone, Debug)]
pub struct Mem;

/// A stream or event handle no emulator op description holds.
#[derive(Copy, Clone, Debug)]
pub struct NoHandle(InstanceId);

impl StreamHandle for NoHandle {
    fn id(&self) -> StreamId {
        StreamId { instance: self.0, index: 0 }
    }
}

impl EventHandle for NoHandle {
    fn id(&self) -> EventId {
        EventId { instance: self.0, index: 0 }
    }
}

impl Resources for Mem {
    type Stream = NoHandle;
    type Event = NoHandle;
    type Buffer = DeviceBuffer;
}
