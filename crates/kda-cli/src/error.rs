//! What a `kda` command can fail with.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum CliError {
    #[error(transparent)]
    Kda(#[from] kda_core::Error),
    #[error("invalid argument {arg}: {reason}")]
    Argument { arg: &'static str, reason: String },
    #[error("{what}: results differ between {a} and {b}")]
    Mismatch { what: String, a: &'static str, b: &'static str },
}
