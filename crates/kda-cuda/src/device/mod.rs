//! The CUDA backend proper (feature `cuda`).

mod blas;
mod cublas;
mod engine;
mod fast;
mod graph;
mod memory;
mod module;
mod ops;
mod scratch;

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, mpsc};

use cudarc::driver::{CudaContext, result, sys};
use kda_core::graph::Graph;
use kda_core::hal::{Allocation, GraphReplay};
use kda_core::{
    Backend, BackendInfo, BufferHandle, BufferId, Capabilities, DType, Device, EventHandle,
    EventId, InstanceId, NativeOps, Resources, Result, StreamHandle, StreamId, Validated,
};

use crate::status::{self, HostFailure, StatusRecord};
use crate::{CudaError, CudaOptions, FastPaths, kernels};
use memory::{DeviceMemory, OwnedPinned, PinnedPool, driver};
use module::Kernels;

pub use graph::MAX_GRAPHS;

/// Streams one instance can create (each owns a status record and a mailbox).
const STREAMS_PER_INSTANCE: usize = 4096;
/// Event snapshot slots, used round robin: a wait must run within this many records of the
/// record it waits for (far beyond any schedule's depth).
const SNAPSHOT_SLOTS: usize = 1 << 16;

/// The CUDA backend. Cheap to clone; clones are the same instance.
#[derive(Clone)]
pub struct CudaBackend {
    inner: Arc<Teardown<Inner>>,
}

/// An instance's state, dropped as a whole under the device gate (`memory::whole_device`): its
/// teardown (the context synchronisation, module unloads, frees, graph and handle destruction)
/// waits for the whole device at several points, none of which may fall inside another
/// thread's capture.
struct Teardown<T>(std::mem::ManuallyDrop<T>);

impl<T> std::ops::Deref for Teardown<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

impl<T> Drop for Teardown<T> {
    fn drop(&mut self) {
        memory::whole_device(|| {
            // SAFETY: the value is dropped once, here, and never used again (`self` is being
            // dropped).
            unsafe { std::mem::ManuallyDrop::drop(&mut self.0) }
        });
    }
}

struct Inner {
    instance: InstanceId,
    ctx: Arc<CudaContext>,
    name: String,
    sms: u32,
    kernels: Kernels,
    /// One `StatusRecord` per stream index.
    status: DeviceMemory,
    /// One u32 per stream index, mapped: the host-function side of a stream's status.
    mailboxes: OwnedPinned,
    /// Event snapshot slots (u32 failure ids).
    snapshots: DeviceMemory,
    staging: Arc<PinnedPool>,
    scratch: scratch::ScratchAllocator,
    graphs: graph::GraphCache,
    /// The fast paths in effect (those requested that the device can take).
    fast: FastPaths,
    /// How long a stream waits for a host function (`kda_host_wait`'s limit).
    host_wait_limit: std::time::Duration,
    host_failures: Arc<Mutex<HashMap<u32, HostFailure>>>,
    /// Host functions already run, kept until a host thread drops them (a callback must not
    /// drop anything that may call CUDA).
    graveyard: Arc<Mutex<Vec<kda_core::HostFn>>>,
    /// Buffers freed in stream order: dropped once their event has completed.
    deferred_frees: Mutex<Vec<(cudarc::driver::CudaEvent, CudaBuffer)>>,
    /// The engines' streams imported into this instance, to ask whether one is capturing.
    imported: Mutex<Vec<std::sync::Weak<StreamInner>>>,
    next_stream: AtomicU64,
    next_event: AtomicU64,
    next_buffer: AtomicU64,
    next_snapshot: AtomicU64,
    next_host_key: AtomicU32,
}

impl fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaBackend")
            .field("instance", &self.inner.instance)
            .field("device", &self.inner.name)
            .finish()
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Callbacks still queued hold mailboxes and staging buffers: let them run first (under
        // the device gate, `Teardown`: not while another thread's capture is open, which the
        // synchronisation would invalidate).
        if self.ctx.bind_to_thread().is_ok() {
            let _ = self.ctx.synchronize();
        }
    }
}

