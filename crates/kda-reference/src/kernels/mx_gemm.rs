//! The MXFP8 GEMM's engine: exact block sums of E4M3 operands read as bytes, no widened copy
//! of either operand.
//!
//! [`kda_core::mx::gemm`] defines the result: per 32-wide K block the exact sum of the products,
//! scaled by the two block factors and rounded once to f32, the block terms added in f32 in
//! block order from `+0`. Every E4M3 value is exact in f64, so is every product and every sum of
//! up to 32 of them (41 bits, see the core module), in any order: a block sum accumulated with
//! f64 fused multiply-adds, however the lanes are arranged, is the exact sum. What is left is
//! arranging the work.
//!
//! The structure is a packed GEMM. The output is cut into panels of [`NC`] columns (tasks,
//! across the pool when there is one); per panel, the K blocks are taken [`KCB`] at a time: the
//! weight rows of the panel are decoded (a 256-entry table) into a packed panel, `[NR]` columns
//! interleaved per K step, and so are the activation rows, [`MC`] at a time, `[MR]` rows
//! interleaved. A micro-kernel then computes an `MR × NR` tile's block sums in registers, one
//! block after the other, and folds each block's scaled, rounded term into the tile's f32
//! accumulators (in memory, in block order). Every weight byte is decoded once per call and per
//! [`MC`] rows of activations: at decode (a few rows) the weights stream from memory once.
//!
//! A partial last block is zero-padded on both sides (the padded products are `0 · 0`).

use rayon::prelude::*;

use kda_core::mx::gemm::scale_block_sum;
use kda_core::mx::{self, BLOCK_SIZE};

/// Activation rows per micro-kernel tile.
pub(super) const MR: usize = 8;
/// Weight rows (output columns) per micro-kernel tile.
pub(super) const NR: usize = 6;
/// Output columns per task: the weight panel decoded at once (each activation row decoded for
/// a panel serves this many columns).
const NC: usize = 64 * NR;
/// K blocks per packed weight panel: `KCB · 32` K elements (a 384-column panel is 768 KB of f64,
/// within the second-level cache).
const KCB: usize = 8;
/// Activation rows packed at once; with at most this many rows, they are packed once per call.
const MC: usize = 16 * MR;

/// The operands as plain-layout bytes: `a` `[m, k]`, `a_scale` `[m, blocks]`, `w` `[n, k]`,
/// `w_scale` `[n, blocks]`.
#[derive(Copy, Clone, Debug)]
pub(super) struct Operands<'a> {
    pub a: &'a [u8],
    pub a_scale: &'a [u8],
    pub w: &'a [u8],
    pub w_scale: &'a [u8],
    pub m: usize,
    pub n: usize,
    pub k: usize,
}

impl Operands<'_> {
    fn blocks(&self) -> usize {
        mx::num_blocks(self.k)
    }
}

/// Every E4M3 byte's value in f64 (exact).
fn decode_table() -> [f64; 256] {
    std::array::from_fn(|b| f64::from(mx::decode_e4m3(b as u8)))
}

/// The GEMM, `[m, n]` f32 row-major: `threads > 1` splits the column panels across the current
/// rayon pool; `progress` is told of each finished panel when it runs serially. The result does
/// not depend on the split: every entry is computed by the same sequence of operations.
pub(super) fn gemm(
    ops: &Operands<'_>,
    threads: usize,
    progress: impl Fn(usize, usize),
) -> Vec<f32> {
    let Operands { m, n, .. } = *ops;
    let mut out = vec![0.0f32; m * n];
    if m == 0 || n == 0 || ops.k == 0 {
        return out;
    }
    let decode = decode_table();
    // A few rows (decode): decoded once, for every panel.
    let whole_a = (m <= MC).then(|| {
        let blocks = ops.blocks();
        let mut packed = Packed::new::<MR>(m.div_ceil(MR), blocks);
        packed.pack::<MR>(&decode, ops.a, ops.a_scale, ops.k, 0..m, 0..blocks);
        packed
    });
    let panels = n.div_ceil(NC);
    let panel = |p: usize| {
        let cols = p * NC..(p * NC + NC).min(n);
        (cols.clone(), gemm_panel(ops, &decode, whole_a.as_ref(), cols))
    };
    let copy = |out: &mut [f32], (cols, part): (std::ops::Range<usize>, Vec<f32>)| {
        let width = cols.len();
        for (dst, src) in out.chunks_exact_mut(n).zip(part.chunks_exact(width)) {
            dst[cols.clone()].copy_from_slice(src);
        }
    };
    if threads <= 1 {
        for p in 0..panels {
            copy(&mut out, panel(p));
            progress(p + 1, panels);
        }
    } else {
        let parts: Vec<_> = (0..panels).into_par_iter().map(panel).collect();
        for part in parts {
            copy(&mut out, part);
        }
    }
    out
}

