//! An engine's `aclrtStream` as the layer's main stream (`import_stream`,
//! docs/embedding.md#streams-the-engines-on-a-device), over the emulated ACL runtime. The
//! "engine" is plain ACL calls on its own stream, as torch_npu or a C++ server would make them:
//! the layer is ordered with the engine's work before and after it, nothing is synchronized or
//! queried while the engine captures (the emulator refuses both with CANN's codes), an engine's
//! capture of a decode step replays as eager steps, and what queued work holds is released in
//! stream order.
#![cfg(feature = "emulated")]
#![allow(clippy::expect_used, clippy::unwrap_used, reason = "tests")]

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use half::bf16;
use kda_ascend::{AscendBackend, AscendOptions, sys};
use kda_core::{DType, Device, Error, Layout, Op, Tensor};
use kda_model::config::Tp;
use kda_model::layer::{BatchMeta, KdaLayer, LayerOptions, RequestSlots};
use kda_model::schedule::ProjectionSchedule;
use kda_reference::{ReferenceBackend, ReferenceOptions};
use kda_testkit::conformance::layer::{Model, load, tiny_config};
use kda_testkit::{Gen, Tolerance};

type B = AscendBackend;

fn backend() -> Device<B> {
    AscendBackend::with_options(AscendOptions { checked: false, ..AscendOptions::default() })
        .unwrap()
}

/// The engine's own stream, destroyed by the engine (after kda's handles are gone).
struct EngineStream(sys::aclrtStream);

impl EngineStream {
    fn new() -> Self {
        let mut s: sys::aclrtStream = std::ptr::null_mut();
        // SAFETY: a valid out-parameter.
        assert_eq!(unsafe { sys::aclrtCreateStream(&mut s) }, 0, "aclrtCreateStream");
        EngineStream(s)
    }

    fn synchronize(&self) {
        // SAFETY: the engine's live stream.
        assert_eq!(unsafe { sys::aclrtSynchronizeStream(self.0) }, 0, "aclrtSynchronizeStream");
    }
}

impl Drop for EngineStream {
    fn drop(&mut self) {
        // SAFETY: created above, destroyed once.
        unsafe { sys::aclrtDestroyStream(self.0) };
    }
}

// SAFETY: an ACL stream handle may be used from any thread.
unsafe impl Send for EngineStream {}
// SAFETY: as for `Send`.
unsafe impl Sync for EngineStream {}

/// Pinned host memory of the engine.
struct Pinned(*mut f32, usize);

impl Pinned {
    fn new(n: usize) -> Self {
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: a valid out-parameter.
        assert_eq!(unsafe { sys::aclrtMallocHost(&mut p, n * 4) }, 0);
        Pinned(p.cast(), n)
    }

    fn slice(&mut self) -> &mut [f32] {
        // SAFETY: `n` f32 allocated above, used by no queued copy while borrowed here (the
        // tests synchronize the engine's stream first).
        unsafe { std::slice::from_raw_parts_mut(self.0, self.1) }
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: allocated by `aclrtMallocHost`, freed once.
        unsafe { sys::aclrtFreeHost(self.0.cast()) };
    }
}

/// A gate the engine's host function waits on (the engine holding its stream).
type Gate = Arc<(Mutex<bool>, Condvar)>;

unsafe extern "C" fn wait_gate(args: *mut c_void) {
    // SAFETY: `args` is the `Gate` passed by `hold`, alive until the stream has run this.
    let gate = unsafe { &*args.cast::<(Mutex<bool>, Condvar)>() };
    let open = gate.0.lock().unwrap();
    let _open = gate.1.wait_while(open, |o| !*o).unwrap();
}

/// The engine holds its stream until `open` (a host function of its own).
fn hold(stream: &EngineStream, gate: &Gate) {
    let args = Arc::as_ptr(gate).cast_mut().cast::<c_void>();
    // SAFETY: a live stream; the gate outlives the host function (the tests open it and
    // synchronize the stream before dropping it).
    assert_eq!(unsafe { sys::aclrtLaunchHostFunc(stream.0, Some(wait_gate), args) }, 0);
}

fn open(gate: &Gate) {
    *gate.0.lock().unwrap() = true;
    gate.1.notify_all();
}

