//! One module per `kda` subcommand, plus what they share.

pub mod backend;
pub mod bench;
pub mod check;
pub mod core;
pub mod info;
pub mod layer;
pub mod layer_bench;
pub mod model;
pub mod openblas;
pub mod perf_table;
pub mod plan;
pub mod precision;
pub mod quant;
pub mod run;
pub mod schedule;
pub mod tensor_file;
pub mod trace;

use std::time::{Duration, Instant};

use kda_core::{Backend, DType, Device, Tensor};
use kda_synth::Gen;

use crate::error::CliError;

/// Allocate a tensor and fill it with seeded uniform values in [-1, 1).
pub fn random_tensor<B: Backend>(
    device: &Device<B>,
    stream: &B::Stream,
    rng: &mut Gen,
    dtype: DType,
    shape: &[usize],
) -> Result<Tensor<B>, CliError> {
    let t = device.alloc(dtype, shape)?;
    let n = t.numel();
    match dtype {
        DType::BF16 => device.upload(stream, &t, &rng.uniform_bf16(n, -1.0, 1.0))?,
        DType::F32 => device.upload(stream, &t, &rng.uniform_f32(n, -1.0, 1.0))?,
        other => {
            return Err(CliError::Argument {
                arg: "dtype",
                reason: format!("{other} is not generated"),
            });
        }
    }
    Ok(t)
}

/// Time `f` `repeats` times (after one warm-up call) and return the median.
pub fn median_time<E>(repeats: usize, mut f: impl FnMut() -> Result<(), E>) -> Result<Duration, E> {
    f()?;
    let mut times = Vec::with_capacity(repeats.max(1));
    for _ in 0..repeats.max(1) {
        let start = Instant::now();
        f()?;
        times.push(start.elapsed());
    }
    times.sort();
    Ok(times[times.len() / 2])
}

/// A progress bar on stderr for `len` steps of `unit` (hidden when stderr is not a terminal).
pub fn progress_bar(len: u64, unit: &str) -> indicatif::ProgressBar {
    let style = indicatif::ProgressStyle::with_template(&format!(
        "{{elapsed_precise}} [{{bar:30}}] {{pos}}/{{len}} {unit} {{msg}}"
    ))
    .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar());
    indicatif::ProgressBar::new(len).with_style(style)
}

/// Write `value` as pretty JSON to `path` (atomically).
pub fn write_json(path: &std::path::Path, value: &serde_json::Value) -> Result<(), CliError> {
    let io = |source| CliError::Io { action: "write", path: path.display().to_string(), source };
    let text = serde_json::to_string_pretty(value).map_err(|e| io(std::io::Error::other(e)))?;
    crate::fsio::write_atomic(path, (text + "\n").as_bytes())
}

/// Milliseconds, for reports.
pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Operand dtype of the benchmarks' inputs (`kda bench gemm`, `kda bench core`).
#[derive(Copy, Clone, Debug, clap::ValueEnum)]
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
