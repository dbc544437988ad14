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
        "95% CI",
        "of ideal",
        "speedup",
        "composed vs staged F",
        "identical bit for bit",
        "summary",
    ] {
        assert!(out.contains(needle), "missing {needle:?} in:\n{out}");
    }
}

/// The decode step's compute floor counts the MXFP8 QKV GEMM's multiply-adds from the op log:
/// on the tiny preset, 4 tokens × hidden 256 × (q, k, v: 3 × 4 heads × 32) = 393 216.
#[test]
fn bench_layer_reports_the_decode_compute_floor() {
    let o = kda(&[
        "bench",
        "layer",
        "--preset",
        "tiny",
        "--prefill-len",
        "8",
        "--decode-batch",
        "4",
        "--repeats",
        "1",
        "--decode-repeats",
        "1",
        "--rounds",
        "1",
        "--no-kernels",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    let expected = format!("decode compute floor: {:.3e} exact MXFP8 multiply-adds", 4 * 256 * 384);
    assert!(out.contains(&expected), "missing {expected:?} in:\n{out}");
    for needle in ["G/s per core (measured)", "x the compute floor)", "decode step (4 x 1 token)"] {
        assert!(out.contains(needle), "missing {needle:?} in:\n{out}");
    }
}

#[test]
fn bench_without_a_subcommand_runs_the_matrix_and_writes_json() {
    let dir = common::TempDir::new("bench-json");
    let path = dir.path("bench.json");
    let file = path.to_str().expect("utf-8 path");
    let o = kda(&["bench", "--tokens", "1,2", "--repeats", "1", "--json", file]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("summary"), "{}", stdout(&o));
    let text = std::fs::read_to_string(&path).expect("the JSON file");
    let json: serde_json::Value = serde_json::from_str(&text).expect("valid JSON");
    let results = json["results"].as_array().expect("results");
    assert_eq!(
        results.iter().map(|r| r["tokens"].as_u64()).collect::<Vec<_>>(),
        [Some(1), Some(2)]
    );
    for r in results {
        for key in ["serial", "overlapped, GEMMs serialized", "overlapped, GEMMs concurrent"] {
            assert!(r["wall_ms"][key].as_f64().is_some_and(|v| v > 0.0), "{key} in {r}");
        }
        let f = r["hidden_vector_fraction"].as_f64().expect("fraction");
        assert!((0.0..=1.0).contains(&f), "{f}");
    }
}

#[test]
fn errors_are_one_line_and_logging_flags_parse() {
    let o = kda(&["-q", "run", "--preset", "tiny", "--checkpoint", "/nonexistent/kda"]);
    assert!(!o.status.success());
    let err = stderr(&o);
    assert!(err.starts_with("error: ") && err.contains("/nonexistent/kda"), "{err}");
    let o = kda(&["-vv", "info"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = kda(&["-v", "-q", "info"]);
    assert!(!o.status.success(), "-v and -q conflict");
}

#[test]
fn bad_arguments_fail_with_a_message() {
    for (args, needle) in [
        (&["bench", "gemm", "--threads", "0"][..], "--threads"),
        (&["bench", "schedule", "--tokens", "0"][..], "--tokens"),
        (&["bench", "schedule", "--scale-alg", "2"][..], "--scale-alg"),
    ] {
        let o = kda(args);
        assert!(!o.status.success(), "{args:?} should fail");
        assert!(stderr(&o).contains(needle), "{args:?}: {}", stderr(&o));
    }
}
