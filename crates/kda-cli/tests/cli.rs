//! The `kda` binary end to end: exit codes and the lines a user reads.

mod common;

use common::{kda, stderr, stdout};

#[test]
fn info_lists_the_reference_backend_in_both_modes() {
    let o = kda(&["info"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("one core per stream"), "{out}");
    assert!(out.contains("shared thread pool"), "{out}");
    assert!(out.contains("concurrent streams: yes"), "{out}");
}

#[test]
fn run_reports_both_orders_and_that_they_agree() {
    let o = kda(&["run", "--tokens", "3", "--repeats", "1"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    for needle in [
        "weights: synthetic Kimi K3 checkpoint (seed 0), layer 0, TP 8 rank 0",
        "QKV x[3, 7168] . w[4608, 7168]",
        "BFG x[3, 7168]",
        "serial (one stream)",
        "capture valid (2 streams joined)",
        ", 0 hazards",
        "speedup",
        "identical bit for bit",
    ] {
        assert!(out.contains(needle), "missing {needle:?} in:\n{out}");
    }
}

#[test]
fn bench_gemm_prints_gflops() {
    let o = kda(&[
        "bench",
        "gemm",
        "--m",
        "3",
        "--n",
        "5",
        "--k",
        "7",
        "--dtype",
        "bf16",
        "--repeats",
        "1",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(
        out.contains("gemm m=3 n=5 k=7 dtype=bf16 threads=1") && out.contains("GFLOP/s"),
        "{out}"
    );
}

#[test]
fn bench_schedule_reports_every_figure() {
    let o = kda(&["bench", "schedule", "--tokens", "2", "--repeats", "1"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    for needle in [
        "T=2 (1 timed round)",
        "serial ",
        "overlapped, GEMMs serialized",
        "overlapped, GEMMs concurrent",
        "ops alone: dynamic_quant",
        "hidden vector fraction",
        "overlapped / serial",
        "of ideal",
        "speedup",
        "composed vs staged F",
        "identical bit for bit",
        "summary",
    ] {
        assert!(out.contains(needle), "missing {needle:?} in:\n{out}");
    }
}

#[test]
fn bad_arguments_fail_with_a_message() {
    for (args, needle) in [
        (&["bench", "gemm", "--threads", "0"][..], "--threads"),
        (&["run", "--tokens", "0"][..], "--tokens"),
        (&["bench", "schedule", "--tokens", "0"][..], "--tokens"),
        (&["bench", "schedule", "--scale-alg", "2"][..], "--scale-alg"),
    ] {
        let o = kda(args);
        assert!(!o.status.success(), "{args:?} should fail");
        assert!(stderr(&o).contains(needle), "{args:?}: {}", stderr(&o));
    }
}
