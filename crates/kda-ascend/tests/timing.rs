//! Device timing of both projection schedules and the layer forward, measured with
//! `ACL_EVENT_TIME_LINE` events (`AscendBackend::time_ms`); the hardware check (`cargo xtask
//! npu-check`) collects the `KDA_TIMING` lines this prints. Serial and overlapped must agree bit
//! for bit and every time must be a positive finite number. Runs over the emulated runtime too
//! (where the times are the emulator's, not an NPU's).
#![cfg(any(feature = "acl", feature = "emulated"))]
#![allow(clippy::expect_used, clippy::unwrap_used, reason = "tests")]

use half::bf16;
use kda_ascend::{AscendBackend, AscendOptions};
use kda_core::{DType, Device, Resources, Tensor};
use kda_model::config::Tp;
use kda_model::layer::LayerOptions;
use kda_model::schedule::{MatrixOverlap, ProjectionSchedule};
use kda_model::{BatchMeta, KdaLayer};
use kda_testkit::Gen;
use kda_testkit::conformance::layer::{Model, load, tiny_config};

type Stream = <AscendBackend as Resources>::Stream;

const ROUNDS: usize = 5;

fn upload_bf16(
    b: &Device<AscendBackend>,
    s: &Stream,
    shape: &[usize],
    v: &[f32],
) -> Tensor<AscendBackend> {
    let t = b.alloc(DType::BF16, shape).unwrap();
    let data: Vec<bf16> = v.iter().map(|&x| bf16::from_f32(x)).collect();
    b.upload(s, &t, &data).unwrap();
    t
}

/// The median of `ROUNDS` timings of `run` (after one warm-up), checked positive and finite.
fn median_ms(b: &Device<AscendBackend>, s: &Stream, mut run: impl FnMut()) -> f32 {
    run();
    let mut times: Vec<f32> = (0..ROUNDS)
        .map(|_| {
            b.raw()
                .time_ms(s, || {
                    run();
                    Ok(())
                })
                .unwrap()
        })
        .collect();
    times.sort_by(f32::total_cmp);
    let median = times[ROUNDS / 2];
    assert!(median.is_finite() && median > 0.0, "{times:?}");
    median
}

#[test]
fn both_schedules_and_the_layer_timed_with_events() {
    let options = AscendOptions { checked: false, ..AscendOptions::default() };
    let b = AscendBackend::with_options(options).unwrap();
    let s = b.new_stream().unwrap();
    let w = load(&tiny_config(Model::K3), Tp::SINGLE, 81);
    let hidden = w.dims.hidden;
    let tokens = 8;
    let mut rng = Gen::new(8);
    let x = upload_bf16(&b, &s, &[tokens, hidden], &rng.normal_f32(tokens * hidden, 0.0, 1.0));
    let meta = BatchMeta::prefills(&[3, 5], &[0, 1]);
    let mut outputs = Vec::new();
    for schedule in [ProjectionSchedule::Serial, ProjectionSchedule::Overlapped] {
        let options = LayerOptions {
            schedule: Some(schedule),
            matrix_overlap: Some(MatrixOverlap::Serialized),
            ..LayerOptions::default()
        };
        let layer = KdaLayer::new(&b, &s, &w, options).unwrap();
        let mut cache = layer.new_cache(&s, 2, 0).unwrap();
        let mut out = b.alloc(DType::F32, &[tokens, hidden]).unwrap();
        let ms = median_ms(&b, &s, || {
            layer.forward(&s, &x, &meta, &mut cache, &mut out).unwrap();
        });
        println!(
            "KDA_TIMING {{\"what\": \"layer_forward\", \"schedule\": \"{schedule:?}\", \
             \"tokens\": {tokens}, \"median_ms\": {ms:.4}, \"rounds\": {ROUNDS}}}"
        );
        // One more forward from a fresh cache: the schedules' outputs are compared below.
        let mut fresh = layer.new_cache(&s, 2, 0).unwrap();
        layer.forward(&s, &x, &meta, &mut fresh, &mut out).unwrap();
        let bits: Vec<u32> =
            b.download::<f32>(&s, &out).unwrap().into_iter().map(f32::to_bits).collect();
        assert!(bits.iter().all(|&v| f32::from_bits(v).is_finite()), "{schedule:?}");
        outputs.push(bits);
    }
    assert_eq!(outputs[0], outputs[1], "serial and overlapped are bit-identical");
}
