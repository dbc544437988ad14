//! The zero-padding mask of the dispatch boundary (`docs/design/kda.md#padding-and-empty-batches`):
//! rows past the live tokens of a graph-padded buffer are set to zero, whatever a kernel left there
//! (NaN included, which no multiplicative mask could clear).

use crate::error::Result;
use crate::resource::Resources;
use crate::tensor::Tensor;

use super::check;

/// Sizes of a validated [`ZeroPadding`]: `rows` rows of `row_len` elements.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct PaddingDims {
    pub rows: usize,
    pub row_len: usize,
}

/// Set rows `num_actual_tokens ..` of `x` (its first dimension) to zero, in place. The count is
/// device data (so a captured graph can be replayed with another batch) and is checked when the
/// op runs: it must lie in `0 ..= T`.
#[derive(Clone, Debug)]
pub struct ZeroPadding<B: Resources> {
    /// `[T, ...]`, any dtype (zero is all-zero bits in every dtype kda has), read and written.
    pub x: Tensor<B>,
    /// `[1]` i32: the live rows.
    pub num_actual_tokens: Tensor<B>,
}

impl<B: Resources> ZeroPadding<B> {
    pub const NAME: &'static str = "zero_padding";

    pub fn inputs(&self) -> Vec<(&'static str, &Tensor<B>)> {
        vec![("num_actual_tokens", &self.num_actual_tokens)]
    }

    pub fn outputs(&self) -> Vec<(&'static str, &Tensor<B>)> {
        vec![("x", &self.x)]
    }

    /// Check shapes and dtypes and return the sizes.
    pub fn validate(&self) -> Result<PaddingDims> {
        const OP: &str = "zero_padding";
        check::meta(OP, "num_actual_tokens", &self.num_actual_tokens, &[1], "one count")?;
        let Some((&rows, rest)) = self.x.shape().split_first() else {
            return Err(crate::Error::Shape {
                op: OP,
                param: "x",
                expected: "[T, ...] (rank at least 1)".into(),
                actual: vec![],
            });
        };
        // A tensor's element count is exact, so the count of its trailing dims is too.
        let row_len = crate::layout::checked_numel(rest).unwrap_or(usize::MAX);
        Ok(PaddingDims { rows, row_len })
    }
}
