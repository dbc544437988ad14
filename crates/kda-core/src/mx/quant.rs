//! Block quantization along the last dimension: every [`BLOCK_SIZE`] consecutive elements of a
//! row share one E8M0 scale; a partial last block (K not a multiple of 32) is scaled from its
//! real elements only.
//!
//! For one block with largest magnitude `amax` (in the input's precision):
//!
//! - a NaN or an infinity anywhere: scale byte `0xFF` and every element [`E4M3_NAN`] (`0x7F`);
//! - otherwise scale byte `s` = [`ScaleAlg::scale_byte`]`(amax)` and elements
//!   `q = sat(RNE(x · 2^-(s - 127)))` ([`encode_e4m3`]). The product is exact in f32 whenever it
//!   is a normal number; when it is smaller, its E4M3 rounding is a signed zero either way.
//!
//! Dequantization is `decode_e4m3(q) · 2^(s - 127)`, exact in f64 and correctly rounded in f32
//! (the only rounding is overflow to infinity for scale bytes above 247).

use super::e4m3::{E4M3_MAX_BYTE, E4M3_NAN, decode_e4m3, encode_e4m3, encode_magnitude};
use super::e8m0::{E8M0_NAN, decode_e8m0, decode_e8m0_f64, inverse_scale};
use super::{BLOCK_SIZE, MxError, MxFloat, ScaleAlg, elements, expect_len, num_blocks};

/// A quantized `[rows, k]` matrix in the plain layout: `data` `[rows, k]` E4M3 bytes and `scale`
/// `[rows, ceil(k/32)]` E8M0 bytes, both row-major.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Quantized {
    pub rows: usize,
    pub k: usize,
    pub data: Vec<u8>,
    pub scale: Vec<u8>,
}

impl Quantized {
    /// Scale blocks per row.
    pub fn blocks(&self) -> usize {
        num_blocks(self.k)
    }

    /// The values, rounded to f32 (see [`dequantize`]).
    pub fn dequantize(&self) -> Vec<f32> {
        dequantize_rows(&self.data, &self.scale, self.k, dequantize_value)
    }

    /// The exact values (see [`dequantize_f64`]).
    pub fn dequantize_f64(&self) -> Vec<f64> {
        dequantize_rows(&self.data, &self.scale, self.k, dequantize_value_f64)
    }
}

/// The f32 bits of a block, zero-padded to a full block (zeros change neither `amax` nor the real
/// elements' encodings).
#[inline(always)]
fn block_bits<T: MxFloat>(x: &[T]) -> [u32; BLOCK_SIZE] {
    let mut bits = [0u32; BLOCK_SIZE];
    for (b, v) in bits.iter_mut().zip(x) {
        *b = v.to_f32_bits();
    }
    bits
}

/// Quantize one full or zero-padded block; returns the scale byte.
#[inline(always)]
fn quantize_bits(bits: &[u32; BLOCK_SIZE], alg: ScaleAlg, out: &mut [u8; BLOCK_SIZE]) -> u8 {
    // Magnitudes compare as their bit patterns (an associative integer max, so the reduction
    // vectorises); NaN patterns sort above infinity.
    let amax = bits.iter().fold(0u32, |m, &b| m.max(b & 0x7FFF_FFFF));
    if amax >= 0x7F80_0000 {
        *out = [E4M3_NAN; BLOCK_SIZE];
        return E8M0_NAN;
    }
    let scale = alg.finite_scale_byte(amax);
    let inverse = inverse_scale(scale);
    for (q, &b) in out.iter_mut().zip(bits) {
        let v = (f32::from_bits(b) * inverse).to_bits();
        *q = ((v >> 24) & 0x80) as u8 | encode_magnitude(v & 0x7FFF_FFFF);
    }
    scale
}

/// The lowest magnitude (bf16 bits without sign) that [`encode_bf16_normal`] encodes under scale
/// byte `scale`: the smallest normal bf16 whose scaled value is a normal E4M3 number (E4M3
/// exponent field at least 1, that is bf16 exponent field at least `scale - 6`). Below it only
/// zero takes the 16-bit path.
#[inline(always)]
fn bf16_fast_floor(scale: u8) -> u16 {
    u16::from(scale).saturating_sub(6).max(1) << 7
}

