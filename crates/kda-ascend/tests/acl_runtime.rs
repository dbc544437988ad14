//! The backend's use of the ACL runtime, checked through the emulated runtime's call log and
//! against the rules CANN enforces: the overlapped projection's call order, the ACL capture path
//! (`instantiate`, and the HAL's `launch_graph`: the projection schedule and the layer forward
//! as one ACL model, a graph with a host function replayed eagerly, a foreign graph), the three
//! rejections (non-SYNC event in a wait, a one-shot executor run twice, an unjoined
//! stream at capture end), and the MXFP8 emulation path of chips without MX GEMMs.
#![cfg(feature = "emulated")]
#![allow(clippy::expect_used, clippy::unwrap_used, reason = "tests")]

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use half::bf16;
use kda_ascend::{AscendBackend, AscendOptions, MxGemmPath, sys};
use kda_core::graph::Graph;
use kda_core::mx::{self, ScaleAlg, num_blocks};
use kda_core::sanitize::HazardKind;
use kda_core::{
    CaptureError, DType, Device, E8M0, Error, F8E4M3, HostFn, Op, Resources, StreamHandle, Tensor,
};
use kda_model::config::Tp;
use kda_model::layer::{CoreOperands, LayerOptions, RequestSlots};
use kda_model::schedule::{
    BfgWeight, MatrixOverlap, Projected, ProjectionDims, ProjectionSchedule, ProjectionWeights,
    QkvBfgProjection, QkvWeight,
};
use kda_model::{BatchMeta, KdaLayer, StateCache};
use kda_testkit::conformance::layer::{Model, load, tiny_config};
use kda_testkit::{Gen, Tolerance};

const DIMS: ProjectionDims = ProjectionDims { hidden: 64, heads: 2, head_dim: 8 };

type Stream = <AscendBackend as Resources>::Stream;

fn backend(mx_gemm: MxGemmPath) -> Device<AscendBackend> {
    let options = AscendOptions { checked: false, mx_gemm, ..AscendOptions::default() };
    AscendBackend::with_options(options).expect("backend over the emulated runtime")
}

fn upload_bf16(
    b: &Device<AscendBackend>,
    s: &<AscendBackend as Resources>::Stream,
    shape: &[usize],
    v: &[f32],
) -> Tensor<AscendBackend> {
    let t = b.alloc(DType::BF16, shape).unwrap();
    let data: Vec<bf16> = v.iter().map(|&x| bf16::from_f32(x)).collect();
    b.upload(s, &t, &data).unwrap();
    t
}

/// MXFP8 QKV and composed BFG weights for [`DIMS`], and an activation of `tokens` rows.
fn projection(
    b: &Device<AscendBackend>,
    main: &<AscendBackend as Resources>::Stream,
    tokens: usize,
) -> (QkvBfgProjection<AscendBackend>, Tensor<AscendBackend>) {
    let mut rng = Gen::new(5);
    let (hd, qkv_rows) = (DIMS.hidden, DIMS.qkv_width());
    let q =
        mx::quantize(&rng.normal_f32(qkv_rows * hd, 0.0, 0.05), qkv_rows, hd, ScaleAlg::OcpFloor)
            .unwrap();
    let data = b.alloc(DType::E4M3, &[qkv_rows, hd]).unwrap();
    let scale = b.alloc(DType::E8M0, &[qkv_rows, num_blocks(hd)]).unwrap();
    b.upload(main, &data, &q.data.iter().map(|&x| F8E4M3(x)).collect::<Vec<_>>()).unwrap();
    b.upload(main, &scale, &q.scale.iter().map(|&x| E8M0(x)).collect::<Vec<_>>()).unwrap();
    let bfg = upload_bf16(
        b,
        main,
        &[DIMS.bfg_width(), hd],
        &rng.normal_f32(DIMS.bfg_width() * hd, 0.0, 0.05),
    );
    let x = upload_bf16(b, main, &[tokens, hd], &rng.normal_f32(tokens * hd, 0.0, 1.0));
    b.synchronize(main).unwrap();
    let weights = ProjectionWeights::new(
        DIMS,
        QkvWeight::Mxfp8 { data, scale, alg: ScaleAlg::OcpFloor },
        BfgWeight::Composed { w: bfg },
    )
    .unwrap();
    let p = QkvBfgProjection::new(b, weights, ProjectionSchedule::Overlapped)
        .unwrap()
        .with_matrix_overlap(MatrixOverlap::Serialized);
    (p, x)
}

