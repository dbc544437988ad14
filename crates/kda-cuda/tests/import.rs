//! Device trials of what an engine hands kda on CUDA (`docs/embedding.md`): its device memory
//! as buffers (`import_buffer`), and its stream as the layer's main stream (`import_stream`),
//! eager and captured into the engine's own CUDA graph. The "engine" here is plain driver calls
//! through cudarc, as a C++ server or torch would make them. Without a CUDA device every trial
//! is reported ignored, by name; the host-side rules are unit tests (`kda_cuda::import`,
//! `kda_cuda::release`).
#![allow(clippy::expect_used, clippy::unwrap_used, reason = "test setup")]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use cudarc::driver::{CudaContext, result, sys};
use half::bf16;
use kda_core::{DType, Device, Error, Layout, Op, Tensor};
use kda_cuda::{CudaBackend, CudaOptions, CudaStream};
use kda_cuda_trials::{Check, Failed};
use kda_model::config::Tp;
use kda_model::layer::{BatchMeta, KdaLayer, LayerOptions, RequestSlots};
use kda_model::schedule::ProjectionSchedule;
use kda_testkit::conformance::layer::{Model, load, tiny_config};

type B = CudaBackend;

fn backend() -> Device<B> {
    CudaBackend::with_options(CudaOptions { checked: false, ..CudaOptions::default() })
        .expect("CUDA backend")
}

/// The engine's side: device 0's primary context (the one kda uses too).
fn engine() -> Arc<CudaContext> {
    CudaContext::new(0).expect("CUDA context")
}

/// Device memory the engine allocated and frees itself.
struct EngineMemory {
    ptr: u64,
    bytes: usize,
    ctx: Arc<CudaContext>,
}

impl EngineMemory {
    fn new(ctx: &Arc<CudaContext>, values: &[f32]) -> Self {
        ctx.bind_to_thread().unwrap();
        let bytes = std::mem::size_of_val(values);
        // SAFETY: a plain allocation, written once below, freed in `drop`.
        let ptr = unsafe { result::malloc_sync(bytes) }.unwrap();
        // SAFETY: `bytes` bytes at `ptr`.
        unsafe { result::memcpy_htod_sync(ptr, values) }.unwrap();
        Self { ptr, bytes, ctx: ctx.clone() }
    }

    fn read(&self) -> Vec<f32> {
        self.ctx.bind_to_thread().unwrap();
        self.ctx.synchronize().unwrap();
        let mut out = vec![0f32; self.bytes / 4];
        // SAFETY: `bytes` bytes at `ptr`; the device is idle.
        unsafe { result::memcpy_dtoh_sync(&mut out, self.ptr) }.unwrap();
        out
    }
}

impl Drop for EngineMemory {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: allocated in `new`, freed once.
        let _ = unsafe { result::free_sync(self.ptr) };
    }
}

/// A keep-alive owner that says when kda dropped it.
struct Owner(Arc<AtomicBool>);

