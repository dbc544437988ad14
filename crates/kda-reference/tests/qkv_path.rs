//! The bf16 QKV path of an MXFP8 checkpoint (`docs/design/kda.md#qkv-precision`) on the
//! reference backend: the layer equals an oracle built from the codec's exact dequantized weight
//! and plain GEMMs of the bf16 activation, on both schedules and bit for bit between them; the
//! backend's capabilities pick MXFP8 when nothing is asked.
#![allow(clippy::expect_used, clippy::unwrap_used, reason = "tests")]

use half::bf16;
use kda_core::mx;
use kda_core::sanitize::ExclusiveUnits;
use kda_core::{DType, Device, NativeOps};
use kda_model::config::{QkvFormat, Tp};
use kda_model::layer::{BatchMeta, KdaLayer, LayerOptions, QkvPath};
use kda_model::schedule::MatrixOverlap;
use kda_model::schedule::{ProjectionSchedule, QkvWeight};
use kda_model::weights::{FusedQkv, HostTensor, LayerWeights, QkvPart, QkvWeights};
use kda_reference::{ReferenceBackend, ReferenceOptions};
use kda_testkit::conformance::gemm::download_f64;
use kda_testkit::conformance::layer::{Model, load, tiny_config};
use kda_testkit::oracle_kda::max_abs;
use kda_testkit::oracle_layer::LayerOracle;
use kda_testkit::{Gen, Tolerance};

const LENS: [usize; 3] = [5, 40, 3];

/// The exact dequantized QKV of `w`, from the codec's f64 decode: `[3 lp, Hd]`.
fn exact_qkv(w: &LayerWeights) -> Vec<f64> {
    let Some(QkvWeights::Mxfp8 { data, scale, .. }) = w.qkv.weights() else {
        panic!("an MXFP8 checkpoint")
    };
    let (rows, k) = (3 * w.dims.local_proj, w.dims.hidden);
    mx::dequantize_f64(data.as_u8().unwrap(), scale.as_u8().unwrap(), rows, k).unwrap()
}

/// `w` with its QKV replaced by a dense f32 weight holding `exact` (exact in f32: E4M3 values
/// times a power of two never reach f32's range limits at these scales), for the layer oracle.
fn dense_twin(w: &LayerWeights, exact: &[f64]) -> LayerWeights {
    let (lp, k) = (w.dims.local_proj, w.dims.hidden);
    let mut qkv = FusedQkv::new(w.dims, QkvFormat::Dense, DType::F32).unwrap();
    for part in QkvPart::ALL {
        let rows = &exact[part.index() * lp * k..(part.index() + 1) * lp * k];
        let as_f32: Vec<f32> = rows.iter().map(|&v| v as f32).collect();
        assert!(as_f32.iter().zip(rows).all(|(&a, &b)| f64::from(a) == b), "exact in f32");
        qkv.load_weight(part, &HostTensor::from_f32(&[lp, k], as_f32).unwrap()).unwrap();
    }
    LayerWeights { qkv, ..w.clone() }
}

struct Run {
    out: Vec<f64>,
    mixed_qkv: Vec<f64>,
}

/// One batch of fresh prefills (`LENS`) through a layer built with `options`.
fn run(b: &Device<ReferenceBackend>, w: &LayerWeights, x: &[f32], options: LayerOptions) -> Run {
    let s = b.new_stream().unwrap();
    let layer = KdaLayer::new(b, &s, w, options).unwrap();
    let hidden = w.dims.hidden;
    let n: usize = LENS.iter().sum();
    let xt = b.alloc(DType::BF16, &[n, hidden]).unwrap();
    let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
    b.upload(&s, &xt, &xb).unwrap();
    let mut cache = layer.new_cache(&s, LENS.len(), 0).unwrap();
    let mut out = b.alloc(DType::F32, &[n, hidden]).unwrap();
    let meta = BatchMeta::prefills(&LENS, &[0, 1, 2]);
    let trace = layer.forward_traced(&s, &xt, &meta, &mut cache, &mut out).unwrap().unwrap();
    Run { out: download_f64(b, &s, &out), mixed_qkv: download_f64(b, &s, &trace.mixed_qkv) }
}

fn options(schedule: ProjectionSchedule, qkv: Option<QkvPath>) -> LayerOptions {
    LayerOptions { schedule: Some(schedule), qkv, ..LayerOptions::default() }
}

