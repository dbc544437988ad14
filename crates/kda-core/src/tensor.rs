//! Device tensors: a buffer handle plus a [`Layout`]. Views share the buffer and never copy.

use std::fmt;
use std::ops::Range;

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::layout::Layout;
use crate::resource::{BufferHandle, Resources};

/// A strided view of (part of) one device buffer.
pub struct Tensor<B: Resources> {
    buffer: B::Buffer,
    layout: Layout,
}

impl<B: Resources> Clone for Tensor<B> {
    fn clone(&self) -> Self {
        Self { buffer: self.buffer.clone(), layout: self.layout.clone() }
    }
}

impl<B: Resources> fmt::Debug for Tensor<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tensor")
            .field("buffer", &self.buffer.id())
            .field("dtype", &self.layout.dtype())
            .field("shape", &self.layout.shape())
            .field("strides", &self.layout.strides())
            .field("offset", &self.layout.offset())
            .finish()
    }
}

impl<B: Resources> Tensor<B> {
    /// Wrap `buffer` with `layout`; fails if the view reaches past the end of the buffer, or
    /// if its element count or byte span does not fit the address space (so `numel` and
    /// `byte_span` of every tensor are exact).
    pub fn new(buffer: B::Buffer, layout: Layout) -> Result<Self> {
        let span = layout.checked_byte_span()?;
        if span.end > buffer.len_bytes() {
            return Err(Error::OutOfBounds {
                param: "tensor",
                needed: (span.start, span.end),
                len: buffer.len_bytes(),
            });
        }
        Ok(Self { buffer, layout })
    }

    pub fn buffer(&self) -> &B::Buffer {
        &self.buffer
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    pub fn dtype(&self) -> DType {
        self.layout.dtype()
    }

    pub fn shape(&self) -> &[usize] {
        self.layout.shape()
    }

    pub fn numel(&self) -> usize {
        self.layout.numel()
    }

    /// Bytes of the buffer from this view's first to one past its last element.
    pub fn byte_span(&self) -> Range<usize> {
        self.layout.byte_span()
    }

    /// Whether this view and `other` may share bytes (conservative: compares the byte spans
    /// they can touch, so two interleaved strided views count as overlapping).
    pub fn overlaps(&self, other: &Tensor<B>) -> bool {
        let (a, b) = (self.byte_span(), other.byte_span());
        self.buffer.id() == other.buffer.id()
            && !a.is_empty()
            && !b.is_empty()
            && a.start < b.end
            && b.start < a.end
    }

    fn with_layout(&self, layout: Layout) -> Self {
        Self { buffer: self.buffer.clone(), layout }
    }

    /// Narrow dimension `dim` to `start..start + len` (no copy).
    pub fn narrow(&self, dim: usize, start: usize, len: usize) -> Result<Self> {
        Ok(self.with_layout(self.layout.narrow(dim, start, len)?))
    }

    /// Split dimension `dim` into pieces of `sizes` (no copy).
    pub fn split(&self, dim: usize, sizes: &[usize]) -> Result<Vec<Self>> {
        Ok(self.layout.split(dim, sizes)?.into_iter().map(|l| self.with_layout(l)).collect())
    }

    /// View with a new shape (no copy); see [`Layout::reshape`].
    pub fn reshape(&self, shape: &[usize]) -> Result<Self> {
        Ok(self.with_layout(self.layout.reshape(shape)?))
    }

    /// View dimension `dim` as `[heads, size / heads]` (no copy).
    pub fn split_heads(&self, dim: usize, heads: usize) -> Result<Self> {
        Ok(self.with_layout(self.layout.split_heads(dim, heads)?))
    }
}
