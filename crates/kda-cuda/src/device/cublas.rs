//! cuBLAS, opened by kda itself (cudarc's candidate names stop at `.so.12`; see
//! [`crate::libs`]): the five entry points the backend calls, and a handle per stream with its
//! own workspace.
//!
//! The handle's workspace is set explicitly (`cublasSetWorkspace`), so cuBLAS never allocates
//! inside a GEMM: a GEMM captured into a CUDA graph then holds no allocation of cuBLAS's own.
//!
//! Bit-equality across streams: cuBLAS promises bitwise identical results run to run (same
//! toolkit, same architecture and SM count) only while one stream is active per handle and
//! workspace; with several concurrent streams it may pick other implementations, unless each
//! stream has its own workspace or its own handle (cuBLAS guide, "Results reproducibility").
//! kda gives every stream its own handle and its own workspace, every handle the same
//! configuration ([`HANDLE_CONFIG`]: workspace size, default math mode, atomics not allowed),
//! and every GEMM the same call (`CUBLAS_GEMM_DEFAULT`: the heuristic, which depends only on
//! the call and the handle's configuration; cublasGemmEx cannot force an algorithm on Hopper,
//! its explicit `CUBLAS_GEMM_ALGO*` values being deprecated no-ops there). So a GEMM gives
//! the same bits on any stream, alone or beside others, and the overlapped schedules are
//! compared with serial bit for bit.
//! Dropping a handle never panics (a failed `cublasDestroy` is ignored: nothing is left to
//! recover, and a drop must not unwind).

use std::ffi::{c_int, c_void};
use std::path::Path;
use std::sync::{Arc, OnceLock};

use cudarc::driver::{CudaContext, sys};
use libloading::Library;

use super::memory::DeviceMemory;
use crate::CudaError;
use crate::libs::{self, CUBLAS_NAMES, CUBLAS_VAR};

type Handle = *mut c_void;
type Status = c_int;

/// `cublasOperation_t`.
pub(super) const OP_N: c_int = 0;
pub(super) const OP_T: c_int = 1;
/// `cudaDataType`: `CUDA_R_32F`, `CUDA_R_16F`, `CUDA_R_16BF`.
pub(super) const R_32F: c_int = 0;
pub(super) const R_16F: c_int = 2;
pub(super) const R_16BF: c_int = 14;
/// `CUBLAS_COMPUTE_32F` and `CUBLAS_GEMM_DEFAULT` (the same values in CUDA 12 and 13).
const COMPUTE_32F: c_int = 68;
const GEMM_DEFAULT: c_int = -1;

/// How every handle is configured: the same for all, so the heuristic picks the same
/// implementation for the same call on every stream (see the module docs).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(super) struct HandleConfig {
    /// Bytes of the handle's own workspace (NVIDIA's recommendation for Hopper).
    pub(super) workspace_bytes: usize,
    /// `cublasMath_t`: `CUBLAS_DEFAULT_MATH` (0).
    pub(super) math_mode: c_int,
    /// `cublasAtomicsMode_t`: `CUBLAS_ATOMICS_NOT_ALLOWED` (0), cuBLAS's default, set anyway:
    /// routines that use atomics are not deterministic.
    pub(super) atomics: c_int,
}

pub(super) const HANDLE_CONFIG: HandleConfig =
    HandleConfig { workspace_bytes: 32 << 20, math_mode: 0, atomics: 0 };

const WORKSPACE_BYTES: usize = HANDLE_CONFIG.workspace_bytes;

type GemmEx = unsafe extern "C" fn(
    Handle,
    c_int,
    c_int,
    c_int,
    c_int,
    c_int,
    *const c_void,
    *const c_void,
    c_int,
    c_int,
    *const c_void,
    c_int,
    c_int,
    *const c_void,
    *mut c_void,
    c_int,
    c_int,
    c_int,
    c_int,
) -> Status;

