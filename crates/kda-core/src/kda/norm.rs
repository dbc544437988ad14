//! The two normalisations of the layer: the q/k L2 norm with the `D^-0.5` scale
//! (`docs/design/kda.md#qk-norm`) and the gated RMSNorm of the output (`RMSNormGated`,
//! `docs/design/kda.md#gated-output-norm`), both in fp32.

use crate::error::Result;
use crate::resource::Resources;
use crate::tensor::Tensor;

use super::check;

/// The epsilon inside the L2 norm's square root: `x / sqrt(Σ x² + 1e-6)`.
pub const L2NORM_EPS: f32 = 1e-6;

/// Sizes of a validated row-wise normalisation: `rows` rows of `dim` elements.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct RowDims {
    pub rows: usize,
    pub dim: usize,
}

/// `y = x / sqrt(Σ x² + 1e-6) · scale` along the last dimension, in fp32 (the scale is applied
/// after the norm, as `docs/design/kda.md#qk-norm` orders it; `scale = D^-0.5` for q, 1 for k).
#[derive(Clone, Debug)]
pub struct L2Norm<B: Resources> {
    /// Input `[..., D]` (bf16, f16 or f32; rank at least 1).
    pub x: Tensor<B>,
    /// Output, the shape of `x` (bf16, f16 or f32; rounded once).
    pub y: Tensor<B>,
    pub scale: f32,
}

impl<B: Resources> L2Norm<B> {
    pub const NAME: &'static str = "l2norm";

    pub fn inputs(&self) -> Vec<(&'static str, &Tensor<B>)> {
        vec![("x", &self.x)]
    }

    pub fn outputs(&self) -> Vec<(&'static str, &Tensor<B>)> {
        vec![("y", &self.y)]
    }

    /// Check shapes, dtypes and the scale and return the sizes.
    pub fn validate(&self) -> Result<RowDims> {
        const OP: &str = "l2norm";
        check::float(OP, "x", &self.x)?;
        check::float(OP, "y", &self.y)?;
        let dim = row_len(OP, "x", &self.x, "[..., D]")?;
        check::shape(OP, "y", &self.y, self.x.shape(), "shape of x")?;
        check::param(OP, "scale", self.scale, true, "finite")?;
        let rows = self.x.numel().checked_div(dim).unwrap_or(0);
        Ok(RowDims { rows, dim })
    }
}

/// `y = x · rsqrt(mean(x²) + eps) · weight · sigmoid(gate)` per head (rows of `D`), in fp32.
#[derive(Clone, Debug)]
pub struct GatedRmsNorm<B: Resources> {
    /// Input `[..., D]` (bf16, f16 or f32), e.g. the core output `[T, H, D]`.
    pub x: Tensor<B>,
    /// Output-gate logits, the shape of `x` (bf16, f16 or f32).
    pub gate: Tensor<B>,
    /// `[D]` (bf16, f16 or f32).
    pub weight: Tensor<B>,
    /// Output, the shape of `x` (bf16, f16 or f32; rounded once).
    pub y: Tensor<B>,
    /// Added to the mean square (1e-5 for the Kimi models); finite and `>= 0`.
    pub eps: f32,
}

impl<B: Resources> GatedRmsNorm<B> {
    pub const NAME: &'static str = "gated_rms_norm";

    pub fn inputs(&self) -> Vec<(&'static str, &Tensor<B>)> {
        vec![("x", &self.x), ("gate", &self.gate), ("weight", &self.weight)]
    }

    pub fn outputs(&self) -> Vec<(&'static str, &Tensor<B>)> {
        vec![("y", &self.y)]
    }

    /// Check shapes, dtypes and eps and return the sizes.
    pub fn validate(&self) -> Result<RowDims> {
        const OP: &str = "gated_rms_norm";
        for (param, t) in
            [("x", &self.x), ("gate", &self.gate), ("weight", &self.weight), ("y", &self.y)]
        {
            check::float(OP, param, t)?;
        }
        let dim = row_len(OP, "x", &self.x, "[..., D]")?;
        check::shape(OP, "gate", &self.gate, self.x.shape(), "shape of x")?;
        check::shape(OP, "weight", &self.weight, &[dim], "D of x")?;
        check::shape(OP, "y", &self.y, self.x.shape(), "shape of x")?;
        check::param(OP, "eps", self.eps, self.eps >= 0.0, "finite and >= 0")?;
        let rows = self.x.numel().checked_div(dim).unwrap_or(0);
        Ok(RowDims { rows, dim })
    }
}

/// The last dimension of a tensor of rank at least 1.
fn row_len<B: Resources>(
    op: &'static str,
    param: &'static str,
    t: &Tensor<B>,
    names: &str,
) -> Result<usize> {
    t.shape().last().copied().ok_or_else(|| crate::Error::Shape {
        op,
        param,
        expected: names.into(),
        actual: t.shape().to_vec(),
    })
}
