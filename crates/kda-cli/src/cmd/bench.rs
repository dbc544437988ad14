//! `kda bench`: benchmarks. Each prints medians over repeats; tests never time anything.

use clap::{Args, Subcommand};
use kda_core::{Backend, DType, Device, Op, ScaleAlg};

use super::backend::{BackendArg, Settings, on_backend};
use super::{BenchDType, median_time, ms};
use crate::error::CliError;

#[derive(Debug, Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct BenchArgs {
    #[command(subcommand)]
    pub command: Option<BenchCommand>,
    /// The default benchmark's options (when no subcommand is given).
    #[command(flatten)]
    pub matrix: super::schedule::ScheduleBenchArgs,
}

#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Dense Linear GEMM `y[M,N] = x[M,K] · w[N,K]^T` (on the reference backend unless
    /// `--backend` says otherwise, as every benchmark), in GFLOP/s.
    Gemm(GemmArgs),
    /// MXFP8 DynamicQuant of `x[M,K]`, in GB/s of input read, next to a host memcpy and an
    /// `Op::Copy` of the same bytes.
    Quant(QuantArgs),
    /// MXFP8 GEMM `y[M,N] = a[M,K] · w[N,K]^T` (E4M3 operands, E8M0 scales, bf16 out).
    MxGemm(MxGemmArgs),
    /// Cost per launch of a small op, checked mode off and on: the sanitizer's overhead.
    Launch(LaunchArgs),
    /// The chunked KDA prefill (`KdaChunk`) in tokens/s and GFLOP/s, and as a fraction of the
    /// same backend's f32 GEMM rate measured in the same run.
    Core(super::core::CoreBenchArgs),
    /// The QKV/BFG projection schedules at Kimi K3 TP8 shapes (MXFP8 QKV), one core per stream:
    /// serial, overlapped under both matrix-overlap policies, each op alone, the hidden vector
    /// fraction, and composed against staged F (from the op timeline: reference backend only).
    Schedule(super::schedule::ScheduleBenchArgs),
    /// The whole KDA layer at Kimi K3 TP8 shapes: prefill tokens/s (4 x 1024 tokens) and
    /// decode latency (32 x 1 token), serial against overlapped, and the decode step as a
    /// multiple of the time to read the layer's weights once (bandwidth measured in the run).
    Layer(super::layer_bench::LayerBenchArgs),
}

#[derive(Debug, Args)]
pub struct GemmArgs {
    #[arg(long, default_value_t = 256)]
    pub m: usize,
    #[arg(long, default_value_t = 3084)]
    pub n: usize,
    #[arg(long, default_value_t = 7168)]
    pub k: usize,
    #[arg(long, value_enum, default_value_t = BenchDType::F32)]
    pub dtype: BenchDType,
    /// Threads per op: 1 runs on the stream's own thread, more use a shared pool (reference
    /// backend).
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
    #[arg(long, default_value_t = 5)]
    pub repeats: usize,
    #[command(flatten)]
    pub device: BackendArg,
}

pub fn run(args: &BenchArgs) -> Result<(), CliError> {
    let Some(command) = &args.command else {
        return super::schedule::bench(&args.matrix);
    };
    match command {
        BenchCommand::Gemm(args) => gemm(args),
        BenchCommand::Quant(args) => quant(args),
        BenchCommand::MxGemm(args) => mx_gemm(args),
        BenchCommand::Launch(args) => launch(args),
        BenchCommand::Core(args) => super::core::bench(args),
        BenchCommand::Schedule(args) => super::schedule::bench(args),
        BenchCommand::Layer(args) => super::layer_bench::bench(args),
    }
}

/// Settings of a benchmark with `--threads threads`.
pub fn with_threads(threads: usize) -> Settings {
    Settings { threads, ..Settings::default() }
}

fn gemm(args: &GemmArgs) -> Result<(), CliError> {
    on_backend!(args.device.backend, &with_threads(args.threads), |b| gemm_on(args, b))
}

