//! Device ops described as data. Every op is a value of [`Op`] launched through
//! [`Device::launch`](crate::Device::launch); the one chokepoint gives validation, tracing, and
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

/// Every op, each described once: its fields, its name, the execution unit it occupies, the
/// views it reads and writes, and the check that validates it and computes its sizes. The enum
/// [`Op`] and its `name`, `unit`, `inputs`, `outputs` and per-op validation are generated from
/// this table; an op with a descriptor type of its own (the KDA ops, in [`crate::kda`]) is
/// listed with that type, which carries the same description. Adding an op is one entry here
/// (with its check), its kernel in each backend, and nothing else in kda-core.
macro_rules! ops {
    (
        $(
            $(#[$doc:meta])*
            op $var:ident { $($field:ident: $fty:ty),* $(,)? } =>
                name $name:expr, unit $unit:expr,
                reads [$($read:ident),*], writes [$($write:ident),*],
                check $check:expr, dims $odt:ty;
        )*
        descriptors {
            $( $(#[$ddoc:meta])* $dvar:ident($dty:ident) => unit $dunit:expr, dims $dims:ident($ddt:ty); )*
        }
    ) => {
        /// One device op with its input and output views. Cloning shares the views (and staged
        /// data), as replaying a captured graph does.
        #[derive(Clone)]
        #[allow(
            clippy::large_enum_variant,
            reason = "an op is built once per launch and moved a few times; boxing the chunk \
                      descriptor (the largest, with its optional chunk-boundary slots) would \
                      change every `Op::KdaChunk` site for no measurable gain"
        )]
        pub enum Op<B: Resources> {
            $( $(#[$doc])* $var { $($field: $fty),* }, )*
            $( $(#[$ddoc])* $dvar($dty<B>), )*
        }

        impl<B: Resources> Op<B> {
            /// The op's name, used in spans, traces and diagnostics.
            pub fn name(&self) -> &'static str {
                match self {
                    $( #[allow(unused_variables)] Op::$var { $($field),* } => $name, )*
                    $( Op::$dvar(_) => $dty::<B>::NAME, )*
                }
            }

            /// The execution unit the op occupies: matrix for the GEMMs, vector for element-wise
            /// and reduction kernels, none for memory movement and host functions. The chunked
            /// recurrence uses both kinds and claims neither.
            pub fn unit(&self) -> Option<ComputeUnit> {
                match self {
                    $( Op::$var { .. } => $unit, )*
                    $( Op::$dvar(_) => $dunit, )*
                }
            }

            /// Views the op reads, with their parameter names.
            pub fn inputs(&self) -> Vec<(&'static str, &Tensor<B>)> {
                match self {
                    $( #[allow(unused_variables)] Op::$var { $($field),* } => vec![$((stringify!($read), $read)),*], )*
                    $( Op::$dvar(op) => op.inputs(), )*
                }
            }

            /// Views the op writes, with their parameter names.
            pub fn outputs(&self) -> Vec<(&'static str, &Tensor<B>)> {
                match self {
                    $( #[allow(unused_variables)] Op::$var { $($field),* } => vec![$((stringify!($write), $write)),*], )*
                    $( Op::$dvar(op) => op.outputs(), )*
                }
            }

            /// The op's own checks (shapes, dtypes, parameters) and the sizes they compute.
            fn check(&self) -> Result<OpDims> {
                match self {
                    $( #[allow(unused_variables)] Op::$var { $($field),* } => $check, )*
                    $( Op::$dvar(op) => Ok(OpDims::$dims(op.validate()?)), )*
                }
            }
        }

        /// A validated op as a backend executes it: the op's fields with the sizes its
        /// validation computed, typed per op ([`Validated::launch`]). Backends match on this,
        /// exhaustively, so a new op is a compile error in every backend that lacks its kernel,
        /// and no backend takes sizes apart again.
        #[derive(Debug)]
        pub enum Launch<'a, B: Resources> {
            $( $(#[$doc])* $var { $($field: &'a $fty,)* dims: $odt }, )*
            $( $(#[$ddoc])* $dvar(&'a $dty<B>, $ddt), )*
        }

        impl<B: Resources> Validated<B> {
            /// The op and its sizes, paired by kind.
            pub fn launch(&self) -> Result<Launch<'_, B>> {
                let dims = self.dims;
                let mismatch = |op: &Op<B>| Error::Param {
                    op: op.name(),
                    param: "dims",
                    expected: "the sizes of the op's own validation".into(),
                    actual: format!("{dims:?}"),
                };
                Ok(match &self.op {
                    $( Op::$var { $($field),* } => Launch::$var {
                        $($field,)*
                        dims: <$odt as KindDims>::of(dims).ok_or_else(|| mismatch(&self.op))?,
                    }, )*
                    $( Op::$dvar(op) => Launch::$dvar(
                        op,
                        <$ddt as KindDims>::of(dims).ok_or_else(|| mismatch(&self.op))?,
                    ), )*
                })
            }
        }
    };
}

/// The sizes one kind of op is validated with, taken out of [`OpDims`].
trait KindDims: Sized {
    fn of(dims: OpDims) -> Option<Self>;
}

macro_rules! kind_dims {
    ($($ty:ty => $variant:ident),* $(,)?) => {
        $( impl KindDims for $ty {
            fn of(dims: OpDims) -> Option<Self> {
                match dims {
                    OpDims::$variant(d) => Some(d),
                    _ => None,
                }
            }
        } )*
    };
}

kind_dims! {
    GemmDims => Gemm, MxDims => Mx, ConvDims => Conv, ConvUpdateDims => ConvUpdate,
    RowDims => Rows, GateDims => Gate, RecurrenceDims => Recurrence, PaddingDims => Padding,
}

/// Ops whose sizes are their operands' shapes.
impl KindDims for () {
    fn of(dims: OpDims) -> Option<Self> {
        matches!(dims, OpDims::None).then_some(())
    }
}

ops! {
    /// Dense Linear-layout GEMM `y[M, N] = x[M, K] · w[N, K]^T`, fp32 accumulation.
    /// `x`, `w`: bf16, f16 or f32 (mixed allowed); `y`: bf16, f16 or f32.
    op Gemm { x: Tensor<B>, w: Tensor<B>, y: Tensor<B> } =>
        name "gemm", unit Some(ComputeUnit::Matrix), reads [x, w], writes [y],
        check gemm_dims(x, w, y).map(OpDims::Gemm), dims GemmDims;
    /// Element-wise copy between two views of the same shape: of the same dtype, or converting
    /// between two float dtypes (exact widening, round-to-nearest-even narrowing).
    op Copy { src: Tensor<B>, dst: Tensor<B> } =>
        name "copy", unit None, reads [src], writes [dst],
        check check_copy(src, dst), dims ();
    /// Set every element of `dst` to `value`. For floats the value is rounded to the dtype; for
    /// `i32` it must be an integer in range; for `u8`, `e4m3` and `e8m0` it is the raw byte.
    op Fill { dst: Tensor<B>, value: f64 } =>
        name "fill", unit None, reads [], writes [dst],
        check check_fill_value(dst.dtype(), *value), dims ();
    /// Write staged host bytes (row-major, `dst.numel()` elements) into `dst`.
    op Upload { dst: Tensor<B>, data: Arc<[u8]> } =>
        name "upload", unit None, reads [], writes [dst],
        check check_upload(dst, data), dims ();
    /// Read `src` (row-major) into a host slot, in stream order.
    op Download { src: Tensor<B>, slot: DownloadSlot } =>
        name "download", unit None, reads [src], writes [],
        check Ok(OpDims::None), dims ();
    /// Run a host function in stream order (CUDA's `cudaLaunchHostFunc`, ACL's
    /// `aclrtLaunchCallback`). An `Err` fails the stream like any op failure.
    op Host { name: &'static str, f: HostFn } =>
        name name, unit None, reads [], writes [],
        check Ok(OpDims::None), dims ();
    /// MXFP8 dynamic quantization (Ascend's `aclnnDynamicMxQuant`): `x[M, K]` (bf16 or f32) to
    /// E4M3 `data[M, K]` and E8M0 `scale[M, ceil(K/32)]` (plain layout), blocks of 32 along K,
    /// bit for bit as [`crate::mx::quantize`].
    op DynamicQuant { x: Tensor<B>, data: Tensor<B>, scale: Tensor<B>, alg: ScaleAlg } =>
        name "dynamic_quant", unit Some(ComputeUnit::Vector), reads [x], writes [data, scale],
        check mx_quant_dims(x, data, scale).map(OpDims::Mx), dims MxDims;
    /// MXFP8 dequantization: E4M3 `data[M, K]` with E8M0 `scale[M, ceil(K/32)]` to `y[M, K]`
    /// (bf16 or f32), each value rounded once ([`crate::mx::dequantize_value`]).
    op MxDequant { data: Tensor<B>, scale: Tensor<B>, y: Tensor<B> } =>
        name "mx_dequant", unit Some(ComputeUnit::Vector), reads [data, scale], writes [y],
        check mx_dequant_dims(data, scale, y).map(OpDims::Mx), dims MxDims;
    /// MXFP8 GEMM `y[M, N] = a[M, K] · w[N, K]^T` (`aclnnQuantMatmulV5` in MX mode): E4M3 `a` and
    /// `w`, E8M0 `a_scale[M, ceil(K/32)]` and `w_scale[N, ceil(K/32)]`, `y` bf16 or f32, summed
    /// as [`crate::mx::gemm`] defines (exact block sums, fp32 accumulation over blocks).
    op MxGemm { a: Tensor<B>, a_scale: Tensor<B>, w: Tensor<B>, w_scale: Tensor<B>, y: Tensor<B> } =>
        name "mx_gemm", unit Some(ComputeUnit::Matrix), reads [a, a_scale, w, w_scale], writes [y],
        check mx_gemm_dims(a, a_scale, w, w_scale, y).map(OpDims::Gemm), dims GemmDims;
    /// Element-wise logistic sigmoid computed in fp32: `y = 1 / (1 + e^-x)` with `x` (bf16, f16
    /// or f32, any view) widened exactly to f32 and `y` f32 of the same shape. The mixed
    /// projection path's "preprocessed" beta (`docs/design/schedule.md#the-beta-contract`).
    op Sigmoid { x: Tensor<B>, y: Tensor<B> } =>
        name "sigmoid", unit Some(ComputeUnit::Vector), reads [x], writes [y],
        check check_sigmoid(x, y), dims ();
    descriptors {
        /// Depthwise causal conv1d + SiLU over a flat batch of prefill requests
        /// ([`crate::kda::conv`]).
        CausalConv(CausalConv) => unit Some(ComputeUnit::Vector), dims Conv(ConvDims);
        /// Causal conv1d + SiLU for decode and speculative decode ([`crate::kda::conv`]).
        CausalConvUpdate(CausalConvUpdate) => unit Some(ComputeUnit::Vector), dims ConvUpdate(ConvUpdateDims);
        /// Row-wise L2 norm with a scale (the q/k norm).
        L2Norm(L2Norm) => unit Some(ComputeUnit::Vector), dims Rows(RowDims);
        /// The forget gate's log decay, softplus or lower-bound form.
        KdaGate(KdaGate) => unit Some(ComputeUnit::Vector), dims Gate(GateDims);
        /// The KDA recurrence token by token (decode, speculative decode).
        KdaRecurrent(KdaRecurrent) => unit Some(ComputeUnit::Vector), dims Recurrence(RecurrenceDims);
        /// The KDA recurrence in chunks of 64 (prefill): it uses both kinds of unit and claims
        /// neither.
        KdaChunk(KdaChunk) => unit None, dims Recurrence(RecurrenceDims);
        /// Gated RMSNorm of the core output.
        GatedRmsNorm(GatedRmsNorm) => unit Some(ComputeUnit::Vector), dims Rows(RowDims);
        /// Zero the rows past the live tokens.
        ZeroPadding(ZeroPadding) => unit Some(ComputeUnit::Vector), dims Padding(PaddingDims);
    }
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
        self.check()
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

impl OpDims {
    /// The op's floating-point operations as the planner counts them: `2·m·n·k` for a GEMM, 0
    /// for every other op (their cost is the bytes they move).
    pub fn flops(&self) -> u64 {
        match self {
            OpDims::Gemm(g) => 2u64
                .saturating_mul(g.m as u64)
                .saturating_mul(g.n as u64)
                .saturating_mul(g.k as u64),
            _ => 0,
        }
    }
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

fn check_copy<B: Resources>(src: &Tensor<B>, dst: &Tensor<B>) -> Result<OpDims> {
    if src.dtype() != dst.dtype() && !(src.dtype().is_float() && dst.dtype().is_float()) {
        return Err(Error::DType {
            op: "copy",
            param: "dst",
            expected: format!(
                "{} (a copy converts only between bf16, f16 and f32)",
                src.dtype().name()
            ),
            actual: dst.dtype(),
        });
    }
    expect_shape("copy", "dst", dst.shape(), src.shape())?;
    Ok(OpDims::None)
}

fn check_upload<B: Resources>(dst: &Tensor<B>, data: &[u8]) -> Result<OpDims> {
    let expected = dst.layout().size_bytes()?;
    if data.len() != expected {
        return Err(Error::HostSize { op: "upload", param: "data", expected, actual: data.len() });
    }
    Ok(OpDims::None)
}

fn check_sigmoid<B: Resources>(x: &Tensor<B>, y: &Tensor<B>) -> Result<OpDims> {
    expect_float("sigmoid", "x", x.dtype())?;
    expect_dtype("sigmoid", "y", y.dtype(), DType::F32, "f32")?;
    expect_shape("sigmoid", "y", y.shape(), x.shape())?;
    Ok(OpDims::None)
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

fn check_fill_value(dtype: DType, value: f64) -> Result<OpDims> {
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
        Ok(OpDims::None)
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

#[cfg(test)]
mod table_tests {
    #![allow(clippy::unwrap_used, reason = "test setup")]

    use super::*;
    use crate::layout::Layout;
    use crate::resource::{BufferId, EventHandle, EventId, StreamHandle, StreamId};

    #[derive(Clone, Debug)]
    struct Res;
    #[derive(Clone, Debug)]
    struct Handle(u64);
    impl StreamHandle for Handle {
        fn id(&self) -> StreamId {
            StreamId { instance: instance(), index: self.0 }
        }
    }
    impl EventHandle for Handle {
        fn id(&self) -> EventId {
            EventId { instance: instance(), index: self.0 }
        }
    }
    impl BufferHandle for Handle {
        fn id(&self) -> BufferId {
            BufferId { instance: instance(), index: self.0 }
        }
        fn len_bytes(&self) -> usize {
            1 << 20
        }
    }
    impl Resources for Res {
        type Stream = Handle;
        type Event = Handle;
        type Buffer = Handle;
    }

    fn instance() -> InstanceId {
        static ID: std::sync::OnceLock<InstanceId> = std::sync::OnceLock::new();
        *ID.get_or_init(InstanceId::fresh)
    }

    fn t(buffer: u64, dtype: DType, shape: &[usize]) -> Tensor<Res> {
        Tensor::new(Handle(buffer), Layout::contiguous(dtype, shape)).unwrap()
    }

    /// The generated `name`, `unit`, `inputs`, `outputs` and checks are the table's.
    #[test]
    fn names_units_operands_and_checks_come_from_the_table() {
        let gemm: Op<Res> = Op::Gemm {
            x: t(0, DType::BF16, &[2, 8]),
            w: t(1, DType::BF16, &[3, 8]),
            y: t(2, DType::F32, &[2, 3]),
        };
        assert_eq!((gemm.name(), gemm.unit()), ("gemm", Some(ComputeUnit::Matrix)));
        let names = |v: Vec<(&'static str, &Tensor<Res>)>| {
            v.into_iter().map(|(n, _)| n).collect::<Vec<_>>()
        };
        assert_eq!(names(gemm.inputs()), vec!["x", "w"]);
        assert_eq!(names(gemm.outputs()), vec!["y"]);
        assert_eq!(gemm.validate(instance()).unwrap(), OpDims::Gemm(GemmDims { m: 2, n: 3, k: 8 }));

        let host: Op<Res> = Op::Host { name: "my_callback", f: HostFn::new(|| Ok(())) };
        assert_eq!((host.name(), host.unit()), ("my_callback", None));
        assert!(host.inputs().is_empty() && host.outputs().is_empty());

        let quant: Op<Res> = Op::DynamicQuant {
            x: t(0, DType::BF16, &[2, 40]),
            data: t(1, DType::E4M3, &[2, 40]),
            scale: t(2, DType::E8M0, &[2, 2]),
            alg: ScaleAlg::default(),
        };
        assert_eq!(names(quant.outputs()), vec!["data", "scale"]);
        let dims = quant.validate(instance()).unwrap();
        assert_eq!(dims, OpDims::Mx(MxDims { m: 2, k: 40, blocks: 2 }));

        let bad_copy: Op<Res> =
            Op::Copy { src: t(0, DType::F32, &[4]), dst: t(1, DType::F32, &[5]) };
        let e = bad_copy.validate(instance()).unwrap_err();
        assert!(matches!(e, Error::Shape { op: "copy", param: "dst", .. }), "{e}");

        // A copy converts between floats, and only between floats.
        let convert: Op<Res> =
            Op::Copy { src: t(0, DType::F32, &[4]), dst: t(1, DType::BF16, &[4]) };
        assert_eq!(convert.validate(instance()).unwrap(), OpDims::None);
        for (from, to) in
            [(DType::I32, DType::F32), (DType::F32, DType::I32), (DType::E4M3, DType::BF16)]
        {
            let op: Op<Res> = Op::Copy { src: t(0, from, &[4]), dst: t(1, to, &[4]) };
            let e = op.validate(instance()).unwrap_err();
            assert!(
                matches!(e, Error::DType { op: "copy", param: "dst", actual, .. } if actual == to),
                "{from} -> {to}: {e}"
            );
        }
    }
}
