//! `cargo xtask <task>`: the project's automation, in Rust so it needs nothing but cargo.
//!
//! - `test`: formatting check, design references (`doc_refs.rs`), clippy with `-D warnings`,
//!   the whole test suite (release), the Python package's pytest suite (see `python.rs`), docs
//!   with warnings denied. What CI runs.
//! - `bench`: the benchmarks (`kda bench ...`) at the shapes the project reports, then the
//!   peer comparison with llama.cpp's ggml (see `peer.rs`; `bench peer` runs it alone).
//! - `kernels`, `test --backend ascend`: the AscendC kernels and the NPU run (see `ascend.rs`);
//!   `kernels --check DEVKIT_DIR`: their syntax check against asc-devkit's headers
//!   (see `kernel_check.rs`).
//! - `gpu-check`: the CUDA backend on a real GPU: build, conformance, capture, benchmarks,
//!   one JSON report (see `gpu_check.rs`).

use std::io::{BufRead, BufReader};
use std::process::{Command, ExitCode, Stdio};
use std::time::Instant;

mod ascend;
mod doc_refs;
mod gpu_check;
mod import_cycles;
mod kernel_check;
mod kernel_script;
mod npu_check;
mod peer;
mod python;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("test") if args.get(1).is_some_and(|a| a == "--backend") => {
            ascend::test_backend(args.get(2).map(String::as_str))
        }
        Some("test") => test(),
        Some("doc-refs") => doc_refs::check(&doc_refs::repo_root()),
        Some("kernels") if args.len() > 1 => kernel_check::check(&args[1..]),
        Some("kernels") => ascend::kernels().map(|_| ()),
        Some("bench") if args.get(1).is_some_and(|a| a == "peer") => peer::compare(),
        Some("bench") => bench(),
        Some("gpu-check") => gpu_check::gpu_check(&args[1..]),
        Some("npu-check") => npu_check::npu_check(&args[1..]),
        _ => {
            eprintln!(
                "usage: cargo xtask <test [--backend ascend]|doc-refs|bench [peer]|kernels [--check DEVKIT_DIR …|--help]|gpu-check [--out PATH] [--quick]|npu-check --bundle DIR [--target TRIPLE]>"
            );
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
    doc_refs::check(&doc_refs::repo_root())?;
    import_cycles::check(&doc_refs::repo_root())?;
    step(
        "clippy",
        &cargo,
        &[
            "clippy",
            "--workspace",
            "--all-targets",
            "--features",
            ascend::EMULATED,
            "--",
            "-D",
            "warnings",
        ],
        &[],
    )?;
    // The CUDA crate's feature-off twin (what a build without a CUDA toolkit in mind gets).
    step(
        "clippy kda-cuda (features off)",
        &cargo,
        &[
            "clippy",
            "-p",
            "kda-cuda",
            "--no-default-features",
            "--all-targets",
            "--",
            "-D",
            "warnings",
        ],
        &[],
    )?;
    msrv()?;
    let mut counts = run_tests(&cargo)?;
    python::pytest(&mut counts)?;
    step(
        "doc",
        &cargo,
        &["doc", "--workspace", "--no-deps", "--features", ascend::EMULATED],
        &[("RUSTDOCFLAGS", "-D warnings")],
    )?;
    ascend::twin_checks()?;
    npu_check::aarch64_bundle()?;
    // One closing line for the whole suite, so CI reads the total, not the last binary's count.
    println!(
        "tests: {} passed, {} failed, {} skipped",
        counts.passed, counts.failed, counts.ignored
    );
    if counts.passed == 0 {
        return Err("test (no test ran)".into());
    }
    Ok(())
}

/// The declared minimum Rust version (`rust-version` in the workspace manifest): the whole
/// workspace is checked with that toolchain (`.ci/run` installs it with rustup when missing).
/// Under CI a missing toolchain fails the step; elsewhere the step says what it could not check
/// (clippy's `incompatible_msrv` lint, part of the clippy step, still rejects standard-library
/// APIs newer than the MSRV).
fn msrv() -> Result<(), String> {
    let manifest = std::fs::read_to_string(doc_refs::repo_root().join("Cargo.toml"))
        .map_err(|e| format!("msrv: cannot read Cargo.toml: {e}"))?;
    let version = manifest
        .lines()
        .find_map(|l| l.trim().strip_prefix("rust-version"))
        .and_then(|rest| rest.split('"').nth(1))
        .ok_or("msrv: no rust-version in the workspace manifest")?
        .to_string();
    let installed = Command::new("rustup")
        .args(["toolchain", "list"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).lines().any(|l| l.starts_with(&version)))
        .unwrap_or(false);
    if installed {
        // Through rustup: under `cargo xtask`, `$CARGO` is the running toolchain's own cargo
        // binary, which takes no `+toolchain`.
        return step(
            "msrv",
            "rustup",
            &[
                "run",
                &version,
                "cargo",
                "check",
                "--workspace",
                "--all-targets",
                "--features",
                ascend::EMULATED,
            ],
            &[],
        );
    }
    if std::env::var_os("CI").is_some() {
        return Err(format!(
            "msrv: toolchain {version} is not installed (`rustup toolchain install {version} \
             --profile minimal`, which .ci/run runs)"
        ));
    }
    eprintln!(
        "==> msrv: toolchain {version} is not installed (`rustup toolchain install {version} \
         --profile minimal`); standard-library APIs were checked against {version} by \
         clippy::incompatible_msrv, language features were not"
    );
    Ok(())
}

