//! `kda bench`: benchmarks. Each prints medians over repeats; tests never time anything.

use clap::{Args, Subcommand, ValueEnum};
use kda_core::{DType, Device, Op, ScaleAlg};
use kda_reference::{ExecutionMode, ReferenceBackend, ReferenceOptions, WaitStrategy};

use super::{median_time, ms};
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
    /// Dense Linear GEMM `y[M,N] = x[M,K] · w[N,K]^T` on the reference backend, in GFLOP/s.
    Gemm(GemmArgs),
    /// MXFP8 DynamicQuant of `x[M,K]` on the reference backend, in GB/s of input read, next to a
    /// host memcpy and an `Op::Copy` of the same bytes.
    Quant(QuantArgs),
    /// MXFP8 GEMM `y[M,N] = a[M,K] · w[N,K]^T` (E4M3 operands, E8M0 scales, bf16 out) on the
    /// reference backend.
    MxGemm(MxGemmArgs),
    /// Cost per launch of a small op, checked mode off and on: the sanitizer's overhead.
    Launch(LaunchArgs),
    /// The chunked KDA prefill (`KdaChunk`) in tokens/s and GFLOP/s, and as a fraction of the
    /// reference f32 GEMM's rate measured in the same run.
    Core(super::core::CoreBenchArgs),
    /// The QKV/BFG projection schedules at Kimi K3 TP8 shapes (MXFP8 QKV), one core per stream:
    /// serial, overlapped under both matrix-overlap policies, each op alone, the hidden vector
    /// fraction, and composed against staged F.
    Schedule(super::schedule::ScheduleBenchArgs),
    /// The whole KDA layer at Kimi K3 TP8 shapes: prefill tokens/s (4 x 1024 tokens) and
    /// decode latency (32 x 1 token), serial against overlapped, and the decode step as a
    /// multiple of the time to read the layer's weights once (bandwidth measured in the run).
    Layer(super::layer_bench::LayerBenchArgs),
}

/// Operand dtype of the GEMM benchmark (x, w and y all take it).
#[derive(Copy, Clone, Debug, ValueEnum)]
pub enum BenchDType {
    F32,
    Bf16,
}

