//! `kda run`: the main job on an embedded default.
//!
//! Until the KDA layer exists, it runs what is real today: the Kimi K3 TP8 rank-0 projections
//! (fused QKV `[4608, 7168]` in MXFP8 with its DynamicQuant, fused BFG `[3084, 7168]` bf16 and
//! its post-process) under the serial schedule and under the overlapped one (captured once as a
//! graph, validated, replayed), in checked mode, and reports the timings, that both schedules
//! agree bit for bit, and that no stream hazard was found.

use std::time::Instant;

use clap::Args;
use half::bf16;
use kda_core::config::{KdaConfig, Tp};
use kda_core::schedule::{
    MatrixOverlap, ProjectionSchedule, ProjectionWeights, QkvBfgProjection, QkvWeight, labels,
};
use kda_core::weights::{LoadOptions, WeightError, load_layer};
use kda_core::{Backend, DType, ScaleAlg, Tensor};
use kda_reference::{ReferenceBackend, ReferenceOptions};
use kda_testkit::Gen;
use kda_testkit::checkpoint::{SyntheticCheckpoint, SyntheticSpec};

use super::{median_time, ms};
use crate::error::CliError;

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
    // Checked mode: every launch below is analysed for stream hazards (cheap next to the GEMMs);
    // the timeline gives each op's own time.
    let options = ReferenceOptions { checked: true, timeline: true, ..ReferenceOptions::default() };
    let backend = ReferenceBackend::with_options(options)?;
    let info = backend.info();
    let main = backend.new_stream()?;
    // The K3 TP8 rank-0 layer 0 weights from the deterministic synthetic checkpoint (generated
    // in memory, only this rank's shard), with F composed into the fused BFG at load.
    let load_start = Instant::now();
    let config = KdaConfig::kimi_k3();
    let checkpoint = SyntheticCheckpoint::new(SyntheticSpec::new(config.clone(), args.seed));
    let tp = Tp::new(8, 0).map_err(WeightError::from)?;
    let loaded = load_layer(&checkpoint, &config, tp, 0, LoadOptions::default())?;
    let weights = ProjectionWeights::upload(&backend, &main, &loaded.weights)?;
    let load_time = load_start.elapsed();
    let dims = weights.dims();
    let (t, hidden, qkv_width, bfg_width) =
        (args.tokens, dims.hidden, dims.qkv_width(), dims.bfg_width());
    let alg = match weights.qkv() {
        QkvWeight::Mxfp8 { alg, .. } => *alg,
        QkvWeight::Bf16 { .. } => ScaleAlg::OcpFloor,
    };
    let mut rng = Gen::new(args.seed);
    let x = random_tensor(&backend, &main, &mut rng, DType::BF16, &[t, hidden])?;
    backend.synchronize(&main)?;

    let serial = QkvBfgProjection::new(&backend, weights.clone(), ProjectionSchedule::Serial)?;
    let overlapped = QkvBfgProjection::new(&backend, weights, ProjectionSchedule::Overlapped)?;
    let (serial_out, overlapped_out) = (serial.alloc_buffers(&x)?, overlapped.alloc_buffers(&x)?);
    let mut op_times = Vec::new();
    let time_serial = median_time(args.repeats, || {
        backend.clear_timeline();
        serial.forward_into(&main, &x, &serial_out)?;
        backend.synchronize(&main)?;
        op_times.push(backend.timeline());
        Ok::<(), CliError>(())
    })?;
    let op_time = |label: &str| {
        let mut times: Vec<f64> =
            op_times.iter().map(|tl| tl.total(|s| s.label == label).as_secs_f64()).collect();
        times.sort_by(f64::total_cmp);
        times.get(times.len() / 2).copied().unwrap_or(f64::NAN)
    };

    // The overlapped schedule, captured once as a graph (which checks that the aux stream is
    // joined back) and replayed for timing.
    backend.begin_capture(&main)?;
    overlapped.forward_into(&main, &x, &overlapped_out)?;
    let graph = backend.end_capture(&main)?;
    let time_overlapped = median_time(args.repeats, || {
        backend.launch_graph(&graph, &main)?;
        backend.synchronize(&main)
    })?;

    let mut checksum = 0.0f64;
    let pairs = [
        (&serial_out.mixed_qkv, &overlapped_out.mixed_qkv, "mixed_qkv"),
        (&serial_out.bfg, &overlapped_out.bfg, "bfg"),
    ];
    for (a, b, what) in pairs {
        let (va, vb): (Vec<bf16>, Vec<bf16>) =
            (backend.download(&main, a)?, backend.download(&main, b)?);
        if va != vb {
            return Err(CliError::Mismatch { what: what.into(), a: "serial", b: "overlapped" });
        }
        checksum += va.iter().map(|v| f64::from(v.to_f32())).sum::<f64>();
    }
    let (beta_a, beta_b): (Vec<f32>, Vec<f32>) = (
        backend.download(&main, &serial_out.beta)?,
        backend.download(&main, &overlapped_out.beta)?,
    );
    if beta_a.iter().map(|v| v.to_bits()).ne(beta_b.iter().map(|v| v.to_bits())) {
        return Err(CliError::Mismatch { what: "beta".into(), a: "serial", b: "overlapped" });
    }

    let gflop = |n: usize| 2.0 * (t * n * hidden) as f64 / 1e9;
    println!(
        "kda run: Kimi K3 TP8 rank-0 projections, {t} tokens, MXFP8 QKV (scale_alg {}) and fused \
         BFG bf16 ({} backend, {})",
        alg.code(),
        info.name,
        info.capabilities.execution
    );
    println!(
        "  weights: synthetic Kimi K3 checkpoint (seed {}), layer 0, TP 8 rank 0; loaded, F \
         composed into the fused BFG and uploaded in {:.2} s",
        args.seed,
        load_time.as_secs_f64()
    );
    let (quant, qkv) = (op_time(labels::DYNAMIC_QUANT), op_time(labels::QKV_MATMUL));
    let (bfg, post) = (op_time(labels::PROJECT_BFG), op_time(labels::POSTPROCESS_BFG));
    println!(
        "  QKV x[{t}, {hidden}] . w[{qkv_width}, {hidden}]^T  {:>9.2} ms  {:>6.1} GFLOP/s (MXFP8; \
         dynamic_quant {:.3} ms before it)",
        qkv * 1e3,
        gflop(qkv_width) / qkv,
        quant * 1e3
    );
    println!(
        "  BFG x[{t}, {hidden}] . w[{bfg_width}, {hidden}]^T  {:>9.2} ms  {:>6.1} GFLOP/s (bf16; \
         postprocess {:.3} ms after it)",
        bfg * 1e3,
        gflop(bfg_width) / bfg,
        post * 1e3
    );
    println!("  serial (one stream)                {:>9.2} ms", ms(time_serial));
    let policy = match overlapped.matrix_overlap() {
        MatrixOverlap::Serialized => "GEMMs serialized",
        MatrixOverlap::Concurrent => "GEMMs concurrent",
    };
    println!(
        "  overlapped (two streams, {policy}) {:>9.2} ms  speedup {:.2}x over serial",
        ms(time_overlapped),
        time_serial.as_secs_f64() / time_overlapped.as_secs_f64()
    );
    println!(
        "  serial and overlapped outputs (mixed_qkv, beta, g1, g2) identical bit for bit; \
         checksum {checksum:.6e}"
    );
    let hazards = backend.instrumentation().hazards();
    let ops = backend.instrumentation().log().len();
    println!(
        "  capture valid ({} streams joined); sanitizer: {ops} calls checked, {} hazards",
        graph.streams(),
        hazards.len()
    );
    Ok(())
}
