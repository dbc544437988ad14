//! The dense GEMM for a few rows (decode): `y[M, N] = x[M, K] · w[N, K]^T` with `M` at most
//! [`MAX_ROWS`], the weight read once, in its stored dtype, straight from its buffer.
//!
//! A large-M GEMM packs and reuses weight panels across many rows; with a few rows each weight
//! element serves only `M` products, so the weight is the traffic and packing it (or widening a
//! bf16 weight to f32 first) costs as much as the products. Here `[TILES]` `· [NR]` weight rows
//! at a time are widened `KC` elements at a time into a small buffer that stays in the
//! first-level cache, and every group of `[MR]` activation rows takes its products from it.
//!
//! Each output is a dot product along K in eight interleaved f32 lanes (lane `l` takes
//! `k ≡ l mod 8` in order, by fused multiply-adds), the lanes combined in a fixed tree at the
//! end. So an entry's bits depend only on its row of `x`, its row of `w` and `K`: not on `M`,
//! the tiling, the split across threads, or which kernel ran (the portable one computes the
//! same fused operations as the AVX2 one; the AVX-512 one holds two activation rows' eight
//! lanes in one register, so its lanes are the same lanes).

use rayon::prelude::*;

use super::Isa;

/// Rows of `x` that take this path at most.
pub(super) const MAX_ROWS: usize = 64;
/// Activation rows per micro-kernel tile.
const MR: usize = 4;
/// Weight rows per micro-kernel tile.
const NR: usize = 3;
/// f32 lanes of one accumulator.
const LANES: usize = 8;
/// K elements widened at once (a multiple of [`LANES`]).
const KC: usize = 128;
/// `[NR]`-row tiles of weight rows widened at once.
const TILES: usize = 4;
/// Weight rows per task when the work is split across threads.
const ROWS_PER_TASK: usize = 32 * NR;

