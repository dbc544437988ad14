//! The hand-written FFI: exactly the ACL runtime, aclnn and kernel-launch entry points the
//! backend calls, with CANN's C signatures (CANN 8.2+/9.0 headers: `acl/acl_rt.h`,
//! `acl/acl_mdl.h`, `aclnn/acl_meta.h`, `aclnnop/aclnn_*.h`). One place declares each symbol.
//!
//! With feature `acl` they resolve against the toolkit's `libascendcl`, `libnnopbase` and
//! `libopapi` (see `build.rs`); with feature `emulated`, against `kda-acl-emu`, which exports
//! the same symbols.

mod types;

use std::ffi::{c_char, c_int, c_void};

pub use types::*;

unsafe extern "C" {
    // acl.h / acl_rt.h: init, device, errors.
    pub fn aclInit(config_path: *const c_char) -> aclError;
    pub fn aclrtSetDevice(device_id: i32) -> aclError;
    pub fn aclrtGetSocName() -> *const c_char;
    pub fn aclGetRecentErrMsg() -> *const c_char;

    // Memory.
    pub fn aclrtMalloc(
        dev_ptr: *mut *mut c_void,
        size: usize,
        policy: aclrtMemMallocPolicy,
    ) -> aclError;
    pub fn aclrtFree(dev_ptr: *mut c_void) -> aclError;
    pub fn aclrtMallocHost(host_ptr: *mut *mut c_void, size: usize) -> aclError;
    pub fn aclrtFreeHost(host_ptr: *mut c_void) -> aclError;
    pub fn aclrtHostRegister(
        ptr: *mut c_void,
        size: u64,
        kind: c_int,
        dev_ptr: *mut *mut c_void,
    ) -> aclError;
    pub fn aclrtHostUnregister(ptr: *mut c_void) -> aclError;
    pub fn aclrtMemcpyAsync(
        dst: *mut c_void,
        dest_max: usize,
        src: *const c_void,
        count: usize,
        kind: aclrtMemcpyKind,
        stream: aclrtStream,
    ) -> aclError;

    // Streams, events, host functions.
    pub fn aclrtCreateStream(stream: *mut aclrtStream) -> aclError;
    pub fn aclrtDestroyStream(stream: aclrtStream) -> aclError;
    pub fn aclrtSetStreamFailureMode(stream: aclrtStream, mode: u64) -> aclError;
    pub fn aclrtSynchronizeStream(stream: aclrtStream) -> aclError;
    pub fn aclrtCreateEventExWithFlag(event: *mut aclrtEvent, flag: u32) -> aclError;
    pub fn aclrtDestroyEvent(event: aclrtEvent) -> aclError;
    pub fn aclrtRecordEvent(event: aclrtEvent, stream: aclrtStream) -> aclError;
    pub fn aclrtStreamWaitEvent(stream: aclrtStream, event: aclrtEvent) -> aclError;
    pub fn aclrtQueryEventStatus(
        event: aclrtEvent,
        status: *mut aclrtEventRecordedStatus,
    ) -> aclError;
    pub fn aclrtLaunchHostFunc(
        stream: aclrtStream,
        f: aclrtHostFunc,
        args: *mut c_void,
    ) -> aclError;

    // acl_mdl.h: capture into a model runtime instance.
    pub fn aclmdlRICaptureBegin(stream: aclrtStream, mode: aclmdlRICaptureMode) -> aclError;
    pub fn aclmdlRICaptureEnd(stream: aclrtStream, model_ri: *mut aclmdlRI) -> aclError;
    pub fn aclmdlRIExecuteAsync(model_ri: aclmdlRI, stream: aclrtStream) -> aclError;
    pub fn aclmdlRIDestroy(model_ri: aclmdlRI) -> aclError;

    // Kernel binaries and launches.
    pub fn aclrtBinaryLoadFromFile(
        path: *const c_char,
        options: *mut aclrtBinaryLoadOptions,
        handle: *mut aclrtBinHandle,
    ) -> aclError;
    pub fn aclrtBinaryUnLoad(handle: aclrtBinHandle) -> aclError;
    pub fn aclrtBinaryGetFunction(
        binary: aclrtBinHandle,
        kernel_name: *const c_char,
        func: *mut aclrtFuncHandle,
    ) -> aclError;
    pub fn aclrtLaunchKernel(
        func: aclrtFuncHandle,
        block_dim: u32,
        args: *const c_void,
        args_size: usize,
        stream: aclrtStream,
    ) -> aclError;

    // aclnn meta: descriptors and executors.
    pub fn aclCreateTensor(
        view_dims: *const i64,
        view_dims_num: u64,
        data_type: aclDataType,
        stride: *const i64,
        offset: i64,
        format: aclFormat,
        storage_dims: *const i64,
        storage_dims_num: u64,
        tensor_data: *mut c_void,
    ) -> *mut aclTensor;
    pub fn aclDestroyTensor(tensor: *const aclTensor) -> aclnnStatus;
    pub fn aclCreateScalar(value: *mut c_void, data_type: aclDataType) -> *mut aclScalar;
    pub fn aclDestroyScalar(scalar: *const aclScalar) -> aclnnStatus;
    pub fn aclSetAclOpExecutorRepeatable(executor: *mut aclOpExecutor) -> aclnnStatus;
    pub fn aclDestroyAclOpExecutor(executor: *mut aclOpExecutor) -> aclnnStatus;

    // aclnn ops, two phases each.
    pub fn aclnnMatmulGetWorkspaceSize(
        self_: *const aclTensor,
        mat2: *const aclTensor,
        out: *mut aclTensor,
        cube_math_type: i8,
        workspace_size: *mut u64,
        executor: *mut *mut aclOpExecutor,
    ) -> aclnnStatus;
    pub fn aclnnMatmul(
        workspace: *mut c_void,
        workspace_size: u64,
        executor: *mut aclOpExecutor,
        stream: aclrtStream,
    ) -> aclnnStatus;
    pub fn aclnnInplaceCopyGetWorkspaceSize(
        self_ref: *mut aclTensor,
        src: *const aclTensor,
        workspace_size: *mut u64,
        executor: *mut *mut aclOpExecutor,
    ) -> aclnnStatus;
    pub fn aclnnInplaceCopy(
        workspace: *mut c_void,
        workspace_size: u64,
        executor: *mut aclOpExecutor,
        stream: aclrtStream,
    ) -> aclnnStatus;
    pub fn aclnnInplaceFillScalarGetWorkspaceSize(
        self_ref: *mut aclTensor,
        value: *const aclScalar,
        workspace_size: *mut u64,
        executor: *mut *mut aclOpExecutor,
    ) -> aclnnStatus;
    pub fn aclnnInplaceFillScalar(
        workspace: *mut c_void,
        workspace_size: u64,
        executor: *mut aclOpExecutor,
        stream: aclrtStream,
    ) -> aclnnStatus;
    pub fn aclnnDynamicMxQuantV3GetWorkspaceSize(
        x: *const aclTensor,
        axis: i64,
        round_mode: *const c_char,
        dst_type: i64,
        blocksize: i64,
        scale_alg: i64,
        dst_type_max: f64,
        max_low_bound: f64,
        y_out: *mut aclTensor,
        mxscale_out: *mut aclTensor,
        workspace_size: *mut u64,
        executor: *mut *mut aclOpExecutor,
    ) -> aclnnStatus;
    pub fn aclnnDynamicMxQuantV3(
        workspace: *mut c_void,
        workspace_size: u64,
        executor: *mut aclOpExecutor,
        stream: aclrtStream,
    ) -> aclnnStatus;
    pub fn aclnnQuantMatmulV5GetWorkspaceSize(
        x1: *const aclTensor,
        x2: *const aclTensor,
        x1_scale: *const aclTensor,
        x2_scale: *const aclTensor,
        y_scale: *const aclTensor,
        x1_offset: *const aclTensor,
        x2_offset: *const aclTensor,
        y_offset: *const aclTensor,
        bias: *const aclTensor,
        transpose_x1: bool,
        transpose_x2: bool,
        group_size: i64,
        out: *mut aclTensor,
        workspace_size: *mut u64,
        executor: *mut *mut aclOpExecutor,
    ) -> aclnnStatus;
    pub fn aclnnQuantMatmulV5(
        workspace: *mut c_void,
        workspace_size: u64,
        executor: *mut aclOpExecutor,
        stream: aclrtStream,
    ) -> aclnnStatus;
}

/// Phase two of every aclnn op has this signature.
pub type AclnnRun =
    unsafe extern "C" fn(*mut c_void, u64, *mut aclOpExecutor, aclrtStream) -> aclnnStatus;

/// This thread's most recent ACL error text (empty when there is none).
pub fn recent_error() -> String {
    // SAFETY: returns null or a NUL-terminated string owned by the runtime, valid until the
    // thread's next failing call; it is copied at once.
    let ptr = unsafe { aclGetRecentErrMsg() };
    if ptr.is_null() {
        return String::new();
    }
    // SAFETY: non-null, NUL-terminated (the runtime's contract).
    unsafe { std::ffi::CStr::from_ptr(ptr) }.to_string_lossy().into_owned()
}
