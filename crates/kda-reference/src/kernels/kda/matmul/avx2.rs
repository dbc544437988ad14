//! The AVX2/FMA product for the block sizes of the chunked recurrence, in `gemm`'s order.
//!
//! Each output element is one accumulator lane that starts at zero and takes one fused
//! multiply-add per step of `k`, in order, then meets the destination in one rounding: exactly
//! what `gemm` 0.19's packed micro-kernel does for these shapes (see
//! [`super::gemm_order_is_sequential`]), so the bits are the same, without its per-call
//! dispatch and packing. Tiles are 6 rows × 16 columns: 12 accumulators, two loads of `b` and
//! one broadcast of `a` fill the 16 vector registers.

use std::arch::x86_64::{
    __m256, _mm256_add_ps, _mm256_fmadd_ps, _mm256_loadu_ps, _mm256_set1_ps, _mm256_setzero_ps,
    _mm256_storeu_ps, _mm256_sub_ps,
};

use std::mem::MaybeUninit;

use super::{MAX_DEPTH, Update};

/// Rows of a tile.
const MR: usize = 6;
/// Lanes of a vector.
const LANES: usize = 8;
/// Columns of a tile.
const NR: usize = 2 * LANES;

/// A product's operands as raw parts: element `(i, j)` of `a` at `a[i·a_rs + j·a_cs]`, of `b`
/// likewise, of `dst` at `dst[i·dst_rs + j]`.
#[derive(Copy, Clone)]
pub(super) struct Parts {
    pub(super) m: usize,
    pub(super) n: usize,
    pub(super) k: usize,
    pub(super) dst: *mut f32,
    pub(super) dst_rs: usize,
    pub(super) a: *const f32,
    pub(super) a_rs: usize,
    pub(super) a_cs: usize,
    pub(super) b: *const f32,
    pub(super) b_rs: usize,
    pub(super) b_cs: usize,
    pub(super) into: Update,
}

/// `dst = a · b` (or `+=`, `-=`) in the sequential order.
///
/// # Safety
/// The CPU has AVX2 and FMA; `1 <= k <= MAX_DEPTH`; every element the parts name lies inside
/// one live allocation; `dst` overlaps neither operand and nothing else accesses it meanwhile.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn product(p: Parts) {
    // A panel of `b`, `k` rows of `NR` contiguous columns, for `b` without unit column stride.
    // (Left uninitialised: only what is packed is read, and zeroing it cost every call.)
    let mut panel = [MaybeUninit::<f32>::uninit(); MAX_DEPTH * NR];
    let mut j0 = 0;
    while j0 < p.n {
        let width = NR.min(p.n - j0);
        if width < LANES {
            // SAFETY: the columns `j0..n` of every row are inside the parts (the caller's
            // contract).
            unsafe { scalar_columns(p, j0) };
            return;
        }
        // SAFETY: column `j0` is inside `b` (the caller's contract).
        let b_col = unsafe { p.b.add(j0 * p.b_cs) };
        let (b_panel, b_rs) = if p.b_cs == 1 {
            (b_col, p.b_rs)
        } else {
            for (row, out) in panel.chunks_exact_mut(NR).take(p.k).enumerate() {
                for (c, x) in out.iter_mut().take(width).enumerate() {
                    // SAFETY: element `(row, j0 + c)` of `b`, `row < k`, `j0 + c < n`.
                    x.write(unsafe { *b_col.add(row * p.b_rs + c * p.b_cs) });
                }
            }
            // The tiles read rows `0..k`, columns `0..width` of the panel: all written above.
            (panel.as_ptr().cast::<f32>(), NR)
        };
        let mut i0 = 0;
        while i0 < p.m {
            // A last tile of one or two rows would leave the FMA units waiting on their
            // latency: the last 7 to 11 rows go as two tiles of 3 to 6.
            let left = p.m - i0;
            let rows = if (MR + 1..2 * MR).contains(&left) { left / 2 } else { MR.min(left) };
            // SAFETY: rows `i0..i0 + rows` and columns `j0..j0 + width` of `a`, `b` (or its
            // panel) and `dst` are inside them.
            unsafe {
                let a = p.a.add(i0 * p.a_rs);
                let dst = p.dst.add(i0 * p.dst_rs + j0);
                let t =
                    Tile { a, a_rs: p.a_rs, a_cs: p.a_cs, b: b_panel, b_rs, dst, dst_rs: p.dst_rs };
                match (rows, width >= NR) {
                    (6, true) => tile::<6, 2>(t, p.k, p.into),
                    (5, true) => tile::<5, 2>(t, p.k, p.into),
                    (4, true) => tile::<4, 2>(t, p.k, p.into),
                    (3, true) => tile::<3, 2>(t, p.k, p.into),
                    (2, true) => tile::<2, 2>(t, p.k, p.into),
                    (1, true) => tile::<1, 2>(t, p.k, p.into),
                    (6, false) => tile::<6, 1>(t, p.k, p.into),
                    (5, false) => tile::<5, 1>(t, p.k, p.into),
                    (4, false) => tile::<4, 1>(t, p.k, p.into),
                    (3, false) => tile::<3, 1>(t, p.k, p.into),
                    (2, false) => tile::<2, 1>(t, p.k, p.into),
                    _ => tile::<1, 1>(t, p.k, p.into),
                }
            }
            i0 += rows;
        }
        j0 += if width >= NR { NR } else { LANES };
    }
}