/// Columns `cols` of the output, `[m, cols.len()]` row-major.
fn gemm_panel(
    ops: &Operands<'_>,
    decode: &[f64; 256],
    whole_a: Option<&Packed>,
    cols: std::ops::Range<usize>,
) -> Vec<f32> {
    let (m, k, blocks) = (ops.m, ops.k, ops.blocks());
    let width = cols.len();
    let col_groups = width.div_ceil(NR);
    let mut acc = vec![0.0f32; m * width];
    let mut wp = Packed::new::<NR>(col_groups, KCB);
    let simd = vector_decode();
    let mut panel_a = Packed::new::<MR>(if whole_a.is_some() { 0 } else { MC / MR }, KCB);
    let mut tile = [0.0f32; MR * NR];
    for b0 in (0..blocks).step_by(KCB) {
        let nb = KCB.min(blocks - b0);
        wp.pack_rows::<NR>(decode, simd, ops.w, ops.w_scale, k, cols.clone(), b0..b0 + nb);
        for r0 in (0..m).step_by(MC) {
            let rows = r0..(r0 + MC).min(m);
            let (ap, g0, at) = match whole_a {
                Some(a) => (a, r0 / MR, b0),
                None => {
                    panel_a.pack::<MR>(decode, ops.a, ops.a_scale, k, rows.clone(), b0..b0 + nb);
                    (&panel_a, 0, 0)
                }
            };
            for g in 0..rows.len().div_ceil(MR) {
                let (i0, mr) = (r0 + g * MR, MR.min(rows.end - r0 - g * MR));
                for h in 0..col_groups {
                    let (j0, nr) = (h * NR, NR.min(width - h * NR));
                    // The tile's accumulators (`[NR][MR]`, by column), loaded from and stored
                    // back to the panel's.
                    for i in 0..mr {
                        for j in 0..nr {
                            tile[j * MR + i] = acc[(i0 + i) * width + j0 + j];
                        }
                    }
                    let (a, w) = (ap.group::<MR>(g0 + g, at, nb), wp.group::<NR>(h, 0, nb));
                    micro_kernel(nb, a, w, &mut tile);
                    for i in 0..mr {
                        for j in 0..nr {
                            acc[(i0 + i) * width + j0 + j] = tile[j * MR + i];
                        }
                    }
                }
            }
        }
    }
    acc
}

/// Rows decoded into f64 for the micro-kernel, per group of `R` rows and per block: the
/// activations interleaved, `[32][R]` values (`R` rows' elements of one K step side by side;
/// [`Packed::pack`]), the weights row by row, `[R][32]` ([`Packed::pack_rows`]); and `[R]`
/// factors.
struct Packed {
    values: Vec<f64>,
    factors: Vec<f64>,
    /// Blocks held per group.
    nb: usize,
}

/// One group's packed blocks: `values` `[nb][32][R]` (or `[nb][R][32]`), `factors` `[nb][R]`.
#[derive(Copy, Clone)]
struct Group<'a> {
    values: &'a [f64],
    factors: &'a [f64],
}

impl Packed {
    fn new<const R: usize>(groups: usize, nb: usize) -> Self {
        Self {
            values: vec![0.0; groups * nb * BLOCK_SIZE * R],
            factors: vec![0.0; groups * nb * R],
            nb,
        }
    }

