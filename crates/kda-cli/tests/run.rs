//! `kda run --preset tiny` end to end: the report's fields, and its checksum against the same
//! workload run directly through the library (serial schedule, eager decode steps).
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test setup")]

mod common;

use common::{kda, stderr, stdout};
use half::bf16;
use kda_core::DType;
use kda_model::config::{KdaConfig, Tp};
use kda_model::layer::{KdaLayer, LayerOptions};
use kda_model::schedule::ProjectionSchedule;
use kda_model::weights::{LoadOptions, load_layer};
use kda_reference::ReferenceBackend;
use kda_testkit::checkpoint::{SyntheticCheckpoint, SyntheticSpec, scaled_config};
use kda_testkit::workload::Workload;

/// The f64 sum of every output element of the prefill and then of each decode step.
fn checksum_directly(w: &Workload) -> f64 {
    let config = scaled_config(&KdaConfig::kimi_k3(), 256, 4, 32);
    let checkpoint = SyntheticCheckpoint::new(SyntheticSpec::new(config.clone(), w.seed));
    let weights =
        load_layer(&checkpoint, &config, Tp::SINGLE, 0, LoadOptions::default()).unwrap().weights;
    let b = ReferenceBackend::new();
    let s = b.new_stream().unwrap();
    let options =
        LayerOptions { schedule: Some(ProjectionSchedule::Serial), ..LayerOptions::default() };
    let layer = KdaLayer::new(&b, &s, &weights, options).unwrap();
    let hd = config.hidden_size;
    let mut cache = layer.new_cache(&s, w.requests, 0).unwrap();
    let mut sum = 0.0f64;
    let mut run = |rows: usize, hidden: Vec<bf16>, meta| {
        let x = b.alloc(DType::BF16, &[rows, hd]).unwrap();
        b.upload(&s, &x, &hidden).unwrap();
        let mut out = b.alloc(DType::F32, &[rows, hd]).unwrap();
        layer.forward(&s, &x, &meta, &mut cache, &mut out).unwrap();
        sum += b.download::<f32>(&s, &out).unwrap().iter().map(|&v| f64::from(v)).sum::<f64>();
    };
    run(w.prefill_tokens(), w.prefill_hidden(hd), w.prefill_meta());
    for step in 0..w.decode_steps {
        run(w.requests, w.decode_hidden(step, hd), w.decode_meta(step));
    }
    sum
}

#[test]
fn run_tiny_reports_every_field_and_the_library_checksum() {
    let o = kda(&[
        "run",
        "--preset",
        "tiny",
        "--requests",
        "3",
        "--tokens",
        "70",
        "--decode-steps",
        "4",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    for needle in [
        "layer 0 of the synthetic tiny",
        "TP rank 0 of 1",
        "QKV MXFP8",
        "load: checkpoint read and fused weights composed in",
        "prefill: 3 requests x 70 tokens = 210 tokens",
        "speedup",
        "hidden vector fraction",
        "prefill throughput",
        "op time by stage: projections",
        "o_proj",
        "decode: 4 steps x 3 requests from one captured graph: step latency",
        "identical bit for bit: prefill, 4 decode steps, final states",
        "capture valid (2 streams joined",
        "no hazards",
    ] {
        assert!(out.contains(needle), "missing {needle:?} in:\n{out}");
    }
    let printed: f64 = out
        .lines()
        .find_map(|l| l.trim().strip_prefix("checksum: "))
        .expect("a checksum line")
        .parse()
        .expect("a number");
    let w = Workload { requests: 3, prompt_tokens: 70, decode_steps: 4, seed: 0 };
    let expected = checksum_directly(&w);
    assert!(expected.is_finite() && expected != 0.0);
    // The same outputs summed in the same order: equal to the last bit.
    assert_eq!(printed.to_bits(), expected.to_bits(), "{printed} vs {expected}");
}

#[test]
fn run_serial_only_and_bad_arguments() {
    let o = kda(&[
        "run",
        "--preset",
        "tiny",
        "--schedule",
        "serial",
        "--tokens",
        "9",
        "--decode-steps",
        "1",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(!out.contains("speedup") && out.contains("checksum: "), "{out}");
    for (args, needle) in [
        (&["run", "--tokens", "0"][..], "--tokens"),
        (&["run", "--requests", "0"][..], "--requests"),
        (&["run", "--preset", "tiny", "--tp-size", "3"][..], "3"),
        (&["run", "--checkpoint", "/nonexistent/kda"][..], "/nonexistent/kda"),
    ] {
        let o = kda(args);
        assert!(!o.status.success(), "{args:?} should fail");
        assert!(stderr(&o).contains(needle), "{args:?}: {}", stderr(&o));
    }
}