/// The bits of a projection's outputs: mixed QKV, beta, g1, g2.
fn projected_bits(
    b: &Device<AscendBackend>,
    main: &Stream,
    out: &Projected<AscendBackend>,
) -> (Vec<u16>, Vec<u32>, Vec<u16>, Vec<u16>) {
    let half = |t: &Tensor<AscendBackend>| -> Vec<u16> {
        b.download::<bf16>(main, t).unwrap().into_iter().map(bf16::to_bits).collect()
    };
    let beta = b.download::<f32>(main, &out.beta).unwrap().into_iter().map(f32::to_bits).collect();
    (half(&out.mixed_qkv), beta, half(&out.g1), half(&out.g2))
}

/// The runtime calls of one overlapped projection, streams and events named by first use.
#[test]
fn overlapped_projection_calls_the_runtime_in_the_seeds_order() {
    let b = backend(MxGemmPath::Auto);
    let main = b.new_stream().unwrap();
    let start = kda_acl_emu::calls_of_this_thread().len();
    let (p, x) = projection(&b, &main, 5);
    p.aux_stream().get(&b).unwrap();
    let from = kda_acl_emu::calls_of_this_thread().len();
    let out = p.forward(&main, &x).unwrap();
    let mut calls = kda_acl_emu::calls_of_this_thread().split_off(start);
    // The schedule's four events are created with the projection, before the forward.
    let setup: Vec<_> = calls.drain(..from - start).collect();
    let created: Vec<&str> = setup
        .iter()
        .filter(|c| c.api.starts_with("aclrtCreateEventExWithFlag"))
        .map(|c| c.api.as_str())
        .collect();
    assert_eq!(created, vec!["aclrtCreateEventExWithFlag(SYNC)"; 4]);

    let (mut streams, mut events) = (HashMap::new(), HashMap::new());
    let main_handle = calls.iter().find(|c| c.api == "aclrtRecordEvent").map(|c| c.stream).unwrap();
    streams.insert(main_handle, "main");
    let event_names = ["hidden_ready", "bfg_projection_ready", "quant_ready", "bfg_ready"];
    let mut trace = Vec::new();
    for c in &calls {
        if c.stream != 0 && !streams.contains_key(&c.stream) {
            streams.insert(c.stream, "aux");
        }
        let s = streams.get(&c.stream).copied().unwrap_or("?");
        let mut name = |event| {
            let next = events.len();
            *events.entry(event).or_insert_with(|| event_names.get(next).copied().unwrap_or("?"))
        };
        trace.push(match c.api.as_str() {
            "aclrtRecordEvent" | "aclrtStreamWaitEvent" if c.event == 0 => "no event".into(),
            "aclrtRecordEvent" => format!("{s}.record({})", name(c.event)),
            "aclrtStreamWaitEvent" => format!("{s}.wait({})", name(c.event)),
            other => format!("{s}:{other}"),
        });
    }
    let expected = [
        "main.record(hidden_ready)",
        "aux.wait(hidden_ready)",
        "aux:aclnnMatmul",
        "aux.record(bfg_projection_ready)",
        "main:aclnnDynamicMxQuantV3",
        "main.record(quant_ready)",
        "main.wait(bfg_projection_ready)",
        "main:aclnnQuantMatmulV5",
        "aux.wait(quant_ready)",
        "aux:kda_sigmoid_f32",
        "aux.record(bfg_ready)",
        "main.wait(bfg_ready)",
    ];
    assert_eq!(trace, expected);
    drop(out);
}

/// The overlapped schedule captured by the HAL, instantiated as an ACL model (executors made
/// repeatable before `aclmdlRICaptureBegin`), replayed twice: bit for bit the eager outputs.
#[test]
fn overlapped_schedule_runs_as_an_acl_model_equal_to_eager() {
    let b = backend(MxGemmPath::Auto);
    let main = b.new_stream().unwrap();
    let (p, x) = projection(&b, &main, 7);
    let bits = |out: &Projected<AscendBackend>| projected_bits(&b, &main, out);
    let eager = bits(&p.forward(&main, &x).unwrap());

    let bufs = p.alloc_buffers(&x).unwrap();
    b.begin_capture(&main).unwrap();
    let out = p.forward_into(&main, &x, &bufs).unwrap();
    let graph = b.end_capture(&main).unwrap();
    let model = b.raw().instantiate(&graph, &main).unwrap();
    let from = kda_acl_emu::calls_of_this_thread().len();
    for _ in 0..2 {
        b.launch(&main, Op::Fill { dst: out.mixed_qkv.clone(), value: f64::NAN }).unwrap();
        model.launch(&main).unwrap();
        assert_eq!(bits(&out), eager, "the ACL model replays the eager outputs bit for bit");
    }
    // The replays ran the model: one ExecuteAsync each, and none of the schedule's ops issued
    // again from the host.
    let runs = kda_acl_emu::calls_of_this_thread().split_off(from);
    let executes = runs.iter().filter(|c| c.api == "aclmdlRIExecuteAsync").count();
    assert_eq!(executes, 2);
    let schedule_ops =
        ["aclnnMatmul", "aclnnDynamicMxQuantV3", "aclnnQuantMatmulV5", "kda_sigmoid_f32"];
    assert!(runs.iter().all(|c| !schedule_ops.contains(&c.api.as_str())), "{runs:?}");
}

