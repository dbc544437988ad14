//! f64 oracles of the KDA core (`docs/design/kda.md#inside-kda`): each formula as a plain loop, in
//! the formulas' own layout (the state is K-first `[K, V]` here, whatever the cache does), so that
//! code this simple can be checked by reading it against the document.

/// `x · sigmoid(x)`.
pub fn silu(x: f64) -> f64 {
    x * sigmoid(x)
}

/// `1 / (1 + e^-z)`.
pub fn sigmoid(z: f64) -> f64 {
    1.0 / (1.0 + (-z).exp())
}

/// `ln(1 + e^a)`, or `a` above the threshold 20.
pub fn softplus(a: f64) -> f64 {
    if a > 20.0 { a } else { (1.0 + a.exp()).ln() }
}

/// Softplus-form gate: `-exp(A_log) · softplus(a)`.
pub fn gate_softplus(a_log: f64, a: f64) -> f64 {
    -a_log.exp() * softplus(a)
}

/// Lower-bound-form gate: `lower_bound · sigmoid(exp(A_log) · a)`.
pub fn gate_lower_bound(lower_bound: f64, a_log: f64, a: f64) -> f64 {
    lower_bound * sigmoid(a_log.exp() * a)
}

/// Depthwise causal conv1d + SiLU of one request: `history` is the `W - 1` inputs before its
/// first token (`[W-1, C]`, oldest first), `x` its `[n, C]` tokens, `weight` `[C, W]`.
/// `y_t[c] = silu(Σ_j w[c, j] · x_{t-W+1+j}[c])`.
///
/// # Panics
/// When the slices do not have the sizes above.
pub fn causal_conv(
    history: &[f64],
    x: &[f64],
    weight: &[f64],
    channels: usize,
    width: usize,
) -> Vec<f64> {
    assert_eq!(history.len(), (width - 1) * channels, "causal_conv: history must be [W-1, C]");
    assert_eq!(weight.len(), channels * width, "causal_conv: weight must be [C, W]");
    assert_eq!(x.len() % channels.max(1), 0, "causal_conv: x must be [n, C]");
    let n = x.len() / channels.max(1);
    // Input number `s` of the request, counting the history: s < W-1 is history.
    let input = |s: usize, c: usize| {
        if s < width - 1 { history[s * channels + c] } else { x[(s - (width - 1)) * channels + c] }
    };
    let mut y = vec![0.0; n * channels];
    for t in 0..n {
        for c in 0..channels {
            // x_{t-W+1+j} is input number t + j when the history comes first.
            let sum: f64 = (0..width).map(|j| weight[c * width + j] * input(t + j, c)).sum();
            y[t * channels + c] = silu(sum);
        }
    }
    y
}

/// `x / sqrt(Σ x² + 1e-6) · scale` for each row of `dim` elements.
pub fn l2norm(x: &[f64], dim: usize, scale: f64) -> Vec<f64> {
    x.chunks(dim.max(1))
        .flat_map(|row| {
            let norm = (row.iter().map(|v| v * v).sum::<f64>() + 1e-6).sqrt();
            row.iter().map(move |v| v / norm * scale)
        })
        .collect()
}

/// `x · rsqrt(mean(x²) + eps) · weight · sigmoid(gate)` for each row of `dim` elements.
pub fn gated_rms_norm(x: &[f64], gate: &[f64], weight: &[f64], eps: f64, dim: usize) -> Vec<f64> {
    let mut y = Vec::with_capacity(x.len());
    for (row, gates) in x.chunks(dim.max(1)).zip(gate.chunks(dim.max(1))) {
        let mean_square = row.iter().map(|v| v * v).sum::<f64>() / dim as f64;
        let inv = 1.0 / (mean_square + eps).sqrt();
        for ((v, w), g) in row.iter().zip(weight).zip(gates) {
            y.push(v * inv * w * sigmoid(*g));
        }
    }
    y
}

