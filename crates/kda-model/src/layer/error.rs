//! The layer's errors: the device's, and those of the layers of kda-core below it that only
//! the model half has (checkpoint loading, batch metadata), composed upward.

use thiserror::Error;

use crate::layer::batch::BatchError;
use crate::layer::keep::KeepError;
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
