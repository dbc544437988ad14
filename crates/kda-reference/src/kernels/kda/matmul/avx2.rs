//! The AVX2/FMA product for the block sizes of the chunked recurrence, in `gemm`'s order.
//!
//! Each output element is one accumulator lane that starts at zero and takes one fused
//! multiply-add per step of `k`, in order, then meets the destination in one rounding: exactly
//! what `gemm` 0.19's packed micro-kernel does for these shapes (see
//! [`super::gemm_order_is_sequential`]), so the bits are the same, without its per-call
//! dispatch and packing. Tiles are 6 rows × 16 columns: 12 accumulators, two loads of `b` and
//! one broadcast of `a` fill the 16 vector registers.

use std::arch::x86_64::{
    __m256, _mm256_add_ps, _mm256_fmadd_ps, _mm256_loadu_ps, _mm256_permute2f128_ps,
    _mm256_set1_ps, _mm256_setzero_ps, _mm256_shuffle_ps, _mm256_storeu_ps, _mm256_sub_ps,
    _mm256_unpackhi_ps, _mm256_unpacklo_ps,
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
    // A panel of `b`, `k` rows of `NR` contiguous columns, for `b` without unit column stride
    // (the chunk kernel's transposed operands: packed by 8 × 8 transposes).
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
        // The columns the tiles read: two vectors or one.
        let cols = if width >= NR { NR } else { LANES };
        let (b_panel, b_rs) = if p.b_cs == 1 {
            (b_col, p.b_rs)
        } else {
            // SAFETY: rows `0..k`, columns `0..cols` from `b_col` are inside `b` (`j0 + cols
            // <= n`), and the panel holds `k <= MAX_DEPTH` rows of `NR >= cols`.
            unsafe { pack(b_col, p.b_rs, p.b_cs, p.k, cols, &mut panel) };
            // The tiles read rows `0..k`, columns `0..cols` of the panel: all written by `pack`.
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

/// Rows `0..k`, columns `0..cols` (`LANES` or `NR`) of the matrix at `b` (element `(r, c)` at
/// `b[r·rs + c·cs]`) into rows of `NR` of `panel`: transposed by 8 × 8 blocks when the rows are
/// contiguous (`rs == 1`), element by element otherwise.
///
/// # Safety
/// AVX2; every element named is inside one live allocation; `k <= MAX_DEPTH`, `cols <= NR`.
#[target_feature(enable = "avx2,fma")]
unsafe fn pack(
    b: *const f32,
    rs: usize,
    cs: usize,
    k: usize,
    cols: usize,
    panel: &mut [MaybeUninit<f32>],
) {
    let out = panel.as_mut_ptr().cast::<f32>();
    let whole = if rs == 1 { k - k % LANES } else { 0 };
    for c0 in (0..cols).step_by(LANES) {
        for r0 in (0..whole).step_by(LANES) {
            // SAFETY: rows `r0..r0 + 8 <= k` (contiguous, `rs == 1`) of columns `c0..c0 + 8 <=
            // cols`, and the same block of the panel.
            unsafe {
                let col = |c: usize| _mm256_loadu_ps(b.add((c0 + c) * cs + r0));
                let t =
                    transpose8([col(0), col(1), col(2), col(3), col(4), col(5), col(6), col(7)]);
                for (r, x) in t.into_iter().enumerate() {
                    _mm256_storeu_ps(out.add((r0 + r) * NR + c0), x);
                }
            }
        }
        for r in whole..k {
            for c in c0..c0 + LANES {
                // SAFETY: `r < k`, `c < cols`: inside `b` and the panel.
                unsafe { *out.add(r * NR + c) = *b.add(r * rs + c * cs) };
            }
        }
    }
}

/// The 8 × 8 transpose: lane `c` of vector `r` of the result is lane `r` of vector `c`.
#[target_feature(enable = "avx2,fma")]
fn transpose8(x: [__m256; 8]) -> [__m256; 8] {
    let lo = |a, b| _mm256_unpacklo_ps(a, b);
    let hi = |a, b| _mm256_unpackhi_ps(a, b);
    let t = [
        lo(x[0], x[1]),
        hi(x[0], x[1]),
        lo(x[2], x[3]),
        hi(x[2], x[3]),
        lo(x[4], x[5]),
        hi(x[4], x[5]),
        lo(x[6], x[7]),
        hi(x[6], x[7]),
    ];
    let u = [
        _mm256_shuffle_ps::<0x44>(t[0], t[2]),
        _mm256_shuffle_ps::<0xEE>(t[0], t[2]),
        _mm256_shuffle_ps::<0x44>(t[1], t[3]),
        _mm256_shuffle_ps::<0xEE>(t[1], t[3]),
        _mm256_shuffle_ps::<0x44>(t[4], t[6]),
        _mm256_shuffle_ps::<0xEE>(t[4], t[6]),
        _mm256_shuffle_ps::<0x44>(t[5], t[7]),
        _mm256_shuffle_ps::<0xEE>(t[5], t[7]),
    ];
    [
        _mm256_permute2f128_ps::<0x20>(u[0], u[4]),
        _mm256_permute2f128_ps::<0x20>(u[1], u[5]),
        _mm256_permute2f128_ps::<0x20>(u[2], u[6]),
        _mm256_permute2f128_ps::<0x20>(u[3], u[7]),
        _mm256_permute2f128_ps::<0x31>(u[0], u[4]),
        _mm256_permute2f128_ps::<0x31>(u[1], u[5]),
        _mm256_permute2f128_ps::<0x31>(u[2], u[6]),
        _mm256_permute2f128_ps::<0x31>(u[3], u[7]),
    ]
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