/// A weight matrix `[N, K]` with contiguous rows, in its stored dtype.
#[derive(Copy, Clone, Debug)]
pub(super) enum Weight<'a> {
    F32 { data: &'a [f32], row_stride: usize },
    BF16 { data: &'a [half::bf16], row_stride: usize },
    F16 { data: &'a [half::f16], row_stride: usize },
}

impl Weight<'_> {
    /// Prefetch elements `k0 .. k0 + len` of row `r` (clamped to `k`).
    #[inline(always)]
    fn prefetch(&self, r: usize, k0: usize, len: usize, k: usize) {
        let len = len.min(k.saturating_sub(k0));
        if len == 0 {
            return;
        }
        match *self {
            Weight::F32 { data, row_stride } => {
                super::prefetch(&data[r * row_stride + k0..][..len])
            }
            Weight::BF16 { data, row_stride } => {
                super::prefetch(&data[r * row_stride + k0..][..len])
            }
            Weight::F16 { data, row_stride } => {
                super::prefetch(&data[r * row_stride + k0..][..len])
            }
        }
    }

    /// Elements `k0 .. k0 + out.len()` of row `r`, widened (exactly) into `out`.
    #[inline(always)]
    fn widen_into(&self, r: usize, k0: usize, out: &mut [f32]) {
        use half::slice::HalfFloatSliceExt;
        let len = out.len();
        match *self {
            Weight::F32 { data, row_stride } => {
                out.copy_from_slice(&data[r * row_stride + k0..][..len]);
            }
            Weight::BF16 { data, row_stride } => {
                let src = &data[r * row_stride + k0..][..len];
                for (d, s) in out.iter_mut().zip(src) {
                    *d = f32::from_bits(u32::from(s.to_bits()) << 16);
                }
            }
            Weight::F16 { data, row_stride } => {
                data[r * row_stride + k0..][..len].convert_to_f32_slice(out);
            }
        }
    }
}

/// `y = x · w^T` as `[m, n]` f32 row-major, `x` `[m, k]` f32 row-major (`m <= MAX_ROWS`);
/// `threads > 1` splits the weight rows across the current rayon pool. `progress` is told of
/// each finished group of weight rows when it runs serially.
pub(super) fn gemm(
    x: &[f32],
    w: Weight<'_>,
    dims: (usize, usize, usize),
    threads: usize,
    progress: impl Fn(usize, usize),
) -> Vec<f32> {
    let isa = match Isa::detect() {
        Isa::Avx512 => Isa::Avx512,
        _ if super::has_avx2_fma() => Isa::Avx2,
        _ => Isa::Portable,
    };
    gemm_on(isa, x, w, dims, threads, progress)
}

/// [`gemm`] on the micro-kernel of `isa` (each gives the same bits).
fn gemm_on(
    isa: Isa,
    x: &[f32],
    w: Weight<'_>,
    (m, n, k): (usize, usize, usize),
    threads: usize,
    progress: impl Fn(usize, usize),
) -> Vec<f32> {
    debug_assert!(m <= MAX_ROWS && x.len() == m * k);
    let mut y = vec![0.0f32; m * n];
    if m == 0 || n == 0 {
        return y;
    }
    // x padded to whole lanes and whole KC chunks, zeros after K (the products there are 0 · 0).
    let kp = k.div_ceil(KC) * KC;
    let rows = if isa == Isa::Avx512 { 2 * MR } else { MR };
    let mut xp = vec![0.0f32; m.div_ceil(rows) * rows * kp];
    if isa == Isa::Avx512 {
        // Rows eight at a time (two row groups), a lane group of each in turn
        // (`[rows / 8][k / 8][8][8]`): one 16-lane load holds the same eight K of two rows, and
        // a step of the micro-kernel reads one contiguous 256 bytes.
        for (i, src) in x.chunks_exact(k.max(1)).enumerate() {
            let block = &mut xp[(i / (2 * MR)) * 2 * MR * kp..][..2 * MR * kp];
            for (c, chunk) in src.chunks(LANES).enumerate() {
                block[(c * 2 * MR + i % (2 * MR)) * LANES..][..chunk.len()].copy_from_slice(chunk);
            }
        }
    } else {
        for (dst, src) in xp.chunks_exact_mut(kp).zip(x.chunks_exact(k.max(1))) {
            dst[..k].copy_from_slice(src);
        }
    }
    let rows = |range: std::ops::Range<usize>| weight_rows(isa, &xp, w, m, k, range);
    let tasks = n.div_ceil(ROWS_PER_TASK);
    let copy = |y: &mut [f32], r0: usize, part: &[f32]| {
        let width = part.len() / m;
        for (dst, src) in y.chunks_exact_mut(n).zip(part.chunks_exact(width)) {
            dst[r0..r0 + width].copy_from_slice(src);
        }
    };
    if threads <= 1 {
        for t in 0..tasks {
            let r0 = t * ROWS_PER_TASK;
            copy(&mut y, r0, &rows(r0..(r0 + ROWS_PER_TASK).min(n)));
            progress(t + 1, tasks);
        }
    } else {
        let parts: Vec<Vec<f32>> = (0..tasks)
            .into_par_iter()
            .map(|t| rows(t * ROWS_PER_TASK..((t + 1) * ROWS_PER_TASK).min(n)))
            .collect();
        for (t, part) in parts.iter().enumerate() {
            copy(&mut y, t * ROWS_PER_TASK, part);
        }
    }
    y
}

/// Outputs of weight rows `range` for every row of `xp` (`[_, kp]`, padded), `[m, range.len()]`:
/// [`weight_rows_with`], compiled for AVX-512 where that kernel runs (its widening loop then
/// works sixteen elements at a time).
fn weight_rows(
    isa: Isa,
    xp: &[f32],
    w: Weight<'_>,
    m: usize,
    k: usize,
    range: std::ops::Range<usize>,
) -> Vec<f32> {
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 {
        // SAFETY: `Isa::Avx512` is only chosen where the CPU has AVX-512F and BW.
        return unsafe { weight_rows_avx512(xp, w, m, k, range) };
    }
    weight_rows_with(isa, xp, w, m, k, range)
}

/// [`weight_rows_with`] for the AVX-512 kernel.
///
/// # Safety
/// The CPU must support AVX-512F and AVX-512BW.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn weight_rows_avx512(
    xp: &[f32],
    w: Weight<'_>,
    m: usize,
    k: usize,
    range: std::ops::Range<usize>,
) -> Vec<f32> {
    weight_rows_with(Isa::Avx512, xp, w, m, k, range)
}

