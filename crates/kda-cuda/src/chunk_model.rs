//! A host model of `kernels/chunk.cu` (`kda_chunk_tc`), phase by phase with the kernel's own
//! arrays, padding and bf16 roundings (an `mma.sync` tile is a dot product of bf16 operands
//! accumulated in f32), checked against the f64 recurrence. It pins down the algorithm the
//! kernel transcribes — the per-sub-block decay references, the guarded diagonal, the blocked
//! inverse of `I + A_kk`, the value tiles — where it can run without a GPU; the kernel itself is
//! checked against the token-by-token kernel on a device (`tests/device.rs`).

#![allow(
    clippy::needless_range_loop,
    reason = "the model indexes its arrays as the kernel's threads do"
)]

use half::bf16;

use crate::launch::{TC_BV, TC_CHUNK, TC_MIN_LEFT};

fn b(x: f32) -> f32 {
    bf16::from_f32(x).to_f32()
}

/// Operands of one sequence, flash-linear-attention's layout: `q`, `k`, `g` `[T, H, K]`, `v`
/// `[T, H, V]`, `beta` `[T, H]`; `g` is the log decay.
pub(crate) struct Inputs<'a> {
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub g: &'a [f32],
    pub beta: &'a [f32],
    pub heads: usize,
    pub kd: usize,
    pub vd: usize,
    pub scale: f32,
    pub l2: bool,
}

/// Outputs `[T, H, V]` and the final state `[H, V, K]` (v-first) from `initial` (`[H, V, K]`).
pub(crate) fn run(x: &Inputs<'_>, initial: Option<&[f32]>) -> (Vec<f32>, Vec<f32>) {
    let (h_n, kd, vd) = (x.heads, x.kd, x.vd);
    let t_n = x.beta.len() / h_n;
    let mut o = vec![0.0; t_n * h_n * vd];
    let mut state = initial.map_or_else(|| vec![0.0; h_n * vd * kd], <[f32]>::to_vec);
    for h in 0..h_n {
        for v0 in (0..vd).step_by(TC_BV) {
            block(x, h, v0, &mut o, &mut state);
        }
    }
    (o, state)
}

