//! NVRTC compile check of every kernel source with the backend's own options: to CUBIN for
//! sm_90 (exactly what the backend loads on an H200) and to compute_90 PTX, whose entries must
//! include every kernel the backend looks up.
//!
//! Runs wherever libnvrtc can be loaded (the CUDA toolkit, or the `nvidia-cuda-nvrtc-cu12` or
//! `nvidia-cuda-nvrtc` (CUDA 13) wheel, found as `kda_cuda::libs` searches); elsewhere each
//! trial is reported ignored, by name. No GPU is needed.
#![allow(clippy::expect_used, clippy::unwrap_used, reason = "test setup")]

use kda_cuda::kernels::{CHECK_ARCH, CHECK_PTX_ARCH, COMMON, KernelSource, SOURCES};
use kda_cuda::nvrtc;
use kda_cuda_trials::{Failed, Trial};

/// Compile one source to CUBIN and to PTX; every kernel it lists must be a PTX entry.
fn compiles(source: KernelSource) -> Result<(), Failed> {
    let cubin = nvrtc::compile(&source, CHECK_ARCH)?;
    if !cubin.starts_with(b"\x7fELF") {
        return Err(format!("{}: the {CHECK_ARCH} output is not an ELF cubin", source.name).into());
    }
    let ptx = String::from_utf8(nvrtc::compile(&source, CHECK_PTX_ARCH)?)?;
    for f in source.functions {
        if !ptx.contains(&format!(".entry {f}(")) {
            return Err(format!("{}: no PTX entry for {f}", source.name).into());
        }
    }
    Ok(())
}

/// The check can fail: a kernel with a type error is rejected, with NVRTC's log.
fn rejects_a_broken_kernel() -> Result<(), Failed> {
    let body = "extern \"C\" __global__ void broken(View v) { v.no_such_field = 1; }\n";
    let broken = KernelSource { name: "broken.cu", body, functions: &["broken"] };
    match nvrtc::compile(&broken, CHECK_ARCH) {
        Ok(_) => Err("a kernel with a type error compiled".into()),
        Err(e) if e.to_string().contains("no_such_field") => Ok(()),
        Err(e) => Err(format!("rejected, but the log does not name the error: {e}").into()),
    }
}

fn main() {
    let present = nvrtc::present();
    match nvrtc::library() {
        Ok(library) => eprintln!("kda-cuda nvrtc: {library}"),
        Err(why) => eprintln!("kda-cuda nvrtc: every trial is ignored: {why}"),
    }
    assert!(!COMMON.is_empty());
    let mut trials: Vec<Trial> = SOURCES
        .into_iter()
        .map(|source| {
            let name = format!("nvrtc_compiles_{}", source.name.replace('.', "_"));
            Trial::test(name, move || compiles(source)).with_ignored_flag(!present)
        })
        .collect();
    trials.push(
        Trial::test("nvrtc_rejects_a_broken_kernel", rejects_a_broken_kernel)
            .with_ignored_flag(!present),
    );
    kda_cuda_trials::run(trials);
}
