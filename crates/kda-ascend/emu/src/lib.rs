//! `kda-acl-emu`: an emulated Ascend runtime implementing the CANN ACL runtime, aclnn and
//! kernel-launch functions kda's Ascend backend calls. Its functions fill the backend's
//! `kda-ascend-sys` table ([`table`]), so each is type-checked against the one list of
//! prototypes and the backend's real FFI layer — pointers, out-parameters and structs included —
//! runs here without an NPU.
//!
//! It implements the documented semantics in its own code, on no other backend: streams are
//! worker threads running queued tasks in order, events records of a stream's position, capture
//! records the tasks of its streams into a model with the ACL join rule (`sched`), device
//! memory is its own allocations (`mem`; device addresses are real host addresses), every aclnn
//! op computes on host vectors from its document (`nn`; CANN's KDA operators at the precision
//! of their kernel sources, `vendor/`), and every AscendC kernel launch executes the kernel's
//! own source, compiled for the host against the AscendC twin ([`twin`],
//! `crates/kda-ascend/twin`),
//! block by block on the launch's device memory, with the device's rules checked. It rejects what CANN rejects, with CANN's
//! codes: a wait on an event without `ACL_EVENT_SYNC`, an executor run twice without
//! `aclSetAclOpExecutorRepeatable`, a capture ending with a forked stream not joined back, a
//! synchronize of a stream in an open capture (its origin, or a stream joined to it by waiting on
//! an event recorded inside it) or a query of an event recorded in an open capture, tasks on
//! any stream of a context stopped by a failed task under stop-on-failure, a kernel launch whose arguments are
//! not where its launch function reads them, a relative binary path, a kernel the binary lacks,
//! MX ops on a SoC without them (`KDA_ACL_EMU_SOC`, default `Ascend950PR_9599`).
//!
//! What it does not emulate: timing, the AI Core / AI Vector split (blocks run one after
//! another), the NPU's own approximations of transcendental functions (the twin computes in IEEE
//! f32).

#![deny(unsafe_op_in_unsafe_fn)]
#![allow(
    clippy::missing_safety_doc,
    reason = "each entry point's contract is CANN's documentation of the same symbol"
)]

mod host;
mod kernel;
pub mod mem;
mod nn;
mod rt;
mod sched;
pub mod twin;
mod vendor;

pub use kernel::write_stand_in;

/// The declarations shared with the backend.
use kda_ascend_sys::{abi, types};

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::ffi::{CString, c_char};
use std::sync::{LazyLock, Mutex, MutexGuard, PoisonError};

use kda_core::{BufferHandle, DType, HostFn, InstanceId, Layout, Tensor};
use mem::{DeviceBuffer, Mem};

use types::*;

/// A view of the emulated device's memory.
type T = Tensor<Mem>;

/// An event and the flags it was created with.
struct EmuEvent {
    /// Where it was last recorded outside a capture (a wait on it waits for that point).
    mark: Option<sched::Mark>,
    flags: u32,
    /// Records queued so far, and the last one whose work has completed.
    recorded: u64,
    done: std::sync::Arc<std::sync::atomic::AtomicU64>,
    /// When the work of the latest completed record finished (`ACL_EVENT_TIME_LINE` events).
    at: std::sync::Arc<Mutex<Option<std::time::Instant>>>,
}

/// A prepared aclnn op: what phase two queues, the workspace it needs, whether it may run
/// more than once.
struct Executor {
    api: &'static str,
    tasks: Vec<HostFn>,
    workspace: u64,
    repeatable: bool,
}

