//! The KDA layer (`docs/design/kda.md#the-layer-forward`): projections through a
//! [schedule](crate::schedule) → dispatch (short conv, gate, chunked prefill / recurrent decode /
//! speculative decode) → gated RMSNorm → `o_proj`, over a continuous-batching batch, writing into
//! the caller's output buffer and the caller's [`StateCache`].
//!
//! - [`batch`]: [`BatchMeta`] and its validation into a [`DispatchGroups`];
//! - [`cache`]: [`StateCache`], per-slot recurrent (v-first) and conv state;
//! - [`weights`]: [`LayerDeviceWeights`], one rank's loaded weights on a device;
//! - `dispatch`: the per-group conv, gate and recurrence launches (prefills hand the raw gate
//!   to the chunk kernel, which applies it: `docs/design/kda.md#behaviour-11`), on operands of
//!   the dtype [`LayerOptions::core_operands`] chooses (`docs/design/kda.md#core-operand-dtype`).
//!
//! [`KdaLayer::forward`] checks everything it can (shapes, dtypes, metadata, slots, aliasing)
//! before it launches anything, so a rejected call leaves the cache and the output as they were.

pub mod auto;
pub mod batch;
pub mod cache;
mod dispatch;
pub mod error;
pub mod keep;
pub mod weights;

pub use auto::{BatchShape, Choice, LayerPlan, PLAN_CONFIGS, PlanConfig};
pub use batch::{BatchError, BatchMeta, DispatchGroups, Group, GroupKind, RequestSlots};
pub use cache::{CacheDims, StateCache};
pub use error::KeepError;
pub use error::LayerError;
pub use keep::KeepState;
pub use weights::{ForgetProjection, LayerDeviceWeights};

use crate::config::{KdaConfig, LayerDims, Tp};
use crate::layer::error::Result;
pub use crate::schedule::QkvPath;
use crate::schedule::{
    MatrixOverlap, Mutation, ProjectionSchedule, QkvBfgProjection, QkvWeight, prepare_beta,
};
use crate::weights::{LayerWeights, LoadOptions, TensorSource, load_layer};
use kda_core::device::Device;
use kda_core::dtype::DType;
use kda_core::error::Error;
use kda_core::hal::Backend;
use kda_core::kda::{ChunkGate, GateForm, GatedRmsNorm, KdaGate, ZeroPadding};
use kda_core::op::Op;
use kda_core::resource::{BufferHandle, Capabilities};
use kda_core::tensor::Tensor;

/// Where dispatch takes beta from (`docs/design/schedule.md#the-beta-contract`).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash)]
pub enum BetaInput {
    /// The mixed path: the projection's fp32 sigmoid output, only sliced.
    #[default]
    Preprocessed,
    /// The ordinary path: the raw B columns of the fused BFG output; dispatch applies the fp32
    /// sigmoid to the live rows.
    Raw,
}

/// The dtype of the recurrence's operands: q, k and v after the short conv, beta, and the core
/// output (`docs/design/kda.md#core-operand-dtype`). The state stays f32 v-first either way.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash)]
pub enum CoreOperands {
    /// Everything in f32 (the default where the backend has no native bf16 KDA core).
    #[default]
    F32,
    /// bf16 operands, as serving engines run the core in the model dtype; what CANN's
    /// `aclnnChunkKdaFwd` and `aclnnRecurrentGatedDeltaRule` take.
    Bf16,
}

impl CoreOperands {
    /// What a backend with `caps` runs when the layer leaves the choice open: bf16 where the
    /// backend's tuned KDA operators take it ([`Capabilities::bf16_core`]), f32 otherwise.
    pub fn for_capabilities(caps: &Capabilities) -> Self {
        if caps.bf16_core { Self::Bf16 } else { Self::F32 }
    }

    /// The dtype of the operands.
    pub fn dtype(self) -> DType {
        match self {
            Self::F32 => DType::F32,
            Self::Bf16 => DType::BF16,
        }
    }
}

/// How a layer runs; everything has the default a backend's capabilities suggest.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct LayerOptions {
    /// `None`: overlapped where streams run concurrently, serial otherwise.
    pub schedule: Option<ProjectionSchedule>,
    /// `None`: what the backend's capabilities choose.
    pub matrix_overlap: Option<MatrixOverlap>,
    pub forget: ForgetProjection,
    pub beta: BetaInput,
    /// `None`: what the backend's capabilities choose ([`CoreOperands::for_capabilities`]).
    pub core_operands: Option<CoreOperands>,
    /// The QKV precision of an MXFP8 checkpoint (`docs/design/kda.md#qkv-precision`). `None`:
    /// MXFP8 where the backend runs the MX ops natively, bf16 otherwise.
    pub qkv: Option<QkvPath>,
    /// An edit to the overlapped schedule's event order, for the tests and `kda check`'s
    /// self-test that show a broken schedule is caught. Not for production use.
    #[doc(hidden)]
    pub mutation: Mutation,
}

