//! Checked mode and graph capture, for every backend at once.
//!
//! Every stream verb of the [`Device`](crate::device::Device) façade goes through its
//! instance's recorder. In checked mode it records each launch, record, wait, synchronize, allocation, free and reuse into a
//! [`log`](Entry) and runs the happens-before [`analysis`] online: an op that would race with
//! work on another stream is **not run**, and its launch returns [`Error::Hazard`](crate::Error::Hazard) naming both
//! ops, both streams, the buffer and the bytes (the rejected op stays in the log, as the call the
//! program made). Capture (turning work on captured streams into
//! [`Graph`](crate::graph::Graph) nodes) lives with the façade too; this module is the analysis:
//! the log's entries, the vector-clock happens-before, the hazards, byte ranges.
//!
//! Optionally ([`ExclusiveUnits`], per instance) it also reports two matrix (or vector) ops on
//! different streams that nothing orders, for backends whose streams share those units.
//!
//! Checked mode is chosen per backend instance; `KDA_SANITIZE=1` (or `0`) overrides the
//! default. When neither checked mode nor a capture is on, each verb pays one relaxed atomic
//! load.

pub mod analysis;
pub mod hazard;
pub mod log;
pub mod ranges;

pub use analysis::{Analyzer, ExclusiveUnits, analyze, analyze_with};
pub use hazard::{Hazard, HazardKind, HazardSide};
pub use log::{Access, Entry, OpRef};
pub use ranges::ByteRanges;

/// The environment variable that turns checked mode on (`1`) or off (`0`) for every instance.
pub const SANITIZE_ENV: &str = "KDA_SANITIZE";

/// Whether checked mode is on: `KDA_SANITIZE` if set to `0`/`1`, else `default`.
pub fn checked_from_env(default: bool) -> bool {
    match std::env::var(SANITIZE_ENV).as_deref() {
        Ok("1") | Ok("true") | Ok("on") => true,
        Ok("0") | Ok("false") | Ok("off") => false,
        _ => default,
    }
}
