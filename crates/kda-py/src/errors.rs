//! kda's errors as Python exceptions: `kda.Error` and one subclass per [`ErrorKind`], each
//! carrying the Rust error's message.

use kda_embed::{EmbedError, ErrorKind};
use pyo3::PyErr;
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyValueError};

create_exception!(
    kda,
    Error,
    PyException,
    "Every error kda raises (except ValueError for an unknown option name)."
);
create_exception!(
    kda,
    ShapeError,
    Error,
    "A tensor of the wrong shape, dtype or layout, or a cache of another layer."
);
create_exception!(
    kda,
    MetadataError,
    Error,
    "Batch metadata that is malformed or does not fit the cache."
);
create_exception!(
    kda,
    CheckpointError,
    Error,
    "A checkpoint that cannot be read or does not hold the layer."
);
create_exception!(kda, BackendError, Error, "A device call or an op failed.");
create_exception!(kda, UnsupportedError, BackendError, "What this backend or build cannot do.");

/// The exception of `e`'s class, with kda's message.
pub fn to_py(e: EmbedError) -> PyErr {
    let message = e.message();
    match e.kind() {
        ErrorKind::Argument => PyValueError::new_err(message),
        ErrorKind::Shape => ShapeError::new_err(message),
        ErrorKind::Metadata => MetadataError::new_err(message),
        ErrorKind::Checkpoint => CheckpointError::new_err(message),
        ErrorKind::Unsupported => UnsupportedError::new_err(message),
        ErrorKind::Backend => BackendError::new_err(message),
        ErrorKind::Internal => Error::new_err(message),
    }
}
