//! The façade every caller uses: [`Device`], over any [`Backend`].
//!
//! The schedules, the layer, the CLI and engines hold a `Device<B>`; backends implement only the
//! raw [`Backend`] trait. Every call goes through here once, for every backend: handles are
//! checked against the instance, ops are validated (their sizes computed once and handed to the
//! backend with the op, see [`Validated`]), a `tracing` span is opened, checked mode records and
//! analyses the call, and an open capture takes it instead of the backend. Nothing a backend
//! implements can skip these steps.
//!
//! # The contract
//!
//! **Streams and events** (CUDA's and ACL's semantics). Every op names its stream; ops on one
//! stream run in launch order, ops on different streams may run concurrently unless events order
//! them. [`Device::record`] snapshots the work queued on a stream *so far*; [`Device::wait`]
//! orders all work launched on the waiting stream afterwards after the snapshot of the event's
//! **most recent record at the time of the wait** (waiting on a never-recorded event is a no-op;
//! recording it again later does not move an earlier wait). [`Device::synchronize`] blocks the
//! host until everything launched on the stream so far has finished.
//!
//! **What the caller must order.** Two ops on different streams that touch the same bytes, at
//! least one of them writing, must be ordered by a record/wait chain or a host synchronize; so
//! must a [`Device::free`] after every use of the buffer on another stream. With checked mode on
//! (`KDA_SANITIZE=1`, or the backend's option), an unordered pair is not run: the launch returns
//! [`Error::Hazard`] naming both ops, streams, the buffer and the bytes. With checked mode off
//! the pair runs unordered: its results are unspecified (on a device, whatever the hardware
//! does). Every backend keeps this memory-safe: the reference backend serialises conflicting
//! byte ranges of its host memory at run time (see `kda-reference`'s buffer module), so an
//! ordering bug is a wrong result, never undefined behaviour.
//!
//! **Buffer lifetimes.** A tensor's buffer handle is reference counted; every op queued on a
//! stream holds handles to the buffers it reads and writes until it has run, so dropping a tensor
//! right after launching work on it is safe. [`Device::free`] is the explicit, stream-ordered
//! release for caching allocators.
//!
//! **When errors surface.** Bad arguments (shapes, dtypes, views outside their buffer, handles
//! of another instance) are returned by the call that received them, before anything is queued.
//! An op that fails while running is returned by the next [`Device::synchronize`] of its stream;
//! ops launched on that stream in the meantime are skipped, and a stream that waited on the
//! failed work fails with [`Error::DependencyFailed`]. Nothing hangs because of a failure.
//!
//! **Capture.** Between [`Device::begin_capture`] and [`Device::end_capture`], work on the origin
//! and on every stream that joins it (by waiting on an event recorded inside the capture) is not
//! run but recorded into a [`Graph`]; ending the capture checks that every forked stream was
//! joined back after its last work and that no captured stream blocked the host.
//! [`Device::launch_graph`] replays it (natively where the backend can).

mod capture;
mod import;
mod instrumentation;

use std::fmt;
use std::sync::Arc;

pub use import::retention;
pub use instrumentation::Instrumentation;

use crate::dtype::{DType, Element};
use crate::error::{CaptureError, Error, Result};
use crate::graph::{Graph, Node};
use crate::hal::{Allocation, Backend, Validated};
use crate::layout::Layout;
use crate::op::{DownloadSlot, Op};
use crate::resource::{BackendInfo, BufferHandle, EventHandle, InstanceId, StreamHandle, StreamId};
use crate::sanitize::checked_from_env;
use crate::tensor::Tensor;

/// A backend behind the one checked entry point. Cheap to clone; clones are the same instance.
pub struct Device<B: Backend> {
    inner: Arc<Inner<B>>,
}

struct Inner<B: Backend> {
    raw: B,
    instrumentation: Instrumentation<B>,
}

impl<B: Backend> Clone for Device<B> {
    fn clone(&self) -> Self {
        Self { inner: Arc::clone(&self.inner) }
    }
}

impl<B: Backend> fmt::Debug for Device<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Device")
            .field("raw", &self.inner.raw)
            .field("checked", &self.inner.instrumentation.is_checked())
            .finish()
    }
}

impl<B: Backend> Device<B> {
    /// The façade over `raw`, in checked mode if `KDA_SANITIZE` says so.
    pub fn new(raw: B) -> Self {
        Self::with_checked(raw, checked_from_env(false))
    }

    /// The façade over `raw`, in checked mode or not. The exclusive-unit rules start off; a
    /// caller that wants them sets them on [`Device::instrumentation`] (e.g.
    /// [`ExclusiveUnits::from_capabilities`](crate::sanitize::ExclusiveUnits::from_capabilities)).
    pub fn with_checked(raw: B, checked: bool) -> Self {
        let instrumentation = Instrumentation::new(checked);
        Self { inner: Arc::new(Inner { raw, instrumentation }) }
    }

