//! The few-row GEMM on AVX-512 VNNI: each block sum as a 32-bit integer sum of 16-bit operands
//! where the values allow it, the rest of it exactly in f64.
//!
//! Every E4M3 value is a multiple of `2^-9` below `2^9`: exact as a 16-bit integer only once
//! scaled and only if it is not too small. An activation `a` is held as `a · 2^KA`, a weight `w`
//! as `w · 2^KB`, when that is an integer (its *main* part); the others (*small*, and NaN) are
//! held as 0. `KA + KB = 8` keeps any sum of 32 products of 16-bit values below `2^31`
//! (`448 · 2^KA · 448 · 2^KB · 32 < 2^31`), so `vpdpwssd` sums a block's main products exactly
//! into `I`, and the exact block sum is
//!
//! ```text
//! S = I · 2^-8 + Σ_{a small} a·w + Σ_{a main, w small} a·w
//! ```
//!
//! For a vector of 16 rows and one column, the block is *clean* when none of the 16 rows' 32
//! activations and none of the column's 32 weights is small, and its block factor `2^s`
//! (`s = sa + sw - 262`, the `2^-8` folded in) keeps every nonzero `I · 2^s` a normal f32: then
//! rounding `I` to f32 and multiplying by `2^s` (exact) is the one rounding of the definition,
//! and a fused multiply-add folds it into the accumulator. Otherwise `I · 2^-8` and the small
//! products are summed in f64 (exact: a multiple of `2^-18` below `2^23`), scaled by the two
//! factors and rounded once, as the f64 kernels do
//! (`docs/design/mxfp8.md#the-reference-engine-and-what-exactness-costs`).
//!
//! The layout: output columns are the weight rows, taken [`C`] at a time; the 16 lanes of a
//! vector are 16 activation rows. Each weight pair (two K steps) is broadcast to the lanes and
//! multiplied with the rows' activation pairs, interleaved once per call (`[pair][16 rows]`).

use std::arch::x86_64::*;

use kda_core::mx::{self, BLOCK_SIZE};

use super::Operands;

/// Activations are held as `a · 2^KA`: up to `448 · 64 = 28672`, within 16 bits.
const KA: i32 = 6;
/// Weights are held as `w · 2^KB`.
const KB: i32 = 2;
/// Rows per vector of 32-bit sums.
const LANES: usize = 16;
/// K pairs per block.
const PAIRS: usize = BLOCK_SIZE / 2;
/// Output columns per micro-kernel call: with two row groups, 16 independent sums in flight,
/// enough to cover `vpdpwssd`'s latency.
const C: usize = 8;
/// K blocks per step: the step's activation pairs (1 KB per block and 16 rows) stay in the
/// first-level cache while every column of the panel uses them.
const STEP: usize = 8;
/// The f32 exponent field of `2^s` is `sa + sw - 135` (`s + 127`, with `s = sa + sw - 262`).
const BIAS: i32 = 135;
/// The clean path's range of `sa + sw`: `2^s` and `|I| · 2^s < 2^(s + 31)` normal f32.
const SUM_RANGE: std::ops::RangeInclusive<i32> = 136..=358;
/// [`SUM_RANGE`] for [`corrected`]'s sums, in units of `2^-10`: `2^(s - 2)` and `|X| · 2^(s - 2)`
/// normal f32.
const FIX_RANGE: std::ops::RangeInclusive<i32> = 138..=360;

/// Whether this CPU runs the engine (AVX-512 F, BW and VNNI).
pub(super) fn available() -> bool {
    use std::sync::OnceLock;
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vnni")
    })
}

/// An activation byte's main part `a · 2^KA`, or `None` when it is small or NaN.
fn activation_main(byte: u8) -> Option<i16> {
    let v = f64::from(mx::decode_e4m3(byte)) * f64::from(1 << KA);
    (v == v.trunc() && v.abs() <= f64::from(i16::MAX)).then_some(v as i16)
}

/// Small activations of one row group in one block: the K step in the block, and each row's
/// value there times `2^8` (0 where that row's activation is main).
struct Small {
    kk: usize,
    values: [f64; LANES],
    /// The values as `a · 2^10 / 2^KB` (`a · 2^8`) 16-bit integers in half `kk % 2` of each
    /// lane's pair, for [`corrected`] (when every one is an integer: see `Acts::fix_sw`).
    pair: [i32; LANES],
}

