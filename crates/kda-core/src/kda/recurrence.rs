//! The delta-rule recurrence (`docs/design/kda.md#recurrence`), token by token for decode and
//! speculative decode ([`KdaRecurrent`]) and chunked for prefill ([`KdaChunk`]).
//!
//! Per head, with state `S` (`[K, V]` in the formulas), for each token:
//!
//! ```text
//! S   = S * exp(g_t)[:, None]          # decay scales the key dimension
//! u   = beta_t * (v_t - S^T k_t)       # uses the decayed state
//! S   = S + k_t ⊗ u
//! o_t = S^T q_t                        # uses the updated state
//! ```
//!
//! where `q` was L2-normalised (optionally, see `qk_l2norm`) and multiplied by `scale`, and `k`
//! L2-normalised (same flag). The state cache is **v-first**: a slot holds `[H, V, K]` f32, i.e.
//! `S^T` per head, as the Ascend kernels take it. (`kda core` reads and writes the K-first
//! `[B, H, K, V]` of flash-linear-attention; to the ops that is just a transposed view.)

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::resource::Resources;
use crate::tensor::Tensor;

use super::check;
use super::gate::ChunkGate;

/// The chunk length of the chunked form.
pub const CHUNK_SIZE: usize = 64;

/// Sizes of a validated [`KdaRecurrent`] or [`KdaChunk`].
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct RecurrenceDims {
    /// Requests (`B`).
    pub batch: usize,
    /// Tokens: per request for [`KdaRecurrent`] (`n`), in the flat batch for [`KdaChunk`] (`T`).
    pub tokens: usize,
    /// Heads (`H`).
    pub heads: usize,
    /// Key dim (`K`).
    pub k: usize,
    /// Value dim (`V`).
    pub v: usize,
    /// State slots (`N`).
    pub slots: usize,
}

/// The recurrence token by token, for decode (`n = 1`) and speculative decode (`n = 1 +
/// num_spec` tokens per request).
///
/// Request `b` starts from the state in slot `state_slots[b, a-1]` with
/// `a = num_accepted_tokens[b]` (1 when absent) and writes the state after its token `t` into
/// slot `state_slots[b, t]`; a negative entry there means "do not keep this one". The initial
/// state is read before anything is written, so it may share a slot with a write. A request
/// whose initial slot is negative is padding: its outputs are zeroed and no state is written.
/// Slots and counts are device data, checked when the op runs. NaN in the operands propagates
/// to exactly the outputs and states that depend on it.
#[derive(Clone, Debug)]
pub struct KdaRecurrent<B: Resources> {
    /// `[B, n, H, K]` (bf16, f16 or f32).
    pub q: Tensor<B>,
    /// `[B, n, H, K]`.
    pub k: Tensor<B>,
    /// `[B, n, H, V]`.
    pub v: Tensor<B>,
    /// Log decay `[B, n, H, K]` (already activated, normally `<= 0`).
    pub g: Tensor<B>,
    /// `[B, n, H]` (already through the sigmoid).
    pub beta: Tensor<B>,
    /// `[B, n]` i32 state slots (see above).
    pub state_slots: Tensor<B>,
    /// `[B]` i32 in `1 ..= n`; `None` means 1 for every request.
    pub num_accepted_tokens: Option<Tensor<B>>,
    /// State cache `[N, H, V, K]` f32 (v-first), read and written in place.
    pub state: Tensor<B>,
    /// Output `[B, n, H, V]` (bf16, f16 or f32).
    pub o: Tensor<B>,
    /// Multiplies q after the optional L2 norm (`K^-0.5` in the models).
    pub scale: f32,
    /// L2-normalise q and k first (eps 1e-6 inside the square root).
    pub qk_l2norm: bool,
}

impl<B: Resources> KdaRecurrent<B> {
    pub const NAME: &'static str = "kda_recurrent";