/// The intermediate tensors of one forward, for debugging (`kda layer --dump`). Token-indexed
/// tensors hold the live tokens only.
#[derive(Clone, Debug)]
pub struct LayerTrace<B: Backend> {
    /// `[n, 3 lp]` bf16: q, k, v before the short conv.
    pub mixed_qkv: Tensor<B>,
    /// `[n, lh]` after the sigmoid, in the core operands' dtype ([`CoreOperands`]).
    pub beta: Tensor<B>,
    /// `[n, lh, D]` bf16: raw forget-gate logits.
    pub g1: Tensor<B>,
    /// `[n, lh, D]` f32: the activated log decay. Computed for the trace only: the forward
    /// itself activates the gate inside the chunk kernel for prefills and per decode group.
    pub gate: Tensor<B>,
    /// `[n, lh, D]` bf16: output-gate logits.
    pub g2: Tensor<B>,
    /// `[n, lh, D]` in the core operands' dtype: the recurrence's output, before the norm.
    pub core_attn_out: Tensor<B>,
}

/// One KDA layer on one TP rank.
#[derive(Debug)]
pub struct KdaLayer<B: Backend> {
    device: Device<B>,
    dims: LayerDims,
    layer: usize,
    gate: GateForm,
    eps: f32,
    beta: BetaInput,
    operands: CoreOperands,
    projection: QkvBfgProjection<B>,
    weights: LayerDeviceWeights<B>,
}

impl<B: Backend> KdaLayer<B> {
    /// Build the layer from one rank's loaded weights, uploading them on `stream`.
    pub fn new(
        device: &Device<B>,
        stream: &B::Stream,
        weights: &LayerWeights,
        options: LayerOptions,
    ) -> Result<Self> {
        let _span = tracing::debug_span!("kda_layer.new", layer = weights.layer).entered();
        let caps = device.info().capabilities;
        let uploaded =
            LayerDeviceWeights::upload(device, stream, weights, options.forget, options.qkv)?;
        let schedule =
            options.schedule.unwrap_or_else(|| ProjectionSchedule::for_capabilities(&caps));
        let policy =
            options.matrix_overlap.unwrap_or_else(|| MatrixOverlap::for_capabilities(&caps));
        let projection = QkvBfgProjection::new(device, uploaded.projection.clone(), schedule)?
            .with_matrix_overlap(policy)
            .with_mutation(options.mutation);
        let eps = weights.rms_norm_eps as f32;
        if !(eps.is_finite() && eps >= 0.0) {
            return Err(Error::Param {
                op: "kda_layer",
                param: "rms_norm_eps",
                expected: "finite and >= 0 as f32".into(),
                actual: weights.rms_norm_eps.to_string(),
            }
            .into());
        }
        Ok(Self {
            device: device.clone(),
            dims: weights.dims,
            layer: weights.layer,
            gate: weights.gate,
            eps,
            beta: options.beta,
            operands: options
                .core_operands
                .unwrap_or_else(|| CoreOperands::for_capabilities(&caps)),
            projection,
            weights: uploaded,
        })
    }

    /// Load layer `layer` of `config` for TP position `tp` from `source` and build it.
    pub fn load(
        device: &Device<B>,
        stream: &B::Stream,
        source: &dyn TensorSource,
        config: &KdaConfig,
        tp: Tp,
        layer: usize,
        options: LayerOptions,
    ) -> Result<Self> {
        let loaded = load_layer(source, config, tp, layer, LoadOptions::default())?;
        Self::new(device, stream, &loaded.weights, options)
    }

    pub fn dims(&self) -> &LayerDims {
        &self.dims
    }

    pub fn schedule(&self) -> ProjectionSchedule {
        self.projection.schedule()
    }

    /// The dtype of the recurrence's operands ([`CoreOperands`]).
    pub fn core_operands(&self) -> CoreOperands {
        self.operands
    }

    /// The precision the QKV projection runs in ([`QkvPath`]): what `LayerOptions::qkv` asked
    /// for, or the backend's choice.
    pub fn qkv_path(&self) -> QkvPath {
        match self.projection.weights().qkv() {
            QkvWeight::Mxfp8 { .. } => QkvPath::Mxfp8,
            QkvWeight::Bf16 { .. } => QkvPath::Bf16,
        }
    }

    pub fn projection(&self) -> &QkvBfgProjection<B> {
        &self.projection
    }

    pub fn weights(&self) -> &LayerDeviceWeights<B> {
        &self.weights
    }

