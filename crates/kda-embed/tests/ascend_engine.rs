//! `backend="ascend"` on an engine's memory and `aclrtStream` (what kda-py's `stream=` and the
//! C API's engine stream reach), over the emulated ACL runtime: a prefill and a decode step
//! queued on the engine's stream between the engine's own copies, equal to the plain Rust API on
//! the reference backend within the layer tolerance, with only the engine's stream
//! synchronized. Run with `--features ascend-emulated`.
#![cfg(feature = "ascend-emulated")]
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test setup")]

use std::ffi::c_void;
use std::path::PathBuf;

use kda_ascend::sys;
use kda_core::DType;
use kda_embed::testing::{LayerSpec, Step, reference_run, write_synthetic_checkpoint};
use kda_embed::{
    BatchArgs, Cache, CacheLayout, ForeignArray, Import, Layer, LayerInfo, Memory, Runtime,
};
use kda_model::schedule::ProjectionSchedule;
use kda_testkit::Tolerance;

/// Device memory the engine allocated (`aclrtMalloc`), freed by the engine.
struct DeviceBlock(usize);

impl DeviceBlock {
    fn new(bytes: usize) -> Self {
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: a valid out-parameter and size.
        let code = unsafe { sys::aclrtMalloc(&mut p, bytes, sys::ACL_MEM_MALLOC_HUGE_FIRST) };
        assert_eq!(code, 0, "aclrtMalloc");
        DeviceBlock(p as usize)
    }
}

impl Drop for DeviceBlock {
    fn drop(&mut self) {
        // SAFETY: allocated above, freed once (after the engine's stream was synchronized).
        unsafe { sys::aclrtFree(self.0 as *mut c_void) };
    }
}

/// Pinned host memory of the engine, for its asynchronous copies.
struct Pinned(usize, usize);

impl Pinned {
    fn new(values: &[f32]) -> Self {
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: a valid out-parameter.
        assert_eq!(unsafe { sys::aclrtMallocHost(&mut p, values.len() * 4) }, 0);
        // SAFETY: `values.len()` f32 just allocated.
        unsafe { std::slice::from_raw_parts_mut(p.cast::<f32>(), values.len()) }
            .copy_from_slice(values);
        Pinned(p as usize, values.len())
    }

    fn read(&self) -> Vec<f32> {
        // SAFETY: `len` f32, no copy in flight (the engine's stream was synchronized).
        unsafe { std::slice::from_raw_parts(self.0 as *const f32, self.1) }.to_vec()
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: allocated by `aclrtMallocHost`, freed once.
        unsafe { sys::aclrtFreeHost(self.0 as *mut c_void) };
    }
}

fn copy(
    dst: usize,
    src: usize,
    bytes: usize,
    kind: sys::aclrtMemcpyKind,
    stream: sys::aclrtStream,
) {
    // SAFETY: both ends hold `bytes` bytes and stay alive until the stream is synchronized.
    let code = unsafe {
        sys::aclrtMemcpyAsync(dst as *mut c_void, bytes, src as *const c_void, bytes, kind, stream)
    };
    assert_eq!(code, 0, "aclrtMemcpyAsync");
}

fn device_array(block: &DeviceBlock, shape: &[usize]) -> ForeignArray {
    // SAFETY: the block holds the shape's f32 and outlives the runtime's use of it (the test
    // synchronizes the engine's stream before dropping it); the engine orders its copies on the
    // same stream.
    unsafe {
        ForeignArray::new(
            block.0 as *mut u8,
            DType::F32,
            shape.to_vec(),
            None,
            Memory::Device { backend: "ascend", device: 0 },
            Box::new(()),
        )
    }
    .unwrap()
}

fn values(n: usize, seed: u64) -> Vec<f32> {
    kda_synth::Gen::new(seed).uniform_f32(n, -0.5, 0.5)
}

