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

use super::{Exec, Scratch};
use crate::ReferenceBackend;

type T = Tensor<ReferenceBackend>;

/// Weight rows widened per block: large enough to keep the kernel's packing efficient, small
/// enough that the widened block stays in the last-level cache.
const WEIGHT_BLOCK_ROWS: usize = 256;

/// An f32 matrix the kernel can read: a view in place, or a widened copy in scratch memory.
struct F32Mat {
    ptr: *const f32,
    row_stride: isize,
    col_stride: isize,
}

impl F32Mat {
    /// `t` (2-D, any float dtype) as f32; a widened copy goes into `scratch`, which must outlive
    /// the use of the returned pointer.
    fn of(t: &T, exec: &Exec, scratch: &mut Scratch<'_>) -> Self {
        let layout = t.layout();
        if t.dtype() == DType::F32 {
            let ptr = t.buffer().element_ptr::<f32>(layout.offset());
            let [rs, cs] = [layout.strides()[0], layout.strides()[1]].map(|s| s as isize);
            return Self { ptr, row_stride: rs, col_stride: cs };
        }
        let out = scratch.take(t.numel());
        widen(t, exec, out);
        Self { ptr: out.as_ptr(), row_stride: layout.shape()[1] as isize, col_stride: 1 }
    }
}

/// Widen a bf16/f16 view to a row-major f32 vector (exact).
fn widen(t: &T, exec: &Exec, out: &mut [f32]) {
    let layout = t.layout();
    match t.dtype() {
        DType::BF16 if layout.is_contiguous() => {
            // SAFETY: validated, contiguous input view; stream contract.
            let values = unsafe { t.buffer().slice::<bf16>(layout) };
            par_zip(exec, values, out, widen_bf16);
        }
        DType::BF16 => {
            // SAFETY: validated input view; stream contract.
            let values = unsafe { t.buffer().gather::<bf16>(layout) };
            par_zip(exec, &values, out, widen_bf16);
        }
        DType::F16 => {
            // SAFETY: validated input view; stream contract.
            let values = unsafe { t.buffer().gather::<f16>(layout) };
            par_zip(exec, &values, out, |src, dst| src.convert_to_f32_slice(dst));
        }
        // `gemm_dims` admits only floats, and f32 is never widened.
        _ => {}
    }
}

/// bf16 is the top half of an f32, so widening is a shift; written as a plain loop because it
/// vectorises (several times faster than a per-element library conversion on this path).
fn widen_bf16(src: &[bf16], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = f32::from_bits(u32::from(s.to_bits()) << 16);
    }
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
    if m <= super::gemm_small::MAX_ROWS && w.layout().is_contiguous() {
        return gemm_few_rows(x, w, y, (m, n, k), exec);
    }
    let parallelism = match exec.threads() {
        1 => Parallelism::None,
        threads => Parallelism::Rayon(threads),
    };
    let direct = w.dtype() == DType::F32 && y.dtype() == DType::F32;
    let block = if direct { n } else { WEIGHT_BLOCK_ROWS };
    let (mut x_scratch, mut w_scratch, mut y_scratch) =
        (exec.scratch(), exec.scratch(), exec.scratch());
    let x32 = F32Mat::of(x, exec, &mut x_scratch);
    let view_err = |e: kda_core::Error| e.to_string();
    for n0 in (0..n).step_by(block) {
        let nb = block.min(n - n0);
        let w32 = F32Mat::of(&w.narrow(0, n0, nb).map_err(view_err)?, exec, &mut w_scratch);
        let y_block = y.narrow(1, n0, nb).map_err(view_err)?;
        let acc = y_scratch.take(if y.dtype() == DType::F32 { 0 } else { m * nb });
        let (dst, dst_rs, dst_cs) = if y.dtype() == DType::F32 {
            let l = y_block.layout();
            let ptr = y_block.buffer().element_ptr::<f32>(l.offset());
            (ptr, l.strides()[0] as isize, l.strides()[1] as isize)
        } else {
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
            store_rounded(&y_block, acc, exec);
        }
        crate::progress::report(n0 + nb, n);
    }
    Ok(())
}

/// A few rows (decode): the weight read once in its dtype ([`super::gemm_small`]).
fn gemm_few_rows(
    x: &T,
    w: &T,
    y: &T,
    (m, n, k): (usize, usize, usize),
    exec: &Exec,
) -> Result<(), String> {
    use super::gemm_small::{self, Weight};
    let mut x_scratch = exec.scratch();
    let x32: &[f32] = if x.dtype() == DType::F32 && x.layout().is_contiguous() {
        // SAFETY: a validated, contiguous f32 input view; stream contract.
        unsafe { x.buffer().slice::<f32>(x.layout()) }
    } else if x.dtype() == DType::F32 {
        let out = x_scratch.take(m * k);
        // SAFETY: a validated input view; stream contract.
        out.copy_from_slice(&unsafe { x.buffer().gather::<f32>(x.layout()) });
        out
    } else {
        let out = x_scratch.take(m * k);
        widen(x, exec, out);
        out
    };
    let layout = w.layout();
    // SAFETY: a validated, contiguous input view of the matched dtype; stream contract.
    let weight = unsafe {
        match w.dtype() {
            DType::BF16 => Weight::BF16 { data: w.buffer().slice(layout), row_stride: k },
            DType::F16 => Weight::F16 { data: w.buffer().slice(layout), row_stride: k },
            _ => Weight::F32 { data: w.buffer().slice(layout), row_stride: k },
        }
    };
    let threads = exec.threads();
    let out =
        exec.install(|| gemm_small::gemm(x32, weight, (m, n, k), threads, crate::progress::report));
    match y.dtype() {
        DType::F32 => {
            // SAFETY: a validated output view of `m · n` elements overlapping no input; stream
            // contract.
            unsafe { y.buffer().scatter::<f32>(y.layout(), &out) }
        }
        _ => store_rounded(y, &out, exec),
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
