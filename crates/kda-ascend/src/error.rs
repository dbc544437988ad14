//! The backend's errors: ACL failures with the function and code, and the twin's answer.

use thiserror::Error;

/// Why an Ascend call failed.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum AscendError {
    /// The crate was built without feature `acl` (CANN) or `emulated`.
    #[error(
        "kda-ascend was compiled without Ascend support: build with feature `acl` (and a CANN \
         toolkit) or `emulated`"
    )]
    NotCompiledWithAscend,
    /// The CANN libraries (or a required symbol) could not be found at backend creation.
    #[error("kda-ascend could not bind CANN: {0}")]
    Load(#[from] kda_ascend_sys::LoadError),
    /// An ACL runtime or aclnn call returned a non-zero code.
    #[error("{func} failed with ACL error {code}: {message}")]
    Acl { func: &'static str, code: i32, message: String },
    /// The kernel binary could not be found or loaded (the path is absolute).
    #[error("kernel binary {path}: {message}")]
    KernelBinary { path: String, message: String },
    /// A kernel the backend launches is not in the loaded kernel binary (one built from older
    /// sources, or another project's): named with the HAL op that needed it and the binary's
    /// absolute path; the op fails before anything is queued and the other kernels still run.
    #[error(
        "kernel `{kernel}` (needed by HAL op `{op}`) is not in the kernel binary {path}: rebuild \
         it from this version's sources with `cargo xtask kernels` ({message})"
    )]
    MissingKernel { kernel: &'static str, op: &'static str, path: String, message: String },
    /// A tiling that cannot be built (a row larger than the unified buffer, no cores).
    #[error("tiling of {kernel}: {message}")]
    Tiling { kernel: &'static str, message: String },
    /// A HAL request the backend cannot express (e.g. a dtype without an ACL code).
    #[error("{op}: {message}")]
    Unsupported { op: &'static str, message: String },
}

impl From<AscendError> for kda_core::Error {
    fn from(e: AscendError) -> Self {
        kda_core::Error::Backend { backend: "ascend", message: e.to_string() }
    }
}
