//! Device trials of what only kda-cuda has (the conformance suite covers the HAL): the fast paths
//! against their spec paths, and HAL graphs run as CUDA graphs. Without a CUDA device every
//! trial is reported ignored, by name.
#![allow(clippy::expect_used, clippy::unwrap_used, reason = "test setup")]

use half::bf16;
use kda_core::Device;
use kda_core::kda::{ChunkGate, GateForm, KdaChunk};
use kda_core::{DType, Op, ScaleAlg, Tensor};
use kda_cuda::{CudaBackend, CudaOptions, CudaStream, FastPaths, GraphRoute};
use kda_cuda_trials::{Check, Failed};
use kda_model::config::Tp;
use kda_model::layer::{BatchMeta, KdaLayer, LayerOptions, RequestSlots};
use kda_model::schedule::ProjectionSchedule;
use kda_testkit::conformance::layer::{Model, load, tiny_config};

type B = CudaBackend;

/// A varlen chunk problem: request lengths, their slots and initial-state flags, (H, K, V), the
/// in-kernel gate.
type Case<'a> = (&'a [usize], &'a [i32], &'a [i32], (usize, usize, usize), Option<GateForm>);

fn backend(fast: FastPaths) -> Device<B> {
    CudaBackend::with_options(CudaOptions { checked: false, fast, ..CudaOptions::default() })
        .expect("CUDA backend")
}

/// A cheap deterministic generator.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f32 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32) / (1u64 << 24) as f32
    }

    fn fill(&mut self, n: usize, lo: f32, hi: f32) -> Vec<f32> {
        (0..n).map(|_| lo + (hi - lo) * self.next()).collect()
    }
}

fn f32_tensor(b: &Device<B>, s: &CudaStream, shape: &[usize], data: &[f32]) -> Tensor<B> {
    let t = b.alloc(DType::F32, shape).unwrap();
    b.upload(s, &t, data).unwrap();
    t
}

fn bf16_tensor(b: &Device<B>, s: &CudaStream, shape: &[usize], data: &[f32]) -> Tensor<B> {
    let t = b.alloc(DType::BF16, shape).unwrap();
    let v: Vec<bf16> = data.iter().map(|&x| bf16::from_f32(x)).collect();
    b.upload(s, &t, &v).unwrap();
    t
}

fn i32_tensor(b: &Device<B>, s: &CudaStream, data: &[i32]) -> Tensor<B> {
    let t = b.alloc(DType::I32, &[data.len()]).unwrap();
    b.upload(s, &t, data).unwrap();
    t
}

/// The largest difference relative to the largest `|want|`.
fn rel_error(got: &[f32], want: &[f32]) -> f64 {
    let scale = want.iter().fold(0f64, |m, &x| m.max(f64::from(x).abs())).max(1e-30);
    let err = got.iter().zip(want).fold(0f64, |m, (&a, &b)| m.max(f64::from(a - b).abs()));
    if got.iter().any(|x| x.is_nan()) { f64::INFINITY } else { err / scale }
}

/// One varlen KdaChunk on `b`: outputs and every state slot.
#[allow(clippy::too_many_arguments, reason = "one problem's parameters")]
fn chunk_on(
    b: &Device<B>,
    lens: &[usize],
    slots: &[i32],
    has_initial: &[i32],
    (h, kd, vd): (usize, usize, usize),
    gate: Option<GateForm>,
    seed: u64,
) -> (Vec<f32>, Vec<f32>) {
    let s = b.new_stream().unwrap();
    let t: usize = lens.iter().sum();
    let mut rng = Rng(seed);
    let n_slots = 1 + *slots.iter().max().unwrap_or(&0) as usize;
    let q = bf16_tensor(b, &s, &[t, h, kd], &rng.fill(t * h * kd, -1.0, 1.0));
    let k = bf16_tensor(b, &s, &[t, h, kd], &rng.fill(t * h * kd, -1.0, 1.0));
    let v = bf16_tensor(b, &s, &[t, h, vd], &rng.fill(t * h * vd, -1.0, 1.0));
    let (g_lo, g_hi) = if gate.is_some() { (-3.0, 3.0) } else { (-0.6, 0.0) };
    let g = f32_tensor(b, &s, &[t, h, kd], &rng.fill(t * h * kd, g_lo, g_hi));
    let beta = f32_tensor(b, &s, &[t, h], &rng.fill(t * h, 0.0, 1.0));
    let state =
        f32_tensor(b, &s, &[n_slots, h, vd, kd], &rng.fill(n_slots * h * vd * kd, -0.3, 0.3));
    let o = f32_tensor(b, &s, &[t, h, vd], &vec![f32::NAN; t * h * vd]);
    let mut offsets = vec![0i32];
    for &l in lens {
        offsets.push(offsets.last().unwrap() + l as i32);
    }
    let gate = gate.map(|form| ChunkGate {
        a_log: f32_tensor(b, &s, &[h], &rng.fill(h, -1.0, 1.0)),
        dt_bias: f32_tensor(b, &s, &[h, kd], &rng.fill(h * kd, -0.5, 0.5)),
        form,
    });
    let op = KdaChunk {
        chunk_state_slots: None,
        host_meta: None,
        q,
        k,
        v,
        g,
        gate,
        beta,
        cu_seqlens: i32_tensor(b, &s, &offsets),
        state_slots: i32_tensor(b, &s, slots),
        has_initial_state: i32_tensor(b, &s, has_initial),
        state: state.clone(),
        o: o.clone(),
        scale: (kd as f32).powf(-0.5),
        qk_l2norm: true,
    };
    b.launch(&s, Op::KdaChunk(op)).unwrap();
    (b.download(&s, &o).unwrap(), b.download(&s, &state).unwrap())
}