/// The whole emulated device (one device, one context, as kda uses it).
struct Emu {
    initialized: bool,
    /// The emulated device: its allocations and the HAL op descriptions launches are checked
    /// against belong to it.
    instance: InstanceId,
    soc: CString,
    /// Device (and host-pinned) allocations by base address.
    memory: BTreeMap<usize, DeviceBuffer>,
    streams: HashMap<usize, sched::Stream>,
    events: HashMap<usize, EmuEvent>,
    tensors: HashMap<usize, (T, aclDataType)>,
    scalars: HashMap<usize, f64>,
    executors: HashMap<usize, Executor>,
    /// Executors freed by their (only) run: a second run is the error CANN reports.
    spent: HashSet<usize>,
    models: HashMap<usize, sched::Model>,
    /// Loaded binaries: the kda kernels each contains and where their code is.
    binaries: HashMap<usize, kernel::Binary>,
    functions: HashMap<usize, (&'static str, kernel::Code)>,
    /// The capture open now, if any.
    capture: Option<Capturing>,
    /// What the open capture has recorded (behind a lock: tasks are queued through `&Emu`).
    recording: Mutex<Option<sched::Capture>>,
    /// Events recorded in the open capture: they cannot be queried or synchronized until it
    /// ends (`ACL_ERROR_RT_EVENT_CAPTURED`).
    captured_events: HashSet<usize>,
    /// Streams in the open capture: its origin and every stream that waited on an event
    /// recorded inside it (`aclmdlRICaptureGetInfo` reports them active; none may be
    /// synchronized).
    captured_streams: HashSet<usize>,
    /// `ACL_STOP_ON_FAILURE` was set on a stream: it holds for every stream of the context.
    stop_on_failure: bool,
    /// The context's failure: the first failed task's code and text (see [`ContextFailure`]).
    failure: ContextFailure,
    next: usize,
}

/// The failure recorded on the (one) context: the first failed task's code, and the text naming
/// the task and its stream. The runtime keeps it on the context (hicann/runtime
/// `src/runtime/core/src/stream/stream.cc`, `Stream::EnterFailureAbort`: the stream's error
/// becomes the context's failure error) until the context is torn down or the device recovers
/// (`hicann/runtime/docs/zh/design/modules/context/context.md`, 异常处理机制); under
/// stop-on-failure every task sent to any stream of the context, and every synchronize, returns
/// it (`src/runtime/core/src/context/context.cc`, `Context::CheckTaskSend`; `stream.cc`,
/// `Stream::GetSynchronizeError`). The emulator has no context teardown or device recovery call,
/// so nothing clears it in a process. Shared with the stream workers: a kernel that faults
/// records it when it runs, as the runtime's error report does, before anyone synchronizes.
#[derive(Clone, Debug, Default)]
struct ContextFailure(std::sync::Arc<Mutex<Option<(aclError, String)>>>);

impl ContextFailure {
    /// Record a failed task; the first failure is the one kept.
    fn record(&self, code: aclError, text: String) {
        let mut slot = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if slot.is_none() {
            *slot = Some((code, text));
        }
    }

    fn get(&self) -> Option<(aclError, String)> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }
}

/// An open capture: the stream it was begun on and the thread that began it. The emulator holds
/// one capture at a time, so a second thread's `aclmdlRICaptureBegin` waits for the first
/// capture to end (CANN captures streams of different threads independently).
#[derive(Copy, Clone, Debug)]
struct Capturing {
    stream: usize,
    thread: std::thread::ThreadId,
}

static EMU: LazyLock<Mutex<Emu>> = LazyLock::new(|| {
    Mutex::new(Emu {
        initialized: false,
        instance: InstanceId::fresh(),
        soc: CString::default(),
        memory: BTreeMap::new(),
        streams: HashMap::new(),
        events: HashMap::new(),
        tensors: HashMap::new(),
        scalars: HashMap::new(),
        executors: HashMap::new(),
        spent: HashSet::new(),
        models: HashMap::new(),
        binaries: HashMap::new(),
        functions: HashMap::new(),
        capture: None,
        recording: Mutex::new(None),
        captured_events: HashSet::new(),
        captured_streams: HashSet::new(),
        stop_on_failure: false,
        failure: ContextFailure::default(),
        next: 0x1000,
    })
});

/// One call into the emulated runtime, as [`calls_of_this_thread`] reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Call {
    /// The entry point, or for launches the aclnn op or kernel name; event creation notes its
    /// flags (`aclrtCreateEventExWithFlag(SYNC)`).
    pub api: String,
    /// The stream handle the call names (0: none).
    pub stream: usize,
    /// The event handle the call names (0: none).
    pub event: usize,
}

static LOG: Mutex<Vec<(std::thread::ThreadId, Call)>> = Mutex::new(Vec::new());

/// Log a successful call, with the calling thread (tests read their own thread's calls).
fn log(api: impl Into<String>, stream: usize, event: usize) {
    let call = Call { api: api.into(), stream, event };
    LOG.lock().unwrap_or_else(PoisonError::into_inner).push((std::thread::current().id(), call));
}

/// The calls this thread has made so far, in order: what a test asserts the backend's runtime
/// call sequence with.
pub fn calls_of_this_thread() -> Vec<Call> {
    let me = std::thread::current().id();
    let log = LOG.lock().unwrap_or_else(PoisonError::into_inner);
    log.iter().filter(|(t, _)| *t == me).map(|(_, c)| c.clone()).collect()
}

