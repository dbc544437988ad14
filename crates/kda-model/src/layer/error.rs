//! The layer's errors: the device's, and those of the layers of kda-core below it that only
//! the model half has (checkpoint loading, batch metadata), composed upward.

use thiserror::Error;

use crate::layer::batch::BatchError;
use crate::weights::WeightError;
use kda_core::error::{Error, ViewError};

/// Everything a [`KdaLayer`](super::KdaLayer) call can report.
#[derive(Debug, Error)]
pub enum LayerError {
    /// A device call failed or rejected an argument (shapes, dtypes, handles, execution).
    #[error(transparent)]
    Device(#[from] Error),
    /// The batch metadata is malformed or does not fit the cache.
    #[error(transparent)]
    Batch(#[from] BatchError),
    /// A state to keep (prefix caching) that the batch cannot honour.
    #[error(transparent)]
    Keep(#[from] KeepError),
    /// The layer's weights are missing, malformed or of the wrong shape.
    #[error(transparent)]
    Weights(#[from] WeightError),
}

impl From<ViewError> for LayerError {
    fn from(e: ViewError) -> Self {
        Self::Device(e.into())
    }
}

pub type Result<T, E = LayerError> = std::result::Result<T, E>;

/// A [`KeepState`](super::KeepState) the batch cannot honour. Every variant names the entry (its index in the
/// list) and the offending values.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum KeepError {
    #[error("keep[{index}]: request {request} is not in the batch of {requests} requests")]
    NoSuchRequest { index: usize, request: usize, requests: usize },
    #[error(
        "keep[{index}]: request {request} is a decode or speculative decode; states are kept \
         for prefills only"
    )]
    NotAPrefill { index: usize, request: usize },
    #[error(
        "keep[{index}]: position {position} of request {request}: expected \
         {computed} + 64·j (j >= 1) up to {end}, or {end} (num_computed_tokens + 64·j, or the \
         request's end: the recurrent state exists at chunk boundaries)"
    )]
    Position { index: usize, request: usize, position: usize, computed: usize, end: usize },
    #[error(
        "keep[{index}]: position {position} of request {request} is {into} tokens into the \
         call; its conv state needs the {history} inputs before it"
    )]
    ConvHistory { index: usize, request: usize, position: usize, into: usize, history: usize },
    #[error("keep[{index}]: slot {slot} is out of range for a cache of {slots} slots")]
    SlotOutOfRange { index: usize, slot: usize, slots: usize },
    #[error("keep[{index}]: slot {slot} is also {other}; every kept state needs a slot of its own")]
    SlotTaken { index: usize, slot: usize, other: String },
    #[error(
        "keep[{index}]: request {request}, position {position} is also kept by keep[{first}]; \
         one slot per position"
    )]
    SamePosition { index: usize, first: usize, request: usize, position: usize },
}