impl From<BenchDType> for DType {
    fn from(d: BenchDType) -> Self {
        match d {
            BenchDType::F32 => DType::F32,
            BenchDType::Bf16 => DType::BF16,
        }
    }
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
    /// Threads per op: 1 runs on the stream's own thread, more use a shared pool.
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
    #[arg(long, default_value_t = 5)]
    pub repeats: usize,
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

/// A reference backend using `threads` threads per op.
pub fn reference_with_threads(threads: usize) -> Result<Device<ReferenceBackend>, CliError> {
    let mode = match threads {
        0 => {
            return Err(CliError::Argument {
                arg: "--threads",
                reason: "must be at least 1".into(),
            });
        }
        1 => ExecutionMode::PerStream,
        threads => ExecutionMode::SharedPool { threads },
    };
    let wait = WaitStrategy::Forecast;
    Ok(ReferenceBackend::with_options(ReferenceOptions {
        mode,
        wait,
        ..ReferenceOptions::default()
    })?)
}

fn gemm(args: &GemmArgs) -> Result<(), CliError> {
    let backend = reference_with_threads(args.threads)?;
    let stream = backend.new_stream()?;
    let dtype = DType::from(args.dtype);
    let (m, n, k) = (args.m, args.n, args.k);
    let mut rng = kda_testkit::Gen::new(7);
    let x = super::random_tensor(&backend, &stream, &mut rng, dtype, &[m, k])?;
    let w = super::random_tensor(&backend, &stream, &mut rng, dtype, &[n, k])?;
    let y = backend.alloc(dtype, &[m, n])?;
    let time = median_time(args.repeats, || {
        backend.launch(&stream, Op::Gemm { x: x.clone(), w: w.clone(), y: y.clone() })?;
        backend.synchronize(&stream)
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
    /// Threads per op: 1 runs on the stream's own thread, more use a shared pool.
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
    #[arg(long, default_value_t = 20)]
    pub repeats: usize,
}

/// GB/s of `bytes` moved in `time`.
fn gb_per_s(bytes: usize, time: std::time::Duration) -> f64 {
    bytes as f64 / time.as_secs_f64() / 1e9
}

fn quant(args: &QuantArgs) -> Result<(), CliError> {
    let alg = ScaleAlg::try_from(args.scale_alg)
        .map_err(|e| CliError::Argument { arg: "--scale-alg", reason: e.to_string() })?;
    let backend = reference_with_threads(args.threads)?;
    let stream = backend.new_stream()?;
    let dtype = DType::from(args.dtype);
    let (m, k) = (args.m, args.k);
    let mut rng = kda_testkit::Gen::new(11);
    let x = super::random_tensor(&backend, &stream, &mut rng, dtype, &[m, k])?;
    let data = backend.alloc(DType::E4M3, &[m, k])?;
    let scale = backend.alloc(DType::E8M0, &[m, kda_core::mx::num_blocks(k)])?;
    let copy = backend.alloc(dtype, &[m, k])?;
    let bytes = m * k * dtype.size_bytes();

    let quant = median_time(args.repeats, || {
        let op = Op::DynamicQuant { x: x.clone(), data: data.clone(), scale: scale.clone(), alg };
        backend.launch(&stream, op)?;
        backend.synchronize(&stream)
    })?;
    let op_copy = median_time(args.repeats, || {
        backend.launch(&stream, Op::Copy { src: x.clone(), dst: copy.clone() })?;
        backend.synchronize(&stream)
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
    /// Threads per op: 1 runs on the stream's own thread, more use a shared pool.
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
}

fn mx_gemm(args: &MxGemmArgs) -> Result<(), CliError> {
    let backend = reference_with_threads(args.threads)?;
    let stream = backend.new_stream()?;
    let (m, n, k) = (args.m, args.n, args.k);
    let blocks = kda_core::mx::num_blocks(k);
    let mut rng = kda_testkit::Gen::new(13);
    let mut quantized = |rows: usize| -> Result<_, CliError> {
        let x = super::random_tensor(&backend, &stream, &mut rng, DType::BF16, &[rows, k])?;
        let data = backend.alloc(DType::E4M3, &[rows, k])?;
        let scale = backend.alloc(DType::E8M0, &[rows, blocks])?;
        let alg = ScaleAlg::OcpFloor;
        backend.launch(
            &stream,
            Op::DynamicQuant { x, data: data.clone(), scale: scale.clone(), alg },
        )?;
        Ok((data, scale))
    };
    let (a, a_scale) = quantized(m)?;
    let (w, w_scale) = quantized(n)?;
    let y = backend.alloc(DType::BF16, &[m, n])?;
    let time = median_time(args.repeats, || {
        let op = Op::MxGemm {
            a: a.clone(),
            a_scale: a_scale.clone(),
            w: w.clone(),
            w_scale: w_scale.clone(),
            y: y.clone(),
        };
        backend.launch(&stream, op)?;
        backend.synchronize(&stream)
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
}

/// Launch and run `ops` 16-element fills on one stream, with checked mode off and on.
fn launch(args: &LaunchArgs) -> Result<(), CliError> {
    let mut per_op = Vec::new();
    for checked in [false, true] {
        let options = ReferenceOptions { checked, ..ReferenceOptions::default() };
        let backend = ReferenceBackend::with_options(options)?;
        let stream = backend.new_stream()?;
        let t = backend.alloc(DType::F32, &[16])?;
        let time = median_time(args.repeats, || {
            for _ in 0..args.ops {
                backend.launch(&stream, Op::Fill { dst: t.clone(), value: 1.0 })?;
            }
            backend.synchronize(&stream)
        })?;
        per_op.push(time.as_secs_f64() * 1e6 / args.ops.max(1) as f64);
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
