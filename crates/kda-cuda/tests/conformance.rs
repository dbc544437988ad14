//! The backend conformance suite (`kda_testkit::conformance_tests!`) on kda-cuda.
//!
//! A `harness = false` target: `kda_cuda_trials::test` turns every `#[test]` the macro expands
//! to into a registered trial, and `kda_cuda_trials::run` runs them (libtest-mimic, any number of
//! name filters). Without a CUDA device (or without
//! the `cuda` feature) every trial is reported as ignored, by name and counted, never as
//! passed; `--include-ignored` runs them anyway and each fails with the reason.
#![allow(clippy::expect_used, clippy::unwrap_used, reason = "test setup")]

use kda_core::Device;
use kda_core::sanitize::checked_from_env;
use kda_cuda::{CudaBackend, CudaOptions};

/// Checked mode is on unless `KDA_SANITIZE=0` says otherwise (as on the reference).
fn plain() -> Device<CudaBackend> {
    let options = CudaOptions { checked: checked_from_env(true), ..CudaOptions::default() };
    CudaBackend::with_options(options).expect("CUDA backend")
}

/// Always checked: the sanitizer's own tests.
fn checked() -> Device<CudaBackend> {
    CudaBackend::with_options(CudaOptions { checked: true, ..CudaOptions::default() })
        .expect("CUDA backend")
}

mod suite {
    use super::{checked, plain};
    use kda_cuda_trials::test;

    // The GPU has no jitter hook: real streams on real hardware already interleave.
    kda_testkit::conformance_tests!(plain: plain, jittered: plain, checked: checked);
}

fn main() {
    let unavailable = CudaBackend::new().err().map(|e| e.to_string());
    if let Some(why) = &unavailable {
        eprintln!("kda-cuda conformance: every trial is ignored: {why}");
    }
    kda_cuda_trials::run(kda_cuda_trials::registered(unavailable.as_deref()));
}