/// A small activation's `a · 2^8` when that is an integer (`|a| ≥ 2^-6`, not NaN).
fn activation_fine(byte: u8) -> Option<i16> {
    let v = f64::from(mx::decode_e4m3(byte)) * 256.0;
    (v == v.trunc()).then_some(v as i16)
}

/// A small weight's `w · 2^4` when that is an integer (`|w| ≥ 1/2`, not NaN).
fn weight_fine(byte: u8) -> Option<i16> {
    let v = f64::from(mx::decode_e4m3(byte)) * 16.0;
    (v == v.trunc() && v.abs() <= f64::from(i16::MAX)).then_some(v as i16)
}

/// The activations prepared once per call, by row group of [`LANES`] rows and by block.
pub(super) struct Acts {
    groups: usize,
    blocks: usize,
    /// `[group][block][pair][lane]`: the lane's two main parts, low half first.
    pairs: Vec<i32>,
    /// `[group][block][lane]`: `(sa - BIAS) << 23` (padding rows take the group's smallest).
    exps: Vec<i32>,
    /// `[group][block]`: the weight scales `sw` for which the group's block is clean (no small
    /// activation, `sa + sw` within [`SUM_RANGE`] for every row); empty when none is.
    clean_sw: Vec<(i32, i32)>,
    /// `[group][block][lane]`: `2^(sa - 127 - 8)` (0 for padding rows): the activation factor
    /// with the `2^-8` of `I` ([`dirty`] sums `I · 2^8 S` in f64).
    factors: Vec<f64>,
    /// `[group][block]`: the weight scales for which [`corrected`] may take the group's block:
    /// its small activations all have an integer `a · 2^8`, and `sa + sw` is within
    /// [`FIX_RANGE`] for every row; empty when not.
    fix_sw: Vec<(i32, i32)>,
    /// `[group][block]`: the K steps where one of the group's activations is small.
    small_mask: Vec<u32>,
    /// `[group · blocks + block]`: the range of its entries in `small`.
    small_at: Vec<usize>,
    small: Vec<Small>,
}

impl Acts {
    /// The activations of `ops` (at most a few row groups: the whole call's).
    pub(super) fn new(ops: &Operands<'_>) -> Self {
        let (m, k, blocks) = (ops.m, ops.k, mx::num_blocks(ops.k));
        let groups = m.div_ceil(LANES);
        let mains: [Option<i16>; 256] = std::array::from_fn(|b| activation_main(b as u8));
        let fines: [Option<i16>; 256] = std::array::from_fn(|b| activation_fine(b as u8));
        let mut acts = Acts {
            groups,
            blocks,
            pairs: vec![0; groups * blocks * PAIRS * LANES],
            exps: vec![0; groups * blocks * LANES],
            clean_sw: vec![(1, 0); groups * blocks],
            fix_sw: vec![(1, 0); groups * blocks],
            small_mask: vec![0; groups * blocks],
            factors: vec![0.0; groups * blocks * LANES],
            small_at: vec![0; groups * blocks + 1],
            small: Vec::new(),
        };
        for g in 0..groups {
            let rows = g * LANES..((g + 1) * LANES).min(m);
            for b in 0..blocks {
                let gb = g * blocks + b;
                let scales = rows.clone().map(|r| i32::from(ops.a_scale[r * blocks + b]));
                let lo = scales.clone().min().unwrap_or(127);
                let hi = scales.clone().max().unwrap_or(127);
                let mut at: [Option<usize>; BLOCK_SIZE] = [None; BLOCK_SIZE];
                let mut fixable = true;
                for lane in 0..LANES {
                    let row = rows.start + lane;
                    let sa =
                        if row < rows.end { i32::from(ops.a_scale[row * blocks + b]) } else { lo };
                    acts.exps[gb * LANES + lane] = (sa - BIAS) << 23;
                    if row >= rows.end {
                        continue;
                    }
                    acts.factors[gb * LANES + lane] = mx::decode_e8m0_f64(sa as u8) / 256.0;
                    let k0 = b * BLOCK_SIZE;
                    for (kk, &byte) in
                        ops.a[row * k + k0..][..BLOCK_SIZE.min(k - k0)].iter().enumerate()
                    {
                        let main = match mains[usize::from(byte)] {
                            Some(v) => v,
                            None => {
                                let i = *at[kk].get_or_insert_with(|| {
                                    acts.small.push(Small {
                                        kk,
                                        values: [0.0; LANES],
                                        pair: [0; LANES],
                                    });
                                    acts.small.len() - 1
                                });
                                let entry = &mut acts.small[i];
                                entry.values[lane] = f64::from(mx::decode_e4m3(byte)) * 256.0;
                                let fine = fines[usize::from(byte)];
                                fixable &= fine.is_some();
                                entry.pair[lane] =
                                    ((fine.unwrap_or(0) as u16 as u32) << (16 * (kk % 2))) as i32;
                                acts.small_mask[gb] |= 1 << kk;
                                0
                            }
                        };
                        let pair = &mut acts.pairs[(gb * PAIRS + kk / 2) * LANES + lane];
                        let half = (main as u16 as u32) << (16 * (kk % 2));
                        *pair = (*pair as u32 | half) as i32;
                    }
                }
                acts.small_at[gb + 1] = acts.small.len();
                if hi != i32::from(mx::E8M0_NAN) {
                    if acts.small_at[gb] == acts.small_at[gb + 1] {
                        acts.clean_sw[gb] = (SUM_RANGE.start() - lo, SUM_RANGE.end() - hi);
                    }
                    if fixable {
                        acts.fix_sw[gb] = (FIX_RANGE.start() - lo, FIX_RANGE.end() - hi);
                    }
                }
            }
        }
        acts
    }

