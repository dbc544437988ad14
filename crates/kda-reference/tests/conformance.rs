//! The backend conformance suite on the reference backend, in both execution modes.
#![allow(clippy::expect_used, reason = "test setup")]

use std::time::Duration;

use kda_core::Device;
use kda_core::sanitize::checked_from_env;
use kda_reference::{ExecutionMode, Jitter, ReferenceBackend, ReferenceOptions, WaitStrategy};

/// Checked mode is on in these tests unless `KDA_SANITIZE=0` says otherwise.
fn backend(mode: ExecutionMode, jitter: Option<Jitter>) -> Device<ReferenceBackend> {
    waiting(mode, jitter, WaitStrategy::Block)
}

fn waiting(
    mode: ExecutionMode,
    jitter: Option<Jitter>,
    wait: WaitStrategy,
) -> Device<ReferenceBackend> {
    let checked = checked_from_env(true);
    let options = ReferenceOptions { mode, jitter, checked, timeline: false, wait };
    ReferenceBackend::with_options(options).expect("reference backend")
}

/// Always checked: the sanitizer's own tests.
fn checked(mode: ExecutionMode) -> Device<ReferenceBackend> {
    let options = ReferenceOptions { mode, checked: true, ..ReferenceOptions::default() };
    ReferenceBackend::with_options(options).expect("reference backend")
}

const JITTER: Jitter = Jitter { seed: 0x5eed, max: Duration::from_micros(150) };

mod per_stream {
    use super::*;
    kda_testkit::conformance_tests!(
        plain: || backend(ExecutionMode::PerStream, None),
        jittered: || backend(ExecutionMode::PerStream, Some(JITTER)),
        checked: || checked(ExecutionMode::PerStream),
    );
}

mod shared_pool {
    use super::*;
    kda_testkit::conformance_tests!(
        plain: || backend(ExecutionMode::SharedPool { threads: 2 }, None),
        jittered: || backend(ExecutionMode::SharedPool { threads: 2 }, Some(JITTER)),
        checked: || checked(ExecutionMode::SharedPool { threads: 2 }),
    );
}

/// The opt-in forecast waiter (what `kda run` and the benchmarks use): the stream and schedule
/// bodies, whose event orders it must keep.
mod per_stream_forecast {
    use super::*;
    const FORECAST: WaitStrategy = WaitStrategy::Forecast;
    kda_testkit::conformance_streams!(
        || waiting(ExecutionMode::PerStream, None, FORECAST),
        || waiting(ExecutionMode::PerStream, Some(JITTER), FORECAST),
        || checked(ExecutionMode::PerStream)
    );
    kda_testkit::conformance_schedule!(
        || waiting(ExecutionMode::PerStream, None, FORECAST),
        || waiting(ExecutionMode::PerStream, Some(JITTER), FORECAST),
        || {
            let options = ReferenceOptions { checked: true, wait: FORECAST, ..Default::default() };
            ReferenceBackend::with_options(options).expect("reference backend")
        }
    );
}
