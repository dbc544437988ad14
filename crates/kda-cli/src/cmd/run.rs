//! `kda run`: the main job on an embedded default.
//!
//! Until the KDA layer exists, it runs what is real today: the Kimi K3 TP8 rank-0 projections
//! (fused QKV `[4608, 7168]` in MXFP8 with its DynamicQuant, fused BFG `[3084, 7168]` bf16 and
//! its post-process) under the serial schedule and under the overlapped one (captured once as a
//! graph, validated, replayed), in checked mode, and reports the timings, that both schedules
//! agree bit for bit, and that no stream hazard was found.

use clap::Args;
use half::bf16;
use kda_core::schedule::{
    BfgWeight, MatrixOverlap, ProjectionDims, ProjectionSchedule, ProjectionWeights,
    QkvBfgProjection, QkvWeight, labels,
};
use kda_core::{Backend, DType, Op, ScaleAlg, Tensor};
use kda_reference::{ReferenceBackend, ReferenceOptions};
use kda_testkit::Gen;

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
    let mut rng = Gen::new(args.seed);
    let dims = ProjectionDims::K3_TP8;
    let (t, hidden, qkv_width, bfg_width) =
        (args.tokens, dims.hidden, dims.qkv_width(), dims.bfg_width());
    let x = random_tensor(&backend, &main, &mut rng, DType::BF16, &[t, hidden])?;
    // MXFP8 QKV weight: a bf16 weight quantized on the device (OCP floor scales).
    let alg = ScaleAlg::OcpFloor;
    let dense = random_tensor(&backend, &main, &mut rng, DType::BF16, &[qkv_width, hidden])?;
    let data = backend.alloc(DType::E4M3, &[qkv_width, hidden])?;
    let scale = backend.alloc(DType::E8M0, &[qkv_width, kda_core::mx::num_blocks(hidden)])?;
    backend.launch(
        &main,
        Op::DynamicQuant { x: dense, data: data.clone(), scale: scale.clone(), alg },
    )?;
    let w_bfg = random_tensor(&backend, &main, &mut rng, DType::BF16, &[bfg_width, hidden])?;
    let weights = ProjectionWeights::new(
        dims,
        QkvWeight::Mxfp8 { data, scale, alg },
        BfgWeight::Composed { w: w_bfg },
    )?;
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
