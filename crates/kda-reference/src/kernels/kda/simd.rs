//! Element-wise helpers written so that LLVM vectorises them (no reductions it would have to
//! reassociate, no library calls in the loops), plus a run-time switch to AVX2/FMA code.
//!
//! Results never depend on the switch: the helpers spell out their association order (eight
//! lanes, combined the same way) and use no fused multiply-add, so the AVX2 build computes the
//! same bits as the baseline one, only wider.

/// `exp(x)` in f32 to within 2 ulp, with no library call, so loops over it vectorise.
///
/// Cody–Waite reduction `x = n·ln2 + r` with `|r| <= ln2/2` and the classic degree-6 polynomial
/// for `e^r` (Cephes' `expf`). Outside the range it is used for it saturates: `x < -87` gives 0
/// (the true value is below 1.7e-38; flushing keeps subnormals, which are slow, out of the GEMM
/// operands), `x > 88` gives +inf (the kernels never pass more than 64). NaN stays NaN.
#[inline(always)]
pub(super) fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // 1.5 · 2^23: adding it rounds to an integer, held in the low mantissa bits.
    const MAGIC: f32 = 12_582_912.0;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const P: [f32; 6] =
        [1.987_569_1e-4, 1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 0.5];
    // NaN passes the clamp and flows through to the result.
    let xc = x.clamp(-87.0, 88.0);
    let shifted = xc * LOG2E + MAGIC;
    let n = shifted.to_bits().wrapping_sub(MAGIC.to_bits()) as i32;
    let z = shifted - MAGIC;
    let r = (xc - z * LN2_HI) - z * LN2_LO;
    let poly = ((((P[0] * r + P[1]) * r + P[2]) * r + P[3]) * r + P[4]) * r + P[5];
    let e_r = poly * (r * r) + r + 1.0;
    // n ∈ [-126, 127] here, so 2^n is a normal f32 and the product stays normal.
    let y = e_r * f32::from_bits(((n + 127) as u32) << 23);
    if x < -87.0 {
        0.0
    } else if x > 88.0 {
        f32::INFINITY
    } else {
        y
    }
}

/// `Σ a[i]·b[i]` in eight interleaved partial sums (a fixed order, so vectorisable).
#[inline(always)]
pub(super) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0.0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut sum = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
    for (x, y) in ra.iter().zip(rb) {
        sum += x * y;
    }
    sum
}

/// `Σ a[i]·b[i]·c[i]`, as [`dot`].
#[inline(always)]
pub(super) fn dot3(a: &[f32], b: &[f32], c: &[f32]) -> f32 {
    let n = a.len().min(b.len()).min(c.len());
    let (a, b, c) = (&a[..n], &b[..n], &c[..n]);
    let mut acc = [0.0f32; 8];
    let (ca, cb, cc) = (a.chunks_exact(8), b.chunks_exact(8), c.chunks_exact(8));
    let (ra, rb, rc) = (ca.remainder(), cb.remainder(), cc.remainder());
    for ((x, y), z) in ca.zip(cb).zip(cc) {
        for l in 0..8 {
            acc[l] += x[l] * y[l] * z[l];
        }
    }
    let mut sum = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
    for ((x, y), z) in ra.iter().zip(rb).zip(rc) {
        sum += x * y * z;
    }
    sum
}

/// `y[i] += alpha · x[i]`.
#[inline(always)]
pub(super) fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
    for (y, &x) in y.iter_mut().zip(x) {
        *y += alpha * x;
    }
}

