//! The device weights a projection schedule multiplies with: the fused QKV linear (bf16, or MXFP8
//! with its activation scale algorithm) and the fused BFG linear (composed F, or staged F as two
//! GEMMs for comparison), checked against each other, and [`ProjectionWeights::upload`] to put
//! one rank's loaded checkpoint weights ([`LayerWeights`]) on a device.

use crate::schedule::qkv_path::QkvPath;
use crate::weights::{BfgMode, HostTensor, LayerWeights, QkvWeights, dequantize_bf16};
use kda_core::device::Device;
use kda_core::dtype::DType;
use kda_core::error::{Error, Result};
use kda_core::hal::Backend;
use kda_core::mx::{ScaleAlg, num_blocks};
use kda_core::tensor::Tensor;

const WHAT: &str = "projection weights";

/// One TP rank's projection sizes: hidden size `Hd`, local heads `lh`, head dim `D`; the local
/// projection is `lp = lh * D` (`docs/design/kda.md#notation`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct ProjectionDims {
    pub hidden: usize,
    pub heads: usize,
    pub head_dim: usize,
}

impl ProjectionDims {
    /// `lp = lh * D`.
    pub fn local_projection(&self) -> usize {
        self.heads * self.head_dim
    }

    /// Width of the fused QKV output, `3 * lp`.
    pub fn qkv_width(&self) -> usize {
        3 * self.local_projection()
    }

    /// Width of the fused BFG output, `lh + 2 * lp` (columns `[B | F | G]`).
    pub fn bfg_width(&self) -> usize {
        self.heads + 2 * self.local_projection()
    }

    /// Kimi K3 at TP 8: `Hd = 7168`, `lh = 12`, `D = 128`.
    pub const K3_TP8: Self = Self { hidden: 7168, heads: 12, head_dim: 128 };
}

/// The fused QKV linear, local rows `[q shard | k shard | v shard]`.
#[derive(Clone, Debug)]
pub enum QkvWeight<B: Backend> {
    /// A dense weight `[3 lp, Hd]` (bf16, or any float the GEMM takes).
    Bf16 { w: Tensor<B> },
    /// MXFP8 W8A8: E4M3 `data [3 lp, Hd]`, E8M0 `scale [3 lp, ceil(Hd/32)]` (plain layout), and
    /// the `scale_alg` the activation's DynamicQuant uses (the checkpoint's configuration).
    Mxfp8 { data: Tensor<B>, scale: Tensor<B>, alg: ScaleAlg },
}

/// The fused BFG linear, local rows `[B | F | G]`.
#[derive(Clone, Debug)]
pub enum BfgWeight<B: Backend> {
    /// One weight `[lh + 2 lp, Hd]` with F composed at load time (`f_b @ f_a` in fp32, cast
    /// once): one GEMM.
    Composed { w: Tensor<B> },
    /// F left as its two factors: `b [lh, Hd]`, `f_a [D, Hd]`, `f_b [lp, D]`, `g [lp, Hd]`.
    /// F is `(x · f_a^T)` rounded to bf16, then `· f_b^T`: four GEMMs, one of them skinny and
    /// dependent, with the intermediate rounding the composition removes.
    Staged { b: Tensor<B>, f_a: Tensor<B>, f_b: Tensor<B>, g: Tensor<B> },
}

/// The weights of one layer's projections on one rank, checked against each other.
#[derive(Clone, Debug)]
pub struct ProjectionWeights<B: Backend> {
    dims: ProjectionDims,
    qkv: QkvWeight<B>,
    bfg: BfgWeight<B>,
}

fn expect(param: &'static str, t: &Tensor<impl Backend>, shape: &[usize]) -> Result<()> {
    if t.shape() == shape {
        Ok(())
    } else {
        Err(Error::Shape {
            op: WHAT,
            param,
            expected: format!("{shape:?}"),
            actual: t.shape().into(),
        })
    }
}

fn expect_dtype(param: &'static str, t: &Tensor<impl Backend>, ok: &[DType]) -> Result<()> {
    if ok.contains(&t.dtype()) {
        return Ok(());
    }
    let names: Vec<&str> = ok.iter().map(|d| d.name()).collect();
    Err(Error::DType { op: WHAT, param, expected: names.join(" or "), actual: t.dtype() })
}

const FLOATS: [DType; 3] = [DType::BF16, DType::F16, DType::F32];

impl<B: Backend> ProjectionWeights<B> {
    /// Check every shape and dtype against `dims`.
    pub fn new(dims: ProjectionDims, qkv: QkvWeight<B>, bfg: BfgWeight<B>) -> Result<Self> {
        let ProjectionDims { hidden, heads, head_dim } = dims;
        if hidden == 0 || heads == 0 || head_dim == 0 {
            return Err(Error::Param {
                op: WHAT,
                param: "dims",
                expected: "hidden, heads and head_dim all at least 1".into(),
                actual: format!("{dims:?}"),
            });
        }
        let (lp, rows) = (dims.local_projection(), dims.qkv_width());
        match &qkv {
            QkvWeight::Bf16 { w } => {
                expect_dtype("qkv.w", w, &FLOATS)?;
                expect("qkv.w", w, &[rows, hidden])?;
            }
            QkvWeight::Mxfp8 { data, scale, .. } => {
                expect_dtype("qkv.data", data, &[DType::E4M3])?;
                expect("qkv.data", data, &[rows, hidden])?;
                expect_dtype("qkv.scale", scale, &[DType::E8M0])?;
                expect("qkv.scale", scale, &[rows, num_blocks(hidden)])?;
            }
        }
        match &bfg {
            BfgWeight::Composed { w } => {
                expect_dtype("bfg.w", w, &FLOATS)?;
                expect("bfg.w", w, &[dims.bfg_width(), hidden])?;
            }
            BfgWeight::Staged { b, f_a, f_b, g } => {
                for (param, t, shape) in [
                    ("bfg.b", b, [heads, hidden]),
                    ("bfg.f_a", f_a, [head_dim, hidden]),
                    ("bfg.f_b", f_b, [lp, head_dim]),
                    ("bfg.g", g, [lp, hidden]),
                ] {
                    expect_dtype(param, t, &FLOATS)?;
                    expect(param, t, &shape)?;
                }
            }
        }
        Ok(Self { dims, qkv, bfg })
    }