/// Objects the runtime holds for its callers: what a leak test counts.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct Live {
    pub allocations: usize,
    pub streams: usize,
    pub events: usize,
    pub tensors: usize,
    pub scalars: usize,
    pub executors: usize,
    pub models: usize,
}

/// The objects alive now.
pub fn live() -> Live {
    let emu = emu();
    Live {
        allocations: emu.memory.len(),
        streams: emu.streams.len(),
        events: emu.events.len(),
        tensors: emu.tensors.len(),
        scalars: emu.scalars.len(),
        executors: emu.executors.len(),
        models: emu.models.len(),
    }
}

thread_local! {
    /// `aclGetRecentErrMsg`: the last failure of this thread's calls.
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn emu() -> MutexGuard<'static, Emu> {
    EMU.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Fail a call: remember `message` for `aclGetRecentErrMsg` and return `code`.
fn fail(code: aclError, message: impl Into<String>) -> aclError {
    let text = CString::new(message.into().replace('\0', " ")).unwrap_or_default();
    LAST_ERROR.with(|e| *e.borrow_mut() = text);
    code
}

/// Run a call's body: `Err((code, message))` becomes [`fail`].
fn call(body: impl FnOnce() -> Result<(), (aclError, String)>) -> aclError {
    match body() {
        Ok(()) => ACL_SUCCESS,
        Err((code, message)) => fail(code, message),
    }
}

type Res<T> = Result<T, (aclError, String)>;

fn invalid<T>(message: impl Into<String>) -> Res<T> {
    Err((ACL_ERROR_INVALID_PARAM, message.into()))
}

impl Emu {
    fn ready(&self, api: &str) -> Res<()> {
        if self.initialized {
            Ok(())
        } else {
            Err((ACL_ERROR_UNINITIALIZE, format!("{api}: aclInit was not called")))
        }
    }

    fn handle(&mut self) -> usize {
        self.next += 0x10;
        self.next
    }

    /// The stream behind `handle`, for a call that queues a task or waits for the stream. Under
    /// stop-on-failure, once a task of the context has failed, every stream refuses both with
    /// the failure's code ([`ContextFailure`]).
    fn stream(&self, api: &str, handle: aclrtStream) -> Res<sched::Stream> {
        let s = self.known_stream(api, handle)?;
        if self.stop_on_failure
            && let Some((code, why)) = self.failure.get()
        {
            return Err((
                code,
                format!(
                    "{api}: stream {handle:?}: the context stopped on a failed task \
                     (stop-on-failure): {why}"
                ),
            ));
        }
        Ok(s)
    }

    /// The stream behind `handle`, for a call that neither queues a task nor waits.
    fn known_stream(&self, api: &str, handle: aclrtStream) -> Res<sched::Stream> {
        self.streams
            .get(&(handle as usize))
            .cloned()
            .ok_or_else(|| (ACL_ERROR_INVALID_PARAM, format!("{api}: unknown stream {handle:?}")))
    }

    fn backend_instance(&self) -> InstanceId {
        self.instance
    }

    /// Whether the MX dtypes exist on this SoC (Ascend 950 only).
    fn has_mx(&self) -> bool {
        rt::soc_has_mx(&self.soc)
    }

    /// The allocation holding `len` bytes from device address `addr`, and the byte offset.
    fn locate(&self, api: &str, addr: usize, len: usize) -> Res<(DeviceBuffer, usize)> {
        let found = self.memory.range(..=addr).next_back();
        match found {
            Some((&base, buf)) if addr - base + len <= buf.len_bytes() => {
                Ok((buf.clone(), addr - base))
            }
            _ => invalid(format!(
                "{api}: {len} bytes at {addr:#x} are not inside one device allocation"
            )),
        }
    }

    /// A byte view of `len` bytes at device address `addr`.
    fn bytes(&self, api: &str, addr: usize, len: usize) -> Res<T> {
        let (buf, offset) = self.locate(api, addr, len)?;
        let layout = Layout::strided(DType::U8, &[len], &[1], offset).map_err(bad)?;
        Tensor::new(buf, layout).map_err(bad)
    }

    /// A typed view: device address of the storage, element offset, shape and strides.
    fn view(
        &self,
        api: &str,
        addr: usize,
        code: aclDataType,
        shape: &[i64],
        strides: &[i64],
        offset: i64,
    ) -> Res<T> {
        let dtype = dtype_of(code)
            .ok_or_else(|| (ACL_ERROR_INVALID_PARAM, format!("{api}: dtype code {code}")))?;
        let to_usize = |v: &i64| usize::try_from(*v);
        let shape: Vec<usize> = shape
            .iter()
            .map(to_usize)
            .collect::<Result<_, _>>()
            .map_err(|_| (ACL_ERROR_INVALID_PARAM, format!("{api}: negative dimension")))?;
        let strides: Vec<usize> = strides
            .iter()
            .map(to_usize)
            .collect::<Result<_, _>>()
            .map_err(|_| (ACL_ERROR_INVALID_PARAM, format!("{api}: negative stride")))?;
        let offset = usize::try_from(offset)
            .map_err(|_| (ACL_ERROR_INVALID_PARAM, format!("{api}: negative offset")))?;
        let (buf, byte_offset) = self.locate(api, addr, 0)?;
        let size = dtype.size_bytes();
        if byte_offset % size != 0 {
            return invalid(format!("{api}: address {addr:#x} not aligned to {dtype}"));
        }
        let layout =
            Layout::strided(dtype, &shape, &strides, offset + byte_offset / size).map_err(bad)?;
        Tensor::new(buf, layout).map_err(bad)
    }

    /// Queue `tasks` on `stream` (recorded instead, while it is in the open capture) under the
    /// name of the task (`aclnnMatmul`, a kernel's name): a failure names it, as an AI Core
    /// exception report names the kernel.
    fn launch(&self, name: &'static str, stream: &sched::Stream, tasks: Vec<HostFn>) -> Res<()> {
        let mut recording = self.recording.lock().unwrap_or_else(PoisonError::into_inner);
        match recording.as_mut() {
            Some(c) if c.holds(stream.key) => {
                tasks.into_iter().for_each(|f| c.run(stream.key, name, f))
            }
            _ => tasks.into_iter().for_each(|f| stream.run(name, f)),
        }
        Ok(())
    }
}

/// A fresh zeroed allocation of the emulated device.
fn allocate(emu: &Emu, api: &str, len: usize) -> Res<DeviceBuffer> {
    DeviceBuffer::new(emu.instance, len)
        .ok_or_else(|| (ACL_ERROR_BAD_ALLOC, format!("{api}: no host memory for {len} bytes")))
}

fn bad(e: impl std::fmt::Display) -> (aclError, String) {
    (ACL_ERROR_INVALID_PARAM, e.to_string())
}

/// The kda dtype of an ACL dtype code.
fn dtype_of(code: aclDataType) -> Option<DType> {
    Some(match code {
        ACL_FLOAT => DType::F32,
        ACL_FLOAT16 => DType::F16,
        ACL_BF16 => DType::BF16,
        ACL_INT32 => DType::I32,
        ACL_UINT8 => DType::U8,
        ACL_FLOAT8_E4M3FN => DType::E4M3,
        ACL_FLOAT8_E8M0 => DType::E8M0,
        _ => return None,
    })
}

/// Copy `n` values from a C array (empty for `n == 0`, whatever the pointer).
///
/// # Safety
/// `ptr` points to `n` readable values when `n > 0`.
unsafe fn array<V: Copy>(ptr: *const V, n: usize) -> Res<Vec<V>> {
    if n == 0 {
        return Ok(Vec::new());
    }
    if ptr.is_null() {
        return invalid("null array");
    }
    // SAFETY: the caller's contract.
    Ok(unsafe { std::slice::from_raw_parts(ptr, n) }.to_vec())
}

/// Store `value` through an out-parameter.
///
/// # Safety
/// `out` is null or valid for a write of `V`.
unsafe fn put<V>(api: &str, out: *mut V, value: V) -> Res<()> {
    if out.is_null() {
        return invalid(format!("{api}: null out-parameter"));
    }
    // SAFETY: non-null, and valid per the caller's contract.
    unsafe { out.write(value) };
    Ok(())
}

/// The emulated runtime as a `kda-ascend-sys` table: each field is assigned this crate's own
/// function, so the compiler checks every emulated prototype against the shared list. The MX
/// ops are left out on a SoC without them (`KDA_ACL_EMU_SOC` not an Ascend 950), as CANN for
/// A2/A3 lacks them.
pub fn table() -> kda_ascend_sys::Api {
    table_for(&rt::soc_name())
}

/// The table of an emulated `soc`.
fn table_for(soc: &CString) -> kda_ascend_sys::Api {
    let mut api = kda_ascend_sys::Api {
        aclInit: Some(rt::aclInit),
        aclrtSetDevice: Some(rt::aclrtSetDevice),
        aclrtGetSocName: Some(rt::aclrtGetSocName),
        aclGetRecentErrMsg: Some(aclGetRecentErrMsg),
        aclrtMalloc: Some(rt::aclrtMalloc),
        aclrtFree: Some(rt::aclrtFree),
        aclrtMallocHost: Some(rt::aclrtMallocHost),
        aclrtFreeHost: Some(rt::aclrtFreeHost),
        aclrtMemcpyAsync: Some(rt::aclrtMemcpyAsync),
        aclrtCreateStream: Some(rt::aclrtCreateStream),
        aclrtDestroyStream: Some(rt::aclrtDestroyStream),
        aclrtSetStreamFailureMode: Some(rt::aclrtSetStreamFailureMode),
        aclrtSynchronizeStream: Some(rt::aclrtSynchronizeStream),
        aclrtCreateEventExWithFlag: Some(rt::aclrtCreateEventExWithFlag),
        aclrtDestroyEvent: Some(rt::aclrtDestroyEvent),
        aclrtRecordEvent: Some(rt::aclrtRecordEvent),
        aclrtStreamWaitEvent: Some(rt::aclrtStreamWaitEvent),
        aclrtQueryEventStatus: Some(rt::aclrtQueryEventStatus),
        aclrtEventElapsedTime: Some(rt::aclrtEventElapsedTime),
        aclrtLaunchHostFunc: Some(rt::aclrtLaunchHostFunc),
        aclmdlRICaptureBegin: Some(rt::aclmdlRICaptureBegin),
        aclmdlRICaptureEnd: Some(rt::aclmdlRICaptureEnd),
        aclmdlRIExecuteAsync: Some(rt::aclmdlRIExecuteAsync),
        aclmdlRIDestroy: Some(rt::aclmdlRIDestroy),
        aclmdlRICaptureGetInfo: Some(rt::aclmdlRICaptureGetInfo),
        aclrtBinaryLoadFromFile: Some(kernel::aclrtBinaryLoadFromFile),
        aclrtBinaryUnLoad: Some(kernel::aclrtBinaryUnLoad),
        aclrtBinaryGetFunction: Some(kernel::aclrtBinaryGetFunction),
        aclrtLaunchKernel: Some(kernel::aclrtLaunchKernel),
        aclrtLaunchKernelWithHostArgs: Some(kernel::aclrtLaunchKernelWithHostArgs),
        aclCreateTensor: Some(nn::aclCreateTensor),
        aclDestroyTensor: Some(nn::aclDestroyTensor),
        aclCreateScalar: Some(nn::aclCreateScalar),
        aclDestroyScalar: Some(nn::aclDestroyScalar),
        aclSetAclOpExecutorRepeatable: Some(nn::aclSetAclOpExecutorRepeatable),
        aclDestroyAclOpExecutor: Some(nn::aclDestroyAclOpExecutor),
        aclnnMatmulGetWorkspaceSize: Some(nn::aclnnMatmulGetWorkspaceSize),
        aclnnMatmul: Some(nn::aclnnMatmul),
        aclnnInplaceCopyGetWorkspaceSize: Some(nn::aclnnInplaceCopyGetWorkspaceSize),
        aclnnInplaceCopy: Some(nn::aclnnInplaceCopy),
        aclnnInplaceFillScalarGetWorkspaceSize: Some(nn::aclnnInplaceFillScalarGetWorkspaceSize),
        aclnnInplaceFillScalar: Some(nn::aclnnInplaceFillScalar),
        ..kda_ascend_sys::Api::default()
    };
    if rt::soc_has_mx(soc) {
        api.aclnnDynamicMxQuantV3GetWorkspaceSize = Some(nn::aclnnDynamicMxQuantV3GetWorkspaceSize);
        api.aclnnDynamicMxQuantV3 = Some(nn::aclnnDynamicMxQuantV3);
        api.aclnnQuantMatmulV5GetWorkspaceSize = Some(nn::aclnnQuantMatmulV5GetWorkspaceSize);
        api.aclnnQuantMatmulV5 = Some(nn::aclnnQuantMatmulV5);
    }
    vendor::register(&mut api);
    api
}

/// The message of this thread's most recent failed call (CANN's `aclGetRecentErrMsg`).
#[unsafe(no_mangle)]
pub extern "C" fn aclGetRecentErrMsg() -> *const c_char {
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every required symbol is emulated; the MX ops exist only on an emulated Ascend 950.
    #[test]
    fn the_table_has_every_required_symbol_and_the_mx_ops_only_on_950() {
        let soc = |s: &str| CString::new(s).unwrap_or_default();
        let a950 = table_for(&soc("Ascend950PR_9599"));
        assert_eq!(a950.missing_required(), Vec::<&str>::new());
        assert_eq!(a950.absent(), Vec::<&str>::new());
        let a2 = table_for(&soc("Ascend910B3"));
        assert_eq!(a2.missing_required(), Vec::<&str>::new());
        assert_eq!(a2.absent(), kda_ascend_sys::MX_SYMBOLS.to_vec());
    }

    /// `aclmdlRICaptureGetInfo` reports the origin of an open capture and every stream joined
    /// to it through an event as active, and none of them may be synchronized until it ends.
    #[test]
    #[allow(clippy::undocumented_unsafe_blocks, reason = "valid handles and out-parameters")]
    fn streams_joined_to_a_capture_are_reported_and_not_synchronized() {
        assert_eq!(rt::aclInit(std::ptr::null()), ACL_SUCCESS);
        assert_eq!(rt::aclrtSetDevice(0), ACL_SUCCESS);
        let stream = || {
            let mut s: aclrtStream = std::ptr::null_mut();
            assert_eq!(unsafe { rt::aclrtCreateStream(&mut s) }, ACL_SUCCESS);
            s
        };
        let event = || {
            let mut e: aclrtEvent = std::ptr::null_mut();
            let code = unsafe { rt::aclrtCreateEventExWithFlag(&mut e, ACL_EVENT_SYNC) };
            assert_eq!(code, ACL_SUCCESS);
            e
        };
        let status = |s: aclrtStream| {
            let mut st = -1;
            let code = unsafe { rt::aclmdlRICaptureGetInfo(s, &mut st, std::ptr::null_mut()) };
            assert_eq!(code, ACL_SUCCESS);
            st
        };
        let (origin, joined, other) = (stream(), stream(), stream());
        let (fork, join) = (event(), event());
        assert_eq!(status(origin), ACL_MODEL_RI_CAPTURE_STATUS_NONE);
        let mode = ACL_MODEL_RI_CAPTURE_MODE_RELAXED;
        assert_eq!(rt::aclmdlRICaptureBegin(origin, mode), ACL_SUCCESS);
        assert_eq!(rt::aclrtRecordEvent(fork, origin), ACL_SUCCESS);
        assert_eq!(status(joined), ACL_MODEL_RI_CAPTURE_STATUS_NONE);
        assert_eq!(rt::aclrtStreamWaitEvent(joined, fork), ACL_SUCCESS);
        assert_eq!(status(origin), ACL_MODEL_RI_CAPTURE_STATUS_ACTIVE);
        assert_eq!(status(joined), ACL_MODEL_RI_CAPTURE_STATUS_ACTIVE);
        assert_eq!(status(other), ACL_MODEL_RI_CAPTURE_STATUS_NONE);
        assert_eq!(rt::aclrtSynchronizeStream(joined), ACL_ERROR_RT_STREAM_CAPTURED);
        assert_eq!(rt::aclrtSynchronizeStream(other), ACL_SUCCESS);
        assert_eq!(rt::aclrtRecordEvent(join, joined), ACL_SUCCESS);
        assert_eq!(rt::aclrtStreamWaitEvent(origin, join), ACL_SUCCESS);
        let mut model: aclmdlRI = std::ptr::null_mut();
        assert_eq!(unsafe { rt::aclmdlRICaptureEnd(origin, &mut model) }, ACL_SUCCESS);
        assert_eq!(status(joined), ACL_MODEL_RI_CAPTURE_STATUS_NONE);
        assert_eq!(rt::aclrtSynchronizeStream(joined), ACL_SUCCESS);
        // An unknown stream is an error, not a status.
        let mut st = 0;
        let bogus = 0x8 as aclrtStream;
        let code = unsafe { rt::aclmdlRICaptureGetInfo(bogus, &mut st, std::ptr::null_mut()) };
        assert_eq!(code, ACL_ERROR_INVALID_PARAM);
        assert_eq!(rt::aclmdlRIDestroy(model), ACL_SUCCESS);
        for e in [fork, join] {
            assert_eq!(rt::aclrtDestroyEvent(e), ACL_SUCCESS);
        }
        for s in [origin, joined, other] {
            assert_eq!(rt::aclrtDestroyStream(s), ACL_SUCCESS);
        }
    }
}
