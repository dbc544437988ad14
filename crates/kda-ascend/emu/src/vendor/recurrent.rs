//! `aclnnRecurrentGatedDeltaRule`'s arithmetic on host vectors, at the precision of its kernel
//! source (hicann/ops-transformer
//! `attention/recurrent_gated_delta_rule/op_kernel/arch35/recurrent_gated_delta_rule.h`, class
//! `RGDR`; the only kernel source the repository publishes, applied here to every SoC):
//!
//! - q, k, v and β are widened to f32 (`Cast(…, CAST_NONE)`), q then multiplied by `scale` in
//!   f32 (`CopyInQK`);
//! - the state of a request's head is read once (`CopyInState`, a bf16 state widened) and carried
//!   in f32 through the request's tokens;
//! - per token: the decay `exp(gk + g)` in f32 (`UpdateGamaBeta`), `S ← decay ⊙ S`, `kᵀS` by an
//!   f32 row sum, `δ = (v − kᵀS)·β`, `S ← δ ⊗ k + S` (`Compute`), the state after the token
//!   stored to `ssmStateIndices[t]` in the state's dtype (`CopyOutState`: `CAST_RINT` for bf16),
//!   and `o = (q·scale)ᵀS` by an f32 row sum stored in `out`'s dtype (`CopyAttentionOut`,
//!   `CAST_RINT`);
//! - the initial state of request `b` is slot `ssmStateIndices[seq0 + numAcceptedTokens[b] − 1]`
//!   (`Process`); requests of no tokens are skipped.
//!
//! Not modelled: the order `ReduceSum` adds a row in (index order here), whether the outer
//! product is fused with its add, and the NPU's `Exp` (IEEE here).

use crate::host::Store;

/// One call's operands, widened.
#[derive(Clone, Debug)]
pub(crate) struct Recurrent {
    pub nk: usize,
    pub nv: usize,
    pub dk: usize,
    pub dv: usize,
    /// `[T, Nk, Dk]`.
    pub q: Vec<f32>,
    pub key: Vec<f32>,
    /// `[T, Nv, Dv]`.
    pub value: Vec<f32>,
    /// `[T, Nv]`.
    pub beta: Vec<f32>,
    /// `[T, Nv]` and `[T, Nv, Dk]` log decays, each optional.
    pub g: Option<Vec<f32>>,
    pub gk: Option<Vec<f32>>,
    /// Tokens per request.
    pub lens: Vec<i64>,
    /// The state slot of every token.
    pub indices: Vec<i64>,
    /// Accepted tokens per request, if given.
    pub accepted: Option<Vec<i64>>,
    pub scale: f32,
    /// `out`'s dtype and the state's.
    pub out: Store,
    pub state_store: Store,
}

impl Recurrent {
    /// Run over `state` (`[blocks, Nv, Dv, Dk]`, updated in place); returns `out` `[T, Nv, Dv]`
    /// rounded to its dtype, or the first slot or length out of range.
    pub(crate) fn run(&self, state: &mut [f32]) -> Result<Vec<f32>, String> {
        let (nk, nv, dk, dv) = (self.nk, self.nv, self.dk, self.dv);
        let tokens = self.indices.len();
        let block = nv * dv * dk;
        let blocks = state.len() / block.max(1);
        let slot = |t: usize| -> Result<usize, String> {
            let s = *self.indices.get(t).ok_or(format!("token {t} has no state index"))?;
            usize::try_from(s)
                .ok()
                .filter(|&s| s < blocks)
                .ok_or(format!("ssmStateIndices[{t}] = {s} outside 0..{blocks}"))
        };
        let mut out = vec![0.0f32; tokens * nv * dv];
        let mut seq1 = 0usize;
        for (b, &len) in self.lens.iter().enumerate() {
            let len = usize::try_from(len).map_err(|_| format!("actualSeqLengths[{b}] = {len}"))?;
            let seq0 = seq1;
            seq1 += len;
            if seq1 > tokens {
                return Err(format!("actualSeqLengths sum past T = {tokens}"));
            }
            if len == 0 {
                continue;
            }
            let first = match &self.accepted {
                Some(a) => {
                    let n = a.get(b).copied().unwrap_or(1);
                    usize::try_from(n - 1)
                        .ok()
                        .filter(|&n| n < len)
                        .ok_or(format!("numAcceptedTokens[{b}] = {n} for {len} tokens"))?
                }
                None => 0,
            };
            let init = slot(seq0 + first)?;
            for head in 0..nv {
                let kh = head / (nv / nk);
                let mut s = state[(init * nv + head) * dv * dk..][..dv * dk].to_vec();
                for t in seq0..seq1 {
                    let q: Vec<f32> = self.q[(t * nk + kh) * dk..][..dk]
                        .iter()
                        .map(|&x| x * self.scale)
                        .collect();
                    let k = &self.key[(t * nk + kh) * dk..][..dk];
                    let v = &self.value[(t * nv + head) * dv..][..dv];
                    let beta = self.beta[t * nv + head];
                    let decay: Vec<f32> = (0..dk)
                        .map(|d| {
                            let mut x =
                                self.gk.as_ref().map_or(0.0, |gk| gk[(t * nv + head) * dk + d]);
                            if let Some(g) = &self.g {
                                x += g[t * nv + head];
                            }
                            x.exp()
                        })
                        .collect();
                    for e in 0..dv {
                        let row = &mut s[e * dk..][..dk];
                        for (x, a) in row.iter_mut().zip(&decay) {
                            *x *= a;
                        }
                        let mut kv = 0.0f32;
                        for (x, kk) in row.iter().zip(k) {
                            kv += kk * *x;
                        }
                        let delta = (v[e] - kv) * beta;
                        for (x, kk) in row.iter_mut().zip(k) {
                            *x += delta * kk;
                        }
                        let mut o = 0.0f32;
                        for (x, qq) in row.iter().zip(&q) {
                            o += qq * *x;
                        }
                        out[(t * nv + head) * dv + e] = self.out.round(o);
                    }
                    let dst = slot(t)?;
                    let at = (dst * nv + head) * dv * dk;
                    for (o, x) in state[at..at + dv * dk].iter_mut().zip(&s) {
                        *o = self.state_store.round(*x);
                    }
                }
            }
        }
        Ok(out)
    }
}
