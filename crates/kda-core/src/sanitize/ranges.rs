//! The exact bytes a view touches, as sorted disjoint intervals, so that two disjoint views of
//! one buffer (the B, F and G column blocks of the fused BFG output, say) do not conflict even
//! though their spans interleave.

use std::ops::Range;

use crate::layout::Layout;

/// Above this many intervals a view is described by its span instead (conservative: it can
/// only add conflicts, never hide one).
const MAX_RUNS: usize = 1 << 20;

/// Sorted, disjoint, non-adjacent byte intervals.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ByteRanges(Vec<Range<usize>>);

impl ByteRanges {
    /// The bytes of `layout`.
    pub fn of(layout: &Layout) -> Self {
        if layout.numel() == 0 {
            return Self::default();
        }
        let size = layout.dtype().size_bytes();
        let (outer, run) = layout.runs();
        if outer.numel() > MAX_RUNS {
            return Self::span(layout.byte_span());
        }
        Self::from_unsorted(outer.offsets().map(|o| o * size..(o + run) * size).collect())
    }

    /// One interval (empty ranges give the empty set).
    pub fn span(range: Range<usize>) -> Self {
        if range.is_empty() { Self::default() } else { Self(vec![range]) }
    }

    /// Normalise any list of intervals.
    pub fn from_unsorted(mut ranges: Vec<Range<usize>>) -> Self {
        ranges.retain(|r| !r.is_empty());
        ranges.sort_by_key(|r| r.start);
        let mut out: Vec<Range<usize>> = Vec::with_capacity(ranges.len());
        for r in ranges {
            match out.last_mut() {
                Some(last) if r.start <= last.end => last.end = last.end.max(r.end),
                _ => out.push(r),
            }
        }
        Self(out)
    }

    pub fn intervals(&self) -> &[Range<usize>] {
        &self.0
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// From the first to one past the last byte.
    pub fn hull(&self) -> Range<usize> {
        match (self.0.first(), self.0.last()) {
            (Some(a), Some(b)) => a.start..b.end,
            _ => 0..0,
        }
    }

    /// The first bytes both sets contain, if any.
    pub fn first_overlap(&self, other: &Self) -> Option<Range<usize>> {
        let (a, b) = (self.hull(), other.hull());
        if a.start >= b.end || b.start >= a.end {
            return None;
        }
        let (mut i, mut j) = (0, 0);
        while i < self.0.len() && j < other.0.len() {
            let (x, y) = (&self.0[i], &other.0[j]);
            let (start, end) = (x.start.max(y.start), x.end.min(y.end));
            if start < end {
                return Some(start..end);
            }
            if x.end <= y.end {
                i += 1;
            } else {
                j += 1;
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;
    use proptest::prelude::*;

    #[test]
    fn bfg_column_blocks_are_disjoint() {
        let bfg = Layout::contiguous(DType::BF16, &[4, 14]);
        let parts = bfg.split(1, &[2, 6, 6]).unwrap();
        let r: Vec<ByteRanges> = parts.iter().map(ByteRanges::of).collect();
        assert_eq!(r[0].intervals(), &[0..4, 28..32, 56..60, 84..88]);
        assert_eq!(r[0].first_overlap(&r[1]), None);
        assert_eq!(r[1].first_overlap(&r[2]), None);
        assert_eq!(ByteRanges::of(&bfg).first_overlap(&r[2]), Some(16..28));
        // A contiguous view is one interval.
        let rows = ByteRanges::of(&bfg.narrow(0, 1, 2).unwrap());
        assert_eq!((rows.intervals().len(), rows.hull()), (1, 28..84));
    }

    fn brute_bytes(l: &Layout) -> Vec<usize> {
        let size = l.dtype().size_bytes();
        let mut v: Vec<usize> = l.offsets().flat_map(|o| o * size..(o + 1) * size).collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    fn expand(r: &ByteRanges) -> Vec<usize> {
        r.intervals().iter().flat_map(|r| r.clone()).collect()
    }

    proptest! {
        #[test]
        fn ranges_are_exactly_the_viewed_bytes(
            shape in proptest::collection::vec(1usize..5, 1..4),
            strides in proptest::collection::vec(0usize..13, 3),
            offset in 0usize..7,
        ) {
            let strides = &strides[..shape.len()];
            let l = Layout::strided(DType::F32, &shape, strides, offset).unwrap();
            prop_assert_eq!(expand(&ByteRanges::of(&l)), brute_bytes(&l));
        }

        #[test]
        fn overlap_agrees_with_brute_force(
            a in (0usize..6, 1usize..4, 0usize..3),
            b in (0usize..6, 1usize..4, 0usize..3),
        ) {
            // Column blocks [start, start+len) of an [r, 8] bf16 matrix.
            let m = Layout::contiguous(DType::BF16, &[3, 8]);
            let va = m.narrow(1, a.0, a.1.min(8 - a.0)).unwrap().narrow(0, a.2, 1).unwrap();
            let vb = m.narrow(1, b.0, b.1.min(8 - b.0)).unwrap();
            let (ra, rb) = (ByteRanges::of(&va), ByteRanges::of(&vb));
            let bytes_a = brute_bytes(&va);
            let common = brute_bytes(&vb).into_iter().any(|x| bytes_a.contains(&x));
            let found = ra.first_overlap(&rb);
            prop_assert_eq!(found.is_some(), common);
            if let Some(r) = found {
                prop_assert!(r.clone().all(|x| bytes_a.contains(&x)));
            }
        }
    }
}