/// The emulated runtime's entry points one call of `f` makes, in order.
fn runtime_calls_of(f: impl FnOnce()) -> Vec<String> {
    let from = kda_acl_emu::calls_of_this_thread().len();
    f();
    kda_acl_emu::calls_of_this_thread().split_off(from).into_iter().map(|c| c.api).collect()
}

/// Launch `graph` on `main` through the HAL and check the runtime calls that made: the first
/// launch instantiates it as an ACL model (every aclnn executor prepared and made repeatable
/// before the capture, none inside it) and executes it; every later launch is exactly one
/// `aclmdlRIExecuteAsync` — no op is issued from the host again.
fn launch_as_acl_model(
    b: &Device<AscendBackend>,
    main: &Stream,
    graph: &Graph<AscendBackend>,
    first: bool,
) {
    let calls = runtime_calls_of(|| b.launch_graph(graph, main).unwrap());
    if !first {
        assert_eq!(calls, ["aclmdlRIExecuteAsync"]);
        return;
    }
    let at = |api: &str| calls.iter().position(|c| c == api).expect(api);
    let (begin, end) = (at("aclmdlRICaptureBegin"), at("aclmdlRICaptureEnd"));
    // The emulator refuses phase one inside a capture; phase two is what the capture records.
    let repeatable =
        |calls: &[String]| calls.iter().filter(|c| *c == "aclSetAclOpExecutorRepeatable").count();
    let captured_aclnn = calls[begin..end].iter().filter(|c| c.starts_with("aclnn")).count();
    assert!(captured_aclnn > 0, "{calls:?}");
    assert_eq!(repeatable(&calls[..begin]), captured_aclnn, "{calls:?}");
    assert_eq!(repeatable(&calls[begin..]), 0, "{calls:?}");
    assert_eq!(calls[end + 1..], ["aclmdlRIExecuteAsync"], "{calls:?}");
}

/// The overlapped projection schedule captured through the HAL (`begin_capture`, `end_capture`)
/// and launched three times with `launch_graph`: one ACL model, instantiated once, executed
/// each time, bit for bit the eager outputs.
#[test]
fn hal_captured_projection_schedule_runs_as_one_acl_model_equal_to_eager() {
    let b = backend(MxGemmPath::Auto);
    let main = b.new_stream().unwrap();
    let (p, x) = projection(&b, &main, 7);
    let bits = |out: &Projected<AscendBackend>| projected_bits(&b, &main, out);
    let eager = bits(&p.forward(&main, &x).unwrap());
    assert!(eager.1.iter().all(|&v| f32::from_bits(v).is_finite()));

    let bufs = p.alloc_buffers(&x).unwrap();
    b.begin_capture(&main).unwrap();
    let out = p.forward_into(&main, &x, &bufs).unwrap();
    let graph = b.end_capture(&main).unwrap();
    let poison = || {
        for t in [&out.mixed_qkv, &out.beta, &out.g1, &out.g2] {
            b.launch(&main, Op::Fill { dst: t.clone(), value: f64::NAN }).unwrap();
        }
    };
    poison();
    assert!(bits(&out).1.iter().all(|&v| f32::from_bits(v).is_nan()), "captured ops ran");
    for i in 0..3 {
        poison();
        launch_as_acl_model(&b, &main, &graph, i == 0);
        assert_eq!(bits(&out), eager, "launch {i} equals eager bit for bit");
    }
}

fn cache_bits(
    b: &Device<AscendBackend>,
    s: &Stream,
    cache: &StateCache<AscendBackend>,
) -> Vec<u32> {
    let mut bits = Vec::new();
    for t in [cache.recurrent(), cache.conv()] {
        bits.extend(b.download::<f32>(s, t).unwrap().into_iter().map(f32::to_bits));
    }
    bits
}

