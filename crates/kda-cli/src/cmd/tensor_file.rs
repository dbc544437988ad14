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

/// The bytes of the regular file at `path`.
pub fn read(path: &Path) -> Result<Vec<u8>, CliError> {
    crate::fsio::read_input(path)
}

/// `bytes` (read from `path`) as safetensors.
pub fn parse<'a>(path: &Path, bytes: &'a [u8]) -> Result<SafeTensors<'a>, CliError> {
    SafeTensors::deserialize(bytes).map_err(|e| safetensors_error(path, e))
}

/// Write `tensors` and `metadata` to `path` as one safetensors file (atomically: the previous
/// file stays whole if anything fails).
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
    crate::fsio::write_atomic(path, &bytes)
}

fn safetensors_error(path: &Path, e: safetensors::SafeTensorError) -> CliError {
    CliError::Safetensors { path: path.display().to_string(), message: e.to_string() }
}

/// A float tensor's values as f32 (exact for bf16) with the dtype it was stored in; f32 and
/// bf16 only. safetensors stores little-endian and does not promise alignment, so elements are
/// decoded one by one.
pub fn floats(name: &str, view: &TensorView<'_>) -> Result<(kda_core::DType, Vec<f32>), CliError> {
    let bytes = view.data();
    match view.dtype() {
        Dtype::F32 => Ok((
            kda_core::DType::F32,
            bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        )),
        Dtype::BF16 => Ok((
            kda_core::DType::BF16,
            bytes
                .chunks_exact(2)
                .map(|c| half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
                .collect(),
        )),
        other => Err(dtype_error(name, other, view.shape(), "expected f32 or bf16")),
    }
}

/// An i32 tensor's values.
pub fn i32s(name: &str, view: &TensorView<'_>) -> Result<Vec<i32>, CliError> {
    match view.dtype() {
        Dtype::I32 => Ok(view
            .data()
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()),
        other => Err(dtype_error(name, other, view.shape(), "expected i32")),
    }
}

/// Warn on stderr when input tensor `name` of `path` holds a NaN or an infinity. kda computes
/// with inputs as given (non-finite in, non-finite out, as the library does), but never
/// silently: the warning names the tensor and its first non-finite element.
pub fn warn_non_finite(path: &Path, name: &str, values: impl IntoIterator<Item = f32>) {
    if let Some((index, value)) = values.into_iter().enumerate().find(|(_, v)| !v.is_finite()) {
        tracing::warn!(
            "{}: input tensor {name:?} holds non-finite values (the first: element {index} = \
             {value}); what is computed from them will not be finite either",
            path.display()
        );
    }
}

/// f32 values as an output tensor.
pub fn f32_tensor(name: &str, shape: &[usize], values: &[f32]) -> OutTensor {
    OutTensor {
        name: name.to_string(),
        dtype: Dtype::F32,
        shape: shape.to_vec(),
        bytes: values.iter().flat_map(|x| x.to_le_bytes()).collect(),
    }
}

fn dtype_error(name: &str, dtype: Dtype, shape: &[usize], reason: &str) -> CliError {
    CliError::Tensor {
        name: name.to_string(),
        dtype: format!("{dtype:?}").to_lowercase(),
        shape: shape.to_vec(),
        reason: reason.into(),
    }
}
