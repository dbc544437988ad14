//! The kda AscendC kernel binary: loaded once per backend instance from an absolute path,
//! functions resolved by name and cached, launched with `aclrtLaunchKernelWithHostArgs` (the
//! launch function CANN documents for binaries loaded with `aclrtBinaryLoadFromFile`): tensor
//! pointers by value, the tiling and descriptors as a GM pointer through a placeholder (see
//! [`abi`]).

use std::collections::HashMap;
use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};

use kda_core::Result;

use super::acl::check;
use crate::error::AscendError;
use crate::kernels::abi::{self, GmTensor, KernelTiling};
use crate::sys;

/// Where `cargo xtask kernels` puts the compiled kernels, below the target directory.
pub const KERNELS_IN_TARGET: &str = "ascend-kernels/kda_kernels.o";

/// The kernel binary to load, as an absolute path (`aclrtBinaryLoadFromFile` requires one):
/// `explicit`, else `KDA_ASCEND_KERNELS`, else [`KERNELS_IN_TARGET`] in the nearest directory
/// above the executable that has it (`target/` for tests and `kda`), else — over the emulated
/// runtime — its stand-in binary. A relative path is taken from the working directory.
pub(crate) fn binary_path(explicit: Option<&Path>) -> std::result::Result<PathBuf, AscendError> {
    let named = explicit
        .map(Path::to_path_buf)
        .or_else(|| std::env::var_os("KDA_ASCEND_KERNELS").map(PathBuf::from));
    let absolute = |p: &Path| {
        std::path::absolute(p).map_err(|e| AscendError::KernelBinary {
            path: p.display().to_string(),
            message: format!("cannot make the path absolute: {e}"),
        })
    };
    if let Some(path) = named {
        return absolute(&path);
    }
    let exe = std::env::current_exe().ok();
    let above_exe = exe.as_deref().and_then(Path::parent).into_iter().flat_map(Path::ancestors);
    if let Some(found) = above_exe.map(|dir| dir.join(KERNELS_IN_TARGET)).find(|p| p.is_file()) {
        return absolute(&found);
    }
    default_binary(exe.as_deref())
}

/// No compiled binary: the emulated runtime's stand-in, written once per process.
#[cfg(not(feature = "acl"))]
fn default_binary(_exe: Option<&Path>) -> std::result::Result<PathBuf, AscendError> {
    static STAND_IN: std::sync::OnceLock<std::result::Result<PathBuf, AscendError>> =
        std::sync::OnceLock::new();
    STAND_IN
        .get_or_init(|| {
            let dir = std::env::temp_dir().join(format!("kda-acl-emu-{}", std::process::id()));
            let path = std::path::absolute(dir.join("kda_kernels.o")).unwrap_or_default();
            let all = crate::kernels::abi::names::ALL;
            kda_acl_emu::write_stand_in(&path, &all).map_err(|e| AscendError::KernelBinary {
                path: path.display().to_string(),
                message: format!("cannot write the emulator's stand-in binary: {e}"),
            })?;
            Ok(path)
        })
        .clone()
}

/// No compiled binary on a CANN build: say where it was looked for.
#[cfg(feature = "acl")]
fn default_binary(exe: Option<&Path>) -> std::result::Result<PathBuf, AscendError> {
    Err(AscendError::KernelBinary {
        path: KERNELS_IN_TARGET.into(),
        message: format!(
            "not found above {} and KDA_ASCEND_KERNELS is not set; build it with `cargo xtask \
             kernels`",
            exe.map_or_else(|| "the executable".into(), |e| e.display().to_string())
        ),
    })
}

/// The loaded binary and its functions (addresses of opaque handles).
#[derive(Debug, Default)]
pub(crate) struct Kernels {
    /// The binary named by the backend's options (`None`: the default search).
    path: Option<PathBuf>,
    loaded: Mutex<Option<Loaded>>,
}

/// A loaded binary: its handle, absolute path (for errors) and the functions resolved so far.
#[derive(Debug)]
struct Loaded {
    bin: usize,
    path: String,
    functions: HashMap<&'static str, usize>,
}

impl Kernels {
    pub(crate) fn new(path: Option<PathBuf>) -> Self {
        Kernels { path, loaded: Mutex::default() }
    }

