//! `aclnnChunkKdaFwd`'s arithmetic on host vectors, at the precision its kernel sources give
//! each intermediate (hicann/ops-transformer `attention/chunk_kda_fwd/op_kernel/`):
//!
//! | intermediate | dtype, and where it is rounded | source |
//! |---|---|---|
//! | `gk`, the gate's in-chunk cumulative sum | f32, in log2 units (`× RCP_LN2` per token, then a running f32 sum in token order) | `kda_gate_cumsum_kernel.h` (`ApplyGate`, `ProcessChunk`); `chunk_kda_fwd_common.h` (`RunFrontEnd` instantiates `GK_T = float`) |
//! | score factors `q·2^(g−g_r)`, `k·2^(g−g_r)`, `k·2^(g_r−g)` (one reference token per 32 rows) | `SCORE_T` = `T` (bf16 for a bf16 op; bf16 for an f16 op with `safeGate`), `Cast(CAST_RINT)` of the f32 product; exponent input clamped to `[−126, 120]·ln2` for a bf16 score, `±80·ln2` otherwise | `chunk_kda_fwd_prepare.h` (`PrepareScoreFactorsBulk`, `ClampScoreExpInput`, `KDA_SCORE_REF_BC`) |
//! | raw `Aqk`, `Akk` | f32: the Cube's f32 accumulator of the `SCORE_T` products | `chunk_kda_fwd_prepare.h` (`ComputeRawAqkAkkCubeBlock`: `ElementC = float`) |
//! | `(I + diag(β)·tril(Akk, −1))⁻¹` | f32 (vector forward substitution on 16-row blocks, merged by f32 Cube GEMMs in IEEE mode, not HF32) | `chunk_kda_fwd_prepare.h` (`SolveDiagonalBlocksInRows`, `CubeGemmSolveSub`, `static_assert(!USE_HF32_MODE)`) |
//! | `akkOut` (the inverse), `aqkOut` (`Aqk · scale`, causal) | `T`, `CAST_RINT` | `chunk_kda_fwd_prepare.h` (`FinalizePrepareIntermediates`) |
//! | `qg = q·2^g`, `k·2^g` | `T`, `CAST_RINT` of the f32 product (exponent clamped to `±80·ln2`) | `chunk_kda_fwd_prepare.h` (`PrepareGateProductsBulk`) |
//! | `w` seed `β·(k·2^g)`, `u` seed `β·v` | `T`, `CAST_RINT` of the f32 product of the `T` value and β | `chunk_kda_fwd_prepare.h` (`ScaleRowsByBeta`) |
//! | `w = A⁻¹·wseed`, `u = A⁻¹·useed` | f32 accumulation of `T`·`T` products, stored as `T` | `chunk_kda_fwd_post_wu.h` (`ComputePostWuCube`; `ComputeTailWuRow` for a short chunk) |
//! | `kg = k·2^(g_last−g)` | `T`, `CAST_RINT` | `chunk_kda_fwd_post_wu.h` (`CopyScratchWAndFinalizeKg`) |
//! | the state before each chunk, as the GEMMs read it (`hOut`) | `T`, `CAST_RINT` of the f32 state | `arch22/fwd_h/epilogue/block/block_epilogue_kda_fwdh_update_arch22.hpp`; `kda_fwd_h_kernel_arch22.hpp` (`ElementH = INPUT_TYPE`) |
//! | `w·h` | f32 | `kda_fwd_h_kernel_arch22.hpp` (`BlockMmadWH`, `WORKSPACE_TYPE = float`) |
//! | `v_new = u − w·h` | `T`, `CAST_RINT` of the f32 difference | `block_epilogue_kda_fwdh_vnew_arch22.hpp` |
//! | `kgᵀ·v_new` | f32 | `kda_fwd_h_kernel_arch22.hpp` (`BlockMmadKV`) |
//! | the state carried between chunks | f32 (`persistFwdHStateInFp32`): `S·2^(g_last) + kgᵀ·v_new`, the decay's exponent unclamped | `chunk_kda_fwd_common.h` (`MakeFwdHTiling`); the update epilogue (`useFp32StateUpdate`) |
//! | `o = (qg·h)·scale + aqkOut·v_new` | both products f32, sum f32, stored as `T` | `chunk_kda_fwd_finalize.h` (`ComputeOutputCube`, `FinalizeOutputRows`) |
//!
//! `T` values are widened exactly; every f32 operation is one IEEE f32 operation, in the order
//! the kernel issues them. What is not modelled: the Cube's and the vector unit's summation
//! order inside one product (sums here run in index order), the blocked order of the
//! triangular solve, and the NPU's `Exp`/`Ln`/`Div` approximations (IEEE here). The 950
//! (`arch35/`) sources use the same element types in the state kernel
//! (`arch35/fwd_h/gemm/kernel/kda_fwd_h_kernel_arch35.hpp`); the emulator applies this table to
//! every SoC.

