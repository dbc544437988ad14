//! Device ops described as data. Every op is a value of [`Op`] launched through
//! [`Device::launch`](crate::device::Device::launch); the one chokepoint gives validation, tracing, and
//! later recording, capture and replay without per-op wrappers.

use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::kda::{
    CausalConv, CausalConvUpdate, ConvDims, ConvUpdateDims, GateDims, GatedRmsNorm, KdaChunk,
    KdaGate, KdaRecurrent, L2Norm, PaddingDims, RecurrenceDims, RowDims, ZeroPadding,
};
use crate::mx::{ScaleAlg, num_blocks};
pub use crate::resource::ComputeUnit;
use crate::resource::{BufferHandle, InstanceId, Resources};
use crate::tensor::Tensor;

/// One device op with its input and output views. Cloning shares the views (and staged
/// data), as replaying a captured graph does.
#[derive(Clone)]
pub enum Op<B: Resources> {
    /// Dense Linear-layout GEMM `y[M, N] = x[M, K] · w[N, K]^T`, fp32 accumulation.
    /// `x`, `w`: bf16, f16 or f32 (mixed allowed); `y`: bf16, f16 or f32.
    Gemm { x: Tensor<B>, w: Tensor<B>, y: Tensor<B> },
    /// Element-wise copy between two views of the same dtype and shape.
    Copy { src: Tensor<B>, dst: Tensor<B> },
    /// Set every element of `dst` to `value`. For floats the value is rounded to the dtype; for
    /// `i32` it must be an integer in range; for `u8`, `e4m3` and `e8m0` it is the raw byte.
    Fill { dst: Tensor<B>, value: f64 },
    /// Write staged host bytes (row-major, `dst.numel()` elements) into `dst`.
    Upload { dst: Tensor<B>, data: Arc<[u8]> },
    /// Read `src` (row-major) into a host slot, in stream order.
    Download { src: Tensor<B>, slot: DownloadSlot },
    /// Run a host function in stream order (CUDA's `cudaLaunchHostFunc`, ACL's
    /// `aclrtLaunchCallback`). An `Err` fails the stream like any op failure.
    Host { name: &'static str, f: HostFn },
    /// MXFP8 dynamic quantization (Ascend's `aclnnDynamicMxQuant`): `x[M, K]` (bf16 or f32) to
    /// E4M3 `data[M, K]` and E8M0 `scale[M, ceil(K/32)]` (plain layout), blocks of 32 along K,
    /// bit for bit as [`crate::mx::quantize`].
    DynamicQuant { x: Tensor<B>, data: Tensor<B>, scale: Tensor<B>, alg: ScaleAlg },
    /// MXFP8 dequantization: E4M3 `data[M, K]` with E8M0 `scale[M, ceil(K/32)]` to `y[M, K]`
    /// (bf16 or f32), each value rounded once ([`crate::mx::dequantize_value`]).
    MxDequant { data: Tensor<B>, scale: Tensor<B>, y: Tensor<B> },
    /// MXFP8 GEMM `y[M, N] = a[M, K] · w[N, K]^T` (`aclnnQuantMatmulV5` in MX mode): E4M3 `a` and
    /// `w`, E8M0 `a_scale[M, ceil(K/32)]` and `w_scale[N, ceil(K/32)]`, `y` bf16 or f32, summed
    /// as [`crate::mx::gemm`] defines (exact block sums, fp32 accumulation over blocks).
    MxGemm { a: Tensor<B>, a_scale: Tensor<B>, w: Tensor<B>, w_scale: Tensor<B>, y: Tensor<B> },
    /// Depthwise causal conv1d + SiLU over a flat batch of prefill requests ([`crate::kda::conv`]).
    CausalConv(CausalConv<B>),
    /// Causal conv1d + SiLU for decode and speculative decode ([`crate::kda::conv`]).
    CausalConvUpdate(CausalConvUpdate<B>),
    /// Row-wise L2 norm with a scale (the q/k norm).
    L2Norm(L2Norm<B>),
    /// The forget gate's log decay, softplus or lower-bound form.
    KdaGate(KdaGate<B>),
    /// The KDA recurrence token by token (decode, speculative decode).
    KdaRecurrent(KdaRecurrent<B>),
    /// The KDA recurrence in chunks of 64 (prefill).
    KdaChunk(KdaChunk<B>),
    /// Gated RMSNorm of the core output.
    GatedRmsNorm(GatedRmsNorm<B>),
    /// Zero the rows past the live tokens.
    ZeroPadding(ZeroPadding<B>),
    /// Element-wise logistic sigmoid computed in fp32: `y = 1 / (1 + e^-x)` with `x` (bf16, f16
    /// or f32, any view) widened exactly to f32 and `y` f32 of the same shape. The mixed
    /// projection path's "preprocessed" beta (KDA.md).
    Sigmoid { x: Tensor<B>, y: Tensor<B> },
}

/// An op the façade has validated for one backend instance, with the sizes validation computed.
/// Only kda-core can make one (the façade validates every op it hands a backend).
#[derive(Clone, Debug)]
pub struct Validated<B: Resources> {
    op: Op<B>,
    dims: OpDims,
}

impl<B: Resources> Validated<B> {
    /// Called by `Op::validate_for` only.
    pub(crate) fn new(op: Op<B>, dims: OpDims) -> Self {
        Self { op, dims }
    }

