//! MXFP8 kernels: DynamicQuant, dequantization and the quantized GEMM. The numbers come from the
//! codec in [`kda_core::mx`] (the specification); these kernels only arrange the work.
//!
//! The GEMM follows [`kda_core::mx::gemm`]'s definition: per 32-wide K block an exact block sum,
//! scaled and rounded once to f32, accumulated over blocks in order in f32; its engine
//! (`mx_gemm.rs`) reads the E4M3 bytes as they are stored.

use std::borrow::Cow;

use bytemuck::Pod;
use half::bf16;
use half::slice::HalfFloatSliceExt;
use kda_core::mx::{self, MxFloat};
use kda_core::op::{MxDims, mx_dequant_dims, mx_gemm_dims, mx_quant_dims};
use kda_core::{DType, GemmDims, ScaleAlg, Tensor};
use rayon::prelude::*;

use super::Exec;
use crate::ReferenceBackend;

type T = Tensor<ReferenceBackend>;

/// Elements a parallel task of the element-wise kernels handles at least.
const TASK_ELEMENTS: usize = 1 << 16;

/// The elements of `t` in row-major order, borrowed when the view is contiguous.
fn read<E: Pod>(t: &T) -> Cow<'_, [E]> {
    let layout = t.layout();
    if layout.is_contiguous() {
        // SAFETY: a validated input view of `E`-sized elements; the stream contract keeps writers
        // off its bytes while the op runs.
        Cow::Borrowed(unsafe { t.buffer().slice::<E>(layout) })
    } else {
        // SAFETY: as above.
        Cow::Owned(unsafe { t.buffer().gather::<E>(layout) })
    }
}

/// Let `f` fill every element of `t` (row-major): in place when the view is contiguous.
fn write<E: Pod, R>(t: &T, f: impl FnOnce(&mut [E]) -> R) -> R {
    let layout = t.layout();
    if layout.is_contiguous() {
        // SAFETY: a validated output view that overlaps no other operand of the op (validated);
        // the stream contract keeps every other thread off its bytes while the op runs.
        f(unsafe { t.buffer().slice_mut::<E>(layout) })
    } else {
        let mut values = vec![E::zeroed(); layout.numel()];
        let r = f(&mut values);
        // SAFETY: as above; the view is non-overlapping (validated).
        unsafe { t.buffer().scatter::<E>(layout, &values) };
        r
    }
}

/// Rows per parallel task for rows of `k` elements.
fn rows_per_task(k: usize) -> usize {
    (TASK_ELEMENTS / k.max(1)).max(1)
}

pub(super) fn dynamic_quant(
    x: &T,
    data: &T,
    scale: &T,
    alg: ScaleAlg,
    exec: &Exec,
) -> Result<(), String> {
    let MxDims { m, k, .. } = mx_quant_dims(x, data, scale).map_err(|e| e.to_string())?;
    if m == 0 || k == 0 {
        return Ok(());
    }
    match x.dtype() {
        DType::BF16 => quantize_rows::<bf16>(x, data, scale, alg, k, exec),
        _ => quantize_rows::<f32>(x, data, scale, alg, k, exec),
    }
}

fn quantize_rows<E: MxFloat + Pod>(
    x: &T,
    data: &T,
    scale: &T,
    alg: ScaleAlg,
    k: usize,
    exec: &Exec,
) -> Result<(), String> {
    let xs = read::<E>(x);
    let blocks = mx::num_blocks(k);
    let rows = rows_per_task(k);
    let result = write::<u8, _>(data, |d| {
        write::<u8, _>(scale, |s| {
            if exec.threads() == 1 {
                return mx::quantize_into(&xs, k, alg, d, s);
            }
            exec.install(|| {
                xs.par_chunks(rows * k)
                    .zip(d.par_chunks_mut(rows * k))
                    .zip(s.par_chunks_mut(rows * blocks))
                    .try_for_each(|((x, d), s)| mx::quantize_into(x, k, alg, d, s))
            })
        })
    });
    result.map_err(|e| e.to_string())
}

pub(super) fn dequant(data: &T, scale: &T, y: &T, exec: &Exec) -> Result<(), String> {
    let MxDims { m, k, .. } = mx_dequant_dims(data, scale, y).map_err(|e| e.to_string())?;
    if m == 0 || k == 0 {
        return Ok(());
    }
    let (ds, ss) = (read::<u8>(data), read::<u8>(scale));
    let result = match y.dtype() {
        // The f32 values are exact but for overflow, so this is the one rounding.
        DType::BF16 => write::<bf16, _>(y, |out| {
            dequant_rows(&ds, &ss, k, out, exec, |v, o| o.convert_from_f32_slice(v))
        }),
        _ => write::<f32, _>(y, |out| {
            dequant_rows(&ds, &ss, k, out, exec, |v, o| o.copy_from_slice(v))
        }),
    };
    result.map_err(|e| e.to_string())
}

/// Dequantize whole rows into `out`, a task of rows at a time (across the pool when there is
/// one), each through f32 values that `store` writes out.
fn dequant_rows<E: Send>(
    data: &[u8],
    scale: &[u8],
    k: usize,
    out: &mut [E],
    exec: &Exec,
    store: impl Fn(&[f32], &mut [E]) + Sync,
) -> Result<(), mx::MxError> {
    let (rows, blocks) = (rows_per_task(k), mx::num_blocks(k));
    let run = |((d, s), o): ((&[u8], &[u8]), &mut [E])| {
        let mut values = vec![0.0f32; o.len()];
        mx::dequantize_into(d, s, k, &mut values)?;
        store(&values, o);
        Ok(())
    };
    let tasks =
        data.chunks(rows * k).zip(scale.chunks(rows * blocks)).zip(out.chunks_mut(rows * k));
    if exec.threads() == 1 {
        tasks.into_iter().try_for_each(run)
    } else {
        let tasks: Vec<_> = tasks.collect();
        exec.install(|| tasks.into_par_iter().try_for_each(run))
    }
}

pub(super) fn gemm(
    a: &T,
    a_scale: &T,
    w: &T,
    w_scale: &T,
    y: &T,
    exec: &Exec,
) -> Result<(), String> {
    let dims = mx_gemm_dims(a, a_scale, w, w_scale, y).map_err(|e| e.to_string())?;
    let GemmDims { m, n, k } = dims;
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        return super::memory::fill(y, 0.0);
    }
    let (a, a_scale, w, w_scale) =
        (read::<u8>(a), read::<u8>(a_scale), read::<u8>(w), read::<u8>(w_scale));
    let ops =
        super::mx_gemm::Operands { a: &a, a_scale: &a_scale, w: &w, w_scale: &w_scale, m, n, k };
    let threads = exec.threads();
    let out = exec.install(|| super::mx_gemm::gemm(&ops, threads, crate::progress::report));
    match y.dtype() {
        DType::BF16 => write::<bf16, _>(y, |dst| dst.convert_from_f32_slice(&out)),
        _ => write::<f32, _>(y, |dst| dst.copy_from_slice(&out)),
    }
    Ok(())
}