    fn small(&self, g: usize, b: usize) -> &[Small] {
        let gb = g * self.blocks + b;
        &self.small[self.small_at[gb]..self.small_at[gb + 1]]
    }
}

/// [`C`] weight rows' blocks of one step, converted: each block's main parts as 16 pairs, which
/// of its values are small (a bit per K step), its bytes (for the small products) and scale.
struct Columns {
    pairs: [[[i32; PAIRS]; STEP]; C],
    small: [[u32; STEP]; C],
    bytes: [[[u8; BLOCK_SIZE]; STEP]; C],
    scales: [[u8; STEP]; C],
    /// The scale where the block has no small value and a scale that is a number, else
    /// `i32::MIN` (outside every clean range).
    clean: [[i32; STEP]; C],
    /// The scale where every small value of the block has an integer `w · 2^4` and the scale
    /// is a number, else `i32::MIN`.
    fix: [[i32; STEP]; C],
}

/// Columns `cols` of the output, `[m, cols.len()]` row-major, for the rows `acts` of `ops`.
pub(super) fn panel(
    ops: &Operands<'_>,
    acts: &Acts,
    decode: &[f64; 256],
    cols: std::ops::Range<usize>,
) -> Vec<f32> {
    assert!(available(), "the int16 engine needs AVX-512 F, BW and VNNI");
    let (m, k, blocks, groups) = (ops.m, ops.k, acts.blocks, acts.groups);
    let width = cols.len();
    let col_groups = width.div_ceil(C);
    // The accumulators, `[col_group][c][group][lane]`.
    let mut acc = vec![0.0f32; col_groups * C * groups * LANES];
    let mut columns = Columns {
        pairs: [[[0; PAIRS]; STEP]; C],
        small: [[0; STEP]; C],
        bytes: [[[0; BLOCK_SIZE]; STEP]; C],
        scales: [[0; STEP]; C],
        clean: [[i32::MIN; STEP]; C],
        fix: [[i32::MIN; STEP]; C],
    };
    let fine: [i16; 256] = std::array::from_fn(|b| weight_fine(b as u8).unwrap_or(0));
    let group_cols = |h: usize| cols.start + h * C..(cols.start + (h + 1) * C).min(cols.end);
    for h in 0..col_groups {
        for b0 in (0..blocks).step_by(STEP) {
            let step = b0..(b0 + STEP).min(blocks);
            // The same rows' next step streams in while this one is used.
            let ahead = step.end..(step.end + STEP).min(blocks);
            super::prefetch_rows(
                ops.w,
                k,
                group_cols(h),
                ahead.start * BLOCK_SIZE..ahead.end * BLOCK_SIZE,
            );
            super::prefetch_rows(ops.w_scale, blocks, group_cols(h), ahead);
            // SAFETY: `available()` (asserted above): the CPU has AVX-512 F, BW and VNNI.
            unsafe { columns.convert(ops, group_cols(h), step.clone()) };
            let tile = &mut acc[h * C * groups * LANES..][..C * groups * LANES];
            let mut g = 0;
            while g < groups {
                // SAFETY: as above.
                g += unsafe {
                    if groups - g >= 2 {
                        columns_step::<2>(acts, g, &columns, step.clone(), (decode, &fine), tile)
                    } else {
                        columns_step::<1>(acts, g, &columns, step.clone(), (decode, &fine), tile)
                    }
                };
            }
        }
    }
    let mut out = vec![0.0f32; m * width];
    for (h, tile) in acc.chunks_exact(C * groups * LANES).enumerate() {
        for (c, column) in tile.chunks_exact(groups * LANES).enumerate() {
            let j = h * C + c;
            if j < width {
                for (row, &v) in column.iter().enumerate().take(m) {
                    out[row * width + j] = v;
                }
            }
        }
    }
    out
}