    /// Decode rows `rows` (of `[_, k]` bytes `data` with scales `scale`, `[_, blocks]`), blocks
    /// `blks`; rows past the range and K past `k` are zeros.
    fn pack<const R: usize>(
        &mut self,
        decode: &[f64; 256],
        data: &[u8],
        scale: &[u8],
        k: usize,
        rows: std::ops::Range<usize>,
        blks: std::ops::Range<usize>,
    ) {
        let (blocks, nb) = (mx::num_blocks(k), blks.len());
        self.nb = nb;
        for (g, r0) in rows.clone().step_by(R).enumerate() {
            let values = &mut self.values[g * nb * BLOCK_SIZE * R..][..nb * BLOCK_SIZE * R];
            let factors = &mut self.factors[g * nb * R..][..nb * R];
            for r in 0..R {
                let row = r0 + r;
                if row >= rows.end {
                    for bb in 0..nb {
                        factors[bb * R + r] = 0.0;
                        for kk in 0..BLOCK_SIZE {
                            values[(bb * BLOCK_SIZE + kk) * R + r] = 0.0;
                        }
                    }
                    continue;
                }
                // The row's next blocks stream in while these are used.
                let next = (blks.end * BLOCK_SIZE).min(k);
                super::prefetch(&data[row * k + next..][..(nb * BLOCK_SIZE).min(k - next)]);
                for (bb, b) in blks.clone().enumerate() {
                    factors[bb * R + r] = mx::decode_e8m0_f64(scale[row * blocks + b]);
                    let k0 = b * BLOCK_SIZE;
                    let kb = BLOCK_SIZE.min(k - k0);
                    let src = &data[row * k + k0..][..kb];
                    let dst = &mut values[bb * BLOCK_SIZE * R..][..BLOCK_SIZE * R];
                    if kb == BLOCK_SIZE {
                        let src: &[u8; BLOCK_SIZE] = src.try_into().unwrap_or(&[0; BLOCK_SIZE]);
                        for (d, &q) in dst.chunks_exact_mut(R).zip(src) {
                            d[r] = decode[usize::from(q)];
                        }
                    } else {
                        for (kk, d) in dst.chunks_exact_mut(R).enumerate() {
                            d[r] = src.get(kk).map_or(0.0, |&q| decode[usize::from(q)]);
                        }
                    }
                }
            }
        }
    }

    /// Decode rows `rows` as [`Packed::pack`] does, each block of each row contiguous
    /// (`[R][32]`); with `simd`, full blocks without NaN are decoded eight bytes at a time.
    #[allow(clippy::too_many_arguments)]
    fn pack_rows<const R: usize>(
        &mut self,
        decode: &[f64; 256],
        simd: bool,
        data: &[u8],
        scale: &[u8],
        k: usize,
        rows: std::ops::Range<usize>,
        blks: std::ops::Range<usize>,
    ) {
        let (blocks, nb) = (mx::num_blocks(k), blks.len());
        self.nb = nb;
        for (g, r0) in rows.clone().step_by(R).enumerate() {
            let values = &mut self.values[g * nb * BLOCK_SIZE * R..][..nb * BLOCK_SIZE * R];
            let factors = &mut self.factors[g * nb * R..][..nb * R];
            for r in 0..R {
                let row = r0 + r;
                if row >= rows.end {
                    for bb in 0..nb {
                        factors[bb * R + r] = 0.0;
                        values[(bb * R + r) * BLOCK_SIZE..][..BLOCK_SIZE].fill(0.0);
                    }
                    continue;
                }
                // The row's next blocks stream in while these are used.
                let next = (blks.end * BLOCK_SIZE).min(k);
                super::prefetch(&data[row * k + next..][..(nb * BLOCK_SIZE).min(k - next)]);
                for (bb, b) in blks.clone().enumerate() {
                    factors[bb * R + r] = mx::decode_e8m0_f64(scale[row * blocks + b]);
                    let k0 = b * BLOCK_SIZE;
                    let src = &data[row * k + k0..][..BLOCK_SIZE.min(k - k0)];
                    let dst = &mut values[(bb * R + r) * BLOCK_SIZE..][..BLOCK_SIZE];
                    decode_block(decode, simd, src, dst);
                }
            }
        }
    }

