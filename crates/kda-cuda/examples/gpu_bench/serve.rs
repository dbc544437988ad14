//! `gpu_bench --serve`: kda's side of gpu-check's interleaved comparison
//! (xtask/src/gpu_check/peers.rs). A line protocol on stdin/stdout: `@ready <kinds>` once, then
//! for each request `<id> <case> <target ms>` one `@result <id> <case> <ms per call>` or
//! `@error <id> <case> <message>` (the id lets the asking side drop a reply that comes after
//! it stopped waiting). A case's first request builds it, runs it once (a graph is run once
//! eagerly, then captured and instantiated there) and fixes how many calls fill the target;
//! every request times that many calls between two CUDA events on the case's stream.
//!
//! Cases (`:`-separated; fast paths on unless the case names the exact one):
//! `chunk:T:H:D`, `chunk_exact:T:H:D` (KdaChunk, one request), `gemm:M:N:K` (bf16 Gemm),
//! `mx_gemm:M:N:K:exact|fast`, `quant:M:K` (DynamicQuant of bf16),
//! `schedule:serial|overlapped_serialized|overlapped_concurrent:T:eager|graph` (the projection
//! at K3 TP8, MXFP8 QKV), `layer_prefill:R:T:eager` (R fresh requests of T tokens),
//! `layer_decode:B:eager|graph` (B single-token requests) — the whole K3 TP8 layer.

use std::collections::HashMap;
use std::io::{BufRead, Write};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;

use kda_core::{DType, Device, Error, Op, Result, Tensor};
use kda_cuda::{CudaBackend, CudaOptions, CudaStream, FastPaths};
use kda_model::layer::{BatchMeta, KdaLayer, RequestSlots};
use kda_model::schedule::{MatrixOverlap, ProjectionDims, ProjectionSchedule, QkvBfgProjection};

use crate::data::{
    B, Rng, bf16_tensor, chunk_problem, hal, k3_tp8_layer, projection_weights, quantized,
};

/// What each case kind's first word is.
const KINDS: &str = "chunk chunk_exact gemm mx_gemm quant schedule layer_prefill layer_decode";

/// A built case: one call, its stream and backend, and how many calls a request times.
struct Prepared {
    backend: Device<B>,
    stream: CudaStream,
    call: Box<dyn FnMut() -> Result<()>>,
    calls: usize,
}

/// The server's backends (spec and fast paths) and the K3 TP8 layer, built on first use.
struct Server {
    spec: Device<B>,
    fast: Device<B>,
    layer: Option<(CudaStream, Arc<KdaLayer<B>>)>,
    cases: HashMap<String, Prepared>,
}

fn bad(case: &str) -> Error {
    Error::Backend { backend: "cuda", message: format!("gpu_bench: cannot measure {case}") }
}

fn dims<const N: usize>(case: &str, words: &[&str]) -> Result<[usize; N]> {
    let mut out = [0; N];
    for (o, w) in out.iter_mut().zip(words) {
        *o = w.parse().map_err(|_| bad(case))?;
    }
    if words.len() < N {
        return Err(bad(case));
    }
    Ok(out)
}

impl Server {
    fn new() -> Result<Self> {
        let options = |fast| CudaOptions { checked: false, fast, ..CudaOptions::default() };
        Ok(Self {
            spec: CudaBackend::with_options(options(FastPaths::default()))?,
            fast: CudaBackend::with_options(options(FastPaths::ALL))?,
            layer: None,
            cases: HashMap::new(),
        })
    }

    fn layer(&mut self) -> Result<(CudaStream, Arc<KdaLayer<B>>)> {
        if self.layer.is_none() {
            let s = self.fast.new_stream()?;
            let layer = k3_tp8_layer(&self.fast, &s, ProjectionSchedule::Overlapped)?;
            self.layer = Some((s, Arc::new(layer)));
        }
        self.layer.clone().ok_or_else(|| bad("layer"))
    }

