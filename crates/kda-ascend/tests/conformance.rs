//! The backend conformance suite (streams, GEMMs, views, sanitizer, KDA ops, MX, both
//! schedules, the layer) on kda-ascend, compared with the reference: over the emulated ACL
//! runtime (feature `emulated`; `cargo xtask test` enables it) or on an NPU (feature `acl`;
//! `cargo xtask test --backend ascend`, `cargo xtask npu-check`).
#![cfg(any(feature = "acl", feature = "emulated"))]
#![allow(clippy::expect_used, reason = "test setup")]

use kda_ascend::{AscendBackend, AscendOptions};
use kda_core::Device;
use kda_core::sanitize::checked_from_env;

/// Checked mode is on unless `KDA_SANITIZE=0` says otherwise, as for the reference.
fn backend(checked: bool) -> Device<AscendBackend> {
    let options = AscendOptions { checked, ..AscendOptions::default() };
    AscendBackend::with_options(options).expect("ascend backend")
}

// The emulated runtime injects no delays: the jittered factory is a plain one.
kda_testkit::conformance_tests!(
    plain: || backend(checked_from_env(true)),
    jittered: || backend(checked_from_env(true)),
    checked: || backend(true),
);
