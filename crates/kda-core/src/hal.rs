//! The hardware abstraction layer: one [`Backend`] trait whose associated types name a backend's
//! streams, events and buffers, in the spirit of `wgpu-hal`'s `Api`.
//!
//! # Stream and event semantics (CUDA's and ACL's)
//!
//! - Every op names its stream; ops on one stream run in the order they were launched, ops on
//!   different streams may run concurrently unless ordered by events.
//! - [`Backend::record`] snapshots the work queued on a stream *so far*; the event completes once
//!   that work has finished.
//! - [`Backend::wait`] orders all work launched on the waiting stream afterwards after the
//!   snapshot of the event's **most recent record at the time of the wait**. Waiting on an event
//!   that was never recorded is a no-op; recording the event again later does not change what an
//!   earlier wait waits for.
//! - [`Backend::synchronize`] blocks the host until everything launched on the stream so far
//!   has finished.
//!
//! # When errors surface
//!
//! Bad arguments (shapes, dtypes, handles of another backend instance, views outside their
//! buffer) are rejected by the call that receives them, before anything is queued. An op that
//! fails while executing marks its stream failed: the error is returned by the next
//! [`Backend::synchronize`] of that stream (which then clears it), ops launched on that stream in
//! the meantime are skipped, and a stream that waits on the failed work fails with
//! [`Error::DependencyFailed`]. Nothing ever hangs because of a failure: skipped ops still count
//! as completed for event purposes.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::dtype::{DType, Element};
use crate::error::{Error, Result};
use crate::layout::Layout;
use crate::op::{DownloadSlot, Op};
use crate::tensor::Tensor;

/// Identifies one backend instance; handles carry it so that mixing instances is an error.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct InstanceId(u64);

impl InstanceId {
    /// A process-unique id for a new backend instance.
    pub fn fresh() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        Self(NEXT.fetch_add(1, Ordering::Relaxed))
    }
}

impl fmt::Display for InstanceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}", self.0)
    }
}

macro_rules! handle_id {
    ($(#[$doc:meta])* $name:ident, $prefix:literal) => {
        $(#[$doc])*
        #[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name {
            pub instance: InstanceId,
            pub index: u64,
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!($prefix, "{}"), self.index)
            }
        }
    };
}

handle_id!(
    /// Identifies a stream within its backend instance (`s0`, `s1`, …).
    StreamId,
    "s"
);
handle_id!(
    /// Identifies an event within its backend instance.
    EventId,
    "e"
);
handle_id!(
    /// Identifies a buffer within its backend instance.
    BufferId,
    "buf"
);

/// A backend's stream handle.
pub trait StreamHandle: Clone + Send + Sync + fmt::Debug + 'static {
    fn id(&self) -> StreamId;
}

/// A backend's event handle.
pub trait EventHandle: Clone + Send + Sync + fmt::Debug + 'static {
    fn id(&self) -> EventId;
}

/// A backend's device memory handle. Cloning shares the same memory; the memory is released when
/// the last handle, including those held by queued ops, is dropped.
pub trait BufferHandle: Clone + Send + Sync + fmt::Debug + 'static {
    fn id(&self) -> BufferId;
    fn len_bytes(&self) -> usize;
}

/// How a backend runs ops, as reported by [`Backend::info`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Capabilities {
    /// Ops on different streams really run at the same time.
    pub concurrent_streams: bool,
    /// Both projection GEMMs compete for one matrix unit, so the overlapped schedule keeps them
    /// serialised (see SCHEDULE.md). False on CPUs, where each stream has its own cores.
    pub shared_matrix_units: bool,
    /// A short description of the execution model (e.g. "one core per stream").
    pub execution: String,
    /// Host or device threads the backend computes with.
    pub threads: usize,
    /// Input dtypes the dense GEMM accepts.
    pub gemm_inputs: Vec<DType>,
}

/// A backend's name and capabilities.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BackendInfo {
    pub name: &'static str,
    pub instance: InstanceId,
    pub capabilities: Capabilities,
}