/// [`encode_e4m3`]`(x · 2^-(scale - 127))` for a bf16 `x` with bits `b`, in 16-bit integer
/// arithmetic: valid when the magnitude `b & 0x7FFF` is zero or at least
/// [`bf16_fast_floor`]`(scale)` and finite, and `scale` is at most 254.
///
/// The scaled value is then a normal f32 (so the f32 product is exact) and a normal E4M3 number
/// before rounding: round the 7-bit mantissa to 3 bits, ties to even (a carry bumps the
/// exponent, which is right), rebias the exponent from `field` to `field + 7 - scale`, and
/// saturate everything above `0x7E` (the scaled value is at least 464 exactly then).
#[inline(always)]
fn encode_bf16_normal(b: u16, scale: u8, floor: u16) -> u8 {
    let a = b & 0x7FFF;
    let rounded = a + 7 + ((a >> 4) & 1);
    let rebias = (7 - i16::from(scale)) << 3;
    let normal = ((rounded >> 4) as i16 + rebias).min(i16::from(E4M3_MAX_BYTE));
    let magnitude = if a < floor { 0 } else { normal };
    ((b >> 8) as u8 & 0x80) | magnitude as u8
}

/// Quantize one full or zero-padded block of bf16 bits; returns the scale byte. Bit for bit
/// [`quantize_bits`] of the widened values: sixteen lanes at a time in 16-bit integers, falling
/// back to [`quantize_bits`] for a block with an element whose scaled value is an E4M3 subnormal
/// (or an input subnormal), which random data almost never has.
#[inline(always)]
fn quantize_bits_bf16(x: &[u16; BLOCK_SIZE], alg: ScaleAlg, out: &mut [u8; BLOCK_SIZE]) -> u8 {
    let amax = x.iter().fold(0u16, |m, &b| m.max(b & 0x7FFF));
    if amax >= 0x7F80 {
        *out = [E4M3_NAN; BLOCK_SIZE];
        return E8M0_NAN;
    }
    let scale = alg.finite_scale_byte(u32::from(amax) << 16);
    let floor = bf16_fast_floor(scale);
    // Encode optimistically and count the elements the 16-bit encoder does not cover: non-zero
    // magnitudes below `floor` (zero wraps to the top and never counts).
    let mut slow = 0u8;
    for (q, &b) in out.iter_mut().zip(x) {
        *q = encode_bf16_normal(b, scale, floor);
        slow |= u8::from((b & 0x7FFF).wrapping_sub(1) < floor - 1);
    }
    if slow != 0 {
        return quantize_bits(&x.map(|b| u32::from(b) << 16), alg, out);
    }
    scale
}

/// [`quantize_row_unchecked`] for bf16 bits.
#[inline(always)]
fn quantize_row_bf16(x: &[u16], alg: ScaleAlg, data: &mut [u8], scale: &mut [u8]) {
    let mut out = [0u8; BLOCK_SIZE];
    let full = x.len() / BLOCK_SIZE;
    let (x_full, x_tail) = x.split_at(full * BLOCK_SIZE);
    let (d_full, d_tail) = data.split_at_mut(full * BLOCK_SIZE);
    for ((xb, db), s) in
        x_full.chunks_exact(BLOCK_SIZE).zip(d_full.chunks_exact_mut(BLOCK_SIZE)).zip(&mut *scale)
    {
        // `chunks_exact` blocks always convert; the `else` arms are never taken.
        let Ok(xb) = <&[u16; BLOCK_SIZE]>::try_from(xb) else { continue };
        let Ok(db) = <&mut [u8; BLOCK_SIZE]>::try_from(db) else { continue };
        *s = quantize_bits_bf16(xb, alg, db);
    }
    if !x_tail.is_empty() {
        let mut bits = [0u16; BLOCK_SIZE];
        bits[..x_tail.len()].copy_from_slice(x_tail);
        scale[full] = quantize_bits_bf16(&bits, alg, &mut out);
        d_tail.copy_from_slice(&out[..x_tail.len()]);
    }
}