fn overlapped() -> LayerOptions {
    LayerOptions { schedule: Some(ProjectionSchedule::Overlapped), ..LayerOptions::default() }
}

fn bf16_values(n: usize, seed: u64) -> Vec<bf16> {
    Gen::new(seed).normal_f32(n, 0.0, 1.0).into_iter().map(bf16::from_f32).collect()
}

/// A prefill on the engine's stream (overlapped: kda forks its auxiliary stream from it and
/// joins back): the engine's write before it (behind the engine's own host function, so it
/// lands late) is overwritten by kda, its copy after it sees kda's output, and only the
/// engine's stream is synchronized. The output equals the reference layer's.
#[test]
fn a_layer_on_the_engines_stream_is_ordered_with_the_engine_and_equals_the_reference() {
    let b = backend();
    let own = b.new_stream().unwrap();
    let engine = EngineStream::new();
    // SAFETY: the engine's stream outlives `s` (dropped at the end of the test, after it).
    let s = unsafe { b.import_stream(engine.0 as usize) }.unwrap();
    let w = load(&tiny_config(Model::K3), Tp::SINGLE, 5);
    let hidden = w.dims.hidden;
    let rows = 5;
    let layer = KdaLayer::new(&b, &own, &w, overlapped()).unwrap();
    let values = bf16_values(rows * hidden, 6);
    let x = b.alloc(DType::BF16, &[rows, hidden]).unwrap();
    b.upload(&own, &x, &values).unwrap();
    let mut cache = layer.new_cache(&own, 1, 0).unwrap();
    b.synchronize(&own).unwrap();

    // The engine's output memory, imported.
    let mut out_ptr: *mut c_void = std::ptr::null_mut();
    // SAFETY: a valid out-parameter.
    let code = unsafe { sys::aclrtMalloc(&mut out_ptr, rows * hidden * 4, 0) };
    assert_eq!(code, 0);
    let freed = Arc::new(AtomicBool::new(false));
    struct Owner(usize, Arc<AtomicBool>);
    impl Drop for Owner {
        fn drop(&mut self) {
            // SAFETY: allocated above, freed once, when kda's last handle is gone.
            unsafe { sys::aclrtFree(self.0 as *mut c_void) };
            self.1.store(true, Ordering::SeqCst);
        }
    }
    let owner = Box::new(Owner(out_ptr as usize, Arc::clone(&freed)));
    // SAFETY: rows·hidden f32 of this device, alive until `owner` drops; the engine touches it
    // only on its stream, ordered with kda's work there.
    let buf = unsafe { b.import_buffer(out_ptr.cast(), rows * hidden * 4, owner) }.unwrap();
    let mut out = Tensor::new(buf, Layout::contiguous(DType::F32, &[rows, hidden])).unwrap();

    // The engine's work before: behind its own host function, a NaN fill of the output.
    let gate: Gate = Arc::default();
    hold(&engine, &gate);
    let mut nan = Pinned::new(rows * hidden);
    nan.slice().fill(f32::NAN);
    // SAFETY: pinned source and device destination of rows·hidden f32, alive until the stream
    // is synchronized.
    let code = unsafe {
        sys::aclrtMemcpyAsync(
            out_ptr,
            rows * hidden * 4,
            nan.0.cast(),
            rows * hidden * 4,
            sys::ACL_MEMCPY_HOST_TO_DEVICE,
            engine.0,
        )
    };
    assert_eq!(code, 0);
    layer.forward(&s, &x, &BatchMeta::prefills(&[rows], &[0]), &mut cache, &mut out).unwrap();
    // The engine's work after: a copy of the output back to its host memory.
    let mut host = Pinned::new(rows * hidden);
    // SAFETY: as above, device to host.
    let code = unsafe {
        sys::aclrtMemcpyAsync(
            host.0.cast(),
            rows * hidden * 4,
            out_ptr,
            rows * hidden * 4,
            sys::ACL_MEMCPY_DEVICE_TO_HOST,
            engine.0,
        )
    };
    assert_eq!(code, 0);
    open(&gate);
    engine.synchronize();

    // The reference layer on the same weights and input.
    let r = ReferenceBackend::with_options(ReferenceOptions::default()).unwrap();
    let rs = r.new_stream().unwrap();
    let rlayer = KdaLayer::new(&r, &rs, &w, overlapped()).unwrap();
    let rx = r.alloc(DType::BF16, &[rows, hidden]).unwrap();
    r.upload(&rs, &rx, &values).unwrap();
    let mut rcache = rlayer.new_cache(&rs, 1, 0).unwrap();
    let mut rout = r.alloc(DType::F32, &[rows, hidden]).unwrap();
    rlayer.forward(&rs, &rx, &BatchMeta::prefills(&[rows], &[0]), &mut rcache, &mut rout).unwrap();
    let want = r.download::<f32>(&rs, &rout).unwrap();
    let got = host.slice().to_vec();
    assert!(got.iter().all(|v| v.is_finite()), "the engine's NaN fill landed after kda's output");
    let max = want.iter().fold(0f64, |m, v| m.max(f64::from(v.abs())));
    Tolerance::new(1.0 / 256.0, max / 256.0).assert_close(&[rows, hidden], &got, &want);
    drop((out, s));
    drop(layer);
    drop(cache);
    assert!(freed.load(Ordering::SeqCst), "the engine's memory is released with kda's handles");
}

