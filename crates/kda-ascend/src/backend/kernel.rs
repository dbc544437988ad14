//! The kda AscendC kernel binary: loaded once per backend instance, functions resolved by name
//! and cached, launched with an argument block and the host-computed tiling.

use std::collections::HashMap;
use std::ffi::CString;
use std::sync::{Mutex, PoisonError};

use kda_core::Result;

use super::acl::check;
use crate::error::AscendError;
use crate::kernels::abi::{self, GmTensor, KernelTiling};
use crate::sys;

/// Where `cargo xtask kernels` puts the compiled kernels, unless `KDA_ASCEND_KERNELS` says.
pub const DEFAULT_KERNELS: &str = "target/ascend-kernels/kda_kernels.o";

/// The loaded binary and its functions (addresses of opaque handles).
#[derive(Debug, Default)]
pub(crate) struct Kernels {
    loaded: Mutex<Option<(usize, HashMap<&'static str, usize>)>>,
}

impl Kernels {
    fn function(&self, name: &'static str) -> Result<usize> {
        let mut loaded = self.loaded.lock().unwrap_or_else(PoisonError::into_inner);
        if loaded.is_none() {
            let path =
                std::env::var("KDA_ASCEND_KERNELS").unwrap_or_else(|_| DEFAULT_KERNELS.into());
            let c = CString::new(path.clone()).map_err(|_| AscendError::Unsupported {
                op: "aclrtBinaryLoadFromFile",
                message: format!("kernel path {path:?} contains NUL"),
            })?;
            let mut bin: sys::aclrtBinHandle = std::ptr::null_mut();
            // SAFETY: NUL-terminated path, no options, valid out-parameter.
            check("aclrtBinaryLoadFromFile", unsafe {
                sys::aclrtBinaryLoadFromFile(c.as_ptr(), std::ptr::null_mut(), &mut bin)
            })?;
            *loaded = Some((bin as usize, HashMap::new()));
        }
        let (bin, functions) = loaded.as_mut().ok_or(AscendError::Unsupported {
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
        check("aclrtBinaryGetFunction", unsafe {
            sys::aclrtBinaryGetFunction(*bin as sys::aclrtBinHandle, c.as_ptr(), &mut f)
        })?;
        functions.insert(name, f as usize);
        Ok(f as usize)
    }

    /// A launch, ready to issue: function, `blockDim` and argument block.
    pub(crate) fn prepare(
        &self,
        name: &'static str,
        tiling: KernelTiling,
        tensors: &[GmTensor],
        scalars: &[f64],
    ) -> Result<Launch> {
        Ok(Launch {
            name,
            func: self.function(name)?,
            block_dim: tiling.block_dim,
            args: abi::encode(tiling, tensors, scalars),
        })
    }
}

impl Drop for Kernels {
    fn drop(&mut self) {
        if let Some((bin, _)) = self.loaded.get_mut().unwrap_or_else(PoisonError::into_inner).take()
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
    args: Vec<u8>,
}

impl Launch {
    pub(crate) fn issue(&self, stream: sys::aclrtStream) -> Result<()> {
        let _span = tracing::trace_span!(
            "aclrtLaunchKernelWithHostArgs",
            kernel = self.name,
            block_dim = self.block_dim
        )
        .entered();
        let mut args = self.args.clone();
        // SAFETY: a function of the loaded binary; `args` is a complete argument block in host
        // memory, which the runtime copies to the device before the call returns; no launch
        // configuration, no placeholders; a live stream.
        check("aclrtLaunchKernelWithHostArgs", unsafe {
            sys::aclrtLaunchKernelWithHostArgs(
                self.func as sys::aclrtFuncHandle,
                self.block_dim,
                stream,
                std::ptr::null_mut(),
                args.as_mut_ptr().cast(),
                args.len(),
                std::ptr::null_mut(),
                0,
            )
        })?;
        Ok(())
    }
}