/// Quantize one row of K elements (no length checks: `data` is as long as `x`, `scale` has
/// `ceil(K/32)` bytes).
#[inline(always)]
fn quantize_row_unchecked<T: MxFloat>(x: &[T], alg: ScaleAlg, data: &mut [u8], scale: &mut [u8]) {
    if let Some(bits) = T::as_bf16_bits(x) {
        // One loop per algorithm, so the scale rule is not chosen again in every block.
        return match alg {
            ScaleAlg::OcpFloor => quantize_row_bf16(bits, ScaleAlg::OcpFloor, data, scale),
            ScaleAlg::RoundUp => quantize_row_bf16(bits, ScaleAlg::RoundUp, data, scale),
        };
    }
    let mut out = [0u8; BLOCK_SIZE];
    let full = x.len() / BLOCK_SIZE;
    let (x_full, x_tail) = x.split_at(full * BLOCK_SIZE);
    let (d_full, d_tail) = data.split_at_mut(full * BLOCK_SIZE);
    for ((xb, db), s) in
        x_full.chunks_exact(BLOCK_SIZE).zip(d_full.chunks_exact_mut(BLOCK_SIZE)).zip(&mut *scale)
    {
        let bits = block_bits(xb);
        *s = quantize_bits(&bits, alg, &mut out);
        db.copy_from_slice(&out);
    }
    if !x_tail.is_empty() {
        let bits = block_bits(x_tail);
        scale[full] = quantize_bits(&bits, alg, &mut out);
        d_tail.copy_from_slice(&out[..x_tail.len()]);
    }
}

/// Quantize one block of at most 32 elements into `data` (as long as `x`); returns its scale
/// byte.
pub fn quantize_block<T: MxFloat>(x: &[T], alg: ScaleAlg, data: &mut [u8]) -> Result<u8, MxError> {
    const WHAT: &str = "quantize_block";
    if x.len() > BLOCK_SIZE {
        return Err(MxError::Length {
            what: WHAT,
            param: "x",
            expected: BLOCK_SIZE,
            actual: x.len(),
        });
    }
    expect_len(WHAT, "data", data.len(), x.len())?;
    let mut out = [0u8; BLOCK_SIZE];
    let scale = quantize_bits(&block_bits(x), alg, &mut out);
    data.copy_from_slice(&out[..x.len()]);
    Ok(scale)
}

/// Encode elements with a given scale byte: `sat(RNE(x · 2^-(scale - 127)))` each, with no
/// block rule (a NaN element is NaN, an infinite one saturates); scale `0xFF` makes every element
/// NaN. For requantizing with a known scale and for tests of the element rounding.
pub fn quantize_block_with_scale<T: MxFloat>(
    x: &[T],
    scale: u8,
    data: &mut [u8],
) -> Result<(), MxError> {
    expect_len("quantize_block_with_scale", "data", data.len(), x.len())?;
    if scale == E8M0_NAN {
        data.fill(E4M3_NAN);
        return Ok(());
    }
    let inverse = inverse_scale(scale);
    for (q, v) in data.iter_mut().zip(x) {
        *q = encode_e4m3(f32::from_bits(v.to_f32_bits()) * inverse);
    }
    Ok(())
}

/// Quantize one row of K elements: `data` K bytes, `scale` `ceil(K/32)` bytes.
pub fn quantize_row<T: MxFloat>(
    x: &[T],
    alg: ScaleAlg,
    data: &mut [u8],
    scale: &mut [u8],
) -> Result<(), MxError> {
    const WHAT: &str = "quantize_row";
    expect_len(WHAT, "data", data.len(), x.len())?;
    expect_len(WHAT, "scale", scale.len(), num_blocks(x.len()))?;
    quantize_row_unchecked(x, alg, data, scale);
    Ok(())
}

