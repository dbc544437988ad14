//! A CANN release without the vendor KDA operators (`KDA_ACL_EMU_VENDOR_OPS=none`, in a test
//! binary of its own: the symbol table is installed once per process): the backend reports them
//! absent and a `KdaChunk` the vendor op would take runs on the project's kernel, equal to the
//! reference (`docs/ascend.md`, vendor operators).
#![cfg(feature = "emulated")]
#![allow(clippy::expect_used, clippy::unwrap_used, reason = "tests")]

mod support;

use kda_ascend::{AscendBackend, AscendOptions};
use kda_core::DType;
use kda_reference::ReferenceBackend;
use kda_testkit::Tolerance;
use kda_testkit::oracle_kda::{max_abs, recurrence_tolerance};
use support::run;

#[test]
fn without_the_vendor_ops_the_chunk_runs_the_projects_kernel() {
    // SAFETY: the only test of this binary sets the variable before anything reads it.
    unsafe { std::env::set_var("KDA_ACL_EMU_VENDOR_OPS", "none") };
    let options = AscendOptions { checked: false, ..AscendOptions::default() };
    let b = AscendBackend::with_options(options).expect("ascend backend over the emulated runtime");
    let absent = b.raw().absent_symbols().to_vec();
    for symbol in ["aclnnChunkKdaFwd", "aclnnRecurrentGatedDeltaRule"] {
        assert!(absent.contains(&symbol), "{symbol} reported absent: {absent:?}");
    }
    let (o, state) = run(&b);
    let calls = kda_acl_emu::calls_of_this_thread();
    assert!(calls.iter().all(|c| c.api != "aclnnChunkKdaFwd"), "no vendor call");
    assert!(calls.iter().any(|c| c.api == "kda_chunk_prefill"), "the project's kernel ran");
    let (o_ref, state_ref) = run(&ReferenceBackend::new());
    // The kernel runs the recurrence token by token (under the twin), the reference in chunks:
    // equal within the recurrence's f32 bound, the bf16 output within one bf16 rounding more.
    let f64s = |v: &[f32]| v.iter().map(|&x| f64::from(x)).collect::<Vec<_>>();
    let (o, o_ref, state, state_ref) = (f64s(&o), f64s(&o_ref), f64s(&state), f64s(&state_ref));
    let rec = |r: &[f64]| recurrence_tolerance(90, 16, 64, max_abs(r));
    let bf16 = Tolerance::for_dtype(DType::BF16);
    bf16.with_abs(bf16.abs + rec(&o_ref).abs).assert_close(&[90, 2, 16], &o, &o_ref);
    rec(&state_ref).assert_close(&[2, 2, 16, 16], &state, &state_ref);
}