impl Drop for Owner {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

fn import(b: &Device<B>, m: &EngineMemory, at: u64, bytes: usize) -> (Tensor<B>, Arc<AtomicBool>) {
    let dropped = Arc::new(AtomicBool::new(false));
    // SAFETY: `bytes` bytes of the engine's device memory at `m.ptr + at`, alive until the test
    // frees `m` (after kda has dropped the buffer), not touched by the engine meanwhile.
    let buffer = unsafe {
        b.import_buffer((m.ptr + at) as *mut u8, bytes, Box::new(Owner(dropped.clone())))
    }
    .unwrap();
    let layout = Layout::contiguous(DType::F32, &[bytes / 4]);
    (Tensor::new(buffer, layout).unwrap(), dropped)
}

/// kda reads and writes the engine's memory in place, never frees it, and drops the owner with
/// the last handle.
fn imported_memory_is_used_in_place_and_never_freed() -> Result<(), Failed> {
    let b = backend();
    let s = b.new_stream()?;
    let ctx = engine();
    let values: Vec<f32> = (0..64).map(|i| i as f32 * 0.5).collect();
    let m = EngineMemory::new(&ctx, &values);
    // A slice of the allocation: elements 16..48.
    let (t, dropped) = import(&b, &m, 64, 128);
    if b.download::<f32>(&s, &t)? != values[16..48] {
        return Err("kda did not read the engine's memory in place".into());
    }
    b.launch(&s, Op::Fill { dst: t.clone(), value: -2.0 })?;
    b.synchronize(&s)?;
    drop(t);
    b.synchronize(&s)?;
    if !dropped.load(Ordering::SeqCst) {
        return Err("the owner outlived the last handle".into());
    }
    let mut want = values.clone();
    want[16..48].iter_mut().for_each(|x| *x = -2.0);
    // Still the engine's, still allocated: kda wrote it and did not free it.
    if m.read() != want {
        return Err("the engine's memory does not hold kda's writes".into());
    }
    Ok(())
}

/// What the driver knows refuses imports past the allocation, of host memory, and misaligned.
fn imports_the_driver_does_not_back_are_refused() -> Result<(), Failed> {
    let b = backend();
    let m = EngineMemory::new(&engine(), &[0.0; 16]);
    let refused = |ptr: u64, len: usize, param: &str| -> Result<(), Failed> {
        // SAFETY: refused before any use (that is what is checked).
        match unsafe { b.import_buffer(ptr as *mut u8, len, Box::new(())) } {
            Err(Error::Param { op: "import_buffer", param: p, .. }) if p == param => Ok(()),
            other => {
                Err(format!("import of {ptr:#x}+{len}: expected {param} refused, got {other:?}")
                    .into())
            }
        }
    };
    refused(m.ptr + 32, 64, "len")?;
    refused(m.ptr + 2, 8, "ptr")?;
    let host = [0f32; 16];
    refused(host.as_ptr() as u64, 64, "ptr")?;
    Ok(())
}

/// A layer on an engine's stream (the overlapped schedule forks its auxiliary stream from it
/// and joins back): the engine's work before is seen, its work after sees kda's output, and
/// only the engine's stream is synchronized. Equal bit for bit to the same step on kda's own
/// stream.
fn a_layer_on_the_engines_stream_is_ordered_with_the_engine() -> Result<(), Failed> {
    let EngineSetup { b, own, ctx, engine_stream, raw, s, layer, hidden } = engine_setup()?;
    let rows = 4;
    let x = bf16_tensor(&b, &own, &[rows, hidden], 5);
    let meta = BatchMeta::prefills(&[rows], &[0]);
    let mut want = b.alloc(DType::F32, &[rows, hidden])?;
    let mut caches = [layer.new_cache(&own, 1, 0)?, layer.new_cache(&own, 1, 0)?];
    layer.forward(&own, &x, &meta, &mut caches[0], &mut want)?;
    b.synchronize(&own)?;
    // The output is the engine's memory.
    let out = EngineMemory::new(&ctx, &vec![0.0; rows * hidden]);
    let (got, _) = import(&b, &out, 0, rows * hidden * 4);
    let mut got = got.reshape(&[rows, hidden])?;
    let out_ptr = out.ptr;
    // The engine's work before: clobber the output on its stream; kda must run after it.
    // SAFETY: `out` holds rows·hidden f32 on this device; ordered on the engine's stream.
    unsafe { sys::cuMemsetD32Async(out_ptr, 0x7fc0_0000, rows * hidden, raw) }.result()?;
    layer.forward(&s, &x, &meta, &mut caches[1], &mut got)?;
    let mut host = vec![0f32; rows * hidden];
    // SAFETY: the engine's work after, on its stream; then only that stream is synchronized.
    unsafe { result::memcpy_dtoh_async(&mut host, out_ptr, raw) }?;
    engine_stream.synchronize()?;
    let want = b.download::<f32>(&own, &want)?;
    if host.iter().map(|x| x.to_bits()).ne(want.iter().map(|x| x.to_bits())) {
        return Err("the layer on the engine's stream differs from kda's own stream".into());
    }
    Ok(())
}

/// A decode step the engine captures into its own CUDA graph (its stream, global mode, kda
/// forking and joining its auxiliary stream inside), replayed twice, equals two eager steps bit
/// for bit, output and state.
fn an_engines_capture_replayed_twice_equals_eager_steps() -> Result<(), Failed> {
    let EngineSetup { b, own, ctx: _, engine_stream, raw, s, layer, hidden } = engine_setup()?;
    let prompt = bf16_tensor(&b, &own, &[12, hidden], 1);
    let x = bf16_tensor(&b, &own, &[2, hidden], 2);
    let mut meta = BatchMeta::empty();
    meta.push(1, 6, RequestSlots::Single(0)).push(1, 6, RequestSlots::Single(1));
    let mut caches = [layer.new_cache(&own, 2, 0)?, layer.new_cache(&own, 2, 0)?];
    for c in &mut caches {
        let mut warm = b.alloc(DType::F32, &[12, hidden])?;
        layer.forward(&own, &prompt, &BatchMeta::prefills(&[6, 6], &[0, 1]), c, &mut warm)?;
    }
    b.synchronize(&own)?;
    let [eager_cache, graph_cache] = &mut caches;
    let (mut eager_out, mut graph_out) =
        (b.alloc(DType::F32, &[2, hidden])?, b.alloc(DType::F32, &[2, hidden])?);
    // One eager call on the engine's stream first, as engines warm up before capturing.
    let mut scratch_cache = layer.new_cache(&own, 2, 0)?;
    let mut scratch_out = b.alloc(DType::F32, &[2, hidden])?;
    b.synchronize(&own)?;
    layer.forward(&s, &x, &meta, &mut scratch_cache, &mut scratch_out)?;
    engine_stream.synchronize()?;

    let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL;
    // SAFETY: the engine's live stream, not capturing.
    unsafe { sys::cuStreamBeginCapture_v2(raw, mode) }.result()?;
    let captured = layer.forward(&s, &x, &meta, graph_cache, &mut graph_out);
    let mut graph: sys::CUgraph = std::ptr::null_mut();
    // SAFETY: ends the capture begun above; `graph` receives it.
    let ended = unsafe { sys::cuStreamEndCapture(raw, &mut graph) }.result();
    captured?;
    ended?;
    let mut exec: sys::CUgraphExec = std::ptr::null_mut();
    // SAFETY: `graph` is the capture's graph.
    unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0) }.result()?;
    let bits = |t: &Tensor<B>| -> Result<Vec<u32>, Failed> {
        Ok(b.download::<f32>(&own, t)?.into_iter().map(f32::to_bits).collect())
    };
    for step in 0..2 {
        layer.forward(&own, &x, &meta, eager_cache, &mut eager_out)?;
        // SAFETY: the instantiated graph on the engine's stream.
        unsafe { sys::cuGraphLaunch(exec, raw) }.result()?;
        engine_stream.synchronize()?;
        b.synchronize(&own)?;
        if bits(&eager_out)? != bits(&graph_out)? {
            return Err(format!("step {step}: the engine's graph output differs from eager").into());
        }
        if bits(eager_cache.recurrent())? != bits(graph_cache.recurrent())?
            || bits(eager_cache.conv())? != bits(graph_cache.conv())?
        {
            return Err(format!("step {step}: the engine's graph state differs from eager").into());
        }
    }
    // SAFETY: destroyed once, after the last launch completed.
    unsafe {
        sys::cuGraphExecDestroy(exec);
        sys::cuGraphDestroy(graph);
    }
    Ok(())
}