/// Quantize whole rows of `k` elements (`x.len()` a multiple of `k`) into plain-layout `data`
/// (as long as `x`) and `scale` (`ceil(k/32)` bytes a row).
pub fn quantize_into<T: MxFloat>(
    x: &[T],
    k: usize,
    alg: ScaleAlg,
    data: &mut [u8],
    scale: &mut [u8],
) -> Result<(), MxError> {
    const WHAT: &str = "quantize_into";
    expect_len(WHAT, "data", data.len(), x.len())?;
    if k == 0 {
        expect_len(WHAT, "scale", scale.len(), 0)?;
        return expect_len(WHAT, "x", x.len(), 0);
    }
    let rows = x.len() / k;
    expect_len(WHAT, "x", x.len(), rows * k)?;
    expect_len(WHAT, "scale", scale.len(), rows * num_blocks(k))?;
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        if let Some(bits) = T::as_bf16_bits(x) {
            // SAFETY: the CPU has AVX2 (checked just above), the only requirement.
            unsafe { quantize_rows_bf16_avx2(bits, k, alg, data, scale) };
            return Ok(());
        }
        // SAFETY: the CPU has AVX2 (checked just above), the only requirement of the function.
        unsafe { quantize_rows_avx2(x, k, alg, data, scale) };
        return Ok(());
    }
    quantize_rows(x, k, alg, data, scale);
    Ok(())
}

/// Whole rows (lengths checked by the caller).
#[inline(always)]
fn quantize_rows<T: MxFloat>(x: &[T], k: usize, alg: ScaleAlg, data: &mut [u8], scale: &mut [u8]) {
    let blocks = num_blocks(k);
    for ((xr, dr), sr) in
        x.chunks_exact(k).zip(data.chunks_exact_mut(k)).zip(scale.chunks_exact_mut(blocks))
    {
        quantize_row_unchecked(xr, alg, dr, sr);
    }
}

/// [`quantize_rows`] compiled for AVX2: the same source, so the same bits (integer operations
/// and IEEE multiplies and adds, which Rust never contracts), eight lanes at a time instead of
/// four.
///
/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn quantize_rows_avx2<T: MxFloat>(
    x: &[T],
    k: usize,
    alg: ScaleAlg,
    data: &mut [u8],
    scale: &mut [u8],
) {
    quantize_rows(x, k, alg, data, scale);
}

/// Whole rows of bf16 bits (lengths checked by the caller): four full blocks at a time in AVX2
/// registers ([`super::quant_avx2::quantize_group`]), a group it gives back and the blocks after
/// the last whole group by [`quantize_bits_bf16`].
///
/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn quantize_rows_bf16_avx2(
    x: &[u16],
    k: usize,
    alg: ScaleAlg,
    data: &mut [u8],
    scale: &mut [u8],
) {
    use super::quant_avx2::{GROUP, GROUP_ELEMENTS, quantize_group};
    let blocks = num_blocks(k);
    let grouped = k / GROUP_ELEMENTS * GROUP_ELEMENTS;
    for ((xr, dr), sr) in
        x.chunks_exact(k).zip(data.chunks_exact_mut(k)).zip(scale.chunks_exact_mut(blocks))
    {
        let (x_groups, x_rest) = xr.split_at(grouped);
        let (d_groups, d_rest) = dr.split_at_mut(grouped);
        let (s_groups, s_rest) = sr.split_at_mut(grouped / BLOCK_SIZE);
        for ((xg, dg), sg) in x_groups
            .chunks_exact(GROUP_ELEMENTS)
            .zip(d_groups.chunks_exact_mut(GROUP_ELEMENTS))
            .zip(s_groups.chunks_exact_mut(GROUP))
        {
            // `chunks_exact` groups always convert; the `else` arms are never taken.
            let Ok(xg) = <&[u16; GROUP_ELEMENTS]>::try_from(xg) else { continue };
            let Ok(dg) = <&mut [u8; GROUP_ELEMENTS]>::try_from(dg) else { continue };
            let Ok(sg) = <&mut [u8; GROUP]>::try_from(sg) else { continue };
            // SAFETY: the CPU has AVX2, this function's own requirement.
            if !unsafe { quantize_group(xg, alg, dg, sg) } {
                quantize_row_bf16(xg, alg, dg, sg);
            }
        }
        quantize_row_bf16(x_rest, alg, d_rest, s_rest);
    }
}