    /// The function `name` of the binary (loaded on first use), for HAL op `op`.
    fn function(&self, name: &'static str, op: &'static str) -> Result<usize> {
        let mut loaded = self.loaded.lock().unwrap_or_else(PoisonError::into_inner);
        if loaded.is_none() {
            let path = binary_path(self.path.as_deref())?;
            let shown = path.display().to_string();
            let c = CString::new(path.as_os_str().as_encoded_bytes()).map_err(|_| {
                AscendError::KernelBinary { path: shown.clone(), message: "contains NUL".into() }
            })?;
            let mut bin: sys::aclrtBinHandle = std::ptr::null_mut();
            // SAFETY: a NUL-terminated absolute path, no options, a valid out-parameter.
            let code =
                unsafe { sys::aclrtBinaryLoadFromFile(c.as_ptr(), std::ptr::null_mut(), &mut bin) };
            check("aclrtBinaryLoadFromFile", code).map_err(|e| AscendError::KernelBinary {
                path: shown.clone(),
                message: e.to_string(),
            })?;
            *loaded = Some(Loaded { bin: bin as usize, path: shown, functions: HashMap::new() });
        }
        let Loaded { bin, path, functions } = loaded.as_mut().ok_or(AscendError::Unsupported {
            op: "aclrtBinaryLoadFromFile",
            message: "the kernel binary is not loaded".into(),
        })?;
        if let Some(&f) = functions.get(name) {
            return Ok(f);
        }
        let c = CString::new(name)
            .map_err(|_| AscendError::Unsupported { op: "kernel", message: name.into() })?;
        let mut f: sys::aclrtFuncHandle = std::ptr::null_mut();
        // SAFETY: a loaded binary, a NUL-terminated name, a valid out-parameter.
        let code =
            unsafe { sys::aclrtBinaryGetFunction(*bin as sys::aclrtBinHandle, c.as_ptr(), &mut f) };
        // CANN reports a name the binary lacks as an internal error ("Cannot find kernel by
        // name"); any failure here means the binary cannot serve this kernel.
        check("aclrtBinaryGetFunction", code).map_err(|e| AscendError::MissingKernel {
            kernel: name,
            op,
            path: path.clone(),
            message: e.to_string(),
        })?;
        functions.insert(name, f as usize);
        Ok(f as usize)
    }

    /// A launch of kernel `name` for HAL op `op`, ready to issue: function, `blockDim` and
    /// argument block.
    pub(crate) fn prepare(
        &self,
        name: &'static str,
        op: &'static str,
        tiling: KernelTiling,
        tensors: &[GmTensor],
        scalars: &[f64],
    ) -> Result<Launch> {
        Ok(Launch {
            name,
            func: self.function(name, op)?,
            block_dim: tiling.block_dim,
            args: abi::encode(tiling, tensors, scalars),
        })
    }
}

impl Drop for Kernels {
    fn drop(&mut self) {
        if let Some(Loaded { bin, .. }) =
            self.loaded.get_mut().unwrap_or_else(PoisonError::into_inner).take()
        {
            // SAFETY: loaded above, unloaded once, after every launch handle is gone.
            let _ = unsafe { sys::aclrtBinaryUnLoad(bin as sys::aclrtBinHandle) };
        }
    }
}

/// A prepared kernel launch.
#[derive(Debug)]
pub(crate) struct Launch {
    pub(crate) name: &'static str,
    func: usize,
    block_dim: u32,
    args: abi::HostArgs,
}

impl Launch {
    pub(crate) fn issue(&self, stream: sys::aclrtStream) -> Result<()> {
        let _span = tracing::trace_span!(
            "aclrtLaunchKernelWithHostArgs",
            kernel = self.name,
            block_dim = self.block_dim
        )
        .entered();
        // The runtime writes the meta copy's device address into the block: a fresh copy per
        // launch (a graph may issue the same launch again).
        let mut args = self.args.bytes.clone();
        let mut place_holder = self.args.place_holder;
        // SAFETY: a function of the loaded binary; `args` is a complete host argument block that
        // the runtime copies (and patches at the placeholder) before the call returns; one
        // placeholder inside the block; no launch configuration; a live stream.
        check("aclrtLaunchKernelWithHostArgs", unsafe {
            sys::aclrtLaunchKernelWithHostArgs(
                self.func as sys::aclrtFuncHandle,
                self.block_dim,
                stream,
                std::ptr::null_mut(),
                args.as_mut_ptr().cast(),
                args.len(),
                &mut place_holder,
                1,
            )
        })?;
        Ok(())
    }
}
