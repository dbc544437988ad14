//! E8M0: an 8-bit biased exponent (bias 127) with no sign and no mantissa. Byte `b` in 0..=254
//! is `2^(b - 127)` (so byte 0 is `2^-127`, not zero); `0xFF` is NaN; there is no zero and no
//! infinity.

/// The NaN scale byte, given to blocks that hold a NaN or an infinity.
pub const E8M0_NAN: u8 = 0xFF;

/// f32 bits of `2^-127`, the value of byte 0 (an f32 subnormal).
const TWO_POW_MINUS_127: u32 = 0x0040_0000;

/// The value of a scale byte as f32 (exact): `2^(b - 127)`, NaN for `0xFF`.
#[inline(always)]
pub fn decode_e8m0(b: u8) -> f32 {
    match b {
        0 => f32::from_bits(TWO_POW_MINUS_127),
        E8M0_NAN => f32::NAN,
        b => f32::from_bits(u32::from(b) << 23),
    }
}

/// The value of a scale byte as f64 (exact): `2^(b - 127)`, NaN for `0xFF`.
#[inline(always)]
pub fn decode_e8m0_f64(b: u8) -> f64 {
    if b == E8M0_NAN { f64::NAN } else { f64::from_bits((u64::from(b) + 1023 - 127) << 52) }
}

/// `2^(127 - b)` as f32, the factor that divides by the scale (`b` at most 254).
#[inline(always)]
pub(crate) fn inverse_scale(b: u8) -> f32 {
    debug_assert!(b != E8M0_NAN);
    if b >= 254 {
        f32::from_bits(TWO_POW_MINUS_127)
    } else {
        f32::from_bits((254 - u32::from(b)) << 23)
    }
}

/// The smallest scale byte whose power of two is at least `|s|` (round up, cuBLAS "RCEIL"),
/// read off the f32 bits of `s`: the exponent field, plus one if the mantissa is non-zero; for a
/// subnormal `s`, byte 1 above `2^-127` (mantissa `0x400000`) and byte 0 up to it. A value above
/// `2^127` rounds up to `0xFF` (NaN), as do infinity and NaN. The sign of `s` is ignored.
#[inline(always)]
pub fn e8m0_round_up(s: f32) -> u8 {
    let bits = s.to_bits() & 0x7FFF_FFFF;
    let (exp, man) = (bits >> 23, bits & 0x7F_FFFF);
    let byte = match exp {
        0 => u32::from(man > TWO_POW_MINUS_127),
        255 => 255,
        exp => exp + u32::from(man != 0),
    };
    // At most 254 + 1: exponent field 254 with a non-zero mantissa rounds up to NaN.
    byte as u8
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decode_is_a_power_of_two_and_ff_is_nan() {
        for b in 0..=254u8 {
            let expected = 2f64.powi(i32::from(b) - 127);
            assert_eq!(decode_e8m0_f64(b), expected, "{b}");
            assert_eq!(f64::from(decode_e8m0(b)), expected, "{b}");
            if b <= 253 {
                assert_eq!(f64::from(inverse_scale(b)), 1.0 / expected, "{b}");
            }
        }
        assert_eq!(f64::from(inverse_scale(254)), 2f64.powi(-127));
        assert!(decode_e8m0(E8M0_NAN).is_nan() && decode_e8m0_f64(E8M0_NAN).is_nan());
    }

    /// The fp32 → E8M0 round-up boundaries of `docs/design/mxfp8.md#round-up-1`, for the value
    /// after the 1/448 multiply.
    #[test]
    fn round_up_boundaries_from_the_spec() {
        let cases: [(u32, u8); 18] = [
            (0x0000_0000, 0),
            (0x0000_0001, 0),
            (0x0040_0000, 0),
            (0x0040_0001, 1),
            (0x007F_FFFF, 1),
            (0x0080_0000, 1),
            (0x1F80_0000, 63),
            (0x1F80_0001, 64),
            (0x3F7F_FFFF, 127),
            (0x3F80_0000, 127),
            (0x3F80_0001, 128),
            (0x5F80_0000, 191),
            (0x5F80_0001, 192),
            (0x7F00_0000, 254),
            (0x7F00_0001, 255),
            (0x7F7F_FFFF, 255),
            (0x7F80_0000, 255),
            (0x7FC0_0000, 255),
        ];
        for (bits, byte) in cases {
            assert_eq!(e8m0_round_up(f32::from_bits(bits)), byte, "{bits:#010x}");
        }
    }

    #[test]
    fn round_up_is_the_ceiling_power_of_two() {
        // An independent formulation: the least q with 2^q >= s, clamped to [-127, 128].
        let ceil_log2 = |s: f64| (-127..=128).find(|&q| 2f64.powi(q) >= s).unwrap_or(128);
        let check = |bits: u32| {
            let s = f32::from_bits(bits);
            let expected = (ceil_log2(f64::from(s)) + 127) as u8;
            assert_eq!(e8m0_round_up(s), expected, "{bits:#010x}");
            assert_eq!(e8m0_round_up(-s), expected, "sign ignored, {bits:#010x}");
        };
        // Every power of two an f32 holds and its neighbours, then a stride across all finites.
        for q in -149..=127i32 {
            let bits = if q >= -126 { ((q + 127) as u32) << 23 } else { 1 << (q + 149) };
            (bits - 1..=bits + 1).for_each(check);
        }
        (0..0x7F80_0000).step_by(99_991).for_each(check);
    }
}