/// A CUDA stream with its failure record: kda's own, or an engine's (imported).
#[derive(Clone)]
pub struct CudaStream {
    id: StreamId,
    inner: Arc<StreamInner>,
}

struct StreamInner {
    raw: engine::RawStream,
    /// kda's own stream, destroyed with the last handle; `None` for an engine's stream.
    #[allow(dead_code, reason = "held only to destroy kda's own stream with its last handle")]
    owned: Option<Arc<cudarc::driver::CudaStream>>,
    /// What queued (or captured) work on this stream uses, when kda cannot synchronize it
    /// (`kda_core::device::retention`).
    retention: Mutex<engine::StreamRetention>,
    /// Device address of this stream's `StatusRecord`.
    status: u64,
    /// This stream's mailbox, host and device addresses.
    mailbox_host: MailboxPtr,
    mailbox_device: u64,
    /// The flag its host worker raises to each finished host function's ticket.
    flag_host: MailboxPtr,
    flag_device: u64,
    next_ticket: AtomicU32,
    /// The thread that runs this stream's host functions, in order (started on first use).
    host_worker: OnceLock<mpsc::Sender<HostJob>>,
    blas: OnceLock<cublas::BlasHandle>,
}

/// A host function's run on its stream's worker thread.
pub(super) type HostJob = Box<dyn FnOnce() + Send>;

/// A u32 of a stream in mapped pinned memory (its mailbox or its host flag), shared by the
/// host and the device.
#[derive(Copy, Clone)]
pub(super) struct MailboxPtr(pub(super) *mut u32);

// SAFETY: the pointer addresses one u32 in the instance's pinned mailbox allocation, which
// outlives every stream and callback (the instance synchronizes its context before freeing it);
// accesses are volatile and ordered by the stream (publish kernel, then callback, then absorb
// kernel).
unsafe impl Send for MailboxPtr {}
// SAFETY: as for `Send`; the pointer itself is never mutated.
unsafe impl Sync for MailboxPtr {}

impl fmt::Debug for CudaStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CudaStream({})", self.id)
    }
}

impl StreamHandle for CudaStream {
    fn id(&self) -> StreamId {
        self.id
    }
}

impl CudaStream {
    fn raw(&self) -> sys::CUstream {
        self.inner.raw.0
    }

    /// Whether this is an engine's stream (`import_stream`).
    pub fn is_imported(&self) -> bool {
        self.inner.owned.is_none()
    }

    /// The sender of this stream's host worker, started on first use.
    fn host_worker(&self) -> Result<&mpsc::Sender<HostJob>> {
        if let Some(tx) = self.inner.host_worker.get() {
            return Ok(tx);
        }
        let (tx, rx) = mpsc::channel::<HostJob>();
        std::thread::Builder::new()
            .name(format!("kda-cuda-host-{}", self.id))
            .spawn(move || rx.into_iter().for_each(|job| job()))
            .map_err(|e| kda_core::Error::Backend {
                backend: "cuda",
                message: format!("cannot start the host-function thread of {}: {e}", self.id),
            })?;
        // Two threads may race here; the loser's worker exits when its sender is dropped.
        Ok(self.inner.host_worker.get_or_init(|| tx))
    }
}

/// A CUDA event with the snapshot slot of its most recent record.
#[derive(Clone)]
pub struct CudaEvent {
    id: EventId,
    inner: Arc<EventInner>,
}

struct EventInner {
    event: cudarc::driver::CudaEvent,
    /// Device address of the snapshot slot the most recent record filled (None: never
    /// recorded).
    snapshot: Mutex<Option<u64>>,
}

impl fmt::Debug for CudaEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CudaEvent({})", self.id)
    }
}

impl EventHandle for CudaEvent {
    fn id(&self) -> EventId {
        self.id
    }
}

