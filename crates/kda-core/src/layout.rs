//! Where a tensor's elements sit in its buffer: dtype, shape, strides and offset, and the views
//! (narrow, split, reshape) that re-describe the same bytes without copying them.
//!
//! Strides and offsets count elements, not bytes; a stride may be zero only along a dimension of
//! size one. Views are pure arithmetic on a [`Layout`], so they are the same for every backend.
//!
//! Element counts and byte sizes are computed here and only here ([`checked_numel`],
//! [`checked_size_bytes`]), with checked arithmetic: a shape whose count or size does not fit the
//! address space is an error ([`ViewError::TooLarge`]), never a count that wrapped around to a
//! small number. [`crate::Tensor::new`] rejects such a layout, so every tensor's element count
//! and byte span are exact (`docs/design/reliability.md`).

use std::ops::Range;

use crate::dtype::DType;
use thiserror::Error;

/// A view (narrow, split, reshape) that does not fit the tensor it is taken of.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum ViewError {
    #[error("{op}: dimension {dim} is out of range for a rank-{rank} tensor")]
    DimOutOfRange { op: &'static str, dim: usize, rank: usize },
    #[error("{op}: range {start}..{start}+{len} along dimension {dim} exceeds its size {size}")]
    RangeOutOfBounds { op: &'static str, dim: usize, start: usize, len: usize, size: usize },
    #[error("split: sizes {sizes:?} along dimension {dim} do not add up to its size {size}")]
    SplitSizes { dim: usize, sizes: Vec<usize>, size: usize },
    #[error("reshape: {from:?} has a different element count than {to:?}")]
    ReshapeNumel { from: Vec<usize>, to: Vec<usize> },
    #[error("reshape: {from:?} with strides {strides:?} cannot be viewed as {to:?} without a copy")]
    ReshapeIncompatible { from: Vec<usize>, strides: Vec<usize>, to: Vec<usize> },
    #[error("split_heads: dimension {dim} of size {size} is not divisible into {heads} heads")]
    HeadsDoNotDivide { dim: usize, size: usize, heads: usize },
    #[error("{op}: shape {shape:?} and strides {strides:?} have different ranks")]
    RankMismatch { op: &'static str, shape: Vec<usize>, strides: Vec<usize> },
    #[error("{op}: element offsets overflow")]
    Overflow { op: &'static str },
    #[error(
        "shape {shape:?} of {dtype} is too large: its element count or byte size does not fit \
         the address space (at most isize::MAX bytes)"
    )]
    TooLarge { shape: Vec<usize>, dtype: DType },
}

/// Shape, strides and offset of a strided view over one buffer.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Layout {
    dtype: DType,
    shape: Vec<usize>,
    strides: Vec<usize>,
    offset: usize,
}

/// The largest byte size of one tensor: Rust's limit for one allocation.
pub const MAX_BYTES: usize = isize::MAX as usize;

/// Elements of `shape` (the product of its sizes; 0 when any size is 0), or `None` when the
/// product does not fit a `usize`.
pub fn checked_numel(shape: &[usize]) -> Option<usize> {
    if shape.contains(&0) {
        return Some(0);
    }
    shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d))
}

/// Bytes of a dense tensor of `dtype` and `shape`, or [`ViewError::TooLarge`] when they exceed
/// [`MAX_BYTES`] (or the element count overflows).
pub fn checked_size_bytes(dtype: DType, shape: &[usize]) -> Result<usize, ViewError> {
    checked_numel(shape)
        .and_then(|n| n.checked_mul(dtype.size_bytes()))
        .filter(|&bytes| bytes <= MAX_BYTES)
        .ok_or_else(|| ViewError::TooLarge { shape: shape.to_vec(), dtype })
}

/// Row-major strides of a contiguous tensor of `shape` (saturating: the strides of a shape too
/// large to exist are never used, because no tensor can have it).
pub fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![1usize; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        strides[d] = strides[d + 1].saturating_mul(shape[d + 1].max(1));
    }
    strides
}

