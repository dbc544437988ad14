//! The C types, codes and flags of CANN's `acl_base.h`, `acl_rt.h`, `acl_mdl.h` and
//! `aclnn/acl_meta.h` that kda uses, with their values from the 8.x/9.x headers.
//!
//! Error codes are those of `include/external/acl/error_codes/rt_error_codes.h` and
//! `acl_base.h` in CANN's open-sourced runtime (`hicann/runtime`); the flags those of
//! `acl_rt.h`. Shared, like the headers themselves, by the backend and the emulated runtime.

use std::ffi::{c_int, c_void};

pub type aclError = c_int;
pub type aclnnStatus = c_int;
pub type aclDataType = c_int;
pub type aclFormat = c_int;
pub type aclrtMemcpyKind = c_int;
pub type aclrtMemMallocPolicy = c_int;
pub type aclmdlRICaptureMode = c_int;
pub type aclmdlRICaptureStatus = c_int;
pub type aclrtEventRecordedStatus = c_int;

pub type aclrtStream = *mut c_void;
pub type aclrtEvent = *mut c_void;
pub type aclrtContext = *mut c_void;
pub type aclmdlRI = *mut c_void;
pub type aclrtBinHandle = *mut c_void;
pub type aclrtFuncHandle = *mut c_void;
/// `void (*)(void *args)`, the host function of `aclrtLaunchHostFunc`.
pub type aclrtHostFunc = Option<unsafe extern "C" fn(args: *mut c_void)>;

/// Opaque aclnn objects (`struct aclTensor` etc. in `acl_meta.h`).
#[repr(C)]
#[derive(Debug)]
pub struct aclTensor {
    _private: [u8; 0],
}
#[repr(C)]
#[derive(Debug)]
pub struct aclScalar {
    _private: [u8; 0],
}
#[repr(C)]
#[derive(Debug)]
pub struct aclOpExecutor {
    _private: [u8; 0],
}
/// `aclIntArray`: a host array of int64 (`aclnnChunkKdaFwd`'s `cuSeqlens`).
#[repr(C)]
#[derive(Debug)]
pub struct aclIntArray {
    _private: [u8; 0],
}
/// `aclrtBinaryLoadOptions`; kda passes none (null).
#[repr(C)]
#[derive(Debug)]
pub struct aclrtBinaryLoadOptions {
    _private: [u8; 0],
}

pub const ACL_SUCCESS: aclError = 0;
pub const ACL_ERROR_INVALID_PARAM: aclError = 100000;
pub const ACL_ERROR_UNINITIALIZE: aclError = 100001;
pub const ACL_ERROR_REPEAT_INITIALIZE: aclError = 100002;
pub const ACL_ERROR_INVALID_FILE: aclError = 100003;
pub const ACL_ERROR_FEATURE_UNSUPPORTED: aclError = 200006;
pub const ACL_ERROR_BAD_ALLOC: aclError = 200000;
// rt_error_codes.h: parameter and capture errors (107xxx).
pub const ACL_ERROR_RT_PARAM_INVALID: aclError = 107000;
pub const ACL_ERROR_RT_FILE_OPEN: aclError = 107009;
pub const ACL_ERROR_RT_INVALID_HANDLE: aclError = 107017;
pub const ACL_ERROR_RT_DEVICE_TASK_ABORT: aclError = 107022;
pub const ACL_ERROR_RT_STREAM_ABORT: aclError = 107023;
pub const ACL_ERROR_RT_CAPTURE_DEPENDENCY: aclError = 107024;
/// A capture ended with a forked stream that was not joined back to the origin.
pub const ACL_ERROR_RT_STREAM_UNJOINED: aclError = 107025;
/// A stream that is capturing cannot be synchronized, queried or destroyed.
pub const ACL_ERROR_RT_STREAM_CAPTURED: aclError = 107027;
/// An event recorded in an open capture cannot be synchronized or queried.
pub const ACL_ERROR_RT_EVENT_CAPTURED: aclError = 107028;
pub const ACL_ERROR_RT_STREAM_NOT_CAPTURED: aclError = 107029;
pub const ACL_ERROR_RT_SYMBOL_NOT_FOUND: aclError = 107042;
pub const ACL_ERROR_RT_INVALID_DEVICE_FUNCTION: aclError = 107044;
// Resource errors (207xxx).
pub const ACL_ERROR_RT_FEATURE_NOT_SUPPORT: aclError = 207000;
pub const ACL_ERROR_RT_MEMORY_ALLOCATION: aclError = 207001;
// Runtime and device errors (507xxx).
pub const ACL_ERROR_RT_INTERNAL_ERROR: aclError = 507000;
pub const ACL_ERROR_RT_EVENT_NOT_COMPLETE: aclError = 507006;
pub const ACL_ERROR_RT_AICORE_EXCEPTION: aclError = 507015;
pub const ACL_ERROR_RT_AICORE_TRAP_EXCEPTION: aclError = 507016;
pub const ACL_ERROR_RT_KERNEL_LOOKUP: aclError = 507027;
pub const ACL_ERROR_RT_VECTOR_CORE_EXCEPTION: aclError = 507035;
pub const ACL_ERROR_RT_DRV_INTERNAL_ERROR: aclError = 507899;
/// The capture was invalidated (an operation the capture cannot hold).
pub const ACL_ERROR_RT_STREAM_CAPTURE_INVALIDATED: aclError = 507903;
pub const ACLNN_SUCCESS: aclnnStatus = 0;
pub const ACLNN_ERR_PARAM_NULLPTR: aclnnStatus = 161001;
pub const ACLNN_ERR_PARAM_INVALID: aclnnStatus = 161002;
pub const ACLNN_ERR_INNER: aclnnStatus = 561000;

