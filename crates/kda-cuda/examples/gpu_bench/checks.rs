//! The standalone report's checks at K3 TP8 shapes: captures (validated by the HAL on a checked
//! instance, and run as CUDA graphs on an unchecked one, each against serial or eager bit for
//! bit), and what the fast paths change against the spec paths, in bits and by how much.

use half::bf16;
use kda_core::{DType, Device, Op, Result, Tensor};
use kda_cuda::{CudaBackend, CudaOptions, CudaStream, FastPaths};
use kda_model::layer::{BatchMeta, RequestSlots};
use kda_model::schedule::{
    MatrixOverlap, ProjectionBuffers, ProjectionDims, ProjectionSchedule, QkvBfgProjection,
};
use serde_json::{Value, json};

use crate::data::{
    B, Rng, bf16_tensor, chunk_problem, hal, k3_tp8_layer, projection_weights, quantized,
};

fn instance(checked: bool, fast: FastPaths) -> Result<Device<B>> {
    Ok(CudaBackend::with_options(CudaOptions { checked, fast, ..CudaOptions::default() })?)
}

/// The outputs' bits, to compare schedules.
fn output_bits(
    b: &Device<B>,
    s: &CudaStream,
    out: &ProjectionBuffers<B>,
) -> Result<(Vec<u16>, Vec<u16>, Vec<f32>)> {
    let q: Vec<bf16> = b.download(s, &out.mixed_qkv)?;
    let f: Vec<bf16> = b.download(s, &out.bfg)?;
    let beta: Vec<f32> = b.download(s, &out.beta)?;
    Ok((q.iter().map(|v| v.to_bits()).collect(), f.iter().map(|v| v.to_bits()).collect(), beta))
}

/// The overlapped projection captured and replayed against serial, for both matrix-overlap
/// policies: on a checked instance (the HAL validates the capture and the sanitizer sees every
/// replayed op) and on an unchecked one (one CUDA graph per launch).
pub fn captures(mxfp8: bool) -> Result<Value> {
    let mut results = Vec::new();
    for checked in [true, false] {
        let b = instance(checked, FastPaths::ALL)?;
        let s = b.new_stream()?;
        let mut rng = Rng(7);
        let weights = projection_weights(&b, &s, &mut rng, mxfp8)?;
        let x = bf16_tensor(&b, &s, &mut rng, &[128, ProjectionDims::K3_TP8.hidden], -1.0, 1.0)?;
        let serial = QkvBfgProjection::new(&b, weights.clone(), ProjectionSchedule::Serial)?;
        let serial_out = serial.alloc_buffers(&x)?;
        serial.forward_into(&s, &x, &serial_out)?;
        let want = output_bits(&b, &s, &serial_out)?;
        for policy in [MatrixOverlap::Serialized, MatrixOverlap::Concurrent] {
            let p = QkvBfgProjection::new(&b, weights.clone(), ProjectionSchedule::Overlapped)?
                .with_matrix_overlap(policy);
            let out = p.alloc_buffers(&x)?;
            // Every GEMM shape and stream once eagerly before the capture (see
            // `layer_decode_graph`).
            p.forward_into(&s, &x, &out)?;
            b.synchronize(&s)?;
            b.begin_capture(&s)?;
            p.forward_into(&s, &x, &out)?;
            let captured = b.end_capture(&s);
            let mut route = None;
            let mut equal = false;
            if let Ok(graph) = &captured {
                route = Some(format!("{:?}", b.raw().instantiate_graph(graph, &s)?));
                for _ in 0..3 {
                    b.launch_graph(graph, &s)?;
                }
                b.synchronize(&s)?;
                equal = output_bits(&b, &s, &out)? == want;
            }
            results.push(json!({
                "checked": checked,
                "policy": format!("{policy:?}"),
                "route": route,
                "capture_valid": captured.is_ok(),
                "capture_error": captured.err().map(|e| e.to_string()),
                "overlapped_equals_serial_bitwise": equal,
                "hazards": b.instrumentation().hazards().len(),
            }));
        }
    }
    Ok(json!({ "qkv": if mxfp8 { "mxfp8" } else { "bf16" }, "tokens": 128, "results": results }))
}

