//! What a `kda` command can fail with.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum CliError {
    #[error(transparent)]
    Kda(#[from] kda_core::Error),
    #[error("invalid argument {arg}: {reason}")]
    Argument { arg: &'static str, reason: String },
    /// `--backend` names a backend that cannot run here.
    #[error("--backend {backend}: {reason}")]
    BackendUnavailable {
        backend: &'static str,
        #[source]
        reason: Unavailable,
    },
    /// The command is made of the per-op timeline, which only the reference backend records.
    #[error(
        "`{command}` needs an op timeline (every op's start and end), which only the reference \
         backend records; the {backend} backend has none: use --backend reference"
    )]
    NeedsTimeline { command: &'static str, backend: &'static str },
    #[error("check failed: {reason}")]
    CheckFailed { reason: String },
    #[error("the sanitizer found {count} stream hazard(s); the first: {first}")]
    Hazards { count: usize, first: String },
    #[error("{what}: results differ between {a} and {b}")]
    Mismatch { what: String, a: &'static str, b: &'static str },
    #[error(transparent)]
    Layer(#[from] kda_model::layer::LayerError),
    #[error(transparent)]
    Mx(#[from] kda_core::MxError),
    #[error(transparent)]
    Weights(#[from] kda_model::weights::WeightError),
    #[error("cannot {action} {path}: {source}")]
    Io { action: &'static str, path: String, source: std::io::Error },
    #[error("{path}: not a valid safetensors file: {message}")]
    Safetensors { path: String, message: String },
    #[error("{path}: no tensor named {name:?} (needed: {needed})")]
    MissingTensor { path: String, name: &'static str, needed: &'static str },
    #[error("tensor {name:?} ({dtype}, shape {shape:?}): {reason}")]
    Tensor { name: String, dtype: String, shape: Vec<usize>, reason: String },
}

/// Why a backend cannot run in this process.
#[derive(Debug, Error)]
pub enum Unavailable {
    /// This `kda` was built without it.
    #[error("not compiled in: build kda-cli with {enable}")]
    NotCompiledIn { enable: &'static str },
    /// Built in, but it did not start (no device, no driver): the backend's own message.
    #[error("{message}")]
    CannotStart { message: String },
}