impl Columns {
    /// Convert weight rows `rows` (at most [`C`]; missing ones are zeros) for blocks `step`.
    ///
    /// # Safety
    /// The CPU must support AVX-512 F and BW.
    #[target_feature(enable = "avx512f,avx512bw")]
    fn convert(
        &mut self,
        ops: &Operands<'_>,
        rows: std::ops::Range<usize>,
        step: std::ops::Range<usize>,
    ) {
        let (k, blocks) = (ops.k, mx::num_blocks(ops.k));
        for c in 0..C {
            let row = rows.start + c;
            for (s, b) in step.clone().enumerate() {
                let bytes = &mut self.bytes[c][s];
                // SAFETY (both arms): 32 bytes, one unaligned load and one store.
                let v = if row < rows.end {
                    let k0 = b * BLOCK_SIZE;
                    let src = &ops.w[row * k + k0..][..BLOCK_SIZE.min(k - k0)];
                    self.scales[c][s] = ops.w_scale[row * blocks + b];
                    if src.len() == BLOCK_SIZE {
                        unsafe { _mm256_loadu_si256(src.as_ptr().cast()) }
                    } else {
                        bytes.fill(0);
                        bytes[..src.len()].copy_from_slice(src);
                        unsafe { _mm256_loadu_si256(bytes.as_ptr().cast()) }
                    }
                } else {
                    self.scales[c][s] = 127;
                    _mm256_setzero_si256()
                };
                unsafe { _mm256_storeu_si256(bytes.as_mut_ptr().cast(), v) };
                let (pairs, small, tiny) = weight_main(v);
                // SAFETY: 16 i32 are 64 bytes, one unaligned store.
                unsafe { _mm512_storeu_si512(self.pairs[c][s].as_mut_ptr().cast(), pairs) };
                self.small[c][s] = small;
                let sw = self.scales[c][s];
                let number = sw != mx::E8M0_NAN;
                self.clean[c][s] = if small == 0 && number { i32::from(sw) } else { i32::MIN };
                self.fix[c][s] = if tiny == 0 && number { i32::from(sw) } else { i32::MIN };
            }
        }
    }
}

