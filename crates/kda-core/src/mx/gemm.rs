//! The quantized GEMM `y[M, N] = a[M, K] · w[N, K]^T` on E4M3 operands with E8M0 block scales,
//! defined to the bit:
//!
//! ```text
//! y[m, n] = fl32( … fl32( fl32(0 + t_0) + t_1 ) … + t_{B-1} )      blocks b = 0, 1, …, B-1 in order
//! t_b     = fl32( S_b · 2^(sa[m, b] - 127) · 2^(sw[n, b] - 127) )
//! S_b     = Σ_{k in block b} qa[m, k] · qw[n, k]                   (exact)
//! ```
//!
//! The spec's `Σ_blocks (Σ_{k in block} qa·qw) · 2^(sa-127) · 2^(sw-127)` with fp32 accumulation,
//! made exact in the one place the formula leaves open, the block sum
//! (`docs/design/mxfp8.md#the-quantized-gemm`):
//!
//! - Every E4M3 value is a multiple of `2^-9` below `2^9`, so a product is a multiple of `2^-18`
//!   below `2^18` with at most 8 significant bits, and a block sum of up to 32 of them is a
//!   multiple of `2^-18` below `2^23`: 41 bits. It is exact in f64 in *any* order (so a blocked,
//!   vectorised f64 GEMM computes it bit for bit), but not in f32 in general: one `448 · 448` and
//!   one `2^-9 · 2^-9` in the same block need 36 bits. Sequential f32 sums would make the result
//!   depend on the order inside the block; an exact block sum rounded once does not.
//! - Scaling by the two powers of two is exact in f64 (the range stays within `2^±300`), so each
//!   block contributes its exact value rounded once to f32 (overflow to ±infinity, underflow
//!   correctly rounded).
//! - Block terms are added in fp32 in block order, starting from `+0`.
//!
//! A NaN element or a NaN scale (`0xFF`) makes its block term, and so the output, NaN.

use super::e4m3::decode_e4m3;
use super::e8m0::decode_e8m0_f64;
use super::{BLOCK_SIZE, MxError, elements, expect_len, num_blocks};

/// The exact dot product of two E4M3 blocks of equal length (NaN if either holds a NaN).
pub fn block_dot(a: &[u8], w: &[u8]) -> f64 {
    a.iter().zip(w).map(|(&x, &y)| f64::from(decode_e4m3(x)) * f64::from(decode_e4m3(y))).sum()
}

/// A block's contribution `fl32(sum · a_factor · w_factor)`, where the factors are the decoded
/// scales ([`decode_e8m0_f64`]): both products are exact in f64, the conversion rounds once.
#[inline(always)]
pub fn scale_block_sum(sum: f64, a_factor: f64, w_factor: f64) -> f32 {
    ((sum * a_factor) * w_factor) as f32
}

/// A block's contribution from its exact sum and its two scale bytes.
#[inline(always)]
pub fn block_term(sum: f64, a_scale: u8, w_scale: u8) -> f32 {
    scale_block_sum(sum, decode_e8m0_f64(a_scale), decode_e8m0_f64(w_scale))
}

/// One output element from a row of `a` and a row of `w` (K bytes each) and their scale rows
/// (`ceil(K/32)` bytes each).
pub fn gemm_at(a: &[u8], a_scale: &[u8], w: &[u8], w_scale: &[u8]) -> Result<f32, MxError> {
    const WHAT: &str = "mx gemm_at";
    let blocks = num_blocks(a.len());
    expect_len(WHAT, "w", w.len(), a.len())?;
    expect_len(WHAT, "a_scale", a_scale.len(), blocks)?;
    expect_len(WHAT, "w_scale", w_scale.len(), blocks)?;
    let mut acc = 0.0f32;
    for (b, (ab, wb)) in a.chunks(BLOCK_SIZE).zip(w.chunks(BLOCK_SIZE)).enumerate() {
        acc += block_term(block_dot(ab, wb), a_scale[b], w_scale[b]);
    }
    Ok(acc)
}

