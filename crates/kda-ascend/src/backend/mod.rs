//! The HAL over ACL: [`AscendBackend`] and its stream, event and buffer handles.

mod acl;
mod capture;
mod descriptor;
mod engine;
mod host;
mod kernel;
mod memory;
mod ops;

use std::any::Any;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};

use kda_core::graph::Graph;
use kda_core::hal::{Allocation, GraphReplay};
use kda_core::{
    Backend, BackendInfo, BufferId, Capabilities, DType, Device, Error, EventHandle, EventId,
    InstanceId, NativeOps, Resources, Result, StreamHandle, StreamId, Validated,
};

use self::acl::{RawEvent, RawStream};
pub use self::capture::AclGraph;
use self::host::{Failure, Gate, Held};
pub use self::memory::AscendBuffer;
use crate::error::AscendError;
use crate::kernels::tiling::Chip;
use crate::options::{AscendOptions, MxGemmPath};

/// The Ascend backend. Cheap to clone; clones are the same instance.
#[derive(Clone, Debug)]
pub struct AscendBackend {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    instance: InstanceId,
    options: AscendOptions,
    chip: Chip,
    /// Whether the MX ops use aclnn (`true`) or the emulation path.
    native_mx: bool,
    /// Whether this CANN has `aclnnChunkKdaFwd` (the bf16 prefill core).
    vendor_chunk: bool,
    /// The optional CANN symbols this installation lacks (capabilities absent here).
    absent: Vec<&'static str>,
    pool: Arc<memory::Pool>,
    kernels: kernel::Kernels,
    /// What `launch_graph` built for each graph (its ACL model), by graph id.
    graphs: capture::GraphCache,
    /// Engines' streams imported into this instance (`engine`).
    imported: engine::Imported,
    next_stream: AtomicU64,
    next_event: AtomicU64,
    next_buffer: AtomicU64,
}

/// Task names kept for failure reports on a stream that is never synchronized by kda.
const MAX_TASK_NAMES: usize = 4096;

/// A stream: the ACL stream, its host-side failure state and held work (see `host`), and what
/// its queued work keeps alive until the stream is synchronized.
#[derive(Clone, Debug)]
pub struct AscendStream {
    inner: Arc<StreamInner>,
}

#[derive(Debug)]
pub(crate) struct StreamInner {
    id: StreamId,
    raw: RawStream,
    state: Mutex<StreamState>,
    /// An engine's stream (`import_stream`), which kda never synchronizes on its own, or a
    /// stream that waited on an event of one (kda's auxiliary stream forked from it, which the
    /// engine's path never synchronizes either): what its work holds is released in stream
    /// order.
    ordered: AtomicBool,
    /// What queued work holds on an engine's stream, or on any stream under an engine's
    /// capture: released in stream order, or pinned (`engine`).
    retention: Mutex<engine::StreamRetention>,
}

#[derive(Debug, Default)]
struct StreamState {
    /// The host-side failure to report at the next synchronize; later work is skipped.
    failure: Option<Failure>,
    /// What the held work waits for.
    gate: Option<Gate>,
    /// Work submitted behind the gate, in order.
    held: VecDeque<Held>,
    /// Handles, descriptors, staging and executors of queued work.
    in_flight: Vec<Box<dyn Any + Send>>,
    /// Device tasks queued since the last synchronize: (kernel or aclnn API, HAL op label), to
    /// name the op when the runtime reports a failed task.
    tasks: Vec<(&'static str, String)>,
}

impl StreamInner {
    fn state(&self) -> MutexGuard<'_, StreamState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn new(id: StreamId, raw: RawStream, imported: bool) -> Self {
        StreamInner {
            id,
            raw,
            state: Mutex::default(),
            ordered: AtomicBool::new(imported),
            retention: Mutex::default(),
        }
    }

    /// Whether what this stream's work holds is released in stream order (`ordered`).
    fn is_ordered(&self) -> bool {
        self.ordered.load(Ordering::Acquire)
    }

    /// Keep `item` until the stream has run the work queued so far: until the next synchronize
    /// on kda's own streams; in stream order on an engine's stream; for the stream's life under
    /// a capture (the engine's model may replay the work at any time).
    pub(crate) fn keep(&self, item: impl Any + Send) {
        let capture = self.capture();
        if self.is_ordered() || !capture.allows_release() {
            self.retention().hold(Box::new(item), capture);
        } else {
            self.state().in_flight.push(Box::new(item));
        }
    }
}

