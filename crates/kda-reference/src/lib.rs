//! `kda-reference`: the CPU backend, and the numerical oracle every other backend is compared
//! with.
//!
//! Streams are real: each is a worker thread with a FIFO queue, [`Device::launch`](kda_core::Device::launch) returns as
//! soon as the op is queued, and events are snapshots of a stream's completion counter (see
//! [`stream`]). So overlap is real, ordering bugs are real, and the sanitizer has something to
//! catch. Two execution modes ([`ExecutionMode`]): one core per stream (each op runs on its
//! stream's thread alone, which shows overlap), or a shared thread pool that every op uses for
//! intra-op parallelism (throughput). In the first, a stream waiting on another behaves as a
//! device stream does: it costs the other stream nothing while it waits (it sleeps until the
//! awaited op is forecast to end) and starts within microseconds of the completion (it polls
//! through the last moments).
//!
//! Errors follow [`kda_core::hal`]: argument errors at the call, execution failures at the next
//! `synchronize` of the stream.

#![deny(unsafe_op_in_unsafe_fn)]

mod buffer;
mod exclusion;
mod forecast;
mod kernels;
pub mod peak;
mod progress;
pub mod stream;
mod timeline;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use kda_core::hal::Allocation;
use kda_core::sanitize::checked_from_env;
use kda_core::timeline::Timeline;
use kda_core::{
    Backend, BackendInfo, BufferId, Capabilities, DType, Device, Error, EventId, InstanceId,
    NativeOps, Resources, Result, StreamId, Validated,
};

pub use buffer::RefBuffer;
use kernels::Exec;
use stream::WaitPolicy;
pub use stream::{Jitter, RefEvent, RefStream};

/// The most threads a shared pool may have: far more than any host's cores, and a bound on
/// what a number from the command line can make the backend spawn.
pub const MAX_POOL_THREADS: usize = 1024;

/// How the reference backend uses the host's cores.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum ExecutionMode {
    /// Each op runs single-threaded on its stream's worker: one core per stream.
    PerStream,
    /// Ops parallelise across one pool of `threads` threads shared by all streams.
    SharedPool { threads: usize },
}

/// Options for [`ReferenceBackend::with_options`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReferenceOptions {
    pub mode: ExecutionMode,
    /// Random delays injected before every queued item (tests of event ordering).
    pub jitter: Option<Jitter>,
    /// Checked mode: record every call and reject ops that race (see [`kda_core::sanitize`]).
    pub checked: bool,
    /// Time every executed op (stream, label, start, end): [`ReferenceBackend::timeline`].
    pub timeline: bool,
    /// How a stream waits for another's work.
    pub wait: WaitStrategy,
}

/// How a stream's worker waits for another stream's work.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub enum WaitStrategy {
    /// Sleep until the awaited work completes (a futex wake-up later).
    #[default]
    Block,
    /// In one-core-per-stream mode, start within microseconds of the completion without slowing
    /// the awaited op: for timing the overlapped schedules (`forecast.rs` says what it buys).
    /// Shared-pool mode always blocks.
    Forecast,
}

impl Default for ReferenceOptions {
    /// One core per stream, no jitter, checked mode as `KDA_SANITIZE` says (off when unset), no
    /// timeline.
    fn default() -> Self {
        Self {
            mode: ExecutionMode::PerStream,
            jitter: None,
            checked: checked_from_env(false),
            timeline: false,
            wait: WaitStrategy::Block,
        }
    }
}

/// The CPU reference backend. Cheap to clone; clones are the same instance.
#[derive(Clone, Debug)]
pub struct ReferenceBackend {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    instance: InstanceId,
    options: ReferenceOptions,
    exec: Exec,
    timeline: Option<Arc<timeline::Recorder>>,
    next_stream: AtomicU64,
    next_event: AtomicU64,
    next_buffer: AtomicU64,
}

impl ReferenceBackend {
    /// A device over a new reference backend: one core per stream, no jitter, checked mode as
    /// `KDA_SANITIZE` says.
    #[allow(clippy::new_ret_no_self, reason = "the backend is used through its façade")]
    pub fn new() -> Device<Self> {
        let options = ReferenceOptions::default();
        let checked = options.checked;
        let inner = Inner::new(options, Exec::serial());
        Device::with_checked(Self { inner: Arc::new(inner) }, checked)
    }