/// The tensor-core chunked prefill against the token-by-token kernel (the oracle), within
/// bf16's precision: lengths across chunk and sub-block boundaries, K3's 128 and padded key
/// dims, several value tiles, fresh and continued states, a padding request, both in-kernel
/// gate forms (with decays fast enough for the direct diagonal).
fn tensor_core_chunk_agrees_with_the_token_by_token_kernel() -> Result<(), Failed> {
    let (exact, fast) =
        (backend(FastPaths::default()), backend(FastPaths { chunk: true, ..FastPaths::default() }));
    if !fast.raw().fast_paths().chunk {
        return Err("the tensor-core chunk kernel is not available on this device".into());
    }
    let cases: [Case<'_>; 6] = [
        (&[1], &[0], &[0], (2, 128, 128), None),
        (&[17, 64, 65], &[2, 0, 1], &[1, 0, 1], (3, 128, 128), None),
        (&[1000], &[0], &[1], (2, 128, 128), None),
        (&[70, 0, 5, 130], &[1, 0, 3, -1], &[1, 1, 0, 0], (2, 48, 40), None),
        (&[200], &[0], &[1], (2, 128, 128), Some(GateForm::LowerBound { lower_bound: -5.0 })),
        (&[150], &[0], &[0], (1, 64, 96), Some(GateForm::Softplus)),
    ];
    for (i, (lens, slots, init, dims, gate)) in cases.into_iter().enumerate() {
        let want = chunk_on(&exact, lens, slots, init, dims, gate, 40 + i as u64);
        let got = chunk_on(&fast, lens, slots, init, dims, gate, 40 + i as u64);
        let (eo, es) = (rel_error(&got.0, &want.0), rel_error(&got.1, &want.1));
        eprintln!("case {i} {lens:?} {dims:?} {gate:?}: outputs {eo:.2e}, states {es:.2e}");
        if !(eo < 0.03 && es < 0.03) {
            return Err(
                format!("case {i}: outputs {eo:.2e}, states {es:.2e} (bf16 bound 3e-2)").into()
            );
        }
    }
    Ok(())
}

