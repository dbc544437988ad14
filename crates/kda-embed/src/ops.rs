//! The standalone ops an engine calls outside a layer, as the CLI's `kda quant` and `kda core`
//! do: MXFP8 quantization and the KDA recurrence in flash-linear-attention's conventions.

use half::bf16;
use kda_core::kda::{KdaChunk, KdaRecurrent};
use kda_core::mx::{self, ScaleAlg};
use kda_core::{Backend, DType, Device, Layout, Op, Tensor};
use kda_reference::ReferenceBackend;

use crate::array::ForeignArray;
use crate::error::{EmbedError, Result};

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

/// Which form of the recurrence [`core()`] runs.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum CoreAlgo {
    /// Chunks of 64 (the prefill form).
    Chunk,
    /// Token by token (the decode form).
    Recurrent,
}

impl CoreAlgo {
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "chunk" => Ok(CoreAlgo::Chunk),
            "recurrent" => Ok(CoreAlgo::Recurrent),
            other => Err(EmbedError::Argument {
                param: "algo",
                expected: "\"chunk\" or \"recurrent\"",
                actual: other.to_string(),
            }),
        }
    }
}

/// The inputs of [`core()`], host arrays in flash-linear-attention's conventions: `q`, `k`, `g`
/// `[B, T, H, K]`, `v` `[B, T, H, V]`, `beta` `[B, T, H]`, `initial_state` `[B, H, K, V]`
/// (K-first), each f32 or bf16.
#[derive(Debug)]
pub struct CoreArgs<'a> {
    pub q: &'a ForeignArray,
    pub k: &'a ForeignArray,
    pub v: &'a ForeignArray,
    pub g: &'a ForeignArray,
    pub beta: &'a ForeignArray,
    pub initial_state: Option<&'a ForeignArray>,
    pub algo: CoreAlgo,
    /// `None`: `K^-0.5`.
    pub scale: Option<f32>,
    pub l2norm: bool,
}

/// `o` `[B, T, H, V]` and `final_state` `[B, H, K, V]`, f32.
#[derive(Clone, Debug, PartialEq)]
pub struct CoreOutput {
    pub o: Vec<f32>,
    pub o_shape: [usize; 4],
    pub final_state: Vec<f32>,
    pub state_shape: [usize; 4],
}

fn shape_error(param: &'static str, a: &ForeignArray, expected: String) -> EmbedError {
    EmbedError::Array { param, message: format!("shape {:?}, expected {expected}", a.shape()) }
}

