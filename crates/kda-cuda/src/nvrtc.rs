//! NVRTC: a kernel program compiled with the crate's options, to CUBIN for a real architecture
//! (`sm_90`: what the backend loads, so no PTX JIT and no dependence on the driver knowing the
//! NVRTC's PTX version) or to PTX for a virtual one (`compute_90`: to list its entries).
//!
//! kda opens NVRTC itself, as it does cuBLAS: cudarc's candidate names stop at `.so.12`, so
//! CUDA 13's `libnvrtc.so.13` (the `nvidia-cuda-nvrtc` wheel's `nvidia/cu13/lib`) would never
//! be found. `$KDA_NVRTC` (a file) wins; else CUDA 12's soname, then CUDA 13's, then
//! `libnvrtc.so`, through the loader's path and then in [`libs::search_dirs`] (CUDA 12 first:
//! its sm_90 CUBINs load on the drivers of CUDA 12 and 13, CUDA 13's need a CUDA 13 driver).
//! The entry points used are the same in both.

use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::path::Path;
use std::sync::OnceLock;

use libloading::Library;

use crate::CudaError;
use crate::kernels::{COMPILE_OPTIONS, KernelSource};
use crate::libs::{self, NVRTC_NAMES, NVRTC_VAR};

type Program = *mut c_void;
type Status = c_int;

/// The loaded library and the entry points the compile uses.
struct Api {
    /// Where it was loaded from (a path, or the soname the loader resolved) and its version.
    origin: String,
    version: (c_int, c_int),
    create: unsafe extern "C" fn(
        *mut Program,
        *const c_char,
        *const c_char,
        c_int,
        *const *const c_char,
        *const *const c_char,
    ) -> Status,
    compile: unsafe extern "C" fn(Program, c_int, *const *const c_char) -> Status,
    log_size: unsafe extern "C" fn(Program, *mut usize) -> Status,
    log: unsafe extern "C" fn(Program, *mut c_char) -> Status,
    cubin_size: unsafe extern "C" fn(Program, *mut usize) -> Status,
    cubin: unsafe extern "C" fn(Program, *mut c_char) -> Status,
    ptx_size: unsafe extern "C" fn(Program, *mut usize) -> Status,
    ptx: unsafe extern "C" fn(Program, *mut c_char) -> Status,
    destroy: unsafe extern "C" fn(*mut Program) -> Status,
    error_string: unsafe extern "C" fn(Status) -> *const c_char,
    /// Kept open for the life of the process (the entry points above point into it).
    _library: Library,
}

static API: OnceLock<Result<Api, String>> = OnceLock::new();

fn api() -> Result<&'static Api, String> {
    API.get_or_init(open).as_ref().map_err(Clone::clone)
}

/// Whether libnvrtc can be loaded.
pub fn present() -> bool {
    api().is_ok()
}

/// The NVRTC this process compiles with: where it was loaded from and its version
/// (`libnvrtc.so.12 (NVRTC 12.9)`), or why none could be loaded.
pub fn library() -> Result<String, String> {
    api().map(|a| format!("{} (NVRTC {}.{})", a.origin, a.version.0, a.version.1))
}

fn open() -> Result<Api, String> {
    if let Some(path) = std::env::var_os(NVRTC_VAR) {
        let path = Path::new(&path);
        return open_path(path).map_err(|e| format!("{NVRTC_VAR}={}: {e}", path.display()));
    }
    for name in NVRTC_NAMES {
        // SAFETY: opening NVRTC runs its initialisers, which have no preconditions.
        if let Ok(library) = unsafe { Library::new(name) } {
            return resolve(name.to_string(), library);
        }
    }
    let found = libs::find_by_name(&NVRTC_NAMES, &libs::search_dirs())
        .map_err(|miss| format!("libnvrtc could not be loaded: {miss}"))?;
    open_path(&found)
}

fn open_path(path: &Path) -> Result<Api, String> {
    // SAFETY: as in `open`.
    let library = unsafe { Library::new(path) }.map_err(|e| format!("{}: {e}", path.display()))?;
    resolve(path.display().to_string(), library)
}

fn resolve(origin: String, library: Library) -> Result<Api, String> {
    fn sym<T: Copy>(lib: &Library, name: &str) -> Result<T, String> {
        // SAFETY: each name is looked up with the C signature NVRTC declares for it (the types
        // of `Api`'s fields, identical in CUDA 12 and 13).
        unsafe { lib.get::<T>(name.as_bytes()) }
            .map(|s| *s)
            .map_err(|e| format!("libnvrtc lacks {name}: {e}"))
    }
    let lib = &library;
    let version_fn: unsafe extern "C" fn(*mut c_int, *mut c_int) -> Status =
        sym(lib, "nvrtcVersion")?;
    let mut version = (0, 0);
    // SAFETY: writes two ints.
    let _ = unsafe { version_fn(&mut version.0, &mut version.1) };
    Ok(Api {
        origin,
        version,
        create: sym(lib, "nvrtcCreateProgram")?,
        compile: sym(lib, "nvrtcCompileProgram")?,
        log_size: sym(lib, "nvrtcGetProgramLogSize")?,
        log: sym(lib, "nvrtcGetProgramLog")?,
        cubin_size: sym(lib, "nvrtcGetCUBINSize")?,
        cubin: sym(lib, "nvrtcGetCUBIN")?,
        ptx_size: sym(lib, "nvrtcGetPTXSize")?,
        ptx: sym(lib, "nvrtcGetPTX")?,
        destroy: sym(lib, "nvrtcDestroyProgram")?,
        error_string: sym(lib, "nvrtcGetErrorString")?,
        _library: library,
    })
}

