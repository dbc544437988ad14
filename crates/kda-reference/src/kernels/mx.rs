//! MXFP8 kernels: DynamicQuant, dequantization and the quantized GEMM. The numbers come from the
//! codec in [`kda_core::mx`] (the specification); these kernels only arrange the work.
//!
//! The GEMM follows [`kda_core::mx::gemm`]'s definition: per 32-wide K block an exact block sum,
//! scaled and rounded once to f32, accumulated over blocks in order in f32. Exact block sums come
//! from the `gemm` crate's f64 kernel: E4M3 products and their 32-term sums are exact in f64 in
//! any order (see the core module docs), so its blocking and FMAs cannot change a bit. The work is
//! tiled over `[M, N]` so a tile's block sums and accumulators stay in cache; tiles are
//! independent and run across the pool when there is one.

use std::borrow::Cow;

use bytemuck::Pod;
use gemm::Parallelism;
use half::bf16;
use half::slice::HalfFloatSliceExt;
use kda_core::mx::gemm::scale_block_sum;
use kda_core::mx::{self, BLOCK_SIZE, MxFloat};
use kda_core::op::{MxDims, mx_dequant_dims, mx_gemm_dims, mx_quant_dims};
use kda_core::{DType, GemmDims, ScaleAlg, Tensor};
use rayon::prelude::*;

use super::Exec;
use crate::ReferenceBackend;

type T = Tensor<ReferenceBackend>;

/// Elements a parallel task of the element-wise kernels handles at least.
const TASK_ELEMENTS: usize = 1 << 16;
/// GEMM tile: rows of `a` and of `w` per tile.
const TILE_M: usize = 256;
const TILE_N: usize = 256;

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

/// The operands of the GEMM as row-major bytes and decoded scales.
struct GemmOperands<'a> {
    a: Cow<'a, [u8]>,
    w: Cow<'a, [u8]>,
    /// `a_scale` decoded, `[m, blocks]`.
    a_factor: Vec<f64>,
    /// `w_scale` decoded and transposed to `[blocks, n]`, so a block's factors are contiguous.
    w_factor: Vec<f64>,
    /// Every E4M3 byte's value.
    decode: [f64; 256],
    dims: GemmDims,
    blocks: usize,
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
    let blocks = mx::num_blocks(k);
    let a_factor = read::<u8>(a_scale).iter().map(|&s| mx::decode_e8m0_f64(s)).collect();
    let w_scale = read::<u8>(w_scale);
    let mut w_factor = vec![0.0; n * blocks];
    for (j, row) in w_scale.chunks_exact(blocks).enumerate() {
        for (b, &s) in row.iter().enumerate() {
            w_factor[b * n + j] = mx::decode_e8m0_f64(s);
        }
    }
    let ops = GemmOperands {
        a: read::<u8>(a),
        w: read::<u8>(w),
        a_factor,
        w_factor,
        decode: std::array::from_fn(|b| f64::from(mx::decode_e4m3(b as u8))),
        dims,
        blocks,
    };
    let tiles: Vec<(usize, usize)> = (0..m)
        .step_by(TILE_M)
        .flat_map(|m0| (0..n).step_by(TILE_N).map(move |n0| (m0, n0)))
        .collect();
    let results: Vec<Vec<f32>> = if exec.threads() == 1 {
        let tile = |(i, &tile): (usize, &(usize, usize))| {
            let acc = gemm_tile(&ops, tile);
            crate::progress::report(i + 1, tiles.len());
            acc
        };
        tiles.iter().enumerate().map(tile).collect()
    } else {
        exec.install(|| tiles.par_iter().map(|&tile| gemm_tile(&ops, tile)).collect())
    };
    let mut out = vec![0.0f32; m * n];
    for (&(m0, n0), acc) in tiles.iter().zip(&results) {
        let nt = TILE_N.min(n - n0);
        for (i, row) in acc.chunks_exact(nt).enumerate() {
            out[(m0 + i) * n + n0..][..nt].copy_from_slice(row);
        }
    }
    match y.dtype() {
        DType::BF16 => write::<bf16, _>(y, |dst| dst.convert_from_f32_slice(&out)),
        _ => write::<f32, _>(y, |dst| dst.copy_from_slice(&out)),
    }
    Ok(())
}

/// One `[TILE_M, TILE_N]` tile of the output (smaller at the edges), row-major.
fn gemm_tile(ops: &GemmOperands<'_>, (m0, n0): (usize, usize)) -> Vec<f32> {
    let GemmDims { m, n, k } = ops.dims;
    let (mt, nt) = (TILE_M.min(m - m0), TILE_N.min(n - n0));
    let mut acc = vec![0.0f32; mt * nt];
    let mut a64 = vec![0.0f64; mt * BLOCK_SIZE];
    let mut w64 = vec![0.0f64; nt * BLOCK_SIZE];
    let mut sums = vec![0.0f64; mt * nt];
    for b in 0..ops.blocks {
        let k0 = b * BLOCK_SIZE;
        let kb = BLOCK_SIZE.min(k - k0);
        decode_block(&ops.decode, &ops.a, k, (m0, mt), (k0, kb), &mut a64);
        decode_block(&ops.decode, &ops.w, k, (n0, nt), (k0, kb), &mut w64);
        // SAFETY: `a64` holds `[mt, kb]` and `w64` `[nt, kb]` row-major (read as its transpose
        // `[kb, nt]`), `sums` `[mt, nt]` row-major; all are live, distinct vectors of this thread,
        // large enough for the strides given.
        unsafe {
            gemm::gemm(
                mt,
                nt,
                kb,
                sums.as_mut_ptr(),
                1,
                nt as isize,
                false,
                a64.as_ptr(),
                1,
                kb as isize,
                w64.as_ptr(),
                kb as isize,
                1,
                0.0,
                1.0,
                false,
                false,
                false,
                Parallelism::None,
            );
        }
        let w_factor = &ops.w_factor[b * n + n0..][..nt];
        for (i, (acc_row, sum_row)) in
            acc.chunks_exact_mut(nt).zip(sums.chunks_exact(nt)).enumerate()
        {
            let a_factor = ops.a_factor[(m0 + i) * ops.blocks + b];
            for ((acc, &sum), &wf) in acc_row.iter_mut().zip(sum_row).zip(w_factor) {
                *acc += scale_block_sum(sum, a_factor, wf);
            }
        }
    }
    acc
}

/// Decode rows `r0..r0 + rows`, columns `k0..k0 + kb` of a row-major `[_, k]` byte matrix into
/// `out` as `[rows, kb]` row-major f64.
fn decode_block(
    decode: &[f64; 256],
    bytes: &[u8],
    k: usize,
    (r0, rows): (usize, usize),
    (k0, kb): (usize, usize),
    out: &mut [f64],
) {
    for (r, dst) in out.chunks_exact_mut(kb).take(rows).enumerate() {
        let src = &bytes[(r0 + r) * k + k0..][..kb];
        for (d, &q) in dst.iter_mut().zip(src) {
            *d = decode[usize::from(q)];
        }
    }
}
