//! The device half of `cargo xtask gpu-check`: on a real GPU, the overlapped projection under
//! capture (valid, bit-identical to serial under both matrix-overlap policies), then CUDA-event
//! timings: the projection stage at K3 TP8 shapes, chunked prefill tokens/s, decode latency.
//! Writes one JSON report (`--out PATH`, default `$OUT/gpu-bench.json` or `gpu-bench.json`).
//!
//! `cargo run --release -p kda-cuda --example gpu_bench -- [--out PATH] [--quick]`
//!
//! `--write-cubins DIR [ARCH]` instead compiles every kernel with NVRTC (no GPU needed) into
//! `DIR` for `KDA_CUDA_CUBIN_DIR` (default architecture sm_90, the H200's).
#![allow(clippy::expect_used, reason = "a benchmark driver: setup failures end the run")]

use std::path::PathBuf;

use half::bf16;
use kda_core::kda::{KdaChunk, KdaRecurrent};
use kda_core::schedule::{
    BfgWeight, MatrixOverlap, ProjectionDims, ProjectionSchedule, ProjectionWeights,
    QkvBfgProjection, QkvWeight,
};
use kda_core::{DType, Device, Op, Result, Tensor};
use kda_cuda::{CudaBackend, CudaOptions, CudaStream};
use serde_json::{Value, json};

/// H200 SXM dense bf16 tensor-core peak and HBM3e bandwidth (NVIDIA's data sheet).
const PEAK_BF16_FLOPS: f64 = 989.4e12;
const PEAK_BYTES_PER_S: f64 = 4.8e12;

type B = CudaBackend;

/// A cheap deterministic generator (xorshift) for benchmark data.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 40) as f32 / (1u64 << 24) as f32
    }

    fn uniform(&mut self, n: usize, lo: f32, hi: f32) -> Vec<f32> {
        (0..n).map(|_| lo + (hi - lo) * self.next()).collect()
    }
}

fn bf16_tensor(
    b: &Device<B>,
    s: &CudaStream,
    rng: &mut Rng,
    shape: &[usize],
    lo: f32,
    hi: f32,
) -> Result<Tensor<B>> {
    let n = shape.iter().product();
    let data: Vec<bf16> = rng.uniform(n, lo, hi).into_iter().map(bf16::from_f32).collect();
    let t = b.alloc(DType::BF16, shape)?;
    b.upload(s, &t, &data)?;
    Ok(t)
}

fn f32_tensor(b: &Device<B>, s: &CudaStream, data: &[f32], shape: &[usize]) -> Result<Tensor<B>> {
    let t = b.alloc(DType::F32, shape)?;
    b.upload(s, &t, data)?;
    Ok(t)
}

fn i32_tensor(b: &Device<B>, s: &CudaStream, data: &[i32]) -> Result<Tensor<B>> {
    let t = b.alloc(DType::I32, &[data.len()])?;
    b.upload(s, &t, data)?;
    Ok(t)
}

/// Mean milliseconds per call of `work` over `iters` calls, timed with CUDA events after
/// `warmup` untimed calls.
fn time_ms(
    b: &Device<B>,
    s: &CudaStream,
    warmup: usize,
    iters: usize,
    mut work: impl FnMut() -> Result<()>,
) -> Result<f64> {
    for _ in 0..warmup {
        work()?;
    }
    b.synchronize(s)?;
    let total = b.raw().elapsed_ms(s, || (0..iters).try_for_each(|_| work()))?;
    b.synchronize(s)?;
    Ok(f64::from(total) / iters as f64)
}

fn projection_weights(
    b: &Device<B>,
    s: &CudaStream,
    rng: &mut Rng,
    mxfp8: bool,
) -> Result<ProjectionWeights<B>> {
    let dims = ProjectionDims::K3_TP8;
    let dense = bf16_tensor(b, s, rng, &[dims.qkv_width(), dims.hidden], -0.05, 0.05)?;
    let qkv = if mxfp8 {
        let alg = kda_core::mx::ScaleAlg::OcpFloor;
        let data = b.alloc(DType::E4M3, &[dims.qkv_width(), dims.hidden])?;
        let scale =
            b.alloc(DType::E8M0, &[dims.qkv_width(), kda_core::mx::num_blocks(dims.hidden)])?;
        b.launch(s, Op::DynamicQuant { x: dense, data: data.clone(), scale: scale.clone(), alg })?;
        QkvWeight::Mxfp8 { data, scale, alg }
    } else {
        QkvWeight::Bf16 { w: dense }
    };
    let w = bf16_tensor(b, s, rng, &[dims.bfg_width(), dims.hidden], -0.05, 0.05)?;
    b.synchronize(s)?;
    ProjectionWeights::new(dims, qkv, BfgWeight::Composed { w })
}

