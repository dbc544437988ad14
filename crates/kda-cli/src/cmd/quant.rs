//! `kda quant`: offline MXFP8 quantization of a safetensors file.
//!
//! Every f32 or bf16 tensor `NAME` (1-D `[K]` or 2-D `[N, K]`, blocks of 32 along the last
//! dimension) becomes `NAME.data` (u8 E4M3 bytes, the same shape) and `NAME.scale` (u8 E8M0
//! bytes). Scales are plain (`[ceil(K/32)]` or `[N, ceil(K/32)]`) or in Ascend's weight layout
//! (`[ceil(K/64), 2]` or `[ceil(K/64), N, 2]`, padded with zero bytes): a checkpoint's tensors
//! are weights. The quantization is the `DynamicQuant` op of the backend `--backend` names (the
//! reference by default), whose bytes are exactly [`kda_core::mx::quantize`]'s on every backend
//! (the conformance suite holds each to the codec); the Ascend layout is arranged on the host.
//! The output's metadata records the format, block size, scale algorithm and layout.

use std::collections::HashMap;
use std::path::Path;

use clap::{Args, ValueEnum};
use half::bf16;
use kda_core::mx::{self, MxFloat};
use kda_core::{Backend, DType, Device, E8M0, Element, F8E4M3, Op, ScaleAlg, ScaleLayout};
use safetensors::tensor::{Dtype, TensorView};

use super::backend::{BackendArg, Settings, on_backend};
use super::tensor_file::{self, OutTensor};
use crate::error::CliError;

#[derive(Debug, Args)]
pub struct QuantArgs {
    /// The safetensors file to quantize.
    #[arg(long)]
    pub input: std::path::PathBuf,
    /// Where to write the quantized safetensors file.
    #[arg(long)]
    pub output: std::path::PathBuf,
    /// Scale algorithm (Ascend's `scale_alg`): 0 = OCP floor (Kimi K3's), 1 = round up.
    #[arg(long, default_value = "0", value_parser = parse_scale_alg)]
    pub scale_alg: ScaleAlg,
    /// Layout of the scales: plain `[N, ceil(K/32)]`, or Ascend's paired weight layout
    /// `[ceil(K/64), N, 2]`.
    #[arg(long, value_enum, default_value_t = ScaleLayoutArg::Plain)]
    pub layout: ScaleLayoutArg,
    #[command(flatten)]
    pub device: BackendArg,
}

fn parse_scale_alg(s: &str) -> Result<ScaleAlg, String> {
    s.parse::<ScaleAlg>().map_err(|e| e.to_string())
}

/// The `--layout` choices.
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum ScaleLayoutArg {
    Plain,
    Ascend,
}

impl ScaleLayoutArg {
    fn layout(self) -> ScaleLayout {
        match self {
            ScaleLayoutArg::Plain => ScaleLayout::Plain,
            ScaleLayoutArg::Ascend => ScaleLayout::AscendWeight,
        }
    }

    fn name(self) -> &'static str {
        match self {
            ScaleLayoutArg::Plain => "plain",
            ScaleLayoutArg::Ascend => "ascend",
        }
    }
}

pub fn run(args: &QuantArgs) -> Result<(), CliError> {
    crate::fsio::check_outputs(&[("--output", &args.output)], &[&args.input])?;
    on_backend!(args.device.backend, &Settings::default(), |b| run_on(args, b))
}

fn run_on<B: Backend>(args: &QuantArgs, b: Device<B>) -> Result<(), CliError> {
    let stream = b.new_stream()?;
    let input = display(&args.input);
    let file = tensor_file::read(&args.input)?;
    let tensors = tensor_file::parse(&args.input, &file)?;
    let mut names = tensors.names();
    names.sort();
    let mut outputs = Vec::with_capacity(2 * names.len());
    for name in names {
        let view = tensors
            .tensor(name)
            .map_err(|e| CliError::Safetensors { path: input.clone(), message: e.to_string() })?;
        let (data, scale) =
            quantize_tensor(&b, &stream, &args.input, name, &view, args.scale_alg, args.layout)?;
        println!(
            "{name} {:?} {} -> {}.data {:?} u8, {}.scale {:?} u8",
            view.shape(),
            dtype_name(view.dtype()),
            name,
            data.shape,
            name,
            scale.shape
        );
        outputs.push(data);
        outputs.push(scale);
    }
    let metadata = HashMap::from([
        ("format".to_string(), "mxfp8".to_string()),
        ("element".to_string(), "e4m3".to_string()),
        ("block_size".to_string(), mx::BLOCK_SIZE.to_string()),
        ("scale_alg".to_string(), args.scale_alg.code().to_string()),
        ("scale_layout".to_string(), args.layout.name().to_string()),
    ]);
    tensor_file::write(&args.output, &outputs, metadata)?;
    println!(
        "wrote {} tensors to {} (scale_alg {}, {} scales)",
        outputs.len(),
        display(&args.output),
        args.scale_alg,
        args.layout.name()
    );
    Ok(())
}

