//! The forget gate (`docs/design/kda.md#gate`): per-channel log decay from the raw logits
//! `a = g1 + dt_bias`, computed in fp32, in one of two forms.

use std::fmt;

use crate::dtype::DType;
use crate::error::Result;
use crate::resource::Resources;
use crate::tensor::Tensor;

use super::check;

/// Softplus returns its argument above this (as PyTorch's `softplus(threshold=20)`).
pub const SOFTPLUS_THRESHOLD: f32 = 20.0;

/// How the log decay `g` is made from `a = g1 + dt_bias` and `A_log[h]`.
#[derive(Copy, Clone, Debug, PartialEq)]
pub enum GateForm {
    /// Kimi Linear: `g = -exp(A_log[h]) · softplus(a)`, so `g ≤ 0` (unbounded below).
    Softplus,
    /// Kimi K3: `g = lower_bound · sigmoid(exp(A_log[h]) · a)`, so `g ∈ (lower_bound, 0]`;
    /// `lower_bound` is finite and negative (K3: -5).
    LowerBound { lower_bound: f32 },
}

impl fmt::Display for GateForm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GateForm::Softplus => f.write_str("softplus"),
            GateForm::LowerBound { lower_bound } => write!(f, "lower bound {lower_bound}"),
        }
    }
}

/// Sizes of a validated [`KdaGate`].
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct GateDims {
    pub tokens: usize,
    pub heads: usize,
    pub dim: usize,
}

/// `g[t, h, c] = gate(form, A_log[h], g1[t, h, c] + dt_bias[h, c])`, fp32.
#[derive(Clone, Debug)]
pub struct KdaGate<B: Resources> {
    /// Raw forget-gate logits `[T, H, D]` (bf16, f16 or f32).
    pub g1: Tensor<B>,
    /// `[H]` (any float; fp32 in checkpoints).
    pub a_log: Tensor<B>,
    /// `[H, D]` (any float; fp32 in checkpoints).
    pub dt_bias: Tensor<B>,
    pub form: GateForm,
    /// Log decay `[T, H, D]`, f32.
    pub g: Tensor<B>,
}

impl<B: Resources> KdaGate<B> {
    pub const NAME: &'static str = "kda_gate";

    pub fn inputs(&self) -> Vec<(&'static str, &Tensor<B>)> {
        vec![("g1", &self.g1), ("a_log", &self.a_log), ("dt_bias", &self.dt_bias)]
    }

    pub fn outputs(&self) -> Vec<(&'static str, &Tensor<B>)> {
        vec![("g", &self.g)]
    }

    /// Check shapes, dtypes and the form's parameter and return the sizes.
    pub fn validate(&self) -> Result<GateDims> {
        const OP: &str = "kda_gate";
        check::float(OP, "g1", &self.g1)?;
        let [tokens, heads, dim] = check::dims(OP, "g1", &self.g1, "[T, H, D]")?;
        check_params(OP, &self.a_log, &self.dt_bias, self.form, [heads, dim], "g1")?;
        check::dtype(OP, "g", &self.g, DType::F32)?;
        check::shape(OP, "g", &self.g, &[tokens, heads, dim], "T, H, D of g1")?;
        Ok(GateDims { tokens, heads, dim })
    }
}

/// The gate's parameters, for an op that applies the gate itself to raw logits
/// ([`KdaChunk::gate`](super::KdaChunk::gate)): it computes exactly what [`KdaGate`] computes
/// from them, element for element, before it uses the log decay.
#[derive(Clone, Debug)]
pub struct ChunkGate<B: Resources> {
    /// `[H]` (any float; fp32 in checkpoints).
    pub a_log: Tensor<B>,
    /// `[H, D]` (any float; fp32 in checkpoints).
    pub dt_bias: Tensor<B>,
    pub form: GateForm,
}

impl<B: Resources> ChunkGate<B> {
    /// The parameters as inputs, for hazard analysis.
    pub fn inputs(&self) -> [(&'static str, &Tensor<B>); 2] {
        [("a_log", &self.a_log), ("dt_bias", &self.dt_bias)]
    }

    /// Check the parameters against logits of `heads` heads of `dim` channels, the sizes of
    /// the parameter `of` of op `op` (as [`KdaGate::validate`] does).
    pub(crate) fn validate(
        &self,
        op: &'static str,
        [heads, dim]: [usize; 2],
        of: &str,
    ) -> Result<()> {
        check_params(op, &self.a_log, &self.dt_bias, self.form, [heads, dim], of)
    }
}

/// `a_log` `[H]` and `dt_bias` `[H, D]` floats for logits of `[heads, dim]` (the sizes of the
/// parameter `of`), and a finite, negative lower bound.
fn check_params<B: Resources>(
    op: &'static str,
    a_log: &Tensor<B>,
    dt_bias: &Tensor<B>,
    form: GateForm,
    [heads, dim]: [usize; 2],
    of: &str,
) -> Result<()> {
    check::float(op, "a_log", a_log)?;
    check::shape(op, "a_log", a_log, &[heads], &format!("H of {of}"))?;
    check::float(op, "dt_bias", dt_bias)?;
    check::shape(op, "dt_bias", dt_bias, &[heads, dim], &format!("H, D of {of}"))?;
    if let GateForm::LowerBound { lower_bound } = form {
        check::param(op, "lower_bound", lower_bound, lower_bound < 0.0, "finite and < 0")?;
    }
    Ok(())
}
