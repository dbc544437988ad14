//! `kda core`: the KDA recurrence on a safetensors file, in flash-linear-attention's tensor
//! conventions (`naive_recurrent_kda` / `naive_chunk_kda`).
//!
//! The input holds `q`, `k` `[B, T, H, K]`, `v` `[B, T, H, V]`, `g` `[B, T, H, K]` (log decay,
//! already activated), `beta` `[B, T, H]` (already through the sigmoid) and optionally
//! `initial_state` `[B, H, K, V]`, each f32 or bf16. The output holds `o` `[B, T, H, V]` and
//! `final_state` `[B, H, K, V]`, f32. The state is K-first here, as in flash-linear-attention;
//! the ops take the cache's v-first `[N, H, V, K]`, and get the K-first buffer as a transposed
//! view of it, read and written in place.
//!
//! The batch runs as `B` requests of `T` tokens: chunked (`KdaChunk`, one flat batch) or token
//! by token (`KdaRecurrent`, every request starting from and ending in its own state slot).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use clap::{Args, ValueEnum};
use half::bf16;
use kda_core::kda::{KdaChunk, KdaRecurrent, MAX_HEAD_DIM};
use kda_core::{Backend, DType, Device, Layout, Op, Tensor};
use safetensors::tensor::{Dtype, TensorView};

use super::backend::{BackendArg, Settings, on_backend};
use super::tensor_file::{self, OutTensor};
use crate::error::CliError;

#[derive(Debug, Args)]
pub struct CoreArgs {
    /// safetensors file with q, k, v, g, beta and optionally initial_state.
    #[arg(long)]
    pub input: PathBuf,
    /// Where to write o and final_state (f32).
    #[arg(long)]
    pub output: PathBuf,
    /// chunk: the chunked prefill form (chunks of 64); recurrent: token by token.
    #[arg(long, value_enum, default_value_t = Algo::Chunk)]
    pub algo: Algo,
    /// L2-normalise q and k first (eps 1e-6 inside the square root).
    #[arg(long)]
    pub l2norm: bool,
    /// Multiplies q (after the L2 norm, if any); default K^-0.5.
    #[arg(long)]
    pub scale: Option<f32>,
    /// Threads per op: 1 runs on the stream's own thread, more use a shared pool (reference
    /// backend).
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
    #[command(flatten)]
    pub device: BackendArg,
}

/// The two forms of the recurrence.
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum Algo {
    Chunk,
    Recurrent,
}

impl Algo {
    fn name(self) -> &'static str {
        match self {
            Algo::Chunk => "chunk",
            Algo::Recurrent => "recurrent",
        }
    }
}

/// The problem read from the file, values as f32 (exact for bf16 inputs) in file order.
#[derive(Debug)]
pub struct CoreInputs {
    pub dims: CoreDims,
    pub q: Tensor32,
    pub k: Tensor32,
    pub v: Tensor32,
    pub g: Tensor32,
    pub beta: Tensor32,
    pub initial_state: Option<Vec<f32>>,
}

/// Sizes of a `kda core` problem.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct CoreDims {
    pub batch: usize,
    pub tokens: usize,
    pub heads: usize,
    pub k: usize,
    pub v: usize,
}

/// A tensor's values and the dtype it had in the file (kept, so the ops see it as given).
#[derive(Debug)]
pub struct Tensor32 {
    pub dtype: DType,
    pub values: Vec<f32>,
}