#[test]
fn bf16_qkv_path_equals_the_dequantized_weight_oracle_on_both_schedules() {
    let b = ReferenceBackend::new();
    let w = load(&tiny_config(Model::K3), Tp::SINGLE, 21);
    assert!(matches!(w.qkv.format(), QkvFormat::Mxfp8 { .. }), "K3 checkpoints are MXFP8");
    let (hidden, width) = (w.dims.hidden, 3 * w.dims.local_proj);
    let n: usize = LENS.iter().sum();
    let x: Vec<f32> = Gen::new(4)
        .normal_f32(n * hidden, 0.0, 1.0)
        .into_iter()
        .map(|v| bf16::from_f32(v).to_f32())
        .collect();

    let serial = run(&b, &w, &x, options(ProjectionSchedule::Serial, Some(QkvPath::Bf16)));
    let overlapped = run(&b, &w, &x, options(ProjectionSchedule::Overlapped, Some(QkvPath::Bf16)));
    let bits = |v: &[f64]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&serial.out), bits(&overlapped.out), "the schedules agree bit for bit");
    assert_eq!(bits(&serial.mixed_qkv), bits(&overlapped.mixed_qkv));

    // mixed_qkv: the bf16 activation times the exact weight, in f64, rounded to bf16 once.
    let exact = exact_qkv(&w);
    let want: Vec<f64> = x
        .chunks(hidden)
        .flat_map(|row| {
            exact.chunks(hidden).map(move |wr| {
                let dot: f64 = row.iter().zip(wr).map(|(&a, &c)| f64::from(a) * c).sum();
                bf16::from_f64(dot).to_f64()
            })
        })
        .collect();
    Tolerance::for_dtype(DType::BF16).assert_close(&[n, width], &serial.mixed_qkv, &want);

    // The MXFP8 path quantizes the activation: its mixed_qkv misses this oracle, so the one
    // above tells the two paths apart.
    let mx_run = run(&b, &w, &x, options(ProjectionSchedule::Serial, Some(QkvPath::Mxfp8)));
    assert!(
        Tolerance::for_dtype(DType::BF16).compare(&[n, width], &mx_run.mixed_qkv, &want).is_err(),
        "the MXFP8 path's activation quantization must be visible against the bf16 oracle"
    );

    // The whole layer: the f64 layer oracle over the same exact weight as a dense QKV.
    let oracle = LayerOracle::new(&dense_twin(&w, &exact), Default::default());
    let mut at = 0;
    for len in LENS {
        let (want, _) = oracle.run(&x[at * hidden..(at + len) * hidden], &oracle.fresh());
        let got = &serial.out[at * hidden..(at + len) * hidden];
        let tolerance = Tolerance::new(1.0 / 256.0, max_abs(&want) / 256.0);
        tolerance.assert_close(&[len, hidden], got, &want);
        at += len;
    }
}

#[test]
fn the_reference_runs_mxfp8_natively_so_no_request_means_mxfp8() {
    let b = ReferenceBackend::new();
    assert_eq!(b.info().capabilities.native, NativeOps::ALL);
    let w = load(&tiny_config(Model::K3), Tp::SINGLE, 21);
    let s = b.new_stream().unwrap();
    let qkv_of = |qkv| {
        let options = LayerOptions { qkv, ..LayerOptions::default() };
        let layer = KdaLayer::new(&b, &s, &w, options).unwrap();
        match layer.weights().projection.qkv() {
            QkvWeight::Mxfp8 { .. } => "mxfp8",
            QkvWeight::Bf16 { w } => {
                assert_eq!(w.dtype(), DType::BF16);
                "bf16"
            }
        }
    };
    assert_eq!(qkv_of(None), "mxfp8");
    assert_eq!(qkv_of(Some(QkvPath::Mxfp8)), "mxfp8");
    assert_eq!(qkv_of(Some(QkvPath::Bf16)), "bf16");
}

/// The bf16 path overlapped on a checked backend whose matrix and vector units are exclusive (as
/// on Ascend), under the seeds' `Serialized` policy: no hazard, and a captured forward replays
/// equal to eager, bit for bit.
#[test]
fn overlapped_bf16_path_is_hazard_free_and_captures() {
    let options = ReferenceOptions { checked: true, ..ReferenceOptions::default() };
    let b = ReferenceBackend::with_options(options).unwrap();
    b.instrumentation().set_exclusive_units(ExclusiveUnits { matrix: true, vector: true });
    let w = load(&tiny_config(Model::K3), Tp::SINGLE, 21);
    let (hidden, n) = (w.dims.hidden, LENS.iter().sum::<usize>());
    let x: Vec<bf16> =
        Gen::new(9).normal_f32(n * hidden, 0.0, 1.0).into_iter().map(bf16::from_f32).collect();
    let s = b.new_stream().unwrap();
    let options = LayerOptions {
        schedule: Some(ProjectionSchedule::Overlapped),
        matrix_overlap: Some(MatrixOverlap::Serialized),
        qkv: Some(QkvPath::Bf16),
        ..LayerOptions::default()
    };
    let layer = KdaLayer::new(&b, &s, &w, options).unwrap();
    let xt = b.alloc(DType::BF16, &[n, hidden]).unwrap();
    b.upload(&s, &xt, &x).unwrap();
    let meta = BatchMeta::prefills(&LENS, &[0, 1, 2]);
    let forward_into = |capture: bool| {
        let mut cache = layer.new_cache(&s, LENS.len(), 0).unwrap();
        let mut out = b.alloc(DType::F32, &[n, hidden]).unwrap();
        b.synchronize(&s).unwrap();
        if capture {
            b.begin_capture(&s).unwrap();
        }
        layer.forward(&s, &xt, &meta, &mut cache, &mut out).unwrap();
        if capture {
            let graph = b.end_capture(&s).unwrap();
            b.launch_graph(&graph, &s).unwrap();
        }
        download_f64(&b, &s, &out).into_iter().map(f64::to_bits).collect::<Vec<_>>()
    };
    let eager = forward_into(false);
    let replayed = forward_into(true);
    assert_eq!(replayed, eager, "the captured forward replays the eager one");
    assert!(b.instrumentation().hazards().is_empty(), "{:?}", b.instrumentation().hazards());
}
