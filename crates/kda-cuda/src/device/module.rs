//! The NVRTC-compiled kernels of one context, and the one launch path they all go through.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, PoisonError};

use cudarc::driver::{CudaContext, CudaFunction, result, sys};
use cudarc::nvrtc::Ptx;

use super::memory::driver;
use crate::CudaError;
use crate::kernels::{CUBIN_DIR_VAR, SOURCES, parameter_sizes};
use crate::nvrtc;

/// CUBIN per architecture, compiled once per process (NVRTC takes seconds for all sources).
/// One architecture's CUBIN, one per source in [`SOURCES`] order.
type Cubins = (&'static str, Vec<Vec<u8>>);

static CUBIN_CACHE: Mutex<Vec<Cubins>> = Mutex::new(Vec::new());

fn cubins_for(arch: &'static str) -> Result<Vec<Vec<u8>>, CudaError> {
    let mut cache = CUBIN_CACHE.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some((_, cubins)) = cache.iter().find(|(a, _)| *a == arch) {
        return Ok(cubins.clone());
    }
    if let Some(cubins) = prebuilt(arch)? {
        cache.push((arch, cubins.clone()));
        return Ok(cubins);
    }
    if let Err(why) = nvrtc::library() {
        return Err(CudaError::KernelCompile {
            source_name: "kernels",
            log: format!(
                "{why} (install the CUDA toolkit, or the nvidia-cuda-nvrtc-cu12 or \
                 nvidia-cuda-nvrtc wheel, or set {CUBIN_DIR_VAR} to prebuilt CUBINs)"
            ),
        });
    }
    let cubins = SOURCES.iter().map(|s| nvrtc::compile(s, arch)).collect::<Result<Vec<_>, _>>()?;
    cache.push((arch, cubins.clone()));
    Ok(cubins)
}

/// The CUBIN files in `$KDA_CUDA_CUBIN_DIR` (`<source>.<arch>.cubin`, as
/// `gpu_bench --write-cubins` writes them), for a machine without NVRTC; `None` when the
/// variable is unset.
fn prebuilt(arch: &str) -> Result<Option<Vec<Vec<u8>>>, CudaError> {
    let Some(dir) = std::env::var_os(CUBIN_DIR_VAR) else { return Ok(None) };
    let dir = std::path::PathBuf::from(dir);
    SOURCES
        .iter()
        .map(|s| {
            let path = dir.join(crate::kernels::cubin_file(s, arch));
            std::fs::read(&path).map_err(|e| CudaError::KernelCompile {
                source_name: s.name,
                log: format!("{CUBIN_DIR_VAR} is set but {} cannot be read: {e}", path.display()),
            })
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}

/// Every kernel function, by name.
#[derive(Debug)]
pub(super) struct Kernels {
    /// Each kernel with the byte sizes of its parameters (from its source).
    functions: HashMap<&'static str, (CudaFunction, Vec<usize>)>,
}

/// A kernel's arguments, as [`args!`] makes them: pointers to the values, and their sizes.
#[derive(Debug)]
pub(super) struct Args<'a> {
    pub(super) ptrs: &'a mut [*mut c_void],
    pub(super) sizes: &'a [usize],
}

impl Kernels {
    pub(super) fn load(ctx: &Arc<CudaContext>, arch: &'static str) -> Result<Self, CudaError> {
        let mut functions = HashMap::new();
        for (source, cubin) in SOURCES.iter().zip(cubins_for(arch)?) {
            let module =
                ctx.load_module(Ptx::from_binary(cubin)).map_err(driver("cuModuleLoadData"))?;
            for &name in source.functions {
                let f = module.load_function(name).map_err(driver("cuModuleGetFunction"))?;
                let sizes = parameter_sizes(source.body, name).ok_or(CudaError::KernelCompile {
                    source_name: source.name,
                    log: format!("the parameters of {name} cannot be read off its source"),
                })?;
                functions.insert(name, (f, sizes));
            }
        }
        load_eagerly(functions.values().map(|(f, _)| f))?;
        Ok(Self { functions })
    }

    /// Allow kernel `name` up to `bytes` of dynamic shared memory (beyond the default 48 KiB).
    pub(super) fn allow_shared(&self, name: &'static str, bytes: u32) -> Result<(), CudaError> {
        let (f, _) = self.function(name)?;
        let attribute = sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
        // SAFETY: `f` is a loaded function of this context.
        unsafe {
            result::function::set_function_attribute(f.cu_function(), attribute, bytes as i32)
        }
        .map_err(driver("cuFuncSetAttribute"))
    }

    fn function(&self, name: &'static str) -> Result<&(CudaFunction, Vec<usize>), CudaError> {
        self.functions.get(name).ok_or(CudaError::Driver {
            call: "cuModuleGetFunction",
            message: format!("kernel {name} is not loaded"),
        })
    }

    /// Launch kernel `name` on `stream`; `params` point at the argument values, in order
    /// (the driver copies them before this returns).
    pub(super) fn launch(
        &self,
        stream: sys::CUstream,
        name: &'static str,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        params: Args<'_>,
    ) -> Result<(), CudaError> {
        self.launch_shared(stream, name, grid, block, 0, params)
    }

    /// [`Self::launch`] with `shared` bytes of dynamic shared memory.
    pub(super) fn launch_shared(
        &self,
        stream: sys::CUstream,
        name: &'static str,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        shared: u32,
        params: Args<'_>,
    ) -> Result<(), CudaError> {
        let (f, sizes) = self.function(name)?;
        if params.sizes != sizes.as_slice() {
            return Err(CudaError::Driver {
                call: "cuLaunchKernel",
                message: format!(
                    "{name} takes parameters of {sizes:?} bytes, the launch passes {:?}",
                    params.sizes
                ),
            });
        }
        // SAFETY: `f` belongs to this context; `params.ptrs` point at live values whose sizes
        // match the kernel's parameters one for one (checked above), in order; the views among
        // them were validated against their buffers.
        unsafe { result::launch_kernel(f.cu_function(), grid, block, shared, stream, params.ptrs) }
            .map_err(driver("cuLaunchKernel"))
    }
}

/// Load every function now when the driver loads modules lazily (CUDA 12.2 and later by
/// default): a lazily loaded kernel is loaded at its first launch, which waits for the device,
/// so launching it behind a kernel that spins until the host acts (`kda_host_wait`) could
/// deadlock, and a first launch inside a graph capture or a timed region pays for the load.
fn load_eagerly<'a>(functions: impl Iterator<Item = &'a CudaFunction>) -> Result<(), CudaError> {
    let mut mode = sys::CUmoduleLoadingMode::CU_MODULE_EAGER_LOADING;
    // SAFETY: writes the process's loading mode into `mode`.
    let queried = unsafe { sys::cuModuleGetLoadingMode(&mut mode) };
    if queried != sys::CUresult::CUDA_SUCCESS
        || mode != sys::CUmoduleLoadingMode::CU_MODULE_LAZY_LOADING
    {
        return Ok(());
    }
    let mut version = 0;
    // SAFETY: writes the driver's CUDA version into `version`.
    let known = unsafe { sys::cuDriverGetVersion(&mut version) } == sys::CUresult::CUDA_SUCCESS;
    // cuFuncLoad exists from CUDA 12.4 on; older drivers load at first launch.
    if !known || version < 12040 {
        return Ok(());
    }
    for f in functions {
        // SAFETY: `f` is a function of a module loaded in the current context.
        unsafe { sys::cuFuncLoad(f.cu_function()) }.result().map_err(driver("cuFuncLoad"))?;
    }
    Ok(())
}

/// Kernel arguments, in order, for [`Kernels::launch`]: each value's address and size.
macro_rules! args {
    ($($a:expr),* $(,)?) => {
        $crate::device::module::Args {
            ptrs: &mut [$((&$a) as *const _ as *mut ::std::ffi::c_void),*],
            sizes: &[$(::std::mem::size_of_val(&$a)),*],
        }
    };
}
pub(super) use args;
