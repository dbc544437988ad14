//! Dispatch of one group of requests (`docs/design/kda.md#batches-and-dispatch`): the short conv,
//! the gate and the recurrence, decodes and speculative decodes on the recurrent path, prefills on
//! the chunked path.
//!
//! The forget gate goes to the two paths differently (`docs/design/kda.md#behaviour-11`): a prefill
//! group hands the chunk kernel the raw logits `g1` with the gate's parameters and the kernel
//! applies the gate itself; a decode group activates its own rows with `KdaGate` first, as the
//! recurrent kernel takes the log decay. No gate is computed for rows that do not need it.
//!
//! A group whose tokens are one run of consecutive rows of the batch (the usual case: engines put
//! decodes first) works on views of the batch's tensors. Otherwise its rows are gathered into
//! group buffers (one copy per run) and its output is scattered back to the requests' own rows,
//! which is the merge by token position.

use std::ops::Range;

use crate::layer::error::Result;
use kda_core::device::Device;
use kda_core::dtype::DType;
use kda_core::hal::Backend;
use kda_core::kda::{
    CausalConv, CausalConvUpdate, ChunkGate, ChunkHostMeta, KdaChunk, KdaGate, KdaRecurrent,
};
use kda_core::op::Op;
use kda_core::tensor::Tensor;

use super::batch::{Group, GroupKind};
use super::cache::StateCache;

/// The per-token tensors of the live rows every group reads from and writes to.
pub(super) struct TokenInputs<B: Backend> {
    /// `[n, 3 lp]`: q, k, v before the conv.
    pub(super) qkv: Tensor<B>,
    /// `[n, lh, D]` bf16: the raw forget-gate logits.
    pub(super) g1: Tensor<B>,
    /// The gate's parameters, applied to `g1` by whichever op needs the log decay.
    pub(super) gate: ChunkGate<B>,
    /// `[n, lh]`: beta after the sigmoid, in the core operands' dtype.
    pub(super) beta: Tensor<B>,
    /// `[n, lh, D]` in the core operands' dtype (`docs/design/kda.md#core-operand-dtype`): the
    /// recurrence's output (written). The conv output (q, k, v) takes the same dtype.
    pub(super) core: Tensor<B>,
}

/// An i32 device tensor `[len]` holding `values` (per-request metadata).
pub(super) fn meta_tensor<B: Backend>(
    device: &Device<B>,
    stream: &B::Stream,
    values: &[i32],
) -> Result<Tensor<B>> {
    let t = device.alloc(DType::I32, &[values.len()])?;
    device.upload(stream, &t, values)?;
    Ok(t)
}

/// `x` in `dtype`: itself when it already is, else a converted copy (rounded once to nearest
/// even).
pub(super) fn to_dtype<B: Backend>(
    device: &Device<B>,
    stream: &B::Stream,
    x: &Tensor<B>,
    dtype: DType,
) -> Result<Tensor<B>> {
    if x.dtype() == dtype {
        return Ok(x.clone());
    }
    let y = device.alloc(dtype, x.shape())?;
    device.launch_labeled(stream, "cast", Op::Copy { src: x.clone(), dst: y.clone() })?;
    Ok(y)
}

/// The rows `runs` of `src` (along dimension 0) copied one after the other into a new tensor.
fn gather<B: Backend>(
    device: &Device<B>,
    stream: &B::Stream,
    src: &Tensor<B>,
    runs: &[Range<usize>],
    rows: usize,
) -> Result<Tensor<B>> {
    let mut shape = src.shape().to_vec();
    shape[0] = rows;
    let dst = device.alloc(src.dtype(), &shape)?;
    let mut at = 0;
    for run in runs {
        let (src, into) = (src.narrow(0, run.start, run.len())?, dst.narrow(0, at, run.len())?);
        device.launch_labeled(stream, "gather", Op::Copy { src, dst: into })?;
        at += run.len();
    }
    Ok(dst)
}

/// The inverse of [`gather`]: consecutive rows of `src` back to `runs` of `dst`.
fn scatter<B: Backend>(
    device: &Device<B>,
    stream: &B::Stream,
    src: &Tensor<B>,
    runs: &[Range<usize>],
    dst: &Tensor<B>,
) -> Result<()> {
    let mut at = 0;
    for run in runs {
        let (from, into) = (src.narrow(0, at, run.len())?, dst.narrow(0, run.start, run.len())?);
        device.launch_labeled(stream, "scatter", Op::Copy { src: from, dst: into })?;
        at += run.len();
    }
    Ok(())
}