impl Drop for StreamInner {
    /// CANN requires a stream's tasks to be done before `aclrtDestroyStream`, and queued host
    /// functions point into `in_flight`: drain the stream first (its error, if any, has no one
    /// left to report to). A stream being captured is not synchronized (the runtime refuses
    /// it); what its captured work holds stays pinned until here.
    fn drop(&mut self) {
        if !self.capture().allows_release() {
            return;
        }
        // SAFETY: a live stream (an engine's stays alive as long as kda's handles, its contract).
        let _ = unsafe { crate::sys::aclrtSynchronizeStream(self.raw.get()) };
    }
}

impl StreamHandle for AscendStream {
    fn id(&self) -> StreamId {
        self.inner.id
    }
}

impl AscendStream {
    pub(crate) fn raw(&self) -> &RawStream {
        &self.inner.raw
    }
}

/// An event (always `ACL_EVENT_SYNC`), the stream of its most recent record, and whether that
/// record is held on the host or was skipped on a failed stream.
#[derive(Clone, Debug)]
pub struct AscendEvent {
    id: EventId,
    inner: Arc<EventInner>,
}

#[derive(Debug)]
struct EventInner {
    raw: RawEvent,
    /// Weak: a stream keeps the events it uses alive, not the other way round.
    recorded_on: Mutex<Option<Weak<StreamInner>>>,
    /// The stream whose held work holds this event's latest record.
    held_on: Mutex<Option<Weak<StreamInner>>>,
    /// The latest record was skipped on a failed stream: (stream, failure).
    failed_upstream: Mutex<Option<(StreamId, String)>>,
}

impl EventHandle for AscendEvent {
    fn id(&self) -> EventId {
        self.id
    }
}

impl AscendBackend {
    /// A device over device 0 with default options.
    #[allow(clippy::new_ret_no_self, reason = "the backend is used through its façade")]
    pub fn new() -> std::result::Result<Device<Self>, AscendError> {
        Self::with_options(AscendOptions::default())
    }

    /// A device over the NPU `options.device`, checked as `options.checked` says.
    pub fn with_options(options: AscendOptions) -> std::result::Result<Device<Self>, AscendError> {
        let checked = options.checked;
        Ok(Device::with_checked(Self::raw_with_options(options)?, checked))
    }

    /// The backend without its façade (for the backend's own tests of raw verbs).
    fn raw_with_options(options: AscendOptions) -> std::result::Result<Self, AscendError> {
        acl::bind(options.device)?;
        let chip = Chip::from_soc(&acl::soc_name())?;
        let api = crate::sys::installed().ok_or(AscendError::Unsupported {
            op: "AscendBackend::with_options",
            message: "the CANN table was not installed".into(),
        })?;
        // The native MX path needs its aclnn ops in this installation, not only an MX chip.
        let mx_ops = api.has_all(&crate::sys::MX_SYMBOLS);
        let native_mx = match options.mx_gemm {
            MxGemmPath::Auto => chip.mx_gemm && mx_ops,
            MxGemmPath::Native if mx_ops => true,
            MxGemmPath::Native => {
                let absent: Vec<&str> =
                    crate::sys::MX_SYMBOLS.into_iter().filter(|s| !api.has(s)).collect();
                return Err(AscendError::Unsupported {
                    op: "MxGemmPath::Native",
                    message: format!(
                        "the native MXFP8 path needs {absent:?}, absent from this CANN ({})",
                        chip.soc
                    ),
                });
            }
            MxGemmPath::Emulated => false,
        };
        let kernels = kernel::Kernels::new(options.kernels.clone());
        let inner = Inner {
            instance: InstanceId::fresh(),
            chip,
            native_mx,
            vendor_chunk: api.has_all(&crate::sys::CHUNK_KDA_SYMBOLS)
                && ops::vendor_prototypes().chunk.is_ok(),
            absent: api.absent(),
            options,
            pool: Arc::default(),
            kernels,
            graphs: capture::GraphCache::default(),
            imported: engine::Imported::default(),
            next_stream: AtomicU64::new(0),
            next_event: AtomicU64::new(0),
            next_buffer: AtomicU64::new(0),
        };
        Ok(Self { inner: Arc::new(inner) })
    }

    pub fn options(&self) -> &AscendOptions {
        &self.inner.options
    }

    /// The chip the runtime reports, as the tiling sees it.
    pub fn chip(&self) -> &Chip {
        &self.inner.chip
    }

    /// Whether the MXFP8 ops run natively (`aclnnQuantMatmulV5`) or through the emulation path.
    pub fn native_mx(&self) -> bool {
        self.inner.native_mx
    }