impl Layout {
    /// A dense row-major layout starting at element 0.
    pub fn contiguous(dtype: DType, shape: &[usize]) -> Self {
        Self { dtype, shape: shape.to_vec(), strides: contiguous_strides(shape), offset: 0 }
    }

    /// A layout from explicit strides and offset (in elements); ranks must agree.
    pub fn strided(
        dtype: DType,
        shape: &[usize],
        strides: &[usize],
        offset: usize,
    ) -> Result<Self, ViewError> {
        if shape.len() != strides.len() {
            return Err(ViewError::RankMismatch {
                op: "strided",
                shape: shape.to_vec(),
                strides: strides.to_vec(),
            });
        }
        let layout = Self { dtype, shape: shape.to_vec(), strides: strides.to_vec(), offset };
        // The last element's offset must be representable.
        layout.max_offset().ok_or(ViewError::Overflow { op: "strided" })?;
        Ok(layout)
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    pub fn strides(&self) -> &[usize] {
        &self.strides
    }

    /// Offset of the first element, in elements.
    pub fn offset(&self) -> usize {
        self.offset
    }

    pub fn rank(&self) -> usize {
        self.shape.len()
    }

    /// Elements of the view. Saturates at `usize::MAX` for a shape whose count overflows, which
    /// no [`crate::Tensor`] can have ([`Layout::checked_byte_span`] rejects it).
    pub fn numel(&self) -> usize {
        checked_numel(&self.shape).unwrap_or(usize::MAX)
    }

    /// Bytes of a dense tensor of this dtype and shape (see [`checked_size_bytes`]).
    pub fn size_bytes(&self) -> Result<usize, ViewError> {
        checked_size_bytes(self.dtype, &self.shape)
    }

    /// Size of dimension `dim`, or an error naming the op that asked.
    pub fn dim(&self, op: &'static str, dim: usize) -> Result<usize, ViewError> {
        self.shape.get(dim).copied().ok_or(ViewError::DimOutOfRange { op, dim, rank: self.rank() })
    }

    /// True when the elements are dense and in row-major order (size-1 dims may have any stride).
    pub fn is_contiguous(&self) -> bool {
        let mut expected = 1usize;
        for (&size, &stride) in self.shape.iter().zip(&self.strides).rev() {
            if size != 1 && stride != expected {
                return false;
            }
            expected = expected.saturating_mul(size);
        }
        true
    }

    /// True when no two elements share an offset, so the view can be written in parallel.
    pub fn is_non_overlapping(&self) -> bool {
        if self.numel() == 0 {
            return true;
        }
        let mut dims: Vec<(usize, usize)> = self
            .shape
            .iter()
            .copied()
            .zip(self.strides.iter().copied())
            .filter(|&(n, _)| n > 1)
            .collect();
        dims.sort_by_key(|&(_, stride)| stride);
        // `extent` is the number of offsets spanned by the smaller-stride dims seen so far.
        let mut extent = 1;
        for (n, stride) in dims {
            if stride < extent {
                return false;
            }
            extent += stride * (n - 1);
        }
        true
    }

    /// Offset of the last element (the largest offset), or `None` for an empty view or overflow.
    fn max_offset(&self) -> Option<usize> {
        if self.numel() == 0 {
            return Some(self.offset);
        }
        self.shape.iter().zip(&self.strides).try_fold(self.offset, |acc, (&n, &s)| {
            (n - 1).checked_mul(s).and_then(|d| acc.checked_add(d))
        })
    }

    /// The bytes of the buffer this view can touch: from its first to one past its last element.
    /// Empty for a view with no elements. Strided views may skip bytes inside the range.
    /// Saturates for a layout no tensor can have (see [`Layout::checked_byte_span`]).
    pub fn byte_span(&self) -> Range<usize> {
        self.checked_byte_span().unwrap_or(MAX_BYTES..MAX_BYTES)
    }

    /// [`Layout::byte_span`], or [`ViewError::TooLarge`] when the element count, an offset or a
    /// byte position does not fit (beyond [`MAX_BYTES`]).
    pub fn checked_byte_span(&self) -> Result<Range<usize>, ViewError> {
        let too_large = || ViewError::TooLarge { shape: self.shape.clone(), dtype: self.dtype };
        let size = self.dtype.size_bytes();
        let numel = checked_numel(&self.shape).ok_or_else(too_large)?;
        let first = self.offset;
        let end =
            if numel == 0 { Some(first) } else { self.max_offset().and_then(|l| l.checked_add(1)) };
        let bytes = |elements: Option<usize>| {
            elements.and_then(|e| e.checked_mul(size)).filter(|&b| b <= MAX_BYTES)
        };
        match (bytes(Some(first)), bytes(end)) {
            (Some(start), Some(end)) => Ok(start..end),
            _ => Err(too_large()),
        }
    }

    /// Narrow dimension `dim` to `start..start + len`.
    pub fn narrow(&self, dim: usize, start: usize, len: usize) -> Result<Self, ViewError> {
        let size = self.dim("narrow", dim)?;
        match start.checked_add(len) {
            Some(end) if end <= size => {}
            _ => return Err(ViewError::RangeOutOfBounds { op: "narrow", dim, start, len, size }),
        }
        let mut out = self.clone();
        out.shape[dim] = len;
        if len > 0 {
            out.offset += start * self.strides[dim];
        }
        Ok(out)
    }

    /// Split dimension `dim` into consecutive pieces of the given sizes, which must add up to the
    /// dimension's size (as `torch.split` with a list).
    pub fn split(&self, dim: usize, sizes: &[usize]) -> Result<Vec<Self>, ViewError> {
        let size = self.dim("split", dim)?;
        let total = sizes.iter().try_fold(0usize, |a, &s| a.checked_add(s));
        if total != Some(size) {
            return Err(ViewError::SplitSizes { dim, sizes: sizes.to_vec(), size });
        }
        let mut start = 0;
        sizes
            .iter()
            .map(|&len| {
                let piece = self.narrow(dim, start, len);
                start += len;
                piece
            })
            .collect()
    }

    /// Re-describe the same elements with a new shape, without copying. Works whenever the
    /// existing strides allow it (the rule of `torch.Tensor.view`): a contiguous tensor can take
    /// any shape with the same element count, and a column slice `[T, lh*D]` of a wider matrix
    /// can still be viewed as `[T, lh, D]`.
    pub fn reshape(&self, shape: &[usize]) -> Result<Self, ViewError> {
        let numel: Option<usize> = shape.iter().try_fold(1usize, |a, &s| a.checked_mul(s));
        if numel != Some(self.numel()) {
            return Err(ViewError::ReshapeNumel { from: self.shape.clone(), to: shape.to_vec() });
        }
        let strides = view_strides(&self.shape, &self.strides, shape).ok_or_else(|| {
            ViewError::ReshapeIncompatible {
                from: self.shape.clone(),
                strides: self.strides.clone(),
                to: shape.to_vec(),
            }
        })?;
        Ok(Self { dtype: self.dtype, shape: shape.to_vec(), strides, offset: self.offset })
    }

    /// Split dimension `dim` of size `heads * d` into `[heads, d]` (e.g. `[T, lh*D]` to
    /// `[T, lh, D]`).
    pub fn split_heads(&self, dim: usize, heads: usize) -> Result<Self, ViewError> {
        let size = self.dim("split_heads", dim)?;
        if heads == 0 || size % heads != 0 {
            return Err(ViewError::HeadsDoNotDivide { dim, size, heads });
        }
        let mut shape = self.shape.clone();
        shape.splice(dim..=dim, [heads, size / heads]);
        self.reshape(&shape)
    }

    /// Element offsets of every element, in row-major logical order.
    pub fn offsets(&self) -> Offsets<'_> {
        Offsets::new(self)
    }

