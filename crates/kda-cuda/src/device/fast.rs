//! The fast paths ([`FastPaths`]) and the vectorised DynamicQuant: which kernel an op takes,
//! decided on the host from the device and the operands' layouts.

use std::sync::Arc;

use cudarc::driver::{CudaContext, sys};
use kda_core::op::{GemmDims, MxDims};
use kda_core::{DType, Result, ScaleAlg, Tensor};

use super::blas::Ready;
use super::memory::driver;
use super::module::{Kernels, args};
use super::{CudaBackend, CudaStream};
use crate::launch::{self, BLOCK, TC_SHARED_BYTES};
use crate::view::KernelView;
use crate::{CudaError, FastPaths};

type T = Tensor<CudaBackend>;

/// The fast paths `requested` that this device can take: the chunk kernel needs bf16
/// `mma.sync` (8.0) and its shared memory as an opt-in block size (sm_90 and sm_100 have it;
/// sm_80 and the consumer parts do not).
pub(super) fn effective(
    ctx: &Arc<CudaContext>,
    kernels: &Kernels,
    major: i32,
    requested: FastPaths,
) -> std::result::Result<FastPaths, CudaError> {
    let optin = sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN;
    let shared = ctx.attribute(optin).map_err(driver("cuDeviceGetAttribute"))?;
    let chunk = requested.chunk && major >= 8 && shared >= TC_SHARED_BYTES as i32;
    if chunk {
        kernels.allow_shared("kda_chunk_tc", TC_SHARED_BYTES)?;
    }
    Ok(FastPaths { mx_gemm: requested.mx_gemm, chunk })
}

/// Whether a rank-2 view has unit column stride and rows that start on `align`-byte
/// boundaries (its first element included), `elsize` bytes per element.
fn aligned_rows(v: &KernelView, elsize: usize, align: u64) -> bool {
    v.rank == 2
        && v.strides[1] == 1
        && v.ptr.is_multiple_of(align)
        && (v.shape[0] <= 1 || (v.strides[0] as u64 * elsize as u64).is_multiple_of(align))
}

fn view(op: &'static str, param: &'static str, t: &T) -> Result<KernelView> {
    Ok(KernelView::new(op, param, t.layout(), t.buffer().device_ptr())?)
}

impl CudaBackend {
    /// The fast paths in effect on this instance (those requested that the device can take).
    pub fn fast_paths(&self) -> FastPaths {
        self.inner.fast
    }

    /// DynamicQuant: four lanes per block of 32 and vector loads where the rows allow it (dense,
    /// aligned, `k` a multiple of 32), else a thread per block; both bit for bit the codec.
    pub(super) fn dynamic_quant(
        &self,
        stream: &CudaStream,
        (x, data, scale): (&T, &T, &T),
        alg: ScaleAlg,
        dims: MxDims,
    ) -> Result<()> {
        const OP: &str = "dynamic_quant";
        let (xv, dv, sv) = (view(OP, "x", x)?, view(OP, "data", data)?, view(OP, "scale", scale)?);
        let (m, k, alg) = (dims.m as i64, dims.k as i64, i32::from(alg.code()));
        let status = stream.inner.status;
        let rows = dims.k.is_multiple_of(32)
            && matches!(x.dtype(), DType::BF16 | DType::F32)
            && aligned_rows(&xv, x.dtype().size_bytes(), 16)
            && aligned_rows(&dv, 1, 8);
        let (name, work) = if rows {
            ("kda_dynamic_quant_rows", dims.m * dims.blocks * 4)
        } else {
            ("kda_dynamic_quant", dims.m * dims.blocks)
        };
        let Some(grid) = self.grid(work, BLOCK) else { return Ok(()) };
        self.kernel(stream, name, grid, args!(status, xv, dv, sv, m, k, alg))
    }

    /// The fast MxGemm: `a` and `w` dequantised exactly into dense bf16 scratch, then one
    /// cuBLAS GEMM into `y`.
    pub(super) fn mx_gemm_fast(
        &self,
        stream: &CudaStream,
        (a, a_scale): (&T, &T),
        (w, w_scale): (&T, &T),
        y: &T,
        dims: GemmDims,
    ) -> Result<()> {
        let (m, n, k) = (dims.m, dims.n, dims.k);
        let mut scratch = Vec::with_capacity(3);
        let mut operand = |rows: usize, data: &T, scale: &T| -> Result<Ready> {
            let s = self.scratch(stream, rows * k * 2)?;
            let ptr = s.ptr;
            scratch.push(s);
            self.dequant_bf16(stream, data, scale, ptr, rows, k)?;
            Ok(Ready::dense(ptr, DType::BF16, k))
        };
        let ar = operand(m, a, a_scale)?;
        let wr = operand(n, w, w_scale)?;
        let (_, output) = launch::gemm_dtypes(DType::BF16, DType::BF16, y.dtype());
        self.gemm_ready(stream, (&ar, &wr), (m, n, k), y, output, scratch)
    }

    /// `data` × 2^`scale` into a dense bf16 `[rows, k]` at `into`: eight elements a thread
    /// where the rows allow it, else the element-wise dequantisation (same values).
    fn dequant_bf16(
        &self,
        stream: &CudaStream,
        data: &T,
        scale: &T,
        into: u64,
        rows: usize,
        k: usize,
    ) -> Result<()> {
        const OP: &str = "mx_gemm";
        let (dv, sv) = (view(OP, "data", data)?, view(OP, "scale", scale)?);
        let yv = KernelView::new(
            OP,
            "dequantised",
            &kda_core::Layout::contiguous(DType::BF16, &[rows, k]),
            into,
        )?;
        let (m, k64, status) = (rows as i64, k as i64, stream.inner.status);
        let vector = k.is_multiple_of(32) && aligned_rows(&dv, 1, 8) && aligned_rows(&yv, 2, 16);
        let (name, work) = if vector {
            ("kda_mx_dequant_bf16", rows * k / 8)
        } else {
            ("kda_mx_dequant", rows * k)
        };
        let Some(grid) = self.grid(work, BLOCK) else { return Ok(()) };
        self.kernel(stream, name, grid, args!(status, dv, sv, yv, m, k64))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kda_core::Layout;

    #[test]
    fn vector_kernels_need_dense_aligned_rows() {
        let v = |shape: &[usize], strides: &[usize], ptr: u64| {
            let layout = Layout::strided(DType::BF16, shape, strides, 0).unwrap();
            KernelView::new("t", "t", &layout, ptr).unwrap()
        };
        assert!(aligned_rows(&v(&[4, 64], &[64, 1], 0x1000), 2, 16));
        assert!(!aligned_rows(&v(&[4, 64], &[64, 1], 0x1008), 2, 16), "misaligned start");
        assert!(!aligned_rows(&v(&[4, 60], &[68, 1], 0x1000), 2, 16), "row stride of 136 bytes");
        assert!(aligned_rows(&v(&[1, 60], &[68, 1], 0x1000), 2, 16), "one row: any stride");
        assert!(!aligned_rows(&v(&[4, 64], &[1, 4], 0x1000), 2, 16), "transposed");
    }
}
