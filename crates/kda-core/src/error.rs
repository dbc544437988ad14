//! Errors of the HAL and its views. Every variant names the op or parameter involved and the
//! expected and actual values, so a message can be acted on without a debugger.

use thiserror::Error;

use crate::dtype::DType;
pub use crate::layout::ViewError;
use crate::resource::{EventId, InstanceId, StreamId};

/// Everything a HAL call can report.
///
/// Argument errors (shapes, dtypes, foreign handles) are returned by the call that was given the
/// bad argument. Failures while an op executes on a stream are returned by the next
/// [`synchronize`](crate::Device::synchronize) of that stream (see [`crate::device`]).
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
    Capture(#[from] CaptureError),

    #[error(transparent)]
    Mx(#[from] crate::mx::MxError),

    #[error("{backend} backend: {message}")]
    Backend { backend: &'static str, message: String },

    /// The backend lacks `feature` by design (on this device, in this build): the typed refusal.
    /// `feature` names what was asked for and why it is absent (often a fixed text; a device's
    /// name where the device decides).
    #[error("the {backend} backend does not support {feature}")]
    Unsupported { backend: &'static str, feature: std::borrow::Cow<'static, str> },
}

/// Why a capture could not begin, continue or end, or a graph could not be launched.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum CaptureError {
    #[error("end_capture on stream {stream}: no capture was begun on it")]
    NotCapturing { stream: StreamId },
    #[error("begin_capture on stream {stream}: a capture from stream {origin} is already open")]
    AlreadyCapturing { stream: StreamId, origin: StreamId },
    #[error(
        "capture from stream {origin}: stream {stream} was forked into the capture but its last \
         work was never joined back to the origin (record an event on it and wait on that event \
         from the origin)"
    )]
    NotJoined { stream: StreamId, origin: StreamId },
    #[error(
        "capture from stream {origin}: stream {stream} received `{label}` after it was joined \
         back; join it again after its last work"
    )]
    WorkAfterJoin { stream: StreamId, origin: StreamId, label: String },
    #[error(
        "capture from stream {origin}: {call} of captured stream {stream} blocks the host inside the capture"
    )]
    HostSyncInCapture { stream: StreamId, origin: StreamId, call: &'static str },
    #[error(
        "capture from stream {origin}: captured stream {stream} waits on event {event}, which was \
         not recorded inside the capture"
    )]
    ExternalEvent { stream: StreamId, origin: StreamId, event: EventId },
    #[error(
        "capture from stream {origin}: captured stream {stream} frees a buffer inside the capture"
    )]
    FreeInCapture { stream: StreamId, origin: StreamId },
    #[error("graph captured on backend instance {graph} cannot be launched on instance {backend}")]
    ForeignGraph { graph: InstanceId, backend: InstanceId },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