/// A prefill of two requests (3 and 4 tokens), then one decode step of each.
fn two_steps() -> [(usize, BatchArgs); 2] {
    let prefill = BatchArgs { query_start_loc: vec![0, 3, 7], ..BatchArgs::default() };
    let decode = BatchArgs {
        query_start_loc: vec![0, 1, 2],
        num_computed_tokens: Some(vec![3, 4]),
        ..BatchArgs::default()
    };
    [(7, prefill), (2, decode)]
}

/// Run `two_steps` on `cache` with the engine's device arrays queued on its stream `engine`,
/// between the engine's own copies (its input and a NaN output before, the output back to its
/// host memory after; only its stream is synchronized). Returns the steps and the outputs.
fn run_on_engine(
    layer: &Layer,
    cache: &Cache,
    engine: sys::aclrtStream,
) -> (Vec<Step>, Vec<Vec<f32>>) {
    let hidden = layer.info().hidden_size;
    let mut steps = Vec::new();
    let mut got = Vec::new();
    for (i, (rows, batch)) in two_steps().into_iter().enumerate() {
        let x = values(rows * hidden, 11 + i as u64);
        let (xd, od) = (DeviceBlock::new(rows * hidden * 4), DeviceBlock::new(rows * hidden * 4));
        let (xh, oh) = (Pinned::new(&x), Pinned::new(&vec![f32::NAN; rows * hidden]));
        let bytes = rows * hidden * 4;
        copy(xd.0, xh.0, bytes, sys::ACL_MEMCPY_HOST_TO_DEVICE, engine);
        copy(od.0, oh.0, bytes, sys::ACL_MEMCPY_HOST_TO_DEVICE, engine);
        // SAFETY: the engine's stream outlives the runtime (destroyed at the end, after it);
        // the arrays are ordered on it.
        let report = unsafe {
            layer.forward(
                device_array(&xd, &[rows, hidden]),
                &batch,
                cache,
                device_array(&od, &[rows, hidden]),
                Some(engine as usize),
            )
        }
        .unwrap();
        assert_eq!(report.hidden_states, Import::InPlace);
        copy(oh.0, od.0, bytes, sys::ACL_MEMCPY_DEVICE_TO_HOST, engine);
        // SAFETY: the engine's live stream.
        assert_eq!(unsafe { sys::aclrtSynchronizeStream(engine) }, 0);
        got.push(oh.read());
        steps.push(Step { hidden: x, dtype: DType::F32, rows, batch });
    }
    (steps, got)
}

/// The emulated Ascend runtime, a layer of the tiny synthetic checkpoint, an engine stream.
fn ascend_layer(name: &str) -> (PathBuf, Runtime, Layer, sys::aclrtStream) {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
    write_synthetic_checkpoint(&dir, "tiny", 3).unwrap();
    let runtime = Runtime::new("ascend", 0).unwrap();
    let layer = Layer::load(&runtime, &dir, 0, 1, 0, ProjectionSchedule::Overlapped).unwrap();
    let mut engine: sys::aclrtStream = std::ptr::null_mut();
    // SAFETY: a valid out-parameter.
    assert_eq!(unsafe { sys::aclrtCreateStream(&mut engine) }, 0);
    (dir, runtime, layer, engine)
}

#[test]
fn the_ascend_layer_on_an_engines_stream_equals_the_rust_api() {
    let (dir, runtime, layer, engine) = ascend_layer("embed-ascend");
    let hidden = layer.info().hidden_size;
    let cache = layer.new_cache(2, 0).unwrap();
    let (steps, got) = run_on_engine(&layer, &cache, engine);
    let spec = LayerSpec {
        dir: &dir,
        layer: 0,
        tp_size: 1,
        tp_rank: 0,
        schedule: ProjectionSchedule::Overlapped,
    };
    let want = reference_run(&spec, 2, 0, &steps).unwrap();
    for ((step, got), want) in steps.iter().zip(&got).zip(&want.outputs) {
        assert!(got.iter().all(|v| v.is_finite()), "the engine's NaN landed after kda's output");
        let max = want.iter().fold(0f64, |m, v| m.max(f64::from(v.abs())));
        Tolerance::new(1.0 / 256.0, max / 256.0).assert_close(&[step.rows, hidden], got, want);
    }
    drop((layer, cache, runtime));
    // SAFETY: created above, destroyed once, after kda's handles to it are gone.
    unsafe { sys::aclrtDestroyStream(engine) };
}

