//! The codec against `docs/design/mxfp8.md#reference-vectors`: every vector of its table, for both
//! scale algorithms and both input precisions, and exhaustive sweeps against an independent, slow
//! formulation.

use std::sync::OnceLock;

use half::bf16;

use super::*;

/// The canonical form of a data byte for comparisons: both NaN bytes are the same NaN.
fn canonical(b: u8) -> u8 {
    if is_nan_e4m3(b) { E4M3_NAN } else { b }
}

fn canonical_all(bytes: &[u8]) -> Vec<u8> {
    bytes.iter().map(|&b| canonical(b)).collect()
}

/// Quantize one block through every public path (block, row, matrix) and check they agree;
/// returns the scale byte and the data bytes.
fn quantize_all_ways<T: MxFloat>(x: &[T], alg: ScaleAlg) -> (u8, Vec<u8>) {
    let mut data = vec![0u8; x.len()];
    let scale = quantize_block(x, alg, &mut data).unwrap();
    let mut row_data = vec![0u8; x.len()];
    let mut row_scale = [0u8; 1];
    quantize_row(x, alg, &mut row_data, &mut row_scale).unwrap();
    assert_eq!((row_scale[0], &row_data), (scale, &data), "quantize_row disagrees");
    let q = quantize(x, 1, x.len(), alg).unwrap();
    assert_eq!((q.scale[0], &q.data), (scale, &data), "quantize disagrees");
    (scale, data)
}

/// One table row: a block and the expected scale and data bytes per algorithm.
struct Vector {
    case: &'static str,
    block: Vec<f32>,
    /// `[alg 0, alg 1]`: (scale, data bytes, one per element).
    expected: [(u8, Vec<u8>); 2],
}

const NAN_BLOCK: [u8; 32] = [E4M3_NAN; 32];

fn filled(v: f32) -> Vec<f32> {
    vec![v; 32]
}

fn with_first(first: f32, rest: f32) -> Vec<f32> {
    let mut block = vec![rest; 32];
    block[0] = first;
    block
}

fn bytes(first: u8, rest: u8) -> Vec<u8> {
    let mut data = vec![rest; 32];
    data[0] = first;
    data
}

/// The spec's table for an input precision whose largest finite value is `max` and smallest
/// positive subnormal `tiny` (rows that name one precision are added by the callers).
fn table(max: f32, tiny: f32) -> Vec<Vector> {
    let same = |s: u8, d: Vec<u8>| [(s, d.clone()), (s, d)];
    vec![
        Vector { case: "zero", block: filled(0.0), expected: same(0, vec![0x00; 32]) },
        Vector {
            case: "smallest normal",
            block: filled(2f32.powi(-126)),
            expected: same(0, vec![0x40; 32]),
        },
        Vector {
            case: "one Inf, rest 1.0",
            block: with_first(f32::INFINITY, 1.0),
            expected: same(255, NAN_BLOCK.to_vec()),
        },
        Vector {
            case: "one -Inf, rest 1.0",
            block: with_first(f32::NEG_INFINITY, 1.0),
            expected: same(255, NAN_BLOCK.to_vec()),
        },
        Vector {
            case: "one NaN, rest 1.0",
            block: with_first(f32::NAN, 1.0),
            expected: same(255, NAN_BLOCK.to_vec()),
        },
        Vector { case: "fp8 max", block: filled(448.0), expected: same(127, vec![0x7E; 32]) },
        Vector {
            case: "negative fp8 max",
            block: filled(-448.0),
            expected: same(127, vec![0xFE; 32]),
        },
        Vector {
            case: "dtype max",
            block: filled(max),
            expected: [(246, vec![0x7E; 32]), (247, vec![0x78; 32])],
        },
        Vector {
            case: "negative dtype max",
            block: filled(-max),
            expected: [(246, vec![0xFE; 32]), (247, vec![0xF8; 32])],
        },
        Vector {
            case: "underflow",
            block: with_first(tiny, 1.0),
            expected: same(119, bytes(0x00, 0x78)),
        },
        Vector {
            case: "negative underflow",
            block: with_first(-tiny, 1.0),
            expected: same(119, bytes(0x80, 0x78)),
        },
        Vector {
            case: "saturate + underflow",
            block: with_first(max, 1.0),
            expected: [(246, bytes(0x7E, 0x00)), (247, bytes(0x78, 0x00))],
        },
        Vector {
            case: "satfinite",
            block: filled(480.0),
            expected: [(127, vec![0x7E; 32]), (128, vec![0x77; 32])],
        },
        Vector {
            case: "negative satfinite",
            block: filled(-480.0),
            expected: [(127, vec![0xFE; 32]), (128, vec![0xF7; 32])],
        },
    ]
}

