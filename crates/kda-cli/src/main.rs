//! `kda`: the command-line face of kda. Each subcommand lives in `cmd/`.

mod cmd;
mod error;
mod fsio;
mod render;
mod signals;

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
    /// More log output on stderr (-v info, -vv debug, -vvv trace); `RUST_LOG` overrides.
    #[arg(short, long, global = true, action = clap::ArgAction::Count, conflicts_with = "quiet")]
    verbose: u8,
    /// Only errors on stderr.
    #[arg(short, long, global = true)]
    quiet: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Backends compiled in, their capabilities, execution modes and threads.
    Info,
    /// The main job: one KDA layer (default: synthetic Kimi K3 TP8 rank 0) on a prefill batch
    /// then decode steps, overlapped against serial, under capture validation and the sanitizer.
    Run(cmd::run::RunArgs),
    /// One layer forward drawn as an SVG timeline (lane per stream, box per op, arrow per wait)
    /// and/or written as a Chrome/Perfetto trace.
    Trace(cmd::trace::TraceArgs),
    /// Capture one layer forward and report the validation (joined streams, hazards); exit code
    /// 0 only when valid.
    Check(cmd::check::CheckArgs),
    /// Quantize every f32/bf16 tensor of a safetensors file to MXFP8 (E4M3 data, E8M0 scales).
    Quant(cmd::quant::QuantArgs),
    /// The KDA recurrence (chunked or token by token) on a safetensors file of q, k, v, g, beta
    /// [, initial_state], in flash-linear-attention's conventions; writes o and final_state.
    Core(cmd::core::CoreArgs),
    /// One KDA layer of a checkpoint on a safetensors file of hidden states and
    /// query_start_loc (fresh prefills); writes this rank's output, final_state and, with
    /// --dump, the intermediates.
    Layer(cmd::layer::LayerArgs),
    /// Composed vs staged low-rank gates (the fused BFG's forget gate) against an f64 oracle,
    /// on K3-shaped weights; `--write docs/precision.md` writes the report.
    Precision(cmd::precision::PrecisionArgs),
    /// Benchmarks. Without a subcommand: the projection-schedule matrix (serial and both
    /// overlap policies x composed | staged F x token counts), as `kda bench schedule`.
    Bench(cmd::bench::BenchArgs),
    /// Predicted projection times per chip and token count for serial / overlapped-serialised /
    /// overlapped-concurrent x composed / staged F, and the configuration the planner recommends.
    Plan(cmd::plan::PlanArgs),
}

/// Log to stderr: `RUST_LOG` when set, else the level `-v`/`-q` ask for (warnings by default).
fn init_logging(verbose: u8, quiet: bool) {
    let level = match (quiet, verbose) {
        (true, _) => "error",
        (false, 0) => "warn",
        (false, 1) => "info",
        (false, 2) => "debug",
        (false, _) => "trace",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(level));
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
}

/// One line for the error, then one indented line per underlying cause not already in it.
fn report(error: &CliError) {
    let mut shown = error.to_string();
    eprintln!("error: {shown}");
    let mut source = std::error::Error::source(error);
    while let Some(cause) = source {
        let text = cause.to_string();
        if !shown.contains(&text) {
            eprintln!("  caused by: {text}");
            shown = text;
        }
        source = cause.source();
    }
}

fn main() -> ExitCode {
    signals::install();
    let cli = Cli::parse();
    init_logging(cli.verbose, cli.quiet);
    let result: Result<(), CliError> = match cli.command {
        Command::Info => cmd::info::run(),
        Command::Run(args) => cmd::run::run(&args),
        Command::Trace(args) => cmd::trace::run(&args),
        Command::Check(args) => cmd::check::run(&args),
        Command::Quant(args) => cmd::quant::run(&args),
        Command::Core(args) => cmd::core::run(&args),
        Command::Layer(args) => cmd::layer::run(&args),
        Command::Precision(args) => cmd::precision::run(&args),
        Command::Bench(bench) => cmd::bench::run(&bench),
        Command::Plan(args) => cmd::plan::run(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            report(&e);
            ExitCode::FAILURE
        }
    }
}