/// One tile's corner in `a`, its panel of `b`, and its corner in `dst`.
#[derive(Copy, Clone)]
struct Tile {
    a: *const f32,
    a_rs: usize,
    a_cs: usize,
    b: *const f32,
    b_rs: usize,
    dst: *mut f32,
    dst_rs: usize,
}

/// `R` rows × `V` vectors of columns, over all of `k`.
///
/// # Safety
/// AVX2 and FMA; rows `0..R` of `a` over `0..k`, rows `0..k` of `b` over `V·LANES` columns and
/// rows `0..R` of `dst` over as many columns are inside their allocations.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn tile<const R: usize, const V: usize>(t: Tile, k: usize, into: Update) {
    let mut acc = [[_mm256_setzero_ps(); V]; R];
    for p in 0..k {
        // SAFETY: `p < k`, so the row of `b` and column of `a` are inside (the contract).
        unsafe {
            let b_row = t.b.add(p * t.b_rs);
            let mut b = [_mm256_setzero_ps(); V];
            for (v, x) in b.iter_mut().enumerate() {
                *x = _mm256_loadu_ps(b_row.add(v * LANES));
            }
            for (r, acc_r) in acc.iter_mut().enumerate() {
                let a = _mm256_set1_ps(*t.a.add(r * t.a_rs + p * t.a_cs));
                for (x, &b) in acc_r.iter_mut().zip(&b) {
                    *x = _mm256_fmadd_ps(a, b, *x);
                }
            }
        }
    }
    for (r, acc_r) in acc.iter().enumerate() {
        for (v, &x) in acc_r.iter().enumerate() {
            // SAFETY: row `r < R`, columns `v·LANES..(v + 1)·LANES` of `dst` are inside.
            unsafe {
                let d = t.dst.add(r * t.dst_rs + v * LANES);
                let out: __m256 = match into {
                    Update::Set => x,
                    Update::Add => _mm256_add_ps(_mm256_loadu_ps(d), x),
                    Update::Sub => _mm256_sub_ps(_mm256_loadu_ps(d), x),
                };
                _mm256_storeu_ps(d, out);
            }
        }
    }
}

/// The last columns `j0..n` (fewer than a vector), one element at a time in the same order.
///
/// # Safety
/// As [`product`].
#[target_feature(enable = "avx2,fma")]
unsafe fn scalar_columns(p: Parts, j0: usize) {
    for i in 0..p.m {
        for j in j0..p.n {
            let mut acc = 0.0f32;
            for q in 0..p.k {
                // SAFETY: `i < m`, `j < n`, `q < k`: inside the parts (the contract).
                let (x, y) = unsafe {
                    (*p.a.add(i * p.a_rs + q * p.a_cs), *p.b.add(q * p.b_rs + j * p.b_cs))
                };
                acc = x.mul_add(y, acc);
            }
            // SAFETY: as above, for `dst`.
            let d = unsafe { &mut *p.dst.add(i * p.dst_rs + j) };
            *d = match p.into {
                Update::Set => acc,
                Update::Add => *d + acc,
                Update::Sub => *d - acc,
            };
        }
    }
}
