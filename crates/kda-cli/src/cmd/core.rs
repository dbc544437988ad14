//! `kda core`: the KDA recurrence on a safetensors file, in flash-linear-attention's tensor
//! conventions (`naive_recurrent_kda` / `naive_chunk_kda`).
//!
//! The input holds `q`, `k` `[B, T, H, K]`, `v` `[B, T, H, V]`, `g` `[B, T, H, K]` (log decay,
//! already activated), `beta` `[B, T, H]` (already through the sigmoid) and optionally
//! `initial_state` `[B, H, K, V]`, each f32 or bf16. The output holds `o` `[B, T, H, V]` and
//! `final_state` `[B, H, K, V]`, f32. The checks and the computation are
//! [`mod@kda_embed::ops::core`]'s, the one implementation `kda.core` in Python runs too; this file
//! reads and writes the files.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use clap::{Args, ValueEnum};
use half::bf16;
use kda_core::kda::KdaChunk;
use kda_core::{Backend, DType, Device, Op};
use kda_embed::ops::{
    CoreAlgo, CoreError, CoreInputs, CoreOptions, HostTensor, core_on, upload_values,
};
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

/// The two forms of the recurrence, as `--algo` spells them.
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum Algo {
    Chunk,
    Recurrent,
}

impl From<Algo> for CoreAlgo {
    fn from(algo: Algo) -> Self {
        match algo {
            Algo::Chunk => CoreAlgo::Chunk,
            Algo::Recurrent => CoreAlgo::Recurrent,
        }
    }
}

/// The tensors read from the file, values as f32 (exact for bf16 inputs) in file order.
#[derive(Debug)]
pub struct FileInputs {
    pub q: Tensor32,
    pub k: Tensor32,
    pub v: Tensor32,
    pub g: Tensor32,
    pub beta: Tensor32,
    pub initial_state: Option<Tensor32>,
}

impl FileInputs {
    /// The inputs as [`core_on`] takes them.
    pub fn host(&self) -> CoreInputs<'_> {
        CoreInputs {
            q: self.q.host(),
            k: self.k.host(),
            v: self.v.host(),
            g: self.g.host(),
            beta: self.beta.host(),
            initial_state: self.initial_state.as_ref().map(Tensor32::host),
        }
    }
}

/// A tensor's shape, values, and the dtype it had in the file (kept, so the ops see it as
/// given).
#[derive(Debug)]
pub struct Tensor32 {
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub values: Vec<f32>,
}

impl Tensor32 {
    fn host(&self) -> HostTensor<'_> {
        HostTensor { dtype: self.dtype, shape: &self.shape, values: &self.values }
    }
}

/// A [`CoreError`] in the CLI's words: the input tensor or the `--scale` flag it names.
fn cli_error(e: CoreError) -> CliError {
    match e {
        CoreError::Input { param, dtype, shape, reason } => {
            CliError::Tensor { name: param.to_string(), dtype: dtype.name().into(), shape, reason }
        }
        CoreError::Scale(s) => {
            CliError::Argument { arg: "--scale", reason: format!("{s} is not finite") }
        }
        CoreError::Device(e) => CliError::Kda(e),
    }
}