/// A decode step of the whole K3 TP8 layer (32 requests) as one CUDA graph, twice, against the
/// same steps run eagerly: outputs and states bit for bit.
pub fn layer_decode_graph() -> Result<Value> {
    let b = instance(false, FastPaths::ALL)?;
    let s = b.new_stream()?;
    let layer = k3_tp8_layer(&b, &s, ProjectionSchedule::Overlapped)?;
    let hidden = layer.dims().hidden;
    let batch = 32;
    let mut rng = Rng(3);
    let prompt = bf16_tensor(&b, &s, &mut rng, &[batch * 16, hidden], -1.0, 1.0)?;
    let x = bf16_tensor(&b, &s, &mut rng, &[batch, hidden], -1.0, 1.0)?;
    let prefill = BatchMeta::prefills(&vec![16; batch], &(0..batch).collect::<Vec<_>>());
    let mut decode = BatchMeta::empty();
    for slot in 0..batch {
        decode.push(1, 16, RequestSlots::Single(slot));
    }
    let mut eager_cache = hal(layer.new_cache(&s, batch, 0))?;
    let mut graph_cache = hal(layer.new_cache(&s, batch, 0))?;
    for cache in [&mut eager_cache, &mut graph_cache] {
        let mut out = b.alloc(DType::F32, &[batch * 16, hidden])?;
        hal(layer.forward(&s, &prompt, &prefill, cache, &mut out))?;
    }
    let mut eager_out = b.alloc(DType::F32, &[batch, hidden])?;
    let mut graph_out = b.alloc(DType::F32, &[batch, hidden])?;
    // One eager decode step first (on a cache of its own), as engines warm up before they
    // capture: cuBLAS then meets the decode GEMM shapes (M = 32) outside a capture.
    let mut warm_cache = hal(layer.new_cache(&s, batch, 0))?;
    let mut warm_out = b.alloc(DType::F32, &[batch, hidden])?;
    hal(layer.forward(&s, &x, &decode, &mut warm_cache, &mut warm_out))?;
    b.synchronize(&s)?;
    b.begin_capture(&s)?;
    hal(layer.forward(&s, &x, &decode, &mut graph_cache, &mut graph_out))?;
    let graph = b.end_capture(&s)?;
    let route = b.raw().instantiate_graph(&graph, &s)?;
    let bits = |t: &Tensor<B>| -> Result<Vec<u32>> {
        Ok(b.download::<f32>(&s, t)?.into_iter().map(f32::to_bits).collect())
    };
    let mut equal = Vec::new();
    for _ in 0..2 {
        hal(layer.forward(&s, &x, &decode, &mut eager_cache, &mut eager_out))?;
        b.launch_graph(&graph, &s)?;
        equal.push(
            bits(&eager_out)? == bits(&graph_out)?
                && bits(eager_cache.recurrent())? == bits(graph_cache.recurrent())?
                && bits(eager_cache.conv())? == bits(graph_cache.conv())?,
        );
    }
    Ok(json!({
        "requests": batch,
        "route": format!("{route:?}"),
        "graph_equals_eager_bitwise": equal,
    }))
}

/// How far `got` is from `want`: how many elements differ in bits, the largest absolute
/// difference, it relative to the largest `|want|`, and the largest distance in f32 ulps.
fn delta(got: &[f32], want: &[f32]) -> Value {
    let scale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
    let mut differ = 0usize;
    let (mut abs, mut ulps) = (0f32, 0u64);
    for (&a, &b) in got.iter().zip(want) {
        if a.to_bits() != b.to_bits() {
            differ += 1;
            abs = abs.max((a - b).abs());
            let key = |x: f32| {
                let i = x.to_bits() as i32;
                if i < 0 { i64::from(i32::MIN) - i64::from(i) } else { i64::from(i) }
            };
            ulps = ulps.max(key(a).abs_diff(key(b)));
        }
    }
    json!({
        "elements": want.len(),
        "differ_in_bits": differ,
        "max_abs": abs,
        "max_abs_over_max_value": if scale > 0.0 { f64::from(abs / scale) } else { 0.0 },
        "max_ulps_f32": ulps,
        "nan": got.iter().any(|x| x.is_nan()),
    })
}

/// The fast MX GEMM against the exact one at the QKV projection's K3 TP8 shape (f32 output,
/// so every bit of the difference shows).
pub fn mx_gemm_delta(m: usize) -> Result<Value> {
    let dims = ProjectionDims::K3_TP8;
    let (n, k) = (dims.qkv_width(), dims.hidden);
    let run = |fast: bool| -> Result<Vec<f32>> {
        let b = instance(false, FastPaths { mx_gemm: fast, ..FastPaths::default() })?;
        let s = b.new_stream()?;
        let mut rng = Rng(17);
        let (a, a_scale) = quantized(&b, &s, bf16_tensor(&b, &s, &mut rng, &[m, k], -2.0, 2.0)?)?;
        let (w, w_scale) = quantized(&b, &s, bf16_tensor(&b, &s, &mut rng, &[n, k], -0.05, 0.05)?)?;
        let y = b.alloc(DType::F32, &[m, n])?;
        b.launch(&s, Op::MxGemm { a, a_scale, w, w_scale, y: y.clone() })?;
        b.download(&s, &y)
    };
    let (exact, fast) = (run(false)?, run(true)?);
    Ok(json!({ "shape": [m, n, k], "fast_vs_exact": delta(&fast, &exact) }))
}

/// The tensor-core chunked prefill against the token-by-token kernel: outputs and final state
/// at `t` tokens, `h` heads of 128, and the time of one call of each.
pub fn chunk_delta(t: usize, h: usize) -> Result<Value> {
    let run = |fast: bool| -> Result<(Vec<f32>, Vec<f32>, f32)> {
        let b = instance(false, FastPaths { chunk: fast, ..FastPaths::default() })?;
        let s = b.new_stream()?;
        let op = chunk_problem(&b, &s, t, h, 128)?;
        b.launch(&s, Op::KdaChunk(op.clone()))?;
        b.synchronize(&s)?;
        let ms = b.raw().elapsed_ms(&s, || b.launch(&s, Op::KdaChunk(op.clone())))?;
        let o: Vec<bf16> = b.download(&s, &op.o)?;
        let state: Vec<f32> = b.download(&s, &op.state)?;
        Ok((o.into_iter().map(f32::from).collect(), state, ms))
    };
    let (exact, fast) = (run(false)?, run(true)?);
    Ok(json!({
        "tokens": t,
        "heads": h,
        "head_dim": 128,
        "outputs": delta(&fast.0, &exact.0),
        "final_state": delta(&fast.1, &exact.1),
        "token_by_token_ms": exact.2,
        "tensor_cores_ms": fast.2,
        "speedup": f64::from(exact.2) / f64::from(fast.2).max(1e-9),
    }))
}
