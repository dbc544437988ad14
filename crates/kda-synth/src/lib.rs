//! `kda-synth`: deterministic synthetic checkpoints, workloads and data — the embedded default
//! of `kda run`, and the inputs kda's tests and benchmarks are generated from.
//!
//! - [`generate`]: [`Gen`], seeded values that reproduce bit for bit on every machine;
//! - [`checkpoint`]: synthetic HF-style KDA checkpoints (any preset or scaled-down config,
//!   generated lazily region by region, or written to a directory);
//! - [`workload`]: the deterministic prefill-then-decode batches and inputs `kda run` drives.
//!
//! Product code, not test code: the CLI runs on it, so it holds no assertions about results
//! (those are `kda-testkit`'s, which re-exports these modules).

pub mod checkpoint;
pub mod generate;
pub mod workload;

pub use generate::Gen;