/// The overlapped K3 layer forward (checked backend) captured through the HAL and launched
/// three times as one ACL model, each launch after one eager forward of the same batch (a
/// decode and a prefill) on a twin cache: outputs and every cache byte equal bit for bit each
/// time, no hazard. With the backend's default core operands (bf16) and with f32.
#[test]
fn hal_captured_layer_forward_runs_as_one_acl_model_equal_to_eager() {
    captured_layer_forward_equals_eager(None, CoreOperands::Bf16);
}

#[test]
fn hal_captured_f32_core_layer_forward_runs_as_one_acl_model_equal_to_eager() {
    captured_layer_forward_equals_eager(Some(CoreOperands::F32), CoreOperands::F32);
}

fn captured_layer_forward_equals_eager(operands: Option<CoreOperands>, runs: CoreOperands) {
    let options = AscendOptions { checked: true, ..AscendOptions::default() };
    let b = AscendBackend::with_options(options).unwrap();
    let s = b.new_stream().unwrap();
    let w = load(&tiny_config(Model::K3), Tp::SINGLE, 81);
    let hidden = w.dims.hidden;
    let options = LayerOptions {
        schedule: Some(ProjectionSchedule::Overlapped),
        matrix_overlap: Some(MatrixOverlap::Concurrent),
        core_operands: operands,
        ..LayerOptions::default()
    };
    let layer = KdaLayer::new(&b, &s, &w, options).unwrap();
    assert_eq!(layer.core_operands(), runs);
    let mut rng = Gen::new(8);
    let warm = upload_bf16(&b, &s, &[7, hidden], &rng.normal_f32(7 * hidden, 0.0, 1.0));
    let mut x = rng.normal_f32(6 * hidden, 0.0, 1.0);
    x.extend(std::iter::repeat_n(0.0, 2 * hidden));
    let x = upload_bf16(&b, &s, &[8, hidden], &x);
    let mut meta = BatchMeta::empty();
    meta.push(1, 3, RequestSlots::Single(0)).push(5, 0, RequestSlots::Single(2));
    let mut caches = [layer.new_cache(&s, 3, 0).unwrap(), layer.new_cache(&s, 3, 0).unwrap()];
    let mut outs =
        [b.alloc(DType::F32, &[8, hidden]).unwrap(), b.alloc(DType::F32, &[8, hidden]).unwrap()];
    for (cache, out) in caches.iter_mut().zip(&mut outs) {
        let prefill = BatchMeta::prefills(&[3, 4], &[0, 1]);
        let mut warm_out = b.alloc(DType::F32, &[7, hidden]).unwrap();
        layer.forward(&s, &warm, &prefill, cache, &mut warm_out).unwrap();
        b.launch(&s, Op::Fill { dst: out.clone(), value: f64::NAN }).unwrap();
    }
    b.synchronize(&s).unwrap();
    let [eager_cache, graph_cache] = &mut caches;
    let [eager_out, graph_out] = &mut outs;
    b.begin_capture(&s).unwrap();
    layer.forward(&s, &x, &meta, graph_cache, graph_out).unwrap();
    let graph = b.end_capture(&s).unwrap();
    let out_bits = |t: &Tensor<AscendBackend>| -> Vec<u32> {
        b.download::<f32>(&s, t).unwrap().into_iter().map(f32::to_bits).collect()
    };
    assert!(out_bits(graph_out).iter().all(|&v| f32::from_bits(v).is_nan()), "captured ops ran");

    for i in 0..3 {
        let from = kda_acl_emu::calls_of_this_thread().len();
        layer.forward(&s, &x, &meta, eager_cache, eager_out).unwrap();
        let vendor = kda_acl_emu::calls_of_this_thread()[from..]
            .iter()
            .any(|c| c.api.starts_with("aclnnChunkKdaFwd"));
        // Head dim 8 is outside aclnnChunkKdaFwd's contract: eager and captured prefills both
        // run the project's kernel (the vendor op's route is `vendor_layer.rs`'s test).
        assert!(!vendor, "eager prefill of head dim 8 on CANN's chunk op");
        b.launch(&s, Op::Fill { dst: graph_out.clone(), value: f64::NAN }).unwrap();
        launch_as_acl_model(&b, &s, &graph, i == 0);
        let eager = out_bits(eager_out);
        assert!(eager.iter().all(|&v| f32::from_bits(v).is_finite()), "launch {i}");
        assert_eq!(out_bits(graph_out), eager, "launch {i}: output");
        assert_eq!(
            cache_bits(&b, &s, graph_cache),
            cache_bits(&b, &s, eager_cache),
            "launch {i}: cache"
        );
    }
    assert!(b.instrumentation().hazards().is_empty(), "{:?}", b.instrumentation().hazards());
}