    /// The backend itself, for what is its own (a timeline, an emulator's counters). Its raw
    /// verbs bypass checked mode and capture; submitting needs a [`Validated`] op, which only
    /// this façade makes.
    pub fn raw(&self) -> &B {
        &self.inner.raw
    }

    /// Name, instance and capabilities.
    pub fn info(&self) -> BackendInfo {
        self.inner.raw.info()
    }

    /// This instance's id; every handle it creates carries it.
    pub fn instance(&self) -> InstanceId {
        self.inner.raw.instance()
    }

    /// The recorder: checked mode's log and hazards, the exclusive-unit rules.
    pub fn instrumentation(&self) -> &Instrumentation<B> {
        &self.inner.instrumentation
    }

    /// Reject a handle (named `what` in the error) made by another instance.
    pub fn check_instance(&self, what: &'static str, handle: InstanceId) -> Result<()> {
        let own = self.instance();
        if handle == own {
            Ok(())
        } else {
            Err(Error::ForeignHandle { what, handle, backend: own })
        }
    }

    pub fn new_stream(&self) -> Result<B::Stream> {
        self.inner.raw.new_stream()
    }

    pub fn new_event(&self) -> Result<B::Event> {
        self.inner.raw.new_event()
    }

    /// Snapshot the work queued on `stream` so far into `event` (replacing any earlier record).
    pub fn record(&self, event: &B::Event, stream: &B::Stream) -> Result<()> {
        self.check_instance("event", event.id().instance)?;
        self.check_instance("stream", stream.id().instance)?;
        let raw = &self.inner.raw;
        self.instrumentation().record(event.id(), stream.id(), || raw.record(event, stream))
    }

    /// Order later work on `stream` after `event`'s most recent record (no-op if never recorded).
    pub fn wait(&self, stream: &B::Stream, event: &B::Event) -> Result<()> {
        self.check_instance("event", event.id().instance)?;
        self.check_instance("stream", stream.id().instance)?;
        let raw = &self.inner.raw;
        self.instrumentation().wait(stream.id(), event.id(), || raw.wait(stream, event))
    }

    /// Block until all work launched on `stream` has finished; returns the stream's pending
    /// execution error, if any.
    pub fn synchronize(&self, stream: &B::Stream) -> Result<()> {
        self.blocking_sync(stream, "synchronize")
    }

    /// A host block on `stream`, named by the call that blocks.
    fn blocking_sync(&self, stream: &B::Stream, call: &'static str) -> Result<()> {
        self.check_instance("stream", stream.id().instance)?;
        let raw = &self.inner.raw;
        let instrumentation = self.instrumentation();
        if !instrumentation.is_active() {
            return raw.synchronize(stream);
        }
        instrumentation.synchronize(stream.id(), call, || raw.synchronize(stream))
    }

    /// Allocate `bytes` bytes of device memory.
    pub fn alloc_buffer(&self, bytes: usize) -> Result<B::Buffer> {
        let Allocation { buffer, reuses } = self.inner.raw.alloc(bytes)?;
        let instrumentation = self.instrumentation();
        if instrumentation.is_checked() {
            instrumentation.alloc(buffer.id(), bytes);
            if let Some(previous) = reuses {
                instrumentation.reuse(buffer.id(), previous)?;
            }
        }
        Ok(buffer)
    }

    /// Allocate a dense tensor of `dtype` and `shape`.
    pub fn alloc(&self, dtype: DType, shape: &[usize]) -> Result<Tensor<B>> {
        let layout = Layout::contiguous(dtype, shape);
        let bytes = layout.size_bytes()?;
        Tensor::new(self.alloc_buffer(bytes)?, layout)
    }

    /// Release `buffer` in the order of `stream`: work on `stream` after this point may reuse its
    /// memory, so every use on another stream must be ordered before it (checked mode reports
    /// [`HazardKind::FreeWhileInUse`](crate::sanitize::HazardKind::FreeWhileInUse) otherwise).
    pub fn free(&self, stream: &B::Stream, buffer: B::Buffer) -> Result<()> {
        self.check_instance("stream", stream.id().instance)?;
        self.check_instance("buffer", buffer.id().instance)?;
        let id = buffer.id();
        let raw = &self.inner.raw;
        self.instrumentation().free(stream.id(), id, || raw.free(stream, buffer))
    }

    /// Validate `op`, open its tracing span and queue it on `stream` under its own name. Returns
    /// as soon as it is queued.
    pub fn launch(&self, stream: &B::Stream, op: Op<B>) -> Result<()> {
        let label = op.name();
        self.launch_labeled(stream, label, op)
    }