/// The whole GEMM, `[m, n]` f32 row-major, from plain-layout operands: `a` `[m, k]`, `a_scale`
/// `[m, ceil(k/32)]`, `w` `[n, k]`, `w_scale` `[n, ceil(k/32)]`. Slow and obviously in the
/// defined order: the specification the backends' kernels are checked against.
pub fn gemm(
    a: &[u8],
    a_scale: &[u8],
    w: &[u8],
    w_scale: &[u8],
    (m, n, k): (usize, usize, usize),
) -> Result<Vec<f32>, MxError> {
    const WHAT: &str = "mx gemm";
    let blocks = num_blocks(k);
    expect_len(WHAT, "a", a.len(), elements(WHAT, m, k)?)?;
    expect_len(WHAT, "w", w.len(), elements(WHAT, n, k)?)?;
    expect_len(WHAT, "a_scale", a_scale.len(), elements(WHAT, m, blocks)?)?;
    expect_len(WHAT, "w_scale", w_scale.len(), elements(WHAT, n, blocks)?)?;
    let mut y = Vec::with_capacity(elements(WHAT, m, n)?);
    for i in 0..m {
        let (ar, asr) = (&a[i * k..(i + 1) * k], &a_scale[i * blocks..(i + 1) * blocks]);
        for j in 0..n {
            let (wr, wsr) = (&w[j * k..(j + 1) * k], &w_scale[j * blocks..(j + 1) * blocks]);
            y.push(gemm_at(ar, asr, wr, wsr)?);
        }
    }
    Ok(y)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mx::{E4M3_NAN, E8M0_NAN};

    #[test]
    fn block_sums_are_exact_where_f32_would_not_be() {
        // 448·448 + 2^-9·2^-9: f32 loses the small product, f64 keeps it.
        let (a, w) = ([0x7E, 0x01], [0x7E, 0x01]);
        let exact = 200_704.0 + 2f64.powi(-18);
        assert_eq!(block_dot(&a, &w), exact);
        assert_ne!(f64::from(448.0f32 * 448.0 + 2f32.powi(-18)), exact);
        // Scales 2^1 and 2^-2 multiply the block sum by 2^-1 before the single rounding.
        assert_eq!(block_term(exact, 128, 125), (exact / 2.0) as f32);
    }

    #[test]
    fn small_gemm_by_hand() {
        // a = [[1, 2]], w = [[3, 4], [-1, 0.5]] with scales: a 2^1, w rows 2^0 and 2^-1.
        let one = 0x38;
        let (two, three, four, half) = (0x40, 0x44, 0x48, 0x30);
        let a = [one, two];
        let w = [three, four, 0x80 | one, half];
        let y = gemm(&a, &[128], &w, &[127, 126], (1, 2, 2)).unwrap();
        // Row 0: (3 + 8) · 2 · 1 = 22; row 1: (-1 + 1) · 2 · 0.5 = 0.
        assert_eq!(y, vec![22.0, 0.0]);
    }

    #[test]
    fn blocks_are_scaled_separately_and_summed_in_order() {
        // K = 40: block 0 has 32 elements, block 1 the remaining 8, each with its own scales.
        let k = 40;
        let a = vec![0x38u8; k]; // all 1.0
        let w = vec![0x38u8; k];
        let y = gemm(&a, &[127, 130], &w, &[127, 126], (1, 1, k)).unwrap();
        assert_eq!(y, vec![32.0 + 8.0 * 8.0 * 0.5]);
    }

    #[test]
    fn nan_scales_and_elements_poison_the_output() {
        let a = vec![0x38u8; 64];
        let mut w = vec![0x38u8; 64];
        assert!(gemm(&a, &[127, E8M0_NAN], &w, &[127, 127], (1, 1, 64)).unwrap()[0].is_nan());
        w[40] = E4M3_NAN;
        assert!(gemm(&a, &[127, 127], &w, &[127, 127], (1, 1, 64)).unwrap()[0].is_nan());
        // Huge scales overflow a block term to infinity: defined, not an error.
        let y = gemm(&a[..1], &[254], &w[..1], &[254], (1, 1, 1)).unwrap();
        assert_eq!(y, vec![f32::INFINITY]);
    }

    #[test]
    fn empty_shapes_and_bad_lengths() {
        assert_eq!(gemm(&[], &[], &[], &[], (2, 3, 0)).unwrap(), vec![0.0; 6]);
        assert_eq!(gemm(&[], &[], &[0; 4], &[0; 1], (0, 1, 4)).unwrap(), Vec::<f32>::new());
        let err = gemm(&[0; 4], &[0; 2], &[0; 4], &[0; 1], (1, 1, 4)).unwrap_err();
        assert_eq!(
            err,
            MxError::Length { what: "mx gemm", param: "a_scale", expected: 1, actual: 2 }
        );
        assert!(gemm(&[], &[], &[], &[], (usize::MAX, 2, 1)).is_err());
    }
}
