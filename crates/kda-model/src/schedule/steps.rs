//! The work both schedules queue, one function per step, under the seeds' labels
//! (`docs/design/schedule.md#inputs-and-outputs`). The schedules differ only in which stream runs
//! each step and in the events between them.

use crate::schedule::buffers::ProjectionBuffers;
use crate::schedule::qkv_route::QkvRoute;
use crate::schedule::weights::{BfgWeight, ProjectionWeights, QkvWeight};
use kda_core::device::Device;
use kda_core::error::{Error, Result};
use kda_core::hal::Backend;
use kda_core::op::Op;
use kda_core::tensor::Tensor;

/// The labels the schedules launch their ops under (the seeds' names; staged F labels its four
/// GEMMs `project_bfg.*`).
pub mod labels {
    /// The fused BFG GEMM (composed F).
    pub const PROJECT_BFG: &str = "project_bfg";
    /// Staged F: the B rows.
    pub const PROJECT_BFG_B: &str = "project_bfg.b";
    /// Staged F: `x · f_a^T`, rounded to bf16.
    pub const PROJECT_BFG_F_A: &str = "project_bfg.f_a";
    /// Staged F: `(x · f_a^T) · f_b^T`, the skinny dependent GEMM.
    pub const PROJECT_BFG_F_B: &str = "project_bfg.f_b";
    /// Staged F: the G rows.
    pub const PROJECT_BFG_G: &str = "project_bfg.g";
    /// MXFP8 quantization of the activation, split out of the QKV linear.
    pub const DYNAMIC_QUANT: &str = "dynamic_quant";
    /// The same quantization kept inside the QKV linear.
    pub const QKV_LINEAR_QUANT: &str = "qkv_matmul.quant";
    /// The fused QKV GEMM (dense or MXFP8).
    pub const QKV_MATMUL: &str = "qkv_matmul";
    /// The BFG post-process: beta's fp32 sigmoid (the split and gate views cost no op).
    pub const POSTPROCESS_BFG: &str = "postprocess_bfg";
}

/// One call's operands.
pub(crate) struct Work<'a, B: Backend> {
    pub(crate) device: &'a Device<B>,
    pub(crate) weights: &'a ProjectionWeights<B>,
    pub(crate) x: &'a Tensor<B>,
    pub(crate) bufs: &'a ProjectionBuffers<B>,
    pub(crate) route: QkvRoute,
}

impl<B: Backend> Work<'_, B> {
    fn quant_op(&self) -> Result<Op<B>> {
        let (Some((data, scale)), Some(alg)) = (&self.bufs.quant, self.route.scale_alg()) else {
            return Err(missing("quant"));
        };
        Ok(Op::DynamicQuant { x: self.x.clone(), data: data.clone(), scale: scale.clone(), alg })
    }

    /// DynamicQuant on its own (only when the route splits it out; nothing otherwise).
    pub(crate) fn quantize(&self, stream: &B::Stream) -> Result<()> {
        if !self.route.splits_quant() {
            return Ok(());
        }
        self.device.launch_labeled(stream, labels::DYNAMIC_QUANT, self.quant_op()?)
    }

    /// The QKV GEMM (with the quantization in front of it when it stays inside the linear).
    pub(crate) fn qkv_matmul(&self, stream: &B::Stream) -> Result<()> {
        let b = self.device;
        let y = self.bufs.mixed_qkv.clone();
        let op = match (self.weights.qkv(), &self.bufs.quant) {
            (QkvWeight::Bf16 { w }, _) => Op::Gemm { x: self.x.clone(), w: w.clone(), y },
            (QkvWeight::Mxfp8 { data, scale, .. }, Some((a, a_scale))) => {
                if let QkvRoute::QuantInLinear { .. } = self.route {
                    b.launch_labeled(stream, labels::QKV_LINEAR_QUANT, self.quant_op()?)?;
                }
                Op::MxGemm {
                    a: a.clone(),
                    a_scale: a_scale.clone(),
                    w: data.clone(),
                    w_scale: scale.clone(),
                    y,
                }
            }
            (QkvWeight::Mxfp8 { .. }, None) => return Err(missing("quant")),
        };
        b.launch_labeled(stream, labels::QKV_MATMUL, op)
    }

    /// The BFG projection into `[B | F | G]`: one GEMM, or four with staged F.
    pub(crate) fn project_bfg(&self, stream: &B::Stream) -> Result<()> {
        let b = self.device;
        let x = self.x.clone();
        match self.weights.bfg() {
            BfgWeight::Composed { w } => b.launch_labeled(
                stream,
                labels::PROJECT_BFG,
                Op::Gemm { x, w: w.clone(), y: self.bufs.bfg.clone() },
            ),
            BfgWeight::Staged { b: w_b, f_a, f_b, g } => {
                let [out_b, out_f, out_g] = self.bufs.bfg_parts()?;
                let Some(mid) = &self.bufs.f_a else { return Err(missing("f_a")) };
                let gemm = |label, x: &Tensor<B>, w: &Tensor<B>, y| {
                    b.launch_labeled(stream, label, Op::Gemm { x: x.clone(), w: w.clone(), y })
                };
                gemm(labels::PROJECT_BFG_B, &x, w_b, out_b)?;
                gemm(labels::PROJECT_BFG_F_A, &x, f_a, mid.clone())?;
                gemm(labels::PROJECT_BFG_F_B, mid, f_b, out_f)?;
                gemm(labels::PROJECT_BFG_G, &x, g, out_g)
            }
        }
    }

    /// Beta's fp32 sigmoid; the split and the gate reshapes are views (see
    /// [`ProjectionBuffers::projected`]).
    pub(crate) fn postprocess(&self, stream: &B::Stream) -> Result<()> {
        let [raw_beta, _, _] = self.bufs.bfg_parts()?;
        let op = Op::Sigmoid { x: raw_beta, y: self.bufs.beta.clone() };
        self.device.launch_labeled(stream, labels::POSTPROCESS_BFG, op)
    }
}

/// Buffers allocated for another route or BFG form than the call's.
fn missing(what: &str) -> Error {
    Error::Param {
        op: "projection",
        param: "buffers",
        expected: format!("a `{what}` workspace (buffers allocated for this route and weights)"),
        actual: "none".into(),
    }
}
