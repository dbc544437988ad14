//! An f64 oracle of the whole KDA layer on one TP rank (`docs/design/kda.md#the-layer-forward`),
//! from the host weights a loader produced, one request at a time, token by token.
//!
//! Built from the formula oracles of [`crate::oracle_kda`] and nothing of the backends': the
//! projections are f64 dot products (MXFP8 QKV through the codec's exact dequantized values,
//! after quantizing the activation with the same spec), rounded to bf16 where the layer stores
//! bf16 (`mixed_qkv`, the BFG output; the staged F's intermediate too); everything after is f64.
//! The state is K-first `[lh, K, V]` here, as the formulas write it.

use half::bf16;
use kda_core::kda::GateForm;
use kda_core::mx;
use kda_model::layer::ForgetProjection;
use kda_model::weights::{BfgBlock, LayerWeights, QkvWeights};

use crate::oracle_kda::{
    KdaSequence, causal_conv, gate_lower_bound, gate_softplus, gated_rms_norm, kda_recurrence,
    sigmoid,
};

/// One request's state between steps.
#[derive(Clone, Debug, PartialEq)]
pub struct RequestState {
    /// `[lh, K, V]`, K-first.
    pub recurrent: Vec<f64>,
    /// `[W - 1, 3 lp]`: the last conv inputs, oldest first.
    pub conv: Vec<f64>,
}

impl RequestState {
    /// The recurrent state as the cache holds it: v-first `[lh, V, K]`.
    pub fn v_first(&self, heads: usize, dim: usize) -> Vec<f64> {
        let mut out = vec![0.0; self.recurrent.len()];
        for h in 0..heads {
            for k in 0..dim {
                for v in 0..dim {
                    out[(h * dim + v) * dim + k] = self.recurrent[(h * dim + k) * dim + v];
                }
            }
        }
        out
    }
}

/// The layer's weights as f64, ready for [`LayerOracle::run`].
#[derive(Clone, Debug)]
pub struct LayerOracle {
    hidden: usize,
    heads: usize,
    dim: usize,
    width: usize,
    qkv: Qkv,
    /// `[lh + 2 lp, Hd]` composed BFG rows.
    bfg: Vec<f64>,
    /// Staged F: `f_a` `[D, Hd]` and `f_b` `[lp, D]` (None: composed).
    staged_f: Option<(Vec<f64>, Vec<f64>)>,
    /// `[C, W]`.
    conv: Vec<f64>,
    a_log: Vec<f64>,
    dt_bias: Vec<f64>,
    o_norm: Vec<f64>,
    /// `[Hd, lp]`.
    o_proj: Vec<f64>,
    gate: GateForm,
    eps: f64,
    /// The recurrence's operands (q, k, v after the conv, beta) and its output rounded to bf16,
    /// as a layer with `CoreOperands::Bf16` stores them.
    bf16_core: bool,
}

#[derive(Clone, Debug)]
enum Qkv {
    Dense(Vec<f64>),
    /// Exact dequantized weights, and the activation's scale algorithm.
    Mx {
        w: Vec<f64>,
        alg: mx::ScaleAlg,
    },
}

fn f64s(t: &kda_model::weights::HostTensor) -> Vec<f64> {
    t.to_f64_vec().expect("float host tensor")
}

fn round_bf16(x: f64) -> f64 {
    f64::from(bf16::from_f64(x).to_f32())
}

/// `y[r, n] = Σ_k x[r, k] · w[n, k]`.
fn linear(x: &[f64], w: &[f64], k: usize) -> Vec<f64> {
    let n = w.len() / k;
    x.chunks(k)
        .flat_map(|row| {
            (0..n).map(move |j| row.iter().zip(&w[j * k..(j + 1) * k]).map(|(a, b)| a * b).sum())
        })
        .collect()
}

impl LayerOracle {
    /// The oracle of `weights` with F as `forget` lays it out.
    ///
    /// # Panics
    /// When the weights are incomplete (tests load complete ones).
    pub fn new(weights: &LayerWeights, forget: ForgetProjection) -> Self {
        let d = weights.dims;
        let (lh, lp, hd) = (d.local_heads, d.local_proj, d.hidden);
        let qkv = match weights.qkv.weights().expect("loaded qkv") {
            QkvWeights::Dense(w) => Qkv::Dense(f64s(w)),
            QkvWeights::Mxfp8 { data, scale, scale_alg } => Qkv::Mx {
                w: mx::dequantize_f64(
                    data.as_u8().expect("bytes"),
                    scale.as_u8().expect("bytes"),
                    3 * lp,
                    hd,
                )
                .expect("valid MXFP8 weight"),
                alg: scale_alg,
            },
        };
        let packed = f64s(weights.bfg.weight().expect("packed BFG"));
        let rows = |b: BfgBlock| weights.bfg.block_rows(b).expect("composed block");
        let bfg = [BfgBlock::Beta, BfgBlock::Forget, BfgBlock::Gate]
            .into_iter()
            .flat_map(|b| {
                let r = rows(b);
                packed[r.start * hd..r.end * hd].to_vec()
            })
            .collect::<Vec<f64>>();
        assert_eq!(bfg.len(), (lh + 2 * lp) * hd, "the oracle reads a composed BFG weight");
        let staged_f = (forget == ForgetProjection::Staged).then(|| {
            let (a, b) = weights.bfg.f_factors();
            // Staged uploads the factors in the weight dtype.
            let cast = |t: &kda_model::weights::HostTensor| {
                f64s(&t.cast(weights.bfg.dtype()).expect("cast"))
            };
            (cast(a.expect("f_a")), cast(b.expect("f_b")))
        });
        let [width, channels] = weights.conv.shape();
        let packed_conv = weights.conv.data();
        let mut conv = vec![0.0; channels * width];
        for j in 0..width {
            for c in 0..channels {
                conv[c * width + j] = f64::from(packed_conv[j * channels + c]);
            }
        }
        Self {
            hidden: hd,
            heads: lh,
            dim: d.head_dim,
            width,
            qkv,
            bfg,
            staged_f,
            conv,
            a_log: f64s(&weights.a_log),
            dt_bias: f64s(&weights.dt_bias),
            o_norm: f64s(&weights.o_norm),
            o_proj: f64s(&weights.o_proj),
            gate: weights.gate,
            eps: weights.rms_norm_eps,
            bf16_core: false,
        }
    }

