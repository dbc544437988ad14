//! The raw backend trait: what a backend implements, and nothing a caller uses directly.
//!
//! A backend receives calls that the [`Device`](crate::device::Device) façade has already
//! checked: handles belong to the instance, ops are [`Validated`] (shapes, dtypes, aliasing, with
//! their sizes computed once), and checked mode and capture have seen the call. So a backend never
//! re-validates or re-derives a shape, and no backend can skip the façade's checks: only kda-core
//! can make a [`Validated`] op, and the façade does so for every op it hands a backend.
//!
//! What a backend owes the façade (the contract callers rely on is in [`crate::device`]):
//! - ops on one stream run in submission order; ops on different streams may overlap;
//! - [`Backend::record`] snapshots the work queued on the stream so far, [`Backend::wait`] orders
//!   later work on the stream after the event's most recent record *at the time of the wait* (a
//!   never-recorded event is a no-op);
//! - an op that fails while running fails its stream: later ops on it are skipped (and still
//!   count as complete for events), streams that waited on it fail with
//!   [`Error::DependencyFailed`], and the next [`Backend::synchronize`] returns the error and
//!   clears it;
//! - every buffer handle held by a queued op keeps its memory alive until the op has run;
//! - an imported buffer ([`Backend::import_buffer`]) keeps its owner alive as long as any handle
//!   to it does, and never frees the memory itself.

use std::any::Any;

use crate::error::{Error, Result};
use crate::graph::Graph;
pub use crate::op::Validated;
use crate::op::{HostFn, Op, OpDims};
use crate::resource::{BackendInfo, BufferHandle, BufferId, InstanceId, Resources};

/// A fresh allocation, and the freed buffer whose memory it reuses, if any (a caching
/// allocator's reuse, which checked mode orders after every use of the old buffer).
#[derive(Debug)]
pub struct Allocation<Buf> {
    pub buffer: Buf,
    pub reuses: Option<BufferId>,
}

impl<Buf> Allocation<Buf> {
    /// New memory, reusing nothing.
    pub fn fresh(buffer: Buf) -> Self {
        Self { buffer, reuses: None }
    }
}

/// How a captured graph is replayed on one backend: the streams standing in for its forked
/// streams (fork `i` is captured stream `i + 1`), the events standing in for its events, and
/// whether the backend runs the whole graph natively ([`Backend::launch_native_graph`]) instead
/// of having its nodes replayed one by one.
#[derive(Debug)]
pub struct GraphReplay<B: Resources> {
    pub forks: Vec<B::Stream>,
    pub events: Vec<B::Event>,
    pub native: bool,
}

/// A device: streams, events, memory, and validated ops queued on streams. Implemented by each
/// backend; used only through [`Device`](crate::device::Device).
pub trait Backend: Resources {
    /// Name, instance and capabilities.
    fn info(&self) -> BackendInfo;

    /// This instance's id; every handle it creates carries it.
    fn instance(&self) -> InstanceId;

    fn new_stream(&self) -> Result<Self::Stream>;

    fn new_event(&self) -> Result<Self::Event>;

    /// Snapshot the work queued on `stream` so far into `event`.
    fn record(&self, event: &Self::Event, stream: &Self::Stream) -> Result<()>;

    /// Order later work on `stream` after `event`'s most recent record.
    fn wait(&self, stream: &Self::Stream, event: &Self::Event) -> Result<()>;

    /// Block until the work queued on `stream` has finished; return and clear its pending
    /// execution error.
    fn synchronize(&self, stream: &Self::Stream) -> Result<()>;

    /// Allocate `bytes` bytes of device memory (zero-initialised is not promised).
    fn alloc(&self, bytes: usize) -> Result<Allocation<Self::Buffer>>;

    /// Wrap `len` bytes of memory someone else allocated (an engine's tensor) at `ptr` as a
    /// buffer, without a copy. The buffer never frees the memory; it keeps `owner` alive until
    /// its last handle (including those held by queued ops) is dropped. The default: this
    /// backend cannot import memory ([`Error::Unsupported`]).
    ///
    /// # Safety
    /// As [`Device::import_buffer`](crate::device::Device::import_buffer).
    unsafe fn import_buffer(
        &self,
        ptr: *mut u8,
        len: usize,
        owner: Box<dyn Any + Send + Sync>,
    ) -> Result<Self::Buffer> {
        let _ = (ptr, len, owner);
        Err(Error::Unsupported { backend: self.info().name, feature: "import_buffer".into() })
    }

    /// Use a stream someone else created (an engine's `CUstream`, `aclrtStream`, passed as an
    /// integer) as a stream of this instance. The default: this backend has no foreign streams
    /// ([`Error::Unsupported`]).
    ///
    /// # Safety
    /// As [`Device::import_stream`](crate::device::Device::import_stream).
    unsafe fn import_stream(&self, handle: usize) -> Result<Self::Stream> {
        let _ = handle;
        Err(Error::Unsupported { backend: self.info().name, feature: "import_stream".into() })
    }

    /// Release `buffer` in the order of `stream`. The default keeps the handle alive until the
    /// stream reaches this point; a caching allocator makes the memory reusable there instead.
    fn free(&self, stream: &Self::Stream, buffer: Self::Buffer) -> Result<()> {
        let hold = HostFn::new(move || {
            let _ = buffer.id();
            Ok(())
        });
        let op = Op::Host { name: "free", f: hold };
        self.submit(stream, "free", Validated::new(op, OpDims::None))
    }

    /// Queue a validated op on `stream`; `label` is the name the caller launched it under (for
    /// the backend's own traces and timelines).
    fn submit(&self, stream: &Self::Stream, label: &str, op: Validated<Self>) -> Result<()>;

    /// The handles a replay of `graph` from `origin` uses, made on its first replay and reused
    /// after. The default replays node by node on streams and events the graph keeps.
    fn prepare_graph(
        &self,
        graph: &Graph<Self>,
        origin: &Self::Stream,
    ) -> Result<GraphReplay<Self>> {
        let _ = origin;
        let (forks, events) = graph.replay_handles(|| self.new_stream(), || self.new_event())?;
        Ok(GraphReplay { forks, events, native: false })
    }

    /// Run `graph` on `origin` as one native graph (an ACL model, a CUDA graph), after the
    /// façade has checked the launch and shown its nodes to checked mode. Called only when
    /// [`Backend::prepare_graph`] said `native`.
    fn launch_native_graph(&self, graph: &Graph<Self>, origin: &Self::Stream) -> Result<()> {
        let _ = (graph, origin);
        Err(Error::Backend {
            backend: self.info().name,
            message: "this backend replays graphs node by node (prepare_graph said so)".into(),
        })
    }
}