/// Rows of the table that exist only in fp32.
fn fp32_only() -> Vec<Vector> {
    vec![
        Vector {
            case: "just above 3.5 (0x40600001)",
            block: filled(f32::from_bits(0x4060_0001)),
            expected: [(120, vec![0x7E; 32]), (121, vec![0x76; 32])],
        },
        Vector {
            case: "just below 512 (0x43FFFFFF)",
            block: filled(f32::from_bits(0x43FF_FFFF)),
            expected: [(127, vec![0x7E; 32]), (128, vec![0x78; 32])],
        },
    ]
}

/// Rows of the table that exist only in bf16 (values exact in bf16).
fn bf16_only() -> Vec<Vector> {
    let ascend = [0.0, 8.0, 64.0, 512.0];
    vec![
        Vector {
            case: "0x43FFFFFF given as bf16 (rounds to 512)",
            block: filled(bf16::from_f32(f32::from_bits(0x43FF_FFFF)).to_f32()),
            expected: [(128, vec![0x78; 32]), (128, vec![0x78; 32])],
        },
        Vector {
            case: "Ascend doc example (0, 8, 64, 512), a block of 4",
            block: ascend.to_vec(),
            expected: [(128, vec![0x00, 0x48, 0x60, 0x78]), (128, vec![0x00, 0x48, 0x60, 0x78])],
        },
        Vector {
            case: "Ascend doc example repeated over 32",
            block: ascend.repeat(8),
            expected: [
                (128, [0x00, 0x48, 0x60, 0x78].repeat(8)),
                (128, [0, 0x48, 0x60, 0x78].repeat(8)),
            ],
        },
    ]
}

fn check_vector<T: MxFloat>(v: &Vector, x: &[T], precision: &str) {
    for alg in ScaleAlg::ALL {
        let (scale, data) = quantize_all_ways(x, alg);
        let (want_scale, want_data) = &v.expected[alg.code() as usize];
        assert_eq!(
            (scale, canonical_all(&data)),
            (*want_scale, want_data.clone()),
            "{} ({precision}, scale_alg {alg})",
            v.case
        );
        // Every element of a NaN block decodes to NaN, whatever the scale.
        if scale == E8M0_NAN {
            assert!(data.iter().all(|&b| is_nan_e4m3(b)));
        }
    }
}

#[test]
fn spec_table_fp32() {
    for v in table(f32::MAX, f32::from_bits(1)).iter().chain(&fp32_only()) {
        check_vector(v, &v.block, "fp32");
    }
}

#[test]
fn spec_table_bf16() {
    let (max, tiny) = (bf16::MAX.to_f32(), bf16::from_bits(1).to_f32());
    assert_eq!(tiny, 2f32.powi(-133));
    for v in table(max, tiny).iter().chain(&bf16_only()) {
        let x: Vec<bf16> = v.block.iter().map(|&f| bf16::from_f32(f)).collect();
        assert!(
            x.iter().zip(&v.block).all(|(b, &f)| b.to_f32().to_bits() == f.to_bits() || f.is_nan()),
            "{}: the vector is exact in bf16",
            v.case
        );
        check_vector(v, &x, "bf16");
    }
}

#[test]
fn the_same_value_differs_between_precisions() {
    // 0x43FFFFFF in fp32 has amax just below 512; as bf16 it is 512 (the spec's example of the
    // maximum being taken in the input's own precision).
    let x32 = filled(f32::from_bits(0x43FF_FFFF));
    let x16: Vec<bf16> = x32.iter().map(|&v| bf16::from_f32(v)).collect();
    assert_eq!(quantize_all_ways(&x32, ScaleAlg::OcpFloor).0, 127);
    assert_eq!(quantize_all_ways(&x16, ScaleAlg::OcpFloor).0, 128);
}