    /// The oracle of a layer that runs an MXFP8 checkpoint's QKV in bf16 (`QkvPath::Bf16`, the
    /// choice on a backend without native MX ops): the weight dequantized exactly, the
    /// activation unquantized, as with a dense QKV weight. A dense weight is unchanged.
    #[must_use]
    pub fn with_bf16_qkv(mut self) -> Self {
        if let Qkv::Mx { w, .. } = self.qkv {
            self.qkv = Qkv::Dense(w);
        }
        self
    }

    /// The oracle of a layer whose recurrence takes bf16 operands (`CoreOperands::Bf16`): q, k,
    /// v after the conv, beta and the core output are rounded to bf16, everything else in f64.
    #[must_use]
    pub fn with_bf16_core_operands(mut self) -> Self {
        self.bf16_core = true;
        self
    }

    /// A fresh request's state (zeros).
    pub fn fresh(&self) -> RequestState {
        let (lh, d) = (self.heads, self.dim);
        RequestState {
            recurrent: vec![0.0; lh * d * d],
            conv: vec![0.0; (self.width - 1) * 3 * lh * d],
        }
    }

    /// Run one request's `x` (`[n, Hd]`, the values of the bf16 activation) from `state`:
    /// returns this rank's partial output `[n, Hd]` and the state after the last token.
    pub fn run(&self, x: &[f32], state: &RequestState) -> (Vec<f64>, RequestState) {
        let (hd, lh, d) = (self.hidden, self.heads, self.dim);
        let lp = lh * d;
        let c = 3 * lp;
        let n = x.len() / hd;
        let xs: Vec<f64> = x.iter().map(|&v| f64::from(v)).collect();
        let mixed: Vec<f64> = match &self.qkv {
            Qkv::Dense(w) => linear(&xs, w, hd),
            Qkv::Mx { w, alg } => {
                let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
                let q = mx::quantize(&xb, n, hd, *alg).expect("quantize");
                let a = mx::dequantize_f64(&q.data, &q.scale, n, hd).expect("dequantize");
                linear(&a, w, hd)
            }
        }
        .into_iter()
        .map(round_bf16)
        .collect();
        let mut bfg: Vec<f64> = linear(&xs, &self.bfg, hd).into_iter().map(round_bf16).collect();
        if let Some((f_a, f_b)) = &self.staged_f {
            let mid: Vec<f64> = linear(&xs, f_a, hd).into_iter().map(round_bf16).collect();
            let f: Vec<f64> = linear(&mid, f_b, d).into_iter().map(round_bf16).collect();
            let width = lh + 2 * lp;
            for t in 0..n {
                bfg[t * width + lh..t * width + lh + lp].copy_from_slice(&f[t * lp..(t + 1) * lp]);
            }
        }
        let width = lh + 2 * lp;
        let col =
            |t: usize, start: usize, len: usize| &bfg[t * width + start..t * width + start + len];
        let beta: Vec<f64> =
            (0..n).flat_map(|t| col(t, 0, lh).iter().map(|&b| sigmoid(b))).collect();
        let g2: Vec<f64> = (0..n).flat_map(|t| col(t, lh + lp, lp).to_vec()).collect();
        let mut g = Vec::with_capacity(n * lp);
        for t in 0..n {
            for (i, &raw) in col(t, lh, lp).iter().enumerate() {
                let (h, a) = (i / d, raw + self.dt_bias[i]);
                g.push(match self.gate {
                    GateForm::Softplus => gate_softplus(self.a_log[h], a),
                    GateForm::LowerBound { lower_bound } => {
                        gate_lower_bound(f64::from(lower_bound), self.a_log[h], a)
                    }
                });
            }
        }
        let conv = causal_conv(&state.conv, &mixed, &self.conv, c, self.width);
        let pick = |part: usize| -> Vec<f64> {
            conv.chunks(c).flat_map(|row| row[part * lp..(part + 1) * lp].to_vec()).collect()
        };
        let (mut q, mut k, mut v) = (pick(0), pick(1), pick(2));
        let mut beta = beta;
        let round = |x: &mut Vec<f64>| x.iter_mut().for_each(|e| *e = round_bf16(*e));
        if self.bf16_core {
            for x in [&mut q, &mut k, &mut v, &mut beta] {
                round(x);
            }
        }
        let seq = KdaSequence { q: &q, k: &k, v: &v, g: &g, beta: &beta, heads: lh, kd: d, vd: d };
        let scale = (d as f64).powf(-0.5);
        let (mut core, recurrent) = kda_recurrence(seq, Some(&state.recurrent), scale, true);
        if self.bf16_core {
            round(&mut core);
        }
        let normed = gated_rms_norm(&core, &g2, &self.o_norm, self.eps, d);
        let out = linear(&normed, &self.o_proj, lp);
        let mut history = state.conv.clone();
        history.extend_from_slice(&mixed);
        let conv_state = history[history.len() - (self.width - 1) * c..].to_vec();
        (out, RequestState { recurrent, conv: conv_state })
    }
}