/// The outputs' bits, to compare schedules.
fn output_bits(
    b: &Device<B>,
    s: &CudaStream,
    out: &kda_core::schedule::ProjectionBuffers<B>,
) -> Result<(Vec<u16>, Vec<u16>, Vec<f32>)> {
    let q: Vec<bf16> = b.download(s, &out.mixed_qkv)?;
    let f: Vec<bf16> = b.download(s, &out.bfg)?;
    let beta: Vec<f32> = b.download(s, &out.beta)?;
    Ok((q.iter().map(|v| v.to_bits()).collect(), f.iter().map(|v| v.to_bits()).collect(), beta))
}

/// The overlapped schedule captured (on a checked instance, so the capture is validated and
/// analysed for hazards), replayed, and compared bit for bit with serial, for both policies.
fn capture_check(mxfp8: bool) -> Result<Value> {
    let b = CudaBackend::with_options(CudaOptions { checked: true, ..CudaOptions::default() })?;
    let s = b.new_stream()?;
    let mut rng = Rng(7);
    let weights = projection_weights(&b, &s, &mut rng, mxfp8)?;
    let x = bf16_tensor(&b, &s, &mut rng, &[128, ProjectionDims::K3_TP8.hidden], -1.0, 1.0)?;
    let serial = QkvBfgProjection::new(&b, weights.clone(), ProjectionSchedule::Serial)?;
    let serial_out = serial.alloc_buffers(&x)?;
    serial.forward_into(&s, &x, &serial_out)?;
    let want = output_bits(&b, &s, &serial_out)?;
    let mut results = Vec::new();
    for policy in [MatrixOverlap::Serialized, MatrixOverlap::Concurrent] {
        let p = QkvBfgProjection::new(&b, weights.clone(), ProjectionSchedule::Overlapped)?
            .with_matrix_overlap(policy);
        let out = p.alloc_buffers(&x)?;
        b.begin_capture(&s)?;
        p.forward_into(&s, &x, &out)?;
        let captured = b.end_capture(&s);
        let capture_valid = captured.is_ok();
        let mut equal = false;
        if let Ok(graph) = &captured {
            for _ in 0..3 {
                b.launch_graph(graph, &s)?;
            }
            b.synchronize(&s)?;
            equal = output_bits(&b, &s, &out)? == want;
        }
        let hazards = b.instrumentation().hazards().len();
        results.push(json!({
            "policy": format!("{policy:?}"),
            "capture_valid": capture_valid,
            "capture_error": captured.err().map(|e| e.to_string()),
            "overlapped_equals_serial_bitwise": equal,
            "hazards": hazards,
        }));
    }
    Ok(json!({ "qkv": if mxfp8 { "mxfp8" } else { "bf16" }, "tokens": 128, "results": results }))
}

fn projection_bench(
    b: &Device<B>,
    s: &CudaStream,
    tokens: &[usize],
    mxfp8: bool,
    iters: usize,
) -> Result<Value> {
    let mut rng = Rng(11);
    let weights = projection_weights(b, s, &mut rng, mxfp8)?;
    let dims = weights.dims();
    let mut rows = Vec::new();
    for &t in tokens {
        let x = bf16_tensor(b, s, &mut rng, &[t, dims.hidden], -1.0, 1.0)?;
        let flops = 2.0 * (t * dims.hidden * (dims.qkv_width() + dims.bfg_width())) as f64;
        let weight_bytes = if mxfp8 {
            dims.qkv_width() * dims.hidden * 33 / 32
        } else {
            2 * dims.qkv_width() * dims.hidden
        };
        let bytes = (weight_bytes
            + 2 * dims.bfg_width() * dims.hidden
            + 2 * t * (dims.hidden + dims.qkv_width() + dims.bfg_width()))
            as f64;
        let roofline_ms = (flops / PEAK_BF16_FLOPS).max(bytes / PEAK_BYTES_PER_S) * 1e3;
        let configs = [
            ("serial", ProjectionSchedule::Serial, MatrixOverlap::Serialized),
            ("overlapped_serialized", ProjectionSchedule::Overlapped, MatrixOverlap::Serialized),
            ("overlapped_concurrent", ProjectionSchedule::Overlapped, MatrixOverlap::Concurrent),
        ];
        let mut timings = serde_json::Map::new();
        for (name, schedule, policy) in configs {
            let p =
                QkvBfgProjection::new(b, weights.clone(), schedule)?.with_matrix_overlap(policy);
            let out = p.alloc_buffers(&x)?;
            let ms = time_ms(b, s, 3, iters, || p.forward_into(s, &x, &out).map(|_| ()))?;
            timings.insert(
                name.into(),
                json!({ "ms": ms, "fraction_of_bf16_roofline": roofline_ms / ms }),
            );
        }
        rows.push(json!({ "tokens": t, "flops": flops, "bytes": bytes, "roofline_ms": roofline_ms, "timings": timings }));
    }
    Ok(
        json!({ "qkv": if mxfp8 { "mxfp8" } else { "bf16" }, "dims": { "hidden": dims.hidden, "heads": dims.heads, "head_dim": dims.head_dim }, "rows": rows }),
    )
}

