//! `kda info`: what this build can run on.

use kda_reference::{ExecutionMode, ReferenceBackend, ReferenceOptions};

use crate::error::CliError;

pub fn run() -> Result<(), CliError> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!("kda {} — backends compiled in:", env!("CARGO_PKG_VERSION"));
    let modes = [ExecutionMode::PerStream, ExecutionMode::SharedPool { threads: cores }];
    for mode in modes {
        let backend = ReferenceBackend::with_options(ReferenceOptions {
            mode,
            ..ReferenceOptions::default()
        })?;
        let info = backend.info();
        let caps = &info.capabilities;
        let dtypes: Vec<_> = caps.gemm_inputs.iter().map(|d| d.name()).collect();
        println!(
            "  {:<10} mode: {:<20} threads/op: {:<3} concurrent streams: {}  shared matrix units: {}  gemm inputs: {}",
            info.name,
            caps.execution,
            caps.threads,
            yes_no(caps.concurrent_streams),
            yes_no(caps.shared_matrix_units),
            dtypes.join(", "),
        );
    }
    println!("host cores: {cores}");
    Ok(())
}

fn yes_no(b: bool) -> &'static str {
    if b { "yes" } else { "no" }
}
