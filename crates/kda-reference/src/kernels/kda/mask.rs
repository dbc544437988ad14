//! The zero-padding mask: rows past the live tokens become zero, whatever they held.

use kda_core::kda::{PaddingDims, ZeroPadding};

use super::io::read_i32;

pub(in crate::kernels) fn zero_padding(
    op: &ZeroPadding<crate::ReferenceBackend>,
    dims: PaddingDims,
) -> Result<(), String> {
    let PaddingDims { rows, .. } = dims;
    let live = read_i32(&op.num_actual_tokens).first().copied().unwrap_or(0);
    if live < 0 || live as usize > rows {
        return Err(format!("num_actual_tokens = {live} is not within 0..={rows} (the rows of x)"));
    }
    let live = live as usize;
    let padding = op.x.narrow(0, live, rows - live).map_err(|e| e.to_string())?;
    // Zero is all-zero bits in every dtype, so the fill needs no rounding.
    super::super::memory::fill(&padding, 0.0)
}
