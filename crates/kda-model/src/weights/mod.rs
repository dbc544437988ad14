//! Checkpoint loading: one TP rank's weights of a KDA layer, read from an HF-style checkpoint
//! into host tensors (the layer uploads them to a backend).
//!
//! - [`host`]: [`HostTensor`], dtype + shape + typed host data, and region reads;
//! - [`source`]: what a loader reads from ([`TensorSource`], [`TensorRead`]), so a memory-mapped
//!   checkpoint, an in-memory map or a lazily generated synthetic checkpoint all load the same
//!   way and only this rank's rows are ever copied;
//! - [`memory`]: [`MemorySource`], tensors the engine holds in memory, read in place;
//! - [`checkpoint`]: [`Checkpoint`], safetensors files (one, or sharded with
//!   `model.safetensors.index.json`), read whole when small, memory-mapped when large;
//! - [`registry`]: [`Param`], the map from every checkpoint name to one loader ([`route`]),
//!   [`LayerLoader`] and [`load_layer`];
//! - [`bfg`]: [`FusedBfgLinear`], beta, the load-time composed forget gate `f_b @ f_a` and the
//!   output gate packed into one weight, with its staged fallback;
//! - [`qkv`]: [`FusedQkv`], `[q | k | v]` shards, dense or MXFP8 (stored, or quantized at load);
//! - [`conv`]: [`ConvWeights`], packed once, in place, into the kernel layout `[W, 3 * lp]`;
//! - [`params`]: `A_log`, `dt_bias`, `o_norm.weight`, `o_proj.weight`.
//!
//! Every shape, dtype and value is checked once, here; an error names the parameter (with its
//! full checkpoint name when it came from a checkpoint), the expected and the actual value.

pub mod bfg;
pub mod checkpoint;
pub mod conv;
pub mod host;
pub mod memory;
pub mod params;
pub mod qkv;
pub mod registry;
pub mod source;

use thiserror::Error;

use crate::config::ConfigError;
use kda_core::mx::MxError;

pub use bfg::{BfgBlock, BfgMode, BfgSource, FusedBfgLinear};
pub use checkpoint::{Checkpoint, INDEX_FILE, SINGLE_FILE};
pub use conv::{ConvLayout, ConvWeights};
pub use host::HostTensor;
pub use memory::MemorySource;
pub use qkv::{FusedQkv, QkvPart, QkvWeights, dequantize_bf16};
pub use registry::{
    BfgTarget, LayerLoader, LayerWeights, LoadOptions, LoadedLayer, Param, Route, Target,
    layer_prefix, load_layer, route,
};
pub use source::{DenseTensor, TensorRead, TensorSource};

/// What loading weights can fail with. `param` is the parameter's name: its full checkpoint
/// name (`model.layers.3.self_attn.f_b_proj.weight`) when the loader was given one.
#[derive(Clone, Debug, Error, PartialEq)]
pub enum WeightError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("{param}: shape {actual:?}, expected {expected}")]
    Shape { param: String, expected: String, actual: Vec<usize> },
    #[error("{param}: dtype {actual}, expected {expected}")]
    DType { param: String, expected: String, actual: String },
    #[error("{param}: {reason}")]
    Value { param: String, reason: String },
    #[error("{param}: {source}")]
    Mx { param: String, source: MxError },
    #[error(
        "{param}: element {index} (flat, row-major) is {value}; a weight must be finite \
         (the checkpoint is corrupt or was saved from a diverged model)"
    )]
    NonFinite { param: String, index: usize, value: String },
    #[error("{param}: cannot allocate {bytes} bytes")]
    Alloc { param: String, bytes: u128 },
    #[error("layer {layer}: {} tensor(s) missing: {}", names.len(), names.join(", "))]
    Missing { layer: usize, names: Vec<String> },
    #[error("layer {layer}: {} unknown tensor(s): {}", names.len(), names.join(", "))]
    Unknown { layer: usize, names: Vec<String> },
    #[error("{origin}: no tensor named {name:?}")]
    NotFound { origin: String, name: String },
    #[error("{path}: cannot {action}: {message}")]
    Io { path: String, action: &'static str, message: String },
    #[error("{path}: not a valid safetensors file: {message}")]
    Safetensors { path: String, message: String },
    #[error("{path}: invalid shard index: {message}")]
    Index { path: String, message: String },
}

impl WeightError {
    /// The same error with `prefix` put before the parameter name (a layer's checkpoint prefix).
    pub fn with_prefix(self, prefix: &str) -> WeightError {
        let full = |param: String| format!("{prefix}{param}");
        match self {
            WeightError::Shape { param, expected, actual } => {
                WeightError::Shape { param: full(param), expected, actual }
            }
            WeightError::DType { param, expected, actual } => {
                WeightError::DType { param: full(param), expected, actual }
            }
            WeightError::Value { param, reason } => {
                WeightError::Value { param: full(param), reason }
            }
            WeightError::Mx { param, source } => WeightError::Mx { param: full(param), source },
            WeightError::Alloc { param, bytes } => WeightError::Alloc { param: full(param), bytes },
            WeightError::NonFinite { param, index, value } => {
                WeightError::NonFinite { param: full(param), index, value }
            }
            other => other,
        }
    }

    pub(crate) fn shape(param: &str, expected: impl Into<String>, actual: &[usize]) -> Self {
        WeightError::Shape {
            param: param.to_string(),
            expected: expected.into(),
            actual: actual.to_vec(),
        }
    }

    pub(crate) fn dtype(param: &str, expected: impl Into<String>, actual: impl ToString) -> Self {
        WeightError::DType {
            param: param.to_string(),
            expected: expected.into(),
            actual: actual.to_string(),
        }
    }

    pub(crate) fn value(param: &str, reason: impl Into<String>) -> Self {
        WeightError::Value { param: param.to_string(), reason: reason.into() }
    }
}

/// `[a, b, c]`, for messages.
pub(crate) fn fmt_shape(shape: &[usize]) -> String {
    format!("{shape:?}")
}

/// `t` must hold floats (bf16, f16 or f32).
pub(crate) fn expect_float(param: &str, t: &dyn TensorRead) -> Result<(), WeightError> {
    if t.dtype().is_float() {
        Ok(())
    } else {
        Err(WeightError::dtype(param, "bf16, f16 or f32", t.dtype()))
    }
}

/// `t` must have exactly `expected` (described as `what`, e.g. `[num_heads, hidden_size]`).
pub(crate) fn expect_shape(
    param: &str,
    t: &dyn TensorRead,
    expected: &[usize],
    what: &str,
) -> Result<(), WeightError> {
    if t.shape() == expected {
        Ok(())
    } else {
        Err(WeightError::shape(param, format!("{} {what}", fmt_shape(expected)), t.shape()))
    }
}

/// Rows `rows` of `t`, every other dimension whole.
pub(crate) fn read_rows(
    t: &dyn TensorRead,
    rows: std::ops::Range<usize>,
) -> Result<HostTensor, WeightError> {
    let mut region: Vec<std::ops::Range<usize>> = t.shape().iter().map(|&d| 0..d).collect();
    if let Some(first) = region.first_mut() {
        *first = rows;
    }
    t.read(&region)
}