    /// The sizes of a cache for this layer with `slots` slots and room for `num_spec`
    /// speculative tokens per step.
    pub fn cache_dims(&self, slots: usize, num_spec: usize) -> CacheDims {
        CacheDims {
            slots,
            heads: self.dims.local_heads,
            head_dim: self.dims.head_dim,
            conv_width: self.dims.conv_width,
            num_spec,
        }
    }

    /// A zeroed cache for this layer (see [`Self::cache_dims`]).
    pub fn new_cache(
        &self,
        stream: &B::Stream,
        slots: usize,
        num_spec: usize,
    ) -> Result<StateCache<B>> {
        Ok(StateCache::new(&self.device, stream, self.cache_dims(slots, num_spec))?)
    }

    /// Run the layer on `hidden_states` `[T, Hd]` for the batch `meta`, reading and updating
    /// `cache`, and write this rank's partial output (before the all-reduce) into `out`
    /// `[T, Hd]` (any float dtype). Rows past the live tokens are zero; an empty batch only
    /// zeroes `out`. Returns once everything is queued on `stream`.
    pub fn forward(
        &self,
        stream: &B::Stream,
        hidden_states: &Tensor<B>,
        meta: &BatchMeta,
        cache: &mut StateCache<B>,
        out: &mut Tensor<B>,
    ) -> Result<()> {
        self.run(stream, hidden_states, meta, &[], cache, out, false).map(|_| ())
    }

    /// [`Self::forward`], also keeping the states `keep` asks for: for each entry, the
    /// recurrent and conv state of a prefill request after `position` tokens of its sequence,
    /// written into cache slot `slot` (`docs/design/kda.md#chunk-boundary-states`). A position is
    /// `num_computed_tokens + 64·j` or the request's end; a kept slot is used by no request of
    /// the batch and by no other entry. Everything is checked before anything is launched.
    pub fn forward_keeping_states(
        &self,
        stream: &B::Stream,
        hidden_states: &Tensor<B>,
        meta: &BatchMeta,
        keep: &[KeepState],
        cache: &mut StateCache<B>,
        out: &mut Tensor<B>,
    ) -> Result<()> {
        self.run(stream, hidden_states, meta, keep, cache, out, false).map(|_| ())
    }

    /// [`Self::forward`], returning the intermediates (`None` for an empty batch). The trace's
    /// activated gate costs one `KdaGate` over the live rows that the forward does not run.
    pub fn forward_traced(
        &self,
        stream: &B::Stream,
        hidden_states: &Tensor<B>,
        meta: &BatchMeta,
        cache: &mut StateCache<B>,
        out: &mut Tensor<B>,
    ) -> Result<Option<LayerTrace<B>>> {
        self.run(stream, hidden_states, meta, &[], cache, out, true)
    }

    /// Every check of a forward call; nothing is launched before they all pass.
    fn check(
        &self,
        x: &Tensor<B>,
        meta: &BatchMeta,
        cache: &StateCache<B>,
        out: &Tensor<B>,
    ) -> Result<DispatchGroups> {
        const OP: &str = "kda_layer";
        for (what, buffer) in [("hidden_states", x.buffer()), ("out", out.buffer())]
            .into_iter()
            .chain(cache.buffers().map(|b| ("cache", b)))
        {
            self.device.check_instance(what, buffer.id().instance)?;
        }
        // Shape and dtype of the input, as the projection sees it.
        self.projection.route(x).map_err(|e| match e {
            Error::Shape { expected, actual, .. } => Error::Shape {
                op: OP,
                param: "hidden_states",
                expected: format!("{expected} (hidden_size of the config)"),
                actual,
            },
            Error::DType { expected, actual, .. } => {
                Error::DType { op: OP, param: "hidden_states", expected, actual }
            }
            other => other,
        })?;
        let rows = x.shape()[0];
        let hidden = self.dims.hidden;
        if out.shape() != [rows, hidden] {
            return Err(Error::Shape {
                op: OP,
                param: "out",
                expected: format!("[{rows}, {hidden}] (rows of hidden_states, hidden_size)"),
                actual: out.shape().to_vec(),
            }
            .into());
        }
        if !out.dtype().is_float() {
            let expected = "bf16, f16 or f32".into();
            return Err(Error::DType { op: OP, param: "out", expected, actual: out.dtype() }.into());
        }
        if !out.layout().is_non_overlapping() {
            return Err(Error::SelfOverlap {
                op: OP,
                param: "out",
                shape: out.shape().to_vec(),
                strides: out.layout().strides().to_vec(),
            }
            .into());
        }
        let aliased = if out.overlaps(x) {
            Some("hidden_states")
        } else {
            cache.overlaps(out).then_some("cache")
        };
        if let Some(other) = aliased {
            let span = out.byte_span();
            let actual = (span.start, span.end);
            return Err(Error::Aliasing { op: OP, param: "out", other, actual }.into());
        }
        let d = &self.dims;
        cache.check(d.local_heads, d.head_dim, d.conv_width)?;
        Ok(DispatchGroups::new(meta, rows, cache.limits())?)
    }