#[test]
fn a_partial_last_block_uses_only_its_real_elements() {
    for alg in ScaleAlg::ALL {
        // K = 33: block 0 holds 32 ones, block 1 the single value 1000 (or a tiny one).
        for last in [1000.0f32, 1e-3, -3.0, 0.0, f32::NAN] {
            let mut x = vec![1.0f32; 33];
            x[32] = last;
            let q = quantize(&x, 1, 33, alg).unwrap();
            let (s0, d0) = quantize_all_ways(&x[..32], alg);
            let (s1, d1) = quantize_all_ways(&x[32..], alg);
            assert_eq!(q.scale, vec![s0, s1], "{alg} {last}");
            assert_eq!(q.data, [d0, d1].concat(), "{alg} {last}");
            assert_eq!(s0, ScaleAlg::scale_byte(alg, 1.0), "the first block ignores the last");
            assert_eq!(s1, ScaleAlg::scale_byte(alg, last.abs()));
        }
    }
    // Zero padding is invisible even to a block of negative values only.
    let x = [-5.0f32, -7.0];
    let (scale, data) = quantize_all_ways(&x, ScaleAlg::OcpFloor);
    assert_eq!(scale, 127 + 2 - 8);
    assert_eq!(data.iter().map(|&b| decode_e4m3(b) * 2f32.powi(2 - 8)).collect::<Vec<_>>(), x);
}

#[test]
fn empty_inputs_and_bad_lengths() {
    for alg in ScaleAlg::ALL {
        let q = quantize::<f32>(&[], 3, 0, alg).unwrap();
        assert_eq!((q.data.len(), q.scale.len(), q.blocks()), (0, 0, 0));
        let q = quantize::<bf16>(&[], 0, 64, alg).unwrap();
        assert!(q.data.is_empty() && q.scale.is_empty());
        let mut data = [];
        assert_eq!(quantize_block::<f32>(&[], alg, &mut data), Ok(0));
        assert!(matches!(
            quantize(&[1.0f32; 5], 2, 3, alg),
            Err(MxError::Length { what: "quantize", param: "x", expected: 6, actual: 5 })
        ));
        assert!(quantize_block(&[1.0f32; 33], alg, &mut [0; 33]).is_err());
        assert!(quantize_block(&[1.0f32; 3], alg, &mut [0; 2]).is_err());
        assert!(quantize_row(&[1.0f32; 40], alg, &mut [0; 40], &mut [0; 1]).is_err());
        assert!(quantize(&[1.0f32; 2], usize::MAX, 2, alg).is_err());
    }
    assert_eq!(dequantize(&[], &[], 4, 0).unwrap(), Vec::<f32>::new());
    assert!(dequantize(&[0; 64], &[0; 1], 1, 64).is_err());
    assert!(dequantize_row(&[0; 4], &[0; 1], &mut [0.0; 3]).is_err());
}

#[test]
fn dequantize_inverts_quantize_up_to_e4m3_rounding() {
    for alg in ScaleAlg::ALL {
        let x: Vec<f32> = (0..200).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.37).collect();
        let q = quantize(&x, 2, 100, alg).unwrap();
        let back = q.dequantize();
        let exact = q.dequantize_f64();
        assert_eq!(back, dequantize(&q.data, &q.scale, 2, 100).unwrap());
        assert_eq!(exact, dequantize_f64(&q.data, &q.scale, 2, 100).unwrap());
        for (i, ((&b, &e), &v)) in back.iter().zip(&exact).zip(&x).enumerate() {
            assert_eq!(f64::from(b), e, "f32 dequantization is exact here");
            // Alg 0 may clip the block maximum by up to 1/8; otherwise half an E4M3 ulp (1/16).
            let scale = decode_e8m0(q.scale[i / 100 * 4 + i % 100 / 32]);
            assert!((b - v).abs() <= v.abs() / 8.0 + scale * 2f32.powi(-10), "{alg} {i}: {v} {b}");
        }
        let mut row = vec![0.0; 100];
        dequantize_row(&q.data[..100], &q.scale[..4], &mut row).unwrap();
        assert_eq!(row, back[..100]);
    }
    // NaN scale or element: NaN. Large scales overflow f32 but not f64.
    assert!(dequantize_value(0x38, E8M0_NAN).is_nan() && dequantize_value(0xFF, 127).is_nan());
    assert_eq!(dequantize_value(0x7E, 254), f32::INFINITY);
    assert_eq!(dequantize_value_f64(0x7E, 254), 448.0 * 2f64.powi(127));
    assert_eq!(dequantize_value(0x01, 0), 2f32.powi(-136));
}

