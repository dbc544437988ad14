//! `kda-cuda`: the kda HAL on NVIDIA GPUs, through cudarc (driver, cuBLAS and NVRTC loaded at
//! run time, so the crate builds without a CUDA toolkit).
//!
//! - [`CudaBackend`] implements [`kda_core::Backend`]: CUDA streams and events map one to one
//!   onto the HAL's, memory is `cuMemAlloc`, dense GEMMs are cuBLAS (`cublasGemmEx`, fp32
//!   accumulation), every other op is an NVRTC-compiled kernel whose source lives in
//!   `kernels/` ([`kernels`]). Capture is the HAL's own (recorded ops and event edges,
//!   replayed through `launch`).
//! - Execution failures follow [`kda_core::hal`]: each stream has a device-side failure record
//!   ([`status`]) that kernels check before running, events carry it to waiting streams, and
//!   `synchronize` reports and clears it.
//! - Without the `cuda` feature (on by default) the same API exists and
//!   [`CudaBackend::new`] returns [`CudaError::NotCompiledWithCuda`]; without a device or
//!   driver it returns [`CudaError::NoCudaDevice`].
//!
//! Host-side pieces (kernel argument layouts, GEMM operand plans, failure messages, the kernel
//! inventory) are plain Rust, tested everywhere; see `docs/cuda.md` for what is verified where.

#![deny(unsafe_op_in_unsafe_fn)]

#[cfg(test)]
mod chunk_model;
mod error;
pub mod graph_plan;
pub mod kernels;
pub mod libs;
pub mod plan;
pub mod status;
pub mod view;

#[cfg(feature = "cuda")]
mod device;
#[cfg(feature = "cuda")]
pub mod nvrtc;
#[cfg(not(feature = "cuda"))]
mod stub;

pub use error::CudaError;

#[cfg(feature = "cuda")]
pub use device::{CudaBackend, CudaBuffer, CudaEvent, CudaStream, GraphRoute, MAX_GRAPHS};
#[cfg(not(feature = "cuda"))]
pub use stub::{CudaBackend, CudaBuffer, CudaEvent, CudaStream};

/// Options for [`CudaBackend::with_options`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaOptions {
    /// The device ordinal.
    pub ordinal: usize,
    /// Checked mode: record every call and reject ops that race (see [`kda_core::sanitize`]).
    pub checked: bool,
}

impl Default for CudaOptions {
    /// Device 0; checked mode as `KDA_SANITIZE` says (off when unset).
    fn default() -> Self {
        Self { ordinal: 0, checked: kda_core::sanitize::checked_from_env(false) }
    }
}
