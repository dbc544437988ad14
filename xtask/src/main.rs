//! `cargo xtask <task>`: the project's automation, in Rust so it needs nothing but cargo.
//!
//! - `test`: formatting check, clippy with `-D warnings`, the whole test suite (release), docs
//!   with warnings denied. What CI runs.
//! - `bench`: the benchmarks (`kda bench ...`) at the shapes the project reports.

use std::process::{Command, ExitCode};
use std::time::Instant;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("test") => test(),
        Some("bench") => bench(),
        _ => {
            eprintln!("usage: cargo xtask <test|bench>");
            return ExitCode::from(2);
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(step) => {
            eprintln!("xtask: step failed: {step}");
            ExitCode::FAILURE
        }
    }
}

/// Run one step, echoing it and its duration; `Err` names the step that failed.
fn step(name: &str, program: &str, args: &[&str], env: &[(&str, &str)]) -> Result<(), String> {
    eprintln!("==> {name}: {program} {}", args.join(" "));
    let start = Instant::now();
    let status = Command::new(program)
        .args(args)
        .envs(env.iter().copied())
        .status()
        .map_err(|e| format!("{name}: cannot start {program}: {e}"))?;
    eprintln!("    {name} took {:.1} s", start.elapsed().as_secs_f64());
    if status.success() { Ok(()) } else { Err(format!("{name} ({status})")) }
}

fn cargo() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".into())
}

fn test() -> Result<(), String> {
    let cargo = cargo();
    step("fmt", &cargo, &["fmt", "--all", "--", "--check"], &[])?;
    step(
        "clippy",
        &cargo,
        &["clippy", "--workspace", "--all-targets", "--", "-D", "warnings"],
        &[],
    )?;
    step("test", &cargo, &["test", "--workspace", "--release"], &[])?;
    step("doc", &cargo, &["doc", "--workspace", "--no-deps"], &[("RUSTDOCFLAGS", "-D warnings")])
}

fn bench() -> Result<(), String> {
    let cargo = cargo();
    let kda = ["run", "--quiet", "--release", "-p", "kda-cli", "--"];
    for (n, dtype) in [("3084", "f32"), ("3084", "bf16"), ("4608", "f32"), ("4608", "bf16")] {
        let mut args = kda.to_vec();
        args.extend(["bench", "gemm", "--m", "256", "--n", n, "--k", "7168", "--dtype", dtype]);
        step("bench gemm", &cargo, &args, &[])?;
    }
    Ok(())
}