#[derive(Debug, Default)]
pub(crate) struct Counts {
    passed: u64,
    failed: u64,
    ignored: u64,
}

/// `cargo test --workspace --release`, echoing its output and adding up its `test result:` lines.
fn run_tests(cargo: &str) -> Result<Counts, String> {
    let args = ["test", "--workspace", "--release", "--features", ascend::EMULATED];
    eprintln!("==> test: {cargo} {}", args.join(" "));
    let start = Instant::now();
    let mut child = Command::new(cargo)
        .args(args)
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| format!("test: cannot start {cargo}: {e}"))?;
    let mut counts = Counts::default();
    if let Some(out) = child.stdout.take() {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            println!("{line}");
            if let Some(summary) = line.strip_prefix("test result: ") {
                add_counts(&mut counts, summary);
            }
        }
    }
    let status = child.wait().map_err(|e| format!("test: {e}"))?;
    eprintln!("    test took {:.1} s", start.elapsed().as_secs_f64());
    if status.success() { Ok(counts) } else { Err(format!("test ({status})")) }
}

/// Add `ok. 26 passed; 0 failed; 1 ignored; ...` to the totals.
fn add_counts(counts: &mut Counts, summary: &str) {
    for part in summary.split([';', '.']) {
        let mut words = part.split_whitespace();
        if let (Some(n), Some(what)) = (words.next(), words.next()) {
            let Ok(n) = n.parse::<u64>() else { continue };
            match what {
                "passed" => counts.passed += n,
                "failed" => counts.failed += n,
                "ignored" => counts.ignored += n,
                _ => {}
            }
        }
    }
}

fn bench() -> Result<(), String> {
    let cargo = cargo();
    let kda = ["run", "--quiet", "--release", "-p", "kda-cli", "--"];
    for (n, dtype) in [("3084", "f32"), ("3084", "bf16"), ("4608", "f32"), ("4608", "bf16")] {
        let mut args = kda.to_vec();
        args.extend(["bench", "gemm", "--m", "256", "--n", n, "--k", "7168", "--dtype", dtype]);
        step("bench gemm", &cargo, &args, &[])?;
    }
    for dtype in ["bf16", "f32"] {
        let mut args = kda.to_vec();
        args.extend(["bench", "quant", "--m", "256", "--k", "7168", "--dtype", dtype]);
        step("bench quant", &cargo, &args, &[])?;
    }
    let mut args = kda.to_vec();
    args.extend(["bench", "mx-gemm", "--m", "256", "--n", "4608", "--k", "7168"]);
    step("bench mx-gemm", &cargo, &args, &[])?;
    let mut args = kda.to_vec();
    args.extend(["bench", "launch"]);
    step("bench launch", &cargo, &args, &[])?;
    for threads in ["1", "2"] {
        let mut args = kda.to_vec();
        args.extend([
            "bench",
            "core",
            "--t",
            "4096",
            "--heads",
            "12",
            "--dim",
            "128",
            "--threads",
            threads,
        ]);
        step("bench core", &cargo, &args, &[])?;
    }
    let mut args = kda.to_vec();
    args.extend(["bench", "schedule"]);
    step("bench schedule", &cargo, &args, &[])?;
    // The whole layer, one core per stream, with the figures table (every figure a ratio of
    // rates measured in the same run); then the decode step with both cores on every op.
    let mut args = kda.to_vec();
    args.extend(["bench", "layer"]);
    step("bench layer", &cargo, &args, &[])?;
    let mut args = kda.to_vec();
    args.extend([
        "bench",
        "layer",
        "--threads",
        "2",
        "--no-kernels",
        "--prefill-len",
        "64",
        "--repeats",
        "1",
    ]);
    step("bench layer (2 threads per op)", &cargo, &args, &[])?;
    peer::compare()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_add_up_across_summaries() {
        let mut c = Counts::default();
        add_counts(
            &mut c,
            "ok. 26 passed; 0 failed; 1 ignored; 0 measured; 0 filtered out; finished in 7.07s",
        );
        add_counts(
            &mut c,
            "FAILED. 3 passed; 2 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.5s",
        );
        assert_eq!((c.passed, c.failed, c.ignored), (29, 2, 1));
    }
}