/// A graph with a host function, which ACL cannot capture, is replayed op by op on every
/// launch: no model is captured or executed, the host function runs each time, and the
/// captured fill lands each time.
#[test]
fn hal_graph_with_a_host_function_is_replayed_eagerly() {
    let b = backend(MxGemmPath::Auto);
    let main = b.new_stream().unwrap();
    let t = b.alloc(DType::F32, &[16]).unwrap();
    let runs = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&runs);
    let host = HostFn::new(move || {
        counter.fetch_add(1, Ordering::SeqCst);
        Ok(())
    });
    b.begin_capture(&main).unwrap();
    b.launch(&main, Op::Fill { dst: t.clone(), value: 2.5 }).unwrap();
    b.launch(&main, Op::Host { name: "count", f: host }).unwrap();
    let graph = b.end_capture(&main).unwrap();
    for i in 1..=3 {
        b.launch(&main, Op::Fill { dst: t.clone(), value: 0.0 }).unwrap();
        let calls = runtime_calls_of(|| b.launch_graph(&graph, &main).unwrap());
        assert!(calls.iter().all(|c| !c.starts_with("aclmdlRI")), "{calls:?}");
        assert!(calls.iter().any(|c| c == "aclnnInplaceFillScalar"), "{calls:?}");
        assert!(calls.iter().any(|c| c == "aclrtLaunchHostFunc"), "{calls:?}");
        assert_eq!(b.download::<f32>(&main, &t).unwrap(), vec![2.5; 16]);
        assert_eq!(runs.load(Ordering::SeqCst), i);
    }
}

/// A graph captured on another instance is the HAL's `ForeignGraph` error, a stream of another
/// instance `ForeignHandle`; neither reaches the runtime.
#[test]
fn hal_graph_of_another_instance_is_rejected() {
    let (b, b2) = (backend(MxGemmPath::Auto), backend(MxGemmPath::Auto));
    let (main, s2) = (b.new_stream().unwrap(), b2.new_stream().unwrap());
    let t = b.alloc(DType::F32, &[4]).unwrap();
    b.begin_capture(&main).unwrap();
    b.launch(&main, Op::Fill { dst: t, value: 1.0 }).unwrap();
    let graph = b.end_capture(&main).unwrap();
    let calls = runtime_calls_of(|| match b2.launch_graph(&graph, &s2) {
        Err(Error::Capture(e)) => assert_eq!(
            e,
            CaptureError::ForeignGraph { graph: b.instance(), backend: b2.instance() }
        ),
        other => panic!("expected ForeignGraph, got {other:?}"),
    });
    assert!(calls.is_empty(), "{calls:?}");
    let calls = runtime_calls_of(|| match b.launch_graph(&graph, &s2) {
        Err(Error::ForeignHandle { what, handle, backend }) => {
            assert_eq!((what, handle, backend), ("stream", s2.id().instance, b.instance()))
        }
        other => panic!("expected ForeignHandle, got {other:?}"),
    });
    assert!(calls.is_empty(), "{calls:?}");
}

/// On a checked backend a graph run as an ACL model is still seen by the sanitizer: a read on
/// another stream not ordered after the launch is a read-after-write hazard naming the graph's
/// op on the launch stream, and the read is not issued.
#[test]
fn hal_graph_run_as_a_model_is_checked_by_the_sanitizer() {
    let options = AscendOptions { checked: true, ..AscendOptions::default() };
    let b = AscendBackend::with_options(options).unwrap();
    let (main, aux) = (b.new_stream().unwrap(), b.new_stream().unwrap());
    let (t, u) = (b.alloc(DType::F32, &[8]).unwrap(), b.alloc(DType::F32, &[8]).unwrap());
    b.begin_capture(&main).unwrap();
    b.launch_labeled(&main, "graph_fill", Op::Fill { dst: t.clone(), value: 1.0 }).unwrap();
    let graph = b.end_capture(&main).unwrap();
    launch_as_acl_model(&b, &main, &graph, true);
    let calls = runtime_calls_of(|| match b.launch(&aux, Op::Copy { src: t.clone(), dst: u }) {
        Err(Error::Hazard(h)) => {
            assert_eq!(h.kind, HazardKind::ReadAfterWrite);
            assert_eq!((h.first.op.label.as_str(), h.first.op.stream), ("graph_fill", main.id()));
            assert_eq!((h.second.op.label.as_str(), h.second.op.stream), ("copy", aux.id()));
        }
        other => panic!("expected a hazard, got {other:?}"),
    });
    assert!(calls.is_empty(), "{calls:?}");
}

