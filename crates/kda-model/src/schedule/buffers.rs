//! What one projection call writes: its outputs and its workspace, and the views of them that
//! dispatch consumes.
//!
//! Lifetimes across streams: every queued op holds handles to the views it uses, so memory
//! never goes away under a running op (what torch's `record_stream` arranges by hand). Ordering
//! a *free* (or a caching allocator's reuse) is the caller's part: after the overlapped schedule
//! returns, main has joined the whole aux tail (`bfg_ready`), so `x`, beta, g1 and g2 may be
//! freed or reused in the order of the main stream, and only there.

use crate::schedule::beta::prepare_beta;
use crate::schedule::qkv_route::QkvRoute;
use crate::schedule::weights::{BfgWeight, ProjectionWeights};
use kda_core::device::Device;
use kda_core::dtype::DType;
use kda_core::error::Result;
use kda_core::hal::Backend;
use kda_core::mx::num_blocks;
use kda_core::tensor::Tensor;

/// The outputs and workspace of one call for `tokens` tokens. Reusing one set across calls (as
/// a captured graph does) is fine on one main stream: each call is ordered after the previous
/// one's consumers there.
#[derive(Clone, Debug)]
pub struct ProjectionBuffers<B: Backend> {
    tokens: usize,
    heads: usize,
    /// `[T, 3 lp]` bf16.
    pub mixed_qkv: Tensor<B>,
    /// `[T, lh + 2 lp]` bf16, columns `[B | F | G]`: g1 and g2 are views of it.
    pub bfg: Tensor<B>,
    /// `[T, lh]` f32: the sigmoid of the B columns.
    pub beta: Tensor<B>,
    /// The quantized activation (E4M3 `[T, Hd]`, E8M0 `[T, ceil(Hd/32)]`), for MXFP8 QKV.
    pub quant: Option<(Tensor<B>, Tensor<B>)>,
    /// Staged F's intermediate `x · f_a^T`, `[T, D]` bf16.
    pub f_a: Option<Tensor<B>>,
}

impl<B: Backend> ProjectionBuffers<B> {
    /// Allocate everything a call with `route` on `tokens` tokens needs.
    pub fn alloc(
        device: &Device<B>,
        weights: &ProjectionWeights<B>,
        route: QkvRoute,
        tokens: usize,
    ) -> Result<Self> {
        let dims = weights.dims();
        let quant = match route {
            QkvRoute::Dense => None,
            QkvRoute::SplitQuant { .. } | QkvRoute::QuantInLinear { .. } => Some((
                device.alloc(DType::E4M3, &[tokens, dims.hidden])?,
                device.alloc(DType::E8M0, &[tokens, num_blocks(dims.hidden)])?,
            )),
        };
        let f_a = match weights.bfg() {
            BfgWeight::Composed { .. } => None,
            BfgWeight::Staged { .. } => Some(device.alloc(DType::BF16, &[tokens, dims.head_dim])?),
        };
        Ok(Self {
            tokens,
            heads: dims.heads,
            mixed_qkv: device.alloc(DType::BF16, &[tokens, dims.qkv_width()])?,
            bfg: device.alloc(DType::BF16, &[tokens, dims.bfg_width()])?,
            beta: device.alloc(DType::F32, &[tokens, dims.heads])?,
            quant,
            f_a,
        })
    }

    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// The B, F and G column blocks of the fused output (views).
    pub fn bfg_parts(&self) -> Result<[Tensor<B>; 3]> {
        let heads = self.heads;
        let lp = self.bfg.shape()[1].saturating_sub(heads) / 2;
        Ok([
            self.bfg.narrow(1, 0, heads)?,
            self.bfg.narrow(1, heads, lp)?,
            self.bfg.narrow(1, heads + lp, lp)?,
        ])
    }

    /// The views dispatch consumes (`docs/design/kda.md#the-layer-forward`).
    pub fn projected(&self) -> Result<Projected<B>> {
        let (t, heads) = (self.tokens, self.heads);
        let [_, f, g] = self.bfg_parts()?;
        let g2 = g.split_heads(1, heads)?;
        let d = g2.shape()[2];
        Ok(Projected {
            mixed_qkv: self.mixed_qkv.clone(),
            beta: self.beta.reshape(&[1, t, heads])?,
            beta_preprocessed: true,
            g1: f.reshape(&[1, t, heads, d])?,
            g2,
        })
    }
}

/// What the projections hand to dispatch.
#[derive(Clone, Debug)]
pub struct Projected<B: Backend> {
    /// `[T, 3 lp]` bf16: q, k, v before the short conv.
    pub mixed_qkv: Tensor<B>,
    /// `[1, T, lh]` f32, already through the fp32 sigmoid ("preprocessed").
    pub beta: Tensor<B>,
    /// Always true here: the mixed path's beta is preprocessed, so dispatch must only slice it.
    pub beta_preprocessed: bool,
    /// `[1, T, lh, D]` bf16 view of the F columns: raw forget-gate logits.
    pub g1: Tensor<B>,
    /// `[T, lh, D]` bf16 view of the G columns: output-gate logits.
    pub g2: Tensor<B>,
}

impl<B: Backend> Projected<B> {
    /// Beta as dispatch takes it for the first `n_live` tokens: [`prepare_beta`] with this
    /// output's `preprocessed` flag (so no second sigmoid, and no op at all).
    pub fn dispatch_beta(
        &self,
        device: &Device<B>,
        stream: &B::Stream,
        n_live: usize,
    ) -> Result<Tensor<B>> {
        prepare_beta(device, stream, &self.beta, n_live, self.beta_preprocessed)
    }
}