/// The engine's state cache in its device memory (`wrap_cache`, vLLM's layout), used in place
/// on the Ascend backend: the same outputs as kda's own cache on that backend, bit for bit, and
/// the states kda leaves in the engine's memory are kda's own cache's.
#[test]
fn an_engines_device_cache_is_used_in_place() {
    let (_dir, runtime, layer, engine) = ascend_layer("embed-ascend-wrapped");
    let LayerInfo { local_heads: lh, head_dim: d, conv_width: w, .. } = layer.info();
    let slots = 2;
    let (conv_shape, rec_shape) = ([slots, w - 1, 3 * lh * d], [slots, lh, d, d]);
    let (conv_len, rec_len) =
        (conv_shape.iter().product::<usize>(), rec_shape.iter().product::<usize>());
    let (conv, rec) = (DeviceBlock::new(conv_len * 4), DeviceBlock::new(rec_len * 4));
    let zeros = Pinned::new(&vec![0.0; conv_len.max(rec_len)]);
    for (block, len) in [(&conv, conv_len), (&rec, rec_len)] {
        copy(block.0, zeros.0, len * 4, sys::ACL_MEMCPY_HOST_TO_DEVICE, engine);
    }
    // SAFETY: the engine's live stream: the zeros are in place before kda's first step.
    assert_eq!(unsafe { sys::aclrtSynchronizeStream(engine) }, 0);
    let wrapped = layer
        .wrap_cache(
            device_array(&conv, &conv_shape),
            device_array(&rec, &rec_shape),
            CacheLayout::Vllm,
            0,
        )
        .unwrap();
    let own = layer.new_cache(slots, 0).unwrap();
    let (_, want) = run_on_engine(&layer, &own, engine);
    let (_, got) = run_on_engine(&layer, &wrapped, engine);
    let bits = |v: &[f32]| -> Vec<u32> { v.iter().map(|x| x.to_bits()).collect() };
    assert_eq!(bits(&got.concat()), bits(&want.concat()), "outputs through the engine's cache");

    // The engine's memory holds kda's own cache's states (read back by the engine).
    let (conv_host, rec_host) =
        (Pinned::new(&vec![f32::NAN; conv_len]), Pinned::new(&vec![f32::NAN; rec_len]));
    copy(conv_host.0, conv.0, conv_len * 4, sys::ACL_MEMCPY_DEVICE_TO_HOST, engine);
    copy(rec_host.0, rec.0, rec_len * 4, sys::ACL_MEMCPY_DEVICE_TO_HOST, engine);
    // SAFETY: the engine's live stream.
    assert_eq!(unsafe { sys::aclrtSynchronizeStream(engine) }, 0);
    let (conv_seen, rec_seen) = (conv_host.read(), rec_host.read());
    for slot in 0..slots {
        let rec_own = own.recurrent_state(&layer, slot).unwrap();
        let rec_slot = &rec_seen[slot * rec_len / slots..][..rec_len / slots];
        assert_eq!(bits(rec_slot), bits(&rec_own), "recurrent state of slot {slot}");
        let (conv_own, _) = own.conv_state(&layer, slot).unwrap();
        let conv_slot = &conv_seen[slot * conv_len / slots..][..conv_len / slots];
        assert_eq!(bits(conv_slot), bits(&conv_own), "conv state of slot {slot}");
    }
    drop((layer, own, wrapped, runtime));
    // SAFETY: created above, destroyed once, after kda's handles to it are gone.
    unsafe { sys::aclrtDestroyStream(engine) };
}