/// A device: streams, events, memory, and ops launched on streams.
///
/// Implementors provide the raw verbs; [`Backend::launch`] is the one entry point every op goes
/// through (validation, tracing, and later recording and capture all wrap it).
pub trait Backend: Send + Sync + fmt::Debug + Sized + 'static {
    type Stream: StreamHandle;
    type Event: EventHandle;
    type Buffer: BufferHandle;

    /// Name, instance and capabilities.
    fn info(&self) -> BackendInfo;

    /// This instance's id; every handle it creates carries it.
    fn instance(&self) -> InstanceId;

    fn new_stream(&self) -> Result<Self::Stream>;

    fn new_event(&self) -> Result<Self::Event>;

    /// Snapshot the work queued on `stream` so far into `event` (replacing any earlier record).
    fn record(&self, event: &Self::Event, stream: &Self::Stream) -> Result<()>;

    /// Order later work on `stream` after `event`'s most recent record (no-op if never recorded).
    fn wait(&self, stream: &Self::Stream, event: &Self::Event) -> Result<()>;

    /// Block until all work launched on `stream` has finished; returns the stream's pending
    /// execution error, if any.
    fn synchronize(&self, stream: &Self::Stream) -> Result<()>;

    /// Allocate `bytes` bytes of device memory (zero-initialised is not promised).
    fn alloc_buffer(&self, bytes: usize) -> Result<Self::Buffer>;

    /// Queue an already validated op on `stream`. Call [`Backend::launch`] instead.
    fn submit(&self, stream: &Self::Stream, op: Op<Self>) -> Result<()>;

    /// Validate `op`, open its tracing span and queue it on `stream`. Returns as soon as it is
    /// queued.
    fn launch(&self, stream: &Self::Stream, op: Op<Self>) -> Result<()> {
        let _span = tracing::trace_span!("launch", op = op.name(), stream = %stream.id()).entered();
        check_instance(self, "stream", stream.id().instance)?;
        op.validate(self.instance())?;
        self.submit(stream, op)
    }

    /// Allocate a dense tensor of `dtype` and `shape`.
    fn alloc(&self, dtype: DType, shape: &[usize]) -> Result<Tensor<Self>> {
        let layout = Layout::contiguous(dtype, shape);
        let bytes = layout
            .numel()
            .checked_mul(dtype.size_bytes())
            .ok_or(Error::OutOfMemory { bytes: usize::MAX })?;
        Tensor::new(self.alloc_buffer(bytes)?, layout)
    }

    /// Queue a copy of host `data` into `dst` on `stream` (the data is staged, so the caller may
    /// drop it at once).
    fn upload<T: Element>(
        &self,
        stream: &Self::Stream,
        dst: &Tensor<Self>,
        data: &[T],
    ) -> Result<()> {
        if T::DTYPE != dst.dtype() {
            return Err(Error::DType {
                op: "upload",
                param: "data",
                expected: dst.dtype().to_string(),
                actual: T::DTYPE,
            });
        }
        let bytes: &[u8] = bytemuck::cast_slice(data);
        self.launch(stream, Op::Upload { dst: dst.clone(), data: bytes.into() })
    }

    /// Copy `src` to the host once the work queued on `stream` before it has finished (this
    /// synchronizes `stream`).
    fn download<T: Element>(&self, stream: &Self::Stream, src: &Tensor<Self>) -> Result<Vec<T>> {
        if T::DTYPE != src.dtype() {
            return Err(Error::DType {
                op: "download",
                param: "output",
                expected: src.dtype().to_string(),
                actual: T::DTYPE,
            });
        }
        let slot = DownloadSlot::default();
        self.launch(stream, Op::Download { src: src.clone(), slot: slot.clone() })?;
        self.synchronize(stream)?;
        let bytes = slot.take().ok_or(Error::StreamLost { stream: stream.id() })?;
        Ok(bytemuck::pod_collect_to_vec(&bytes))
    }
}

/// Reject a handle created by another backend instance.
pub fn check_instance<B: Backend>(
    backend: &B,
    what: &'static str,
    handle: InstanceId,
) -> Result<()> {
    let own = backend.instance();
    if handle == own { Ok(()) } else { Err(Error::ForeignHandle { what, handle, backend: own }) }
}