/// The work of [`weight_rows`].
///
/// The weight rows are taken [`TILES`] `· [NR]` at a time and widened `KC` elements at a time
/// into a buffer that stays in the first-level cache; each group of `[MR]` activation rows then
/// takes its products with every tile of them while its chunk is in that cache too, so the
/// activations are read from the next levels once per [`TILES`] tiles, not once per tile (with
/// two threads the two cores' activation traffic, not the weights, bounded the rate).
#[inline(always)]
fn weight_rows_with(
    isa: Isa,
    xp: &[f32],
    w: Weight<'_>,
    m: usize,
    k: usize,
    range: std::ops::Range<usize>,
) -> Vec<f32> {
    let kp = k.div_ceil(KC) * KC;
    let width = range.len();
    let mut out = vec![0.0f32; m * width];
    let groups = m.div_ceil(MR);
    let mut wbuf = vec![[[0.0f32; KC]; NR]; TILES];
    let mut acc = vec![[[0.0f32; LANES]; NR * MR]; groups * TILES];
    for p0 in range.clone().step_by(TILES * NR) {
        let np = (TILES * NR).min(range.end - p0);
        acc.iter_mut().for_each(|a| *a = [[0.0; LANES]; NR * MR]);
        for k0 in (0..kp).step_by(KC) {
            let kc = KC.min(k - k0);
            for (j, row) in wbuf.iter_mut().flatten().enumerate() {
                let len = if j < np { kc } else { 0 };
                if len > 0 {
                    w.widen_into(p0 + j, k0, &mut row[..len]);
                }
                row[len..].fill(0.0);
            }
            // The next chunk of these rows (or the first of the next rows) streams in while
            // this one is used.
            let (next_rows, next_k) = if k0 + KC < k {
                (p0..p0 + np, k0 + KC)
            } else {
                (p0 + np..(p0 + 2 * np).min(range.end), 0)
            };
            for r in next_rows {
                w.prefetch(r, next_k, KC, k);
            }
            let used = np.div_ceil(NR);
            #[cfg(target_arch = "x86_64")]
            if isa == Isa::Avx512 {
                // SAFETY: `Isa::Avx512` only where `Isa::detect` found it.
                unsafe { tiles_avx512(&mut acc, &wbuf[..used], (xp, kp, k0)) };
                continue;
            }
            for (g, tiles) in acc.chunks_exact_mut(TILES).enumerate() {
                let xs = &xp[g * MR * kp..][..MR * kp];
                for (a, wt) in tiles.iter_mut().zip(&wbuf).take(used) {
                    micro_kernel(isa, xs, kp, k0, wt, a);
                }
            }
        }
        for (g, tiles) in acc.chunks_exact(TILES).enumerate() {
            for i in 0..MR.min(m - g * MR) {
                for j in 0..np {
                    let a = &tiles[j / NR][acc_index(isa, i, j % NR)];
                    out[(g * MR + i) * width + (p0 - range.start) + j] = reduce(a);
                }
            }
        }
    }
    out
}

/// One `KC` chunk of every row group's tiles against the widened weight tiles `wbuf`, on
/// AVX-512: two row groups and two tiles per call (24 independent accumulators, each weight
/// broadcast serving four activation registers), fewer at the edges.
///
/// # Safety
/// The CPU must support AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn tiles_avx512(
    acc: &mut [[[f32; LANES]; NR * MR]],
    wbuf: &[[[f32; KC]; NR]],
    (xp, kp, k0): (&[f32], usize, usize),
) {
    for (gg, both) in acc.chunks_mut(2 * TILES).enumerate() {
        let xs = &xp[gg * 2 * MR * kp..];
        let (first, second) = both.split_at_mut(TILES);
        for (t, w) in wbuf.chunks(2).enumerate() {
            let f = &mut first[2 * t..][..w.len()];
            let s = second.get_mut(2 * t..2 * t + w.len());
            match (f, s, w) {
                ([f0, f1], Some([s0, s1]), [w0, w1]) => {
                    micro_kernel_avx512([w0, w1], [[f0, f1], [s0, s1]], (xs, k0))
                }
                ([f0, f1], _, [w0, w1]) => micro_kernel_avx512([w0, w1], [[f0, f1]], (xs, k0)),
                ([f0], Some([s0]), [w0]) => micro_kernel_avx512([w0], [[f0], [s0]], (xs, k0)),
                ([f0], _, [w0]) => micro_kernel_avx512([w0], [[f0]], (xs, k0)),
                _ => {}
            }
        }
    }
}

/// Where a tile keeps the lanes of activation row `i`, weight row `j`: row by row (`i · NR + j`),
/// or for the AVX-512 kernel, which holds two rows' lanes in one register, pair by pair (row
/// `2p + h` at `2 (p · NR + j) + h`), so that register is one contiguous load.
#[inline(always)]
fn acc_index(isa: Isa, i: usize, j: usize) -> usize {
    if isa == Isa::Avx512 { 2 * ((i / 2) * NR + j) + i % 2 } else { i * NR + j }
}

/// The lanes of an accumulator, combined in a fixed order.
#[inline(always)]
fn reduce(l: &[f32; LANES]) -> f32 {
    ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]))
}