/// A decode step the engine captures into its own model (`aclmdlRICaptureBegin` on its stream,
/// kda forking and joining its auxiliary stream inside): under the capture kda synchronizes
/// and queries nothing (the emulator refuses both), a synchronize or a download asked of it is
/// a typed error, and the model replayed twice equals two eager steps bit for bit, output and
/// state.
#[test]
fn an_engines_capture_of_a_decode_step_replayed_twice_equals_eager_steps() {
    let b = backend();
    let own = b.new_stream().unwrap();
    let engine = EngineStream::new();
    // SAFETY: the engine's stream outlives `s`.
    let s = unsafe { b.import_stream(engine.0 as usize) }.unwrap();
    let w = load(&tiny_config(Model::K3), Tp::SINGLE, 7);
    let hidden = w.dims.hidden;
    let layer = KdaLayer::new(&b, &own, &w, overlapped()).unwrap();
    let upload = |shape: &[usize], seed| {
        let t = b.alloc(DType::BF16, shape).unwrap();
        b.upload(&own, &t, &bf16_values(shape.iter().product(), seed)).unwrap();
        t
    };
    let prompt = upload(&[12, hidden], 1);
    let x = upload(&[2, hidden], 2);
    let mut meta = BatchMeta::empty();
    meta.push(1, 6, RequestSlots::Single(0)).push(1, 6, RequestSlots::Single(1));
    let mut caches = [layer.new_cache(&own, 2, 0).unwrap(), layer.new_cache(&own, 2, 0).unwrap()];
    for c in &mut caches {
        let mut warm = b.alloc(DType::F32, &[12, hidden]).unwrap();
        layer.forward(&own, &prompt, &BatchMeta::prefills(&[6, 6], &[0, 1]), c, &mut warm).unwrap();
    }
    b.synchronize(&own).unwrap();
    let [eager_cache, graph_cache] = &mut caches;
    let mut eager_out = b.alloc(DType::F32, &[2, hidden]).unwrap();
    let mut graph_out = b.alloc(DType::F32, &[2, hidden]).unwrap();
    // One eager call on the engine's stream first, as engines warm up before capturing.
    let mut scratch_cache = layer.new_cache(&own, 2, 0).unwrap();
    let mut scratch_out = b.alloc(DType::F32, &[2, hidden]).unwrap();
    b.synchronize(&own).unwrap();
    layer.forward(&s, &x, &meta, &mut scratch_cache, &mut scratch_out).unwrap();
    engine.synchronize();

    // SAFETY: the engine's live stream, not capturing.
    let code =
        unsafe { sys::aclmdlRICaptureBegin(engine.0, sys::ACL_MODEL_RI_CAPTURE_MODE_GLOBAL) };
    assert_eq!(code, 0);
    let captured = layer.forward(&s, &x, &meta, graph_cache, &mut graph_out);
    let sync = b.synchronize(&s);
    let download = b.download::<f32>(&s, &graph_out);
    let mut model: sys::aclmdlRI = std::ptr::null_mut();
    // SAFETY: ends the capture begun above; `model` receives it.
    let ended = unsafe { sys::aclmdlRICaptureEnd(engine.0, &mut model) };
    captured.unwrap();
    assert_eq!(ended, 0, "the engine's capture ends (kda joined its auxiliary stream back)");
    for (what, result) in [("synchronize", sync.err()), ("download", download.err())] {
        match result {
            Some(Error::Unsupported { backend: "ascend", feature }) => {
                assert!(feature.contains("capturing") || feature.contains("capture"), "{feature}")
            }
            other => panic!("a {what} under the engine's capture: expected Unsupported, {other:?}"),
        }
    }
    let bits = |t: &Tensor<B>| -> Vec<u32> {
        b.download::<f32>(&own, t).unwrap().into_iter().map(f32::to_bits).collect()
    };
    for step in 0..2 {
        // The engine's eager work between replays: kda's next call on its stream releases what
        // it may, never what the model uses.
        layer.forward(&s, &x, &meta, &mut scratch_cache, &mut scratch_out).unwrap();
        engine.synchronize();
        layer.forward(&own, &x, &meta, eager_cache, &mut eager_out).unwrap();
        // SAFETY: the engine's model on its stream.
        assert_eq!(unsafe { sys::aclmdlRIExecuteAsync(model, engine.0) }, 0);
        engine.synchronize();
        b.synchronize(&own).unwrap();
        let eager = bits(&eager_out);
        assert!(eager.iter().all(|&v| f32::from_bits(v).is_finite()), "step {step}");
        assert_eq!(bits(&graph_out), eager, "step {step}: output");
        for (g, e) in [
            (graph_cache.recurrent(), eager_cache.recurrent()),
            (graph_cache.conv(), eager_cache.conv()),
        ] {
            assert_eq!(bits(g), bits(e), "step {step}: state");
        }
    }
    // SAFETY: destroyed once, after its last launch completed.
    assert_eq!(unsafe { sys::aclmdlRIDestroy(model) }, 0);
}

