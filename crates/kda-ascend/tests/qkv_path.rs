//! An installation without the MXFP8 ops (an emulated Ascend 910B3, as CANN for A2/A3): the
//! backend reports the MX op families absent, the layer takes the bf16 QKV path
//! (`docs/design/kda.md#qkv-precision`) with no MX quant or GEMM anywhere in the runtime calls
//! and equals the reference layer on the same path; asking for MXFP8 there fails when the layer
//! is built, and a hand-launched `DynamicQuant` is a typed refusal (the project has no AscendC
//! MXFP8 quantize kernel). In its own binary: the emulated SoC is chosen once per process.
#![cfg(feature = "emulated")]
#![allow(clippy::expect_used, clippy::unwrap_used, reason = "tests")]

use std::sync::Once;

use half::bf16;
use kda_ascend::{AscendBackend, AscendOptions};
use kda_core::mx::{ScaleAlg, num_blocks};
use kda_core::{Backend, DType, Device, Error, NativeOps, Op};
use kda_model::config::Tp;
use kda_model::layer::{BatchMeta, CoreOperands, KdaLayer, LayerError, LayerOptions, QkvPath};
use kda_model::schedule::{ProjectionSchedule, QkvWeight};
use kda_model::weights::LayerWeights;
use kda_reference::ReferenceBackend;
use kda_testkit::conformance::gemm::download_f64;
use kda_testkit::conformance::layer::{Model, load, tiny_config};
use kda_testkit::{Gen, Tolerance};

/// An A2/A3 part: CANN there has no `aclnnDynamicMxQuantV3` or `aclnnQuantMatmulV5`.
fn a2_backend() -> Device<AscendBackend> {
    static SOC: Once = Once::new();
    // SAFETY: set once, before this binary's first backend reads it; nothing else in this
    // binary touches the environment.
    SOC.call_once(|| unsafe { std::env::set_var("KDA_ACL_EMU_SOC", "Ascend910B3") });
    AscendBackend::with_options(AscendOptions { checked: true, ..AscendOptions::default() })
        .unwrap()
}

/// The runtime calls that would be MXFP8 work: the aclnn MX ops and the dequant kernel.
fn mx_calls(calls: &[kda_acl_emu::Call]) -> Vec<String> {
    let mx = ["DynamicMxQuant", "QuantMatmul", "kda_mx_dequant"];
    calls.iter().map(|c| c.api.clone()).filter(|api| mx.iter().any(|m| api.contains(m))).collect()
}

const LENS: [usize; 2] = [37, 4];

/// The layer's output for one batch of fresh prefills, and whether its QKV weight is bf16.
fn forward<B: Backend>(
    b: &Device<B>,
    w: &LayerWeights,
    x: &[bf16],
    options: LayerOptions,
) -> (Vec<f64>, bool) {
    let s = b.new_stream().unwrap();
    let layer = KdaLayer::new(b, &s, w, options).unwrap();
    let bf16_qkv = matches!(layer.weights().projection.qkv(), QkvWeight::Bf16 { .. });
    let (n, hidden) = (LENS.iter().sum::<usize>(), w.dims.hidden);
    let xt = b.alloc(DType::BF16, &[n, hidden]).unwrap();
    b.upload(&s, &xt, x).unwrap();
    let mut cache = layer.new_cache(&s, LENS.len(), 0).unwrap();
    let mut out = b.alloc(DType::F32, &[n, hidden]).unwrap();
    layer.forward(&s, &xt, &BatchMeta::prefills(&LENS, &[1, 0]), &mut cache, &mut out).unwrap();
    (download_f64(b, &s, &out), bf16_qkv)
}

#[test]
fn without_mx_ops_the_layer_runs_bf16_qkv_and_equals_the_reference() {
    let b = a2_backend();
    assert_eq!(b.info().capabilities.native, NativeOps { mx_quant: false, mx_gemm: false });
    let w = load(&tiny_config(Model::K3), Tp::SINGLE, 33);
    let n: usize = LENS.iter().sum();
    let x: Vec<bf16> = Gen::new(6)
        .normal_f32(n * w.dims.hidden, 0.0, 1.0)
        .into_iter()
        .map(bf16::from_f32)
        .collect();
    let reference = ReferenceBackend::new();
    for schedule in [ProjectionSchedule::Serial, ProjectionSchedule::Overlapped] {
        let schedule = Some(schedule);
        let from = kda_acl_emu::calls_of_this_thread().len();
        // No QKV request: the capabilities choose. f32 core operands on both backends, so that
        // they run the same kernels (bf16 prefills take CANN's aclnnChunkKdaFwd here, compared
        // within tolerance in vendor_layer.rs).
        let core_operands = Some(CoreOperands::F32);
        let (got, bf16_qkv) =
            forward(&b, &w, &x, LayerOptions { schedule, core_operands, ..Default::default() });
        let calls = kda_acl_emu::calls_of_this_thread().split_off(from);
        assert!(bf16_qkv, "{schedule:?}: the MX ops are absent, so the QKV weight is bf16");
        assert_eq!(mx_calls(&calls), Vec::<String>::new(), "{schedule:?}: no MXFP8 work");
        assert!(calls.iter().any(|c| c.api.contains("Matmul")), "the GEMMs ran on the runtime");

        let options = LayerOptions {
            schedule,
            qkv: Some(QkvPath::Bf16),
            core_operands,
            ..Default::default()
        };
        let (want, _) = forward(&reference, &w, &x, options);
        // The layer's kernels run under the twin (their own arithmetic, not the reference's):
        // the conformance suite's layer tolerance.
        let magnitude = kda_testkit::oracle_kda::max_abs(&want);
        Tolerance::new(1.0 / 256.0, magnitude / 256.0).assert_close(
            &[n, w.dims.hidden],
            &got,
            &want,
        );
    }
}