/// Quantize a row-major `[rows, k]` matrix into the plain layout.
pub fn quantize<T: MxFloat>(
    x: &[T],
    rows: usize,
    k: usize,
    alg: ScaleAlg,
) -> Result<Quantized, MxError> {
    const WHAT: &str = "quantize";
    expect_len(WHAT, "x", x.len(), elements(WHAT, rows, k)?)?;
    let mut data = vec![0u8; x.len()];
    let mut scale = vec![0u8; elements(WHAT, rows, num_blocks(k))?];
    quantize_into(x, k, alg, &mut data, &mut scale)?;
    Ok(Quantized { rows, k, data, scale })
}

/// The value of element `q` under scale `s`, rounded to f32: `decode_e4m3(q) · 2^(s - 127)`.
/// The product is exact except for overflow (a finite result above f32's range is infinite);
/// a NaN element or scale gives NaN.
#[inline(always)]
pub fn dequantize_value(q: u8, s: u8) -> f32 {
    decode_e4m3(q) * decode_e8m0(s)
}

/// The exact value of element `q` under scale `s`.
#[inline(always)]
pub fn dequantize_value_f64(q: u8, s: u8) -> f64 {
    f64::from(decode_e4m3(q)) * decode_e8m0_f64(s)
}

/// Dequantize one row: `data` K bytes, `scale` `ceil(K/32)` bytes, into `out` (K values).
pub fn dequantize_row(data: &[u8], scale: &[u8], out: &mut [f32]) -> Result<(), MxError> {
    const WHAT: &str = "dequantize_row";
    expect_len(WHAT, "out", out.len(), data.len())?;
    expect_len(WHAT, "scale", scale.len(), num_blocks(data.len()))?;
    for ((db, ob), &s) in data.chunks(BLOCK_SIZE).zip(out.chunks_mut(BLOCK_SIZE)).zip(scale) {
        let factor = decode_e8m0(s);
        for (o, &q) in ob.iter_mut().zip(db) {
            *o = decode_e4m3(q) * factor;
        }
    }
    Ok(())
}

fn check_dequant(data: &[u8], scale: &[u8], rows: usize, k: usize) -> Result<(), MxError> {
    const WHAT: &str = "dequantize";
    expect_len(WHAT, "data", data.len(), elements(WHAT, rows, k)?)?;
    expect_len(WHAT, "scale", scale.len(), elements(WHAT, rows, num_blocks(k))?)
}

fn dequantize_rows<R: Copy + Default>(
    data: &[u8],
    scale: &[u8],
    k: usize,
    value: impl Fn(u8, u8) -> R,
) -> Vec<R> {
    let mut out = vec![R::default(); data.len()];
    dequantize_rows_into(data, scale, k, &mut out, value);
    out
}

fn dequantize_rows_into<R>(
    data: &[u8],
    scale: &[u8],
    k: usize,
    out: &mut [R],
    value: impl Fn(u8, u8) -> R,
) {
    if k == 0 {
        return;
    }
    for ((dr, or), sr) in
        data.chunks_exact(k).zip(out.chunks_exact_mut(k)).zip(scale.chunks_exact(num_blocks(k)))
    {
        for ((db, ob), &s) in dr.chunks(BLOCK_SIZE).zip(or.chunks_mut(BLOCK_SIZE)).zip(sr) {
            for (o, &q) in ob.iter_mut().zip(db) {
                *o = value(q, s);
            }
        }
    }
}

/// Dequantize whole rows of `k` elements (plain layout: `scale` has `ceil(k/32)` bytes a row)
/// into `out` (as long as `data`), rounded to f32 (see [`dequantize_value`]).
pub fn dequantize_into(
    data: &[u8],
    scale: &[u8],
    k: usize,
    out: &mut [f32],
) -> Result<(), MxError> {
    const WHAT: &str = "dequantize_into";
    expect_len(WHAT, "out", out.len(), data.len())?;
    let rows = data.len().checked_div(k).unwrap_or(0);
    check_dequant(data, scale, rows, k)?;
    dequantize_rows_into(data, scale, k, out, dequantize_value);
    Ok(())
}