use crate::host::Store;

const LN2: f32 = std::f32::consts::LN_2;
const RCP_LN2: f32 = std::f32::consts::LOG2_E;
/// Largest magnitude of f16, the clamp before every f16 store the kernels clamp.
const F16_MAX: f32 = 65504.0;

/// The gate the op applies itself (`useGateInKernel`).
#[derive(Clone, Debug)]
pub(crate) struct Gate {
    /// `A_log`, one per value head.
    pub a_log: Vec<f32>,
    /// `dt_bias`, `[HV·K]`, if given.
    pub dt_bias: Option<Vec<f32>>,
    /// `safeGate`'s lower bound, or `None` for the softplus form.
    pub lower_bound: Option<f32>,
}

/// One call's operands, widened to f32, token-major (`[tokens, heads, dim]`).
#[derive(Clone, Debug)]
pub(crate) struct Chunk {
    pub h: usize,
    pub hv: usize,
    pub k: usize,
    pub v: usize,
    /// `chunkSize`.
    pub chunk: usize,
    pub q: Vec<f32>,
    pub key: Vec<f32>,
    pub value: Vec<f32>,
    /// `[tokens, HV, K]`: log decays (natural log), or raw gate logits with `gate`.
    pub g: Vec<f32>,
    /// `[tokens, HV]`.
    pub beta: Vec<f32>,
    pub gate: Option<Gate>,
    /// Sequence boundaries, from 0 to `tokens`.
    pub offsets: Vec<usize>,
    /// Initial states `[N, HV, K, V]` (k-major), if given.
    pub initial: Option<Vec<f32>>,
    pub scale: f32,
    /// The op's `T`: q, k, v, the output and every `T` intermediate.
    pub store: Store,
    /// `safeGate` (it picks the score dtype of an f16 op).
    pub safe_gate: bool,
}

/// What the op writes.
#[derive(Clone, Debug)]
pub(crate) struct Outputs {
    /// `[tokens, HV, V]`, already rounded to `T`.
    pub o: Vec<f32>,
    /// `[N, HV, K, V]` (k-major), f32.
    pub final_state: Vec<f32>,
    /// `aqkOut` and `akkOut`, `[HV, tokens, chunk]` (head-major), rounded to `T`.
    pub aqk: Vec<f32>,
    pub akk: Vec<f32>,
}

impl Store {
    /// `x` rounded to this dtype after the f16 clamp the kernels apply before such stores
    /// (`ClampFp32ToOutputType`, `ClampFp32ForCast`).
    fn saturate(self, x: f32) -> f32 {
        match self {
            Self::F16 => self.round(x.clamp(-F16_MAX, F16_MAX)),
            _ => self.round(x),
        }
    }
}

/// `2^x` as the kernels compute it: `exp(clamp(x·ln2, lo, hi))`, each step in f32.
fn exp2(x: f32, lo: f32, hi: f32) -> f32 {
    (x * LN2).max(lo).min(hi).exp()
}

/// `Σ a[i]·b[i·stride]` in f32, in index order.
fn dot(a: &[f32], b: &[f32], stride: usize) -> f32 {
    let mut s = 0.0f32;
    for (i, x) in a.iter().enumerate() {
        s += x * b[i * stride];
    }
    s
}