    /// Upload one rank's loaded projection weights on `stream`: the fused QKV on the path the
    /// backend's capabilities choose ([`QkvPath::resolve`] with no request: MXFP8 data and
    /// plain-layout scales with the checkpoint's `scale_alg` where the MX ops run, its exact bf16
    /// dequantization elsewhere; a dense QKV as loaded) and the composed fused BFG. A staged BFG
    /// has no single weight to upload; load it composed.
    pub fn upload(device: &Device<B>, stream: &B::Stream, layer: &LayerWeights) -> Result<Self> {
        let info = device.info();
        let path = QkvPath::resolve(None, layer.qkv.format(), info.capabilities.native, info.name)?;
        Self::upload_on(device, stream, layer, path)
    }

    /// [`Self::upload`] with the QKV on `path` (already resolved against the backend).
    pub fn upload_on(
        device: &Device<B>,
        stream: &B::Stream,
        layer: &LayerWeights,
        path: QkvPath,
    ) -> Result<Self> {
        let d = &layer.dims;
        let dims = ProjectionDims { hidden: d.hidden, heads: d.local_heads, head_dim: d.head_dim };
        let qkv = upload_qkv(device, stream, layer, path)?;
        let bfg = match (layer.bfg.mode(), layer.bfg.weight()) {
            (BfgMode::Composed, Some(w)) if layer.bfg.is_composed() => {
                BfgWeight::Composed { w: upload(device, stream, w)? }
            }
            (mode, _) => {
                let state = format!("{mode:?}, composed: {}", layer.bfg.is_composed());
                return Err(incomplete("bfg", state));
            }
        };
        Self::new(dims, qkv, bfg)
    }

    pub fn dims(&self) -> ProjectionDims {
        self.dims
    }

    pub fn qkv(&self) -> &QkvWeight<B> {
        &self.qkv
    }

    pub fn bfg(&self) -> &BfgWeight<B> {
        &self.bfg
    }
}

fn incomplete(param: &'static str, actual: String) -> Error {
    Error::Param {
        op: "upload projection weights",
        param,
        expected: "a fully loaded weight".into(),
        actual,
    }
}

/// A device copy of the fused QKV on `path`: dense as loaded; MXFP8 data and plain-layout
/// scales with the checkpoint's `scale_alg`; or, on the bf16 path, the MXFP8 weight dequantized
/// once here into its exact bf16 values (`docs/design/kda.md#qkv-precision`).
pub(crate) fn upload_qkv<B: Backend>(
    device: &Device<B>,
    stream: &B::Stream,
    layer: &LayerWeights,
    path: QkvPath,
) -> Result<QkvWeight<B>> {
    Ok(match layer.qkv.weights() {
        Some(QkvWeights::Dense(w)) => QkvWeight::Bf16 { w: upload(device, stream, w)? },
        Some(QkvWeights::Mxfp8 { data, scale, .. }) if path == QkvPath::Bf16 => {
            let _span = tracing::debug_span!("qkv.dequantize_bf16", layer = layer.layer).entered();
            let w = dequantize_bf16(data, scale, layer.layer).map_err(|e| Error::Param {
                op: "upload projection weights",
                param: "qkv",
                expected: "an MXFP8 weight exact in bf16 (the bf16 QKV path)".into(),
                actual: e.to_string(),
            })?;
            QkvWeight::Bf16 { w: upload(device, stream, &w)? }
        }
        Some(QkvWeights::Mxfp8 { data, scale, scale_alg }) => QkvWeight::Mxfp8 {
            data: upload_as(device, stream, data, DType::E4M3)?,
            scale: upload_as(device, stream, scale, DType::E8M0)?,
            alg: scale_alg,
        },
        None => return Err(incomplete("qkv", format!("missing {:?}", layer.qkv.missing()))),
    })
}

/// A device copy of a float host tensor, in its own dtype.
pub(crate) fn upload<B: Backend>(
    device: &Device<B>,
    stream: &B::Stream,
    t: &HostTensor,
) -> Result<Tensor<B>> {
    upload_as(device, stream, t, t.dtype())
}

/// A device copy of `t`'s bytes as `dtype` (E4M3 and E8M0 bytes arrive as `u8` host tensors).
pub(crate) fn upload_as<B: Backend>(
    device: &Device<B>,
    stream: &B::Stream,
    t: &HostTensor,
    dtype: DType,
) -> Result<Tensor<B>> {
    let tensor = device.alloc(dtype, t.shape())?;
    device.launch(
        stream,
        kda_core::op::Op::Upload { dst: tensor.clone(), data: t.as_bytes().into() },
    )?;
    Ok(tensor)
}