/// What work on the engine's stream holds is released in stream order: not while the stream
/// has not reached the work (the engine holds it), at the first call after it has, and with no
/// synchronize by kda; dropping kda's handles leaves the engine's stream alive.
#[test]
fn work_on_the_engines_stream_is_released_in_stream_order() {
    let b = backend();
    let engine = EngineStream::new();
    // SAFETY: the engine's stream outlives `s`.
    let s = unsafe { b.import_stream(engine.0 as usize) }.unwrap();
    let mut p: *mut c_void = std::ptr::null_mut();
    // SAFETY: a valid out-parameter.
    assert_eq!(unsafe { sys::aclrtMalloc(&mut p, 64, 0) }, 0);
    let released = Arc::new(AtomicBool::new(false));
    struct Owner(usize, Arc<AtomicBool>);
    impl Drop for Owner {
        fn drop(&mut self) {
            // SAFETY: allocated above, freed once.
            unsafe { sys::aclrtFree(self.0 as *mut c_void) };
            self.1.store(true, Ordering::SeqCst);
        }
    }
    let owner = Box::new(Owner(p as usize, Arc::clone(&released)));
    // SAFETY: 64 bytes of this device, alive until `owner` drops.
    let buf = unsafe { b.import_buffer(p.cast(), 64, owner) }.unwrap();
    let t = Tensor::new(buf, Layout::contiguous(DType::F32, &[16])).unwrap();
    let other = b.alloc(DType::F32, &[16]).unwrap();

    let gate: Gate = Arc::default();
    hold(&engine, &gate);
    b.launch(&s, Op::Fill { dst: t.clone(), value: 2.0 }).unwrap();
    drop(t);
    // A later call on the stream marks the fill's batch; the stream has not reached it.
    b.launch(&s, Op::Fill { dst: other.clone(), value: 1.0 }).unwrap();
    b.launch(&s, Op::Fill { dst: other.clone(), value: 3.0 }).unwrap();
    assert!(!released.load(Ordering::SeqCst), "released before the stream ran the fill");
    open(&gate);
    engine.synchronize();
    // The stream has passed the mark: the next call releases the fill's handles.
    b.launch(&s, Op::Fill { dst: other.clone(), value: 4.0 }).unwrap();
    assert!(released.load(Ordering::SeqCst), "not released once the stream passed the fill");
    engine.synchronize();
    assert_eq!(b.download::<f32>(&s, &other).unwrap(), vec![4.0; 16]);
    // kda's handles gone, the stream is still the engine's: kda never destroys it.
    drop((s, other, b));
    engine.synchronize();
}