/// A weight block's main parts `w · 2^KB` as 32 16-bit values (0 where small or NaN), a mask
/// of its small values (NaN included), and of those without an integer `w · 2^4` (exponent
/// below 6, or NaN). Main: zero, or a biased exponent of at least 8 (`|w| ≥
/// 2`, so `w · 4 = (8 + mantissa) << (exponent - 8)`, an integer up to `1792`).
#[inline(always)]
fn weight_main(bytes: __m256i) -> (__m512i, u32, u32) {
    // SAFETY: the callers run with AVX-512 F and BW enabled.
    unsafe {
        let x = _mm512_cvtepu8_epi16(bytes);
        let mag = _mm512_and_si512(x, _mm512_set1_epi16(0x7F));
        let exp = _mm512_srli_epi16::<3>(mag);
        let mant =
            _mm512_or_si512(_mm512_and_si512(mag, _mm512_set1_epi16(7)), _mm512_set1_epi16(8));
        // A count past 15 (an exponent below 8, wrapped) shifts everything out: 0.
        let value = _mm512_sllv_epi16(mant, _mm512_sub_epi16(exp, _mm512_set1_epi16(8)));
        // Small: 1 ..= 0x3F (exponent below 8, not zero), or NaN (0x7F).
        let below = _mm512_cmplt_epu16_mask(
            _mm512_sub_epi16(mag, _mm512_set1_epi16(1)),
            _mm512_set1_epi16(0x3F),
        );
        let nan = _mm512_cmpeq_epi16_mask(mag, _mm512_set1_epi16(0x7F));
        let tiny = _mm512_cmplt_epu16_mask(
            _mm512_sub_epi16(mag, _mm512_set1_epi16(1)),
            _mm512_set1_epi16(0x2F),
        );
        let value = _mm512_maskz_mov_epi16(!nan, value);
        let negative = _mm512_test_epi16_mask(x, _mm512_set1_epi16(0x80));
        let value = _mm512_mask_sub_epi16(value, negative, _mm512_setzero_si512(), value);
        (value, below | nan, tiny | nan)
    }
}

/// The blocks `step` of the converted columns for row groups `g0 .. g0 + G`, their terms
/// added to `tile` (`[c][group][lane]`); returns `G`.
///
/// # Safety
/// The CPU must support AVX-512 F, BW and VNNI.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
fn columns_step<const G: usize>(
    acts: &Acts,
    g0: usize,
    columns: &Columns,
    step: std::ops::Range<usize>,
    (decode, fine): (&[f64; 256], &[i16; 256]),
    tile: &mut [f32],
) -> usize {
    let groups = acts.groups;
    assert!(g0 + G <= groups && tile.len() >= C * groups * LANES);
    let at = |c: usize, g: usize| (c * groups + g0 + g) * LANES;
    let tile = tile.as_mut_ptr();
    for (s, b) in step.enumerate() {
        let base: [usize; G] =
            std::array::from_fn(|g| ((g0 + g) * acts.blocks + b) * PAIRS * LANES);
        assert!(base[G - 1] + PAIRS * LANES <= acts.pairs.len());
        let mut sums = [[_mm512_setzero_si512(); G]; C];
        for p in 0..PAIRS {
            // SAFETY: pair `p < 16` of block `b` of group `g0 + g` lies within `pairs` (asserted).
            let x: [__m512i; G] = std::array::from_fn(|g| unsafe {
                _mm512_loadu_si512(acts.pairs.as_ptr().add(base[g] + p * LANES).cast())
            });
            for (c, sc) in sums.iter_mut().enumerate() {
                let y = _mm512_set1_epi32(columns.pairs[c][s][p]);
                for (sg, &xg) in sc.iter_mut().zip(&x) {
                    *sg = _mm512_dpwssd_epi32(*sg, xg, y);
                }
            }
        }
        // Which vectors are clean (bit `c · G + g`), without a branch per vector.
        let mut clean = 0u32;
        for c in 0..C {
            let sw = columns.clean[c][s];
            for g in 0..G {
                let (lo, hi) = acts.clean_sw[(g0 + g) * acts.blocks + b];
                clean |= u32::from(lo <= sw && sw <= hi) << (c * G + g);
            }
        }
        // The others first, their terms added to the tile where they lie.
        let mut pending = !clean & ((1 << (C * G)) - 1);
        while pending != 0 {
            let i = pending.trailing_zeros() as usize;
            pending &= pending - 1;
            let (c, g) = (i / G, i % G);
            let gb = (g0 + g) * acts.blocks + b;
            let ((lo, hi), sw) = (acts.fix_sw[gb], columns.fix[c][s]);
            let fixed = (lo <= sw && sw <= hi && acts.small_mask[gb] & columns.small[c][s] == 0)
                .then(|| corrected(acts, (g0 + g, b), sums[c][g], columns, (c, s), fine))
                .flatten();
            // SAFETY: 16 exponents of group `g0 + g`, block `b` within `exps`; the tile's 16
            // accumulators at `at(c, g)` (asserted above).
            unsafe {
                let a = tile.add(at(c, g));
                let acc = _mm512_loadu_ps(a);
                let acc = match fixed {
                    Some(x) => {
                        let exps = _mm512_loadu_si512(acts.exps.as_ptr().add(gb * LANES).cast());
                        let bits = _mm512_add_epi32(exps, _mm512_set1_epi32((sw - 2) << 23));
                        _mm512_fmadd_ps(_mm512_cvtepi32_ps(x), _mm512_castsi512_ps(bits), acc)
                    }
                    None => {
                        let column =
                            (&columns.bytes[c][s], columns.small[c][s], columns.scales[c][s]);
                        dirty(acts, (g0 + g, b), sums[c][g], column, decode, acc)
                    }
                };
                _mm512_storeu_ps(a, acc);
            }
        }
        // The clean ones: `I` rounded to f32 times `2^s` (exact), fused into the accumulator;
        // the others' lanes are masked off (their factor may be anything).
        for (c, sc) in sums.iter().enumerate() {
            let sw = _mm512_set1_epi32(columns.clean[c][s] << 23);
            for (g, &sum) in sc.iter().enumerate() {
                let gb = (g0 + g) * acts.blocks + b;
                let mask = 0u16.wrapping_sub(((clean >> (c * G + g)) & 1) as u16);
                // SAFETY: as above.
                unsafe {
                    let exps = _mm512_loadu_si512(acts.exps.as_ptr().add(gb * LANES).cast());
                    let factor = _mm512_castsi512_ps(_mm512_add_epi32(exps, sw));
                    let a = tile.add(at(c, g));
                    let acc = _mm512_loadu_ps(a);
                    _mm512_storeu_ps(
                        a,
                        _mm512_mask3_fmadd_ps(_mm512_cvtepi32_ps(sum), factor, acc, mask),
                    );
                }
            }
        }
    }
    G
}