/// The operands of one sequence: `q`, `k`, `g` `[T, H, K]`, `v` `[T, H, V]`, `beta` `[T, H]`,
/// row-major (flash-linear-attention's layout without the batch dimension).
#[derive(Copy, Clone, Debug)]
pub struct KdaSequence<'a> {
    pub q: &'a [f64],
    pub k: &'a [f64],
    pub v: &'a [f64],
    pub g: &'a [f64],
    pub beta: &'a [f64],
    pub heads: usize,
    pub kd: usize,
    pub vd: usize,
}

/// The KDA recurrence token by token, the four lines of `docs/design/kda.md#recurrence` per head,
/// from `initial` (`[H, K, V]` K-first; zero when `None`). `q` is optionally L2-normalised, then
/// multiplied by `scale`; `k` L2-normalised with the same flag. Returns the outputs `[T, H, V]` and
/// the final state `[H, K, V]`.
///
/// # Panics
/// When the slices do not have the sizes above.
pub fn kda_recurrence(
    seq: KdaSequence<'_>,
    initial: Option<&[f64]>,
    scale: f64,
    l2norm_qk: bool,
) -> (Vec<f64>, Vec<f64>) {
    let KdaSequence { heads, kd, vd, .. } = seq;
    let tokens = seq.beta.len() / heads.max(1);
    assert_eq!(seq.q.len(), tokens * heads * kd, "kda_recurrence: q must be [T, H, K]");
    assert_eq!(seq.k.len(), tokens * heads * kd, "kda_recurrence: k must be [T, H, K]");
    assert_eq!(seq.g.len(), tokens * heads * kd, "kda_recurrence: g must be [T, H, K]");
    assert_eq!(seq.v.len(), tokens * heads * vd, "kda_recurrence: v must be [T, H, V]");
    let mut state = match initial {
        Some(s) => {
            assert_eq!(s.len(), heads * kd * vd, "kda_recurrence: initial must be [H, K, V]");
            s.to_vec()
        }
        None => vec![0.0; heads * kd * vd],
    };
    let mut o = vec![0.0; tokens * heads * vd];
    for t in 0..tokens {
        for h in 0..heads {
            let at = t * heads + h;
            let row = |x: &[f64], d: usize| x[at * d..(at + 1) * d].to_vec();
            let (mut q, mut k) = (row(seq.q, kd), row(seq.k, kd));
            if l2norm_qk {
                q = l2norm(&q, kd, 1.0);
                k = l2norm(&k, kd, 1.0);
            }
            let q: Vec<f64> = q.iter().map(|x| x * scale).collect();
            let (v, g, beta) = (row(seq.v, vd), row(seq.g, kd), seq.beta[at]);
            let s = &mut state[h * kd * vd..(h + 1) * kd * vd];
            // S = S * exp(g_t)[:, None]
            for c in 0..kd {
                let decay = g[c].exp();
                for j in 0..vd {
                    s[c * vd + j] *= decay;
                }
            }
            // u = beta_t * (v_t - S^T k_t)
            let u: Vec<f64> = (0..vd)
                .map(|j| beta * (v[j] - (0..kd).map(|c| s[c * vd + j] * k[c]).sum::<f64>()))
                .collect();
            // S = S + k_t ⊗ u
            for c in 0..kd {
                for j in 0..vd {
                    s[c * vd + j] += k[c] * u[j];
                }
            }
            // o_t = S^T q_t
            for j in 0..vd {
                o[at * vd + j] = (0..kd).map(|c| s[c * vd + j] * q[c]).sum();
            }
        }
    }
    (o, state)
}