/// Text up to the first NUL.
fn text(bytes: &[u8]) -> String {
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    String::from_utf8_lossy(&bytes[..end]).into_owned()
}

/// A program, destroyed when dropped.
struct Compiled<'a> {
    api: &'a Api,
    prog: Program,
}

impl Compiled<'_> {
    fn error(&self, call: &str, status: Status) -> String {
        // SAFETY: NVRTC returns a static string for any status.
        let what = unsafe { (self.api.error_string)(status) };
        let what = if what.is_null() {
            format!("status {status}")
        } else {
            // SAFETY: a NUL-terminated static string (checked non-null).
            unsafe { CStr::from_ptr(what) }.to_string_lossy().into_owned()
        };
        format!("{call}: {what}")
    }

    /// Bytes of one of the program's outputs (`size` then `get`, the NVRTC pattern).
    fn output(
        &self,
        what: &str,
        size: unsafe extern "C" fn(Program, *mut usize) -> Status,
        get: unsafe extern "C" fn(Program, *mut c_char) -> Status,
    ) -> Result<Vec<u8>, String> {
        let mut n = 0usize;
        // SAFETY: a live program; `n` receives the size.
        let status = unsafe { size(self.prog, &mut n) };
        if status != 0 {
            return Err(self.error(what, status));
        }
        let mut bytes = vec![0u8; n];
        // SAFETY: `bytes` holds the `n` bytes NVRTC said it writes.
        let status = unsafe { get(self.prog, bytes.as_mut_ptr() as *mut c_char) };
        if status != 0 {
            return Err(self.error(what, status));
        }
        Ok(bytes)
    }
}

impl Drop for Compiled<'_> {
    fn drop(&mut self) {
        // SAFETY: created by `nvrtcCreateProgram`, destroyed once, here.
        let _ = unsafe { (self.api.destroy)(&mut self.prog) };
    }
}

/// Compile `source` for `arch`: CUBIN bytes for `sm_*`, PTX text for `compute_*`. Without
/// libnvrtc, an error that says what was searched.
pub fn compile(source: &KernelSource, arch: &str) -> Result<Vec<u8>, CudaError> {
    let fail = |log: String| CudaError::KernelCompile { source_name: source.name, log };
    let api = api().map_err(fail)?;
    let program = CString::new(source.program()).map_err(|e| fail(e.to_string()))?;
    let name = CString::new(source.name).map_err(|e| fail(e.to_string()))?;
    let mut options = vec![format!("--gpu-architecture={arch}")];
    options.extend(COMPILE_OPTIONS.iter().map(|s| s.to_string()));
    let options = options
        .into_iter()
        .map(CString::new)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| fail(e.to_string()))?;
    let pointers: Vec<*const c_char> = options.iter().map(|o| o.as_ptr()).collect();
    let mut prog: Program = std::ptr::null_mut();
    // SAFETY: `program` and `name` are NUL-terminated and outlive the call; no headers.
    let status = unsafe {
        (api.create)(
            &mut prog,
            program.as_ptr(),
            name.as_ptr(),
            0,
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    if status != 0 {
        return Err(fail(format!("nvrtcCreateProgram failed with status {status}")));
    }
    let compiled = Compiled { api, prog };
    let count = c_int::try_from(pointers.len()).map_err(|e| fail(e.to_string()))?;
    // SAFETY: a live program; `pointers` holds `count` NUL-terminated options that outlive the
    // call.
    let status = unsafe { (api.compile)(compiled.prog, count, pointers.as_ptr()) };
    if status != 0 {
        let log = compiled.output("nvrtcGetProgramLog", api.log_size, api.log).unwrap_or_default();
        return Err(fail(format!(
            "{}: {}",
            compiled.error("nvrtcCompileProgram", status),
            text(&log)
        )));
    }
    if arch.starts_with("sm_") {
        compiled.output("nvrtcGetCUBIN", api.cubin_size, api.cubin).map_err(fail)
    } else {
        let ptx = compiled.output("nvrtcGetPTX", api.ptx_size, api.ptx).map_err(fail)?;
        Ok(text(&ptx).into_bytes())
    }
}