    /// Device time of the work `work` queues on `stream`, in milliseconds, measured between two
    /// `ACL_EVENT_TIME_LINE` events recorded around it (`aclrtEventElapsedTime`). Synchronizes
    /// `stream` before and after.
    pub fn time_ms(&self, stream: &AscendStream, work: impl FnOnce() -> Result<()>) -> Result<f32> {
        self.enter()?;
        host::synchronize(stream)?;
        let start = RawEvent::with_flag(crate::sys::ACL_EVENT_TIME_LINE)?;
        let end = RawEvent::with_flag(crate::sys::ACL_EVENT_TIME_LINE)?;
        start.record(stream.raw())?;
        work()?;
        // Work held behind host functions is issued before the end mark.
        host::drain(&stream.inner, 0)?;
        end.record(stream.raw())?;
        host::synchronize(stream)?;
        Ok(start.elapsed_ms(&end)?)
    }

    /// The optional CANN symbols (ops) this installation lacks: capabilities reported absent,
    /// which the backend routes around (the MXFP8 ops: the bf16 emulation path).
    pub fn absent_symbols(&self) -> &[&'static str] {
        &self.inner.absent
    }

    fn enter(&self) -> Result<()> {
        acl::bind(self.inner.options.device).map_err(Error::from)
    }

    fn next(counter: &AtomicU64) -> u64 {
        counter.fetch_add(1, Ordering::Relaxed)
    }

    /// On an engine's stream (or one forked from it) while no engine captures: release what
    /// the work it has passed held. Nothing is recorded or queried while an engine captures any
    /// imported stream, even on a stream outside that capture (a record from the capturing
    /// thread may join the capture, and a query of it is refused).
    fn release_on(&self, stream: &AscendStream) -> Result<()> {
        if stream.inner.is_ordered()
            && stream.inner.capture().allows_release()
            && !self.engine_capturing()
        {
            stream.inner.release_passed()?;
        }
        Ok(())
    }
}

impl Resources for AscendBackend {
    type Stream = AscendStream;
    type Event = AscendEvent;
    type Buffer = AscendBuffer;
}

impl Backend for AscendBackend {
    fn info(&self) -> BackendInfo {
        let chip = &self.inner.chip;
        let mx = if self.inner.native_mx {
            "native MXFP8"
        } else {
            "no native MXFP8: the layer runs QKV in bf16"
        };
        BackendInfo {
            name: "ascend",
            instance: self.inner.instance,
            capabilities: Capabilities {
                concurrent_streams: true,
                // Cube units are shared by both projection GEMMs.
                shared_matrix_units: true,
                // CANN's aclnnChunkKdaFwd (and aclnnRecurrentGatedDeltaRule where it fits) take
                // bf16 operands: the layer's core runs on them by default where they exist and
                // their prototype is confirmed for the installed release (vendor.rs).
                bf16_core: self.inner.vendor_chunk,
                // Under ACL_STOP_ON_FAILURE a failed device task stops every stream of the
                // context until it is destroyed (docs/ascend.md, "Failures").
                device_faults_are_fatal: true,
                execution: {
                    let mut notes = vec![mx.to_string()];
                    if !self.inner.absent.is_empty() {
                        notes.push(format!("absent: {}", self.inner.absent.join(", ")));
                    }
                    // Present vendor ops the backend will not call, and why.
                    let p = ops::vendor_prototypes();
                    let api = crate::sys::installed();
                    for (symbols, why) in [
                        (&crate::sys::CHUNK_KDA_SYMBOLS[..], &p.chunk),
                        (&crate::sys::RECURRENT_GDR_SYMBOLS[..], &p.recurrent),
                    ] {
                        if let (true, Err(why)) = (api.is_some_and(|a| a.has_all(symbols)), why) {
                            notes.push(format!("kda kernels instead: {why}"));
                        }
                    }
                    format!("ACL streams on {} ({})", chip.soc, notes.join("; "))
                },
                threads: chip.vector_cores as usize,
                gemm_inputs: vec![DType::BF16, DType::F16, DType::F32],
                // Without the aclnn MX ops there is no MX quantization (DynamicQuant is refused
                // with a typed error), so MXFP8 runs on an NPU only where the aclnn MX ops do.
                native: NativeOps { mx_quant: self.inner.native_mx, mx_gemm: self.inner.native_mx },
            },
        }
    }

    fn instance(&self) -> InstanceId {
        self.inner.instance
    }

    fn new_stream(&self) -> Result<AscendStream> {
        self.enter()?;
        let inner = &self.inner;
        let id = StreamId { instance: inner.instance, index: Self::next(&inner.next_stream) };
        let stream = StreamInner::new(id, RawStream::create()?, false);
        Ok(AscendStream { inner: Arc::new(stream) })
    }