    /// A device over a new reference backend with `options`.
    pub fn with_options(options: ReferenceOptions) -> Result<Device<Self>> {
        let exec = match options.mode {
            ExecutionMode::PerStream => Exec::serial(),
            ExecutionMode::SharedPool { threads } => {
                if threads > MAX_POOL_THREADS {
                    return Err(Error::Param {
                        op: "reference backend",
                        param: "threads",
                        expected: format!("at most {MAX_POOL_THREADS}"),
                        actual: threads.to_string(),
                    });
                }
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads.max(1))
                    .thread_name(|i| format!("kda-ref-pool-{i}"))
                    .build()
                    .map_err(|e| Error::Backend {
                        backend: "reference",
                        message: format!("cannot start a pool of {threads} threads: {e}"),
                    })?;
                Exec::pooled(pool)
            }
        };
        let checked = options.checked;
        Ok(Device::with_checked(Self { inner: Arc::new(Inner::new(options, exec)) }, checked))
    }

    pub fn options(&self) -> &ReferenceOptions {
        &self.inner.options
    }

    /// The ops executed so far with their times (empty unless [`ReferenceOptions::timeline`]).
    pub fn timeline(&self) -> Timeline {
        self.inner.timeline.as_ref().map(|t| t.snapshot()).unwrap_or_default()
    }

    /// Forget the spans recorded so far.
    pub fn clear_timeline(&self) {
        if let Some(t) = &self.inner.timeline {
            t.clear();
        }
    }
}

impl Inner {
    fn new(options: ReferenceOptions, exec: Exec) -> Self {
        Self {
            instance: InstanceId::fresh(),
            timeline: options.timeline.then(|| Arc::new(timeline::Recorder::new())),
            options,
            exec,
            next_stream: AtomicU64::new(0),
            next_event: AtomicU64::new(0),
            next_buffer: AtomicU64::new(0),
        }
    }

    fn next(&self, counter: &AtomicU64) -> u64 {
        counter.fetch_add(1, Ordering::Relaxed)
    }
}

impl Resources for ReferenceBackend {
    type Stream = RefStream;
    type Event = RefEvent;
    type Buffer = RefBuffer;
}

impl Backend for ReferenceBackend {
    fn info(&self) -> BackendInfo {
        let execution = match self.inner.options.mode {
            ExecutionMode::PerStream => "one core per stream".to_string(),
            ExecutionMode::SharedPool { .. } => "shared thread pool".to_string(),
        };
        BackendInfo {
            name: "reference",
            instance: self.inner.instance,
            capabilities: Capabilities {
                concurrent_streams: true,
                shared_matrix_units: false,
                bf16_core: false,
                device_faults_are_fatal: false,
                execution,
                threads: self.inner.exec.threads(),
                gemm_inputs: vec![DType::BF16, DType::F16, DType::F32],
                // Every op, MXFP8 included, is implemented on the CPU.
                native: NativeOps::ALL,
            },
        }
    }

    fn instance(&self) -> InstanceId {
        self.inner.instance
    }

    fn new_stream(&self) -> Result<RefStream> {
        let inner = &self.inner;
        let id = StreamId { instance: inner.instance, index: inner.next(&inner.next_stream) };
        let wait = match inner.options.mode {
            ExecutionMode::PerStream if inner.options.wait == WaitStrategy::Forecast => {
                WaitPolicy::Spin(forecast::SPIN_LIMIT)
            }
            // In shared-pool mode the cores belong to the pool: a poller would steal them.
            _ => WaitPolicy::Block,
        };
        RefStream::spawn(id, inner.exec.clone(), wait, inner.options.jitter, inner.timeline.clone())
    }

    fn new_event(&self) -> Result<RefEvent> {
        let inner = &self.inner;
        Ok(RefEvent::new(EventId {
            instance: inner.instance,
            index: inner.next(&inner.next_event),
        }))
    }

    fn record(&self, event: &RefEvent, stream: &RefStream) -> Result<()> {
        event.set(stream.snapshot());
        Ok(())
    }

    fn wait(&self, stream: &RefStream, event: &RefEvent) -> Result<()> {
        if let Some(snapshot) = event.get() {
            stream.wait_for(&snapshot);
        }
        Ok(())
    }

    fn synchronize(&self, stream: &RefStream) -> Result<()> {
        stream.synchronize()
    }

    fn alloc(&self, bytes: usize) -> Result<Allocation<RefBuffer>> {
        let inner = &self.inner;
        let id = BufferId { instance: inner.instance, index: inner.next(&inner.next_buffer) };
        RefBuffer::new(id, bytes).map(Allocation::fresh)
    }

    unsafe fn import_buffer(
        &self,
        ptr: *mut u8,
        len: usize,
        owner: Box<dyn std::any::Any + Send + Sync>,
    ) -> Result<RefBuffer> {
        let inner = &self.inner;
        let id = BufferId { instance: inner.instance, index: inner.next(&inner.next_buffer) };
        // SAFETY: the importer's contract (`Device::import_buffer`) is `RefBuffer::import`'s.
        unsafe { RefBuffer::import(id, ptr, len, owner) }
    }

    fn submit(&self, stream: &RefStream, label: &str, op: Validated<Self>) -> Result<()> {
        // Only the façade makes a `Validated` op: the kernels' unsafe preconditions (no aliasing,
        // shapes agree) hold for every op that reaches here.
        stream.submit(op, self.inner.timeline.is_some().then_some(label));
        Ok(())
    }
}
