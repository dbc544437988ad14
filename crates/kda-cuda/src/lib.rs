//! `kda-cuda`: the kda HAL on NVIDIA GPUs, through cudarc (the driver loaded at run time) and
//! cuBLAS and NVRTC opened by kda itself (CUDA 12 or 13, [`libs`]), so the crate builds without
//! a CUDA toolkit.
//!
//! - [`CudaBackend`] implements [`kda_core::Backend`]: CUDA streams and events map one to one
//!   onto the HAL's, memory is `cuMemAlloc`, dense GEMMs are cuBLAS (`cublasGemmEx`, fp32
//!   accumulation), every other op is an NVRTC-compiled kernel whose source lives in
//!   `kernels/` ([`kernels`]). A captured graph runs as one CUDA graph ([`graph_recipe`]):
//!   the HAL validates the capture, the backend replays it into a stream capture once and
//!   launches it with one `cuGraphLaunch`.
//! - Two ops have a fast path beside the spec path ([`FastPaths`]): the chunked prefill on
//!   tensor cores and the MXFP8 GEMM through exact bf16 dequantisation and cuBLAS.
//! - Execution failures follow [`kda_core::hal`]: each stream has a device-side failure record
//!   ([`status`]) that kernels check before running, events carry it to waiting streams, and
//!   `synchronize` reports and clears it.
//! - Without the `cuda` feature (on by default) the same API exists and
//!   [`CudaBackend::new`] returns [`CudaError::NotCompiledWithCuda`]; without a device or
//!   driver it returns [`CudaError::NoCudaDevice`].
//!
//! Host-side pieces (kernel argument layouts, GEMM operand mappings, failure messages, the kernel
//! inventory) are plain Rust, tested everywhere; see `docs/cuda.md` for what is verified where.

#![deny(unsafe_op_in_unsafe_fn)]

#[cfg(test)]
mod chunk_model;
mod error;
pub mod graph_recipe;
pub mod import;
pub mod kernels;
pub mod launch;
pub mod libs;
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
pub use device::{CudaBackend, CudaBuffer, CudaEvent, CudaStream, MAX_GRAPHS};
#[cfg(not(feature = "cuda"))]
pub use stub::{CudaBackend, CudaBuffer, CudaEvent, CudaStream};

/// How a captured graph runs on this backend ([`CudaBackend::instantiate_graph`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GraphRoute {
    /// One instantiated CUDA graph: one `cuGraphLaunch` per launch.
    Native,
    /// Op by op through the launch path, for the reason given (host work in the graph, or a
    /// checked instance).
    Replay(String),
}

/// Options for [`CudaBackend::with_options`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaOptions {
    /// The device ordinal.
    pub ordinal: usize,
    /// Checked mode: record every call and reject ops that race (see [`kda_core::sanitize`]).
    pub checked: bool,
    /// The fast paths to take where the device has them (the spec paths otherwise).
    pub fast: FastPaths,
    /// How long a stream waits for one of its host functions (`Op::Host`) before it gives up
    /// and fails the stream (reported at `synchronize`), so a host function that never returns
    /// cannot hold the device forever.
    pub host_wait_limit: std::time::Duration,
}

impl Default for CudaOptions {
    /// Device 0; checked mode as `KDA_SANITIZE` says (off when unset); fast paths as
    /// `KDA_CUDA_FAST` says (none when unset); host functions waited for up to
    /// `KDA_CUDA_HOST_WAIT_S` seconds (60 when unset).
    fn default() -> Self {
        Self {
            ordinal: 0,
            checked: kda_core::sanitize::checked_from_env(false),
            fast: FastPaths::from_env(),
            host_wait_limit: host_wait_limit(std::env::var(HOST_WAIT_VAR).ok().as_deref()),
        }
    }
}

/// The variable [`CudaOptions::default`] reads the host-function wait limit from, in seconds.
pub const HOST_WAIT_VAR: &str = "KDA_CUDA_HOST_WAIT_S";

/// The wait limit `text` (seconds, fractions allowed) names; [`launch::HOST_WAIT_LIMIT`] when
/// unset or not a positive number.
fn host_wait_limit(text: Option<&str>) -> std::time::Duration {
    text.and_then(|t| t.trim().parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s > 0.0)
        .and_then(|s| std::time::Duration::try_from_secs_f64(s).ok())
        .unwrap_or(launch::HOST_WAIT_LIMIT)
}

/// Ops with a spec path and a fast one. The spec paths are what the conformance suite holds
/// every backend to (MxGemm bit for bit with `kda_core::mx::gemm`, KdaChunk within fp32
/// rounding of the recurrence); the fast paths trade that for speed, each measured against its
/// spec path on the device (`docs/cuda.md`). A fast path the device cannot take (too little
/// shared memory for the chunk kernel) falls back to the spec path;
/// [`CudaBackend::fast_paths`] says which are in effect.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct FastPaths {
    /// MxGemm: both operands dequantised exactly into bf16 (E4M3 × 2^scale has at most four
    /// significant bits), then one cuBLAS bf16 GEMM with fp32 accumulation over all of K, in
    /// cuBLAS's order, instead of exact block sums accumulated in order. Hopper has no MX
    /// block-scaled tensor cores.
    pub mx_gemm: bool,
    /// KdaChunk: the chunked form on tensor cores (`kernels/chunk.cu`: bf16 `mma.sync`
    /// operands, fp32 accumulation) instead of the token-by-token recurrence, for key dims up
    /// to 128.
    pub chunk: bool,
}

/// The variable [`FastPaths::from_env`] reads: `1` or `all` for every fast path, or a comma
/// list of `mx_gemm`, `chunk`.
pub const FAST_VAR: &str = "KDA_CUDA_FAST";

impl FastPaths {
    /// Every fast path.
    pub const ALL: FastPaths = FastPaths { mx_gemm: true, chunk: true };

    /// As `KDA_CUDA_FAST` says (none when unset or unrecognised).
    pub fn from_env() -> Self {
        std::env::var(FAST_VAR).map(|v| Self::parse(&v)).unwrap_or_default()
    }

    /// `1` / `all`, or a comma list of `mx_gemm` and `chunk`; anything else is none.
    pub fn parse(text: &str) -> Self {
        let text = text.trim();
        if matches!(text, "1" | "all" | "on" | "true") {
            return Self::ALL;
        }
        let has = |name: &str| text.split(',').any(|w| w.trim() == name);
        Self { mx_gemm: has("mx_gemm"), chunk: has("chunk") }
    }
}

#[cfg(test)]
mod tests {
    use super::{FastPaths, host_wait_limit};
    use std::time::Duration;

    #[test]
    fn the_host_wait_limit_parses_from_its_variable() {
        assert_eq!(host_wait_limit(None), Duration::from_secs(60));
        assert_eq!(host_wait_limit(Some("2.5")), Duration::from_millis(2500));
        for bad in ["0", "-1", "soon", "inf", "NaN"] {
            assert_eq!(host_wait_limit(Some(bad)), Duration::from_secs(60), "{bad}");
        }
    }

    #[test]
    fn fast_paths_parse_from_their_variable() {
        assert_eq!(FastPaths::parse("1"), FastPaths::ALL);
        assert_eq!(FastPaths::parse("all"), FastPaths::ALL);
        assert_eq!(FastPaths::parse("chunk"), FastPaths { mx_gemm: false, chunk: true });
        assert_eq!(FastPaths::parse("mx_gemm, chunk"), FastPaths::ALL);
        assert_eq!(FastPaths::parse("0"), FastPaths::default());
        assert_eq!(FastPaths::parse("fast"), FastPaths::default());
    }
}