    pub fn inputs(&self) -> Vec<(&'static str, &Tensor<B>)> {
        let mut v = vec![
            ("q", &self.q),
            ("k", &self.k),
            ("v", &self.v),
            ("g", &self.g),
            ("beta", &self.beta),
            ("state_slots", &self.state_slots),
        ];
        if let Some(a) = &self.num_accepted_tokens {
            v.push(("num_accepted_tokens", a));
        }
        v
    }

    /// The state is read and written; as an output its write covers the read for hazard
    /// analysis.
    pub fn outputs(&self) -> Vec<(&'static str, &Tensor<B>)> {
        vec![("state", &self.state), ("o", &self.o)]
    }

    /// Check shapes, dtypes and the scale and return the sizes.
    pub fn validate(&self) -> Result<RecurrenceDims> {
        const OP: &str = "kda_recurrent";
        let [batch, tokens, heads, k] = check::dims(OP, "q", &self.q, "[B, n, H, K]")?;
        let v = check_operands(OP, self.into(), &[batch, tokens], "B, n")?;
        check::meta(OP, "state_slots", &self.state_slots, &[batch, tokens], "B, n of q")?;
        if let Some(a) = &self.num_accepted_tokens {
            check::meta(OP, "num_accepted_tokens", a, &[batch], "B of q")?;
        }
        let slots = check_state(OP, &self.state, heads, k, v)?;
        check::param(OP, "scale", self.scale, true, "finite")?;
        Ok(RecurrenceDims { batch, tokens, heads, k, v, slots })
    }
}

/// The chunked form for prefill: a flat batch of requests of any lengths, chunks of
/// [`CHUNK_SIZE`] tokens (the last one shorter), agreeing with the recurrence within fp32
/// rounding.
///
/// Request `b` owns tokens `cu_seqlens[b] .. cu_seqlens[b+1]` and state slot `state_slots[b]`:
/// it starts from that slot's state when `has_initial_state[b]` is nonzero (else from zero) and
/// writes its final state there. A negative slot marks a padding request: its outputs are zeroed
/// and no state is touched. Tokens that belong to no request are left as they are. Offsets and
/// slots are device data, checked when the op runs.
///
/// With [`gate`](Self::gate) the op takes the raw forget-gate logits in `g` and applies the
/// gate itself (`docs/design/kda.md#gate`, `docs/design/kda.md#behaviour-11`): every log decay it
/// uses is exactly, bit for bit, what [`KdaGate`](super::KdaGate) computes from the same logits and
/// parameters, so the result equals `KdaGate` followed by this op without the gate, while the
/// activated gate never goes through memory.
///
/// With [`chunk_state_slots`](Self::chunk_state_slots) the op also keeps the state at chunk
/// boundaries, for prefix caching (`docs/design/kda.md#chunk-boundary-states`): the state after
/// the last token of every chunk of every request, written (v-first, f32) into the state slot
/// the caller names for that chunk.
///
/// NaN in the operands propagates and never fails the op: it makes NaN every output and state
/// entry that depends on it, and may also reach the outputs of the earlier tokens of its
/// 64-token chunk (the chunked products multiply it by zeros); other heads and requests are
/// unaffected.
#[derive(Clone, Debug)]
pub struct KdaChunk<B: Resources> {
    /// `[T, H, K]` (bf16, f16 or f32).
    pub q: Tensor<B>,
    /// `[T, H, K]`.
    pub k: Tensor<B>,
    /// `[T, H, V]`.
    pub v: Tensor<B>,
    /// `[T, H, K]`: the log decay (already activated, normally `<= 0`), or with
    /// [`gate`](Self::gate) the raw logits `g1` (bf16, f16 or f32).
    pub g: Tensor<B>,
    /// `Some`: `g` holds raw logits, activated in the kernel with these parameters
    /// (`a_log` `[H]`, `dt_bias` `[H, K]`, the form) as [`KdaGate`](super::KdaGate) does.
    pub gate: Option<ChunkGate<B>>,
    /// `[T, H]` (already through the sigmoid).
    pub beta: Tensor<B>,
    /// `[B + 1]` i32: non-decreasing token offsets, the last at most `T`.
    pub cu_seqlens: Tensor<B>,
    /// `[B]` i32 state slots (negative: padding).
    pub state_slots: Tensor<B>,
    /// `[B]` i32: nonzero starts from the slot's state, zero from a zero state.
    pub has_initial_state: Tensor<B>,
    /// Optional chunk-boundary states: `[NC]` i32 state slots, one per chunk of every request in
    /// order (request `b` has `ceil(len_b / 64)` chunks, padding requests included, so
    /// `NC = Σ_b ceil(len_b / 64)`). The state after the last token of request `b`'s chunk `c`
    /// (after token `64·(c+1)`, or the request's last token for its last chunk) is written to
    /// the slot named there; a negative entry keeps nothing. These slots are written after every
    /// initial state has been read and must differ from each other and from every entry of
    /// `state_slots`; like them they are device data, checked when the op runs. (This is
    /// `aclnnChunkKdaFwd`'s `hOut` and flash-linear-attention's per-chunk `h`, shifted by one
    /// chunk, in f32 and written where the caller caches it instead of into an `[NC, H, V, K]`
    /// array.)
    pub chunk_state_slots: Option<Tensor<B>>,
    /// State cache `[N, H, V, K]` f32 (v-first), read and written in place.
    pub state: Tensor<B>,
    /// Output `[T, H, V]` (bf16, f16 or f32).
    pub o: Tensor<B>,
    /// Multiplies q after the optional L2 norm (`K^-0.5` in the models).
    pub scale: f32,
    /// L2-normalise q and k first (eps 1e-6 inside the square root).
    pub qk_l2norm: bool,
}

