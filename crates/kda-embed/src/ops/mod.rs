//! The standalone ops an engine calls outside a layer, as the CLI's `kda quant` and `kda core`
//! do: MXFP8 quantization and the KDA recurrence in flash-linear-attention's conventions
//! ([`mod@core`], which the CLI's `kda core` runs too).

pub mod core;

use half::bf16;
use kda_core::DType;
use kda_core::mx::{self, ScaleAlg};

use crate::array::ForeignArray;
use crate::error::{EmbedError, Result};

pub use self::core::{
    CoreAlgo, CoreArgs, CoreDims, CoreError, CoreInputs, CoreOptions, CoreOutput, HostTensor, core,
    core_on, upload_values,
};

/// An MXFP8 quantization: E4M3 bytes with the input's shape, E8M0 scale bytes `[.., ceil(K/32)]`
/// (plain layout).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Quantized {
    pub data: Vec<u8>,
    pub data_shape: Vec<usize>,
    pub scale: Vec<u8>,
    pub scale_shape: Vec<usize>,
}

/// Quantize a host `[K]` or `[N, K]` f32 / bf16 array to MXFP8 with `scale_alg` (0: OCP floor,
/// 1: round up), blocks of 32 along K, bit for bit as [`kda_core::mx::quantize`].
pub fn quant(x: &ForeignArray, scale_alg: i64) -> Result<Quantized> {
    let alg = u8::try_from(scale_alg)
        .ok()
        .and_then(|code| ScaleAlg::try_from(code).ok())
        .ok_or_else(|| EmbedError::Argument {
            param: "scale_alg",
            expected: "0 (OCP floor) or 1 (round up)",
            actual: scale_alg.to_string(),
        })?;
    x.expect_dtype("x", &[DType::F32, DType::BF16])?;
    let shape = x.shape().to_vec();
    let (rows, k) = match shape[..] {
        [k] => (1, k),
        [rows, k] => (rows, k),
        _ => {
            return Err(EmbedError::Array {
                param: "x",
                message: format!("shape {shape:?}, expected [K] or [N, K]"),
            });
        }
    };
    let values = x.to_f32("x")?;
    let q = match x.dtype() {
        DType::BF16 => {
            let v: Vec<bf16> = values.iter().map(|&f| bf16::from_f32(f)).collect();
            mx::quantize(&v, rows, k, alg)
        }
        _ => mx::quantize(&values, rows, k, alg),
    }
    .map_err(kda_core::Error::from)?;
    let blocks = k.div_ceil(mx::BLOCK_SIZE);
    let scale_shape = if shape.len() == 1 { vec![blocks] } else { vec![rows, blocks] };
    Ok(Quantized { data: q.data, data_shape: shape, scale: q.scale, scale_shape })
}