    pub fn op(&self) -> &Op<B> {
        &self.op
    }

    /// The sizes validation computed (which variant matches the op's kind).
    pub fn dims(&self) -> OpDims {
        self.dims
    }

    pub fn into_op(self) -> Op<B> {
        self.op
    }

    pub fn into_parts(self) -> (Op<B>, OpDims) {
        (self.op, self.dims)
    }
}

/// A host function queued on a stream.
#[derive(Clone)]
pub struct HostFn(Arc<dyn Fn() -> std::result::Result<(), String> + Send + Sync>);

impl HostFn {
    pub fn new(f: impl Fn() -> std::result::Result<(), String> + Send + Sync + 'static) -> Self {
        Self(Arc::new(f))
    }

    pub fn call(&self) -> std::result::Result<(), String> {
        (self.0)()
    }
}

impl fmt::Debug for HostFn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("HostFn")
    }
}

/// Where a [`Op::Download`] leaves its bytes.
#[derive(Clone, Debug, Default)]
pub struct DownloadSlot(Arc<Mutex<Option<Vec<u8>>>>);

impl DownloadSlot {
    pub fn put(&self, bytes: Vec<u8>) {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) = Some(bytes);
    }

    pub fn take(&self) -> Option<Vec<u8>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).take()
    }
}

impl<B: Resources> fmt::Debug for Op<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct(self.name());
        for (name, t) in self.inputs().into_iter().chain(self.outputs()) {
            d.field(name, t);
        }
        d.finish()
    }
}

/// The sizes of a validated [`Op::Gemm`].
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct GemmDims {
    pub m: usize,
    pub n: usize,
    pub k: usize,
}