#[test]
fn asking_for_mxfp8_without_the_mx_ops_fails_when_the_layer_is_built() {
    let b = a2_backend();
    let s = b.new_stream().unwrap();
    let w = load(&tiny_config(Model::K3), Tp::SINGLE, 33);
    let from = kda_acl_emu::calls_of_this_thread().len();
    let options = LayerOptions { qkv: Some(QkvPath::Mxfp8), ..LayerOptions::default() };
    match KdaLayer::new(&b, &s, &w, options) {
        Err(LayerError::Device(Error::Param { param, expected, actual, .. })) => {
            assert_eq!(param, "LayerOptions::qkv");
            assert!(expected.contains("mx_quant and mx_gemm"), "{expected}");
            assert!(actual.contains("QkvPath::Mxfp8 on the ascend backend"), "{actual}");
            assert!(actual.contains("native has none"), "{actual}");
        }
        other => panic!("expected the typed refusal, got {:?}", other.map(|_| ())),
    }
    let calls = kda_acl_emu::calls_of_this_thread().split_off(from);
    assert!(
        !calls.iter().any(|c| c.api.contains("Memcpy")),
        "refused before any weight was uploaded: {calls:?}"
    );
    // The bf16 path is what the same layer takes on request.
    let options = LayerOptions { qkv: Some(QkvPath::Bf16), ..LayerOptions::default() };
    KdaLayer::new(&b, &s, &w, options).unwrap();
}

/// The bf16 path (what the layer takes here by default) under the overlapped schedule, both
/// matrix-overlap policies, on a checked backend: no hazard, and a captured forward (one ACL
/// model) replays equal to eager.
#[test]
fn the_bf16_path_is_hazard_free_and_replays_as_a_captured_graph() {
    kda_testkit::conformance::layer::overlapped_forward_is_clean_and_replays(&a2_backend);
}

#[test]
fn dynamic_quant_on_a2_is_refused_before_anything_is_queued() {
    let b = a2_backend();
    assert_eq!(b.info().capabilities.native, NativeOps { mx_quant: false, mx_gemm: false });
    let s = b.new_stream().unwrap();
    let (m, k) = (3, 64);
    let x = b.alloc(DType::BF16, &[m, k]).unwrap();
    let data = b.alloc(DType::E4M3, &[m, k]).unwrap();
    let scale = b.alloc(DType::E8M0, &[m, num_blocks(k)]).unwrap();
    let from = kda_acl_emu::calls_of_this_thread().len();
    match b.launch(&s, Op::DynamicQuant { x, data, scale, alg: ScaleAlg::OcpFloor }) {
        Err(Error::Unsupported { backend: "ascend", feature }) => {
            assert!(feature.starts_with("DynamicQuant on Ascend910B3"), "{feature}");
            assert!(feature.contains("capabilities.native.mx_quant is false"), "{feature}");
        }
        other => panic!("expected the typed refusal, got {other:?}"),
    }
    let calls = kda_acl_emu::calls_of_this_thread().split_off(from);
    assert_eq!(calls, Vec::new(), "nothing reached the runtime");
}

/// A2/A3's `aclnnMatmul` refuses a bf16 operand with an f32 or f16 one (hicann/ops-nn
/// `aclnnMatmul.md`, 约束说明; the emulated 910B3 refuses it with 161002): the backend widens both
/// operands to f32 first (`aclnnInplaceCopy`, exact) and the GEMM equals the reference's mixed
/// one — the layer's `o_proj` (f32 activations, bf16 weights) is this GEMM.
#[test]
fn a_mixed_bf16_gemm_on_a2_is_widened_to_f32_and_equals_the_reference() {
    let b = a2_backend();
    let s = b.new_stream().unwrap();
    let reference = ReferenceBackend::new();
    let rs = reference.new_stream().unwrap();
    let (m, n, k) = (5, 7, 40);
    let mut rng = Gen::new(41);
    let xv = rng.uniform_f32(m * k, -1.0, 1.0);
    let wv: Vec<bf16> = rng.uniform_f32(n * k, -1.0, 1.0).into_iter().map(bf16::from_f32).collect();
    let x = b.alloc(DType::F32, &[m, k]).unwrap();
    let w = b.alloc(DType::BF16, &[n, k]).unwrap();
    let y = b.alloc(DType::F32, &[m, n]).unwrap();
    b.upload(&s, &x, &xv).unwrap();
    b.upload(&s, &w, &wv).unwrap();
    let from = kda_acl_emu::calls_of_this_thread().len();
    b.launch(&s, Op::Gemm { x, w, y: y.clone() }).unwrap();
    let got = download_f64(&b, &s, &y);
    let calls: Vec<String> =
        kda_acl_emu::calls_of_this_thread().split_off(from).into_iter().map(|c| c.api).collect();
    let copy = calls.iter().position(|c| c == "aclnnInplaceCopy");
    let gemm = calls.iter().position(|c| c == "aclnnMatmul");
    assert!(copy.is_some() && copy < gemm, "widened before the GEMM: {calls:?}");
    let (rx, rw, ry) = (
        reference.alloc(DType::F32, &[m, k]).unwrap(),
        reference.alloc(DType::BF16, &[n, k]).unwrap(),
        reference.alloc(DType::F32, &[m, n]).unwrap(),
    );
    reference.upload(&rs, &rx, &xv).unwrap();
    reference.upload(&rs, &rw, &wv).unwrap();
    reference.launch(&rs, Op::Gemm { x: rx, w: rw, y: ry.clone() }).unwrap();
    let want = download_f64(&reference, &rs, &ry);
    Tolerance::for_dtype(DType::F32).assert_close(&[m, n], &got, &want);
}