    /// Group `g`'s blocks `from .. from + nb` (of those packed).
    fn group<const R: usize>(&self, g: usize, from: usize, nb: usize) -> Group<'_> {
        let first = g * self.nb + from;
        Group {
            values: &self.values[first * BLOCK_SIZE * R..][..nb * BLOCK_SIZE * R],
            factors: &self.factors[first * R..][..nb * R],
        }
    }
}

/// Whether the weight rows are decoded with AVX2 and F16C.
fn vector_decode() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// One block row of E4M3 bytes (at most 32) into 32 f64 values, zero-padded.
#[inline(always)]
fn decode_block(decode: &[f64; 256], simd: bool, src: &[u8], dst: &mut [f64]) {
    #[cfg(target_arch = "x86_64")]
    if simd {
        if let (Ok(bytes), Ok(out)) =
            (<&[u8; 32]>::try_from(src), <&mut [f64; 32]>::try_from(&mut *dst))
        {
            // SAFETY: the CPU has AVX2 and F16C (`vector_decode`).
            if unsafe { decode_block_f16c(bytes, out) } {
                return;
            }
        }
    }
    let _ = simd;
    for (d, q) in dst.iter_mut().zip(src.iter().map(Some).chain(std::iter::repeat(None))) {
        *d = q.map_or(0.0, |&q| decode[usize::from(q)]);
    }
}

/// A full block of E4M3 bytes into f64, 16 at a time: each byte's sign, exponent and mantissa
/// moved into the fields of an f16 (same mantissa width, exponent bias 15 instead of 7, so the
/// f16 is the value times `2^-8`, subnormals included), converted by the hardware, scaled back
/// by `2^8` (exact). Returns false, having written nothing, when the block holds a NaN byte (the
/// f16 fields would make it a number), for the table to decode.
///
/// # Safety
/// The CPU must support AVX2 and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn decode_block_f16c(src: &[u8; 32], dst: &mut [f64; 32]) -> bool {
    use std::arch::x86_64::*;
    // SAFETY: `src` is 32 bytes, one unaligned 256-bit load.
    let bytes = unsafe { _mm256_loadu_si256(src.as_ptr().cast()) };
    let low7 = _mm256_and_si256(bytes, _mm256_set1_epi8(0x7F));
    if _mm256_movemask_epi8(_mm256_cmpeq_epi8(low7, _mm256_set1_epi8(0x7F))) != 0 {
        return false;
    }
    let scale_back = _mm256_set1_ps(256.0);
    for half in 0..2 {
        let part = if half == 0 {
            _mm256_castsi256_si128(bytes)
        } else {
            _mm256_extracti128_si256::<1>(bytes)
        };
        let x = _mm256_cvtepu8_epi16(part);
        let sign = _mm256_and_si256(_mm256_slli_epi16::<8>(x), _mm256_set1_epi16(0x8000u16 as i16));
        let rest = _mm256_and_si256(_mm256_slli_epi16::<7>(x), _mm256_set1_epi16(0x3F80));
        let h = _mm256_or_si256(sign, rest);
        for (q, lanes) in
            [_mm256_castsi256_si128(h), _mm256_extracti128_si256::<1>(h)].into_iter().enumerate()
        {
            let f = _mm256_mul_ps(_mm256_cvtph_ps(lanes), scale_back);
            let lo = _mm256_cvtps_pd(_mm256_castps256_ps128(f));
            let hi = _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(f));
            let at = half * 16 + q * 8;
            // SAFETY: `at + 8 <= 32`: two unaligned stores of 4 f64 within `dst`.
            unsafe {
                _mm256_storeu_pd(dst.as_mut_ptr().add(at), lo);
                _mm256_storeu_pd(dst.as_mut_ptr().add(at + 4), hi);
            }
        }
    }
    true
}

/// `nb` blocks of an `MR × NR` tile: each block's exact sums, scaled and rounded, added to
/// `tile` (`[MR][NR]` f32) in block order.
fn micro_kernel(nb: usize, a: Group<'_>, w: Group<'_>, tile: &mut [f32; MR * NR]) {
    #[cfg(target_arch = "x86_64")]
    if super::has_avx2_fma() {
        // SAFETY: the CPU has AVX2 and FMA (checked at run time).
        unsafe { micro_kernel_avx2(nb, a, w, tile) };
        return;
    }
    micro_kernel_portable(nb, a, w, tile);
}