impl<B: Resources> Op<B> {
    /// The op's name, used in spans, traces and diagnostics.
    pub fn name(&self) -> &'static str {
        match self {
            Op::Gemm { .. } => "gemm",
            Op::Copy { .. } => "copy",
            Op::Fill { .. } => "fill",
            Op::Upload { .. } => "upload",
            Op::Download { .. } => "download",
            Op::Host { name, .. } => name,
            Op::CausalConv(_) => CausalConv::<B>::NAME,
            Op::CausalConvUpdate(_) => CausalConvUpdate::<B>::NAME,
            Op::L2Norm(_) => L2Norm::<B>::NAME,
            Op::KdaGate(_) => KdaGate::<B>::NAME,
            Op::KdaRecurrent(_) => KdaRecurrent::<B>::NAME,
            Op::KdaChunk(_) => KdaChunk::<B>::NAME,
            Op::GatedRmsNorm(_) => GatedRmsNorm::<B>::NAME,
            Op::ZeroPadding(_) => ZeroPadding::<B>::NAME,
            Op::DynamicQuant { .. } => "dynamic_quant",
            Op::MxDequant { .. } => "mx_dequant",
            Op::MxGemm { .. } => "mx_gemm",
            Op::Sigmoid { .. } => "sigmoid",
        }
    }

    /// The execution unit the op occupies: matrix for the GEMMs, vector for element-wise and
    /// reduction kernels, none for memory movement and host functions. The chunked recurrence
    /// uses both kinds and claims neither.
    pub fn unit(&self) -> Option<ComputeUnit> {
        match self {
            Op::Gemm { .. } | Op::MxGemm { .. } => Some(ComputeUnit::Matrix),
            Op::DynamicQuant { .. }
            | Op::MxDequant { .. }
            | Op::Sigmoid { .. }
            | Op::CausalConv(_)
            | Op::CausalConvUpdate(_)
            | Op::L2Norm(_)
            | Op::KdaGate(_)
            | Op::KdaRecurrent(_)
            | Op::GatedRmsNorm(_)
            | Op::ZeroPadding(_) => Some(ComputeUnit::Vector),
            Op::Copy { .. }
            | Op::Fill { .. }
            | Op::Upload { .. }
            | Op::Download { .. }
            | Op::Host { .. }
            | Op::KdaChunk(_) => None,
        }
    }

    /// Views the op reads, with their parameter names.
    pub fn inputs(&self) -> Vec<(&'static str, &Tensor<B>)> {
        match self {
            Op::Gemm { x, w, .. } => vec![("x", x), ("w", w)],
            Op::Sigmoid { x, .. } => vec![("x", x)],
            Op::Copy { src, .. } | Op::Download { src, .. } => vec![("src", src)],
            Op::Fill { .. } | Op::Upload { .. } | Op::Host { .. } => vec![],
            Op::CausalConv(op) => op.inputs(),
            Op::CausalConvUpdate(op) => op.inputs(),
            Op::L2Norm(op) => op.inputs(),
            Op::KdaGate(op) => op.inputs(),
            Op::KdaRecurrent(op) => op.inputs(),
            Op::KdaChunk(op) => op.inputs(),
            Op::GatedRmsNorm(op) => op.inputs(),
            Op::ZeroPadding(op) => op.inputs(),
            Op::DynamicQuant { x, .. } => vec![("x", x)],
            Op::MxDequant { data, scale, .. } => vec![("data", data), ("scale", scale)],
            Op::MxGemm { a, a_scale, w, w_scale, .. } => {
                vec![("a", a), ("a_scale", a_scale), ("w", w), ("w_scale", w_scale)]
            }
        }
    }

    /// Views the op writes, with their parameter names.
    pub fn outputs(&self) -> Vec<(&'static str, &Tensor<B>)> {
        match self {
            Op::Gemm { y, .. } | Op::Sigmoid { y, .. } => vec![("y", y)],
            Op::Copy { dst, .. } | Op::Fill { dst, .. } | Op::Upload { dst, .. } => {
                vec![("dst", dst)]
            }
            Op::Download { .. } | Op::Host { .. } => vec![],
            Op::CausalConv(op) => op.outputs(),
            Op::CausalConvUpdate(op) => op.outputs(),
            Op::L2Norm(op) => op.outputs(),
            Op::KdaGate(op) => op.outputs(),
            Op::KdaRecurrent(op) => op.outputs(),
            Op::KdaChunk(op) => op.outputs(),
            Op::GatedRmsNorm(op) => op.outputs(),
            Op::ZeroPadding(op) => op.outputs(),
            Op::DynamicQuant { data, scale, .. } => vec![("data", data), ("scale", scale)],
            Op::MxDequant { y, .. } | Op::MxGemm { y, .. } => vec![("y", y)],
        }
    }

    /// Validate for the façade, which alone hands ops to a backend.
    pub(crate) fn validate_for(self, instance: InstanceId) -> Result<Validated<B>> {
        let dims = self.validate(instance)?;
        Ok(Validated::new(self, dims))
    }

    /// Check everything that can be checked before running: handles belong to `instance`,
    /// shapes and dtypes agree, outputs overlap neither themselves, nor each other, nor any input.
    /// Returns the sizes the checks computed.
    pub fn validate(&self, instance: InstanceId) -> Result<OpDims> {
        let op = self.name();
        let (inputs, outputs) = (self.inputs(), self.outputs());
        for (_, t) in inputs.iter().chain(&outputs) {
            let handle = t.buffer().id().instance;
            if handle != instance {
                return Err(Error::ForeignHandle { what: "buffer", handle, backend: instance });
            }
        }
        for (param, out) in &outputs {
            if !out.layout().is_non_overlapping() {
                return Err(Error::SelfOverlap {
                    op,
                    param,
                    shape: out.shape().to_vec(),
                    strides: out.layout().strides().to_vec(),
                });
            }
            let others = outputs.iter().take_while(|(p, _)| p != param);
            for (other, inp) in inputs.iter().chain(others) {
                if out.overlaps(inp) {
                    let span = out.byte_span();
                    return Err(Error::Aliasing {
                        op,
                        param,
                        other,
                        actual: (span.start, span.end),
                    });
                }
            }
        }
        Ok(match self {
            Op::Gemm { x, w, y } => OpDims::Gemm(gemm_dims(x, w, y)?),
            Op::Copy { src, dst } => {
                expect_dtype(op, "dst", dst.dtype(), src.dtype(), src.dtype().name())?;
                expect_shape(op, "dst", dst.shape(), src.shape())?;
                OpDims::None
            }
            Op::Fill { dst, value } => {
                check_fill_value(dst.dtype(), *value)?;
                OpDims::None
            }
            Op::Upload { dst, data } => {
                let expected = dst.numel() * dst.dtype().size_bytes();
                if data.len() != expected {
                    return Err(Error::HostSize {
                        op,
                        param: "data",
                        expected,
                        actual: data.len(),
                    });
                }
                OpDims::None
            }
            Op::Download { .. } | Op::Host { .. } => OpDims::None,
            Op::CausalConv(op) => OpDims::Conv(op.validate()?),
            Op::CausalConvUpdate(op) => OpDims::ConvUpdate(op.validate()?),
            Op::L2Norm(op) => OpDims::Rows(op.validate()?),
            Op::KdaGate(op) => OpDims::Gate(op.validate()?),
            Op::KdaRecurrent(op) => OpDims::Recurrence(op.validate()?),
            Op::KdaChunk(op) => OpDims::Recurrence(op.validate()?),
            Op::GatedRmsNorm(op) => OpDims::Rows(op.validate()?),
            Op::ZeroPadding(op) => OpDims::Padding(op.validate()?),
            Op::DynamicQuant { x, data, scale, .. } => OpDims::Mx(mx_quant_dims(x, data, scale)?),
            Op::MxDequant { data, scale, y } => OpDims::Mx(mx_dequant_dims(data, scale, y)?),
            Op::MxGemm { a, a_scale, w, w_scale, y } => {
                OpDims::Gemm(mx_gemm_dims(a, a_scale, w, w_scale, y)?)
            }
            Op::Sigmoid { x, y } => {
                expect_float(op, "x", x.dtype())?;
                expect_dtype(op, "y", y.dtype(), DType::F32, "f32")?;
                expect_shape(op, "y", y.shape(), x.shape())?;
                OpDims::None
            }
        })
    }
}

