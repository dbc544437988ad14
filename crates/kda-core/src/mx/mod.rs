//! MXFP8 (OCP microscaling), bit for bit: the E4M3 element codec, the E8M0 block scale, the scale
//! algorithms, block quantization and dequantization, the quantized GEMM's defining formula, and
//! the plain and Ascend scale layouts. Pure functions on host slices.
//!
//! This module is the specification every backend must match (see `docs/design/mxfp8.md`): the
//! reference backend's kernels call these functions, and the conformance suite compares every
//! backend with them byte for byte.
//!
//! - [`e4m3`]: `float8_e4m3fn` elements ([`encode_e4m3`], [`decode_e4m3`]);
//! - [`e8m0`]: the shared power-of-two scale ([`decode_e8m0`], [`e8m0_round_up`]);
//! - [`scale`]: [`ScaleAlg`], the Ascend `scale_alg` numbering;
//! - [`quant`]: blocks of [`BLOCK_SIZE`] along the last dimension ([`quantize`], [`dequantize`]);
//! - [`gemm`]: the quantized GEMM `y = a · w^T` with its summation order ([`gemm::gemm`]);
//! - [`layout`]: where the scales sit ([`ScaleLayout`]: plain, Ascend paired).
//!
//! Inputs are f32 or bf16 ([`MxFloat`]); a bf16 input is widened to f32 exactly, so the block
//! maximum is taken in the input's own precision, as the spec requires.

pub mod e4m3;
pub mod e8m0;
pub mod gemm;
pub mod layout;
pub mod quant;
#[cfg(target_arch = "x86_64")]
mod quant_avx2;
pub mod scale;
#[cfg(test)]
mod spec_tests;

use thiserror::Error;

use crate::dtype::DType;

pub use e4m3::{E4M3_MAX, E4M3_MAX_BYTE, E4M3_NAN, decode_e4m3, encode_e4m3, is_nan_e4m3};
pub use e8m0::{E8M0_NAN, decode_e8m0, decode_e8m0_f64, e8m0_round_up};
pub use layout::{ScaleLayout, transpose_bytes};
pub use quant::{
    Quantized, dequantize, dequantize_f64, dequantize_into, dequantize_row, dequantize_value,
    dequantize_value_f64, quantize, quantize_block, quantize_block_with_scale, quantize_into,
    quantize_row,
};
pub use scale::ScaleAlg;

/// Elements that share one E8M0 scale, consecutive along the last (K) dimension.
pub const BLOCK_SIZE: usize = 32;

/// Scale blocks of a row of `k` elements: `ceil(k / 32)`. A partial last block has its own
/// scale, computed from its real elements only.
pub const fn num_blocks(k: usize) -> usize {
    k.div_ceil(BLOCK_SIZE)
}

/// What the codec's host functions can reject. Values are never errors: NaN and infinity have
/// defined encodings.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum MxError {
    #[error("scale_alg {0} is not defined: expected 0 (OCP floor) or 1 (round up)")]
    UnknownScaleAlg(String),
    #[error("{what}: {param} has {actual} elements, expected {expected}")]
    Length { what: &'static str, param: &'static str, expected: usize, actual: usize },
    #[error("{what}: a [{rows}, {k}] matrix has more elements than memory can address")]
    Overflow { what: &'static str, rows: usize, k: usize },
}

/// Check that `param` of `what` has `expected` elements.
pub(crate) fn expect_len(
    what: &'static str,
    param: &'static str,
    actual: usize,
    expected: usize,
) -> Result<(), MxError> {
    if actual == expected { Ok(()) } else { Err(MxError::Length { what, param, expected, actual }) }
}

/// `rows * k`, or an error naming the op.
pub(crate) fn elements(what: &'static str, rows: usize, k: usize) -> Result<usize, MxError> {
    rows.checked_mul(k).ok_or(MxError::Overflow { what, rows, k })
}

mod sealed {
    pub trait Sealed: Sized {
        /// The raw bits of a bf16 slice, for the quantizer's 16-bit path; `None` for f32.
        fn as_bf16_bits(x: &[Self]) -> Option<&[u16]>;
    }
    impl Sealed for f32 {
        #[inline(always)]
        fn as_bf16_bits(_: &[f32]) -> Option<&[u16]> {
            None
        }
    }
    impl Sealed for half::bf16 {
        #[inline(always)]
        fn as_bf16_bits(x: &[half::bf16]) -> Option<&[u16]> {
            use half::slice::HalfFloatSliceExt;
            Some(x.reinterpret_cast())
        }
    }
}

/// An input element the quantizer accepts: f32 or bf16.
pub trait MxFloat: Copy + Send + Sync + sealed::Sealed + 'static {
    /// The device dtype of this element.
    const DTYPE: DType;
    /// The bits of the value as an f32 (exact: bf16 is the top half of an f32).
    fn to_f32_bits(self) -> u32;
}

impl MxFloat for f32 {
    const DTYPE: DType = DType::F32;
    #[inline(always)]
    fn to_f32_bits(self) -> u32 {
        self.to_bits()
    }
}

impl MxFloat for half::bf16 {
    const DTYPE: DType = DType::BF16;
    #[inline(always)]
    fn to_f32_bits(self) -> u32 {
        u32::from(self.to_bits()) << 16
    }
}
