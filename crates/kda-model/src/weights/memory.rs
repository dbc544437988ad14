//! [`MemorySource`]: tensors an engine already holds in memory (its own loader's output, a
//! model's parameters), named as in the checkpoint and read in place.
//!
//! Loading from it is loading from a checkpoint: the same [`super::load_layer`], so the same
//! checks and the same fused BFG composition, bit for bit. Only the region a TP rank owns is
//! copied, as from a memory-mapped file; the engine's memory is never written.

use std::collections::BTreeMap;

use super::WeightError;
use super::host::numel;
use super::source::{DenseTensor, TensorRead, TensorSource};
use kda_core::dtype::DType;

#[derive(Debug)]
struct Entry<'a> {
    dtype: DType,
    shape: Vec<usize>,
    bytes: &'a [u8],
}

/// Named tensors borrowed from memory the caller holds for the source's life.
#[derive(Debug, Default)]
pub struct MemorySource<'a> {
    origin: String,
    entries: BTreeMap<String, Entry<'a>>,
}

impl<'a> MemorySource<'a> {
    /// An empty source; `origin` names it in errors (`"weights from memory"`).
    pub fn new(origin: impl Into<String>) -> Self {
        Self { origin: origin.into(), entries: BTreeMap::new() }
    }

    /// Add `name`: `bytes` are the row-major little-endian elements of a `dtype` tensor of
    /// `shape`. A length that does not match the shape, or a name given twice, is an error
    /// naming the tensor.
    pub fn insert(
        &mut self,
        name: impl Into<String>,
        dtype: DType,
        shape: &[usize],
        bytes: &'a [u8],
    ) -> Result<(), WeightError> {
        let name = name.into();
        let expected = numel(&name, shape)?.checked_mul(dtype.size_bytes()).ok_or_else(|| {
            WeightError::shape(&name, "a shape whose byte size fits in memory", shape)
        })?;
        if bytes.len() != expected {
            return Err(WeightError::value(
                &name,
                format!(
                    "{} bytes given for a {dtype} tensor of shape {shape:?}, expected {expected}",
                    bytes.len()
                ),
            ));
        }
        if self.entries.contains_key(&name) {
            return Err(WeightError::value(&name, "given twice"));
        }
        self.entries.insert(name, Entry { dtype, shape: shape.to_vec(), bytes });
        Ok(())
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

impl TensorSource for MemorySource<'_> {
    fn origin(&self) -> String {
        self.origin.clone()
    }

    fn names(&self) -> Vec<String> {
        self.entries.keys().cloned().collect()
    }

    fn tensor(&self, name: &str) -> Result<Box<dyn TensorRead + '_>, WeightError> {
        match self.entries.get_key_value(name) {
            Some((key, e)) => Ok(Box::new(DenseTensor {
                name: key,
                dtype: e.dtype,
                shape: &e.shape,
                bytes: e.bytes,
            })),
            None => Err(WeightError::NotFound { origin: self.origin(), name: name.to_string() }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weights::source::read_all;

    #[test]
    fn reads_regions_in_place_and_checks_lengths() {
        let values: Vec<f32> = (0..12).map(|i| i as f32).collect();
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut source = MemorySource::new("test");
        source.insert("w", DType::F32, &[4, 3], &bytes).unwrap();
        assert!(source.insert("w", DType::F32, &[4, 3], &bytes).is_err());
        assert!(matches!(
            source.insert("short", DType::F32, &[4, 4], &bytes),
            Err(WeightError::Value { .. })
        ));
        assert!(source.insert("huge", DType::F32, &[usize::MAX, 2], &bytes).is_err());
        let t = source.tensor("w").unwrap();
        assert_eq!(t.shape(), &[4, 3]);
        assert_eq!(t.read(&[1..3, 0..3]).unwrap().as_f32().unwrap(), &[3., 4., 5., 6., 7., 8.]);
        assert_eq!(read_all(&*t).unwrap().as_f32().unwrap(), &values[..]);
        assert!(matches!(source.tensor("x"), Err(WeightError::NotFound { .. })));
        assert_eq!(source.names(), vec!["w".to_string()]);
    }
}
