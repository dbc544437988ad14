//! Dense Linear-layout GEMM `y[M, N] = x[M, K] · w[N, K]^T` with fp32 accumulation, on the
//! `gemm` crate's f32 kernels.
//!
//! f32 operands are passed to the kernel in place, with their strides. bf16/f16 operands are
//! widened to f32 (exact), and the weight is widened a block of rows at a time so a bf16 weight is
//! used as stored, without ever materialising a full f32 copy of it. A bf16/f16 output is
//! accumulated in f32 and rounded once (round to nearest even).

use gemm::Parallelism;
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use kda_core::op::gemm_dims;
use kda_core::{DType, GemmDims, Tensor};

use super::Exec;
use crate::ReferenceBackend;

type T = Tensor<ReferenceBackend>;

/// Weight rows widened per block: large enough to keep the kernel's packing efficient, small
/// enough that the widened block stays in the last-level cache.
const WEIGHT_BLOCK_ROWS: usize = 256;

/// An f32 matrix the kernel can read: a view in place, or a widened copy.
struct F32Mat {
    /// Keeps a widened copy alive while `ptr` points into it.
    _owned: Vec<f32>,
    ptr: *const f32,
    row_stride: isize,
    col_stride: isize,
}

impl F32Mat {
    /// `t` (2-D, any float dtype) as f32.
    fn of(t: &T, exec: &Exec) -> Self {
        let layout = t.layout();
        if t.dtype() == DType::F32 {
            let ptr = t.buffer().element_ptr::<f32>(layout.offset());
            let [rs, cs] = [layout.strides()[0], layout.strides()[1]].map(|s| s as isize);
            return Self { _owned: Vec::new(), ptr, row_stride: rs, col_stride: cs };
        }
        let owned = widen(t, exec);
        let cols = layout.shape()[1] as isize;
        Self { ptr: owned.as_ptr(), _owned: owned, row_stride: cols, col_stride: 1 }
    }
}

/// Widen a bf16/f16 view to a row-major f32 vector (exact).
fn widen(t: &T, exec: &Exec) -> Vec<f32> {
    let mut out = vec![0f32; t.numel()];
    macro_rules! widen_as {
        ($H:ty) => {{
            // SAFETY: validated input view; stream contract.
            let values = unsafe { t.buffer().gather::<$H>(t.layout()) };
            par_zip(exec, &values, &mut out, |src, dst| src.convert_to_f32_slice(dst));
        }};
    }
    match t.dtype() {
        DType::BF16 => widen_as!(bf16),
        DType::F16 => widen_as!(f16),
        // `gemm_dims` admits only floats, and f32 is never widened.
        _ => {}
    }
    out
}

/// Apply `f` to matching chunks of `src` and `dst`, across the pool when there is one.
fn par_zip<A: Sync, B: Send>(
    exec: &Exec,
    src: &[A],
    dst: &mut [B],
    f: impl Fn(&[A], &mut [B]) + Sync,
) {
    use rayon::prelude::*;
    const CHUNK: usize = 1 << 16;
    if exec.threads() == 1 || src.len() <= CHUNK {
        f(src, dst);
    } else {
        src.par_chunks(CHUNK).zip(dst.par_chunks_mut(CHUNK)).for_each(|(s, d)| f(s, d));
    }
}

pub(super) fn gemm(x: &T, w: &T, y: &T, exec: &Exec) -> Result<(), String> {
    let GemmDims { m, n, k } = gemm_dims(x, w, y).map_err(|e| e.to_string())?;
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        return super::memory::fill(y, 0.0);
    }
    let parallelism = match exec.threads() {
        1 => Parallelism::None,
        threads => Parallelism::Rayon(threads),
    };
    let direct = w.dtype() == DType::F32 && y.dtype() == DType::F32;
    let block = if direct { n } else { WEIGHT_BLOCK_ROWS };
    let x32 = F32Mat::of(x, exec);
    let view_err = |e: kda_core::Error| e.to_string();
    for n0 in (0..n).step_by(block) {
        let nb = block.min(n - n0);
        let w32 = F32Mat::of(&w.narrow(0, n0, nb).map_err(view_err)?, exec);
        let y_block = y.narrow(1, n0, nb).map_err(view_err)?;
        let mut acc = Vec::new();
        let (dst, dst_rs, dst_cs) = if y.dtype() == DType::F32 {
            let l = y_block.layout();
            let ptr = y_block.buffer().element_ptr::<f32>(l.offset());
            (ptr, l.strides()[0] as isize, l.strides()[1] as isize)
        } else {
            acc = vec![0f32; m * nb];
            (acc.as_mut_ptr(), nb as isize, 1)
        };
        // SAFETY: the pointers address validated views (x: [m, k], w block: [nb, k] read as its
        // transpose [k, nb], dst: [m, nb]) that are in bounds with the given strides; the output
        // overlaps neither input nor itself (validated), and the stream contract keeps other
        // threads off these bytes.
        unsafe {
            gemm::gemm(
                m,
                nb,
                k,
                dst,
                dst_cs,
                dst_rs,
                false,
                x32.ptr,
                x32.col_stride,
                x32.row_stride,
                w32.ptr,
                w32.row_stride,
                w32.col_stride,
                0.0,
                1.0,
                false,
                false,
                false,
                parallelism,
            );
        }
        if y.dtype() != DType::F32 {
            store_rounded(&y_block, &acc, exec);
        }
    }
    Ok(())
}

/// Round f32 results once to the output dtype and write them into `y`.
fn store_rounded(y: &T, acc: &[f32], exec: &Exec) {
    macro_rules! store_as {
        ($H:ty) => {{
            let mut out = vec![<$H>::ZERO; acc.len()];
            par_zip(exec, acc, &mut out, |src, dst| dst.convert_from_f32_slice(src));
            // SAFETY: validated, non-overlapping output view of `acc.len()` elements.
            unsafe { y.buffer().scatter::<$H>(y.layout(), &out) };
        }};
    }
    match y.dtype() {
        DType::BF16 => store_as!(bf16),
        DType::F16 => store_as!(f16),
        _ => {}
    }
}