/// The loaded library and its entry points.
struct Api {
    /// Where it was loaded from (a file path, or the name the loader resolved).
    origin: String,
    create: unsafe extern "C" fn(*mut Handle) -> Status,
    destroy: unsafe extern "C" fn(Handle) -> Status,
    set_stream: unsafe extern "C" fn(Handle, sys::CUstream) -> Status,
    set_workspace: unsafe extern "C" fn(Handle, *mut c_void, usize) -> Status,
    set_math_mode: unsafe extern "C" fn(Handle, c_int) -> Status,
    set_atomics_mode: unsafe extern "C" fn(Handle, c_int) -> Status,
    gemm_ex: GemmEx,
    /// Kept open for the life of the process (the entry points above point into them).
    _libraries: Vec<Library>,
}

static API: OnceLock<Result<Api, String>> = OnceLock::new();

/// The library, opened on first use: `$KDA_CUBLAS` if set, else the newest soname the loader
/// resolves, else the first file found in [`libs::search_dirs`].
fn api() -> Result<&'static Api, CudaError> {
    API.get_or_init(open)
        .as_ref()
        .map_err(|reason| CudaError::NoCudaDevice { ordinal: 0, reason: reason.clone() })
}

/// Where cuBLAS was loaded from; an error naming what was searched when it cannot be.
pub fn origin() -> Result<&'static str, CudaError> {
    api().map(|a| a.origin.as_str())
}

impl super::CudaBackend {
    /// The cuBLAS library this process opened (a path, or the soname the loader resolved).
    pub fn cublas_library(&self) -> &'static str {
        origin().unwrap_or("(not loaded)")
    }
}

fn open() -> Result<Api, String> {
    if let Some(path) = std::env::var_os(CUBLAS_VAR) {
        let path = Path::new(&path);
        return open_file(path).map_err(|e| format!("{CUBLAS_VAR}={}: {e}", path.display()));
    }
    for name in CUBLAS_NAMES {
        // SAFETY: opening cuBLAS runs its initialisers, which have no preconditions.
        if let Ok(lib) = unsafe { Library::new(name) } {
            return resolve(name.to_string(), vec![lib]);
        }
    }
    let found = libs::find(&CUBLAS_NAMES, &libs::search_dirs())
        .map_err(|miss| format!("cuBLAS could not be loaded: {miss}"))?;
    open_file(&found)
}

/// Open a cuBLAS file by path, its cuBLASLt first when it lies beside it.
fn open_file(path: &Path) -> Result<Api, String> {
    let mut libraries = Vec::new();
    if let Some(lt) = libs::companion_lt(path) {
        // SAFETY: as in `open`.
        libraries.push(unsafe { Library::new(&lt) }.map_err(|e| format!("{}: {e}", lt.display()))?);
    }
    // SAFETY: as in `open`.
    libraries.push(unsafe { Library::new(path) }.map_err(|e| format!("{}: {e}", path.display()))?);
    resolve(path.display().to_string(), libraries)
}

fn resolve(origin: String, libraries: Vec<Library>) -> Result<Api, String> {
    let lib = libraries.last().ok_or("no library")?;
    fn sym<T: Copy>(lib: &Library, name: &str) -> Result<T, String> {
        // SAFETY: each name is looked up with the C signature cuBLAS declares for it (the types
        // of `Api`'s fields, identical in CUDA 12 and 13).
        unsafe { lib.get::<T>(name.as_bytes()) }
            .map(|s| *s)
            .map_err(|e| format!("cuBLAS lacks {name}: {e}"))
    }
    Ok(Api {
        create: sym(lib, "cublasCreate_v2")?,
        destroy: sym(lib, "cublasDestroy_v2")?,
        set_stream: sym(lib, "cublasSetStream_v2")?,
        set_workspace: sym(lib, "cublasSetWorkspace_v2")?,
        set_math_mode: sym(lib, "cublasSetMathMode")?,
        set_atomics_mode: sym(lib, "cublasSetAtomicsMode")?,
        gemm_ex: sym(lib, "cublasGemmEx")?,
        origin,
        _libraries: libraries,
    })
}

fn check(call: &'static str, status: Status) -> Result<(), CudaError> {
    if status == 0 {
        Ok(())
    } else {
        Err(CudaError::Driver { call, message: format!("cuBLAS status {status}") })
    }
}

/// A cuBLAS handle bound to one stream, with its own workspace.
#[derive(Debug)]
pub(super) struct BlasHandle {
    handle: Handle,
    /// Freed after the handle (fields drop after `Drop::drop`).
    _workspace: DeviceMemory,
}