pub fn run(args: &CoreArgs) -> Result<(), CliError> {
    crate::fsio::check_outputs(&[("--output", &args.output)], &[&args.input])?;
    let file = tensor_file::read(&args.input)?;
    let inputs = read_inputs(&args.input, &file)?;
    let CoreDims { batch, tokens, heads, k, v } = inputs.dims;
    let scale = match args.scale {
        Some(s) if s.is_finite() => s,
        Some(s) => {
            return Err(CliError::Argument {
                arg: "--scale",
                reason: format!("{s} is not finite"),
            });
        }
        None => 1.0 / (k as f32).sqrt(),
    };
    let settings = Settings { threads: args.threads, ..Settings::default() };
    let (o, final_state) = on_backend!(args.device.backend, &settings, |b| {
        compute(&b, &inputs, args.algo, scale, args.l2norm)
    })?;

    let output = display(&args.output);
    let f32_bytes = |values: &[f32]| values.iter().flat_map(|x| x.to_le_bytes()).collect();
    let tensors = [
        OutTensor {
            name: "o".into(),
            dtype: Dtype::F32,
            shape: vec![batch, tokens, heads, v],
            bytes: f32_bytes(&o),
        },
        OutTensor {
            name: "final_state".into(),
            dtype: Dtype::F32,
            shape: vec![batch, heads, k, v],
            bytes: f32_bytes(&final_state),
        },
    ];
    let metadata = HashMap::from([
        ("algo".to_string(), args.algo.name().to_string()),
        ("scale".to_string(), scale.to_string()),
        ("l2norm".to_string(), args.l2norm.to_string()),
        ("state_layout".to_string(), "[B, H, K, V]".to_string()),
    ]);
    tensor_file::write(&args.output, &tensors, metadata)?;
    println!(
        "kda core ({}): B={batch} T={tokens} H={heads} K={k} V={v}, scale {scale}, l2norm {}, \
         initial state {}; wrote o [{batch}, {tokens}, {heads}, {v}] and final_state \
         [{batch}, {heads}, {k}, {v}] (f32) to {output}",
        args.algo.name(),
        if args.l2norm { "on" } else { "off" },
        if inputs.initial_state.is_some() { "given" } else { "zero" },
    );
    Ok(())
}

fn display(path: &Path) -> String {
    path.display().to_string()
}

/// Read and check the tensors of a `kda core` input file (`path` names it in errors).
pub fn read_inputs(path: &Path, file: &[u8]) -> Result<CoreInputs, CliError> {
    let tensors = tensor_file::parse(path, file)?;
    let get = |name: &'static str| -> Result<Option<(Vec<usize>, Tensor32)>, CliError> {
        let Ok(view) = tensors.tensor(name) else { return Ok(None) };
        let shape = view.shape().to_vec();
        let values = decode(name, &view)?;
        tensor_file::warn_non_finite(path, name, values.values.iter().copied());
        Ok(Some((shape, values)))
    };
    let need = |name: &'static str| {
        get(name)?.ok_or_else(|| CliError::MissingTensor {
            path: path.display().to_string(),
            name,
            needed: "q, k, v, g, beta (and optionally initial_state)",
        })
    };
    let (q_shape, q) = need("q")?;
    let [batch, tokens, heads, k] = <[usize; 4]>::try_from(q_shape.as_slice())
        .map_err(|_| shape_error("q", q.dtype, &q_shape, "expected [B, T, H, K]".into()))?;
    // Every size at least 1, so B·T·H ≤ the elements of beta: what is sized by B (the slots, the
    // state) is backed by data in the file, not by a header number alone.
    for (dim, size) in [("B", batch), ("T", tokens), ("H", heads), ("K", k)] {
        if size == 0 {
            let why = format!("{dim} must be at least 1");
            return Err(shape_error("q", q.dtype, &q_shape, why));
        }
    }
    check_head_dim("q", &q, &q_shape, "K", k)?;
    let expect = |name: &'static str, t: &Tensor32, shape: &[usize], want: &[usize], what: &str| {
        if shape == want {
            Ok(())
        } else {
            Err(shape_error(
                name,
                t.dtype,
                shape,
                format!("expected {what} = {want:?} (from q {q_shape:?})"),
            ))
        }
    };
    let (k_shape, kt) = need("k")?;
    expect("k", &kt, &k_shape, &q_shape, "[B, T, H, K]")?;
    let (g_shape, g) = need("g")?;
    expect("g", &g, &g_shape, &q_shape, "[B, T, H, K]")?;
    let (v_shape, v) = need("v")?;
    let vdim = match v_shape[..] {
        [b, t, h, vd] if [b, t, h] == [batch, tokens, heads] && vd > 0 => vd,
        _ => {
            let want = format!(
                "expected [B, T, H, V] with [B, T, H] = {:?} (from q {q_shape:?}) and V at least 1",
                [batch, tokens, heads]
            );
            return Err(shape_error("v", v.dtype, &v_shape, want));
        }
    };
    check_head_dim("v", &v, &v_shape, "V", vdim)?;
    let (beta_shape, beta) = need("beta")?;
    expect("beta", &beta, &beta_shape, &[batch, tokens, heads], "[B, T, H]")?;
    let initial_state = match get("initial_state")? {
        None => None,
        Some((shape, s)) => {
            let want = [batch, heads, k, vdim];
            if shape != want {
                let why = format!(
                    "expected [B, H, K, V] = {want:?} (K-first, from q {q_shape:?} and v {v_shape:?})"
                );
                return Err(shape_error("initial_state", s.dtype, &shape, why));
            }
            Some(s.values)
        }
    };
    let dims = CoreDims { batch, tokens, heads, k, v: vdim };
    Ok(CoreInputs { dims, q, k: kt, v, g, beta, initial_state })
}