/// Device memory. Clones share it; it is freed when the last clone is dropped.
#[derive(Clone)]
pub struct CudaBuffer {
    id: BufferId,
    memory: Arc<DeviceMemory>,
}

impl fmt::Debug for CudaBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CudaBuffer({}, {} bytes)", self.id, self.memory.bytes)
    }
}

impl BufferHandle for CudaBuffer {
    fn id(&self) -> BufferId {
        self.id
    }

    fn len_bytes(&self) -> usize {
        self.memory.bytes
    }
}

impl CudaBuffer {
    /// The device address of byte 0.
    pub(crate) fn device_ptr(&self) -> u64 {
        self.memory.ptr
    }
}

fn no_device(ordinal: usize) -> impl Fn(cudarc::driver::DriverError) -> CudaError {
    move |e| CudaError::NoCudaDevice { ordinal, reason: e.to_string() }
}

impl CudaBackend {
    /// A device over GPU 0, checked mode as `KDA_SANITIZE` says.
    #[allow(clippy::new_ret_no_self, reason = "the backend is used through its façade")]
    pub fn new() -> std::result::Result<Device<Self>, CudaError> {
        Self::with_options(CudaOptions::default())
    }

    /// A device over GPU `options.ordinal`: open it and compile (once per process) and load
    /// the kernels. [`CudaError::NoCudaDevice`] when the driver library or the device is
    /// missing.
    pub fn with_options(options: CudaOptions) -> std::result::Result<Device<Self>, CudaError> {
        let checked = options.checked;
        Ok(Device::with_checked(Self::open(options)?, checked))
    }

    fn open(options: CudaOptions) -> std::result::Result<Self, CudaError> {
        let ordinal = options.ordinal;
        // SAFETY: only tries to open the driver library.
        if !unsafe { sys::is_culib_present() } {
            return Err(CudaError::NoCudaDevice {
                ordinal,
                reason: "the CUDA driver library (libcuda) could not be loaded".into(),
            });
        }
        cublas::origin().map_err(|e| match e {
            CudaError::NoCudaDevice { reason, .. } => CudaError::NoCudaDevice { ordinal, reason },
            other => other,
        })?;
        let count = CudaContext::device_count().map_err(no_device(ordinal))?;
        if ordinal >= count.max(0) as usize {
            return Err(CudaError::NoCudaDevice {
                ordinal,
                reason: format!("the driver reports {count} device(s)"),
            });
        }
        let ctx = CudaContext::new(ordinal).map_err(no_device(ordinal))?;
        // SAFETY: kda orders streams itself through events; cudarc's automatic tracking of
        // its own slices (which kda does not use) is switched off before any work exists.
        unsafe { ctx.disable_event_tracking() };
        let (major, minor) = ctx.compute_capability().map_err(driver("cuDeviceGetAttribute"))?;
        if major < 8 {
            return Err(CudaError::NoCudaDevice {
                ordinal,
                reason: format!("compute capability {major}.{minor}; the kernels need 8.0 (bf16)"),
            });
        }
        let name = ctx.name().map_err(driver("cuDeviceGetName"))?;
        let sms = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(driver("cuDeviceGetAttribute"))?
            .max(1) as u32;
        let arch = kernels::arch_for(major, minor).ok_or_else(|| CudaError::NoCudaDevice {
            ordinal,
            reason: format!("compute capability {major}.{minor} has no CUBIN target in NVRTC 12"),
        })?;
        let kernels = Kernels::load(&ctx, arch)?;
        let fast = fast::effective(&ctx, &kernels, major, options.fast)?;
        let record = std::mem::size_of::<StatusRecord>();
        let status = DeviceMemory::new(&ctx, STREAMS_PER_INSTANCE * record)?;
        let snapshots = DeviceMemory::new(&ctx, SNAPSHOT_SLOTS * 4)?;
        // Zeroed before any stream of this instance can read them (see `DeviceMemory::zero`).
        status.zero()?;
        snapshots.zero()?;
        let mailboxes = OwnedPinned::new(&ctx, 2 * STREAMS_PER_INSTANCE * 4)?;
        let probe = ctx.new_stream().map_err(driver("cuStreamCreate"))?;
        let scratch = scratch::ScratchAllocator::new(&ctx, probe.cu_stream());
        drop(probe);
        let inner = Inner {
            instance: InstanceId::fresh(),
            staging: Arc::new(PinnedPool::new(&ctx)),
            scratch,
            graphs: graph::GraphCache::default(),
            fast,
            host_wait_limit: options.host_wait_limit,
            ctx,
            name,
            sms,
            kernels,
            status,
            mailboxes,
            snapshots,
            host_failures: Arc::default(),
            graveyard: Arc::default(),
            deferred_frees: Mutex::new(Vec::new()),
            imported: Mutex::new(Vec::new()),
            next_stream: AtomicU64::new(0),
            next_event: AtomicU64::new(0),
            next_buffer: AtomicU64::new(0),
            next_snapshot: AtomicU64::new(0),
            next_host_key: AtomicU32::new(1),
        };
        Ok(Self { inner: Arc::new(Teardown(std::mem::ManuallyDrop::new(inner))) })
    }