    fn build(&mut self, case: &str) -> Result<Prepared> {
        let words: Vec<&str> = case.split(':').collect();
        let (kind, rest) = words.split_first().ok_or_else(|| bad(case))?;
        let mut rng = Rng(21);
        match *kind {
            "chunk" | "chunk_exact" => {
                let [t, h, d] = dims(case, rest)?;
                let b = if *kind == "chunk" { self.fast.clone() } else { self.spec.clone() };
                let s = b.new_stream()?;
                let op = chunk_problem(&b, &s, t, h, d)?;
                let (bb, ss) = (b.clone(), s.clone());
                let call = Box::new(move || bb.launch(&ss, Op::KdaChunk(op.clone())));
                Ok(Prepared { backend: b, stream: s, call, calls: 1 })
            }
            "gemm" => {
                let [m, n, k] = dims(case, rest)?;
                let b = self.fast.clone();
                let s = b.new_stream()?;
                let x = bf16_tensor(&b, &s, &mut rng, &[m, k], -1.0, 1.0)?;
                let w = bf16_tensor(&b, &s, &mut rng, &[n, k], -0.05, 0.05)?;
                let y = b.alloc(DType::BF16, &[m, n])?;
                let (bb, ss) = (b.clone(), s.clone());
                let call = Box::new(move || {
                    bb.launch(&ss, Op::Gemm { x: x.clone(), w: w.clone(), y: y.clone() })
                });
                Ok(Prepared { backend: b, stream: s, call, calls: 1 })
            }
            "mx_gemm" => {
                let [m, n, k] = dims(case, rest)?;
                let b = match rest.get(3) {
                    Some(&"exact") => self.spec.clone(),
                    Some(&"fast") => self.fast.clone(),
                    _ => return Err(bad(case)),
                };
                let s = b.new_stream()?;
                let (a, a_scale) =
                    quantized(&b, &s, bf16_tensor(&b, &s, &mut rng, &[m, k], -1.0, 1.0)?)?;
                let (w, w_scale) =
                    quantized(&b, &s, bf16_tensor(&b, &s, &mut rng, &[n, k], -0.05, 0.05)?)?;
                let y = b.alloc(DType::BF16, &[m, n])?;
                let (bb, ss) = (b.clone(), s.clone());
                let call = Box::new(move || {
                    let op = Op::MxGemm {
                        a: a.clone(),
                        a_scale: a_scale.clone(),
                        w: w.clone(),
                        w_scale: w_scale.clone(),
                        y: y.clone(),
                    };
                    bb.launch(&ss, op)
                });
                Ok(Prepared { backend: b, stream: s, call, calls: 1 })
            }
            "quant" => {
                let [m, k] = dims(case, rest)?;
                let b = self.fast.clone();
                let s = b.new_stream()?;
                let x = bf16_tensor(&b, &s, &mut rng, &[m, k], -1.0, 1.0)?;
                let data = b.alloc(DType::E4M3, &[m, k])?;
                let scale = b.alloc(DType::E8M0, &[m, kda_core::mx::num_blocks(k)])?;
                let (bb, ss) = (b.clone(), s.clone());
                let call = Box::new(move || {
                    let alg = kda_core::mx::ScaleAlg::OcpFloor;
                    bb.launch(
                        &ss,
                        Op::DynamicQuant {
                            x: x.clone(),
                            data: data.clone(),
                            scale: scale.clone(),
                            alg,
                        },
                    )
                });
                Ok(Prepared { backend: b, stream: s, call, calls: 1 })
            }
            "schedule" => {
                let (name, t, mode) = match rest {
                    [name, t, mode] => (*name, t.parse::<usize>().map_err(|_| bad(case))?, *mode),
                    _ => return Err(bad(case)),
                };
                let (schedule, policy) = match name {
                    "serial" => (ProjectionSchedule::Serial, MatrixOverlap::Serialized),
                    "overlapped_serialized" => {
                        (ProjectionSchedule::Overlapped, MatrixOverlap::Serialized)
                    }
                    "overlapped_concurrent" => {
                        (ProjectionSchedule::Overlapped, MatrixOverlap::Concurrent)
                    }
                    _ => return Err(bad(case)),
                };
                let b = self.fast.clone();
                let s = b.new_stream()?;
                let weights = projection_weights(&b, &s, &mut rng, true)?;
                let p = QkvBfgProjection::new(&b, weights, schedule)?.with_matrix_overlap(policy);
                let x =
                    bf16_tensor(&b, &s, &mut rng, &[t, ProjectionDims::K3_TP8.hidden], -1.0, 1.0)?;
                let out = p.alloc_buffers(&x)?;
                let forward = move |ss: &CudaStream| p.forward_into(ss, &x, &out).map(|_| ());
                self.eager_or_graph(case, b, s, mode, forward)
            }
            "layer_prefill" => {
                let [r, t] = dims(case, rest)?;
                let (s, layer) = self.layer()?;
                let b = self.fast.clone();
                let hidden = layer.dims().hidden;
                let x = bf16_tensor(&b, &s, &mut rng, &[r * t, hidden], -1.0, 1.0)?;
                let meta = BatchMeta::prefills(&vec![t; r], &(0..r).collect::<Vec<_>>());
                let mut cache = hal(layer.new_cache(&s, r, 0))?;
                let mut out = b.alloc(DType::F32, &[r * t, hidden])?;
                let ss = s.clone();
                let call =
                    Box::new(move || hal(layer.forward(&ss, &x, &meta, &mut cache, &mut out)));
                Ok(Prepared { backend: b, stream: s, call, calls: 1 })
            }
            "layer_decode" => {
                let (batch, mode) = match rest {
                    [n, mode] => (n.parse::<usize>().map_err(|_| bad(case))?, *mode),
                    _ => return Err(bad(case)),
                };
                let (s, layer) = self.layer()?;
                let b = self.fast.clone();
                let hidden = layer.dims().hidden;
                let x = bf16_tensor(&b, &s, &mut rng, &[batch, hidden], -1.0, 1.0)?;
                let mut meta = BatchMeta::empty();
                for slot in 0..batch {
                    meta.push(1, 1024, RequestSlots::Single(slot));
                }
                let mut cache = hal(layer.new_cache(&s, batch, 0))?;
                let mut out: Tensor<B> = b.alloc(DType::F32, &[batch, hidden])?;
                let forward =
                    move |ss: &CudaStream| hal(layer.forward(ss, &x, &meta, &mut cache, &mut out));
                self.eager_or_graph(case, b, s, mode, forward)
            }
            _ => Err(bad(case)),
        }
    }