/// K and V size the state `[B, H, K, V]` together, which the file need not hold (a zero
/// initial state): both are bounded by [`MAX_HEAD_DIM`].
fn check_head_dim(
    name: &str,
    t: &Tensor32,
    shape: &[usize],
    dim: &str,
    size: usize,
) -> Result<(), CliError> {
    if size <= MAX_HEAD_DIM {
        return Ok(());
    }
    let why =
        format!("{dim} = {size}, expected at most {MAX_HEAD_DIM} (kda's bound on a head dim)");
    Err(shape_error(name, t.dtype, shape, why))
}

fn shape_error(name: &str, dtype: DType, shape: &[usize], reason: String) -> CliError {
    CliError::Tensor {
        name: name.to_string(),
        dtype: dtype.name().to_string(),
        shape: shape.to_vec(),
        reason,
    }
}

/// A tensor's values as f32; f32 and bf16 only.
fn decode(name: &str, view: &TensorView<'_>) -> Result<Tensor32, CliError> {
    // safetensors stores little-endian and does not promise alignment: decode element by element.
    let bytes = view.data();
    match view.dtype() {
        Dtype::F32 => Ok(Tensor32 {
            dtype: DType::F32,
            values: bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        }),
        Dtype::BF16 => Ok(Tensor32 {
            dtype: DType::BF16,
            values: bytes
                .chunks_exact(2)
                .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
                .collect(),
        }),
        other => Err(CliError::Tensor {
            name: name.to_string(),
            dtype: format!("{other:?}").to_lowercase(),
            shape: view.shape().to_vec(),
            reason: "expected f32 or bf16".into(),
        }),
    }
}

/// Upload `t` in its own dtype with `shape`.
fn upload<B: Backend>(
    b: &Device<B>,
    s: &B::Stream,
    t: &Tensor32,
    shape: &[usize],
) -> Result<Tensor<B>, CliError> {
    let dst = b.alloc(t.dtype, shape)?;
    match t.dtype {
        DType::BF16 => {
            let v: Vec<bf16> = t.values.iter().map(|&x| bf16::from_f32(x)).collect();
            b.upload(s, &dst, &v)?;
        }
        _ => b.upload(s, &dst, &t.values)?,
    }
    Ok(dst)
}

fn upload_i32<B: Backend>(
    b: &Device<B>,
    s: &B::Stream,
    shape: &[usize],
    values: &[i32],
) -> Result<Tensor<B>, CliError> {
    let dst = b.alloc(DType::I32, shape)?;
    b.upload(s, &dst, values)?;
    Ok(dst)
}

