//! The CANN declarations, from `kda-ascend-sys` (one list of prototypes, resolved at run time
//! with feature `acl`, or filled by the emulated runtime with feature `emulated`), and the
//! backend's helpers over them.

use std::ffi::c_void;

pub use kda_ascend_sys::*;

/// Phase two of every aclnn op has this signature.
pub type AclnnRun =
    unsafe extern "C" fn(*mut c_void, u64, *mut aclOpExecutor, aclrtStream) -> aclnnStatus;

/// The table of this build: CANN's libraries opened at run time (feature `acl`), else the
/// emulated runtime's functions (feature `emulated`).
pub(crate) fn bind_table() -> Result<&'static Api, LoadError> {
    #[cfg(feature = "acl")]
    {
        load()
    }
    #[cfg(not(feature = "acl"))]
    {
        install(kda_acl_emu::table())
    }
}

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