pub fn run(args: &CoreArgs) -> Result<(), CliError> {
    crate::fsio::check_outputs(&[("--output", &args.output)], &[&args.input])?;
    let file = tensor_file::read(&args.input)?;
    let inputs = read_inputs(&args.input, &file)?;
    let host = inputs.host();
    let options = CoreOptions { algo: args.algo.into(), scale: args.scale, l2norm: args.l2norm };
    // Checked before a device is opened, so a bad file or flag never waits for one.
    let dims = host.dims().map_err(cli_error)?;
    options.scale_for(dims.k).map_err(cli_error)?;
    let settings = Settings { threads: args.threads, ..Settings::default() };
    let out = on_backend!(args.device.backend, &settings, |b| {
        core_on(&b, &host, options).map_err(cli_error)
    })?;
    let ([batch, tokens, heads, v], k) = (out.o_shape, dims.k);
    let scale = out.scale;

    let output = display(&args.output);
    let f32_bytes = |values: &[f32]| values.iter().flat_map(|x| x.to_le_bytes()).collect();
    let tensors = [
        OutTensor {
            name: "o".into(),
            dtype: Dtype::F32,
            shape: out.o_shape.to_vec(),
            bytes: f32_bytes(&out.o),
        },
        OutTensor {
            name: "final_state".into(),
            dtype: Dtype::F32,
            shape: out.state_shape.to_vec(),
            bytes: f32_bytes(&out.final_state),
        },
    ];
    let algo = options.algo.name();
    let metadata = HashMap::from([
        ("algo".to_string(), algo.to_string()),
        ("scale".to_string(), scale.to_string()),
        ("l2norm".to_string(), args.l2norm.to_string()),
        ("state_layout".to_string(), "[B, H, K, V]".to_string()),
    ]);
    tensor_file::write(&args.output, &tensors, metadata)?;
    println!(
        "kda core ({algo}): B={batch} T={tokens} H={heads} K={k} V={v}, scale {scale}, l2norm {}, \
         initial state {}; wrote o [{batch}, {tokens}, {heads}, {v}] and final_state \
         [{batch}, {heads}, {k}, {v}] (f32) to {output}",
        if args.l2norm { "on" } else { "off" },
        if inputs.initial_state.is_some() { "given" } else { "zero" },
    );
    Ok(())
}

fn display(path: &Path) -> String {
    path.display().to_string()
}

/// Read the tensors of a `kda core` input file (`path` names it in errors); their shapes are
/// checked by [`CoreInputs::dims`].
pub fn read_inputs(path: &Path, file: &[u8]) -> Result<FileInputs, CliError> {
    let tensors = tensor_file::parse(path, file)?;
    let get = |name: &'static str| -> Result<Option<Tensor32>, CliError> {
        let Ok(view) = tensors.tensor(name) else { return Ok(None) };
        let t = decode(name, &view)?;
        tensor_file::warn_non_finite(path, name, t.values.iter().copied());
        Ok(Some(t))
    };
    let need = |name: &'static str| {
        get(name)?.ok_or_else(|| CliError::MissingTensor {
            path: path.display().to_string(),
            name,
            needed: "q, k, v, g, beta (and optionally initial_state)",
        })
    };
    Ok(FileInputs {
        q: need("q")?,
        k: need("k")?,
        v: need("v")?,
        g: need("g")?,
        beta: need("beta")?,
        initial_state: get("initial_state")?,
    })
}

/// A tensor's values as f32; f32 and bf16 only.
fn decode(name: &str, view: &TensorView<'_>) -> Result<Tensor32, CliError> {
    // safetensors stores little-endian and does not promise alignment: decode element by element.
    let bytes = view.data();
    let shape = view.shape().to_vec();
    match view.dtype() {
        Dtype::F32 => Ok(Tensor32 {
            dtype: DType::F32,
            shape,
            values: bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        }),
        Dtype::BF16 => Ok(Tensor32 {
            dtype: DType::BF16,
            shape,
            values: bytes
                .chunks_exact(2)
                .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
                .collect(),
        }),
        other => Err(CliError::Tensor {
            name: name.to_string(),
            dtype: format!("{other:?}").to_lowercase(),
            shape,
            reason: "expected f32 or bf16".into(),
        }),
    }
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
    #[arg(long, value_enum, default_value_t = super::BenchDType::Bf16)]
    pub dtype: super::BenchDType,
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
        a_log: upload_values(b, s, &[h], &vec![0.0; h])?,
        dt_bias: upload_values(b, s, &[h, d], &vec![-1.0; h * d])?,
        form: GateForm::LowerBound { lower_bound: -5.0 },
        g: g.clone(),
    };
    b.launch(s, Op::KdaGate(gate))?;
    let beta_values: Vec<f32> = rng.uniform_f32(t * h, 0.05, 0.95);
    let beta = upload_values(b, s, &[t, h], &beta_values)?;
    let state = b.alloc(DType::F32, &[1, h, d, d])?;
    let o = b.alloc(DType::F32, &[t, h, d])?;
    let op = Op::KdaChunk(KdaChunk {
        chunk_state_slots: None,
        host_meta: None,
        q,
        k,
        v,
        g,
        gate: None,
        beta,
        cu_seqlens: upload_values(b, s, &[2], &[0, t_i32])?,
        state_slots: upload_values(b, s, &[1], &[0])?,
        has_initial_state: upload_values(b, s, &[1], &[0])?,
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