    /// The device's name as the driver reports it.
    pub fn device_name(&self) -> &str {
        &self.inner.name
    }

    /// Time the work `work` launches on `stream` with CUDA events, in milliseconds (this
    /// synchronizes on the end event).
    pub fn elapsed_ms(
        &self,
        stream: &CudaStream,
        work: impl FnOnce() -> Result<()>,
    ) -> Result<f32> {
        let ctx = &self.inner.ctx;
        let timing = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = ctx.new_event(timing).map_err(driver("cuEventCreate"))?;
        let end = ctx.new_event(timing).map_err(driver("cuEventCreate"))?;
        engine::record_raw(&start, stream.raw())?;
        work()?;
        engine::record_raw(&end, stream.raw())?;
        end.synchronize().map_err(driver("cuEventSynchronize"))?;
        Ok(start.elapsed_ms(&end).map_err(driver("cuEventElapsedTime"))?)
    }

    fn bind(&self) -> Result<()> {
        Ok(self.inner.ctx.bind_to_thread().map_err(driver("cuCtxSetCurrent"))?)
    }

    /// Drop what host callbacks left behind and the buffers whose stream-ordered free has
    /// been reached. Runs on host threads only, and not while an engine captures one of its
    /// imported streams (neither queries nor frees may run then).
    fn sweep(&self) {
        if self.engine_capturing() {
            return;
        }
        let dead = std::mem::take(
            &mut *self.inner.graveyard.lock().unwrap_or_else(PoisonError::into_inner),
        );
        drop(dead);
        let mut frees = self.inner.deferred_frees.lock().unwrap_or_else(PoisonError::into_inner);
        frees.retain(|(event, _)| !event.is_complete());
    }

    /// A stream of this instance over `raw`: kda's own (`owned`) or an engine's.
    fn stream_of(
        &self,
        raw: sys::CUstream,
        owned: Option<Arc<cudarc::driver::CudaStream>>,
    ) -> Result<CudaStream> {
        let inner = &self.inner;
        let index = inner.next_stream.fetch_add(1, Ordering::Relaxed);
        let slot = index as usize;
        crate::launch::within("new_stream", "streams", slot + 1, STREAMS_PER_INSTANCE)?;
        let record = std::mem::size_of::<StatusRecord>() as u64;
        let base = inner.mailboxes.host() as *mut u32;
        // SAFETY: `slot` < STREAMS_PER_INSTANCE and the allocation holds two u32 per stream
        // (mailboxes, then flags), so both addresses are inside it.
        let (mailbox_host, flag_host) = unsafe {
            (MailboxPtr(base.add(slot)), MailboxPtr(base.add(STREAMS_PER_INSTANCE + slot)))
        };
        let stream = StreamInner {
            raw: engine::RawStream(raw),
            owned,
            retention: Mutex::default(),
            status: inner.status.ptr + record * index,
            mailbox_host,
            mailbox_device: inner.mailboxes.device() + 4 * index,
            flag_host,
            flag_device: inner.mailboxes.device() + 4 * (STREAMS_PER_INSTANCE as u64 + index),
            next_ticket: AtomicU32::new(0),
            host_worker: OnceLock::new(),
            blas: OnceLock::new(),
        };
        Ok(CudaStream { id: self.stream_id(index), inner: Arc::new(stream) })
    }