fn gemm_on<B: Backend>(args: &GemmArgs, device: Device<B>) -> Result<(), CliError> {
    let stream = device.new_stream()?;
    let dtype = DType::from(args.dtype);
    let (m, n, k) = (args.m, args.n, args.k);
    let mut rng = kda_synth::Gen::new(7);
    let x = super::random_tensor(&device, &stream, &mut rng, dtype, &[m, k])?;
    let w = super::random_tensor(&device, &stream, &mut rng, dtype, &[n, k])?;
    let y = device.alloc(dtype, &[m, n])?;
    let time = median_time(args.repeats, || {
        device.launch(&stream, Op::Gemm { x: x.clone(), w: w.clone(), y: y.clone() })?;
        device.synchronize(&stream)
    })?;
    let gflops = 2.0 * (m * n * k) as f64 / time.as_secs_f64() / 1e9;
    println!(
        "gemm m={m} n={n} k={k} dtype={dtype} threads={}: median {:.2} ms over {} repeats, {gflops:.1} GFLOP/s",
        args.threads,
        ms(time),
        args.repeats,
    );
    Ok(())
}

#[derive(Debug, Args)]
pub struct QuantArgs {
    #[arg(long, default_value_t = 256)]
    pub m: usize,
    #[arg(long, default_value_t = 7168)]
    pub k: usize,
    /// Input dtype.
    #[arg(long, value_enum, default_value_t = BenchDType::Bf16)]
    pub dtype: BenchDType,
    /// Scale algorithm: 0 (OCP floor) or 1 (round up).
    #[arg(long, default_value_t = 0)]
    pub scale_alg: u8,
    /// Threads per op: 1 runs on the stream's own thread, more use a shared pool (reference
    /// backend).
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
    #[arg(long, default_value_t = 20)]
    pub repeats: usize,
    #[command(flatten)]
    pub device: BackendArg,
}

/// GB/s of `bytes` moved in `time`.
fn gb_per_s(bytes: usize, time: std::time::Duration) -> f64 {
    bytes as f64 / time.as_secs_f64() / 1e9
}

fn quant(args: &QuantArgs) -> Result<(), CliError> {
    let alg = ScaleAlg::try_from(args.scale_alg)
        .map_err(|e| CliError::Argument { arg: "--scale-alg", reason: e.to_string() })?;
    on_backend!(args.device.backend, &with_threads(args.threads), |b| quant_on(args, alg, b))
}

fn quant_on<B: Backend>(
    args: &QuantArgs,
    alg: ScaleAlg,
    device: Device<B>,
) -> Result<(), CliError> {
    let stream = device.new_stream()?;
    let dtype = DType::from(args.dtype);
    let (m, k) = (args.m, args.k);
    let mut rng = kda_synth::Gen::new(11);
    let x = super::random_tensor(&device, &stream, &mut rng, dtype, &[m, k])?;
    let data = device.alloc(DType::E4M3, &[m, k])?;
    let scale = device.alloc(DType::E8M0, &[m, kda_core::mx::num_blocks(k)])?;
    let copy = device.alloc(dtype, &[m, k])?;
    let bytes = m * k * dtype.size_bytes();

    let quant = median_time(args.repeats, || {
        let op = Op::DynamicQuant { x: x.clone(), data: data.clone(), scale: scale.clone(), alg };
        device.launch(&stream, op)?;
        device.synchronize(&stream)
    })?;
    let op_copy = median_time(args.repeats, || {
        device.launch(&stream, Op::Copy { src: x.clone(), dst: copy.clone() })?;
        device.synchronize(&stream)
    })?;
    let source = vec![1u8; bytes];
    let mut target = vec![0u8; bytes];
    let memcpy = median_time(args.repeats, || {
        target.copy_from_slice(std::hint::black_box(&source));
        std::hint::black_box(&mut target);
        Ok::<(), CliError>(())
    })?;

    let (quant_gbs, memcpy_gbs, copy_gbs) =
        (gb_per_s(bytes, quant), gb_per_s(bytes, memcpy), gb_per_s(bytes, op_copy));
    println!(
        "quant m={m} k={k} dtype={dtype} scale_alg={} threads={}: input {:.2} MB, medians over {} repeats",
        alg.code(),
        args.threads,
        bytes as f64 / 1e6,
        args.repeats,
    );
    println!("  dynamic_quant     {:>8.3} ms  {quant_gbs:>7.2} GB/s of input read", ms(quant));
    println!("  host memcpy       {:>8.3} ms  {memcpy_gbs:>7.2} GB/s (one thread)", ms(memcpy));
    println!(
        "  op copy           {:>8.3} ms  {copy_gbs:>7.2} GB/s (Op::Copy, same bytes)",
        ms(op_copy)
    );
    println!(
        "  ratio dynamic_quant / host memcpy = {:.3}; / op copy = {:.3}",
        quant_gbs / memcpy_gbs,
        quant_gbs / copy_gbs
    );
    Ok(())
}

