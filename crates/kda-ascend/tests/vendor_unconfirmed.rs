//! A CANN release whose vendor-op prototypes are not confirmed (an install record saying
//! CANN 8.3, in a test binary of its own: the release is read once per process): the ops are
//! present, but the backend does not call them — `kda info` says why — and a `KdaChunk` the
//! vendor op would take runs on the project's kernel, equal to the reference
//! (`docs/ascend.md`, vendor operators).
#![cfg(feature = "emulated")]
#![allow(clippy::expect_used, clippy::unwrap_used, reason = "tests")]

mod support;

use kda_ascend::{AscendBackend, AscendOptions};
use kda_core::kda::CHUNK_SIZE;
use kda_reference::ReferenceBackend;
use kda_testkit::oracle_kda::{max_abs, recurrence_tolerance};
use support::run;

#[test]
fn an_unconfirmed_prototype_runs_the_projects_kernel_and_info_says_why() {
    let root = std::env::temp_dir().join(format!("kda-cann83-{}", std::process::id()));
    let record = root.join(format!("{}-linux", std::env::consts::ARCH));
    std::fs::create_dir_all(&record).unwrap();
    std::fs::write(record.join("ascend_ops_install.info"), "version=8.3.RC1\n").unwrap();
    // SAFETY: the only test of this binary sets the variables before anything reads them.
    unsafe {
        std::env::set_var("ASCEND_TOOLKIT_HOME", &root);
        std::env::remove_var("KDA_ASCEND_VENDOR_OPS");
    }
    let options = AscendOptions { checked: false, ..AscendOptions::default() };
    let b = AscendBackend::with_options(options).expect("ascend backend over the emulated runtime");
    assert!(b.raw().absent_symbols().iter().all(|s| !s.contains("Kda")), "the ops are present");
    let caps = b.info().capabilities;
    assert!(!caps.bf16_core, "no bf16 core without the vendor op");
    assert!(
        caps.execution.contains(
            "kda kernels instead: aclnnChunkKdaFwd's prototype is not confirmed for CANN 8.3"
        ),
        "{}",
        caps.execution
    );
    assert!(
        caps.execution.contains("aclnnRecurrentGatedDeltaRule's prototype"),
        "{}",
        caps.execution
    );
    let (o, state) = run(&b);
    let calls = kda_acl_emu::calls_of_this_thread();
    assert!(calls.iter().all(|c| c.api != "aclnnChunkKdaFwd"), "no vendor call");
    assert!(calls.iter().any(|c| c.api == "kda_chunk_prefill"), "the project's kernel ran");
    let (o_ref, state_ref) = run(&ReferenceBackend::new());
    // The kernel's own arithmetic (executed under the AscendC twin) against the reference's:
    // equal within the recurrence's fp32 rounding bound, as in the conformance suite.
    let tol = |want: &[f32]| {
        let wide: Vec<f64> = want.iter().map(|&v| f64::from(v)).collect();
        recurrence_tolerance(90, 16, CHUNK_SIZE, max_abs(&wide))
    };
    tol(&o_ref).assert_close(&[90, 2, 16], &o, &o_ref);
    tol(&state_ref).assert_close(&[2, 2, 16, 16], &state, &state_ref);
    let _ = std::fs::remove_dir_all(&root);
}
