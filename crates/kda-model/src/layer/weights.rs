//! [`LayerDeviceWeights`]: one rank's loaded layer ([`LayerWeights`]) on a device: the projection
//! weights (composed or staged F), the conv weights, `A_log`, `dt_bias`, the output norm weight
//! and `o_proj`.

use crate::layer::error::{LayerError, Result};
use crate::schedule::weights::{upload, upload_qkv};
use crate::schedule::{BfgWeight, ProjectionDims, ProjectionWeights, QkvPath, QkvWeight};
use crate::weights::bfg::compose_low_rank;
use crate::weights::{BfgBlock, ConvLayout, HostTensor, LayerWeights, TensorRead};
use kda_core::device::Device;
use kda_core::dtype::DType;
use kda_core::error::Error;
use kda_core::hal::Backend;
use kda_core::layout::Layout;
use kda_core::tensor::Tensor;

/// How the forget gate's projection is laid out on the device.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash)]
pub enum ForgetProjection {
    /// F composed at load (`f_b @ f_a`, fp32, rounded once): one fused BFG GEMM.
    #[default]
    Composed,
    /// F as its two factors: `x · f_a^T` rounded to bf16, then `· f_b^T` (the comparison form).
    Staged,
}

/// One rank's layer weights on a device.
#[derive(Clone, Debug)]
pub struct LayerDeviceWeights<B: Backend> {
    pub projection: ProjectionWeights<B>,
    /// `[3 lp, W]` f32: a transposed view of the packed kernel layout `[W, 3 lp]`.
    pub conv: Tensor<B>,
    /// `[lh]` f32.
    pub a_log: Tensor<B>,
    /// `[lh, D]` f32.
    pub dt_bias: Tensor<B>,
    /// `[D]` f32.
    pub o_norm: Tensor<B>,
    /// `[Hd, lp]` in the weight dtype.
    pub o_proj: Tensor<B>,
}

fn incomplete(param: &'static str, actual: impl Into<String>) -> LayerError {
    Error::Param {
        op: "upload layer weights",
        param,
        expected: "a fully loaded weight".into(),
        actual: actual.into(),
    }
    .into()
}

impl<B: Backend> LayerDeviceWeights<B> {
    /// Upload `layer` on `stream` (ready in its order), with F as `forget` says and the QKV on
    /// the path `qkv` asks for, `None` letting the backend's capabilities choose
    /// ([`QkvPath::resolve`]). An impossible request fails here, before anything is uploaded.
    pub fn upload(
        device: &Device<B>,
        stream: &B::Stream,
        layer: &LayerWeights,
        forget: ForgetProjection,
        qkv: Option<QkvPath>,
    ) -> Result<Self> {
        let d = &layer.dims;
        let info = device.info();
        let path = QkvPath::resolve(qkv, layer.qkv.format(), info.capabilities.native, info.name)?;
        let projection = match forget {
            ForgetProjection::Composed => {
                ProjectionWeights::upload_on(device, stream, layer, path)?
            }
            ForgetProjection::Staged => upload_staged(device, stream, layer, path)?,
        };
        if layer.conv.layout() != ConvLayout::Kernel {
            return Err(incomplete("conv", "conv weights not packed into [W, 3 lp]"));
        }
        let [width, channels] = layer.conv.shape();
        let packed = upload(device, stream, &layer.conv.to_tensor()?)?;
        // The kernel layout `[W, C]` read as the conv op's `[C, W]`: a transposed view.
        let layout = Layout::strided(DType::F32, &[channels, width], &[1, channels], 0)?;
        let conv = Tensor::new(packed.buffer().clone(), layout)?;
        let dt_bias =
            upload(device, stream, &layer.dt_bias)?.reshape(&[d.local_heads, d.head_dim])?;
        Ok(Self {
            projection,
            conv,
            a_log: upload(device, stream, &layer.a_log)?,
            dt_bias,
            o_norm: upload(device, stream, &layer.o_norm)?,
            o_proj: upload(device, stream, &layer.o_proj)?,
        })
    }
}

impl<B: Backend> LayerDeviceWeights<B> {
    /// Bytes of every weight tensor: what one step reads at least once.
    pub fn bytes(&self) -> usize {
        let size = |t: &Tensor<B>| t.numel() * t.dtype().size_bytes();
        let qkv = match self.projection.qkv() {
            QkvWeight::Bf16 { w } => size(w),
            QkvWeight::Mxfp8 { data, scale, .. } => size(data) + size(scale),
        };
        let bfg = match self.projection.bfg() {
            BfgWeight::Composed { w } => size(w),
            BfgWeight::Staged { b, f_a, f_b, g } => size(b) + size(f_a) + size(f_b) + size(g),
        };
        let rest = [&self.conv, &self.a_log, &self.dt_bias, &self.o_norm, &self.o_proj];
        qkv + bfg + rest.into_iter().map(size).sum::<usize>()
    }
}

/// The projection weights with F (and a low-rank G with it) left as factors: B and a full-rank G
/// come from the packed weight, `f_a` and `f_b` from the loader's exact copies (cast to the
/// weight dtype: exact for a checkpoint's bf16 factors). A low-rank G (Kimi Linear) is composed on the host exactly as the
/// composed form does, so only F differs between the two forms.
fn upload_staged<B: Backend>(
    device: &Device<B>,
    stream: &B::Stream,
    layer: &LayerWeights,
    path: QkvPath,
) -> Result<ProjectionWeights<B>> {
    let d = &layer.dims;
    let bfg = &layer.bfg;
    let dtype = bfg.dtype();
    let Some(packed) = bfg.weight() else {
        return Err(incomplete("bfg", "no packed weight"));
    };
    let block = |b: BfgBlock| bfg.block_rows(b).map(|rows| packed.read(&[rows, 0..d.hidden]));
    let beta = block(BfgBlock::Beta).ok_or_else(|| incomplete("bfg.b", "no beta rows"))??;
    let g = match block(BfgBlock::Gate) {
        Some(rows) => rows?,
        None => {
            let (Some(a), Some(b)) = bfg.g_factors() else {
                return Err(incomplete("bfg.g", "g_a_proj / g_b_proj not loaded"));
            };
            let (a, b) = (a.to_f32_vec(), b.to_f32_vec());
            let (Some(a), Some(b)) = (a, b) else {
                return Err(incomplete("bfg.g", "low-rank factors that are not floats"));
            };
            let product = compose_low_rank(&b, &a, d.local_proj, d.head_dim, d.hidden);
            HostTensor::from_f32_as(dtype, &[d.local_proj, d.hidden], &product)?
        }
    };
    let (Some(f_a), Some(f_b)) = bfg.f_factors() else {
        return Err(incomplete("bfg.f", "f_a_proj / f_b_proj not loaded"));
    };
    let staged = BfgWeight::Staged {
        b: upload(device, stream, &beta)?,
        f_a: upload(device, stream, &f_a.cast(dtype)?)?,
        f_b: upload(device, stream, &f_b.cast(dtype)?)?,
        g: upload(device, stream, &g)?,
    };
    let qkv = upload_qkv(device, stream, layer, path)?;
    let dims = ProjectionDims { hidden: d.hidden, heads: d.local_heads, head_dim: d.head_dim };
    Ok(ProjectionWeights::new(dims, qkv, staged)?)
}