/// `acc[i·NR + j][l] += Σ x[i][k0 + 8t + l] · w[j][8t + l]` over the chunk, `t` in order.
/// `xs`: the group's `MR` rows, laid out as [`gemm_on`] lays them out for `isa` (not AVX-512:
/// [`weight_rows`] calls [`micro_kernel_avx512`] itself).
fn micro_kernel(
    isa: Isa,
    xs: &[f32],
    kp: usize,
    k0: usize,
    w: &[[f32; KC]; NR],
    acc: &mut [[f32; LANES]; NR * MR],
) {
    #[cfg(target_arch = "x86_64")]
    if isa != Isa::Portable && super::has_avx2_fma() {
        // SAFETY: the CPU has AVX2 and FMA (checked at run time).
        unsafe { micro_kernel_avx2(xs, kp, k0, w, acc) };
        return;
    }
    micro_kernel_portable(xs, kp, k0, w, acc);
}

/// [`micro_kernel_portable`] on `T` tiles of `G` row groups at once in AVX-512 registers, each
/// register holding one weight row's eight lanes for two activation rows (the rows' lane groups
/// interleaved in `xs`, the weight's lanes broadcast to both halves): a `4 × 3` tile's twelve
/// accumulators in six registers, twice the products per instruction of the AVX2 kernel, the
/// same fused operations lane by lane. `xs` holds the eight rows of two groups as
/// [`gemm_on`] lays them out (a group alone: its rows first, padding after).
///
/// # Safety
/// The CPU must support AVX-512 F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn micro_kernel_avx512<const T: usize, const G: usize>(
    w: [&[[f32; KC]; NR]; T],
    acc: [[&mut [[f32; LANES]; NR * MR]; T]; G],
    (xs, k0): (&[f32], usize),
) {
    use std::arch::x86_64::*;
    const PAIRS: usize = MR / 2;
    const { assert!(MR == 4 && NR == 3 && KC.is_multiple_of(LANES)) };
    assert!(xs.len() >= 2 * MR * (k0 + KC));
    let mut a = [[[[_mm512_setzero_ps(); NR]; PAIRS]; T]; G];
    for (group, acc) in a.iter_mut().zip(&acc) {
        for (tile, acc) in group.iter_mut().zip(acc) {
            let at = acc.as_ptr().cast::<f32>();
            for (p, row) in tile.iter_mut().enumerate() {
                for (j, v) in row.iter_mut().enumerate() {
                    // SAFETY: the tile's 96 f32 hold `(p · NR + j)`'s sixteen at `16 (p · NR + j)`.
                    *v = unsafe { _mm512_loadu_ps(at.add(16 * (p * NR + j))) };
                }
            }
        }
    }
    let x0 = xs.as_ptr();
    for t in (0..KC).step_by(LANES) {
        // SAFETY: `t + 8 <= KC`: within each weight row; row pair `q = 2 g + p`'s sixteen
        // values for K `k0 + t ..` lie at `8 (k0 + t) + 16 q`, inside `xs` (asserted above).
        unsafe {
            let xv: [[__m512; PAIRS]; G] = std::array::from_fn(|g| {
                std::array::from_fn(|p| {
                    _mm512_loadu_ps(x0.add(2 * MR * (k0 + t) + (g * PAIRS + p) * 2 * LANES))
                })
            });
            for (ti, wt) in w.iter().enumerate() {
                for j in 0..NR {
                    let half = _mm256_castps_pd(_mm256_loadu_ps(wt[j].as_ptr().add(t)));
                    let wj = _mm512_castpd_ps(_mm512_broadcast_f64x4(half));
                    for (group, xg) in a.iter_mut().zip(&xv) {
                        for (row, &x) in group[ti].iter_mut().zip(xg) {
                            row[j] = _mm512_fmadd_ps(x, wj, row[j]);
                        }
                    }
                }
            }
        }
    }
    for (group, acc) in a.iter().zip(acc) {
        for (tile, acc) in group.iter().zip(acc) {
            let at = acc.as_mut_ptr().cast::<f32>();
            for (p, row) in tile.iter().enumerate() {
                for (j, &v) in row.iter().enumerate() {
                    // SAFETY: as for the loads.
                    unsafe { _mm512_storeu_ps(at.add(16 * (p * NR + j)), v) };
                }
            }
        }
    }
}

/// The definition, lane by lane, with the same fused multiply-adds as the vector kernel.
fn micro_kernel_portable(
    xs: &[f32],
    kp: usize,
    k0: usize,
    w: &[[f32; KC]; NR],
    acc: &mut [[f32; LANES]; NR * MR],
) {
    for i in 0..MR {
        let x = &xs[i * kp + k0..][..KC];
        for (j, wj) in w.iter().enumerate() {
            let a = &mut acc[i * NR + j];
            for (xc, wc) in x.chunks_exact(LANES).zip(wj.chunks_exact(LANES)) {
                for l in 0..LANES {
                    a[l] = xc[l].mul_add(wc[l], a[l]);
                }
            }
        }
    }
}