/// Run the problem on `backend`: returns `o` (`[B, T, H, V]`) and the final state
/// (`[B, H, K, V]`), both f32.
pub fn compute<B: Backend>(
    backend: &Device<B>,
    inputs: &CoreInputs,
    algo: Algo,
    scale: f32,
    l2norm: bool,
) -> Result<(Vec<f32>, Vec<f32>), CliError> {
    let (b, s) = (backend, backend.new_stream()?);
    let CoreDims { batch, tokens, heads, k, v } = inputs.dims;
    let too_big = |what: &str| CliError::Argument {
        arg: "--input",
        reason: format!("{what} do not fit an i32"),
    };
    let tokens_i32 = i32::try_from(tokens).map_err(|_| too_big("T tokens"))?;
    let batch_i32 = i32::try_from(batch).map_err(|_| too_big("B requests"))?;
    // The chunked form's offsets run up to B·T.
    let n = batch
        .checked_mul(tokens)
        .filter(|&n| i32::try_from(n).is_ok())
        .ok_or_else(|| too_big("B·T tokens"))?;
    // The K-first state the file speaks of, and the v-first view of it that the ops take.
    let state_kfirst = b.alloc(DType::F32, &[batch, heads, k, v])?;
    match &inputs.initial_state {
        Some(values) => b.upload(&s, &state_kfirst, values)?,
        None => b.launch(&s, Op::Fill { dst: state_kfirst.clone(), value: 0.0 })?,
    }
    let layout =
        Layout::strided(DType::F32, &[batch, heads, v, k], &[heads * k * v, k * v, 1, v], 0)
            .map_err(kda_core::Error::from)?;
    let state = Tensor::new(state_kfirst.buffer().clone(), layout)?;
    let slots: Vec<i32> = (0..batch_i32).collect();
    let o = b.alloc(DType::F32, &[batch, tokens, heads, v])?;
    let op = match algo {
        Algo::Chunk => {
            // The B requests back to back: one flat batch of B·T tokens.
            let cu_seqlens: Vec<i32> = (0..=batch_i32).map(|r| r * tokens_i32).collect();
            Op::KdaChunk(KdaChunk {
                chunk_state_slots: None,
                q: upload(b, &s, &inputs.q, &[n, heads, k])?,
                k: upload(b, &s, &inputs.k, &[n, heads, k])?,
                v: upload(b, &s, &inputs.v, &[n, heads, v])?,
                g: upload(b, &s, &inputs.g, &[n, heads, k])?,
                gate: None,
                beta: upload(b, &s, &inputs.beta, &[n, heads])?,
                cu_seqlens: upload_i32(b, &s, &[batch + 1], &cu_seqlens)?,
                state_slots: upload_i32(b, &s, &[batch], &slots)?,
                has_initial_state: upload_i32(b, &s, &[batch], &vec![1; batch])?,
                state,
                o: o.reshape(&[n, heads, v])?,
                scale,
                qk_l2norm: l2norm,
            })
        }
        Algo::Recurrent => {
            // Request r starts from slot r (read at its last token, the one accepted) and keeps
            // only the state after its last token, in slot r.
            let mut state_slots = vec![-1i32; n];
            for (r, &slot) in slots.iter().enumerate() {
                if tokens > 0 {
                    state_slots[r * tokens + tokens - 1] = slot;
                }
            }
            Op::KdaRecurrent(KdaRecurrent {
                q: upload(b, &s, &inputs.q, &[batch, tokens, heads, k])?,
                k: upload(b, &s, &inputs.k, &[batch, tokens, heads, k])?,
                v: upload(b, &s, &inputs.v, &[batch, tokens, heads, v])?,
                g: upload(b, &s, &inputs.g, &[batch, tokens, heads, k])?,
                beta: upload(b, &s, &inputs.beta, &[batch, tokens, heads])?,
                state_slots: upload_i32(b, &s, &[batch, tokens], &state_slots)?,
                num_accepted_tokens: Some(upload_i32(
                    b,
                    &s,
                    &[batch],
                    &vec![tokens_i32.max(1); batch],
                )?),
                state,
                o: o.clone(),
                scale,
                qk_l2norm: l2norm,
            })
        }
    };
    b.launch(&s, op)?;
    let o = b.download::<f32>(&s, &o)?;
    let final_state = b.download::<f32>(&s, &state_kfirst)?;
    Ok((o, final_state))
}