#[derive(Debug, Args)]
pub struct MxGemmArgs {
    #[arg(long, default_value_t = 256)]
    pub m: usize,
    #[arg(long, default_value_t = 4608)]
    pub n: usize,
    #[arg(long, default_value_t = 7168)]
    pub k: usize,
    /// Threads per op: 1 runs on the stream's own thread, more use a shared pool (reference
    /// backend).
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    #[command(flatten)]
    pub device: BackendArg,
}

fn mx_gemm(args: &MxGemmArgs) -> Result<(), CliError> {
    on_backend!(args.device.backend, &with_threads(args.threads), |b| mx_gemm_on(args, b))
}

fn mx_gemm_on<B: Backend>(args: &MxGemmArgs, device: Device<B>) -> Result<(), CliError> {
    let stream = device.new_stream()?;
    let (m, n, k) = (args.m, args.n, args.k);
    let blocks = kda_core::mx::num_blocks(k);
    let mut rng = kda_synth::Gen::new(13);
    let mut quantized = |rows: usize| -> Result<_, CliError> {
        let x = super::random_tensor(&device, &stream, &mut rng, DType::BF16, &[rows, k])?;
        let data = device.alloc(DType::E4M3, &[rows, k])?;
        let scale = device.alloc(DType::E8M0, &[rows, blocks])?;
        let alg = ScaleAlg::OcpFloor;
        device.launch(
            &stream,
            Op::DynamicQuant { x, data: data.clone(), scale: scale.clone(), alg },
        )?;
        Ok((data, scale))
    };
    let (a, a_scale) = quantized(m)?;
    let (w, w_scale) = quantized(n)?;
    let y = device.alloc(DType::BF16, &[m, n])?;
    let time = median_time(args.repeats, || {
        let op = Op::MxGemm {
            a: a.clone(),
            a_scale: a_scale.clone(),
            w: w.clone(),
            w_scale: w_scale.clone(),
            y: y.clone(),
        };
        device.launch(&stream, op)?;
        device.synchronize(&stream)
    })?;
    let gflops = 2.0 * (m * n * k) as f64 / time.as_secs_f64() / 1e9;
    println!(
        "mx_gemm m={m} n={n} k={k} e4m3 x e4m3 -> bf16 threads={}: median {:.1} ms over {} repeats, {gflops:.1} GFLOP/s",
        args.threads,
        ms(time),
        args.repeats,
    );
    Ok(())
}

#[derive(Debug, Args)]
pub struct LaunchArgs {
    /// Ops launched per timed run.
    #[arg(long, default_value_t = 20_000)]
    pub ops: usize,
    #[arg(long, default_value_t = 5)]
    pub repeats: usize,
    #[command(flatten)]
    pub device: BackendArg,
}

/// Launch and run `ops` 16-element fills on one stream, with checked mode off and on.
fn launch(args: &LaunchArgs) -> Result<(), CliError> {
    let mut per_op = Vec::new();
    for checked in [false, true] {
        let settings = Settings { checked: Some(checked), ..Settings::default() };
        per_op.push(on_backend!(args.device.backend, &settings, |b| launch_on(args, b))?);
    }
    println!(
        "launch+run of a 16-element fill, {} ops, median of {}: checked off {:.3} us/op, checked on {:.3} us/op ({:.2}x)",
        args.ops,
        args.repeats,
        per_op[0],
        per_op[1],
        per_op[1] / per_op[0]
    );
    Ok(())
}

/// Microseconds per launch and run of a 16-element fill on `backend`.
fn launch_on<B: Backend>(args: &LaunchArgs, device: Device<B>) -> Result<f64, CliError> {
    let stream = device.new_stream()?;
    let t = device.alloc(DType::F32, &[16])?;
    let time = median_time(args.repeats, || {
        for _ in 0..args.ops {
            device.launch(&stream, Op::Fill { dst: t.clone(), value: 1.0 })?;
        }
        device.synchronize(&stream)
    })?;
    Ok(time.as_secs_f64() * 1e6 / args.ops.max(1) as f64)
}
