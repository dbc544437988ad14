//! The device half of `cargo xtask gpu-check`.
//!
//! `cargo run --release -p kda-cuda --example gpu_bench -- [--out PATH] [--quick]` writes one
//! JSON report (`--out`, default `$OUT/gpu-bench.json` or `gpu-bench.json`): the device and the
//! paths in effect, captures checked at K3 TP8 shapes (the overlapped projection against serial
//! under capture, checked and as CUDA graphs; a whole-layer decode step as a CUDA graph against
//! eager), and what the fast paths change against the spec paths (the MXFP8 GEMM in f32 bits,
//! the tensor-core chunked prefill against the token-by-token kernel, with one timing each).
//!
//! `--probe` writes only the first part (the device, the libraries and kernels it loaded, the
//! paths in effect): what gpu-check asks first, in seconds, before anything slow.
//!
//! `--serve` measures for gpu-check's interleaved comparison instead (see `serve.rs`).
//!
//! `--write-cubins DIR [ARCH]` compiles every kernel with NVRTC (no GPU needed) into `DIR` for
//! `KDA_CUDA_CUBIN_DIR` (default architecture sm_90, the H200's).
#![allow(clippy::expect_used, reason = "a benchmark driver: setup failures end the run")]

mod checks;
mod data;
mod serve;

use std::path::PathBuf;

use kda_core::Result;
use kda_cuda::{CudaBackend, CudaOptions, FastPaths};
use serde_json::{Value, json};

/// One part of the report.
type Part = Box<dyn Fn() -> Result<Value>>;

fn main() {
    let mut args = std::env::args().skip(1);
    let mut out = std::env::var_os("OUT")
        .map(|d| PathBuf::from(d).join("gpu-bench.json"))
        .unwrap_or_else(|| "gpu-bench.json".into());
    let (mut quick, mut probe) = (false, false);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--out" => out = args.next().map(PathBuf::from).expect("--out needs a path"),
            "--quick" => quick = true,
            "--probe" => probe = true,
            "--serve" => std::process::exit(serve::serve()),
            "--write-cubins" => {
                let dir = PathBuf::from(args.next().expect("--write-cubins needs a directory"));
                let arch = args.next().unwrap_or_else(|| kda_cuda::kernels::CHECK_ARCH.into());
                write_cubins(&dir, &arch);
                return;
            }
            other => {
                eprintln!(
                    "gpu_bench: unknown argument {other}; usage: gpu_bench [--out PATH] [--quick] \
                     [--probe] | --serve | --write-cubins DIR [ARCH]"
                );
                std::process::exit(2);
            }
        }
    }
    // Each part is written as soon as it is done, so a run cut short keeps what it measured;
    // the most telling first: what loaded, the tensor-core chunk against the token-by-token
    // kernel, a decode step as a CUDA graph against eager, the fast MX GEMM, the captures.
    let mut report = serde_json::Map::new();
    let mut failed = false;
    let parts: Vec<(&str, Part)> = vec![
        ("device", Box::new(device)),
        (
            "chunk_tensor_cores_vs_token_by_token",
            Box::new(move || checks::chunk_delta(if quick { 2048 } else { 8192 }, 12)),
        ),
        ("layer_decode_graph", Box::new(checks::layer_decode_graph)),
        (
            "mx_gemm_fast_vs_exact",
            Box::new(move || checks::mx_gemm_delta(if quick { 32 } else { 128 })),
        ),
        ("capture_bf16", Box::new(|| checks::captures(false))),
        ("capture_mxfp8", Box::new(|| checks::captures(true))),
    ];
    let parts = parts.into_iter().take(if probe { 1 } else { usize::MAX });
    for (name, part) in parts {
        eprintln!("gpu_bench: {name}");
        let value = part().unwrap_or_else(|e| {
            failed = true;
            eprintln!("gpu_bench: {name}: {e}");
            json!({ "error": e.to_string() })
        });
        report.insert(name.into(), value);
        let text = serde_json::to_string_pretty(&report).expect("a JSON value serialises");
        if let Err(e) = std::fs::write(&out, &text) {
            eprintln!("gpu_bench: cannot write {}: {e}", out.display());
            std::process::exit(1);
        }
    }
    println!("{}", serde_json::to_string_pretty(&report).expect("a JSON value serialises"));
    if failed {
        std::process::exit(1);
    }
}

/// The device, the libraries and the paths in effect.
fn device() -> Result<Value> {
    let b =
        CudaBackend::with_options(CudaOptions { fast: FastPaths::ALL, ..CudaOptions::default() })?;
    let fast = b.raw().fast_paths();
    let kernels = match std::env::var_os(kda_cuda::kernels::CUBIN_DIR_VAR) {
        Some(dir) => format!("prebuilt CUBINs in {}", PathBuf::from(dir).display()),
        None => format!("compiled here by {}", kda_cuda::nvrtc::library().unwrap_or_default()),
    };
    Ok(json!({
        "name": b.raw().device_name(),
        "cublas": b.raw().cublas_library(),
        "kernels": kernels,
        "memory_pool": b.raw().uses_memory_pool(),
        "fast_paths_available": { "mx_gemm": fast.mx_gemm, "chunk": fast.chunk },
    }))
}

fn write_cubins(dir: &std::path::Path, arch: &str) {
    let nvrtc = match kda_cuda::nvrtc::library() {
        Ok(library) => library,
        Err(why) => {
            eprintln!("gpu_bench: {why}");
            std::process::exit(1);
        }
    };
    eprintln!("gpu_bench: compiling the kernels for {arch} with {nvrtc}");
    std::fs::create_dir_all(dir).expect("create the CUBIN directory");
    // Which NVRTC built them: a CUDA 13 NVRTC's CUBINs need a CUDA 13 driver.
    std::fs::write(dir.join("nvrtc.txt"), format!("{nvrtc}\n")).expect("write nvrtc.txt");
    for source in kda_cuda::kernels::SOURCES {
        let cubin = kda_cuda::nvrtc::compile(&source, arch).expect("NVRTC compiles the kernels");
        let path = dir.join(kda_cuda::kernels::cubin_file(&source, arch));
        std::fs::write(&path, cubin).expect("write a CUBIN");
        println!("{}", path.display());
    }
}
