//! `kda info`: every backend kda knows, each with its capabilities or the reason it cannot
//! start here; the reference backend in both of its execution modes.

use kda_ascend::AscendBackend;
use kda_cuda::CudaBackend;
use kda_reference::{ExecutionMode, ReferenceBackend, ReferenceOptions};

use super::backend::{self, BackendKind};
use crate::error::CliError;

pub fn run() -> Result<(), CliError> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!("kda {} — backends:", env!("CARGO_PKG_VERSION"));
    for kind in BackendKind::ALL {
        match kind {
            BackendKind::Reference => {
                let modes =
                    [ExecutionMode::PerStream, ExecutionMode::SharedPool { threads: cores }];
                for mode in modes {
                    let options = ReferenceOptions { mode, ..ReferenceOptions::default() };
                    let device = ReferenceBackend::with_options(options)?;
                    println!("  {}", backend::capabilities(&device));
                }
            }
            BackendKind::Ascend => println!("  {}", backend::describe::<AscendBackend>()),
            BackendKind::Cuda => println!("  {}", backend::describe::<CudaBackend>()),
        }
    }
    println!("host cores: {cores}");
    Ok(())
}