/// `y -= a[0]·x_0`, then `y -= a[1]·x_1`, and so on (`x_n` is `rows[n·stride..]`, as long as
/// `y`), each step rounded as [`axpy`] with `-a[n]` rounds it and terms with `a[n] == 0` left
/// out: the same bits as that sequence of axpys, with `y` held in registers across the terms,
/// a strip of it at a time, instead of read and written once per term.
#[inline(always)]
pub(super) fn sub_terms(y: &mut [f32], a: &[f32], rows: &[f32], stride: usize) {
    /// Eight AVX2 vectors.
    const STRIP: usize = 64;
    let n = y.len();
    let mut j = 0;
    while j + STRIP <= n {
        let mut acc = [0.0f32; STRIP];
        acc.copy_from_slice(&y[j..j + STRIP]);
        for (t, &a) in a.iter().enumerate() {
            if a != 0.0 {
                let alpha = -a;
                let at = t * stride + j;
                for (acc, &x) in acc.iter_mut().zip(&rows[at..at + STRIP]) {
                    *acc += alpha * x;
                }
            }
        }
        y[j..j + STRIP].copy_from_slice(&acc);
        j += STRIP;
    }
    if j < n {
        for (t, &a) in a.iter().enumerate() {
            if a != 0.0 {
                axpy(-a, &rows[t * stride + j..t * stride + n], &mut y[j..]);
            }
        }
    }
}

pub(super) use crate::kernels::has_avx2_fma;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_within_two_ulp_over_its_range() {
        let mut worst = 0.0f64;
        let mut x = -87.0f32;
        while x <= 88.0 {
            let want = f64::from(x).exp();
            let got = f64::from(exp(x));
            worst = worst.max(((got - want) / want).abs());
            x += 0.000_731;
        }
        // 2 ulp of f32 relative: 2 · 2^-23.
        assert!(worst <= 2.0 * f64::from(f32::EPSILON), "worst relative error {worst:e}");
        for x in [0.0f32, -0.0] {
            assert_eq!(exp(x), 1.0);
        }
    }

    #[test]
    fn exp_saturates_and_propagates_nan() {
        assert_eq!(exp(-87.5), 0.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(-1e30), 0.0);
        assert_eq!(exp(88.5), f32::INFINITY);
        assert_eq!(exp(f32::INFINITY), f32::INFINITY);
        assert!(exp(f32::NAN).is_nan());
        assert!(exp(-87.0) >= f32::MIN_POSITIVE, "no subnormal results");
    }

    /// `sub_terms` against the axpys it stands for, bit for bit: strips and a tail, zero
    /// coefficients skipped (their row holds an infinity, which a product would turn into NaN).
    #[test]
    fn sub_terms_is_its_sequence_of_axpys() {
        for width in [3, 64, 100, 256] {
            let stride = width + 5;
            let terms = 7;
            let mut rows: Vec<f32> =
                (0..terms * stride).map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0).collect();
            let a: Vec<f32> =
                (0..terms).map(|t| if t % 3 == 1 { 0.0 } else { 0.1 + t as f32 * 0.37 }).collect();
            rows[stride + 2] = f32::INFINITY;
            let y0: Vec<f32> = (0..width).map(|i| (i as f32 * 0.73).sin() * 1e3).collect();
            let mut want = y0.clone();
            for (t, &a) in a.iter().enumerate() {
                if a != 0.0 {
                    axpy(-a, &rows[t * stride..t * stride + width], &mut want);
                }
            }
            let mut got = y0;
            sub_terms(&mut got, &a, &rows, stride);
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "width {width}");
            assert!(got.iter().all(|v| v.is_finite()), "width {width}: a skipped term leaked");
        }
    }

    #[test]
    fn dots_match_plain_sums() {
        let a: Vec<f32> = (0..37).map(|i| (i as f32 * 0.37).sin()).collect();
        let b: Vec<f32> = (0..37).map(|i| (i as f32 * 0.11).cos()).collect();
        let c: Vec<f32> = (0..37).map(|i| 1.0 + i as f32 / 64.0).collect();
        let plain: f64 = a.iter().zip(&b).map(|(x, y)| f64::from(*x) * f64::from(*y)).sum();
        assert!((f64::from(dot(&a, &b)) - plain).abs() < 1e-5);
        let plain3: f64 = a
            .iter()
            .zip(&b)
            .zip(&c)
            .map(|((x, y), z)| f64::from(*x) * f64::from(*y) * f64::from(*z))
            .sum();
        assert!((f64::from(dot3(&a, &b, &c)) - plain3).abs() < 1e-5);
        let mut y = vec![1.0f32; 5];
        axpy(2.0, &[1.0, 2.0, 3.0, 4.0, 5.0], &mut y);
        assert_eq!(y, vec![3.0, 5.0, 7.0, 9.0, 11.0]);
    }
}
