//! `kda bench`: benchmarks. Each prints medians over repeats; tests never time anything.

use clap::{Args, Subcommand, ValueEnum};
use kda_core::{Backend, DType, Op};
use kda_reference::{ExecutionMode, ReferenceBackend, ReferenceOptions};

use super::{median_time, ms};
use crate::error::CliError;

#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Dense Linear GEMM `y[M,N] = x[M,K] · w[N,K]^T` on the reference backend, in GFLOP/s.
    Gemm(GemmArgs),
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

pub fn run(command: &BenchCommand) -> Result<(), CliError> {
    match command {
        BenchCommand::Gemm(args) => gemm(args),
    }
}

/// A reference backend using `threads` threads per op.
pub fn reference_with_threads(threads: usize) -> Result<ReferenceBackend, CliError> {
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
    Ok(ReferenceBackend::with_options(ReferenceOptions { mode, ..ReferenceOptions::default() })?)
}

fn gemm(args: &GemmArgs) -> Result<(), CliError> {
    let backend = reference_with_threads(args.threads)?;
    let stream = backend.new_stream()?;
    let dtype = DType::from(args.dtype);
    let (m, n, k) = (args.m, args.n, args.k);
    let mut rng = kda_testkit::Gen::new(7);
    let x = super::run::random_tensor(&backend, &stream, &mut rng, dtype, &[m, k])?;
    let w = super::run::random_tensor(&backend, &stream, &mut rng, dtype, &[n, k])?;
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