/// The sizes an op's validation computed, handed to the backend with the op
/// ([`Validated::dims`]) so that no backend derives them again.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum OpDims {
    /// Ops whose sizes are their operands' shapes (copies, fills, transfers, host functions).
    None,
    /// The dense and the MXFP8 GEMM.
    Gemm(GemmDims),
    /// MXFP8 quantization and dequantization.
    Mx(MxDims),
    Conv(ConvDims),
    ConvUpdate(ConvUpdateDims),
    /// L2 norm and gated RMSNorm.
    Rows(RowDims),
    Gate(GateDims),
    /// The recurrence, token by token or chunked.
    Recurrence(RecurrenceDims),
    Padding(PaddingDims),
}

fn expect_dtype(
    op: &'static str,
    param: &'static str,
    actual: DType,
    want: DType,
    expected: &str,
) -> Result<()> {
    if actual == want {
        Ok(())
    } else {
        Err(Error::DType { op, param, expected: expected.to_string(), actual })
    }
}

fn expect_shape(
    op: &'static str,
    param: &'static str,
    actual: &[usize],
    want: &[usize],
) -> Result<()> {
    if actual == want {
        Ok(())
    } else {
        Err(Error::Shape { op, param, expected: format!("{want:?}"), actual: actual.to_vec() })
    }
}

