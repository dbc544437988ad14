//! The backend conformance suite on the reference backend, in both execution modes.
#![allow(clippy::expect_used, reason = "test setup")]

use std::time::Duration;

use kda_reference::{ExecutionMode, Jitter, ReferenceBackend, ReferenceOptions};

fn backend(mode: ExecutionMode, jitter: Option<Jitter>) -> ReferenceBackend {
    ReferenceBackend::with_options(ReferenceOptions { mode, jitter }).expect("reference backend")
}

const JITTER: Jitter = Jitter { seed: 0x5eed, max: Duration::from_micros(150) };

mod per_stream {
    use super::*;
    kda_testkit::conformance_tests!(
        plain: || backend(ExecutionMode::PerStream, None),
        jittered: || backend(ExecutionMode::PerStream, Some(JITTER)),
    );
}

mod shared_pool {
    use super::*;
    kda_testkit::conformance_tests!(
        plain: || backend(ExecutionMode::SharedPool { threads: 2 }, None),
        jittered: || backend(ExecutionMode::SharedPool { threads: 2 }, Some(JITTER)),
    );
}