/// The fast MXFP8 GEMM against the exact one: every output within twice the worst case of the
/// two summations' fp32 roundings (`(K + K/32 + 2) u Σ|a w|`: a K-term fp32 sum against K/32
/// rounded block sums accumulated in order), margin for the tensor cores' accumulation, and how
/// many outputs differ.
fn fast_mx_gemm_is_within_the_accumulation_bound() -> Result<(), Failed> {
    let (m, n, k) = (64usize, 256usize, 7168usize);
    let run = |fast: bool| -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let b = backend(FastPaths { mx_gemm: fast, ..FastPaths::default() });
        let s = b.new_stream().unwrap();
        let mut rng = Rng(5);
        let quantized = |rows: usize, lo: f32, hi: f32, rng: &mut Rng| {
            let x = bf16_tensor(&b, &s, &[rows, k], &rng.fill(rows * k, lo, hi));
            let data = b.alloc(DType::E4M3, &[rows, k]).unwrap();
            let scale = b.alloc(DType::E8M0, &[rows, k / 32]).unwrap();
            let op = Op::DynamicQuant {
                x,
                data: data.clone(),
                scale: scale.clone(),
                alg: ScaleAlg::OcpFloor,
            };
            b.launch(&s, op).unwrap();
            (data, scale)
        };
        let (a, a_scale) = quantized(m, -2.0, 2.0, &mut rng);
        let (w, w_scale) = quantized(n, -0.05, 0.05, &mut rng);
        let y = b.alloc(DType::F32, &[m, n]).unwrap();
        let op = Op::MxGemm {
            a: a.clone(),
            a_scale: a_scale.clone(),
            w: w.clone(),
            w_scale: w_scale.clone(),
            y: y.clone(),
        };
        b.launch(&s, op).unwrap();
        let dequant = |data: &Tensor<B>, scale: &Tensor<B>, rows: usize| {
            let out = b.alloc(DType::F32, &[rows, k]).unwrap();
            b.launch(
                &s,
                Op::MxDequant { data: data.clone(), scale: scale.clone(), y: out.clone() },
            )
            .unwrap();
            b.download::<f32>(&s, &out).unwrap()
        };
        (b.download(&s, &y).unwrap(), dequant(&a, &a_scale, m), dequant(&w, &w_scale, n))
    };
    let (exact, a, w) = run(false);
    let (fast, _, _) = run(true);
    let u = f64::from(f32::EPSILON) / 2.0;
    let mut differ = 0;
    for i in 0..m {
        for j in 0..n {
            let abs: f64 = (0..k).map(|l| f64::from(a[i * k + l] * w[j * k + l]).abs()).sum();
            let (x, y) = (f64::from(exact[i * n + j]), f64::from(fast[i * n + j]));
            let bound = 2.0 * (k as f64 + (k / 32) as f64 + 2.0) * u * abs;
            differ += usize::from(x.to_bits() != y.to_bits());
            if (x - y).abs() > bound {
                return Err(format!("y[{i}, {j}]: exact {x}, fast {y}, bound {bound:.3e}").into());
            }
        }
    }
    eprintln!(
        "fast MX GEMM [{m}, {n}, {k}]: {differ} of {} f32 outputs differ from the exact path",
        m * n
    );
    Ok(())
}

/// A decode step of the overlapped layer captured, run as one CUDA graph (native, not a
/// replay), equals the same step run eagerly, bit for bit, twice in a row (the state carried),
/// with the spec paths and with the fast paths.
fn graph_replayed_decode_step_equals_eager_bit_for_bit() -> Result<(), Failed> {
    for fast in [FastPaths::default(), FastPaths::ALL] {
        let b = backend(fast);
        let s = b.new_stream().unwrap();
        let w = load(&tiny_config(Model::K3), Tp::SINGLE, 3);
        let options = LayerOptions {
            schedule: Some(ProjectionSchedule::Overlapped),
            ..LayerOptions::default()
        };
        let layer = KdaLayer::new(&b, &s, &w, options).unwrap();
        let hidden = layer.dims().hidden;
        let mut rng = Rng(9);
        let prompt = bf16_tensor(&b, &s, &[2 * 6, hidden], &rng.fill(12 * hidden, -1.0, 1.0));
        let x = bf16_tensor(&b, &s, &[2, hidden], &rng.fill(2 * hidden, -1.0, 1.0));
        let mut meta = BatchMeta::empty();
        meta.push(1, 6, RequestSlots::Single(0)).push(1, 6, RequestSlots::Single(1));
        let mut caches = [layer.new_cache(&s, 2, 0).unwrap(), layer.new_cache(&s, 2, 0).unwrap()];
        let mut out = [
            b.alloc(DType::F32, &[2, hidden]).unwrap(),
            b.alloc(DType::F32, &[2, hidden]).unwrap(),
        ];
        for c in &mut caches {
            let mut warm = b.alloc(DType::F32, &[12, hidden]).unwrap();
            layer
                .forward(&s, &prompt, &BatchMeta::prefills(&[6, 6], &[0, 1]), c, &mut warm)
                .unwrap();
        }
        // One eager decode step first (on a cache of its own), as engines warm up before they
        // capture: cuBLAS then meets the decode GEMM shapes (M = 2) outside a capture.
        let mut warm_cache = layer.new_cache(&s, 2, 0).unwrap();
        let mut warm_out = b.alloc(DType::F32, &[2, hidden]).unwrap();
        layer.forward(&s, &x, &meta, &mut warm_cache, &mut warm_out).unwrap();
        let [eager_cache, graph_cache] = &mut caches;
        let [eager_out, graph_out] = &mut out;
        b.synchronize(&s).unwrap();
        b.begin_capture(&s).unwrap();
        layer.forward(&s, &x, &meta, graph_cache, graph_out).unwrap();
        let graph = b.end_capture(&s).unwrap();
        let route = b.raw().instantiate_graph(&graph, &s).unwrap();
        if route != GraphRoute::Native {
            return Err(format!(
                "{fast:?}: the decode step did not become a CUDA graph: {route:?}"
            )
            .into());
        }
        for step in 0..2 {
            layer.forward(&s, &x, &meta, eager_cache, eager_out).unwrap();
            b.launch_graph(&graph, &s).unwrap();
            let bits = |t: &Tensor<B>| -> Vec<u32> {
                b.download::<f32>(&s, t).unwrap().into_iter().map(f32::to_bits).collect()
            };
            if bits(eager_out) != bits(graph_out) {
                return Err(
                    format!("{fast:?}: step {step}: graph output differs from eager").into()
                );
            }
            if bits(eager_cache.recurrent()) != bits(graph_cache.recurrent())
                || bits(eager_cache.conv()) != bits(graph_cache.conv())
            {
                return Err(format!("{fast:?}: step {step}: graph state differs from eager").into());
            }
        }
        b.raw().forget_graph(&graph);
    }
    Ok(())
}