/// The short conv and the recurrence of `group`, reading `inputs` and writing its rows of
/// `inputs.core` and its slots of `cache`.
#[allow(clippy::too_many_arguments)]
pub(super) fn run_group<B: Backend>(
    device: &Device<B>,
    stream: &B::Stream,
    group: &Group,
    inputs: &TokenInputs<B>,
    conv_weight: &Tensor<B>,
    cache: &mut StateCache<B>,
    scale: f32,
    chunk_state_slots: Option<&[i32]>,
) -> Result<()> {
    let b = device;
    let (tokens, requests) = (group.tokens(), group.requests());
    let _span =
        tracing::debug_span!("kda_layer.dispatch", kind = ?group.kind, requests, tokens).entered();
    let runs = group.runs();
    let (qkv, g1, beta, core) = match runs.as_slice() {
        [run] => (
            inputs.qkv.narrow(0, run.start, tokens)?,
            inputs.g1.narrow(0, run.start, tokens)?,
            inputs.beta.narrow(0, run.start, tokens)?,
            inputs.core.narrow(0, run.start, tokens)?,
        ),
        _ => {
            let core_shape = [&[tokens], &inputs.core.shape()[1..]].concat();
            (
                gather(b, stream, &inputs.qkv, &runs, tokens)?,
                gather(b, stream, &inputs.g1, &runs, tokens)?,
                gather(b, stream, &inputs.beta, &runs, tokens)?,
                b.alloc(inputs.core.dtype(), &core_shape)?,
            )
        }
    };
    let channels = qkv.shape()[1];
    let (heads, head_dim) = (g1.shape()[1], g1.shape()[2]);
    let lp = heads * head_dim;
    let conv_out = b.alloc(inputs.core.dtype(), &[tokens, channels])?;
    let state_slots = meta_tensor(b, stream, &group.state_slots)?;
    let conv_state = cache.conv().clone();
    let recurrent_state = cache.recurrent().clone();

    if group.kind == GroupKind::Prefill {
        let offsets = meta_tensor(b, stream, &group.local_offsets())?;
        let has_initial_state = meta_tensor(b, stream, &group.has_initial_state)?;
        b.launch(
            stream,
            Op::CausalConv(CausalConv {
                x: qkv,
                weight: conv_weight.clone(),
                query_start_loc: offsets.clone(),
                state_slots: state_slots.clone(),
                has_initial_state: has_initial_state.clone(),
                state: conv_state,
                y: conv_out.clone(),
            }),
        )?;
        let [q, k, v] = split_qkv(&conv_out, lp, &[tokens, heads, head_dim])?;
        b.launch(
            stream,
            Op::KdaChunk(KdaChunk {
                chunk_state_slots: chunk_state_slots
                    .map(|slots| meta_tensor(b, stream, slots))
                    .transpose()?,
                host_meta: Some(ChunkHostMeta {
                    cu_seqlens: group.local_offsets().into(),
                    state_slots: group.state_slots.as_slice().into(),
                    has_initial_state: group.has_initial_state.as_slice().into(),
                }),
                q,
                k,
                v,
                g: g1,
                gate: Some(inputs.gate.clone()),
                beta,
                cu_seqlens: offsets,
                state_slots,
                has_initial_state,
                state: recurrent_state,
                o: core.clone(),
                scale,
                qk_l2norm: true,
            }),
        )?;
    } else {
        let n = tokens / requests.max(1);
        let accepted = match group.kind {
            GroupKind::Speculative { .. } => Some(meta_tensor(b, stream, &group.num_accepted)?),
            _ => None,
        };
        let conv_slots = meta_tensor(b, stream, &group.conv_slots)?;
        b.launch(
            stream,
            Op::CausalConvUpdate(CausalConvUpdate {
                x: qkv.reshape(&[requests, n, channels])?,
                weight: conv_weight.clone(),
                state_slots: conv_slots,
                num_accepted_tokens: accepted.clone(),
                state: conv_state,
                y: conv_out.reshape(&[requests, n, channels])?,
            }),
        )?;
        let [q, k, v] = split_qkv(&conv_out, lp, &[requests, n, heads, head_dim])?;
        let gate = b.alloc(DType::F32, g1.shape())?;
        let ChunkGate { a_log, dt_bias, form } = inputs.gate.clone();
        b.launch(stream, Op::KdaGate(KdaGate { g1, a_log, dt_bias, form, g: gate.clone() }))?;
        b.launch(
            stream,
            Op::KdaRecurrent(KdaRecurrent {
                q,
                k,
                v,
                g: gate.reshape(&[requests, n, heads, head_dim])?,
                beta: beta.reshape(&[requests, n, heads])?,
                state_slots: state_slots.reshape(&[requests, n])?,
                num_accepted_tokens: accepted,
                state: recurrent_state,
                o: core.reshape(&[requests, n, heads, head_dim])?,
                scale,
                qk_l2norm: true,
            }),
        )?;
    }
    if runs.len() > 1 {
        scatter(b, stream, &core, &runs, &inputs.core)?;
    }
    Ok(())
}

/// The q, k and v column blocks of the conv output `[T, 3 lp]`, each viewed as `shape`.
fn split_qkv<B: Backend>(
    conv_out: &Tensor<B>,
    lp: usize,
    shape: &[usize],
) -> Result<[Tensor<B>; 3]> {
    let parts = conv_out.split(1, &[lp, lp, lp])?;
    Ok([parts[0].reshape(shape)?, parts[1].reshape(shape)?, parts[2].reshape(shape)?])
}