    /// `forward` as the case's call (`eager`), or captured once and launched as a graph.
    fn eager_or_graph(
        &self,
        case: &str,
        b: Device<B>,
        s: CudaStream,
        mode: &str,
        mut forward: impl FnMut(&CudaStream) -> Result<()> + 'static,
    ) -> Result<Prepared> {
        match mode {
            "eager" => {
                let ss = s.clone();
                Ok(Prepared {
                    backend: b,
                    stream: s,
                    call: Box::new(move || forward(&ss)),
                    calls: 1,
                })
            }
            "graph" => {
                // Once eagerly first: cuBLAS meets every GEMM shape outside the capture.
                forward(&s)?;
                b.synchronize(&s)?;
                b.begin_capture(&s)?;
                let captured = forward(&s);
                let graph = b.end_capture(&s)?;
                captured?;
                let route = b.raw().instantiate_graph(&graph, &s)?;
                eprintln!("gpu_bench: {case}: {route:?}");
                let (bb, ss) = (b.clone(), s.clone());
                let call = Box::new(move || bb.launch_graph(&graph, &ss));
                Ok(Prepared { backend: b, stream: s, call, calls: 1 })
            }
            _ => Err(bad(case)),
        }
    }

    /// Milliseconds per call of `case` (building it on its first request).
    fn measure(&mut self, case: &str, target_ms: f64) -> Result<f64> {
        if !self.cases.contains_key(case) {
            let mut p = self.build(case)?;
            (p.call)()?;
            p.backend.synchronize(&p.stream)?;
            let once = f64::from(p.backend.raw().elapsed_ms(&p.stream, &mut p.call)?).max(1e-3);
            p.calls = ((target_ms / once) as usize).clamp(1, 1000);
            self.cases.insert(case.to_string(), p);
        }
        let p = self.cases.get_mut(case).ok_or_else(|| bad(case))?;
        p.backend.synchronize(&p.stream)?;
        let (calls, call) = (p.calls, &mut p.call);
        let ms = p.backend.raw().elapsed_ms(&p.stream, || (0..calls).try_for_each(|_| call()))?;
        p.backend.synchronize(&p.stream)?;
        Ok(f64::from(ms) / calls as f64)
    }
}

/// Serve requests until stdin closes.
pub fn serve() -> i32 {
    let mut server = match Server::new() {
        Ok(s) => s,
        Err(e) => {
            println!("@ready");
            eprintln!("gpu_bench --serve: {e}");
            return 1;
        }
    };
    println!("@ready {KINDS}");
    let _ = std::io::stdout().flush();
    for line in std::io::stdin().lock().lines().map_while(std::io::Result::ok) {
        let mut words = line.split_whitespace();
        let (Some(id), Some(case)) = (words.next(), words.next()) else { continue };
        let target = words.next().and_then(|w| w.parse().ok()).unwrap_or(40.0);
        let measured = catch_unwind(AssertUnwindSafe(|| server.measure(case, target)));
        match measured {
            Ok(Ok(ms)) => println!("@result {id} {case} {ms:.6}"),
            Ok(Err(e)) => println!("@error {id} {case} {}", e.to_string().replace('\n', " ")),
            Err(_) => println!("@error {id} {case} panicked (see the log)"),
        }
        let _ = std::io::stdout().flush();
    }
    0
}
