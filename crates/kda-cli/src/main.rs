//! `kda`: the command-line face of kda. Each subcommand lives in `cmd/`.

mod cmd;
mod error;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::error::CliError;

#[derive(Debug, Parser)]
#[command(
    name = "kda",
    version,
    about = "Kimi Delta Attention on accelerators: run, inspect, benchmark"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Backends compiled in, their capabilities, execution modes and threads.
    Info,
    /// The main job on an embedded default (today: the K3 TP8 projections, serial and overlapped).
    Run(cmd::run::RunArgs),
    /// Quantize every f32/bf16 tensor of a safetensors file to MXFP8 (E4M3 data, E8M0 scales).
    Quant(cmd::quant::QuantArgs),
    /// The KDA recurrence (chunked or token by token) on a safetensors file of q, k, v, g, beta
    /// [, initial_state], in flash-linear-attention's conventions; writes o and final_state.
    Core(cmd::core::CoreArgs),
    /// Composed vs staged low-rank gates (the fused BFG's forget gate) against an f64 oracle,
    /// on K3-shaped weights; `--write docs/precision.md` writes the report.
    Precision(cmd::precision::PrecisionArgs),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(cmd::bench::BenchCommand),
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("KDA_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result: Result<(), CliError> = match cli.command {
        Command::Info => cmd::info::run(),
        Command::Run(args) => cmd::run::run(&args),
        Command::Quant(args) => cmd::quant::run(&args),
        Command::Core(args) => cmd::core::run(&args),
        Command::Precision(args) => cmd::precision::run(&args),
        Command::Bench(bench) => cmd::bench::run(&bench),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