/// The tolerance for outputs (or states) of the KDA recurrence computed in fp32, against
/// [`kda_recurrence`], over `tokens` tokens with key dim `kd`; `chunk` is the chunk length of a
/// chunked form (0 for the token-by-token one) and `magnitude` the largest `|value|` of the
/// oracle's result being compared.
///
/// Every element is the end of a chain of fp32 roundings: a `K`-term dot product at its token,
/// and one rounded update of the state for each earlier token. With `beta` in `[0, 1]`,
/// L2-normalised keys and decays at most 1, the delta rule is non-expansive, so an error made at
/// one token is carried by later tokens but not amplified; the accumulated error is then at most
/// `γ_n · magnitude` ([`crate::oracle::dot_abs_bound`]) with `n = K + T`, and `n = 2(K + C) + T`
/// for a chunked form, whose triangular solve and intra-chunk products add two more chains of at
/// most `K + C` terms per chunk. The bound does not hold without the L2 norm (a key of norm
/// above `sqrt(2)` with `beta = 1` makes the recurrence expansive).
pub fn recurrence_tolerance(
    tokens: usize,
    kd: usize,
    chunk: usize,
    magnitude: f64,
) -> crate::Tolerance {
    let n = kd + tokens + if chunk > 0 { 2 * (kd + chunk) } else { 0 };
    let f32_unit_roundoff = 1.0 / (1u64 << 24) as f64;
    let base = crate::Tolerance::for_dtype(kda_core::DType::F32);
    base.with_abs(base.abs + crate::oracle::dot_abs_bound(n, magnitude, f32_unit_roundoff))
}

/// The largest `|x|` (0 for an empty slice; NaN is ignored).
pub fn max_abs(x: &[f64]) -> f64 {
    x.iter().fold(0.0, |m, v| if v.abs() > m { v.abs() } else { m })
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn conv_by_hand() {
        // C = 1, W = 3, history [1, 2], x [3, 4], w = [0.5, 0, 1]: sums 1·0.5 + 3 = 3.5 and
        // 2·0.5 + 4 = 5.
        let y = causal_conv(&[1.0, 2.0], &[3.0, 4.0], &[0.5, 0.0, 1.0], 1, 3);
        assert!((y[0] - silu(3.5)).abs() < 1e-15 && (y[1] - silu(5.0)).abs() < 1e-15);
        assert!((silu(0.0)).abs() < 1e-300 && (silu(50.0) - 50.0).abs() < 1e-12);
    }

    #[test]
    fn gates_by_hand() {
        assert!((softplus(0.0) - 2f64.ln()).abs() < 1e-15);
        assert_eq!(softplus(25.0), 25.0);
        assert!((gate_softplus(0.0, 0.0) + 2f64.ln()).abs() < 1e-15);
        assert!((gate_lower_bound(-5.0, 0.0, 0.0) + 2.5).abs() < 1e-15);
    }

    #[test]
    fn recurrence_one_head_by_hand() {
        // K = V = 1, no decay, beta = 1: u = v - s k, s += k u, o = s q.
        let seq = KdaSequence {
            q: &[1.0, 2.0],
            k: &[1.0, 1.0],
            v: &[3.0, 5.0],
            g: &[0.0, 0.0],
            beta: &[1.0, 1.0],
            heads: 1,
            kd: 1,
            vd: 1,
        };
        let (o, s) = kda_recurrence(seq, None, 1.0, false);
        // Token 0: u = 3, s = 3, o = 3. Token 1: u = 5 - 3 = 2, s = 5, o = 10.
        assert_eq!(o, vec![3.0, 10.0]);
        assert_eq!(s, vec![5.0]);
        // Decay ln(0.5) halves the state before the update: u = 5 - 1.5, s = 5.
        let seq = KdaSequence { g: &[0.0, 0.5f64.ln()], ..seq };
        let (o, s) = kda_recurrence(seq, None, 1.0, false);
        assert!((o[1] - 10.0).abs() < 1e-12 && (s[0] - 5.0).abs() < 1e-12);
    }

    #[test]
    fn norms_by_hand() {
        let y = l2norm(&[3.0, 4.0], 2, 2.0);
        assert!((y[0] - 1.2).abs() < 1e-6 && (y[1] - 1.6).abs() < 1e-6);
        let y = gated_rms_norm(&[3.0, 4.0], &[0.0, 100.0], &[1.0, 2.0], 0.0, 2);
        let rms = 12.5f64.sqrt();
        assert!((y[0] - 3.0 / rms * 0.5).abs() < 1e-12 && (y[1] - 8.0 / rms).abs() < 1e-12);
    }
}
