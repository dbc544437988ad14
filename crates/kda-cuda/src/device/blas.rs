//! Dense GEMMs on cuBLAS: `y[M, N] = x[M, K] · w[N, K]^T` as one column-major `cublasGemmEx`
//! with fp32 compute, reading strided views in place where cuBLAS can (see
//! [`crate::launch::matrix_operand`]) and staging them through scratch where it cannot.
//!
//! cuBLAS calls are not skipped after an earlier failure on the stream (only kernels check
//! the stream's failure record); the failure is still reported at `synchronize`.

use std::ffi::c_int;

use kda_core::{DType, Layout, Result};

use super::cublas::{self, BlasHandle};
use super::scratch::Scratch;
use super::{CudaBackend, CudaStream};
use crate::CudaError;
use crate::launch::{MatrixOperand, gemm_dtypes, matrix_operand};
use crate::view::KernelView;

type T = kda_core::Tensor<CudaBackend>;

fn cuda_dtype(dtype: DType) -> c_int {
    match dtype {
        DType::BF16 => cublas::R_16BF,
        DType::F16 => cublas::R_16F,
        _ => cublas::R_32F,
    }
}

fn int(param: &'static str, v: usize) -> Result<c_int> {
    Ok(c_int::try_from(v).map_err(|_| CudaError::Limit {
        op: "gemm",
        param,
        actual: v,
        limit: c_int::MAX as usize,
    })?)
}

/// An operand ready for cuBLAS: its address, dtype and column-major description.
pub(super) struct Ready {
    pub(super) ptr: u64,
    pub(super) dtype: DType,
    pub(super) operand: MatrixOperand,
}

impl Ready {
    /// A dense row-major matrix of `cols` columns at `ptr`.
    pub(super) fn dense(ptr: u64, dtype: DType, cols: usize) -> Self {
        Self { ptr, dtype, operand: MatrixOperand { transposed: false, ld: cols.max(1) } }
    }
}

impl CudaBackend {
    /// The stream's cuBLAS handle, created on first use (before a graph capture, for every
    /// stream the capture uses: creating one allocates).
    pub(super) fn blas<'a>(&self, stream: &'a CudaStream) -> Result<&'a BlasHandle> {
        if let Some(blas) = stream.inner.blas.get() {
            return Ok(blas);
        }
        // Relaxed: the first GEMM on an auxiliary stream may come inside an engine's capture.
        let blas =
            super::memory::relaxed_capture(|| BlasHandle::new(&self.inner.ctx, stream.raw()))?;
        // Two threads may race here; the loser's handle is destroyed unused.
        Ok(stream.inner.blas.get_or_init(|| blas))
    }

    /// `t` as it is, or converted to a dense `dtype` copy in scratch.
    fn gemm_input(
        &self,
        stream: &CudaStream,
        param: &'static str,
        t: &T,
        dtype: DType,
        scratch: &mut Vec<Scratch>,
    ) -> Result<Ready> {
        let shape = [t.shape()[0], t.shape()[1]];
        let strides = [t.layout().strides()[0], t.layout().strides()[1]];
        let here = KernelView::new("gemm", param, t.layout(), t.buffer().device_ptr())?;
        if t.dtype() == dtype
            && let Some(operand) = matrix_operand(shape, strides)
        {
            return Ok(Ready { ptr: here.ptr, dtype, operand });
        }
        let s = self.scratch(stream, t.numel() * dtype.size_bytes())?;
        let dense = KernelView::new("gemm", param, &Layout::contiguous(dtype, &shape), s.ptr)?;
        self.convert_views(stream, here, dense, t.numel())?;
        let ready = Ready::dense(s.ptr, dtype, shape[1]);
        scratch.push(s);
        Ok(ready)
    }

    pub(super) fn gemm(
        &self,
        stream: &CudaStream,
        x: &T,
        w: &T,
        y: &T,
        dims: kda_core::GemmDims,
    ) -> Result<()> {
        let (m, n, k) = (dims.m, dims.n, dims.k);
        if m == 0 || n == 0 {
            return Ok(());
        }
        if k == 0 {
            return self.fill(stream, y, 0.0);
        }
        let (input, output) = gemm_dtypes(x.dtype(), w.dtype(), y.dtype());
        let mut scratch = Vec::new();
        let xr = self.gemm_input(stream, "x", x, input, &mut scratch)?;
        let wr = self.gemm_input(stream, "w", w, input, &mut scratch)?;
        self.gemm_ready(stream, (&xr, &wr), (m, n, k), y, output, scratch)
    }

    /// `y = x · w^T` for operands already in cuBLAS's terms (`output`: the dtype cuBLAS writes,
    /// see [`gemm_dtypes`]); `scratch` is released after the call.
    pub(super) fn gemm_ready(
        &self,
        stream: &CudaStream,
        (xr, wr): (&Ready, &Ready),
        (m, n, k): (usize, usize, usize),
        y: &T,
        output: DType,
        mut scratch: Vec<Scratch>,
    ) -> Result<()> {
        let y_here = KernelView::new("gemm", "y", y.layout(), y.buffer().device_ptr())?;
        let direct = matrix_operand([m, n], [y.layout().strides()[0], y.layout().strides()[1]])
            .filter(|op| !op.transposed && y.dtype() == output);
        let (y_ptr, ldc, y_stage) = match direct {
            Some(op) => (y_here.ptr, op.ld, None),
            None => {
                let s = self.scratch(stream, m * n * output.size_bytes())?;
                let dense =
                    KernelView::new("gemm", "y", &Layout::contiguous(output, &[m, n]), s.ptr)?;
                let ptr = s.ptr;
                scratch.push(s);
                (ptr, n, Some(dense))
            }
        };
        // Column-major: C[N, M] = op(W)[N, K] · op(X)[K, M], where row-major y[M, N] is
        // column-major C with ld = y's row stride.
        let op_w = if wr.operand.transposed { cublas::OP_N } else { cublas::OP_T };
        let op_x = if xr.operand.transposed { cublas::OP_T } else { cublas::OP_N };
        let blas = self.blas(stream)?;
        // SAFETY: the handle is bound to `stream`; every pointer addresses validated device
        // memory of the sizes the dimensions and leading dimensions describe (checked by
        // `matrix_operand` or dense scratch).
        unsafe {
            blas.gemm(
                (op_w, op_x),
                (int("N", n)?, int("M", m)?, int("K", k)?),
                (wr.ptr, cuda_dtype(wr.dtype), int("ld(w)", wr.operand.ld)?),
                (xr.ptr, cuda_dtype(xr.dtype), int("ld(x)", xr.operand.ld)?),
                (y_ptr, cuda_dtype(output), int("ld(y)", ldc)?),
            )
        }?;
        if let Some(dense) = y_stage {
            self.convert_views(stream, dense, y_here, m * n)?;
        }
        for s in scratch {
            self.release(stream, s)?;
        }
        Ok(())
    }
}