/// A graph launched while a capture is open on the stream is captured into the new graph, not
/// run; launching the outer graph runs it.
#[test]
fn hal_graph_launched_inside_a_capture_is_captured_not_run() {
    let b = backend(MxGemmPath::Auto);
    let main = b.new_stream().unwrap();
    let t = b.alloc(DType::F32, &[8]).unwrap();
    b.begin_capture(&main).unwrap();
    b.launch(&main, Op::Fill { dst: t.clone(), value: 3.0 }).unwrap();
    let inner = b.end_capture(&main).unwrap();
    b.launch(&main, Op::Fill { dst: t.clone(), value: 0.0 }).unwrap();
    b.begin_capture(&main).unwrap();
    let calls = runtime_calls_of(|| b.launch_graph(&inner, &main).unwrap());
    assert!(!calls.iter().any(|c| c == "aclmdlRIExecuteAsync"), "{calls:?}");
    let outer = b.end_capture(&main).unwrap();
    assert_eq!(outer.ops(), inner.ops());
    assert_eq!(b.download::<f32>(&main, &t).unwrap(), vec![0.0; 8], "captured, not run");
    launch_as_acl_model(&b, &main, &outer, true);
    assert_eq!(b.download::<f32>(&main, &t).unwrap(), vec![3.0; 8]);
}

/// Device memory of `bytes` bytes through the raw FFI.
fn device_alloc(bytes: usize) -> *mut c_void {
    let mut p = std::ptr::null_mut();
    // SAFETY: valid out-parameter.
    assert_eq!(unsafe { sys::aclrtMalloc(&mut p, bytes, sys::ACL_MEM_MALLOC_HUGE_FIRST) }, 0);
    p
}

fn stream() -> sys::aclrtStream {
    let mut s = std::ptr::null_mut();
    // SAFETY: valid out-parameter.
    assert_eq!(unsafe { sys::aclrtCreateStream(&mut s) }, 0);
    s
}

fn event(flags: u32) -> sys::aclrtEvent {
    let mut e = std::ptr::null_mut();
    // SAFETY: valid out-parameter.
    assert_eq!(unsafe { sys::aclrtCreateEventExWithFlag(&mut e, flags) }, 0);
    e
}

/// An f32 `[n]` descriptor over `addr`.
fn f32_tensor(addr: *mut c_void, n: usize) -> *mut sys::aclTensor {
    let (dims, strides) = ([n as i64], [1i64]);
    // SAFETY: arrays of one value each, a live device allocation of `n` f32.
    let t = unsafe {
        sys::aclCreateTensor(
            dims.as_ptr(),
            1,
            sys::ACL_FLOAT,
            strides.as_ptr(),
            0,
            sys::ACL_FORMAT_ND,
            dims.as_ptr(),
            1,
            addr,
        )
    };
    assert!(!t.is_null(), "{}", sys::recent_error());
    t
}

/// Phase one of `aclnnInplaceFillScalar(dst, value)`.
fn fill_executor(dst: *mut sys::aclTensor, value: f64) -> (*mut sys::aclOpExecutor, u64) {
    let mut v = value;
    // SAFETY: a live f64.
    let scalar = unsafe { sys::aclCreateScalar((&raw mut v).cast(), sys::ACL_DOUBLE) };
    let (mut ws, mut ex) = (0u64, std::ptr::null_mut());
    // SAFETY: live descriptors, valid out-parameters.
    let code =
        unsafe { sys::aclnnInplaceFillScalarGetWorkspaceSize(dst, scalar, &mut ws, &mut ex) };
    assert_eq!(code, 0, "{}", sys::recent_error());
    // SAFETY: created above; the executor keeps what it needs.
    unsafe { sys::aclDestroyScalar(scalar) };
    (ex, ws)
}

fn read_f32(s: sys::aclrtStream, addr: *mut c_void, n: usize) -> Vec<f32> {
    let mut host = vec![0f32; n];
    // SAFETY: `host` holds `n` f32 and outlives the synchronize below; `addr` is device memory.
    let code = unsafe {
        sys::aclrtMemcpyAsync(
            host.as_mut_ptr().cast(),
            n * 4,
            addr,
            n * 4,
            sys::ACL_MEMCPY_DEVICE_TO_HOST,
            s,
        )
    };
    assert_eq!(code, 0);
    // SAFETY: a live stream.
    assert_eq!(unsafe { sys::aclrtSynchronizeStream(s) }, 0, "{}", sys::recent_error());
    host
}