    /// The view as runs of elements that lie next to each other: `(outer, run)`, where the
    /// offsets of `outer` (row-major, as [`Layout::offsets`]) start one run of `run` elements
    /// each, the dense innermost dimensions merged into the run (dimensions of size one
    /// dropped). Together the runs hold the view's elements in row-major order; an empty view
    /// gives no run.
    pub fn runs(&self) -> (Layout, usize) {
        let dims: Vec<(usize, usize)> = self
            .shape
            .iter()
            .zip(&self.strides)
            .map(|(&n, &s)| (n, s))
            .filter(|&(n, _)| n != 1)
            .collect();
        let (mut run, mut split) = (1usize, dims.len());
        while split > 0 && dims[split - 1].1 == run && dims[split - 1].0 > 0 {
            run = run.saturating_mul(dims[split - 1].0);
            split -= 1;
        }
        let outer = Layout {
            dtype: self.dtype,
            shape: dims[..split].iter().map(|&(n, _)| n).collect(),
            strides: dims[..split].iter().map(|&(_, s)| s).collect(),
            offset: self.offset,
        };
        (outer, run)
    }
}

/// Strides for viewing (`shape`, `strides`) as `new_shape`, or `None` when that needs a copy.
///
/// Walks both shapes from the innermost dimension, grouping old dimensions into chunks that are
/// contiguous with each other; every chunk must be re-divided exactly by the new dimensions.
fn view_strides(shape: &[usize], strides: &[usize], new_shape: &[usize]) -> Option<Vec<usize>> {
    if checked_numel(shape) == Some(0) || shape.is_empty() {
        return Some(contiguous_strides(new_shape));
    }
    let mut new_strides = vec![0; new_shape.len()];
    let mut view_d = new_shape.len();
    let mut chunk_base = *strides.last()?;
    let mut tensor_numel = 1;
    let mut view_numel = 1;
    for d in (0..shape.len()).rev() {
        tensor_numel *= shape[d];
        let chunk_ends =
            d == 0 || (shape[d - 1] != 1 && strides[d - 1] != tensor_numel * chunk_base);
        if !chunk_ends {
            continue;
        }
        while view_d > 0 && (view_numel < tensor_numel || new_shape[view_d - 1] == 1) {
            new_strides[view_d - 1] = view_numel * chunk_base;
            view_numel *= new_shape[view_d - 1];
            view_d -= 1;
        }
        if view_numel != tensor_numel {
            return None;
        }
        if d > 0 {
            chunk_base = strides[d - 1];
            tensor_numel = 1;
            view_numel = 1;
        }
    }
    (view_d == 0).then_some(new_strides)
}