/// The definition, lane by lane: the oracle the vector kernel is tested against, and the
/// kernel on CPUs without AVX2/FMA. `tile` is `[NR][MR]` (by column).
fn micro_kernel_portable(nb: usize, a: Group<'_>, w: Group<'_>, tile: &mut [f32; MR * NR]) {
    for b in 0..nb {
        let mut sums = [[0.0f64; MR]; NR];
        for (j, col) in sums.iter_mut().enumerate() {
            let wv = &w.values[(b * NR + j) * BLOCK_SIZE..][..BLOCK_SIZE];
            for (kk, &y) in wv.iter().enumerate() {
                let av = &a.values[(b * BLOCK_SIZE + kk) * MR..][..MR];
                for (s, &x) in col.iter_mut().zip(av) {
                    *s += x * y;
                }
            }
        }
        let (fa, fw) = (&a.factors[b * MR..][..MR], &w.factors[b * NR..][..NR]);
        for (j, col) in sums.iter().enumerate() {
            for (i, &s) in col.iter().enumerate() {
                tile[j * MR + i] += scale_block_sum(s, fa[i], fw[j]);
            }
        }
    }
}

/// [`micro_kernel_portable`] with the 48 block sums of an `8 × 6` tile in twelve AVX registers
/// (two 4-lane f64 vectors of rows per column) and fused multiply-adds, exact like the plain
/// sums.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn micro_kernel_avx2(nb: usize, a: Group<'_>, w: Group<'_>, tile: &mut [f32; MR * NR]) {
    use std::arch::x86_64::*;
    const { assert!(MR == 8 && NR == 6) };
    assert!(a.values.len() >= nb * BLOCK_SIZE * MR && w.values.len() >= nb * BLOCK_SIZE * NR);
    assert!(a.factors.len() >= nb * MR && w.factors.len() >= nb * NR);
    let (ap, wp) = (a.values.as_ptr(), w.values.as_ptr());
    for b in 0..nb {
        let mut s = [[_mm256_setzero_pd(); 2]; NR];
        let wb = b * NR * BLOCK_SIZE;
        for kk in 0..BLOCK_SIZE {
            // SAFETY: `b < nb` and `kk < 32`: the 8 activation values at `(b·32 + kk)·8` and
            // the weight value at `(b·6 + j)·32 + kk` lie within their slices (asserted above).
            unsafe {
                let arow = ap.add((b * BLOCK_SIZE + kk) * MR);
                let (a0, a1) = (_mm256_loadu_pd(arow), _mm256_loadu_pd(arow.add(4)));
                for (j, sj) in s.iter_mut().enumerate() {
                    let y = _mm256_broadcast_sd(&*wp.add(wb + j * BLOCK_SIZE + kk));
                    sj[0] = _mm256_fmadd_pd(a0, y, sj[0]);
                    sj[1] = _mm256_fmadd_pd(a1, y, sj[1]);
                }
            }
        }
        let fa = &a.factors[b * MR..][..MR];
        let fav =
            [_mm256_set_pd(fa[3], fa[2], fa[1], fa[0]), _mm256_set_pd(fa[7], fa[6], fa[5], fa[4])];
        for (j, sj) in s.iter().enumerate() {
            let fw = _mm256_set1_pd(w.factors[b * NR + j]);
            for (q, (&sij, &fai)) in sj.iter().zip(&fav).enumerate() {
                // (sum · a_factor) · w_factor, both exact, then one rounding to f32.
                let term = _mm256_cvtpd_ps(_mm256_mul_pd(_mm256_mul_pd(sij, fai), fw));
                let at = &mut tile[j * MR + 4 * q..][..4];
                // SAFETY: `at` holds 4 f32, the width of the unaligned load and store.
                unsafe {
                    let sum = _mm_add_ps(_mm_loadu_ps(at.as_ptr()), term);
                    _mm_storeu_ps(at.as_mut_ptr(), sum);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kda_testkit::Gen;

    fn random_bytes(rng: &mut Gen, len: usize, nan: bool) -> Vec<u8> {
        (0..len)
            .map(|_| {
                let b = rng.uniform_usize(0, 256) as u8;
                if !nan && mx::is_nan_e4m3(b) { b & 0xF0 } else { b }
            })
            .collect()
    }

    fn scales(rng: &mut Gen, len: usize, nan: bool) -> Vec<u8> {
        (0..len)
            .map(|_| {
                if nan && rng.uniform_usize(0, 50) == 0 {
                    0xFF
                } else {
                    rng.uniform_usize(100, 150) as u8
                }
            })
            .collect()
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| if x.is_nan() { u32::MAX } else { x.to_bits() }).collect()
    }

    /// Every code (extreme ranges inside blocks, NaN), shapes with partial tiles, panels and
    /// blocks, serial and split: bit for bit with the core's definition.
    #[test]
    fn equals_the_definition_bit_for_bit() {
        let mut rng = Gen::new(0x3141);
        let shapes = [
            (1, 1, 1),
            (3, 13, 33),
            (5, 97, 64),
            (9, 25, 300),
            (70, 400, 290),
            (150, 20, 200),
            (8, 6, 256),
            (40, 7, 1000),
        ];
        for (i, &(m, n, k)) in shapes.iter().enumerate() {
            let nan = i % 2 == 1;
            let blocks = mx::num_blocks(k);
            let (a, w) = (random_bytes(&mut rng, m * k, nan), random_bytes(&mut rng, n * k, nan));
            let (sa, sw) = (scales(&mut rng, m * blocks, nan), scales(&mut rng, n * blocks, nan));
            let want = mx::gemm::gemm(&a, &sa, &w, &sw, (m, n, k)).unwrap();
            let ops = Operands { a: &a, a_scale: &sa, w: &w, w_scale: &sw, m, n, k };
            for threads in [1, 2] {
                let got = gemm(&ops, threads, |_, _| {});
                assert_eq!(bits(&got), bits(&want), "[{m}, {n}, {k}] threads {threads}");
            }
        }
    }

    /// The vector decoding of weight blocks against the table, on every byte value.
    #[test]
    fn vector_decode_equals_the_table() {
        let decode = decode_table();
        for first in (0..=255u8).step_by(32) {
            let mut block: [u8; 32] = std::array::from_fn(|i| first.wrapping_add(i as u8));
            for nan in [false, true] {
                if !nan {
                    block.iter_mut().for_each(|b| {
                        if mx::is_nan_e4m3(*b) {
                            *b = 0x80
                        }
                    });
                }
                let (mut fast, mut plain) = ([1.0f64; 32], [2.0f64; 32]);
                decode_block(&decode, vector_decode(), &block, &mut fast);
                decode_block(&decode, false, &block, &mut plain);
                let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&fast), bits(&plain), "bytes from {first:#04x}");
            }
        }
    }

    /// The vector micro-kernel against the plain one on one packed tile.
    #[test]
    fn vector_kernel_equals_the_plain_one() {
        let mut rng = Gen::new(7);
        let nb = 3;
        let decode = decode_table();
        let k = nb * BLOCK_SIZE - 5;
        let (a, w) = (random_bytes(&mut rng, MR * k, true), random_bytes(&mut rng, NR * k, true));
        let (sa, sw) = (scales(&mut rng, MR * nb, true), scales(&mut rng, NR * nb, true));
        let (mut ap, mut wp) = (Packed::new::<MR>(1, nb), Packed::new::<NR>(1, nb));
        ap.pack::<MR>(&decode, &a, &sa, k, 0..MR, 0..nb);
        wp.pack_rows::<NR>(&decode, false, &w, &sw, k, 0..NR, 0..nb);
        let (mut plain, mut fast) = ([0.5f32; MR * NR], [0.5f32; MR * NR]);
        let (ag, wg) = (ap.group::<MR>(0, 0, nb), wp.group::<NR>(0, 0, nb));
        micro_kernel_portable(nb, ag, wg, &mut plain);
        micro_kernel(nb, ag, wg, &mut fast);
        assert_eq!(bits(&plain), bits(&fast));
    }
}