// ---- exhaustive sweeps against an independent formulation ----

/// An E4M3 byte's value from the definition (sign, 4-bit exponent with bias 7, 3-bit mantissa).
fn slow_decode(b: u8) -> f64 {
    let (exp, man) = (i32::from((b >> 3) & 0xF), f64::from(b & 7));
    let magnitude = if exp == 0 { man * 2f64.powi(-9) } else { (8.0 + man) * 2f64.powi(exp - 10) };
    if b & 0x80 != 0 { -magnitude } else { magnitude }
}

/// [`slow_decode`] of bytes 0..=0x7E, computed once.
fn magnitudes() -> &'static [f64] {
    static VALUES: OnceLock<Vec<f64>> = OnceLock::new();
    VALUES.get_or_init(|| (0..=0x7Eu8).map(slow_decode).collect())
}

/// `(p, 2^p)` for p in -160..=128, computed once.
fn powers() -> &'static [(i32, f64)] {
    static POWERS: OnceLock<Vec<(i32, f64)>> = OnceLock::new();
    POWERS.get_or_init(|| (-160..=128).map(|p| (p, 2f64.powi(p))).collect())
}

/// The E4M3 byte nearest to `t` (exact), ties to the even mantissa, saturating beyond ±448:
/// a linear search over all finite non-negative encodings, then the sign of `t`.
fn slow_encode(t: f64) -> u8 {
    if t.is_nan() {
        return E4M3_NAN;
    }
    let sign = if t.is_sign_negative() { 0x80 } else { 0x00 };
    let magnitude = t.abs();
    if magnitude >= 448.0 {
        return sign | 0x7E;
    }
    let values = magnitudes();
    let mut best = 0u8;
    for b in 1..=0x7Eu8 {
        let d = (values[usize::from(b)] - magnitude).abs();
        let d_best = (values[usize::from(best)] - magnitude).abs();
        if d < d_best || (d == d_best && b & 1 == 0) {
            best = b;
        }
    }
    sign | best
}

/// The scale byte for a block maximum `amax` (finite, >= 0), from the algorithms' definitions:
/// alg 0 through the largest power of two not above `amax`, alg 1 through the least power of
/// two not below `amax · fl32(1/448)` (the product taken in f32, as the spec says).
fn slow_scale(amax: f32, alg: ScaleAlg) -> u8 {
    let amax64 = f64::from(amax);
    let exponent = match alg {
        ScaleAlg::OcpFloor => {
            let floor_log2 =
                powers().iter().rev().find(|&&(_, v)| v <= amax64).map_or(-160, |&(p, _)| p);
            (floor_log2 - 8).clamp(-127, 127)
        }
        ScaleAlg::RoundUp => {
            let s = f64::from(amax * (1.0f32 / 448.0));
            let ceil_log2 = powers().iter().find(|&&(p, v)| p >= -127 && v >= s);
            ceil_log2.map_or(128, |&(q, _)| q)
        }
    };
    (exponent + 127) as u8
}

/// The expected bytes of a block by the slow formulation: (scale, data).
fn slow_block(x: &[f64], alg: ScaleAlg) -> (u8, Vec<u8>) {
    if x.iter().any(|v| !v.is_finite()) {
        return (E8M0_NAN, vec![E4M3_NAN; x.len()]);
    }
    let amax = x.iter().fold(0.0f64, |m, v| m.max(v.abs())) as f32;
    let scale = slow_scale(amax, alg);
    let factor = 2f64.powi(127 - i32::from(scale));
    let data = x
        .iter()
        .map(|&v| {
            let t = v * factor;
            if alg == ScaleAlg::RoundUp {
                assert!(t.abs() <= 448.0, "round-up never clips: {v} with scale {scale}");
            }
            slow_encode(t)
        })
        .collect();
    (scale, data)
}