/// Iterator over the element offsets of a [`Layout`] in row-major order.
#[derive(Debug)]
pub struct Offsets<'a> {
    layout: &'a Layout,
    index: Vec<usize>,
    next: Option<usize>,
}

impl<'a> Offsets<'a> {
    fn new(layout: &'a Layout) -> Self {
        let next = (layout.numel() > 0).then_some(layout.offset);
        Self { layout, index: vec![0; layout.rank()], next }
    }
}

impl Iterator for Offsets<'_> {
    type Item = usize;

    fn next(&mut self) -> Option<usize> {
        let current = self.next?;
        let (shape, strides) = (&self.layout.shape, &self.layout.strides);
        let mut offset = current;
        let mut d = shape.len();
        self.next = loop {
            if d == 0 {
                break None;
            }
            d -= 1;
            if self.index[d] + 1 < shape[d] {
                self.index[d] += 1;
                break Some(offset + strides[d]);
            }
            offset -= self.index[d] * strides[d];
            self.index[d] = 0;
        };
        Some(current)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn l(shape: &[usize]) -> Layout {
        Layout::contiguous(DType::F32, shape)
    }

    #[test]
    fn contiguous_strides_are_row_major() {
        assert_eq!(l(&[2, 3, 4]).strides(), &[12, 4, 1]);
        assert_eq!(l(&[]).strides(), &[] as &[usize]);
        assert!(l(&[2, 3, 4]).is_contiguous());
    }

    #[test]
    fn narrow_moves_offset_and_keeps_strides() {
        let v = l(&[4, 10]).narrow(1, 3, 5).unwrap();
        assert_eq!((v.shape(), v.strides(), v.offset()), (&[4, 5][..], &[10, 1][..], 3));
        assert!(!v.is_contiguous());
        assert_eq!(v.offsets().take(7).collect::<Vec<_>>(), vec![3, 4, 5, 6, 7, 13, 14]);
        assert_eq!(v.byte_span(), 12..(3 * 10 + 8) * 4);
    }

    #[test]
    fn split_matches_bfg_layout() {
        // Fused BFG output [T, lh + 2*lp] with lh = 2, lp = 6 (D = 3).
        let bfg = l(&[5, 14]);
        let parts = bfg.split(1, &[2, 6, 6]).unwrap();
        assert_eq!(parts.iter().map(Layout::offset).collect::<Vec<_>>(), vec![0, 2, 8]);
        let g = parts[2].split_heads(1, 2).unwrap();
        assert_eq!((g.shape(), g.strides(), g.offset()), (&[5, 2, 3][..], &[14, 3, 1][..], 8));
        // Element [t=1, head=1, d=2] of g is column 8 + 3 + 2 of row 1.
        assert_eq!(g.offsets().nth(6 + 3 + 2).unwrap(), 14 + 8 + 3 + 2);
    }

    #[test]
    fn out_of_range_views_are_errors() {
        let t = l(&[4, 10]);
        assert!(matches!(t.narrow(2, 0, 1), Err(ViewError::DimOutOfRange { dim: 2, rank: 2, .. })));
        assert!(matches!(t.narrow(1, 8, 3), Err(ViewError::RangeOutOfBounds { .. })));
        assert!(matches!(t.narrow(1, usize::MAX, 2), Err(ViewError::RangeOutOfBounds { .. })));
        assert!(matches!(t.split(1, &[3, 3]), Err(ViewError::SplitSizes { .. })));
        assert!(matches!(t.reshape(&[3, 13]), Err(ViewError::ReshapeNumel { .. })));
        assert!(matches!(t.split_heads(1, 3), Err(ViewError::HeadsDoNotDivide { .. })));
        let cols = t.narrow(1, 0, 6).unwrap();
        assert!(matches!(cols.reshape(&[24]), Err(ViewError::ReshapeIncompatible { .. })));
        assert!(Layout::strided(DType::F32, &[2], &[1, 1], 0).is_err());
        assert!(Layout::strided(DType::F32, &[3], &[usize::MAX], 0).is_err());
    }

    /// Issue #21, item 1: `[2^32, 2^32]` has 2^64 elements, which an unchecked product wraps
    /// to 0 (a 0-byte buffer that a kernel then reads through).
    #[test]
    fn sizes_that_overflow_are_errors_not_wrapped_counts() {
        let huge = [1usize << 32, 1 << 32];
        assert_eq!(checked_numel(&huge), None);
        assert_eq!(checked_numel(&[1 << 40, 1 << 40, 0]), Some(0));
        assert_eq!(checked_numel(&[]), Some(1));
        assert_eq!(l(&huge).numel(), usize::MAX);
        assert_eq!(checked_size_bytes(DType::BF16, &[3, 5]), Ok(30));
        let too_large = ViewError::TooLarge { shape: vec![1 << 62], dtype: DType::F32 };
        assert_eq!(checked_size_bytes(DType::F32, &[1 << 62]), Err(too_large));
        let state = l(&[1, 1, 1 << 32, 1 << 32]);
        assert!(matches!(state.size_bytes(), Err(ViewError::TooLarge { .. })));
        assert!(matches!(state.checked_byte_span(), Err(ViewError::TooLarge { .. })));
        let far = Layout::strided(DType::F32, &[2], &[1], usize::MAX / 2).unwrap();
        assert!(far.checked_byte_span().is_err());
        assert_eq!(l(&[0, 1 << 40, 1 << 40]).checked_byte_span(), Ok(0..0));
        assert_eq!(l(&[4, 10]).narrow(1, 3, 5).unwrap().checked_byte_span(), Ok(12..152));
    }

    #[test]
    fn overlap_detection() {
        assert!(l(&[3, 4]).is_non_overlapping());
        assert!(l(&[3, 4]).narrow(1, 1, 2).unwrap().is_non_overlapping());
        assert!(Layout::strided(DType::F32, &[3, 4], &[1, 3], 0).unwrap().is_non_overlapping());
        assert!(!Layout::strided(DType::F32, &[3, 4], &[0, 1], 0).unwrap().is_non_overlapping());
        assert!(!Layout::strided(DType::F32, &[3, 4], &[2, 1], 0).unwrap().is_non_overlapping());
        assert!(Layout::strided(DType::F32, &[1, 4], &[0, 1], 0).unwrap().is_non_overlapping());
    }

    #[test]
    fn reshape_of_transposed_is_rejected_but_size_one_dims_are_free() {
        let t = Layout::strided(DType::F32, &[3, 4], &[1, 3], 0).unwrap();
        assert!(t.reshape(&[12]).is_err());
        let r = l(&[3, 4]).reshape(&[1, 3, 1, 4]).unwrap();
        assert_eq!(r.offsets().collect::<Vec<_>>(), (0..12).collect::<Vec<_>>());
    }

    /// Gather the offsets a view addresses, by brute force from the parent's multi-index.
    fn narrowed_offsets(parent: &Layout, dim: usize, start: usize, len: usize) -> Vec<usize> {
        let all: Vec<usize> = parent.offsets().collect();
        let inner: usize = parent.shape()[dim + 1..].iter().product();
        all.into_iter()
            .enumerate()
            .filter(|(i, _)| {
                let along = (i / inner) % parent.shape()[dim];
                (start..start + len).contains(&along)
            })
            .map(|(_, o)| o)
            .collect()
    }

    #[test]
    fn a_column_block_is_one_run_per_row_and_a_dense_view_one_run() {
        let block = l(&[3, 10]).narrow(1, 2, 4).unwrap().reshape(&[3, 2, 2]).unwrap();
        let (outer, run) = block.runs();
        assert_eq!((outer.offsets().collect::<Vec<_>>(), run), (vec![2, 12, 22], 4));
        let (outer, run) = l(&[2, 1, 3]).runs();
        assert_eq!((outer.offsets().collect::<Vec<_>>(), run), (vec![0], 6));
    }

    proptest! {
        #[test]
        fn narrow_selects_exactly_the_parent_elements(
            shape in proptest::collection::vec(1usize..5, 1..4),
            dim_seed in 0usize..8, start_seed in 0usize..8, len_seed in 0usize..8,
        ) {
            let parent = l(&shape);
            let dim = dim_seed % shape.len();
            let start = start_seed % shape[dim];
            let len = len_seed % (shape[dim] - start + 1);
            let v = parent.narrow(dim, start, len).unwrap();
            prop_assert_eq!(v.offsets().collect::<Vec<_>>(), narrowed_offsets(&parent, dim, start, len));
        }

        #[test]
        fn runs_hold_the_offsets_in_order(
            shape in proptest::collection::vec(0usize..5, 0..5),
            strides in proptest::collection::vec(0usize..40, 5),
            offset in 0usize..7,
        ) {
            // Any strides (overlapping, permuted, broadcast, dense suffixes), any sizes, empty too.
            let strides = &strides[..shape.len()];
            let v = Layout::strided(DType::F32, &shape, strides, offset).unwrap();
            let (outer, run) = v.runs();
            let from_runs: Vec<usize> = outer.offsets().flat_map(|o| o..o + run).collect();
            prop_assert_eq!(from_runs, v.offsets().collect::<Vec<_>>());
        }

        #[test]
        fn reshape_preserves_element_order(
            shape in proptest::collection::vec(1usize..5, 1..4),
            cut in 0usize..4,
        ) {
            // Narrow the outermost dim (keeps viewability), then flatten and re-split.
            let parent = l(&shape);
            let v = parent.narrow(0, 0, shape[0] - cut.min(shape[0] - 1)).unwrap();
            let flat = v.reshape(&[v.numel()]).unwrap();
            prop_assert_eq!(flat.offsets().collect::<Vec<_>>(), v.offsets().collect::<Vec<_>>());
            let back = flat.reshape(v.shape()).unwrap();
            prop_assert_eq!(back.offsets().collect::<Vec<_>>(), v.offsets().collect::<Vec<_>>());
        }
    }
}