/// One thread block of the kernel: head `h`, value columns `v0 .. v0 + BV`.
fn block(x: &Inputs<'_>, h: usize, v0: usize, o: &mut [f32], state: &mut [f32]) {
    const C: usize = TC_CHUNK;
    const BV: usize = TC_BV;
    let (h_n, kd, vd) = (x.heads, x.kd, x.vd);
    let t_n = x.beta.len() / h_n;
    let kp = kd.div_ceil(16) * 16;
    let nv = BV.min(vd - v0);
    // st[v][c]: this block's columns of the v-first state, fp32; sb its bf16 copy.
    let mut st = vec![[0f32; 128]; BV];
    for v in 0..nv {
        for c in 0..kd {
            st[v][c] = state[(h * vd + v0 + v) * kd + c];
        }
    }
    let mut c0 = 0;
    while c0 < t_n {
        let len = C.min(t_n - c0);
        let sb: Vec<[f32; 128]> = st.iter().map(|r| r.map(b)).collect();
        // Phase A: raw rows, cumulative log decay, normalised q and k, the derived operands.
        let mut gc = vec![[0f32; 128]; C];
        let mut beta = [0f32; C];
        for t in 0..len {
            for c in 0..kd {
                gc[t][c] = x.g[((c0 + t) * h_n + h) * kd + c];
            }
            beta[t] = x.beta[(c0 + t) * h_n + h];
        }
        for c in 0..kp {
            let mut run = 0f32;
            for row in gc.iter_mut() {
                run += row[c];
                row[c] = run;
            }
        }
        let dlast: Vec<f32> = (0..kp).map(|c| gc[C - 1][c].exp()).collect();
        let (mut qb, mut kb) = (vec![[0f32; 128]; C], vec![[0f32; 128]; C]);
        let (mut qg, mut wrhs) = (vec![[0f32; 128]; C], vec![[0f32; 128]; C]);
        let mut kdt = vec![[0f32; C]; 128];
        for t in 0..len {
            let at = ((c0 + t) * h_n + h) * kd;
            let mut q: Vec<f32> = x.q[at..at + kd].to_vec();
            let mut k: Vec<f32> = x.k[at..at + kd].to_vec();
            if x.l2 {
                let qi = 1.0 / (q.iter().map(|a| a * a).sum::<f32>() + 1e-6).sqrt();
                let ki = 1.0 / (k.iter().map(|a| a * a).sum::<f32>() + 1e-6).sqrt();
                q.iter_mut().for_each(|a| *a = *a * qi * x.scale);
                k.iter_mut().for_each(|a| *a *= ki);
            } else {
                q.iter_mut().for_each(|a| *a *= x.scale);
            }
            for c in 0..kd {
                let e = gc[t][c].exp();
                qb[t][c] = b(q[c]);
                kb[t][c] = b(k[c]);
                qg[t][c] = b(q[c] * e);
                wrhs[t][c] = b(beta[t] * (k[c] * e));
                kdt[c][t] = b(k[c] * (gc[C - 1][c] - gc[t][c]).exp());
            }
        }
        let mut urhs = vec![[0f32; C]; BV];
        for (v, row) in urhs.iter_mut().enumerate().take(nv) {
            for t in 0..len {
                row[t] = b(beta[t] * x.v[((c0 + t) * h_n + h) * vd + v0 + v]);
            }
        }
        // Phase B: A_kk (beta-scaled, strictly lower) and A_qk (lower), by sub-blocks of 16.
        let mut akk = vec![[0f32; C]; C];
        let mut aqk = vec![[0f32; C]; C];
        for r0 in (0..len).step_by(16) {
            let r1 = r0 + 16;
            let reference = |c: usize| if r0 == 0 { 0.0 } else { gc[r0 - 1][c] };
            let mut ok = true;
            let mut left = vec![[0f32; 128]; 32];
            for t in r0..r1 {
                for c in 0..kp {
                    let l = (gc[t][c] - reference(c)).exp();
                    ok &= c >= kd || l >= TC_MIN_LEFT;
                    left[t - r0][c] = b(kb[t][c] * l);
                    left[16 + t - r0][c] = b(qb[t][c] * l);
                }
            }
            let right: Vec<[f32; 128]> = (0..r1)
                .map(|i| std::array::from_fn(|c| b(kb[i][c] * (reference(c) - gc[i][c]).exp())))
                .collect();
            for (rr, l) in left.iter().enumerate() {
                for (i, r) in right.iter().enumerate() {
                    let val: f32 = (0..kp).map(|c| l[c] * r[c]).sum();
                    if rr < 16 {
                        let t = r0 + rr;
                        akk[t][i] = if i < t { beta[t] * val } else { 0.0 };
                    } else {
                        let t = r0 + rr - 16;
                        aqk[t][i] = if i <= t { b(val) } else { 0.0 };
                    }
                }
            }
            if !ok {
                for t in r0..r1 {
                    for i in r0..=t {
                        let e = |c: usize| (gc[t][c] - gc[i][c]).exp();
                        let sk: f32 = (0..kp).map(|c| kb[t][c] * kb[i][c] * e(c)).sum();
                        let sq: f32 = (0..kp).map(|c| qb[t][c] * kb[i][c] * e(c)).sum();
                        akk[t][i] = if i < t { beta[t] * sk } else { 0.0 };
                        aqk[t][i] = b(sq);
                    }
                }
            }
        }
        // Phase C: M = (I + A_kk)^-1 by blocks of 16: the diagonal blocks by substitution (a
        // column per lane), then block rows top down, M_ij = -M_ii Σ_k A_ik M_kj.
        let mut m = akk.clone();
        for bd in 0..4 {
            let o16 = 16 * bd;
            let cols: Vec<[f32; 16]> = (0..16)
                .map(|j| {
                    let mut x = [0f32; 16];
                    for t in 0..16 {
                        x[t] = if t == j {
                            1.0
                        } else if t < j {
                            0.0
                        } else {
                            -(j..t).map(|i| akk[o16 + t][o16 + i] * x[i]).sum::<f32>()
                        };
                    }
                    x
                })
                .collect();
            for (j, col) in cols.iter().enumerate() {
                for t in 0..16 {
                    m[o16 + t][o16 + j] = col[t];
                }
            }
        }
        for bi in 1..4 {
            let tmp: Vec<[[f32; 16]; 16]> = (0..bi)
                .map(|bj| {
                    std::array::from_fn(|r| {
                        std::array::from_fn(|c| {
                            (bj..bi)
                                .flat_map(|bk| (0..16).map(move |s| (bk, s)))
                                .map(|(bk, s)| {
                                    akk[16 * bi + r][16 * bk + s] * m[16 * bk + s][16 * bj + c]
                                })
                                .sum()
                        })
                    })
                })
                .collect();
            for (bj, t) in tmp.iter().enumerate() {
                for r in 0..16 {
                    for c in 0..16 {
                        let s: f32 = (0..16).map(|s| m[16 * bi + r][16 * bi + s] * t[s][c]).sum();
                        m[16 * bi + r][16 * bj + c] = -s;
                    }
                }
            }
        }
        let mb: Vec<[f32; C]> = m.iter().map(|r| r.map(b)).collect();
        // Phase D: W = M · wrhs (bf16), U = M · urhs (f32).
        let w: Vec<[f32; 128]> = (0..C)
            .map(|t| std::array::from_fn(|c| b((0..C).map(|i| mb[t][i] * wrhs[i][c]).sum())))
            .collect();
        // Phase E: v_new = U - W S, o = qg S + A_qk v_new, S = decay S + Kd^T v_new.
        let mut vnew = vec![[0f32; C]; BV];
        for t in 0..C {
            for v in 0..BV {
                let u: f32 = (0..C).map(|i| mb[t][i] * urhs[v][i]).sum();
                let y: f32 = (0..kp).map(|c| w[t][c] * sb[v][c]).sum();
                vnew[v][t] = b(u - y);
            }
        }
        for t in 0..len {
            for v in 0..nv {
                let inter: f32 = (0..kp).map(|c| qg[t][c] * sb[v][c]).sum();
                let intra: f32 = (0..C).map(|i| aqk[t][i] * vnew[v][i]).sum();
                o[((c0 + t) * h_n + h) * vd + v0 + v] = inter + intra;
            }
        }
        for c in 0..kp {
            for (v, row) in st.iter_mut().enumerate() {
                let d: f32 = (0..C).map(|i| kdt[c][i] * vnew[v][i]).sum();
                row[c] = row[c] * dlast[c] + d;
            }
        }
        c0 += len;
    }
    for v in 0..nv {
        for c in 0..kd {
            state[(h * vd + v0 + v) * kd + c] = st[v][c];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kda_testkit::oracle_kda::{KdaSequence, kda_recurrence, max_abs};

    struct Lcg(u64);
    impl Lcg {
        fn next(&mut self) -> f32 {
            self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((self.0 >> 40) as f32) / (1u64 << 24) as f32
        }
        fn fill(&mut self, n: usize, lo: f32, hi: f32) -> Vec<f32> {
            (0..n).map(|_| lo + (hi - lo) * self.next()).collect()
        }
    }

    /// The model against the f64 recurrence: the largest error relative to the largest value,
    /// for outputs and the final state.
    fn errors(
        t: usize,
        h: usize,
        kd: usize,
        vd: usize,
        g: (f32, f32),
        with_initial: bool,
    ) -> (f64, f64) {
        let mut rng = Lcg(t as u64 * 31 + kd as u64);
        let q = rng.fill(t * h * kd, -1.0, 1.0);
        let k = rng.fill(t * h * kd, -1.0, 1.0);
        let v = rng.fill(t * h * vd, -1.0, 1.0);
        let gv = rng.fill(t * h * kd, g.0, g.1);
        let beta = rng.fill(t * h, 0.0, 1.0);
        let init = with_initial.then(|| rng.fill(h * vd * kd, -0.5, 0.5));
        let scale = (kd as f32).powf(-0.5);
        let x =
            Inputs { q: &q, k: &k, v: &v, g: &gv, beta: &beta, heads: h, kd, vd, scale, l2: true };
        let (o, s) = run(&x, init.as_deref());
        let f = |a: &[f32]| a.iter().map(|&x| f64::from(x)).collect::<Vec<f64>>();
        // The oracle's state is K-first.
        let init_kf = init.map(|s| {
            let mut kf = vec![0.0; h * kd * vd];
            for hh in 0..h {
                for vv in 0..vd {
                    for c in 0..kd {
                        kf[(hh * kd + c) * vd + vv] = f64::from(s[(hh * vd + vv) * kd + c]);
                    }
                }
            }
            kf
        });
        let seq = KdaSequence {
            q: &f(&q),
            k: &f(&k),
            v: &f(&v),
            g: &f(&gv),
            beta: &f(&beta),
            heads: h,
            kd,
            vd,
        };
        let (o_ref, s_ref) = kda_recurrence(seq, init_kf.as_deref(), f64::from(scale), true);
        let rel = |got: &[f64], want: &[f64]| {
            let err = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
            err / max_abs(want).max(1e-30)
        };
        let mut s_kf = vec![0.0; h * kd * vd];
        for hh in 0..h {
            for vv in 0..vd {
                for c in 0..kd {
                    s_kf[(hh * kd + c) * vd + vv] = f64::from(s[(hh * vd + vv) * kd + c]);
                }
            }
        }
        (rel(&f(&o), &o_ref), rel(&s_kf, &s_ref))
    }

    /// bf16 operands (8 significant bits) in every product: errors of a few 2^-8 relative to the
    /// largest value, the precision flash-linear-attention's kernel has.
    const BF16_REL: f64 = 0.03;

    #[test]
    fn the_model_matches_the_recurrence_across_chunk_boundaries() {
        for t in [1, 15, 16, 17, 63, 64, 65, 130] {
            let (eo, es) = errors(t, 2, 128, 40, (-0.5, 0.0), false);
            assert!(eo < BF16_REL && es < BF16_REL, "T = {t}: outputs {eo:.2e}, state {es:.2e}");
        }
    }

    #[test]
    fn padded_key_dims_and_initial_states() {
        let (eo, es) = errors(70, 1, 48, 16, (-0.3, 0.0), true);
        assert!(eo < BF16_REL && es < BF16_REL, "outputs {eo:.2e}, state {es:.2e}");
    }

    /// Gates near K3's lower bound (-5): sub-blocks whose decay spans more than e^-40 take the
    /// direct diagonal.
    #[test]
    fn fast_decay_takes_the_direct_diagonal() {
        let (eo, es) = errors(100, 1, 64, 32, (-5.0, -3.0), true);
        assert!(eo < BF16_REL && es < BF16_REL, "outputs {eo:.2e}, state {es:.2e}");
    }
}