    /// [`Device::launch`] under a label of the caller's (the name diagnostics and traces use,
    /// e.g. `project_bfg`).
    pub fn launch_labeled(&self, stream: &B::Stream, label: &str, op: Op<B>) -> Result<()> {
        let _span = tracing::trace_span!("launch", op = label, stream = %stream.id()).entered();
        self.check_instance("stream", stream.id().instance)?;
        let op = op.validate_for(self.instance())?;
        let raw = &self.inner.raw;
        let instrumentation = self.instrumentation();
        if !instrumentation.is_active() {
            return raw.submit(stream, label, op);
        }
        instrumentation.launch(stream.id(), label, op, |op| raw.submit(stream, label, op))
    }

    /// Queue a copy of host `data` into `dst` on `stream` (the data is staged, so the caller may
    /// drop it at once).
    pub fn upload<T: Element>(
        &self,
        stream: &B::Stream,
        dst: &Tensor<B>,
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
    pub fn download<T: Element>(&self, stream: &B::Stream, src: &Tensor<B>) -> Result<Vec<T>> {
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
        self.blocking_sync(stream, "download")?;
        let bytes = slot.take().ok_or(Error::StreamLost { stream: stream.id() })?;
        Ok(bytemuck::pod_collect_to_vec(&bytes))
    }

    /// Start capturing work on `origin` (and on every stream that joins by waiting on a
    /// captured event) into a graph instead of running it.
    pub fn begin_capture(&self, origin: &B::Stream) -> Result<()> {
        self.check_instance("stream", origin.id().instance)?;
        self.instrumentation().begin_capture(origin.id())
    }

    /// End the capture begun on `origin`; fails, naming the stream, unless every captured stream
    /// was joined back to `origin` after its last work and no captured stream blocked the host
    /// or waited on an event recorded outside the capture.
    pub fn end_capture(&self, origin: &B::Stream) -> Result<Graph<B>> {
        self.check_instance("stream", origin.id().instance)?;
        self.instrumentation().end_capture(origin.id(), self.instance())
    }

    /// Run a captured graph on `stream` (its origin), with the captured order: forked streams
    /// and events are this instance's own, created on the first launch and reused after. A
    /// backend with native graphs runs it as one; otherwise its nodes are replayed through this
    /// façade. Either way checked mode sees every node, and a capture open on `stream` takes
    /// them.
    pub fn launch_graph(&self, graph: &Graph<B>, stream: &B::Stream) -> Result<()> {
        self.check_instance("stream", stream.id().instance)?;
        if graph.instance() != self.instance() {
            return Err(CaptureError::ForeignGraph {
                graph: graph.instance(),
                backend: self.instance(),
            }
            .into());
        }
        let _span = tracing::trace_span!("launch_graph", graph = graph.id(), stream = %stream.id())
            .entered();
        let raw = &self.inner.raw;
        let replay = raw.prepare_graph(graph, stream)?;
        let stream_of = |i: usize| if i == 0 { stream } else { &replay.forks[i - 1] };
        if !replay.native {
            for node in graph.nodes() {
                match node {
                    Node::Launch { stream, label, op } => {
                        self.launch_labeled(stream_of(*stream), label, op.op().clone())?
                    }
                    Node::Record { stream, event } => {
                        self.record(&replay.events[*event], stream_of(*stream))?
                    }
                    Node::Wait { stream, event } => {
                        self.wait(stream_of(*stream), &replay.events[*event])?
                    }
                }
            }
            return Ok(());
        }
        if self.show_graph(graph, &replay.events, stream_of)? {
            raw.launch_native_graph(graph, stream)?;
        }
        Ok(())
    }

    /// Show a natively launched graph's nodes to checked mode (and to a capture open on its
    /// origin, which takes them). Returns whether the backend is to run the graph: not when a
    /// capture took it.
    fn show_graph<'a>(
        &self,
        graph: &Graph<B>,
        events: &[B::Event],
        stream_of: impl Fn(usize) -> &'a B::Stream,
    ) -> Result<bool>
    where
        B: 'a,
    {
        let instrumentation = self.instrumentation();
        if !instrumentation.is_active() {
            return Ok(true);
        }
        let mut run = false;
        for node in graph.nodes() {
            match node {
                Node::Launch { stream, label, op } => {
                    let s: StreamId = stream_of(*stream).id();
                    instrumentation.launch(s, label, Validated::clone(op), |_| {
                        run = true;
                        Ok(())
                    })?;
                }
                Node::Record { stream, event } => {
                    let e = events[*event].id();
                    instrumentation.record(e, stream_of(*stream).id(), || {
                        run = true;
                        Ok(())
                    })?;
                }
                Node::Wait { stream, event } => {
                    let e = events[*event].id();
                    instrumentation.wait(stream_of(*stream).id(), e, || {
                        run = true;
                        Ok(())
                    })?;
                }
            }
        }
        Ok(run)
    }
}