    fn stream_id(&self, index: u64) -> StreamId {
        StreamId { instance: self.inner.instance, index }
    }

    /// Blocks for a grid-stride loop over `work` items.
    fn grid(&self, work: usize, per_block: u32) -> Option<u32> {
        crate::launch::grid_for(work, per_block, self.inner.sms * 16)
    }
}

impl Resources for CudaBackend {
    type Stream = CudaStream;
    type Event = CudaEvent;
    type Buffer = CudaBuffer;
}

impl Backend for CudaBackend {
    fn info(&self) -> BackendInfo {
        BackendInfo {
            name: "cuda",
            instance: self.inner.instance,
            capabilities: Capabilities {
                concurrent_streams: true,
                shared_matrix_units: true,
                bf16_core: false,
                // Bad device metadata is reported by the kernels, not a sticky device fault.
                device_faults_are_fatal: false,
                execution: format!("CUDA streams on {}", self.inner.name),
                threads: self.inner.sms as usize,
                gemm_inputs: vec![DType::BF16, DType::F16, DType::F32],
                // DynamicQuant and MxGemm are NVRTC kernels of this backend on every GPU.
                native: NativeOps::ALL,
            },
        }
    }

    fn instance(&self) -> InstanceId {
        self.inner.instance
    }

    fn new_stream(&self) -> Result<CudaStream> {
        let cuda = self.inner.ctx.new_stream().map_err(driver("cuStreamCreate"))?;
        self.stream_of(cuda.cu_stream(), Some(cuda))
    }

    /// An engine's `CUstream` as a stream of this instance (see `engine.rs`).
    unsafe fn import_stream(&self, handle: usize) -> Result<CudaStream> {
        // SAFETY: the caller's contract (`kda_core::Device::import_stream`).
        unsafe { self.import_engine_stream(handle) }
    }

    /// An engine's device memory as a buffer of this instance (see `engine.rs`).
    unsafe fn import_buffer(
        &self,
        ptr: *mut u8,
        len: usize,
        owner: Box<dyn std::any::Any + Send + Sync>,
    ) -> Result<CudaBuffer> {
        self.import_engine_buffer(ptr as u64, len, owner)
    }

    fn new_event(&self) -> Result<CudaEvent> {
        let inner = &self.inner;
        let index = inner.next_event.fetch_add(1, Ordering::Relaxed);
        let event = inner.ctx.new_event(None).map_err(driver("cuEventCreate"))?;
        Ok(CudaEvent {
            id: EventId { instance: inner.instance, index },
            inner: Arc::new(EventInner { event, snapshot: Mutex::new(None) }),
        })
    }

    fn record(&self, event: &CudaEvent, stream: &CudaStream) -> Result<()> {
        self.bind()?;
        let inner = &self.inner;
        let n = inner.next_snapshot.fetch_add(1, Ordering::Relaxed) as usize % SNAPSHOT_SLOTS;
        let slot = inner.snapshots.ptr + 4 * n as u64;
        let status = stream.inner.status;
        inner.kernels.launch(
            stream.raw(),
            "kda_status_snapshot",
            (1, 1, 1),
            (1, 1, 1),
            module::args!(status, slot),
        )?;
        engine::record_raw(&event.inner.event, stream.raw())?;
        *event.inner.snapshot.lock().unwrap_or_else(PoisonError::into_inner) = Some(slot);
        Ok(())
    }

