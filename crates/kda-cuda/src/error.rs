//! Errors of constructing and driving the CUDA backend. HAL calls return [`kda_core::Error`];
//! these convert into it (`Backend { backend: "cuda", .. }`, or `OutOfMemory`).

use thiserror::Error;

/// What can go wrong in kda-cuda before or outside an op's own checks.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum CudaError {
    /// Built without the `cuda` feature.
    #[error(
        "kda-cuda was built without the `cuda` feature; rebuild with `--features cuda` \
         (on by default)"
    )]
    NotCompiledWithCuda,
    /// No driver library, no device at `ordinal`, or the device could not be opened.
    #[error("no CUDA device {ordinal}: {reason}")]
    NoCudaDevice { ordinal: usize, reason: String },
    /// NVRTC is missing or rejected a kernel source.
    #[error("NVRTC could not compile {source_name}: {log}")]
    KernelCompile { source_name: &'static str, log: String },
    /// A driver, cuBLAS or NVRTC call failed.
    #[error("{call} failed: {message}")]
    Driver { call: &'static str, message: String },
    /// An operand beyond what the kernels hold (rank, conv window, key dimension, streams).
    #[error("{op}: {param} = {actual} exceeds the CUDA kernels' limit of {limit}")]
    Limit { op: &'static str, param: &'static str, actual: usize, limit: usize },
    /// The device ran out of memory.
    #[error("out of device memory: could not allocate {bytes} bytes")]
    OutOfMemory { bytes: usize },
}

impl From<CudaError> for kda_core::Error {
    fn from(e: CudaError) -> Self {
        match e {
            CudaError::OutOfMemory { bytes } => kda_core::Error::OutOfMemory { bytes },
            other => kda_core::Error::Backend { backend: "cuda", message: other.to_string() },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_name_what_to_do_and_convert_into_the_hal_error() {
        let e = kda_core::Error::from(CudaError::NotCompiledWithCuda);
        match e {
            kda_core::Error::Backend { backend, message } => {
                assert_eq!(backend, "cuda");
                assert!(message.contains("--features cuda"), "{message}");
            }
            other => panic!("expected Backend, got {other:?}"),
        }
        let e = CudaError::NoCudaDevice { ordinal: 1, reason: "libcuda.so not found".into() };
        assert_eq!(e.to_string(), "no CUDA device 1: libcuda.so not found");
        let oom = kda_core::Error::from(CudaError::OutOfMemory { bytes: 12 });
        assert_eq!(oom, kda_core::Error::OutOfMemory { bytes: 12 });
        let limit = CudaError::Limit { op: "kda_chunk", param: "K", actual: 512, limit: 256 };
        assert_eq!(limit.to_string(), "kda_chunk: K = 512 exceeds the CUDA kernels' limit of 256");
    }
}