/// A block that is not clean but whose small values all have the integer forms `a · 2^8` and
/// `w · 2^4` (and no K step where both are small): `X = 4 I + J` in units of `2^-10`, `J` the
/// small products as 16-bit products (`(a · 2^8)(w · 2^KB)` and `(a · 2^KA)(w · 2^4)`), exact
/// in 32 bits when `|I| < 2^28` (`|J| < 2^25`); `None` when `I` is larger.
///
/// # Safety
/// The CPU must support AVX-512 F and VNNI.
#[target_feature(enable = "avx512f,avx512vnni")]
fn corrected(
    acts: &Acts,
    (g, b): (usize, usize),
    sum: __m512i,
    columns: &Columns,
    (c, s): (usize, usize),
    fine: &[i16; 256],
) -> Option<__m512i> {
    if _mm512_cmpgt_epu32_mask(_mm512_abs_epi32(sum), _mm512_set1_epi32((1 << 28) - 1)) != 0 {
        return None;
    }
    let pairs = &columns.pairs[c][s];
    let mut j = _mm512_setzero_si512();
    for entry in acts.small(g, b) {
        // SAFETY: 16 i32, one unaligned load.
        let x = unsafe { _mm512_loadu_si512(entry.pair.as_ptr().cast()) };
        j = _mm512_dpwssd_epi32(j, x, _mm512_set1_epi32(pairs[entry.kk / 2]));
    }
    let mut bits = columns.small[c][s];
    while bits != 0 {
        let kk = bits.trailing_zeros() as usize;
        bits &= bits - 1;
        let w = fine[usize::from(columns.bytes[c][s][kk])];
        let y = ((w as u16 as u32) << (16 * (kk % 2))) as i32;
        let at = ((g * acts.blocks + b) * PAIRS + kk / 2) * LANES;
        assert!(at + LANES <= acts.pairs.len());
        // SAFETY: 16 pairs within `pairs` (asserted).
        let x = unsafe { _mm512_loadu_si512(acts.pairs.as_ptr().add(at).cast()) };
        j = _mm512_dpwssd_epi32(j, x, _mm512_set1_epi32(y));
    }
    Some(_mm512_add_epi32(_mm512_slli_epi32::<2>(sum), j))
}

