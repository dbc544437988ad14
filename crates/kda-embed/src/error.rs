//! One error type for every embedding call, and the class an engine dispatches on.

use kda_core::Error;
use kda_model::layer::{BatchError, LayerError};
use kda_model::weights::WeightError;
use thiserror::Error;

/// The class of an [`EmbedError`]: what a Python exception subclass or a C error code says.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// An argument that is not one of the accepted values (a backend or schedule name).
    Argument,
    /// A tensor of the wrong shape, dtype or layout, or a cache of another layer.
    Shape,
    /// Batch metadata that is malformed or does not fit the cache.
    Metadata,
    /// A checkpoint that cannot be read or does not hold the layer.
    Checkpoint,
    /// What this backend or build cannot do (a backend not compiled in, foreign memory).
    Unsupported,
    /// A device call or an op failed.
    Backend,
    /// A bug in kda: a panic caught at the boundary.
    Internal,
}

/// Everything an embedding call can report. The messages are kda's own, naming the parameter,
/// what was expected and what was given.
#[derive(Debug, Error)]
pub enum EmbedError {
    #[error(transparent)]
    Layer(#[from] LayerError),

    #[error("{param}: {actual:?} is not one of {expected}")]
    Argument { param: &'static str, expected: &'static str, actual: String },

    #[error("{param}: NULL, expected a non-null pointer")]
    Null { param: &'static str },

    #[error("{param}: {message}")]
    Array { param: &'static str, message: String },

    #[error("batch metadata: {param}[{index}] = {value}, expected {expected}")]
    MetadataValue { param: &'static str, index: usize, value: i64, expected: String },

    /// A count or index of the batch or the cache outside what bounds it (a request count
    /// above the tokens, `num_spec` above the cache's, a slot past the cache's), with the value
    /// exactly as the caller gave it: checked before any array it sizes is read.
    #[error("batch metadata: {param} = {value}, expected {expected}")]
    MetadataBound { param: &'static str, value: i128, expected: String },

    /// A size argument that no object can have (a negative count), as the caller gave it.
    #[error("{param} = {value}, expected {expected}")]
    Count { param: &'static str, value: i128, expected: String },

    #[error("{what}: the layer runs on backend {layer} but the {what} belongs to backend {other}")]
    BackendMismatch { what: &'static str, layer: &'static str, other: &'static str },

    /// A cache could not be made: the sizes exactly as the caller asked for them, and why.
    #[error("a cache of num_slots = {num_slots}, num_spec = {num_spec}")]
    NewCache {
        num_slots: usize,
        num_spec: usize,
        #[source]
        source: Box<EmbedError>,
    },

    #[error("kda panicked (a bug, please report it): {0}")]
    Panic(String),
}

impl From<Error> for EmbedError {
    fn from(e: Error) -> Self {
        Self::Layer(e.into())
    }
}

impl From<BatchError> for EmbedError {
    fn from(e: BatchError) -> Self {
        Self::Layer(e.into())
    }
}

impl From<WeightError> for EmbedError {
    fn from(e: WeightError) -> Self {
        Self::Layer(e.into())
    }
}

impl EmbedError {
    pub fn kind(&self) -> ErrorKind {
        match self {
            EmbedError::Layer(LayerError::Batch(_) | LayerError::Keep(_))
            | EmbedError::MetadataValue { .. }
            | EmbedError::MetadataBound { .. } => ErrorKind::Metadata,
            EmbedError::Layer(LayerError::Weights(_)) => ErrorKind::Checkpoint,
            EmbedError::Layer(LayerError::Device(e)) => device_kind(e),
            EmbedError::Argument { .. } | EmbedError::Null { .. } | EmbedError::Count { .. } => {
                ErrorKind::Argument
            }
            EmbedError::Array { .. } | EmbedError::BackendMismatch { .. } => ErrorKind::Shape,
            EmbedError::NewCache { source, .. } => source.kind(),
            EmbedError::Panic(_) => ErrorKind::Internal,
        }
    }

    /// The message and its causes, as one line.
    pub fn message(&self) -> String {
        let mut message = self.to_string();
        let mut source = std::error::Error::source(self);
        while let Some(cause) = source {
            let cause = cause.to_string();
            if !message.contains(&cause) {
                message.push_str(": ");
                message.push_str(&cause);
            }
            source = cause_of(source);
        }
        message
    }
}

fn cause_of<'a>(
    e: Option<&'a (dyn std::error::Error + 'static)>,
) -> Option<&'a (dyn std::error::Error + 'static)> {
    e.and_then(std::error::Error::source)
}

/// Argument errors of a device call are the caller's tensors; the rest is the device's.
fn device_kind(e: &Error) -> ErrorKind {
    match e {
        Error::View(_)
        | Error::Shape { .. }
        | Error::DType { .. }
        | Error::Aliasing { .. }
        | Error::SelfOverlap { .. }
        | Error::OutOfBounds { .. }
        | Error::HostSize { .. }
        | Error::ForeignHandle { .. }
        | Error::Param { .. } => ErrorKind::Shape,
        Error::Unsupported { .. } => ErrorKind::Unsupported,
        _ => ErrorKind::Backend,
    }
}

pub type Result<T, E = EmbedError> = std::result::Result<T, E>;