    /// The forward; with `traced` it also returns the intermediates (else `None`, as for an
    /// empty batch).
    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        stream: &B::Stream,
        x: &Tensor<B>,
        meta: &BatchMeta,
        keep: &[KeepState],
        cache: &mut StateCache<B>,
        out: &mut Tensor<B>,
        traced: bool,
    ) -> Result<Option<LayerTrace<B>>> {
        let _span = tracing::debug_span!(
            "kda_layer.forward",
            layer = self.layer,
            tokens = x.shape().first().copied().unwrap_or(0),
            requests = meta.num_requests(),
        )
        .entered();
        let groups = self.check(x, meta, cache, out)?;
        let kept =
            keep::KeepWrites::new(keep, meta, &groups, cache.dims().slots, self.dims.conv_width)?;
        let b = &self.device;
        if groups.is_empty() {
            b.launch(stream, Op::Fill { dst: out.clone(), value: 0.0 })?;
            return Ok(None);
        }
        let (rows, n) = (x.shape()[0], groups.num_actual_tokens);
        let (lh, hd) = (self.dims.local_heads, self.dims.head_dim);

        let bufs = self.projection.alloc_buffers(x)?;
        let projected = self.projection.forward_into(stream, x, &bufs)?;

        // Per-token work on the live rows, once for every group.
        let beta = match self.beta {
            BetaInput::Preprocessed => projected.dispatch_beta(b, stream, n)?,
            BetaInput::Raw => {
                let [raw, _, _] = bufs.bfg_parts()?;
                prepare_beta(b, stream, &raw, n, false)?
            }
        }
        .reshape(&[n, lh])?;
        let beta = dispatch::to_dtype(b, stream, &beta, self.operands.dtype())?;
        let g1 = projected.g1.narrow(1, 0, n)?.reshape(&[n, lh, hd])?;
        let w = &self.weights;
        let gate =
            ChunkGate { a_log: w.a_log.clone(), dt_bias: w.dt_bias.clone(), form: self.gate };

        let core = b.alloc(self.operands.dtype(), &[n, lh, hd])?;
        let inputs = dispatch::TokenInputs {
            qkv: projected.mixed_qkv.narrow(0, 0, n)?,
            g1: g1.clone(),
            gate: gate.clone(),
            beta: beta.clone(),
            core: core.clone(),
        };
        let scale = (hd as f32).powf(-0.5);
        for group in groups.groups() {
            let chunk_states = match group.kind {
                GroupKind::Prefill => kept.chunk_state_slots.as_deref(),
                _ => None,
            };
            dispatch::run_group(b, stream, group, &inputs, &w.conv, cache, scale, chunk_states)?;
        }
        let history = self.dims.conv_width.saturating_sub(1);
        kept.write_conv(b, stream, &inputs.qkv, &w.conv, cache, history)?;

        // Gated norm and o_proj on the live rows; the padding rows of `out` set to zero.
        let g2 = projected.g2.narrow(0, 0, n)?;
        let normed = b.alloc(DType::F32, &[n, lh, hd])?;
        b.launch(
            stream,
            Op::GatedRmsNorm(GatedRmsNorm {
                x: core.clone(),
                gate: g2.clone(),
                weight: w.o_norm.clone(),
                y: normed.clone(),
                eps: self.eps,
            }),
        )?;
        let live_out = out.narrow(0, 0, n)?;
        let flat = normed.reshape(&[n, lh * hd])?;
        b.launch_labeled(stream, "o_proj", Op::Gemm { x: flat, w: w.o_proj.clone(), y: live_out })?;
        if n < rows {
            let count = dispatch::meta_tensor(b, stream, &[n as i32])?;
            b.launch(
                stream,
                Op::ZeroPadding(ZeroPadding { x: out.clone(), num_actual_tokens: count }),
            )?;
        }
        if !traced {
            return Ok(None);
        }
        // The activated gate for the trace alone (the forward above never stored it).
        let trace_gate = b.alloc(DType::F32, &[n, lh, hd])?;
        let ChunkGate { a_log, dt_bias, form } = gate;
        let g = trace_gate.clone();
        b.launch(stream, Op::KdaGate(KdaGate { g1: g1.clone(), a_log, dt_bias, form, g }))?;
        Ok(Some(LayerTrace {
            mixed_qkv: bufs.mixed_qkv.narrow(0, 0, n)?,
            beta,
            g1,
            gate: trace_gate,
            g2,
            core_attn_out: core,
        }))
    }
}
