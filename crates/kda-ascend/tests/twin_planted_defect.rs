//! The emulated backend runs the kernels' own code: a copy of `kda_gate.cpp` with one
//! arithmetic defect planted (softplus's `+ 1` made `+ 1.001`), built through the twin into a
//! kernel binary the backend loads, fails the gate's conformance body; the unchanged source,
//! built the same way, passes it.
#![cfg(feature = "emulated")]
#![allow(clippy::expect_used, clippy::unwrap_used, reason = "tests")]

use std::path::PathBuf;

use kda_acl_emu::twin::{Library, kernels_dir};
use kda_ascend::{AscendBackend, AscendOptions};

/// A kernel binary holding `kda_gate` built from its source with `edit` applied.
fn gate_binary(tag: &str, edit: impl Fn(&str) -> String) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kda-twin-defect-{}-{tag}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let source = std::fs::read_to_string(kernels_dir().join("kda_gate.cpp")).unwrap();
    let copy = dir.join("kda_gate.cpp");
    std::fs::write(&copy, edit(&source)).unwrap();
    let out = std::path::absolute(dir.join("kda_kernels.so")).unwrap();
    Library::build(&[copy], &[], &out).unwrap();
    out
}

fn gate_conformance_passes(binary: PathBuf) -> bool {
    let make = move || {
        let options = AscendOptions {
            checked: false,
            kernels: Some(binary.clone()),
            ..AscendOptions::default()
        };
        AscendBackend::with_options(options).expect("ascend backend")
    };
    std::panic::catch_unwind(|| {
        kda_testkit::conformance::kda::gate_forms_match_f64_at_extremes(&make)
    })
    .is_ok()
}

#[test]
fn a_planted_arithmetic_defect_fails_conformance() {
    const RIGHT: &str = "Adds(tv, tv, 1.0f, dim);";
    let planted = gate_binary("planted", |s| {
        assert!(s.contains(RIGHT), "the softplus step moved: update the planted defect");
        s.replace(RIGHT, "Adds(tv, tv, 1.001f, dim);")
    });
    assert!(!gate_conformance_passes(planted), "conformance passed a defective gate kernel");
    let unchanged = gate_binary("unchanged", str::to_string);
    assert!(gate_conformance_passes(unchanged), "the unchanged gate kernel failed conformance");
}
