//! What loaders read from. A loader asks a tensor for its dtype and shape, checks them, and then
//! reads only the region this TP rank owns: a memory-mapped checkpoint copies just those bytes,
//! and a synthetic checkpoint generates just those values.

use std::collections::BTreeMap;
use std::ops::Range;

use super::WeightError;
use super::host::{HostTensor, gather_bytes};
use kda_core::dtype::DType;

/// One named tensor of a source, not yet read.
pub trait TensorRead: std::fmt::Debug {
    /// The stored element type.
    fn dtype(&self) -> DType;
    /// The stored shape.
    fn shape(&self) -> &[usize];
    /// The row-major sub-tensor `region` (one range per dimension), in the stored dtype.
    fn read(&self, region: &[Range<usize>]) -> Result<HostTensor, WeightError>;
}

/// One named tensor whose elements are dense row-major little-endian bytes in memory (a
/// checkpoint's shard, mapped or read; an engine's array): what [`TensorRead::read`] copies a
/// region of.
#[derive(Debug)]
pub struct DenseTensor<'a> {
    pub(super) name: &'a str,
    pub(super) dtype: DType,
    pub(super) shape: &'a [usize],
    pub(super) bytes: &'a [u8],
}

impl TensorRead for DenseTensor<'_> {
    fn dtype(&self) -> DType {
        self.dtype
    }

    fn shape(&self) -> &[usize] {
        self.shape
    }

    fn read(&self, region: &[Range<usize>]) -> Result<HostTensor, WeightError> {
        let bytes =
            gather_bytes(self.name, self.bytes, self.dtype.size_bytes(), self.shape, region)?;
        let shape: Vec<usize> = region.iter().map(|r| r.len()).collect();
        HostTensor::from_le_bytes(self.dtype, &shape, &bytes)
    }
}

impl TensorRead for HostTensor {
    fn dtype(&self) -> DType {
        HostTensor::dtype(self)
    }

    fn shape(&self) -> &[usize] {
        HostTensor::shape(self)
    }

    fn read(&self, region: &[Range<usize>]) -> Result<HostTensor, WeightError> {
        self.region(region)
    }
}

impl<T: TensorRead + ?Sized> TensorRead for &T {
    fn dtype(&self) -> DType {
        (**self).dtype()
    }

    fn shape(&self) -> &[usize] {
        (**self).shape()
    }

    fn read(&self, region: &[Range<usize>]) -> Result<HostTensor, WeightError> {
        (**self).read(region)
    }
}

/// The whole of `t`.
pub fn read_all(t: &dyn TensorRead) -> Result<HostTensor, WeightError> {
    let region: Vec<Range<usize>> = t.shape().iter().map(|&d| 0..d).collect();
    t.read(&region)
}

/// A set of named tensors: a checkpoint on disk, an in-memory map, a generator.
pub trait TensorSource {
    /// Where the tensors come from, for messages.
    fn origin(&self) -> String;
    /// Every tensor name, sorted.
    fn names(&self) -> Vec<String>;
    /// The tensor called `name`.
    fn tensor(&self, name: &str) -> Result<Box<dyn TensorRead + '_>, WeightError>;
}

/// An in-memory source (tests, tools).
impl TensorSource for BTreeMap<String, HostTensor> {
    fn origin(&self) -> String {
        "in-memory tensors".into()
    }

    fn names(&self) -> Vec<String> {
        self.keys().cloned().collect()
    }

    fn tensor(&self, name: &str) -> Result<Box<dyn TensorRead + '_>, WeightError> {
        match self.get(name) {
            Some(t) => Ok(Box::new(t)),
            None => Err(WeightError::NotFound { origin: self.origin(), name: name.to_string() }),
        }
    }
}