fn display(path: &Path) -> String {
    path.display().to_string()
}

fn dtype_name(dtype: Dtype) -> String {
    match dtype {
        Dtype::F32 => "f32".into(),
        Dtype::BF16 => "bf16".into(),
        other => format!("{other:?}").to_lowercase(),
    }
}

/// Quantize one tensor (of the file `path`) on `b` into its `.data` and `.scale` outputs.
fn quantize_tensor<B: Backend>(
    b: &Device<B>,
    s: &B::Stream,
    path: &Path,
    name: &str,
    view: &TensorView<'_>,
    alg: ScaleAlg,
    layout: ScaleLayoutArg,
) -> Result<(OutTensor, OutTensor), CliError> {
    let shape = view.shape().to_vec();
    let error = |reason: &str| CliError::Tensor {
        name: name.to_string(),
        dtype: dtype_name(view.dtype()),
        shape: shape.clone(),
        reason: reason.to_string(),
    };
    let (rows, k) = match shape[..] {
        [k] => (1, k),
        [rows, k] => (rows, k),
        _ => return Err(error("expected a 1-D [K] or 2-D [N, K] tensor")),
    };
    let bytes = view.data();
    // safetensors stores little-endian and does not promise alignment: decode element by element.
    let q = match view.dtype() {
        Dtype::F32 => {
            let values: Vec<f32> = bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            tensor_file::warn_non_finite(path, name, values.iter().copied());
            quantize_on(b, s, &values, rows, k, alg)?
        }
        Dtype::BF16 => {
            let values: Vec<bf16> = bytes
                .chunks_exact(2)
                .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])))
                .collect();
            tensor_file::warn_non_finite(path, name, values.iter().map(|v| v.to_f32()));
            quantize_on(b, s, &values, rows, k, alg)?
        }
        _ => return Err(error("only f32 and bf16 tensors can be quantized")),
    };
    let scale_layout = layout.layout();
    let mut scale_shape = scale_layout.scale_shape(rows, k);
    if shape.len() == 1 {
        // A 1-D tensor is one row; its scales drop the row dimension.
        let row_dim = if scale_layout == ScaleLayout::Plain { 0 } else { 1 };
        scale_shape.remove(row_dim);
    }
    let scale = scale_layout.from_plain(&q.scale, rows, k)?;
    Ok((
        OutTensor { name: format!("{name}.data"), dtype: Dtype::U8, shape, bytes: q.data },
        OutTensor {
            name: format!("{name}.scale"),
            dtype: Dtype::U8,
            shape: scale_shape,
            bytes: scale,
        },
    ))
}

/// `x` `[rows, k]` quantized by the device's `DynamicQuant` (an empty tensor has nothing to
/// launch: the codec's empty result).
fn quantize_on<B: Backend, T: Element + MxFloat>(
    b: &Device<B>,
    s: &B::Stream,
    x: &[T],
    rows: usize,
    k: usize,
    alg: ScaleAlg,
) -> Result<mx::Quantized, CliError> {
    if rows == 0 || k == 0 {
        return Ok(mx::quantize(x, rows, k, alg)?);
    }
    let input = b.alloc(<T as Element>::DTYPE, &[rows, k])?;
    b.upload(s, &input, x)?;
    let data = b.alloc(DType::E4M3, &[rows, k])?;
    let scale = b.alloc(DType::E8M0, &[rows, mx::num_blocks(k)])?;
    b.launch(s, Op::DynamicQuant { x: input, data: data.clone(), scale: scale.clone(), alg })?;
    Ok(mx::Quantized {
        rows,
        k,
        data: b.download::<F8E4M3>(s, &data)?.into_iter().map(|q| q.0).collect(),
        scale: b.download::<E8M0>(s, &scale)?.into_iter().map(|q| q.0).collect(),
    })
}