/// A backend with a stream of its own, the engine's context and stream (`raw`) imported as `s`,
/// and the tiny K3 layer (overlapped schedule) with its hidden size.
struct EngineSetup {
    b: Device<B>,
    own: CudaStream,
    ctx: Arc<CudaContext>,
    engine_stream: Arc<cudarc::driver::CudaStream>,
    raw: sys::CUstream,
    s: CudaStream,
    layer: KdaLayer<B>,
    hidden: usize,
}

fn engine_setup() -> Result<EngineSetup, Failed> {
    let b = backend();
    let own = b.new_stream()?;
    let ctx = engine();
    let engine_stream = ctx.new_stream()?;
    let raw = engine_stream.cu_stream();
    // SAFETY: the engine's stream lives as long as the setup, and the trial synchronizes it
    // before dropping it.
    let s = unsafe { b.import_stream(raw as usize) }?;
    let w = load(&tiny_config(Model::K3), Tp::SINGLE, 3);
    let options =
        LayerOptions { schedule: Some(ProjectionSchedule::Overlapped), ..LayerOptions::default() };
    let layer = KdaLayer::new(&b, &own, &w, options)?;
    let hidden = layer.dims().hidden;
    Ok(EngineSetup { b, own, ctx, engine_stream, raw, s, layer, hidden })
}

/// A bf16 tensor of `shape` with seeded values in [-1, 1).
fn bf16_tensor(b: &Device<B>, s: &CudaStream, shape: &[usize], seed: u64) -> Tensor<B> {
    let n: usize = shape.iter().product();
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let values: Vec<bf16> = (0..n)
        .map(|_| {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            bf16::from_f32(((state >> 40) as f32) / (1u64 << 23) as f32 - 1.0)
        })
        .collect();
    let t = b.alloc(DType::BF16, shape).unwrap();
    b.upload(s, &t, &values).unwrap();
    t
}

fn main() {
    let unavailable = CudaBackend::new().err().map(|e| e.to_string());
    if let Some(why) = &unavailable {
        eprintln!("kda-cuda import trials: every trial is ignored: {why}");
    }
    let checks: &[(&str, Check)] = &[
        (
            "imported_memory_is_used_in_place_and_never_freed",
            imported_memory_is_used_in_place_and_never_freed,
        ),
        (
            "imports_the_driver_does_not_back_are_refused",
            imports_the_driver_does_not_back_are_refused,
        ),
        (
            "a_layer_on_the_engines_stream_is_ordered_with_the_engine",
            a_layer_on_the_engines_stream_is_ordered_with_the_engine,
        ),
        (
            "an_engines_capture_replayed_twice_equals_eager_steps",
            an_engines_capture_replayed_twice_equals_eager_steps,
        ),
    ];
    kda_cuda_trials::run(kda_cuda_trials::checks(unavailable.as_deref(), checks));
}
