//! `float8_e4m3fn`: 1 sign, 4 exponent (bias 7) and 3 mantissa bits; no infinities, NaN is
//! `S.1111.111` (`0x7F`, `0xFF`), the largest finite value is 448 (`0x7E`), subnormals reach
//! down to `2^-9`.
//!
//! Encoding rounds to nearest, ties to even, and is *satfinite*: every finite value beyond the
//! largest finite one, and infinity, becomes ±448 (`cvt.rn.satfinite.e4m3x2.f32` in PTX); NaN
//! stays NaN with its sign. The quantizer never hands an infinity to the element codec (a block
//! with one is NaN as a whole, see [`crate::mx::quant`]).

/// The largest finite E4M3 value.
pub const E4M3_MAX: f32 = 448.0;
/// The byte of +448.
pub const E4M3_MAX_BYTE: u8 = 0x7E;
/// The canonical NaN byte; `0xFF` is NaN too and compares equal in every test.
pub const E4M3_NAN: u8 = 0x7F;
/// `floor(log2(E4M3_MAX))`, the `emax_elem` of the OCP scale rule.
pub const EMAX_ELEM: u32 = 8;

/// f32 bits of 464, the midpoint between 448 and the next step 480 (which is NaN in E4M3fn):
/// from here on, round to nearest would leave the format, so the result saturates. 464 itself
/// rounds to the even 448 either way.
const SATURATE_FROM: u32 = 0x43E8_0000;
/// f32 bits of `2^-6`, the smallest normal E4M3 value.
const SMALLEST_NORMAL: u32 = 0x3C80_0000;
/// `2^14`: its f32 ulp is `2^-9`, the E4M3 subnormal step, so adding it rounds a magnitude below
/// `2^-6` to the subnormal grid in the FPU's round-to-nearest-even.
const SUBNORMAL_GRID: f32 = 16384.0;
const SUBNORMAL_GRID_BITS: u32 = 0x4680_0000;
/// The f32 and E4M3 exponent biases differ by 127 - 7 = 120; in the position of the E4M3
/// exponent field after shifting the f32 bits right by 20.
const REBIAS: u32 = 120 << 3;

/// f32 bits of the value of E4M3 byte `b` (NaN bytes give a quiet NaN with the byte's sign).
const fn decode_bits(b: u8) -> u32 {
    let sign = ((b & 0x80) as u32) << 24;
    let exp = ((b >> 3) & 0xF) as u32;
    let man = (b & 7) as u32;
    if exp == 15 && man == 7 {
        return sign | 0x7FC0_0000;
    }
    if exp == 0 {
        if man == 0 {
            return sign;
        }
        // man · 2^-9, normalised: the leading one of `man` becomes the implicit bit.
        let lead = 31 - man.leading_zeros();
        let frac = (man & !(1 << lead)) << (23 - lead);
        return sign | ((lead + 127 - 9) << 23) | frac;
    }
    sign | ((exp + 120) << 23) | (man << 20)
}

const fn decode_table() -> [u32; 256] {
    let mut table = [0; 256];
    let mut b = 0;
    while b < 256 {
        table[b] = decode_bits(b as u8);
        b += 1;
    }
    table
}

/// Every byte's value as f32 bits (all exact: E4M3 values have at most 4 significant bits).
static DECODE: [u32; 256] = decode_table();

/// The value of an E4M3 byte (exact). `0x7F` and `0xFF` are NaN.
#[inline(always)]
pub fn decode_e4m3(b: u8) -> f32 {
    f32::from_bits(DECODE[b as usize])
}

/// Whether `b` is one of the two NaN bytes.
#[inline(always)]
pub const fn is_nan_e4m3(b: u8) -> bool {
    b & 0x7F == 0x7F
}

/// Round `x` to E4M3: nearest, ties to even; beyond ±448 (and ±infinity) saturate to ±448; NaN
/// stays NaN (`0x7F` or `0xFF`, by sign). The sign of zero is kept (`-0.0` is `0x80`).
#[inline(always)]
pub fn encode_e4m3(x: f32) -> u8 {
    let bits = x.to_bits();
    let abs = bits & 0x7FFF_FFFF;
    let sign = ((bits >> 24) & 0x80) as u8;
    if abs > 0x7F80_0000 {
        return sign | E4M3_NAN;
    }
    sign | encode_magnitude(abs)
}