/// Chunks of a request of `len` tokens: entries it owns in [`KdaChunk::chunk_state_slots`].
pub fn chunks_of(len: usize) -> usize {
    len.div_ceil(CHUNK_SIZE)
}

impl<B: Resources> KdaChunk<B> {
    pub const NAME: &'static str = "kda_chunk";

    pub fn inputs(&self) -> Vec<(&'static str, &Tensor<B>)> {
        let mut v = vec![
            ("q", &self.q),
            ("k", &self.k),
            ("v", &self.v),
            ("g", &self.g),
            ("beta", &self.beta),
            ("cu_seqlens", &self.cu_seqlens),
            ("state_slots", &self.state_slots),
            ("has_initial_state", &self.has_initial_state),
        ];
        if let Some(gate) = &self.gate {
            v.extend(gate.inputs());
        }
        if let Some(c) = &self.chunk_state_slots {
            v.push(("chunk_state_slots", c));
        }
        v
    }

    /// The state is read and written (see [`KdaRecurrent::outputs`]); the chunk-boundary states
    /// go into the same tensor.
    pub fn outputs(&self) -> Vec<(&'static str, &Tensor<B>)> {
        vec![("state", &self.state), ("o", &self.o)]
    }

    /// Check shapes, dtypes, the scale and the gate's parameters and return the sizes.
    pub fn validate(&self) -> Result<RecurrenceDims> {
        const OP: &str = "kda_chunk";
        let [tokens, heads, k] = check::dims(OP, "q", &self.q, "[T, H, K]")?;
        let v = check_operands(OP, self.into(), &[tokens], "T")?;
        if let Some(gate) = &self.gate {
            gate.validate(OP, [heads, k], "g")?;
        }
        let [starts] = check::dims(OP, "cu_seqlens", &self.cu_seqlens, "[B + 1]")?;
        let batch = starts.checked_sub(1).ok_or_else(|| Error::Shape {
            op: OP,
            param: "cu_seqlens",
            expected: "[B + 1] with B + 1 >= 1".into(),
            actual: self.cu_seqlens.shape().to_vec(),
        })?;
        check::meta(OP, "cu_seqlens", &self.cu_seqlens, &[batch + 1], "B + 1")?;
        check::meta(OP, "state_slots", &self.state_slots, &[batch], "B of cu_seqlens")?;
        let why = "B of cu_seqlens";
        check::meta(OP, "has_initial_state", &self.has_initial_state, &[batch], why)?;
        if let Some(c) = &self.chunk_state_slots {
            // NC depends on the offsets (device data); only the rank is known here.
            let [nc] = check::dims(OP, "chunk_state_slots", c, "[NC]")?;
            check::meta(OP, "chunk_state_slots", c, &[nc], "NC = Σ_b ceil(len_b / 64)")?;
        }
        let slots = check_state(OP, &self.state, heads, k, v)?;
        check::param(OP, "scale", self.scale, true, "finite")?;
        Ok(RecurrenceDims { batch, tokens, heads, k, v, slots })
    }
}

