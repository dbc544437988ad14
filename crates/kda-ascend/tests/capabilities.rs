//! An installation without the MXFP8 ops (an emulated Ascend 910B3, as CANN for A2/A3): the
//! absent symbols are reported as capabilities, the MX GEMM takes the bf16 path, and asking for
//! the native path names what is missing. In its own binary: the emulated SoC is chosen once per
//! process.
#![cfg(feature = "emulated")]
#![allow(clippy::expect_used, clippy::unwrap_used, reason = "tests")]

use kda_ascend::{AscendBackend, AscendError, AscendOptions, MxGemmPath, sys};
use kda_core::Backend;

#[test]
fn absent_mx_ops_are_reported_and_the_mx_path_follows_them() {
    // SAFETY: the only test of this binary sets the variable before anything reads it.
    unsafe { std::env::set_var("KDA_ACL_EMU_SOC", "Ascend910B3") };
    let options = |mx_gemm| AscendOptions { checked: false, mx_gemm, ..AscendOptions::default() };
    let b = AscendBackend::with_options(options(MxGemmPath::Auto)).unwrap();
    assert_eq!(b.raw().absent_symbols(), sys::MX_SYMBOLS);
    assert!(!b.raw().native_mx(), "the MX ops are absent: the bf16 path");
    let execution = b.raw().info().capabilities.execution;
    assert!(execution.contains("absent: aclnnDynamicMxQuantV3GetWorkspaceSize"), "{execution}");
    match AscendBackend::with_options(options(MxGemmPath::Native)) {
        Err(AscendError::Unsupported { op, message }) => {
            assert_eq!(op, "MxGemmPath::Native");
            assert!(message.contains("aclnnQuantMatmulV5"), "{message}");
        }
        other => panic!("expected the native path refused, got {:?}", other.map(|_| ())),
    }
}