/// One block's term for a vector of rows and one column when it is not clean: `I · 2^-8` and
/// the small products summed in f64 (exact), times the two factors, rounded once to f32 and
/// added to `acc`.
///
/// # Safety
/// The CPU must support AVX-512 F.
#[cold]
#[target_feature(enable = "avx512f")]
fn dirty(
    acts: &Acts,
    (g, b): (usize, usize),
    sum: __m512i,
    (bytes, small, scale): (&[u8; BLOCK_SIZE], u32, u8),
    decode: &[f64; 256],
    acc: __m512,
) -> __m512 {
    // `I · 2^8 S`: the main sum as it is, the small products times `2^8`.
    let mut lo = _mm512_cvtepi32_pd(_mm512_castsi512_si256(sum));
    let mut hi = _mm512_cvtepi32_pd(_mm512_extracti64x4_epi64::<1>(sum));
    // Small activations (held times `2^8`) times their weights, whatever those are.
    for entry in acts.small(g, b) {
        let y = _mm512_set1_pd(decode[usize::from(bytes[entry.kk])]);
        // SAFETY: 16 f64, two unaligned loads of 8.
        let (a0, a1) = unsafe {
            (_mm512_loadu_pd(entry.values.as_ptr()), _mm512_loadu_pd(entry.values.as_ptr().add(8)))
        };
        lo = _mm512_fmadd_pd(a0, y, lo);
        hi = _mm512_fmadd_pd(a1, y, hi);
    }
    // Small weights times the main activations (`a · 2^KA`; the small ones are counted above):
    // `a · w · 2^8 = (a · 2^KA) · w · 2^(8 - KA)`.
    let mut bits = small;
    while bits != 0 {
        let kk = bits.trailing_zeros() as usize;
        bits &= bits - 1;
        let y = _mm512_set1_pd(decode[usize::from(bytes[kk])] * f64::from(1 << (8 - KA)));
        let at = ((g * acts.blocks + b) * PAIRS + kk / 2) * LANES;
        assert!(at + LANES <= acts.pairs.len());
        // SAFETY: 16 pairs within `pairs` (asserted).
        let pair = unsafe { _mm512_loadu_si512(acts.pairs.as_ptr().add(at).cast()) };
        let main = if kk % 2 == 0 {
            _mm512_srai_epi32::<16>(_mm512_slli_epi32::<16>(pair))
        } else {
            _mm512_srai_epi32::<16>(pair)
        };
        lo = _mm512_fmadd_pd(_mm512_cvtepi32_pd(_mm512_castsi512_si256(main)), y, lo);
        hi = _mm512_fmadd_pd(_mm512_cvtepi32_pd(_mm512_extracti64x4_epi64::<1>(main)), y, hi);
    }
    let fw = _mm512_set1_pd(mx::decode_e8m0_f64(scale));
    let at = (g * acts.blocks + b) * LANES;
    // SAFETY: 16 factors of group `g`, block `b` within `factors`.
    let (f0, f1) = unsafe {
        (
            _mm512_loadu_pd(acts.factors.as_ptr().add(at)),
            _mm512_loadu_pd(acts.factors.as_ptr().add(at + 8)),
        )
    };
    let t0 = _mm512_cvtpd_ps(_mm512_mul_pd(lo, _mm512_mul_pd(f0, fw)));
    let t1 = _mm512_cvtpd_ps(_mm512_mul_pd(hi, _mm512_mul_pd(f1, fw)));
    let t =
        _mm512_insertf64x4::<1>(_mm512_castpd256_pd512(_mm256_castps_pd(t0)), _mm256_castps_pd(t1));
    _mm512_add_ps(acc, _mm512_castpd_ps(t))
}

pub(super) static COUNTS: [std::sync::atomic::AtomicUsize; 3] =
    [const { std::sync::atomic::AtomicUsize::new(0) }; 3];