// SAFETY: a cuBLAS handle may be used from any host thread; every call through this one is
// ordered by its stream, so its workspace is never used by two GEMMs at once.
unsafe impl Send for BlasHandle {}
// SAFETY: as for `Send`: cuBLAS's API is thread safe for one handle.
unsafe impl Sync for BlasHandle {}

impl BlasHandle {
    pub(super) fn new(ctx: &Arc<CudaContext>, stream: sys::CUstream) -> Result<Self, CudaError> {
        let api = api()?;
        let workspace = DeviceMemory::new(ctx, WORKSPACE_BYTES)?;
        let mut handle: Handle = std::ptr::null_mut();
        // SAFETY: `handle` receives a new handle; the context is current (`DeviceMemory::new`).
        check("cublasCreate", unsafe { (api.create)(&mut handle) })?;
        let this = Self { handle, _workspace: workspace };
        // SAFETY: a live handle and stream; the workspace holds WORKSPACE_BYTES bytes and lives
        // as long as the handle.
        unsafe {
            check("cublasSetStream", (api.set_stream)(this.handle, stream))?;
            let ptr = this._workspace.ptr as *mut c_void;
            check("cublasSetWorkspace", (api.set_workspace)(this.handle, ptr, WORKSPACE_BYTES))?;
            check("cublasSetMathMode", (api.set_math_mode)(this.handle, HANDLE_CONFIG.math_mode))?;
            let atomics = HANDLE_CONFIG.atomics;
            check("cublasSetAtomicsMode", (api.set_atomics_mode)(this.handle, atomics))?;
        }
        Ok(this)
    }

    /// `C = A·B` in column-major terms, fp32 compute (`cublasGemmEx`).
    ///
    /// # Safety
    /// `a`, `b` and `c` address device memory of the sizes the dimensions and leading
    /// dimensions describe, in the given data types.
    #[allow(clippy::too_many_arguments, reason = "cublasGemmEx's own parameters")]
    pub(super) unsafe fn gemm(
        &self,
        (op_a, op_b): (c_int, c_int),
        (m, n, k): (c_int, c_int, c_int),
        (a, a_type, lda): (u64, c_int, c_int),
        (b, b_type, ldb): (u64, c_int, c_int),
        (c, c_type, ldc): (u64, c_int, c_int),
    ) -> Result<(), CudaError> {
        let api = api()?;
        let (alpha, beta) = (1.0f32, 0.0f32);
        // SAFETY: the caller's contract; alpha and beta are host f32, as fp32 compute reads
        // them in the default host pointer mode.
        let status = unsafe {
            (api.gemm_ex)(
                self.handle,
                op_a,
                op_b,
                m,
                n,
                k,
                &alpha as *const f32 as *const c_void,
                a as *const c_void,
                a_type,
                lda,
                b as *const c_void,
                b_type,
                ldb,
                &beta as *const f32 as *const c_void,
                c as *mut c_void,
                c_type,
                ldc,
                COMPUTE_32F,
                GEMM_DEFAULT,
            )
        };
        check("cublasGemmEx", status)
    }
}

impl Drop for BlasHandle {
    fn drop(&mut self) {
        if let Ok(api) = api() {
            // `cublasDestroy` synchronises the device: not while another thread captures.
            // SAFETY: created in `new`, destroyed once, here; a failure is ignored (a drop must
            // not panic, and nothing is left to recover).
            let _ = super::memory::whole_device(|| unsafe { (api.destroy)(self.handle) });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What cuBLAS's reproducibility rules need of every handle: a workspace of its own (set,
    /// so cuBLAS never shares one between streams), the default math mode and no atomics.
    #[test]
    fn every_handle_is_configured_for_reproducible_gemms() {
        const { assert!(HANDLE_CONFIG.workspace_bytes >= 4 << 20, "room for the heuristic's choices") };
        assert_eq!(HANDLE_CONFIG.atomics, 0, "CUBLAS_ATOMICS_NOT_ALLOWED");
        assert_eq!(HANDLE_CONFIG.math_mode, 0, "CUBLAS_DEFAULT_MATH");
        assert_eq!(GEMM_DEFAULT, -1, "one algorithm choice for every stream: the heuristic");
    }
}
