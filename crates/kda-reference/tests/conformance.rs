//! The backend conformance suite on the reference backend, in both execution modes.
#![allow(clippy::expect_used, reason = "test setup")]

use std::time::Duration;

use kda_core::Device;
use kda_core::sanitize::checked_from_env;
use kda_reference::{ExecutionMode, Jitter, ReferenceBackend, ReferenceOptions};

/// Checked mode is on in these tests unless `KDA_SANITIZE=0` says otherwise.
fn backend(mode: ExecutionMode, jitter: Option<Jitter>) -> Device<ReferenceBackend> {
    let options =
        ReferenceOptions { mode, jitter, checked: checked_from_env(true), timeline: false };
    ReferenceBackend::with_options(options).expect("reference backend")
}

/// Always checked: the sanitizer's own tests.
fn checked(mode: ExecutionMode) -> Device<ReferenceBackend> {
    let options = ReferenceOptions { mode, jitter: None, checked: true, timeline: false };
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