/// A failure inside a CUDA graph (a state slot out of range, in device metadata) is reported
/// by the next synchronize, and the same graph launched again after the metadata is fixed runs
/// clean: the forks' failure records start each launch from the origin's.
fn graph_failures_are_reported_and_do_not_stick() -> Result<(), Failed> {
    let b = backend(FastPaths::default());
    let s = b.new_stream().unwrap();
    let aux = b.new_stream().unwrap();
    let (fork, join) = (b.new_event().unwrap(), b.new_event().unwrap());
    let (h, d) = (1, 16);
    let mut rng = Rng(1);
    let q = bf16_tensor(&b, &s, &[4, h, d], &rng.fill(4 * h * d, -1.0, 1.0));
    let g = f32_tensor(&b, &s, &[4, h, d], &rng.fill(4 * h * d, -0.5, 0.0));
    let beta = f32_tensor(&b, &s, &[4, h], &rng.fill(4 * h, 0.0, 1.0));
    let state = f32_tensor(&b, &s, &[2, h, d, d], &vec![0.0; 2 * h * d * d]);
    let o = f32_tensor(&b, &s, &[4, h, d], &vec![0.0; 4 * h * d]);
    let slots = i32_tensor(&b, &s, &[0]);
    let op = Op::KdaChunk(KdaChunk {
        chunk_state_slots: None,
        host_meta: None,
        q: q.clone(),
        k: q.clone(),
        v: q,
        g,
        gate: None,
        beta,
        cu_seqlens: i32_tensor(&b, &s, &[0, 4]),
        state_slots: slots.clone(),
        has_initial_state: i32_tensor(&b, &s, &[0]),
        state,
        o,
        scale: 0.25,
        qk_l2norm: true,
    });
    b.synchronize(&s).unwrap();
    b.begin_capture(&s).unwrap();
    b.record(&fork, &s).unwrap();
    b.wait(&aux, &fork).unwrap();
    b.launch(&aux, op).unwrap();
    b.record(&join, &aux).unwrap();
    b.wait(&s, &join).unwrap();
    let graph = b.end_capture(&s).unwrap();
    b.upload(&s, &slots, &[5i32]).unwrap();
    b.launch_graph(&graph, &s).unwrap();
    match b.synchronize(&s) {
        Err(e) if e.to_string().contains("out of range") => {}
        other => return Err(format!("a bad slot inside the graph gave {other:?}").into()),
    }
    b.upload(&s, &slots, &[1i32]).unwrap();
    b.launch_graph(&graph, &s).unwrap();
    b.synchronize(&s).map_err(|e| format!("the fixed graph still fails: {e}"))?;
    Ok(())
}

fn main() {
    let unavailable = CudaBackend::new().err().map(|e| e.to_string());
    if let Some(why) = &unavailable {
        eprintln!("kda-cuda device trials: every trial is ignored: {why}");
    }
    let checks: &[(&str, Check)] = &[
        (
            "tensor_core_chunk_agrees_with_the_token_by_token_kernel",
            tensor_core_chunk_agrees_with_the_token_by_token_kernel,
        ),
        (
            "fast_mx_gemm_is_within_the_accumulation_bound",
            fast_mx_gemm_is_within_the_accumulation_bound,
        ),
        (
            "graph_replayed_decode_step_equals_eager_bit_for_bit",
            graph_replayed_decode_step_equals_eager_bit_for_bit,
        ),
        (
            "graph_failures_are_reported_and_do_not_stick",
            graph_failures_are_reported_and_do_not_stick,
        ),
    ];
    kda_cuda_trials::run(kda_cuda_trials::checks(unavailable.as_deref(), checks));
}