fn all_bf16() -> impl Iterator<Item = bf16> {
    (0..=u16::MAX).map(bf16::from_bits)
}

#[test]
fn slow_formulation_agrees_with_the_table_it_replaces() {
    // The oracle itself, checked on the hand-made vectors before it checks everything else.
    for v in table(f32::MAX, f32::from_bits(1)).iter().chain(&fp32_only()) {
        let x: Vec<f64> = v.block.iter().map(|&f| f64::from(f)).collect();
        for alg in ScaleAlg::ALL {
            let (s, d) = slow_block(&x, alg);
            assert_eq!((s, d), v.expected[alg.code() as usize].clone(), "{} {alg}", v.case);
        }
    }
}

/// Every bf16 value, encoded with a fixed scale: nearest E4M3, ties to even, saturating.
#[test]
fn every_bf16_value_with_a_fixed_scale_rounds_to_the_nearest_e4m3() {
    for scale in [0u8, 1, 100, 119, 127, 128, 200, 246, 247, 254] {
        let factor = 2f64.powi(127 - i32::from(scale));
        for v in all_bf16() {
            let mut q = [0u8];
            quantize_block_with_scale(&[v], scale, &mut q).unwrap();
            let t = v.to_f64() * factor;
            assert_eq!(
                canonical(q[0]),
                slow_encode(t),
                "bf16 {:#06x} with scale {scale}",
                v.to_bits()
            );
        }
    }
    let mut q = [0u8; 2];
    quantize_block_with_scale(&[bf16::ONE, bf16::ZERO], E8M0_NAN, &mut q).unwrap();
    assert_eq!(q, [E4M3_NAN; 2]);
}

/// Every bf16 value in a block anchored by 448 (so the scale stays 2^0 while |v| <= 448, and
/// follows v beyond), and every bf16 value filling a block on its own, for both algorithms.
#[test]
fn every_bf16_value_in_a_block_matches_the_slow_formulation() {
    for alg in ScaleAlg::ALL {
        for v in all_bf16() {
            let anchored = [v, bf16::from_f32(448.0), bf16::from_f32(-1.5), bf16::ZERO];
            let x: Vec<f64> = anchored.iter().map(|b| b.to_f64()).collect();
            let (scale, data) = quantize_all_ways(&anchored, alg);
            assert_eq!((scale, canonical_all(&data)), slow_block(&x, alg), "{:#06x}", v.to_bits());
            if v.to_f64().abs() <= 448.0 {
                assert_eq!(scale, 127, "the anchor fixes the scale");
            }

            let block = [v; BLOCK_SIZE];
            let (scale, data) = quantize_all_ways(&block, alg);
            // A block of one copy has the same maximum and the same element encoding.
            let (want_scale, want_data) = slow_block(&[v.to_f64()], alg);
            let want = (want_scale, vec![want_data[0]; BLOCK_SIZE]);
            assert_eq!((scale, canonical_all(&data)), want, "filled {:#06x} {alg}", v.to_bits());
        }
    }
}

/// f32 inputs: a stride through all 2^32 bit patterns, filling a block, for both algorithms.
#[test]
fn sampled_f32_values_in_a_block_match_the_slow_formulation() {
    for alg in ScaleAlg::ALL {
        for bits in (0..=u32::MAX).step_by(40_009).chain([0x4060_0001, 0x43FF_FFFF, 0x7F7F_FFFF]) {
            let v = f32::from_bits(bits);
            let anchored = [v, 1.0, -0.75, 3e-5];
            let x: Vec<f64> = anchored.iter().map(|&f| f64::from(f)).collect();
            let (scale, data) = quantize_all_ways(&anchored, alg);
            assert_eq!((scale, canonical_all(&data)), slow_block(&x, alg), "{bits:#010x} {alg}");
        }
    }
}
