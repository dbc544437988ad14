//! `kda-testkit`: what kda's tests share, so every crate checks numbers the same way.
//!
//! - [`tolerance`]: [`Tolerance`] (relative + absolute, per dtype, NaN/Inf-aware) and the
//!   [`Mismatches`] report that names the first offending elements;
//! - [`generate`]: [`Gen`], seeded inputs that reproduce bit-for-bit on every machine;
//! - [`oracle`]: slow, obviously-correct f64 formulations to check the reference against;
//! - [`oracle_kda`]: the same for the KDA core (conv, norms, gates, the recurrence);
//! - [`checkpoint`]: synthetic HF-style KDA checkpoints (any preset or scaled-down config,
//!   generated lazily region by region, or written to a directory).
//!
//! - [`conformance`]: the backend conformance suite, test bodies generic over `Backend` that
//!   each backend crate instantiates with [`conformance_tests!`].

pub mod checkpoint;
#[allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "test bodies fail by panicking"
)]
pub mod conformance;
pub mod generate;
pub mod oracle;
pub mod oracle_kda;
pub mod tolerance;

pub use generate::Gen;
pub use tolerance::{AsF64, Mismatches, Tolerance};
