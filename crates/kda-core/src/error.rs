//! Errors of the HAL and its views. Every variant names the op or parameter involved and the
//! expected and actual values, so a message can be acted on without a debugger.

use thiserror::Error;

use crate::dtype::DType;
use crate::hal::{InstanceId, StreamId};

/// A view (narrow, split, reshape) that does not fit the tensor it is taken of.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum ViewError {
    #[error("{op}: dimension {dim} is out of range for a rank-{rank} tensor")]
    DimOutOfRange { op: &'static str, dim: usize, rank: usize },
    #[error("{op}: range {start}..{start}+{len} along dimension {dim} exceeds its size {size}")]
    RangeOutOfBounds { op: &'static str, dim: usize, start: usize, len: usize, size: usize },
    #[error("split: sizes {sizes:?} along dimension {dim} do not add up to its size {size}")]
    SplitSizes { dim: usize, sizes: Vec<usize>, size: usize },
    #[error("reshape: {from:?} has a different element count than {to:?}")]
    ReshapeNumel { from: Vec<usize>, to: Vec<usize> },
    #[error("reshape: {from:?} with strides {strides:?} cannot be viewed as {to:?} without a copy")]
    ReshapeIncompatible { from: Vec<usize>, strides: Vec<usize>, to: Vec<usize> },
    #[error("split_heads: dimension {dim} of size {size} is not divisible into {heads} heads")]
    HeadsDoNotDivide { dim: usize, size: usize, heads: usize },
    #[error("{op}: shape {shape:?} and strides {strides:?} have different ranks")]
    RankMismatch { op: &'static str, shape: Vec<usize>, strides: Vec<usize> },
    #[error("{op}: element offsets overflow")]
    Overflow { op: &'static str },
    #[error(
        "shape {shape:?} of {dtype} is too large: its element count or byte size does not fit \
         the address space (at most isize::MAX bytes)"
    )]
    TooLarge { shape: Vec<usize>, dtype: DType },
}

/// Everything a HAL call can report.
///
/// Argument errors (shapes, dtypes, foreign handles) are returned by the call that was given the
/// bad argument. Failures while an op executes on a stream are returned by the next
/// [`synchronize`](crate::Backend::synchronize) of that stream (see [`crate::hal`]).
#[derive(Clone, Debug, Error, PartialEq)]
pub enum Error {
    #[error(transparent)]
    View(#[from] ViewError),

    #[error("{op}: {param} has shape {actual:?}, expected {expected}")]
    Shape { op: &'static str, param: &'static str, expected: String, actual: Vec<usize> },

    #[error("{op}: {param} has dtype {actual}, expected {expected}")]
    DType { op: &'static str, param: &'static str, expected: String, actual: DType },

    #[error("{op}: {param} (bytes {actual:?}) overlaps {other} in the same buffer")]
    Aliasing { op: &'static str, param: &'static str, other: &'static str, actual: (usize, usize) },

    #[error("{op}: {param} has overlapping elements (shape {shape:?}, strides {strides:?})")]
    SelfOverlap { op: &'static str, param: &'static str, shape: Vec<usize>, strides: Vec<usize> },

    #[error("{param}: view needs bytes {needed:?} but its buffer holds {len} bytes")]
    OutOfBounds { param: &'static str, needed: (usize, usize), len: usize },

    #[error("{op}: {param} = {value} is not representable as {dtype}")]
    Value { op: &'static str, param: &'static str, value: String, dtype: DType },

    #[error("{op}: parameter {param} = {actual}, expected {expected}")]
    Param { op: &'static str, param: &'static str, expected: String, actual: String },

    #[error("{op}: {param} has {actual} bytes, expected {expected}")]
    HostSize { op: &'static str, param: &'static str, expected: usize, actual: usize },

    #[error("{what} belongs to backend instance {handle} but was used with instance {backend}")]
    ForeignHandle { what: &'static str, handle: InstanceId, backend: InstanceId },

    #[error("op {op} failed on stream {stream}: {message}")]
    OpFailed { op: String, stream: StreamId, message: String },

    #[error("stream {stream} waited on work of stream {upstream} that had failed: {message}")]
    DependencyFailed { stream: StreamId, upstream: StreamId, message: String },

    #[error("out of memory: could not allocate {bytes} bytes")]
    OutOfMemory { bytes: usize },

    #[error("stream {stream} is no longer running")]
    StreamLost { stream: StreamId },

    #[error(transparent)]
    Hazard(Box<crate::sanitize::Hazard>),

    #[error(transparent)]
    Capture(#[from] crate::sanitize::CaptureError),

    #[error(transparent)]
    Mx(#[from] crate::mx::MxError),

    #[error(transparent)]
    Weights(#[from] crate::weights::WeightError),

    #[error(transparent)]
    Batch(#[from] crate::layer::BatchError),

    #[error("{backend} backend: {message}")]
    Backend { backend: &'static str, message: String },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
