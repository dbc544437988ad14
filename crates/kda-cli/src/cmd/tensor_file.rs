//! The safetensors files that commands read and write, with errors that name the file.

use std::collections::HashMap;
use std::path::Path;

use safetensors::SafeTensors;
use safetensors::tensor::{Dtype, TensorView};

use crate::error::CliError;

/// One tensor to write: name, dtype, shape and little-endian bytes.
#[derive(Debug)]
pub struct OutTensor {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub bytes: Vec<u8>,
}

/// The bytes of the file at `path`.
pub fn read(path: &Path) -> Result<Vec<u8>, CliError> {
    std::fs::read(path).map_err(|source| CliError::Io {
        action: "read",
        path: path.display().to_string(),
        source,
    })
}

/// `bytes` (read from `path`) as safetensors.
pub fn parse<'a>(path: &Path, bytes: &'a [u8]) -> Result<SafeTensors<'a>, CliError> {
    SafeTensors::deserialize(bytes).map_err(|e| safetensors_error(path, e))
}

/// Write `tensors` and `metadata` to `path` as one safetensors file.
pub fn write(
    path: &Path,
    tensors: &[OutTensor],
    metadata: HashMap<String, String>,
) -> Result<(), CliError> {
    let views = tensors
        .iter()
        .map(|t| Ok((t.name.as_str(), TensorView::new(t.dtype, t.shape.clone(), &t.bytes)?)))
        .collect::<Result<Vec<_>, safetensors::SafeTensorError>>()
        .map_err(|e| safetensors_error(path, e))?;
    let bytes =
        safetensors::serialize(views, Some(metadata)).map_err(|e| safetensors_error(path, e))?;
    std::fs::write(path, bytes).map_err(|source| CliError::Io {
        action: "write",
        path: path.display().to_string(),
        source,
    })
}

fn safetensors_error(path: &Path, e: safetensors::SafeTensorError) -> CliError {
    CliError::Safetensors { path: path.display().to_string(), message: e.to_string() }
}