/// The E4M3 magnitude byte (0..=0x7E) of the non-NaN f32 whose bits without sign are `abs`.
///
/// Written without branches (both roundings are computed and one is selected), so loops over a
/// block vectorise.
#[inline(always)]
pub(crate) fn encode_magnitude(abs: u32) -> u8 {
    // Normal range: round the 23-bit mantissa to 3 bits, ties to even (the carry may bump the
    // exponent, which is exactly right), then rebias the exponent.
    let rounded = abs + 0x7_FFFF + ((abs >> 20) & 1);
    let normal = (rounded >> 20).wrapping_sub(REBIAS);
    // Subnormal range: the FPU rounds onto the 2^-9 grid; the count of steps is the byte, and 8
    // steps is 0x08, the smallest normal, which is also right.
    let grid = (f32::from_bits(abs) + SUBNORMAL_GRID).to_bits().wrapping_sub(SUBNORMAL_GRID_BITS);
    // `abs` has no sign bit, so signed compares agree with unsigned ones; x86 has only the
    // signed vector compare.
    let signed = abs as i32;
    let magnitude = if signed < SMALLEST_NORMAL as i32 { grid } else { normal };
    let magnitude =
        if signed >= SATURATE_FROM as i32 { u32::from(E4M3_MAX_BYTE) } else { magnitude };
    magnitude as u8
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The value of a byte from the format's definition, in f64 (independent of the table).
    fn by_definition(b: u8) -> f64 {
        let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
        let (exp, man) = (i32::from((b >> 3) & 0xF), f64::from(b & 7));
        if exp == 15 && man == 7.0 {
            f64::NAN
        } else if exp == 0 {
            sign * man / 8.0 * 2f64.powi(-6)
        } else {
            sign * (1.0 + man / 8.0) * 2f64.powi(exp - 7)
        }
    }

    #[test]
    fn every_byte_decodes_as_defined_and_re_encodes_to_itself() {
        for b in 0..=255u8 {
            let value = decode_e4m3(b);
            let defined = by_definition(b);
            if defined.is_nan() {
                assert!(value.is_nan() && is_nan_e4m3(b), "{b:#04x}");
                assert!(is_nan_e4m3(encode_e4m3(value)), "{b:#04x}: NaN must encode to NaN");
                assert_eq!(value.is_sign_negative(), b & 0x80 != 0, "{b:#04x}: NaN sign");
                continue;
            }
            assert!(!is_nan_e4m3(b));
            assert_eq!(f64::from(value), defined, "{b:#04x}");
            assert_eq!(value.is_sign_negative(), b & 0x80 != 0, "{b:#04x}: sign (incl. -0)");
            assert_eq!(encode_e4m3(value), b, "{b:#04x} = {value}");
        }
        assert_eq!(decode_e4m3(E4M3_MAX_BYTE), E4M3_MAX);
        assert_eq!(decode_e4m3(0x01), 2f32.powi(-9));
        assert_eq!(decode_e4m3(0x08), 2f32.powi(-6));
        assert!(decode_e4m3(0xFF).is_nan() && decode_e4m3(E4M3_NAN).is_nan());
    }

    #[test]
    fn rounding_is_to_nearest_even_in_both_ranges() {
        // Normal range: 1.0 (0x38) and 1.125 (0x39); 1.0625 is the tie and goes to the even 1.0;
        // 1.1875 is the tie between 1.125 and 1.25 (0x3A) and goes to the even 1.25.
        assert_eq!(encode_e4m3(1.0625), 0x38);
        assert_eq!(encode_e4m3(f32::from_bits(1.0625f32.to_bits() + 1)), 0x39);
        assert_eq!(encode_e4m3(1.1875), 0x3A);
        // Carry into the exponent: 1.9375 is the tie between 1.875 (0x3F) and 2.0 (0x40).
        assert_eq!(encode_e4m3(1.9375), 0x40);
        // Subnormal grid 2^-9: 1.5 steps is a tie to 2 steps, 2.5 steps to 2 steps.
        let step = 2f32.powi(-9);
        assert_eq!(encode_e4m3(1.5 * step), 0x02);
        assert_eq!(encode_e4m3(2.5 * step), 0x02);
        assert_eq!(encode_e4m3(0.5 * step), 0x00, "half the smallest subnormal ties to zero");
        assert_eq!(encode_e4m3(f32::from_bits((0.5 * step).to_bits() + 1)), 0x01);
        assert_eq!(encode_e4m3(-0.25 * step), 0x80, "underflow keeps the sign");
        // Just below the smallest normal rounds up into it.
        assert_eq!(encode_e4m3(7.5 * step), 0x08);
        assert_eq!(encode_e4m3(f32::from_bits(1)), 0x00);
    }

    #[test]
    fn saturation_and_special_values() {
        assert_eq!(encode_e4m3(448.0), 0x7E);
        assert_eq!(encode_e4m3(463.99), 0x7E);
        assert_eq!(encode_e4m3(464.0), 0x7E, "the tie rounds to the even 448");
        assert_eq!(encode_e4m3(470.0), 0x7E, "would round to 480 (NaN): saturates");
        assert_eq!(encode_e4m3(-1e30), 0xFE);
        assert_eq!(encode_e4m3(f32::MAX), 0x7E);
        assert_eq!(encode_e4m3(f32::INFINITY), 0x7E);
        assert_eq!(encode_e4m3(f32::NEG_INFINITY), 0xFE);
        assert_eq!(encode_e4m3(f32::NAN), 0x7F);
        assert_eq!(encode_e4m3(-f32::NAN), 0xFF);
        assert_eq!(encode_e4m3(0.0), 0x00);
        assert_eq!(encode_e4m3(-0.0), 0x80);
    }
}