/// An import is checked: a null handle, and a stream under capture, are refused by name.
#[test]
fn imports_of_null_or_capturing_streams_are_refused() {
    let b = backend();
    // SAFETY: a null handle is refused before use.
    match unsafe { b.import_stream(0) } {
        Err(Error::Param { op: "import_stream", param: "handle", actual, .. }) => {
            assert_eq!(actual, "null")
        }
        other => panic!("expected a Param error, got {other:?}"),
    }
    let engine = EngineStream::new();
    // SAFETY: the engine's live stream.
    let code =
        unsafe { sys::aclmdlRICaptureBegin(engine.0, sys::ACL_MODEL_RI_CAPTURE_MODE_RELAXED) };
    assert_eq!(code, 0);
    // SAFETY: a live stream (refused: it is capturing).
    let refused = unsafe { b.import_stream(engine.0 as usize) };
    let mut model: sys::aclmdlRI = std::ptr::null_mut();
    // SAFETY: ends the capture begun above.
    let ended = unsafe { sys::aclmdlRICaptureEnd(engine.0, &mut model) };
    match refused {
        Err(Error::Param { op: "import_stream", actual, .. }) => {
            assert!(actual.contains("under capture"), "{actual}")
        }
        other => panic!("expected a Param error, got {other:?}"),
    }
    if ended == 0 {
        // SAFETY: the empty capture's model, destroyed once.
        unsafe { sys::aclmdlRIDestroy(model) };
    }
}

/// A buffer freed on the engine's stream while the engine captures it stays with the model (its
/// replays write it): its block is not handed out again, so a later tensor is not clobbered by
/// a replay.
#[test]
fn a_block_freed_under_the_engines_capture_stays_with_the_model() {
    let b = backend();
    let own = b.new_stream().unwrap();
    let engine = EngineStream::new();
    // SAFETY: the engine's stream outlives `s`.
    let s = unsafe { b.import_stream(engine.0 as usize) }.unwrap();
    let n = 1024;
    let t = b.alloc(DType::F32, &[n]).unwrap();
    // SAFETY: the engine's live stream, not capturing.
    let code =
        unsafe { sys::aclmdlRICaptureBegin(engine.0, sys::ACL_MODEL_RI_CAPTURE_MODE_GLOBAL) };
    assert_eq!(code, 0);
    let filled = b.launch(&s, Op::Fill { dst: t.clone(), value: 1.0 });
    let freed = b.free(&s, t.buffer().clone());
    drop(t);
    let mut model: sys::aclmdlRI = std::ptr::null_mut();
    // SAFETY: ends the capture begun above.
    let ended = unsafe { sys::aclmdlRICaptureEnd(engine.0, &mut model) };
    filled.unwrap();
    freed.unwrap();
    assert_eq!(ended, 0);
    // The engine's eager work after the capture: kda's calls on its stream release what the
    // stream has passed, never what the model holds.
    let other = b.alloc(DType::F32, &[16]).unwrap();
    b.launch(&s, Op::Fill { dst: other.clone(), value: 0.0 }).unwrap();
    engine.synchronize();
    b.launch(&s, Op::Fill { dst: other.clone(), value: 0.0 }).unwrap();
    engine.synchronize();
    // Every block of this size the allocator hands out now is a fresh one.
    let later: Vec<Tensor<B>> = (0..4).map(|_| b.alloc(DType::F32, &[n]).unwrap()).collect();
    for l in &later {
        b.launch(&own, Op::Fill { dst: l.clone(), value: 5.0 }).unwrap();
    }
    b.synchronize(&own).unwrap();
    for _ in 0..2 {
        // SAFETY: the engine's model on its stream.
        assert_eq!(unsafe { sys::aclmdlRIExecuteAsync(model, engine.0) }, 0);
        engine.synchronize();
    }
    for l in &later {
        assert_eq!(b.download::<f32>(&own, l).unwrap(), vec![5.0; n], "a replay clobbered it");
    }
    // SAFETY: destroyed once, after its last launch completed.
    assert_eq!(unsafe { sys::aclmdlRIDestroy(model) }, 0);
}