impl Chunk {
    /// The whole op.
    pub(crate) fn run(&self) -> Outputs {
        let (hv, kd, vd, c) = (self.hv, self.k, self.v, self.chunk);
        let tokens = *self.offsets.last().unwrap_or(&0);
        let n = self.offsets.len().saturating_sub(1);
        let mut out = Outputs {
            o: vec![0.0; tokens * hv * vd],
            final_state: vec![0.0; n * hv * kd * vd],
            aqk: vec![0.0; hv * tokens * c],
            akk: vec![0.0; hv * tokens * c],
        };
        for s in 0..n {
            for head in 0..hv {
                let mut state = match &self.initial {
                    Some(init) => init[(s * hv + head) * kd * vd..][..kd * vd].to_vec(),
                    None => vec![0.0; kd * vd],
                };
                let (start, end) = (self.offsets[s], self.offsets[s + 1]);
                let mut c0 = start;
                while c0 < end {
                    let len = c.min(end - c0);
                    self.chunk_step(head, c0, len, &mut state, &mut out);
                    c0 += len;
                }
                out.final_state[(s * hv + head) * kd * vd..][..kd * vd].copy_from_slice(&state);
            }
        }
        out
    }

    /// Row `t` of `x` (`[tokens, heads, dim]`) for head `head`.
    fn row(x: &[f32], t: usize, heads: usize, head: usize, dim: usize) -> &[f32] {
        &x[(t * heads + head) * dim..][..dim]
    }

    /// The gate's cumulative sum over one chunk, `[len, K]`, log2 units.
    fn gate_cumsum(&self, head: usize, c0: usize, len: usize) -> Vec<f32> {
        let kd = self.k;
        let mut acc = vec![0.0f32; kd];
        let mut gk = Vec::with_capacity(len * kd);
        let exp_a = self.gate.as_ref().map(|gate| gate.a_log[head].exp());
        for t in c0..c0 + len {
            let raw = Self::row(&self.g, t, self.hv, head, kd);
            for d in 0..kd {
                let mut x = raw[d];
                if let (Some(gate), Some(exp_a)) = (&self.gate, exp_a) {
                    if let Some(bias) = &gate.dt_bias {
                        x += bias[head * kd + d];
                    }
                    x = match gate.lower_bound {
                        // lowerBound · sigmoid(e^A · x), as 1 / (1 + exp(−e^A·x)).
                        Some(lb) => (1.0 / ((-(x * exp_a)).exp() + 1.0)) * lb,
                        // −e^A · softplus(x), softplus as max(x, 0) + ln(1 + exp(−|x|)).
                        None => (x.max(0.0) + ((-x.abs()).exp() + 1.0).ln()) * -exp_a,
                    };
                }
                acc[d] += x * RCP_LN2;
            }
            gk.extend_from_slice(&acc);
        }
        gk
    }