/// [`micro_kernel_portable`] with the twelve accumulators of a `4 × 3` tile in AVX registers (with
/// the three weight vectors and one activation vector, all sixteen: four activation rows per
/// three weight loads instead of three, about 5 % less time at decode shapes on one thread).
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn micro_kernel_avx2(
    xs: &[f32],
    kp: usize,
    k0: usize,
    w: &[[f32; KC]; NR],
    acc: &mut [[f32; LANES]; NR * MR],
) {
    use std::arch::x86_64::*;
    const { assert!(MR == 4 && NR == 3 && KC.is_multiple_of(LANES)) };
    assert!(xs.len() >= (MR - 1) * kp + k0 + KC);
    let mut a = [_mm256_setzero_ps(); MR * NR];
    for (v, s) in a.iter_mut().zip(acc.iter()) {
        // SAFETY: `s` holds 8 f32.
        *v = unsafe { _mm256_loadu_ps(s.as_ptr()) };
    }
    let x0 = xs[k0..].as_ptr();
    for t in (0..KC).step_by(LANES) {
        // SAFETY: `t + 8 <= KC`: within each weight row, and within each of the MR activation
        // rows at `i·kp + k0` (asserted above).
        unsafe {
            let wv = [
                _mm256_loadu_ps(w[0].as_ptr().add(t)),
                _mm256_loadu_ps(w[1].as_ptr().add(t)),
                _mm256_loadu_ps(w[2].as_ptr().add(t)),
            ];
            for i in 0..MR {
                let xv = _mm256_loadu_ps(x0.add(i * kp + t));
                for j in 0..NR {
                    a[i * NR + j] = _mm256_fmadd_ps(xv, wv[j], a[i * NR + j]);
                }
            }
        }
    }
    for (v, s) in a.iter().zip(acc.iter_mut()) {
        // SAFETY: `s` holds 8 f32.
        unsafe { _mm256_storeu_ps(s.as_mut_ptr(), *v) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;
    use kda_testkit::Gen;

    /// Each entry by its definition: eight lanes of fused multiply-adds, the fixed tree.
    fn by_definition(x: &[f32], w: &[f32]) -> f32 {
        let mut lanes = [0.0f32; LANES];
        for (t, (&a, &b)) in x.iter().zip(w).enumerate() {
            lanes[t % LANES] = a.mul_add(b, lanes[t % LANES]);
        }
        reduce(&lanes)
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// Shapes with partial tiles, chunks and lanes, f32 and bf16 weights with a row stride,
    /// serial and split: every entry equals its definition bit for bit, whatever `M`.
    #[test]
    fn every_entry_is_its_definition_whatever_the_rows() {
        let mut rng = Gen::new(5);
        for &(m, n, k) in &[(1, 1, 1), (2, 7, 9), (5, 100, 300), (32, 97, 700), (64, 5, 256)] {
            let x = rng.uniform_f32(m * k, -1.0, 1.0);
            let stride = k + 3;
            let w32 = rng.uniform_f32(n * stride, -1.0, 1.0);
            let w16: Vec<bf16> = w32.iter().map(|&v| bf16::from_f32(v)).collect();
            let wide: Vec<f32> = w16.iter().map(|v| v.to_f32()).collect();
            let cases = [
                (Weight::F32 { data: &w32, row_stride: stride }, &w32),
                (Weight::BF16 { data: &w16, row_stride: stride }, &wide),
            ];
            for (w, values) in cases {
                let want: Vec<f32> = (0..m * n)
                    .map(|e| {
                        let (i, j) = (e / n, e % n);
                        by_definition(&x[i * k..][..k], &values[j * stride..][..k])
                    })
                    .collect();
                for isa in Isa::available() {
                    for threads in [1, 2] {
                        let got = gemm_on(isa, &x, w, (m, n, k), threads, |_, _| {});
                        let at = format!("[{m}, {n}, {k}] {isa:?} threads {threads}");
                        assert_eq!(bits(&got), bits(&want), "{at}");
                    }
                    // One row alone gives that row's bits.
                    let one = gemm_on(isa, &x[(m - 1) * k..], w, (1, n, k), 1, |_, _| {});
                    assert_eq!(bits(&one), bits(&want[(m - 1) * n..]), "{isa:?}");
                }
            }
        }
    }
}