    fn new_event(&self) -> Result<AscendEvent> {
        self.enter()?;
        let inner = &self.inner;
        let id = EventId { instance: inner.instance, index: Self::next(&inner.next_event) };
        let event = EventInner {
            raw: RawEvent::create()?,
            recorded_on: Mutex::new(None),
            held_on: Mutex::new(None),
            failed_upstream: Mutex::new(None),
        };
        Ok(AscendEvent { id, inner: Arc::new(event) })
    }

    fn record(&self, event: &AscendEvent, stream: &AscendStream) -> Result<()> {
        self.enter()?;
        self.release_on(stream)?;
        *event.inner.recorded_on.lock().unwrap_or_else(PoisonError::into_inner) =
            Some(Arc::downgrade(&stream.inner));
        // The stream keeps the event alive once recorded (CANN: no destroy with tasks pending).
        host::submit(stream, Held::Record(Arc::clone(&event.inner)))
    }

    fn wait(&self, stream: &AscendStream, event: &AscendEvent) -> Result<()> {
        self.enter()?;
        let upstream =
            event.inner.recorded_on.lock().unwrap_or_else(PoisonError::into_inner).clone();
        // Never recorded: a no-op, as the HAL (and CANN) define it.
        let Some(upstream) = upstream else { return Ok(()) };
        // A stream forked from an engine's stream is, like it, never synchronized by the
        // engine's path: what its work holds is released in stream order too.
        if upstream.upgrade().is_some_and(|up| up.is_ordered()) {
            stream.inner.ordered.store(true, Ordering::Release);
        }
        self.release_on(stream)?;
        host::submit(stream, Held::Wait(Arc::clone(&event.inner)))
    }

    fn synchronize(&self, stream: &AscendStream) -> Result<()> {
        self.enter()?;
        host::synchronize(stream)
    }

    fn alloc(&self, bytes: usize) -> Result<Allocation<AscendBuffer>> {
        self.enter()?;
        let inner = &self.inner;
        let id = BufferId { instance: inner.instance, index: Self::next(&inner.next_buffer) };
        // No reuse event is queried while an engine captures one of its streams.
        let _open = self.engine_capturing().then(|| inner.pool.capture_open());
        let (buffer, reuses) = inner.pool.alloc(id, bytes)?;
        Ok(Allocation { buffer, reuses })
    }

    unsafe fn import_buffer(
        &self,
        ptr: *mut u8,
        len: usize,
        owner: Box<dyn Any + Send + Sync>,
    ) -> Result<AscendBuffer> {
        self.enter()?;
        if ptr.is_null() && len > 0 {
            return Err(Error::Param {
                op: "import_buffer",
                param: "ptr",
                expected: "an ACL device pointer".into(),
                actual: "null".into(),
            });
        }
        let inner = &self.inner;
        let id = BufferId { instance: inner.instance, index: Self::next(&inner.next_buffer) };
        Ok(inner.pool.import(id, ptr as usize, len, owner))
    }

    unsafe fn import_stream(&self, handle: usize) -> Result<AscendStream> {
        // SAFETY: the caller's contract (`kda_core::Device::import_stream`).
        unsafe { self.import_engine_stream(handle) }
    }

    fn free(&self, stream: &AscendStream, buffer: AscendBuffer) -> Result<()> {
        self.enter()?;
        if !stream.inner.capture().allows_release() {
            // Under a capture the engine's model may use the block at every replay: pinned.
            stream.inner.keep(buffer);
            return Ok(());
        }
        self.release_on(stream)?;
        host::submit(stream, Held::Free(buffer))
    }

    fn submit(&self, stream: &AscendStream, label: &str, op: Validated<Self>) -> Result<()> {
        self.enter()?;
        let _span = tracing::trace_span!("ascend", op = label, stream = %stream.id()).entered();
        let capture = stream.inner.capture();
        let captured = !capture.allows_release();
        if captured && matches!(op.op(), kda_core::Op::Host { .. } | kda_core::Op::Download { .. })
        {
            return Err(engine::refused(
                "a download or host function inside an engine's capture (its model would \
                 replay it without kda)",
            ));
        }
        self.release_on(stream)?;
        // Under a capture: executors repeatable (the model replays them), no reuse event
        // queried by the allocator.
        let _open = captured.then(|| self.inner.pool.capture_open());
        let steps = ops::prepare(self, stream, &op, captured)?;
        {
            let mut state = stream.inner.state();
            for step in &steps {
                if let Some(task) = step.task() {
                    state.tasks.push((task, label.to_string()));
                }
            }
            // A stream kda never synchronizes keeps the latest names only.
            if stream.inner.is_ordered() && state.tasks.len() > MAX_TASK_NAMES {
                let excess = state.tasks.len() - MAX_TASK_NAMES / 2;
                state.tasks.drain(..excess);
            }
        }
        // The op's views keep their buffers alive until the stream has run it.
        stream.inner.keep(op);
        host::submit(stream, Held::Steps(steps))
    }

