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
use crate::op::{DownloadSlot, HostFn, Op};
use crate::sanitize::{CaptureError, Graph, Instrumentation, Node};
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
/// Implementors provide the raw verbs (`raw_*`, [`Backend::submit`]) and an
/// [`Instrumentation`]; callers use the provided verbs, which validate arguments, open tracing
/// spans, and route every call through the instrumentation (checked-mode recording and hazard
/// analysis, graph capture) before the raw verb runs. [`Backend::launch`] is the one entry point
/// for ops.
pub trait Backend: Clone + Send + Sync + fmt::Debug + Sized + 'static {
    type Stream: StreamHandle;
    type Event: EventHandle;
    type Buffer: BufferHandle;

    /// Name, instance and capabilities.
    fn info(&self) -> BackendInfo;

    /// This instance's id; every handle it creates carries it.
    fn instance(&self) -> InstanceId;

    /// This instance's recorder, analyser and capture state.
    fn instrumentation(&self) -> &Instrumentation<Self>;

    fn new_stream(&self) -> Result<Self::Stream>;

    fn new_event(&self) -> Result<Self::Event>;

    /// Backend part of [`Backend::record`]; arguments are already checked.
    fn raw_record(&self, event: &Self::Event, stream: &Self::Stream) -> Result<()>;

    /// Backend part of [`Backend::wait`]; arguments are already checked.
    fn raw_wait(&self, stream: &Self::Stream, event: &Self::Event) -> Result<()>;

    /// Backend part of [`Backend::synchronize`]; arguments are already checked.
    fn raw_synchronize(&self, stream: &Self::Stream) -> Result<()>;

    /// Allocate `bytes` bytes of device memory (zero-initialised is not promised).
    fn raw_alloc(&self, bytes: usize) -> Result<Self::Buffer>;

    /// Release `buffer` in the order of `stream`. The default drops the handle when the stream
    /// reaches this point; a caching allocator makes the memory reusable there instead.
    fn raw_free(&self, stream: &Self::Stream, buffer: Self::Buffer) -> Result<()> {
        let hold = HostFn::new(move || {
            let _ = buffer.id();
            Ok(())
        });
        self.submit(stream, "free", Op::Host { name: "free", f: hold })
    }

    /// Queue an already validated op on `stream`; `label` is the name the caller launched it
    /// under (for the backend's own traces and timelines). Call [`Backend::launch`] instead.
    fn submit(&self, stream: &Self::Stream, label: &str, op: Op<Self>) -> Result<()>;

    /// The auxiliary stream the core's overlapped schedules fork work onto: created on the first
    /// call, then the same stream for every caller of this instance (every layer), as the seeds'
    /// one BFG stream per process. Kept in [`Backend::instrumentation`].
    fn aux_stream(&self) -> Result<Self::Stream> {
        let slot = self.instrumentation().aux_stream();
        if let Some(stream) = slot.get() {
            return Ok(stream.clone());
        }
        let fresh = self.new_stream()?;
        // Two threads may race here; the stream that lost is dropped unused.
        Ok(slot.get_or_init(|| fresh).clone())
    }

    /// Snapshot the work queued on `stream` so far into `event` (replacing any earlier record).
    fn record(&self, event: &Self::Event, stream: &Self::Stream) -> Result<()> {
        check_instance(self, "event", event.id().instance)?;
        check_instance(self, "stream", stream.id().instance)?;
        self.instrumentation().record(event.id(), stream.id(), || self.raw_record(event, stream))
    }

    /// Order later work on `stream` after `event`'s most recent record (no-op if never recorded).
    fn wait(&self, stream: &Self::Stream, event: &Self::Event) -> Result<()> {
        check_instance(self, "event", event.id().instance)?;
        check_instance(self, "stream", stream.id().instance)?;
        self.instrumentation().wait(stream.id(), event.id(), || self.raw_wait(stream, event))
    }

    /// Block until all work launched on `stream` has finished; returns the stream's pending
    /// execution error, if any.
    fn synchronize(&self, stream: &Self::Stream) -> Result<()> {
        blocking_sync(self, stream, "synchronize")
    }

    /// Allocate `bytes` bytes of device memory.
    fn alloc_buffer(&self, bytes: usize) -> Result<Self::Buffer> {
        let buffer = self.raw_alloc(bytes)?;
        if self.instrumentation().is_checked() {
            self.instrumentation().alloc(buffer.id(), bytes);
        }
        Ok(buffer)
    }

    /// Allocate a dense tensor of `dtype` and `shape`.
    fn alloc(&self, dtype: DType, shape: &[usize]) -> Result<Tensor<Self>> {
        let layout = Layout::contiguous(dtype, shape);
        let bytes = layout.size_bytes()?;
        Tensor::new(self.alloc_buffer(bytes)?, layout)
    }

    /// Release `buffer` in the order of `stream`: work on `stream` after this point may reuse its
    /// memory, so every use on another stream must be ordered before it (checked mode reports
    /// [`HazardKind::FreeWhileInUse`](crate::sanitize::HazardKind::FreeWhileInUse) otherwise).
    fn free(&self, stream: &Self::Stream, buffer: Self::Buffer) -> Result<()> {
        check_instance(self, "stream", stream.id().instance)?;
        check_instance(self, "buffer", buffer.id().instance)?;
        let id = buffer.id();
        self.instrumentation().free(stream.id(), id, || self.raw_free(stream, buffer))
    }

    /// Validate `op`, open its tracing span and queue it on `stream` under its own name. Returns
    /// as soon as it is queued.
    fn launch(&self, stream: &Self::Stream, op: Op<Self>) -> Result<()> {
        let label = op.name();
        self.launch_labeled(stream, label, op)
    }

    /// [`Backend::launch`] under a label of the caller's (the name diagnostics and traces use,
    /// e.g. `project_bfg`).
    fn launch_labeled(&self, stream: &Self::Stream, label: &str, op: Op<Self>) -> Result<()> {
        let _span = tracing::trace_span!("launch", op = label, stream = %stream.id()).entered();
        check_instance(self, "stream", stream.id().instance)?;
        op.validate(self.instance())?;
        let instrumentation = self.instrumentation();
        if !instrumentation.is_active() {
            return self.submit(stream, label, op);
        }
        instrumentation.launch(stream.id(), label, op, |op| self.submit(stream, label, op))
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
        blocking_sync(self, stream, "download")?;
        let bytes = slot.take().ok_or(Error::StreamLost { stream: stream.id() })?;
        Ok(bytemuck::pod_collect_to_vec(&bytes))
    }

    /// Start capturing work on `origin` (and on every stream that joins by waiting on a
    /// captured event) into a graph instead of running it.
    fn begin_capture(&self, origin: &Self::Stream) -> Result<()> {
        check_instance(self, "stream", origin.id().instance)?;
        self.instrumentation().begin_capture(origin.id())
    }

    /// End the capture begun on `origin`; fails, naming the stream, unless every captured stream
    /// was joined back to `origin` after its last work and no captured stream blocked the host
    /// or waited on an event recorded outside the capture.
    fn end_capture(&self, origin: &Self::Stream) -> Result<Graph<Self>> {
        check_instance(self, "stream", origin.id().instance)?;
        self.instrumentation().end_capture(origin.id(), self.instance())
    }

    /// Run a captured graph on `stream` (its origin), with the captured order: forked streams
    /// and events are this instance's own, created on the first launch and reused after.
    fn launch_graph(&self, graph: &Graph<Self>, stream: &Self::Stream) -> Result<()> {
        check_instance(self, "stream", stream.id().instance)?;
        if graph.instance != self.instance() {
            return Err(CaptureError::ForeignGraph {
                graph: graph.instance,
                backend: self.instance(),
            }
            .into());
        }
        let (forks, events) = graph.replay_handles(self)?;
        let stream_of = |i: usize| if i == 0 { stream } else { &forks[i - 1] };
        for node in &graph.nodes {
            match node {
                Node::Launch { stream, label, op } => {
                    self.launch_labeled(stream_of(*stream), label, Op::clone(op))?
                }
                Node::Record { stream, event } => {
                    self.record(&events[*event], stream_of(*stream))?
                }
                Node::Wait { stream, event } => self.wait(stream_of(*stream), &events[*event])?,
            }
        }
        Ok(())
    }
}

/// A host block on `stream`, named by the call that blocks.
fn blocking_sync<B: Backend>(backend: &B, stream: &B::Stream, call: &'static str) -> Result<()> {
    check_instance(backend, "stream", stream.id().instance)?;
    let instrumentation = backend.instrumentation();
    if !instrumentation.is_active() {
        return backend.raw_synchronize(stream);
    }
    instrumentation.synchronize(stream.id(), call, || backend.raw_synchronize(stream))
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