/// The KDA recurrence on the reference backend, as `kda core` (see [`CoreArgs`]).
pub fn core(args: &CoreArgs<'_>) -> Result<CoreOutput> {
    let float = [DType::F32, DType::BF16];
    for (name, a) in [("q", args.q), ("k", args.k), ("v", args.v), ("g", args.g)] {
        a.expect_dtype(name, &float)?;
    }
    args.beta.expect_dtype("beta", &float)?;
    let [b, t, h, k] = <[usize; 4]>::try_from(args.q.shape())
        .map_err(|_| shape_error("q", args.q, "[B, T, H, K]".into()))?;
    if k == 0 {
        return Err(shape_error("q", args.q, "K >= 1".into()));
    }
    for (name, a) in [("k", args.k), ("g", args.g)] {
        if a.shape() != args.q.shape() {
            return Err(shape_error(name, a, format!("{:?} (as q)", args.q.shape())));
        }
    }
    let vd = match args.v.shape() {
        [vb, vt, vh, vd] if [*vb, *vt, *vh] == [b, t, h] => *vd,
        _ => return Err(shape_error("v", args.v, format!("[{b}, {t}, {h}, V] (from q)"))),
    };
    if args.beta.shape() != [b, t, h] {
        return Err(shape_error("beta", args.beta, format!("[{b}, {t}, {h}] (from q)")));
    }
    if let Some(s) = args.initial_state {
        s.expect_dtype("initial_state", &float)?;
        if s.shape() != [b, h, k, vd] {
            return Err(shape_error(
                "initial_state",
                s,
                format!("[{b}, {h}, {k}, {vd}] (K-first)"),
            ));
        }
    }
    let scale = match args.scale {
        Some(s) if s.is_finite() => s,
        Some(s) => {
            return Err(EmbedError::Argument {
                param: "scale",
                expected: "a finite number",
                actual: s.to_string(),
            });
        }
        None => 1.0 / (k as f32).sqrt(),
    };
    let too_big = |param: &'static str, value: usize| {
        EmbedError::from(kda_core::layer::BatchError::TooLarge { param, value })
    };
    let t_i32 = i32::try_from(t).map_err(|_| too_big("T", t))?;
    let b_i32 = i32::try_from(b).map_err(|_| too_big("B", b))?;

    let dev = ReferenceBackend::new();
    let s = dev.new_stream()?;
    let up = |a: &ForeignArray, name: &'static str, shape: &[usize]| -> Result<Tensor<_>> {
        upload(&dev, &s, a.dtype(), &a.to_f32(name)?, shape)
    };
    // The K-first state of the conventions, and the v-first view of it the ops take.
    let state_kfirst = dev.alloc(DType::F32, &[b, h, k, vd])?;
    match args.initial_state {
        Some(a) => dev.upload(&s, &state_kfirst, &a.to_f32("initial_state")?)?,
        None => dev.launch(&s, Op::Fill { dst: state_kfirst.clone(), value: 0.0 })?,
    }
    let layout = Layout::strided(DType::F32, &[b, h, vd, k], &[h * k * vd, k * vd, 1, vd], 0)
        .map_err(kda_core::Error::from)?;
    let state = Tensor::new(state_kfirst.buffer().clone(), layout)?;
    let slots: Vec<i32> = (0..b_i32).collect();
    let o = dev.alloc(DType::F32, &[b, t, h, vd])?;
    let op = match args.algo {
        CoreAlgo::Chunk => {
            let n = b * t;
            let cu: Vec<i32> = (0..=b_i32).map(|r| r * t_i32).collect();
            Op::KdaChunk(KdaChunk {
                chunk_state_slots: None,
                q: up(args.q, "q", &[n, h, k])?,
                k: up(args.k, "k", &[n, h, k])?,
                v: up(args.v, "v", &[n, h, vd])?,
                g: up(args.g, "g", &[n, h, k])?,
                gate: None,
                beta: up(args.beta, "beta", &[n, h])?,
                cu_seqlens: upload_i32(&dev, &s, &[b + 1], &cu)?,
                state_slots: upload_i32(&dev, &s, &[b], &slots)?,
                has_initial_state: upload_i32(&dev, &s, &[b], &vec![1; b])?,
                state,
                o: o.reshape(&[n, h, vd])?,
                scale,
                qk_l2norm: args.l2norm,
            })
        }
        CoreAlgo::Recurrent => {
            // Request r starts from slot r and keeps only the state after its last token.
            let mut state_slots = vec![-1i32; b * t];
            for (r, &slot) in slots.iter().enumerate() {
                if t > 0 {
                    state_slots[r * t + t - 1] = slot;
                }
            }
            Op::KdaRecurrent(KdaRecurrent {
                q: up(args.q, "q", &[b, t, h, k])?,
                k: up(args.k, "k", &[b, t, h, k])?,
                v: up(args.v, "v", &[b, t, h, vd])?,
                g: up(args.g, "g", &[b, t, h, k])?,
                beta: up(args.beta, "beta", &[b, t, h])?,
                state_slots: upload_i32(&dev, &s, &[b, t], &state_slots)?,
                num_accepted_tokens: Some(upload_i32(&dev, &s, &[b], &vec![t_i32.max(1); b])?),
                state,
                o: o.clone(),
                scale,
                qk_l2norm: args.l2norm,
            })
        }
    };
    dev.launch(&s, op)?;
    Ok(CoreOutput {
        o: dev.download::<f32>(&s, &o)?,
        o_shape: [b, t, h, vd],
        final_state: dev.download::<f32>(&s, &state_kfirst)?,
        state_shape: [b, h, k, vd],
    })
}

/// A tensor of `dtype` (its values exact in it) holding `values`.
fn upload<B: Backend>(
    dev: &Device<B>,
    s: &B::Stream,
    dtype: DType,
    values: &[f32],
    shape: &[usize],
) -> Result<Tensor<B>> {
    let dst = dev.alloc(dtype, shape)?;
    match dtype {
        DType::BF16 => {
            let v: Vec<bf16> = values.iter().map(|&x| bf16::from_f32(x)).collect();
            dev.upload(s, &dst, &v)?;
        }
        _ => dev.upload(s, &dst, values)?,
    }
    Ok(dst)
}

fn upload_i32<B: Backend>(
    dev: &Device<B>,
    s: &B::Stream,
    shape: &[usize],
    values: &[i32],
) -> Result<Tensor<B>> {
    let dst = dev.alloc(DType::I32, shape)?;
    dev.upload(s, &dst, values)?;
    Ok(dst)
}
