//! Whether DynamicQuant is split out of the QKV linear
//! (`docs/design/schedule.md#dynamicquant-split`, `docs/design/kda.md#behaviour-10`).
//!
//! The overlap hides the activation's quantization under the BFG GEMM, which needs the quant to
//! be an op of its own on the main stream. The seeds split it only for MXFP8 methods on a 2-D
//! bf16 activation, with the configured `scale_alg`; any other input keeps the quantization
//! inside the linear, where it runs just before the quantized GEMM.

use crate::schedule::weights::QkvWeight;
use kda_core::dtype::DType;
use kda_core::hal::Backend;
use kda_core::mx::ScaleAlg;

/// How the QKV linear runs.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum QkvRoute {
    /// A dense GEMM; no quantization op at all.
    Dense,
    /// `DynamicQuant(x)` with `alg` as its own op (overlapping the BFG GEMM), then the MXFP8 GEMM.
    SplitQuant { alg: ScaleAlg },
    /// The quantization stays inside the linear: DynamicQuant with `alg` directly before the
    /// MXFP8 GEMM, both in the QKV GEMM's place.
    QuantInLinear { alg: ScaleAlg },
}

impl QkvRoute {
    /// The route for `weight` applied to an activation of `x_dtype` and rank `x_rank`.
    pub fn decide<B: Backend>(weight: &QkvWeight<B>, x_dtype: DType, x_rank: usize) -> Self {
        match weight {
            QkvWeight::Bf16 { .. } => QkvRoute::Dense,
            QkvWeight::Mxfp8 { alg, .. } if x_dtype == DType::BF16 && x_rank == 2 => {
                QkvRoute::SplitQuant { alg: *alg }
            }
            QkvWeight::Mxfp8 { alg, .. } => QkvRoute::QuantInLinear { alg: *alg },
        }
    }

    /// Whether the quantization is an op of its own before the stage-1 join.
    pub fn splits_quant(self) -> bool {
        matches!(self, QkvRoute::SplitQuant { .. })
    }

    /// The activation quantization's scale algorithm, if there is one.
    pub fn scale_alg(self) -> Option<ScaleAlg> {
        match self {
            QkvRoute::Dense => None,
            QkvRoute::SplitQuant { alg } | QkvRoute::QuantInLinear { alg } => Some(alg),
        }
    }
}