#[test]
fn a_wait_on_an_event_without_acl_event_sync_is_rejected() {
    let _init = backend(MxGemmPath::Auto);
    let (a, s) = (stream(), stream());
    let plain = event(0);
    // SAFETY: live event and streams.
    unsafe {
        assert_eq!(sys::aclrtRecordEvent(plain, a), 0);
        assert_eq!(sys::aclrtStreamWaitEvent(s, plain), sys::ACL_ERROR_RT_PARAM_INVALID);
    }
    assert!(sys::recent_error().contains("without ACL_EVENT_SYNC"), "{}", sys::recent_error());
    // The same wait on a SYNC event is accepted.
    let sync = event(sys::ACL_EVENT_SYNC);
    // SAFETY: as above.
    unsafe {
        assert_eq!(sys::aclrtRecordEvent(sync, a), 0);
        assert_eq!(sys::aclrtStreamWaitEvent(s, sync), 0);
        assert_eq!(sys::aclrtDestroyEvent(plain), 0);
        assert_eq!(sys::aclrtDestroyEvent(sync), 0);
    }
}

#[test]
fn an_executor_run_twice_without_being_made_repeatable_is_rejected() {
    let _init = backend(MxGemmPath::Auto);
    let s = stream();
    let mem = device_alloc(16);
    let t = f32_tensor(mem, 4);
    let (once, ws) = fill_executor(t, 2.5);
    let run = |ex| {
        // SAFETY: an executor from phase one, no workspace needed (ws = 0), a live stream.
        unsafe { sys::aclnnInplaceFillScalar(std::ptr::null_mut(), ws, ex, s) }
    };
    assert_eq!(ws, 0);
    assert_eq!(run(once), 0);
    assert_eq!(read_f32(s, mem, 4), vec![2.5; 4]);
    assert_eq!(run(once), sys::ACLNN_ERR_PARAM_INVALID);
    assert!(
        sys::recent_error().contains("aclSetAclOpExecutorRepeatable"),
        "{}",
        sys::recent_error()
    );

    // Made repeatable, it runs any number of times and is then destroyed by its owner.
    let (again, _) = fill_executor(t, -1.0);
    // SAFETY: a fresh executor.
    assert_eq!(unsafe { sys::aclSetAclOpExecutorRepeatable(again) }, 0);
    for _ in 0..3 {
        assert_eq!(run(again), 0);
    }
    assert_eq!(read_f32(s, mem, 4), vec![-1.0; 4]);
    // SAFETY: repeatable, not used after.
    unsafe {
        assert_eq!(sys::aclDestroyAclOpExecutor(again), 0);
        assert_eq!(sys::aclDestroyTensor(t), 0);
        assert_eq!(sys::aclrtFree(mem), 0);
    }
}

#[test]
fn capture_end_without_the_final_join_fails_with_the_acl_error() {
    let _init = backend(MxGemmPath::Auto);
    let (main, aux) = (stream(), stream());
    let mem = device_alloc(16);
    let t = f32_tensor(mem, 4);
    let capture = |join: bool| -> (sys::aclError, sys::aclmdlRI) {
        let (fork, joined) = (event(sys::ACL_EVENT_SYNC), event(sys::ACL_EVENT_SYNC));
        let (ex, _) = fill_executor(t, 7.0);
        let mut ri = std::ptr::null_mut();
        // SAFETY: live streams, events and executor; valid out-parameter.
        let end = unsafe {
            assert_eq!(sys::aclSetAclOpExecutorRepeatable(ex), 0);
            assert_eq!(sys::aclmdlRICaptureBegin(main, sys::ACL_MODEL_RI_CAPTURE_MODE_GLOBAL), 0);
            assert_eq!(sys::aclrtRecordEvent(fork, main), 0);
            assert_eq!(sys::aclrtStreamWaitEvent(aux, fork), 0);
            assert_eq!(sys::aclnnInplaceFillScalar(std::ptr::null_mut(), 0, ex, aux), 0);
            assert_eq!(sys::aclrtRecordEvent(joined, aux), 0);
            if join {
                assert_eq!(sys::aclrtStreamWaitEvent(main, joined), 0);
            }
            sys::aclmdlRICaptureEnd(main, &mut ri)
        };
        (end, ri)
    };
    let (end, _) = capture(false);
    assert_eq!(end, sys::ACL_ERROR_RT_STREAM_UNJOINED);
    assert!(sys::recent_error().contains("never joined back"), "{}", sys::recent_error());

    let (end, ri) = capture(true);
    assert_eq!(end, 0, "{}", sys::recent_error());
    // SAFETY: a live model and stream.
    unsafe { assert_eq!(sys::aclmdlRIExecuteAsync(ri, main), 0) };
    assert_eq!(read_f32(main, mem, 4), vec![7.0; 4]);
    // SAFETY: destroyed once.
    unsafe { assert_eq!(sys::aclmdlRIDestroy(ri), 0) };
}