/// The per-token operands of either form.
struct Operands<'a, B: Resources> {
    q: &'a Tensor<B>,
    k: &'a Tensor<B>,
    v: &'a Tensor<B>,
    g: &'a Tensor<B>,
    beta: &'a Tensor<B>,
    o: &'a Tensor<B>,
}

impl<'a, B: Resources> From<&'a KdaRecurrent<B>> for Operands<'a, B> {
    fn from(op: &'a KdaRecurrent<B>) -> Self {
        Self { q: &op.q, k: &op.k, v: &op.v, g: &op.g, beta: &op.beta, o: &op.o }
    }
}

impl<'a, B: Resources> From<&'a KdaChunk<B>> for Operands<'a, B> {
    fn from(op: &'a KdaChunk<B>) -> Self {
        Self { q: &op.q, k: &op.k, v: &op.v, g: &op.g, beta: &op.beta, o: &op.o }
    }
}

/// q, k, g `[lead.., H, K]`, v and o `[lead.., H, V]`, beta `[lead.., H]`, all floats, where
/// `lead` are the leading sizes of q (already checked for rank); returns `V`.
fn check_operands<B: Resources>(
    op: &'static str,
    t: Operands<'_, B>,
    lead: &[usize],
    lead_names: &str,
) -> Result<usize> {
    for (param, x) in [("q", t.q), ("k", t.k), ("v", t.v), ("g", t.g), ("beta", t.beta), ("o", t.o)]
    {
        check::float(op, param, x)?;
    }
    let heads = t.q.shape()[lead.len()];
    let with = |tail: &[usize]| [lead, tail].concat();
    check::shape(op, "k", t.k, t.q.shape(), "shape of q")?;
    check::shape(op, "g", t.g, t.q.shape(), "shape of q")?;
    check::shape(op, "beta", t.beta, &with(&[heads]), &format!("{lead_names}, H of q"))?;
    let v_shape = t.v.shape();
    let vdim = match v_shape.split_last() {
        Some((&vdim, front)) if front == with(&[heads]).as_slice() => vdim,
        _ => {
            return Err(Error::Shape {
                op,
                param: "v",
                expected: format!("{:?} + [V] ({lead_names}, H of q)", with(&[heads])),
                actual: v_shape.to_vec(),
            });
        }
    };
    check::shape(op, "o", t.o, &with(&[heads, vdim]), &format!("{lead_names}, H of q, V of v"))?;
    Ok(vdim)
}

/// The v-first state cache `[N, H, V, K]` f32; returns `N`.
fn check_state<B: Resources>(
    op: &'static str,
    state: &Tensor<B>,
    heads: usize,
    k: usize,
    v: usize,
) -> Result<usize> {
    check::dtype(op, "state", state, DType::F32)?;
    let slots = state.shape().first().copied().unwrap_or(0);
    let why = "N slots, H of q, V of v, K of q: v-first";
    if state.shape().len() != 4 {
        return Err(Error::Shape {
            op,
            param: "state",
            expected: format!("[N, {heads}, {v}, {k}] ({why})"),
            actual: state.shape().to_vec(),
        });
    }
    check::shape(op, "state", state, &[slots, heads, v, k], why)?;
    Ok(slots)
}
