//! The bf16 quantizer four blocks at a time in AVX2 registers: the same 16-bit arithmetic as
//! `quant::encode_bf16_normal`, with the four block maxima reduced together and the scale rule
//! computed once for the four, so no value leaves the vector registers between the maximum and
//! the encoding. A group that needs anything else (a NaN or an infinity, an input subnormal, an
//! element whose scaled value is an E4M3 subnormal) is reported back, and the caller quantizes
//! it with the scalar path, which stays the definition.

use std::arch::x86_64::*;

use super::BLOCK_SIZE;
use super::scale::{INV_E4M3_MAX, ScaleAlg};

/// Blocks quantized together.
pub(super) const GROUP: usize = 4;
/// Elements of a group.
pub(super) const GROUP_ELEMENTS: usize = GROUP * BLOCK_SIZE;

/// The scale byte of each lane's block maximum `amax` (bf16 magnitude bits, finite), in 16-bit
/// lanes: [`ScaleAlg::finite_scale_byte`] of `amax << 16`.
///
/// # Safety
/// The CPU must support AVX2.
#[target_feature(enable = "avx2")]
unsafe fn scale_bytes(amax: __m256i, alg: ScaleAlg) -> __m256i {
    match alg {
        // The f32 exponent field of `amax << 16` is `amax >> 7`.
        ScaleAlg::OcpFloor => _mm256_subs_epu16(_mm256_srli_epi16::<7>(amax), _mm256_set1_epi16(8)),
        ScaleAlg::RoundUp => {
            // In 32-bit lanes: the maxima sit in both halves of every lane (the reduction
            // leaves every lane of a block equal), so the high half is the f32 `amax`.
            let wide = _mm256_and_si256(amax, _mm256_set1_epi32(0xFFFF_0000u32 as i32));
            let s = _mm256_mul_ps(_mm256_castsi256_ps(wide), _mm256_set1_ps(INV_E4M3_MAX));
            let bits = _mm256_castps_si256(s);
            // `e8m0_round_up`: the exponent field, plus one for a non-zero mantissa; for a
            // subnormal product, 1 above 2^-127 and 0 up to it. A finite `amax` never reaches
            // exponent field 255 after the 1/448.
            let exp = _mm256_srli_epi32::<23>(bits);
            let man = _mm256_and_si256(bits, _mm256_set1_epi32(0x7F_FFFF));
            let zero = _mm256_setzero_si256();
            let man_zero = _mm256_cmpeq_epi32(man, zero);
            let normal = _mm256_add_epi32(_mm256_add_epi32(exp, _mm256_set1_epi32(1)), man_zero);
            let above_half = _mm256_cmpgt_epi32(man, _mm256_set1_epi32(0x40_0000));
            let subnormal = _mm256_srli_epi32::<31>(above_half);
            let byte = _mm256_blendv_epi8(normal, subnormal, _mm256_cmpeq_epi32(exp, zero));
            _mm256_or_si256(byte, _mm256_slli_epi32::<16>(byte))
        }
    }
}