/// Recurrence operands `[lead.., H, D]` (q, k, v bf16; g f32 in [-0.5, 0]; beta f32 in (0, 1)).
struct Operands {
    q: Tensor<B>,
    k: Tensor<B>,
    v: Tensor<B>,
    g: Tensor<B>,
    beta: Tensor<B>,
}

fn operands(
    b: &Device<B>,
    s: &CudaStream,
    rng: &mut Rng,
    lead: &[usize],
    h: usize,
    d: usize,
) -> Result<Operands> {
    let with = |tail: &[usize]| [lead, tail].concat();
    let n: usize = lead.iter().product();
    Ok(Operands {
        q: bf16_tensor(b, s, rng, &with(&[h, d]), -1.0, 1.0)?,
        k: bf16_tensor(b, s, rng, &with(&[h, d]), -1.0, 1.0)?,
        v: bf16_tensor(b, s, rng, &with(&[h, d]), -1.0, 1.0)?,
        g: f32_tensor(b, s, &rng.uniform(n * h * d, -0.5, 0.0), &with(&[h, d]))?,
        beta: f32_tensor(b, s, &rng.uniform(n * h, 0.0, 1.0), &with(&[h]))?,
    })
}

fn prefill_bench(
    b: &Device<B>,
    s: &CudaStream,
    t: usize,
    h: usize,
    d: usize,
    iters: usize,
) -> Result<Value> {
    let mut rng = Rng(13);
    let ops = operands(b, s, &mut rng, &[t], h, d)?;
    let state = b.alloc(DType::F32, &[1, h, d, d])?;
    let o = b.alloc(DType::BF16, &[t, h, d])?;
    let (cu, slots, init) =
        (i32_tensor(b, s, &[0, t as i32])?, i32_tensor(b, s, &[0])?, i32_tensor(b, s, &[0])?);
    let op = || {
        Op::KdaChunk(KdaChunk {
            q: ops.q.clone(),
            k: ops.k.clone(),
            v: ops.v.clone(),
            g: ops.g.clone(),
            gate: None,
            beta: ops.beta.clone(),
            cu_seqlens: cu.clone(),
            state_slots: slots.clone(),
            has_initial_state: init.clone(),
            state: state.clone(),
            o: o.clone(),
            scale: (d as f32).powf(-0.5),
            qk_l2norm: true,
        })
    };
    let ms = time_ms(b, s, 1, iters, || b.launch(s, op()))?;
    Ok(
        json!({ "tokens": t, "heads": h, "head_dim": d, "ms": ms, "tokens_per_s": t as f64 / (ms * 1e-3) }),
    )
}

