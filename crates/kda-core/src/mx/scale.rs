//! How a block's E8M0 scale is chosen from its largest magnitude: the `scale_alg` of Ascend's
//! `aclnnDynamicMxQuant`, with its numbering.

use std::fmt;
use std::str::FromStr;

use super::MxError;
use super::e4m3::EMAX_ELEM;
use super::e8m0::{E8M0_NAN, e8m0_round_up};

/// The scale algorithm (`scale_alg`). Kimi K3 on Ascend uses [`ScaleAlg::OcpFloor`].
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum ScaleAlg {
    /// `0`, the OCP MX rule: `e = clamp(floor(log2(amax)) - 8, -127, 127)`. The block maximum can
    /// land in `[448, 512)` after scaling and then saturates to ±448.
    #[default]
    OcpFloor = 0,
    /// `1`, round the scale up (cuBLAS "RCEIL"): the E8M0 round-up of `amax * (1/448)` in fp32,
    /// so no element clips.
    RoundUp = 1,
}

/// `1/448` as the nearest f32, the constant the round-up rule multiplies by (in fp32).
pub(super) const INV_E4M3_MAX: f32 = 1.0 / 448.0;

impl ScaleAlg {
    /// Both algorithms, for exhaustive tests.
    pub const ALL: [ScaleAlg; 2] = [ScaleAlg::OcpFloor, ScaleAlg::RoundUp];

    /// The Ascend `scale_alg` number.
    pub const fn code(self) -> u8 {
        self as u8
    }

    /// A short name for messages and listings.
    pub const fn name(self) -> &'static str {
        match self {
            ScaleAlg::OcpFloor => "ocp-floor",
            ScaleAlg::RoundUp => "round-up",
        }
    }

    /// The scale byte of a block whose largest magnitude is `amax` (a bf16 maximum widened to f32
    /// is the same number). NaN or infinite `amax` gives [`E8M0_NAN`].
    #[inline(always)]
    pub fn scale_byte(self, amax: f32) -> u8 {
        let bits = amax.to_bits() & 0x7FFF_FFFF;
        if bits >= 0x7F80_0000 { E8M0_NAN } else { self.finite_scale_byte(bits) }
    }

    /// [`ScaleAlg::scale_byte`] for the bits of a finite, non-negative `amax`.
    #[inline(always)]
    pub(crate) fn finite_scale_byte(self, amax_bits: u32) -> u8 {
        match self {
            // floor(log2(amax)) is the unbiased exponent field; e + 127 = field - 8, clamped at 0
            // (zero and subnormal maxima have field 0). The upper clamp cannot bind: field <= 254.
            ScaleAlg::OcpFloor => (amax_bits >> 23).saturating_sub(EMAX_ELEM) as u8,
            ScaleAlg::RoundUp => e8m0_round_up(f32::from_bits(amax_bits) * INV_E4M3_MAX),
        }
    }
}

impl TryFrom<u8> for ScaleAlg {
    type Error = MxError;

    fn try_from(code: u8) -> Result<Self, MxError> {
        match code {
            0 => Ok(ScaleAlg::OcpFloor),
            1 => Ok(ScaleAlg::RoundUp),
            other => Err(MxError::UnknownScaleAlg(other.to_string())),
        }
    }
}

impl From<ScaleAlg> for u8 {
    fn from(alg: ScaleAlg) -> u8 {
        alg.code()
    }
}

impl FromStr for ScaleAlg {
    type Err = MxError;

    /// `0`/`1` or the names `ocp-floor`/`round-up`.
    fn from_str(s: &str) -> Result<Self, MxError> {
        match s {
            "ocp-floor" => Ok(ScaleAlg::OcpFloor),
            "round-up" => Ok(ScaleAlg::RoundUp),
            s => match s.parse::<u8>() {
                Ok(code) => ScaleAlg::try_from(code),
                Err(_) => Err(MxError::UnknownScaleAlg(s.to_string())),
            },
        }
    }
}

impl fmt::Display for ScaleAlg {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.code(), self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_others_are_errors() {
        for alg in ScaleAlg::ALL {
            assert_eq!(ScaleAlg::try_from(alg.code()), Ok(alg));
            assert_eq!(alg.name().parse::<ScaleAlg>(), Ok(alg));
            assert_eq!(alg.code().to_string().parse::<ScaleAlg>(), Ok(alg));
        }
        assert_eq!(ScaleAlg::try_from(2), Err(MxError::UnknownScaleAlg("2".into())));
        let message = ScaleAlg::try_from(7).unwrap_err().to_string();
        assert!(message.contains("scale_alg 7") && message.contains("0 (OCP floor)"), "{message}");
        let message = "floor".parse::<ScaleAlg>().unwrap_err().to_string();
        assert!(message.contains("scale_alg floor"), "{message}");
        assert_eq!(ScaleAlg::default(), ScaleAlg::OcpFloor, "Kimi K3's choice");
    }

    #[test]
    fn non_finite_maxima_give_the_nan_scale() {
        for alg in ScaleAlg::ALL {
            for amax in [f32::NAN, f32::INFINITY, -f32::NAN] {
                assert_eq!(alg.scale_byte(amax), E8M0_NAN, "{alg} {amax}");
            }
            assert_eq!(alg.scale_byte(0.0), 0);
        }
    }

    #[test]
    fn inverse_of_448_is_rounded_up_in_f32() {
        // The round-up rule's claim that nothing clips rests on fl(1/448) >= 1/448.
        assert!(f64::from(INV_E4M3_MAX) > 1.0 / 448.0);
    }
}