    fn wait(&self, stream: &CudaStream, event: &CudaEvent) -> Result<()> {
        let Some(slot) = *event.inner.snapshot.lock().unwrap_or_else(PoisonError::into_inner)
        else {
            return Ok(());
        };
        self.bind()?;
        engine::wait_raw(stream.raw(), &event.inner.event)?;
        let status = stream.inner.status;
        self.inner.kernels.launch(
            stream.raw(),
            "kda_status_inherit",
            (1, 1, 1),
            (1, 1, 1),
            module::args!(status, slot),
        )?;
        Ok(())
    }

    fn synchronize(&self, stream: &CudaStream) -> Result<()> {
        self.bind()?;
        self.refuse_in_capture(stream, "synchronize")?;
        // SAFETY: a live stream of the bound context, not being captured (checked above).
        unsafe { result::stream::synchronize(stream.raw()) }
            .map_err(driver("cuStreamSynchronize"))?;
        self.sweep();
        self.settle(stream);
        let mut record = [StatusRecord::default()];
        // SAFETY: the stream is idle, so its record is not being written; 32 bytes at
        // `status` are this stream's record.
        unsafe { result::memcpy_dtoh_sync(&mut record, stream.inner.status) }
            .map_err(driver("cuMemcpyDtoH"))?;
        let record = record[0];
        if record.fid == 0 {
            return Ok(());
        }
        // Cleared in the stream's own order: a memset on the legacy default stream would be
        // unordered against kda's non-blocking streams.
        memory::clear_on_stream(stream.raw(), stream.inner.status, size_of::<StatusRecord>())?;
        let failures = self.inner.host_failures.lock().unwrap_or_else(PoisonError::into_inner);
        Err(status::to_error(
            stream.id,
            &record,
            |key| failures.get(&key).cloned(),
            |i| self.stream_id(i),
        ))
    }

    fn alloc(&self, bytes: usize) -> Result<Allocation<CudaBuffer>> {
        self.sweep();
        let inner = &self.inner;
        let memory = DeviceMemory::new(&inner.ctx, bytes)?;
        let index = inner.next_buffer.fetch_add(1, Ordering::Relaxed);
        Ok(Allocation::fresh(CudaBuffer {
            id: BufferId { instance: inner.instance, index },
            memory: Arc::new(memory),
        }))
    }

    /// The memory is dropped once `stream` reaches this point (an event marks it), never in a
    /// driver callback.
    fn free(&self, stream: &CudaStream, buffer: CudaBuffer) -> Result<()> {
        self.bind()?;
        if self.retains(stream)? {
            return self.retain(stream, Box::new(buffer));
        }
        let event = self.inner.ctx.new_event(None).map_err(driver("cuEventCreate"))?;
        engine::record_raw(&event, stream.raw())?;
        self.inner
            .deferred_frees
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push((event, buffer));
        Ok(())
    }

    fn submit(&self, stream: &CudaStream, label: &str, op: Validated<Self>) -> Result<()> {
        // Only the façade makes a `Validated` op: the kernels' preconditions (views inside their
        // buffers, no aliasing outputs) hold for every op that reaches here.
        self.bind()?;
        let _span = tracing::trace_span!("cuda", op = label, stream = %stream.id).entered();
        self.submit_ordered(stream, label, op)
    }

    /// A graph runs as one CUDA graph instantiated for its origin (see `graph.rs`), or, with
    /// host work in it, replays op by op.
    fn prepare_graph(&self, graph: &Graph<Self>, origin: &CudaStream) -> Result<GraphReplay<Self>> {
        self.prepare_captured(graph, origin)
    }

    /// One `cuGraphLaunch`.
    fn launch_native_graph(&self, graph: &Graph<Self>, origin: &CudaStream) -> Result<()> {
        self.launch_captured(graph, origin)
    }
}