fn decode_bench(
    b: &Device<B>,
    s: &CudaStream,
    batch: usize,
    h: usize,
    d: usize,
    iters: usize,
) -> Result<Value> {
    let mut rng = Rng(17);
    let ops = operands(b, s, &mut rng, &[batch, 1], h, d)?;
    let state = b.alloc(DType::F32, &[batch, h, d, d])?;
    b.launch(s, Op::Fill { dst: state.clone(), value: 0.0 })?;
    let o = b.alloc(DType::BF16, &[batch, 1, h, d])?;
    let slot_ids: Vec<i32> = (0..batch as i32).collect();
    let slots = b.alloc(DType::I32, &[batch, 1])?;
    b.upload(s, &slots, &slot_ids)?;
    let op = || {
        Op::KdaRecurrent(KdaRecurrent {
            q: ops.q.clone(),
            k: ops.k.clone(),
            v: ops.v.clone(),
            g: ops.g.clone(),
            beta: ops.beta.clone(),
            state_slots: slots.clone(),
            num_accepted_tokens: None,
            state: state.clone(),
            o: o.clone(),
            scale: (d as f32).powf(-0.5),
            qk_l2norm: true,
        })
    };
    let ms = time_ms(b, s, 3, iters, || b.launch(s, op()))?;
    Ok(json!({ "batch": batch, "heads": h, "head_dim": d, "ms_per_step": ms }))
}

fn main() {
    let mut args = std::env::args().skip(1);
    let mut out = std::env::var_os("OUT")
        .map(|d| PathBuf::from(d).join("gpu-bench.json"))
        .unwrap_or_else(|| "gpu-bench.json".into());
    let mut quick = false;
    while let Some(a) = args.next() {
        match a.as_str() {
            "--out" => out = args.next().map(PathBuf::from).expect("--out needs a path"),
            "--quick" => quick = true,
            "--write-cubins" => {
                let dir = PathBuf::from(args.next().expect("--write-cubins needs a directory"));
                let arch = args.next().unwrap_or_else(|| kda_cuda::kernels::CHECK_ARCH.into());
                write_cubins(&dir, &arch);
                return;
            }
            other => {
                eprintln!(
                    "gpu_bench: unknown argument {other}; usage: gpu_bench [--out PATH] [--quick]"
                );
                std::process::exit(2);
            }
        }
    }
    let report = match run(quick) {
        Ok(report) => report,
        Err(e) => {
            eprintln!("gpu_bench: {e}");
            json!({ "error": e.to_string() })
        }
    };
    let text = serde_json::to_string_pretty(&report).expect("a JSON value serialises");
    println!("{text}");
    if let Err(e) = std::fs::write(&out, text) {
        eprintln!("gpu_bench: cannot write {}: {e}", out.display());
        std::process::exit(1);
    }
    if report.get("error").is_some() {
        std::process::exit(1);
    }
}

fn write_cubins(dir: &std::path::Path, arch: &str) {
    if !kda_cuda::nvrtc::present() {
        eprintln!("gpu_bench: libnvrtc could not be loaded");
        std::process::exit(1);
    }
    std::fs::create_dir_all(dir).expect("create the CUBIN directory");
    for source in kda_cuda::kernels::SOURCES {
        let cubin = kda_cuda::nvrtc::compile(&source, arch).expect("NVRTC compiles the kernels");
        let path = dir.join(kda_cuda::kernels::cubin_file(&source, arch));
        std::fs::write(&path, cubin).expect("write a CUBIN");
        println!("{}", path.display());
    }
}

fn run(quick: bool) -> Result<Value> {
    let b = CudaBackend::new()?;
    let s = b.new_stream()?;
    let iters = if quick { 5 } else { 20 };
    let capture = vec![capture_check(false)?, capture_check(true)?];
    let tokens = [1, 16, 128, 1024];
    let projection = vec![
        projection_bench(&b, &s, &tokens, false, iters)?,
        projection_bench(&b, &s, &tokens, true, iters.min(5))?,
    ];
    let prefill_iters = if quick { 1 } else { 3 };
    let prefill = vec![
        prefill_bench(&b, &s, 8192, 96, 128, prefill_iters)?,
        prefill_bench(&b, &s, 8192, 12, 128, prefill_iters)?,
    ];
    let mut decode = Vec::new();
    for (batch, h) in [(1, 96), (1, 12), (64, 12), (256, 12)] {
        decode.push(decode_bench(&b, &s, batch, h, 128, iters)?);
    }
    Ok(json!({
        "device": b.raw().device_name(),
        "peaks": { "bf16_flops": PEAK_BF16_FLOPS, "bytes_per_s": PEAK_BYTES_PER_S },
        "capture": capture,
        "projection": projection,
        "chunked_prefill": prefill,
        "decode": decode,
        "notes": [
            "times are CUDA-event means over repeated launches on one stream",
            "chunked prefill runs the exact token-by-token recurrence kernel (kda_chunk)",
            "the MXFP8 QKV GEMM is emulated (exact block sums in f64): H200 has no MX hardware",
        ],
    }))
}