/// Dequantize a plain-layout `[rows, k]` matrix to f32 (see [`dequantize_value`]).
pub fn dequantize(data: &[u8], scale: &[u8], rows: usize, k: usize) -> Result<Vec<f32>, MxError> {
    check_dequant(data, scale, rows, k)?;
    Ok(dequantize_rows(data, scale, k, dequantize_value))
}

/// Dequantize a plain-layout `[rows, k]` matrix exactly, to f64.
pub fn dequantize_f64(
    data: &[u8],
    scale: &[u8],
    rows: usize,
    k: usize,
) -> Result<Vec<f64>, MxError> {
    check_dequant(data, scale, rows, k)?;
    Ok(dequantize_rows(data, scale, k, dequantize_value_f64))
}

#[cfg(test)]
mod tests {
    //! The bf16 16-bit path against the f32 path ([`quantize_bits`] and [`encode_e4m3`], which
    //! stay the element codec's definition; `spec_tests` checks those against the format).
    use super::*;
    use crate::mx::e8m0::inverse_scale;
    #[cfg(target_arch = "x86_64")]
    use crate::mx::quant_avx2::{GROUP, GROUP_ELEMENTS, quantize_group};
    use half::bf16;

    /// A small xorshift generator (no dependency).
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }

        /// bf16 bits of a mixed distribution: ordinary magnitudes, wide exponents, the range
        /// where scaled values are E4M3 subnormals, zeros, subnormals, infinities and NaN.
        fn bf16_bits(&mut self, around: u16) -> u16 {
            let r = self.next();
            let sign = ((r >> 63) as u16) << 15;
            let man = (r >> 8) as u16 & 0x7F;
            let magnitude = match r % 64 {
                0 => 0,
                1 => man,
                2 => 0x7F80,
                3 => 0x7F80 | man.max(1),
                4..=15 => (r >> 20) as u16 % 0x7F80,
                16..=27 => (around.saturating_sub((r >> 20) as u16 % 18) << 7) | man,
                _ => (around.saturating_sub((r >> 20) as u16 % 5) << 7) | man,
            };
            sign | magnitude
        }
    }

    /// Every finite bf16 under every finite scale byte: the 16-bit encoder equals `encode_e4m3`
    /// of the f32 product wherever the fast path uses it, and the values it leaves to the f32
    /// path are exactly the input subnormals and the scaled values below 2^-6.
    #[test]
    fn bf16_encoder_matches_encode_e4m3_for_every_bf16_and_scale() {
        for scale in 0..=254u8 {
            let floor = bf16_fast_floor(scale);
            let inverse = inverse_scale(scale);
            for b in 0..=u16::MAX {
                let a = b & 0x7FFF;
                if a >= 0x7F80 {
                    continue;
                }
                let x = f32::from_bits(u32::from(b) << 16);
                let scaled = x * inverse;
                let fast = a == 0 || a >= floor;
                let small = a < 0x80 || scaled.abs() < 2f32.powi(-6);
                assert_eq!(fast, a == 0 || !small, "{b:#06x} scale {scale}: fast-path predicate");
                if fast {
                    assert_eq!(
                        encode_bf16_normal(b, scale, floor),
                        encode_e4m3(scaled),
                        "{b:#06x} scale {scale}"
                    );
                }
            }
        }
    }

    fn check_block(x: &[u16; BLOCK_SIZE], alg: ScaleAlg) {
        let (mut fast, mut oracle) = ([0u8; BLOCK_SIZE], [0u8; BLOCK_SIZE]);
        let s_fast = quantize_bits_bf16(x, alg, &mut fast);
        let s_oracle = quantize_bits(&x.map(|b| u32::from(b) << 16), alg, &mut oracle);
        assert_eq!((s_fast, fast), (s_oracle, oracle), "{alg} {x:04x?}");
    }

    /// Every bf16 value in blocks anchored by maxima across the whole exponent range (so every
    /// value meets scales from 0 to 246 / 254), both algorithms.
    #[test]
    fn every_bf16_in_anchored_blocks_matches_the_f32_path() {
        let anchors: Vec<u16> = (0..=0xFEu16)
            .step_by(3)
            .flat_map(|e| [e << 7, (e << 7) | 0x7F, (e << 7) | 0x40])
            .chain([0x0001, 0x007F, 0x43E0, 0x43E8, 0x43F0, 0x7F7F])
            .collect();
        for alg in ScaleAlg::ALL {
            for &anchor in &anchors {
                for chunk in (0..=u16::MAX).collect::<Vec<_>>().chunks(30) {
                    let mut x = [0u16; BLOCK_SIZE];
                    x[0] = anchor;
                    x[1] = anchor ^ 0x8000;
                    x[2..2 + chunk.len()].copy_from_slice(chunk);
                    check_block(&x, alg);
                }
            }
        }
    }

    /// Random blocks (zeros, subnormals, infinities, NaN, values near the E4M3 subnormal
    /// boundary and the saturation range), block by block and through whole rows of several
    /// lengths (with AVX2: rows of whole four-block groups, groups followed by single blocks
    /// and a partial block, and rows too short for a group), against the f32 path on the
    /// widened values.
    #[test]
    fn random_bf16_blocks_and_rows_match_the_f32_path() {
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
        for alg in ScaleAlg::ALL {
            for _ in 0..200_000 {
                let around = (rng.next() % 255) as u16;
                let x: [u16; BLOCK_SIZE] = std::array::from_fn(|_| rng.bf16_bits(around));
                check_block(&x, alg);
            }
            for k in [1, 5, 31, 32, 33, 64, 100, 128, 160, 293, 7168, 7169] {
                let rows = 3;
                let around = (rng.next() % 255) as u16;
                let bits: Vec<u16> = (0..rows * k).map(|_| rng.bf16_bits(around)).collect();
                let x: Vec<bf16> = bits.iter().map(|&b| bf16::from_bits(b)).collect();
                let wide: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
                let q = quantize(&x, rows, k, alg).unwrap();
                let want = quantize(&wide, rows, k, alg).unwrap();
                assert_eq!(q, want, "k {k} {alg}");
            }
        }
    }

    /// Whether the scalar path would leave block `x` to the f32 path or mark it NaN: a
    /// non-finite element, or a non-zero magnitude below [`bf16_fast_floor`] of its scale.
    #[cfg(target_arch = "x86_64")]
    fn needs_scalar_path(x: &[u16], alg: ScaleAlg) -> bool {
        let amax = x.iter().map(|b| b & 0x7FFF).max().unwrap_or(0);
        if amax >= 0x7F80 {
            return true;
        }
        let floor = bf16_fast_floor(alg.finite_scale_byte(u32::from(amax) << 16));
        x.iter().any(|&b| (1..floor).contains(&(b & 0x7FFF)))
    }

    /// One group through the AVX2 path against [`quantize_bits`] (the f32 definition) block by
    /// block; it must take exactly the groups with no block that needs the scalar path.
    /// Returns whether it took the group.
    #[cfg(target_arch = "x86_64")]
    fn check_group(x: &[u16; GROUP_ELEMENTS], alg: ScaleAlg) -> bool {
        let (mut data, mut scale) = ([0u8; GROUP_ELEMENTS], [0u8; GROUP]);
        // SAFETY: the callers run this only where the CPU has AVX2.
        let took = unsafe { quantize_group(x, alg, &mut data, &mut scale) };
        let blocks = x.chunks_exact(BLOCK_SIZE);
        let covered = !blocks.clone().any(|xb| needs_scalar_path(xb, alg));
        assert_eq!(took, covered, "{alg}: which groups the vector path takes: {x:04x?}");
        if took {
            for (b, xb) in blocks.enumerate() {
                let mut want = [0u8; BLOCK_SIZE];
                let bits: [u32; BLOCK_SIZE] = std::array::from_fn(|i| u32::from(xb[i]) << 16);
                let s = quantize_bits(&bits, alg, &mut want);
                let got = &data[b * BLOCK_SIZE..(b + 1) * BLOCK_SIZE];
                assert_eq!((scale[b], got), (s, &want[..]), "{alg} block {b} of {x:04x?}");
            }
        }
        took
    }

    #[cfg(target_arch = "x86_64")]
    fn has_avx2() -> bool {
        let avx2 = std::arch::is_x86_feature_detected!("avx2");
        if !avx2 {
            eprintln!("no AVX2 on this CPU: the vector quantizer is not used and not tested");
        }
        avx2
    }

    /// Every bf16 value in every position of groups whose four blocks are anchored by maxima
    /// across the whole exponent range, a different one in each block (so the four scales of a
    /// group differ), both algorithms; then every bf16 value with its group's anchors zero to
    /// three octaves above it, which the vector path takes unless a value is non-finite or
    /// subnormal.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_groups_match_the_f32_path_for_every_bf16_in_anchored_blocks() {
        if !has_avx2() {
            return;
        }
        let anchors: Vec<u16> = (0..=0xFEu16)
            .step_by(3)
            .flat_map(|e| [e << 7, (e << 7) | 0x7F, (e << 7) | 0x40])
            .chain([0x0001, 0x007F, 0x43E0, 0x43E8, 0x43F0, 0x7F7F])
            .collect();
        let values: Vec<u16> = (0..=u16::MAX).collect();
        for alg in ScaleAlg::ALL {
            for i in 0..anchors.len() {
                for chunk in values.chunks(GROUP * 30) {
                    let mut x = [0u16; GROUP_ELEMENTS];
                    for (b, (xb, part)) in
                        x.chunks_exact_mut(BLOCK_SIZE).zip(chunk.chunks(30)).enumerate()
                    {
                        let anchor = anchors[(i + 37 * b) % anchors.len()];
                        xb[0] = anchor;
                        xb[1] = anchor ^ 0x8000;
                        xb[2..2 + part.len()].copy_from_slice(part);
                    }
                    check_group(&x, alg);
                }
            }
            let (mut taken, mut groups) = (0usize, 0usize);
            for chunk in values.chunks(30) {
                let top = chunk.iter().map(|b| (b & 0x7FFF) >> 7).max().unwrap_or(0);
                let mut x = [0u16; GROUP_ELEMENTS];
                for (b, xb) in x.chunks_exact_mut(BLOCK_SIZE).enumerate() {
                    let anchor = ((top + b as u16).min(0xFE) << 7) | 0x55;
                    xb[0] = anchor;
                    xb[1] = anchor ^ 0x8000;
                    xb[2..2 + chunk.len()].copy_from_slice(chunk);
                }
                taken += usize::from(check_group(&x, alg));
                groups += 1;
            }
            // Only the chunks with a subnormal, a NaN or an infinity (about 2 % of the
            // patterns) are given back.
            assert!(taken * 100 > groups * 95, "{alg}: the vector path took {taken} of {groups}");
        }
    }

    /// Every bf16 magnitude as the maximum of the first block (the scale rule of both
    /// algorithms for every finite maximum, and the NaN groups), the other blocks random
    /// with their own maxima; ordinary data takes the vector path.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_groups_match_the_f32_path_for_every_block_maximum() {
        if !has_avx2() {
            return;
        }
        let mut rng = Rng(0x2545_F491_4F6C_DD1D);
        for alg in ScaleAlg::ALL {
            let mut taken = 0usize;
            for amax in 0..=0x7FFFu16 {
                let mut x = [0u16; GROUP_ELEMENTS];
                for (b, xb) in x.chunks_exact_mut(BLOCK_SIZE).enumerate() {
                    let top = if b == 0 { amax } else { (rng.next() % 0x7F00) as u16 + 0x80 };
                    for v in xb.iter_mut() {
                        // Within 2^3 of the maximum, so no scaled value is an E4M3 subnormal.
                        let r = rng.next();
                        let m = top.saturating_sub((r % 0x180) as u16).max(top.min(0x80));
                        *v = m | (((r >> 32) as u16) & 0x8000);
                    }
                    xb[(rng.next() % 32) as usize] = top | (amax & 0x8000);
                }
                taken += usize::from(check_group(&x, alg));
            }
            // The 128 non-finite maxima and the subnormal ones go to the scalar path.
            assert!(taken >= 0x7F80 - 0x100, "{alg}: the vector path took {taken} groups");
        }
    }
}
