//! `kda run`: the main job on an embedded default.
//!
//! Until the KDA layer exists, it runs what is real today: the Kimi K3 TP8 rank-0 projection
//! GEMMs (fused QKV `[4608, 7168]` and fused BFG `[3084, 7168]`, bf16) on one stream and then on
//! two streams ordered by events, and reports the timings and that both orders agree bit for bit.

use clap::Args;
use half::bf16;
use kda_core::{Backend, DType, Op, Tensor};
use kda_reference::{ReferenceBackend, ReferenceOptions};
use kda_testkit::Gen;

use super::{median_time, ms};
use crate::error::CliError;

/// Kimi K3 hidden size.
const HIDDEN: usize = 7168;
/// Local fused QKV width at TP 8: `3 * 1536`.
const QKV_WIDTH: usize = 4608;
/// Local fused BFG width at TP 8: `12 + 1536 + 1536`.
const BFG_WIDTH: usize = 3084;

#[derive(Debug, Args)]
pub struct RunArgs {
    /// Tokens in the batch (rows of the activation).
    #[arg(long, default_value_t = 256)]
    pub tokens: usize,
    /// Timed repeats of each schedule (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// Seed of the synthetic weights and activations.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// Allocate a tensor and fill it with seeded uniform values in [-1, 1).
pub fn random_tensor<B: Backend>(
    backend: &B,
    stream: &B::Stream,
    rng: &mut Gen,
    dtype: DType,
    shape: &[usize],
) -> Result<Tensor<B>, CliError> {
    let t = backend.alloc(dtype, shape)?;
    let n = t.numel();
    match dtype {
        DType::BF16 => backend.upload(stream, &t, &rng.uniform_bf16(n, -1.0, 1.0))?,
        DType::F32 => backend.upload(stream, &t, &rng.uniform_f32(n, -1.0, 1.0))?,
        other => {
            return Err(CliError::Argument {
                arg: "dtype",
                reason: format!("{other} is not generated"),
            });
        }
    }
    Ok(t)
}

pub fn run(args: &RunArgs) -> Result<(), CliError> {
    if args.tokens == 0 {
        return Err(CliError::Argument { arg: "--tokens", reason: "must be at least 1".into() });
    }
    // Checked mode: every launch below is analysed for stream hazards (cheap next to the GEMMs).
    let options = ReferenceOptions { checked: true, ..ReferenceOptions::default() };
    let backend = ReferenceBackend::with_options(options)?;
    let info = backend.info();
    let (main, aux) = (backend.new_stream()?, backend.new_stream()?);
    let mut rng = Gen::new(args.seed);
    let t = args.tokens;
    let x = random_tensor(&backend, &main, &mut rng, DType::BF16, &[t, HIDDEN])?;
    let w_qkv = random_tensor(&backend, &main, &mut rng, DType::BF16, &[QKV_WIDTH, HIDDEN])?;
    let w_bfg = random_tensor(&backend, &main, &mut rng, DType::BF16, &[BFG_WIDTH, HIDDEN])?;
    let outputs = |b: &ReferenceBackend| -> Result<[Tensor<ReferenceBackend>; 2], CliError> {
        Ok([b.alloc(DType::BF16, &[t, QKV_WIDTH])?, b.alloc(DType::BF16, &[t, BFG_WIDTH])?])
    };
    let [qkv_serial, bfg_serial] = outputs(&backend)?;
    let [qkv_overlap, bfg_overlap] = outputs(&backend)?;
    backend.synchronize(&main)?;

    let qkv =
        |y: &Tensor<ReferenceBackend>| Op::Gemm { x: x.clone(), w: w_qkv.clone(), y: y.clone() };
    let bfg =
        |y: &Tensor<ReferenceBackend>| Op::Gemm { x: x.clone(), w: w_bfg.clone(), y: y.clone() };

    let time_qkv = median_time(args.repeats, || {
        backend.launch(&main, qkv(&qkv_serial))?;
        backend.synchronize(&main)
    })?;
    let time_bfg = median_time(args.repeats, || {
        backend.launch(&main, bfg(&bfg_serial))?;
        backend.synchronize(&main)
    })?;
    let serial = median_time(args.repeats, || {
        backend.launch(&main, qkv(&qkv_serial))?;
        backend.launch(&main, bfg(&bfg_serial))?;
        backend.synchronize(&main)
    })?;
    // The two-stream order, captured once as a graph (which checks that the aux stream is
    // joined back) and replayed for timing.
    let (hidden_ready, bfg_ready) = (backend.new_event()?, backend.new_event()?);
    backend.begin_capture(&main)?;
    backend.record(&hidden_ready, &main)?;
    backend.wait(&aux, &hidden_ready)?;
    backend.launch_labeled(&aux, "project_bfg", bfg(&bfg_overlap))?;
    backend.record(&bfg_ready, &aux)?;
    backend.launch_labeled(&main, "qkv_matmul", qkv(&qkv_overlap))?;
    backend.wait(&main, &bfg_ready)?;
    let graph = backend.end_capture(&main)?;
    let concurrent = median_time(args.repeats, || {
        backend.launch_graph(&graph, &main)?;
        backend.synchronize(&main)
    })?;

    let mut checksum = 0.0f64;
    for (a, b, what) in [(&qkv_serial, &qkv_overlap, "qkv"), (&bfg_serial, &bfg_overlap, "bfg")] {
        let (va, vb): (Vec<bf16>, Vec<bf16>) =
            (backend.download(&main, a)?, backend.download(&main, b)?);
        if va != vb {
            return Err(CliError::Mismatch { what: what.into(), a: "serial", b: "concurrent" });
        }
        checksum += va.iter().map(|v| f64::from(v.to_f32())).sum::<f64>();
    }

    let gflop = |n: usize| 2.0 * (t * n * HIDDEN) as f64 / 1e9;
    println!(
        "kda run: Kimi K3 TP8 rank-0 projection GEMMs, {t} tokens, bf16 ({} backend, {})",
        info.name, info.capabilities.execution
    );
    for (name, n, time) in [("QKV", QKV_WIDTH, time_qkv), ("BFG", BFG_WIDTH, time_bfg)] {
        println!(
            "  {name} x[{t}, {HIDDEN}] . w[{n}, {HIDDEN}]^T   {:>8.1} ms  {:>6.1} GFLOP/s",
            ms(time),
            gflop(n) / time.as_secs_f64()
        );
    }
    println!("  serial (one stream)                {:>8.1} ms", ms(serial));
    println!(
        "  concurrent (two streams, events)   {:>8.1} ms  speedup {:.2}x over serial",
        ms(concurrent),
        serial.as_secs_f64() / concurrent.as_secs_f64()
    );
    println!("  serial and concurrent outputs identical bit for bit; checksum {checksum:.6e}");
    let hazards = backend.instrumentation().hazards();
    let ops = backend.instrumentation().log().len();
    println!(
        "  capture valid ({} streams joined); sanitizer: {ops} calls checked, {} hazards",
        graph.streams(),
        hazards.len()
    );
    Ok(())
}