    /// One chunk of one (sequence, head): its outputs, and `state` carried past it.
    fn chunk_step(&self, head: usize, c0: usize, len: usize, state: &mut [f32], out: &mut Outputs) {
        let (hv, kd, vd, c) = (self.hv, self.k, self.v, self.chunk);
        let kh = head / (hv / self.h);
        let t_ = self.store;
        let q = |i: usize| Self::row(&self.q, c0 + i, self.h, kh, kd);
        let k = |i: usize| Self::row(&self.key, c0 + i, self.h, kh, kd);
        let v = |i: usize| Self::row(&self.value, c0 + i, hv, head, vd);
        let beta = |i: usize| self.beta[(c0 + i) * hv + head];
        let gk = self.gate_cumsum(head, c0, len);
        let g = |i: usize| &gk[i * kd..][..kd];

        // Scores: one reference token per block of 32 rows keeps every factor in range.
        let score = if t_ == Store::F16 && self.safe_gate { Store::Bf16 } else { t_ };
        let (lo, hi) = if score == Store::Bf16 {
            (-126.0 * LN2, 120.0 * LN2)
        } else {
            (-80.0 * LN2, 80.0 * LN2)
        };
        let mut aqk = vec![0.0f32; len * len];
        let mut akk = vec![0.0f32; len * len];
        let mut rb = 0;
        while rb < len {
            let rc = 32.min(len - rb);
            let r = (rb + rc / 2).min(len - 1);
            let cols = rb + rc;
            let factor = |x: &[f32], gi: &[f32], gj: &[f32]| -> Vec<f32> {
                (0..kd).map(|d| score.saturate(x[d] * exp2(gi[d] - gj[d], lo, hi))).collect()
            };
            let kgs: Vec<Vec<f32>> = (0..cols).map(|j| factor(k(j), g(r), g(j))).collect();
            for i in rb..cols {
                let qs = factor(q(i), g(i), g(r));
                let ks = factor(k(i), g(i), g(r));
                for (j, kg) in kgs.iter().enumerate() {
                    aqk[i * len + j] = dot(&qs, kg, 1);
                    akk[i * len + j] = dot(&ks, kg, 1);
                }
            }
            rb = cols;
        }

        // (I + diag(β)·tril(Akk, −1))⁻¹ in f32, by forward substitution.
        let a = |i: usize, j: usize| akk[i * len + j] * beta(i);
        let mut inv = vec![0.0f32; len * len];
        for i in 0..len {
            inv[i * len + i] = 1.0;
            for j in 0..i {
                let mut s = 0.0f32;
                for m in j..i {
                    s += a(i, m) * inv[m * len + j];
                }
                inv[i * len + j] = -s;
            }
        }
        let ainv: Vec<f32> = inv.iter().map(|&x| t_.saturate(x)).collect();
        let mut aqk_t = vec![0.0f32; len * len];
        for i in 0..len {
            for j in 0..=i {
                aqk_t[i * len + j] = t_.saturate(aqk[i * len + j] * self.scale);
            }
        }
        for i in 0..len {
            let at = (head * (out.aqk.len() / (hv * c)) + c0 + i) * c;
            out.aqk[at..at + len].copy_from_slice(&aqk_t[i * len..][..len]);
            out.akk[at..at + len].copy_from_slice(&ainv[i * len..][..len]);
        }

        // Gate products and the β-scaled seeds of w and u.
        let (elo, ehi) = (-80.0 * LN2, 80.0 * LN2);
        let mut qg = vec![0.0f32; len * kd];
        let mut wseed = vec![0.0f32; len * kd];
        let mut useed = vec![0.0f32; len * vd];
        let mut kg = vec![0.0f32; len * kd];
        let last = g(len - 1);
        for i in 0..len {
            for d in 0..kd {
                let e = exp2(g(i)[d], elo, ehi);
                qg[i * kd + d] = t_.saturate(q(i)[d] * e);
                wseed[i * kd + d] = t_.round(t_.saturate(k(i)[d] * e) * beta(i));
                kg[i * kd + d] = t_.saturate(k(i)[d] * exp2(last[d] - g(i)[d], elo, ehi));
            }
            for e in 0..vd {
                useed[i * vd + e] = t_.round(v(i)[e] * beta(i));
            }
        }
        // w = A⁻¹·wseed, u = A⁻¹·useed.
        let mut w = vec![0.0f32; len * kd];
        let mut u = vec![0.0f32; len * vd];
        for i in 0..len {
            let row = &ainv[i * len..][..len];
            for d in 0..kd {
                w[i * kd + d] = t_.saturate(dot(row, &wseed[d..], kd));
            }
            for e in 0..vd {
                u[i * vd + e] = t_.saturate(dot(row, &useed[e..], vd));
            }
        }

        // The state before this chunk as the GEMMs read it, then v_new and the new state.
        let h: Vec<f32> = state.iter().map(|&x| t_.round(x)).collect();
        let mut vnew = vec![0.0f32; len * vd];
        for i in 0..len {
            for e in 0..vd {
                let wh = dot(&w[i * kd..][..kd], &h[e..], vd);
                vnew[i * vd + e] = t_.round(u[i * vd + e] - wh);
            }
        }
        for d in 0..kd {
            let decay = (last[d] * LN2).exp();
            for e in 0..vd {
                let mut hw = 0.0f32;
                for i in 0..len {
                    hw += kg[i * kd + d] * vnew[i * vd + e];
                }
                state[d * vd + e] = state[d * vd + e] * decay + hw;
            }
        }

        // o = (qg·h)·scale + aqk·v_new.
        for i in 0..len {
            for e in 0..vd {
                let inter = dot(&qg[i * kd..][..kd], &h[e..], vd);
                let intra = dot(&aqk_t[i * len..][..len], &vnew[e..], vd);
                out.o[((c0 + i) * hv + head) * vd + e] = t_.saturate(inter * self.scale + intra);
            }
        }
    }
}