fn expect_float(op: &'static str, param: &'static str, dtype: DType) -> Result<()> {
    if dtype.is_float() {
        Ok(())
    } else {
        Err(Error::DType { op, param, expected: "bf16, f16 or f32".into(), actual: dtype })
    }
}

/// Validate the operands of `y = x · w^T` and return its sizes.
pub fn gemm_dims<B: Resources>(x: &Tensor<B>, w: &Tensor<B>, y: &Tensor<B>) -> Result<GemmDims> {
    const OP: &str = "gemm";
    for (param, t) in [("x", x), ("w", w), ("y", y)] {
        expect_float(OP, param, t.dtype())?;
        if t.shape().len() != 2 {
            let expected = match param {
                "x" => "[M, K]",
                "w" => "[N, K]",
                _ => "[M, N]",
            };
            return Err(Error::Shape {
                op: OP,
                param,
                expected: expected.into(),
                actual: t.shape().to_vec(),
            });
        }
    }
    let (m, k) = (x.shape()[0], x.shape()[1]);
    let n = w.shape()[0];
    if w.shape()[1] != k {
        return Err(Error::Shape {
            op: OP,
            param: "w",
            expected: format!("[N, {k}] (K of x)"),
            actual: w.shape().to_vec(),
        });
    }
    expect_shape(OP, "y", y.shape(), &[m, n])?;
    Ok(GemmDims { m, n, k })
}

fn check_fill_value(dtype: DType, value: f64) -> Result<()> {
    let ok = match dtype {
        DType::F32 => !value.is_finite() || value.abs() <= f32::MAX as f64,
        DType::BF16 => !value.is_finite() || value.abs() <= half::bf16::MAX.to_f64(),
        DType::F16 => !value.is_finite() || value.abs() <= half::f16::MAX.to_f64(),
        DType::I32 => value.fract() == 0.0 && (i32::MIN as f64..=i32::MAX as f64).contains(&value),
        DType::U8 | DType::E4M3 | DType::E8M0 => {
            value.fract() == 0.0 && (0.0..=255.0).contains(&value)
        }
    };
    if ok {
        Ok(())
    } else {
        Err(Error::Value { op: "fill", param: "value", value: value.to_string(), dtype })
    }
}

/// The sizes of a validated MXFP8 quantization or dequantization: `[m, k]` elements in
/// `blocks = ceil(k/32)` scale blocks per row.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct MxDims {
    pub m: usize,
    pub k: usize,
    pub blocks: usize,
}

/// Require a rank-2 tensor; `expected` names its shape in the error.
fn expect_matrix<B: Resources>(
    op: &'static str,
    param: &'static str,
    t: &Tensor<B>,
    expected: &str,
) -> Result<(usize, usize)> {
    match *t.shape() {
        [rows, cols] => Ok((rows, cols)),
        _ => Err(Error::Shape { op, param, expected: expected.into(), actual: t.shape().to_vec() }),
    }
}