    /// A graph runs as an ACL model (`aclmdlRIExecuteAsync`), instantiated at its first launch
    /// and reused after; a graph with host functions, which ACL cannot capture, is replayed op
    /// by op instead.
    fn prepare_graph(
        &self,
        graph: &Graph<Self>,
        origin: &AscendStream,
    ) -> Result<GraphReplay<Self>> {
        self.prepare_graph_impl(graph, origin)
    }

    fn launch_native_graph(&self, graph: &Graph<Self>, origin: &AscendStream) -> Result<()> {
        self.launch_native_graph_impl(graph, origin)
    }
}

#[cfg(all(test, feature = "emulated"))]
#[allow(clippy::expect_used, reason = "tests")]
mod tests {
    use std::sync::{Condvar, Mutex};

    use kda_core::{HostFn, Op};

    use super::*;

    fn backend() -> Device<AscendBackend> {
        let options = AscendOptions { checked: false, ..AscendOptions::default() };
        AscendBackend::with_options(options).expect("backend")
    }

    /// A block freed on a stream is handed out again only once the stream is past the free.
    #[test]
    fn a_freed_block_is_reused_only_after_its_stream_passes_the_free() {
        let b = backend();
        let s = b.new_stream().expect("stream");
        let x = b.raw().alloc(1000).expect("alloc").buffer;
        let addr = x.addr();
        let gate = Arc::new((Mutex::new(false), Condvar::new()));
        let held = Arc::clone(&gate);
        let wait = HostFn::new(move || {
            let (open, cv) = &*held;
            let guard = open.lock().map_err(|e| e.to_string())?;
            let _open = cv.wait_while(guard, |open| !*open).map_err(|e| e.to_string())?;
            Ok(())
        });
        b.launch(&s, Op::Host { name: "hold", f: wait }).expect("launch");
        b.free(&s, x).expect("free");
        let early = b.raw().alloc(1000).expect("alloc").buffer;
        assert_ne!(early.addr(), addr, "the stream has not passed the free yet");
        {
            let (open, cv) = &*gate;
            *open.lock().expect("lock") = true;
            cv.notify_all();
        }
        b.synchronize(&s).expect("synchronize");
        let later: Vec<AscendBuffer> =
            (0..2).map(|_| b.raw().alloc(1000).expect("alloc").buffer).collect();
        assert!(later.iter().any(|l| l.addr() == addr), "the freed block is reused once passed");
        // Another size class does not take it.
        drop(later);
        let other = b.raw().alloc(5000).expect("alloc").buffer;
        assert_ne!(other.addr(), addr);
    }

    /// While a capture is open the allocator queries no reuse event (CANN refuses queries of
    /// what a capture holds): a block whose free completed is reused only after the capture.
    #[test]
    fn the_allocator_reuses_no_freed_block_while_a_capture_is_open() {
        let b = backend();
        let s = b.new_stream().expect("stream");
        let x = b.raw().alloc(1000).expect("alloc").buffer;
        let addr = x.addr();
        b.free(&s, x).expect("free");
        b.synchronize(&s).expect("the free has completed");
        {
            let _open = b.raw().inner.pool.capture_open();
            let during = b.raw().alloc(1000).expect("alloc").buffer;
            assert_ne!(during.addr(), addr, "no reuse event is queried while the capture is open");
        }
        let after: Vec<AscendBuffer> =
            (0..2).map(|_| b.raw().alloc(1000).expect("alloc").buffer).collect();
        assert!(after.iter().any(|a| a.addr() == addr), "reused once the capture has ended");
    }

    /// ACL failures are typed errors naming the function, the code and the runtime's message.
    #[test]
    fn acl_errors_name_the_function_and_code() {
        let _init = backend();
        match acl::bind(3) {
            Err(AscendError::Acl { func, code, message }) => {
                assert_eq!((func, code), ("aclrtSetDevice", crate::sys::ACL_ERROR_INVALID_PARAM));
                assert!(message.contains("device 3"), "{message}");
            }
            other => panic!("expected an ACL error, got {other:?}"),
        }
    }
}
