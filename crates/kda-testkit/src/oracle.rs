//! Slow, obviously-correct f64 formulations that the reference and the backends are checked against.
//!
//! Plain loops in f64 on purpose: the error they add is far below every tolerance in
//! [`crate::tolerance`] (see [`dot_abs_bound`]), and code this simple can be checked by reading it.

/// `y[m, n] = Σ_k x[m, k] · w[n, k]`, all row-major: the Linear layout, where `w` is `[N, K]`.
///
/// # Panics
///
/// When `x` is not `m * k` long or `w` is not `n * k` long.
pub fn gemm_f64(m: usize, n: usize, k: usize, x: &[f64], w: &[f64]) -> Vec<f64> {
    assert_eq!(x.len(), m * k, "gemm_f64: x must be [m={m}, k={k}]");
    assert_eq!(w.len(), n * k, "gemm_f64: w must be [n={n}, k={k}]");
    let mut y = Vec::with_capacity(m * n);
    for i in 0..m {
        let x_row = &x[i * k..(i + 1) * k];
        for j in 0..n {
            y.push(gemm_f64_at(k, x_row, &w[j * k..(j + 1) * k]));
        }
    }
    y
}

/// One entry of [`gemm_f64`]: the dot product of a row of `x` with a row of `w`.
///
/// GEMMs too large for the full oracle are checked at sampled `(m, n)` entries with this.
///
/// # Panics
///
/// When either row is not `k` long.
pub fn gemm_f64_at(k: usize, x_row: &[f64], w_row: &[f64]) -> f64 {
    assert_eq!(x_row.len(), k, "gemm_f64_at: x row must have k={k} elements");
    assert_eq!(w_row.len(), k, "gemm_f64_at: w row must have k={k} elements");
    x_row.iter().zip(w_row).map(|(a, b)| a * b).sum()
}

/// The worst-case forward error of a `k`-term dot product accumulated in a format with unit
/// roundoff `u` (2^-24 for f32, 2^-8 for bf16, 2^-53 for f64): `γ_k · Σ|x_i·w_i|` with
/// `γ_k = k·u / (1 - k·u)`.
///
/// `sum_abs_products` is `Σ|x_i·w_i|`, computed by the caller (in f64) from the same inputs. The
/// bound holds for any summation order, so it covers blocked and split-K kernels too. When
/// `k·u >= 1` no bound follows from this argument and the result is infinite.
pub fn dot_abs_bound(k: usize, sum_abs_products: f64, unit_roundoff: f64) -> f64 {
    let ku = k as f64 * unit_roundoff;
    if ku >= 1.0 {
        return f64::INFINITY;
    }
    ku / (1.0 - ku) * sum_abs_products
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::Gen;

    #[test]
    fn gemm_small_by_hand() {
        // x = [[1, 2, 3], [4, 5, 6]], w = [[7, 8, 9], [10, 11, 12]] (rows are outputs).
        let x = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let w = [7.0, 8.0, 9.0, 10.0, 11.0, 12.0];
        // Reading w as [K, N] instead would give 58 for the first entry.
        assert_eq!(gemm_f64(2, 2, 3, &x, &w), vec![50.0, 68.0, 122.0, 167.0]);
    }

    #[test]
    fn gemm_rectangular_by_hand() {
        // m = 1, n = 3, k = 2: one input row against three output rows.
        let x = [2.0, -1.0];
        let w = [1.0, 1.0, 0.5, 4.0, -3.0, 0.0];
        assert_eq!(gemm_f64(1, 3, 2, &x, &w), vec![1.0, -3.0, -6.0]);
        // m = 3, n = 1: three input rows against one output row.
        let x = [1.0, 0.0, 0.0, 1.0, 2.0, 3.0];
        let w = [5.0, 7.0];
        assert_eq!(gemm_f64(3, 1, 2, &x, &w), vec![5.0, 7.0, 31.0]);
    }

    #[test]
    fn gemm_with_empty_k_is_zero() {
        assert_eq!(gemm_f64(2, 3, 0, &[], &[]), vec![0.0; 6]);
        assert_eq!(gemm_f64(0, 3, 4, &[], &[1.0; 12]), Vec::<f64>::new());
    }

    #[test]
    #[should_panic(expected = "w must be [n=2, k=3]")]
    fn gemm_rejects_wrong_lengths() {
        gemm_f64(1, 2, 3, &[0.0; 3], &[0.0; 5]);
    }

    #[test]
    fn sampled_entries_agree_with_the_full_gemm() {
        let (m, n, k) = (5, 7, 33);
        let mut g = Gen::new(1);
        let x = g.uniform_f64(m * k, -1.0, 1.0);
        let w = g.uniform_f64(n * k, -1.0, 1.0);
        let y = gemm_f64(m, n, k, &x, &w);
        for i in 0..m {
            for j in 0..n {
                let at = gemm_f64_at(k, &x[i * k..(i + 1) * k], &w[j * k..(j + 1) * k]);
                assert_eq!(at, y[i * n + j], "entry [{i}, {j}]");
            }
        }
    }

    #[test]
    fn dot_bound_by_hand() {
        let u = 2f64.powi(-24);
        let expected = 4.0 * u / (1.0 - 4.0 * u) * 10.0;
        assert_eq!(dot_abs_bound(4, 10.0, u), expected);
        assert_eq!(dot_abs_bound(0, 10.0, u), 0.0);
        assert_eq!(dot_abs_bound(256, 1.0, 2f64.powi(-8)), f64::INFINITY);
        // Just below k·u = 1 the bound is finite but large.
        assert!(dot_abs_bound(255, 1.0, 2f64.powi(-8)) > 100.0);
    }

    #[test]
    fn dot_bound_covers_real_f32_accumulation() {
        let k = 4096;
        let mut g = Gen::new(2);
        // Shifted so products do not cancel on average and the accumulated error is realistic.
        let x = g.uniform_f32(k, -0.5, 1.0);
        let w = g.uniform_f32(k, -0.5, 1.0);
        let acc32 = x.iter().zip(&w).fold(0.0_f32, |acc, (a, b)| acc + a * b);
        let x64: Vec<f64> = x.iter().map(|&v| f64::from(v)).collect();
        let w64: Vec<f64> = w.iter().map(|&v| f64::from(v)).collect();
        let exact = gemm_f64_at(k, &x64, &w64);
        let sum_abs: f64 = x64.iter().zip(&w64).map(|(a, b)| (a * b).abs()).sum();
        let err = (f64::from(acc32) - exact).abs();
        let bound = dot_abs_bound(k, sum_abs, 2f64.powi(-24));
        assert!(err > 0.0, "f32 accumulation should lose something over k={k}");
        assert!(err <= bound, "error {err} exceeds bound {bound}");
    }
}