/// Quantize the four full blocks of `x` (bf16 bits) into `data` and their scale bytes into
/// `scale`, bit for bit as `quant::quantize_bits_bf16` does each one. Returns false when a block
/// holds a NaN, an infinity or an element the 16-bit encoder does not cover; `data` and `scale`
/// then hold nothing meaningful and the caller quantizes the group by the scalar path.
///
/// # Safety
/// The CPU must support AVX2.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn quantize_group(
    x: &[u16; GROUP_ELEMENTS],
    alg: ScaleAlg,
    data: &mut [u8; GROUP_ELEMENTS],
    scale: &mut [u8; GROUP],
) -> bool {
    let magnitude = _mm256_set1_epi16(0x7FFF);
    let mut xs = [[_mm256_setzero_si256(); 2]; GROUP];
    let mut abs = [[_mm256_setzero_si256(); 2]; GROUP];
    for (b, (xb, ab)) in xs.iter_mut().zip(&mut abs).enumerate() {
        for (h, (xv, av)) in xb.iter_mut().zip(ab).enumerate() {
            // SAFETY: 16 u16 at element `32 b + 16 h` of a 128-element array, one unaligned
            // 256-bit load.
            *xv = unsafe { _mm256_loadu_si256(x.as_ptr().add(b * BLOCK_SIZE + h * 16).cast()) };
            *av = _mm256_and_si256(*xv, magnitude);
        }
    }

    // The four maxima: blocks 0 and 1 into the two 128-bit lanes of one vector, 2 and 3 of
    // another, then both into the 64-bit halves of each lane, then down to one value repeated.
    // Magnitudes are at most 0x7FFF, so the unsigned maximum is the bf16 magnitude order.
    let m = abs.map(|[lo, hi]| _mm256_max_epu16(lo, hi));
    let pair = |p: __m256i, q: __m256i| {
        _mm256_max_epu16(
            _mm256_permute2x128_si256::<0x20>(p, q),
            _mm256_permute2x128_si256::<0x31>(p, q),
        )
    };
    let (c01, c23) = (pair(m[0], m[1]), pair(m[2], m[3]));
    let c01 = _mm256_max_epu16(c01, _mm256_shuffle_epi32::<0x4E>(c01));
    let c23 = _mm256_max_epu16(c23, _mm256_shuffle_epi32::<0x4E>(c23));
    // 64-bit lanes: q0 block 0, q1 block 2, q2 block 1, q3 block 3.
    let amax = _mm256_blend_epi32::<0b1100_1100>(c01, c23);
    let amax = _mm256_max_epu16(amax, _mm256_shuffle_epi32::<0xB1>(amax));
    let swap_words = _mm256_setr_epi8(
        2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9,
        14, 15, 12, 13,
    );
    let amax = _mm256_max_epu16(amax, _mm256_shuffle_epi8(amax, swap_words));
    // Magnitudes are at most 0x7FFF, so the signed compare is the unsigned one.
    let non_finite = _mm256_cmpgt_epi16(amax, _mm256_set1_epi16(0x7F7F));

    // SAFETY: this function's own requirement (AVX2).
    let scale16 = unsafe { scale_bytes(amax, alg) };
    // `bf16_fast_floor`, and the rounding bias with the rebias folded in: for an encoded element
    // `(a + 7 + odd + ((7 - scale) << 7)) >> 4` is `((a + 7 + odd) >> 4) + ((7 - scale) << 3)`
    // exactly (the added term is a multiple of 16 and the sum of an element at or above the
    // floor is non-negative and below 2^16).
    let floor = _mm256_slli_epi16::<7>(_mm256_max_epu16(
        _mm256_subs_epu16(scale16, _mm256_set1_epi16(6)),
        _mm256_set1_epi16(1),
    ));
    let seven = _mm256_set1_epi16(7);
    let bias = _mm256_add_epi16(_mm256_slli_epi16::<7>(_mm256_sub_epi16(seven, scale16)), seven);

    let (one, max_byte, sign_bit) =
        (_mm256_set1_epi16(1), _mm256_set1_epi16(0x7E), _mm256_set1_epi16(0x80));
    let mut slow = non_finite;
    for (b, (xb, ab)) in xs.iter().zip(&abs).enumerate() {
        let (floor_b, bias_b) = match b {
            0 => (_mm256_permute4x64_epi64::<0x00>(floor), _mm256_permute4x64_epi64::<0x00>(bias)),
            1 => (_mm256_permute4x64_epi64::<0xAA>(floor), _mm256_permute4x64_epi64::<0xAA>(bias)),
            2 => (_mm256_permute4x64_epi64::<0x55>(floor), _mm256_permute4x64_epi64::<0x55>(bias)),
            _ => (_mm256_permute4x64_epi64::<0xFF>(floor), _mm256_permute4x64_epi64::<0xFF>(bias)),
        };
        let mut out = [_mm256_setzero_si256(); 2];
        for (o, (&xv, &a)) in out.iter_mut().zip(xb.iter().zip(ab)) {
            let odd = _mm256_and_si256(_mm256_srli_epi16::<4>(a), one);
            let rounded = _mm256_add_epi16(_mm256_add_epi16(a, odd), bias_b);
            let normal = _mm256_min_epu16(_mm256_srli_epi16::<4>(rounded), max_byte);
            let below = _mm256_cmpgt_epi16(floor_b, a);
            // A non-zero magnitude below the floor is left to the scalar path.
            slow = _mm256_or_si256(slow, _mm256_and_si256(below, a));
            let sign = _mm256_and_si256(_mm256_srli_epi16::<8>(xv), sign_bit);
            *o = _mm256_or_si256(sign, _mm256_andnot_si256(below, normal));
        }
        // Every 16-bit value is at most 0xFF, so the saturating pack is a plain narrowing; it
        // interleaves the 64-bit quarters, which the permute puts back in order.
        let bytes = _mm256_permute4x64_epi64::<0xD8>(_mm256_packus_epi16(out[0], out[1]));
        // SAFETY: 32 bytes at byte `32 b` of a 128-byte array, one unaligned 256-bit store.
        unsafe { _mm256_storeu_si256(data.as_mut_ptr().add(b * BLOCK_SIZE).cast(), bytes) };
    }
    *scale = [
        _mm256_extract_epi16::<0>(scale16) as u8,
        _mm256_extract_epi16::<8>(scale16) as u8,
        _mm256_extract_epi16::<4>(scale16) as u8,
        _mm256_extract_epi16::<12>(scale16) as u8,
    ];
    _mm256_testz_si256(slow, slow) != 0
}