/// bf16 or f32, the floats the MXFP8 ops read and write.
fn expect_mx_float(op: &'static str, param: &'static str, dtype: DType) -> Result<()> {
    match dtype {
        DType::BF16 | DType::F32 => Ok(()),
        actual => Err(Error::DType { op, param, expected: "bf16 or f32".into(), actual }),
    }
}

/// Check the E4M3 `data[M, K]` and E8M0 `scale[M, ceil(K/32)]` of a quantized matrix whose
/// size is given by `(m, k)`.
fn expect_quantized<B: Resources>(
    op: &'static str,
    (data_param, data): (&'static str, &Tensor<B>),
    (scale_param, scale): (&'static str, &Tensor<B>),
    (m, k): (usize, usize),
) -> Result<usize> {
    expect_dtype(op, data_param, data.dtype(), DType::E4M3, "e4m3")?;
    expect_dtype(op, scale_param, scale.dtype(), DType::E8M0, "e8m0")?;
    expect_shape(op, data_param, data.shape(), &[m, k])?;
    let blocks = num_blocks(k);
    if scale.shape() != [m, blocks] {
        return Err(Error::Shape {
            op,
            param: scale_param,
            expected: format!("[{m}, {blocks}] ([M, ceil(K/32)], plain layout)"),
            actual: scale.shape().to_vec(),
        });
    }
    Ok(blocks)
}

/// Validate the operands of [`Op::DynamicQuant`] and return its sizes.
pub fn mx_quant_dims<B: Resources>(
    x: &Tensor<B>,
    data: &Tensor<B>,
    scale: &Tensor<B>,
) -> Result<MxDims> {
    const OP: &str = "dynamic_quant";
    expect_mx_float(OP, "x", x.dtype())?;
    let (m, k) = expect_matrix(OP, "x", x, "[M, K]")?;
    let blocks = expect_quantized(OP, ("data", data), ("scale", scale), (m, k))?;
    Ok(MxDims { m, k, blocks })
}

/// Validate the operands of [`Op::MxDequant`] and return its sizes.
pub fn mx_dequant_dims<B: Resources>(
    data: &Tensor<B>,
    scale: &Tensor<B>,
    y: &Tensor<B>,
) -> Result<MxDims> {
    const OP: &str = "mx_dequant";
    let (m, k) = expect_matrix(OP, "data", data, "[M, K]")?;
    let blocks = expect_quantized(OP, ("data", data), ("scale", scale), (m, k))?;
    expect_mx_float(OP, "y", y.dtype())?;
    expect_shape(OP, "y", y.shape(), &[m, k])?;
    Ok(MxDims { m, k, blocks })
}

/// Validate the operands of [`Op::MxGemm`] and return its sizes.
pub fn mx_gemm_dims<B: Resources>(
    a: &Tensor<B>,
    a_scale: &Tensor<B>,
    w: &Tensor<B>,
    w_scale: &Tensor<B>,
    y: &Tensor<B>,
) -> Result<GemmDims> {
    const OP: &str = "mx_gemm";
    let (m, k) = expect_matrix(OP, "a", a, "[M, K]")?;
    let (n, w_k) = expect_matrix(OP, "w", w, "[N, K]")?;
    if w_k != k {
        return Err(Error::Shape {
            op: OP,
            param: "w",
            expected: format!("[N, {k}] (K of a)"),
            actual: w.shape().to_vec(),
        });
    }
    expect_quantized(OP, ("a", a), ("a_scale", a_scale), (m, k))?;
    expect_quantized(OP, ("w", w), ("w_scale", w_scale), (n, k))?;
    expect_mx_float(OP, "y", y.dtype())?;
    expect_shape(OP, "y", y.shape(), &[m, n])?;
    Ok(GemmDims { m, n, k })
}