/// A2/A3 path: `DynamicQuant` has no kernel there (no AscendC source, no aclnn op), so it is a
/// typed refusal before anything is queued; the MX GEMM's emulation (dequantize + bf16 GEMM) on
/// the natively quantized operands stays within bf16 rounding of the exact MX GEMM.
#[test]
fn mx_emulation_path_refuses_the_quant_and_matches_the_native_gemm() {
    let (native, emulated) = (backend(MxGemmPath::Native), backend(MxGemmPath::Emulated));
    assert!(native.raw().native_mx() && !emulated.raw().native_mx());
    let (m, n, k) = (6, 5, 96);
    let mut rng = Gen::new(3);
    let xs: Vec<bf16> = rng.normal_f32(m * k, 0.0, 2.0).into_iter().map(bf16::from_f32).collect();
    let ws: Vec<bf16> = rng.normal_f32(n * k, 0.0, 0.1).into_iter().map(bf16::from_f32).collect();
    // The operands, quantized by aclnnDynamicMxQuantV3 on the native backend.
    let s = native.new_stream().unwrap();
    let quant = |v: &[bf16], rows: usize| -> (Vec<F8E4M3>, Vec<E8M0>) {
        let x = native.alloc(DType::BF16, &[rows, k]).unwrap();
        native.upload(&s, &x, v).unwrap();
        let data = native.alloc(DType::E4M3, &[rows, k]).unwrap();
        let scale = native.alloc(DType::E8M0, &[rows, num_blocks(k)]).unwrap();
        let op = Op::DynamicQuant {
            x,
            data: data.clone(),
            scale: scale.clone(),
            alg: ScaleAlg::RoundUp,
        };
        native.launch(&s, op).unwrap();
        (native.download(&s, &data).unwrap(), native.download(&s, &scale).unwrap())
    };
    let (a, w) = (quant(&xs, m), quant(&ws, n));
    let gemm = |b: &Device<AscendBackend>| -> Vec<f64> {
        let s = b.new_stream().unwrap();
        let put = |(data, scale): &(Vec<F8E4M3>, Vec<E8M0>), rows: usize| {
            let d = b.alloc(DType::E4M3, &[rows, k]).unwrap();
            b.upload(&s, &d, data).unwrap();
            let sc = b.alloc(DType::E8M0, &[rows, num_blocks(k)]).unwrap();
            b.upload(&s, &sc, scale).unwrap();
            (d, sc)
        };
        let ((a, a_scale), (w, w_scale)) = (put(&a, m), put(&w, n));
        let y = b.alloc(DType::F32, &[m, n]).unwrap();
        b.launch(&s, Op::MxGemm { a, a_scale, w, w_scale, y: y.clone() }).unwrap();
        b.download::<f32>(&s, &y).unwrap().into_iter().map(f64::from).collect()
    };
    // Both operands dequantize exactly into bf16; only the f32 summation order differs.
    let (want, got) = (gemm(&native), gemm(&emulated));
    Tolerance::new(1e-5, 1e-5).assert_close(&[m, n], &got, &want);

    // The quant on the emulation path: refused, naming the op, the chip and the capability.
    let s = emulated.new_stream().unwrap();
    let x = emulated.alloc(DType::BF16, &[m, k]).unwrap();
    let data = emulated.alloc(DType::E4M3, &[m, k]).unwrap();
    let scale = emulated.alloc(DType::E8M0, &[m, num_blocks(k)]).unwrap();
    let from = kda_acl_emu::calls_of_this_thread().len();
    let op = Op::DynamicQuant { x, data, scale, alg: ScaleAlg::RoundUp };
    match emulated.launch(&s, op) {
        Err(Error::Unsupported { backend: "ascend", feature }) => {
            assert!(feature.starts_with("DynamicQuant on "), "{feature}");
            assert!(feature.contains(&emulated.raw().chip().soc), "{feature}");
            assert!(feature.contains("mx_quant is false"), "{feature}");
        }
        other => panic!("expected the typed refusal, got {other:?}"),
    }
    let calls = kda_acl_emu::calls_of_this_thread().split_off(from);
    assert_eq!(calls, Vec::new(), "nothing reached the runtime");
}
