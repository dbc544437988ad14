//! `kda-testkit`: what kda's tests share, so every crate checks numbers the same way.
//!
//! - [`tolerance`]: [`Tolerance`] (relative + absolute, per dtype, NaN/Inf-aware) and the
//!   [`Mismatches`] report that names the first offending elements;
//! - [`generate`]: [`Gen`], seeded inputs that reproduce bit-for-bit on every machine
//!   (re-exported from `kda-synth`, as are [`checkpoint`] and [`workload`]);
//! - [`oracle`]: slow, obviously-correct f64 formulations to check the reference against;
//! - [`oracle_kda`]: the same for the KDA core (conv, norms, gates, the recurrence);
//! - [`oracle_layer`]: the whole layer on one rank, in f64, from host weights;
//! - [`checkpoint`]: synthetic HF-style KDA checkpoints (any preset or scaled-down config,
//!   generated lazily region by region, or written to a directory);
//! - [`workload`]: the deterministic prefill-then-decode batches and inputs `kda run` drives.
//!
//! - [`conformance`]: the backend conformance suite, test bodies generic over `Backend` that
//!   each backend crate instantiates with [`conformance_tests!`].

#[allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "test bodies fail by panicking"
)]
pub mod conformance;
pub mod oracle;
pub mod oracle_kda;
#[allow(clippy::expect_used, reason = "an oracle of complete test weights")]
pub mod oracle_layer;
pub mod tolerance;

pub use kda_synth::{Gen, checkpoint, generate, workload};
pub use tolerance::{AsF64, Mismatches, Tolerance};