pub const ACL_FLOAT: aclDataType = 0;
pub const ACL_FLOAT16: aclDataType = 1;
pub const ACL_INT8: aclDataType = 2;
pub const ACL_INT32: aclDataType = 3;
pub const ACL_UINT8: aclDataType = 4;
pub const ACL_INT64: aclDataType = 9;
pub const ACL_DOUBLE: aclDataType = 11;
pub const ACL_BF16: aclDataType = 27;
pub const ACL_FLOAT8_E5M2: aclDataType = 35;
pub const ACL_FLOAT8_E4M3FN: aclDataType = 36;
pub const ACL_FLOAT8_E8M0: aclDataType = 37;
pub const ACL_FLOAT4_E2M1: aclDataType = 40;

pub const ACL_FORMAT_ND: aclFormat = 2;

pub const ACL_MEMCPY_HOST_TO_HOST: aclrtMemcpyKind = 0;
pub const ACL_MEMCPY_HOST_TO_DEVICE: aclrtMemcpyKind = 1;
pub const ACL_MEMCPY_DEVICE_TO_HOST: aclrtMemcpyKind = 2;
pub const ACL_MEMCPY_DEVICE_TO_DEVICE: aclrtMemcpyKind = 3;

pub const ACL_MEM_MALLOC_HUGE_FIRST: aclrtMemMallocPolicy = 0;

/// `aclrtCreateEventExWithFlag` flags: only SYNC events may be waited on by another stream
/// (a scarce resource: 65,536 per device); CAPTURE_STREAM_PROGRESS events mark a stream's
/// progress for host queries and may be recorded inside a capture.
pub const ACL_EVENT_SYNC: u32 = 0x1;
pub const ACL_EVENT_CAPTURE_STREAM_PROGRESS: u32 = 0x2;
pub const ACL_EVENT_TIME_LINE: u32 = 0x8;

pub const ACL_EVENT_RECORDED_STATUS_NOT_READY: aclrtEventRecordedStatus = 0;
pub const ACL_EVENT_RECORDED_STATUS_COMPLETE: aclrtEventRecordedStatus = 1;

/// `aclrtSetStreamFailureMode`: stop the stream's later tasks after a failed one (the mode then
/// holds for every stream of the context, and no new task is accepted).
pub const ACL_CONTINUE_ON_FAILURE: u64 = 0;
pub const ACL_STOP_ON_FAILURE: u64 = 1;

/// `aclrtLaunchKernelCfg` (`acl_rt.h`): launch attributes; kda passes none (null).
#[repr(C)]
#[derive(Debug)]
pub struct aclrtLaunchKernelCfg {
    pub attrs: *mut c_void,
    pub num_attrs: usize,
}

/// `aclrtPlaceHolderInfo` (`acl_rt.h`): at launch the runtime copies the host data at
/// `dataOffset` of `hostArgs` into device memory and writes that device address into `hostArgs`
/// at `addrOffset`.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct aclrtPlaceHolderInfo {
    pub addr_offset: u32,
    pub data_offset: u32,
}

pub const ACL_MODEL_RI_CAPTURE_MODE_GLOBAL: aclmdlRICaptureMode = 0;
pub const ACL_MODEL_RI_CAPTURE_MODE_THREAD_LOCAL: aclmdlRICaptureMode = 1;
pub const ACL_MODEL_RI_CAPTURE_MODE_RELAXED: aclmdlRICaptureMode = 2;

/// `aclmdlRICaptureGetInfo`'s status (acl_rt.h `aclmdlRICaptureStatus`).
pub const ACL_MODEL_RI_CAPTURE_STATUS_NONE: aclmdlRICaptureStatus = 0;
pub const ACL_MODEL_RI_CAPTURE_STATUS_ACTIVE: aclmdlRICaptureStatus = 1;
pub const ACL_MODEL_RI_CAPTURE_STATUS_INVALIDATED: aclmdlRICaptureStatus = 2;

/// `aclnnMatmul`'s `cubeMathType`: keep the input dtype (no HF32 down-conversion).
pub const KEEP_DTYPE: i8 = 0;

/// `aclnnQuantMatmulV5` `groupSize` for MX: `(groupM << 32) | (groupN << 16) | groupK` with
/// groupM = 1, groupN = 1, groupK = 32.
pub const MX_GROUP_SIZE: i64 = (1 << 32) | (1 << 16) | 32;
/// `aclnnDynamicMxQuantV3` block size along K.
pub const MX_BLOCK_SIZE: i64 = 32;