#[derive(Debug, Args)]
pub struct CoreBenchArgs {
    /// Tokens of the one prefill request.
    #[arg(long, default_value_t = 4096)]
    pub t: usize,
    /// Heads (12: Kimi K3 at TP 8).
    #[arg(long, default_value_t = 12)]
    pub heads: usize,
    /// Head dim K = V.
    #[arg(long, default_value_t = 128)]
    pub dim: usize,
    /// dtype of q, k and v (g and beta are f32, as the gate and the sigmoid make them).
    #[arg(long, value_enum, default_value_t = super::bench::BenchDType::Bf16)]
    pub dtype: super::bench::BenchDType,
    /// Threads per op: 1 runs on the stream's own thread, more use a shared pool (reference
    /// backend).
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
    #[arg(long, default_value_t = 5)]
    pub repeats: usize,
    #[command(flatten)]
    pub device: BackendArg,
}

/// The GEMM the chunked prefill's FLOP rate is compared with (on the same backend): f32, the
/// K3 TP8 fused BFG projection shape.
const GEMM_SHAPE: (usize, usize, usize) = (256, 3084, 7168);

/// `kda bench core`: throughput of the chunked prefill (`KdaChunk`, one request, L2 norm on,
/// lower-bound gates from `KdaGate`) and its FLOP rate as a fraction of the same backend's GEMM,
/// measured in the same run. FLOPs are counted as `6TD² + 3TCD + TC²` per head (`C = 64`).
pub fn bench(args: &CoreBenchArgs) -> Result<(), CliError> {
    let (t, h, d) = (args.t, args.heads, args.dim);
    if t == 0 || h == 0 || d == 0 {
        return Err(CliError::Argument {
            arg: "--t/--heads/--dim",
            reason: "must be at least 1".into(),
        });
    }
    let settings = Settings { threads: args.threads, ..Settings::default() };
    on_backend!(args.device.backend, &settings, |b| bench_on(args, b))
}

fn bench_on<B: Backend>(args: &CoreBenchArgs, b: Device<B>) -> Result<(), CliError> {
    use kda_core::kda::CHUNK_SIZE;

    let (t, h, d) = (args.t, args.heads, args.dim);
    let s = b.new_stream()?;
    let dtype = DType::from(args.dtype);
    let mut rng = kda_synth::Gen::new(17);
    let random = |rng: &mut kda_synth::Gen, dtype, shape: &[usize]| {
        super::random_tensor(&b, &s, rng, dtype, shape)
    };
    let (op, flops) = prefill_workload(&b, &s, &mut rng, (t, h, d), dtype)?;
    let time = super::median_time(args.repeats, || {
        b.launch(&s, op.clone())?;
        b.synchronize(&s)
    })?;

    let (m, n, kk) = GEMM_SHAPE;
    let x = random(&mut rng, DType::F32, &[m, kk])?;
    let w = random(&mut rng, DType::F32, &[n, kk])?;
    let y = b.alloc(DType::F32, &[m, n])?;
    let gemm_time = super::median_time(args.repeats, || {
        b.launch(&s, Op::Gemm { x: x.clone(), w: w.clone(), y: y.clone() })?;
        b.synchronize(&s)
    })?;

    let tf = t as f64;
    let gflops = flops / time.as_secs_f64() / 1e9;
    let gemm_gflops = 2.0 * (m * n * kk) as f64 / gemm_time.as_secs_f64() / 1e9;
    println!(
        "core chunk T={t} H={h} K=V={d} ({dtype} q/k/v, f32 g/beta, l2norm) threads={}: median {:.1} ms \
         over {} repeats, {:.0} tokens/s, {gflops:.1} GFLOP/s (6TD²+3TCD+TC² per head, C={CHUNK_SIZE})",
        args.threads,
        super::ms(time),
        args.repeats,
        tf / time.as_secs_f64(),
    );
    println!(
        "{} gemm f32 m={m} n={n} k={kk} threads={}: median {:.1} ms, {gemm_gflops:.1} GFLOP/s",
        b.info().name,
        args.threads,
        super::ms(gemm_time),
    );
    println!("fraction of the GEMM rate: {:.2} (target >= 0.4)", gflops / gemm_gflops);
    Ok(())
}

/// The chunked prefill the benchmarks time: one request of `t` tokens, `h` heads of `d`, L2 norm
/// on, lower-bound gates from `KdaGate`, q/k/v in `dtype`; with its FLOP count
/// (`6TD² + 3TCD + TC²` per head, `C = 64`).
pub fn prefill_workload<B: Backend>(
    b: &Device<B>,
    s: &B::Stream,
    rng: &mut kda_synth::Gen,
    (t, h, d): (usize, usize, usize),
    dtype: DType,
) -> Result<(Op<B>, f64), CliError> {
    use kda_core::kda::{CHUNK_SIZE, GateForm, KdaGate};

    let t_i32 = i32::try_from(t)
        .map_err(|_| CliError::Argument { arg: "--t", reason: "too large".into() })?;
    let random = |rng: &mut kda_synth::Gen, dtype, shape: &[usize]| {
        super::random_tensor(b, s, rng, dtype, shape)
    };
    let (q, k, v) = (
        random(rng, dtype, &[t, h, d])?,
        random(rng, dtype, &[t, h, d])?,
        random(rng, dtype, &[t, h, d])?,
    );
    // Gates as the layer makes them: K3's lower-bound form, logits in [-3, 1) after the bias.
    let g = b.alloc(DType::F32, &[t, h, d])?;
    let gate = KdaGate {
        g1: random(rng, DType::F32, &[t, h, d])?,
        a_log: upload_f32(b, s, &[h], &vec![0.0; h])?,
        dt_bias: upload_f32(b, s, &[h, d], &vec![-1.0; h * d])?,
        form: GateForm::LowerBound { lower_bound: -5.0 },
        g: g.clone(),
    };
    b.launch(s, Op::KdaGate(gate))?;
    let beta_values: Vec<f32> = rng.uniform_f32(t * h, 0.05, 0.95);
    let beta = upload_f32(b, s, &[t, h], &beta_values)?;
    let state = b.alloc(DType::F32, &[1, h, d, d])?;
    let o = b.alloc(DType::F32, &[t, h, d])?;
    let op = Op::KdaChunk(KdaChunk {
        chunk_state_slots: None,
        q,
        k,
        v,
        g,
        gate: None,
        beta,
        cu_seqlens: upload_i32(b, s, &[2], &[0, t_i32])?,
        state_slots: upload_i32(b, s, &[1], &[0])?,
        has_initial_state: upload_i32(b, s, &[1], &[0])?,
        state,
        o,
        scale: 1.0 / (d as f32).sqrt(),
        qk_l2norm: true,
    });
    b.synchronize(s)?;
    let (tf, df, cf) = (t as f64, d as f64, CHUNK_SIZE as f64);
    let flops = h as f64 * (6.0 * tf * df * df + 3.0 * tf * cf * df + tf * cf * cf);
    Ok((op, flops))
}

/// An f32 tensor holding `values`.
fn upload_f32<B: Backend>(
    b: &Device<B>,
    s: &B::Stream,
    shape: &[usize],
    values: &[f32],
) -> Result<Tensor<B>, CliError> {
    let dst = b.alloc(DType::F32, shape)?;
    b.upload(s, &dst, values)?;
    Ok(dst)
}
