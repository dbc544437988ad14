//! `kda run`: the main job on an embedded default.
//!
//! One KDA layer (by default layer 0 of a deterministic synthetic Kimi K3 checkpoint, TP 8
//! rank 0, F composed into the fused BFG at load, MXFP8 QKV) on the reference backend, one
//! core per stream (or on the backend `--backend` names), in checked mode: a prefill batch
//! ([`Workload`]: 4 requests × 512 tokens) under the serial and the overlapped schedule, then
//! decode steps (one token per request) replayed from one captured graph of the overlapped
//! layer, each step checked against the serial layer run eagerly. It reports load and composition time, op time per stage, the
//! overlapped schedule's speedup and hidden vector fraction, prefill tokens/s, decode step
//! latency, an output checksum (the f64 sum of every output element of the prefill and the
//! decode steps, in order), and whether the capture was valid and the sanitizer silent. The op
//! times per stage and the hidden vector fraction come from the reference backend's op
//! timeline; on other backends the report says they were not measured.

use std::time::{Duration, Instant};

use clap::Args;
use kda_core::timeline::{Span, Timeline};
use kda_core::{Backend, DType, Device, Tensor};
use kda_model::config::QkvFormat;
use kda_model::layer::{BatchShape, KdaLayer, LayerOptions, StateCache};
use kda_model::schedule::{MatrixOverlap, ProjectionSchedule, labels};
use kda_synth::workload::Workload;

use super::backend::{BackendArg, CliBackend, Settings, on_backend};
use super::model::{self, CoreArg, ModelArgs, ScheduleArg};
use super::ms;
use crate::error::CliError;

#[derive(Debug, Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub device: BackendArg,
    /// The schedule under test; `overlapped` also runs `serial` to compare with.
    #[arg(long, value_enum, default_value_t = ScheduleArg::Overlapped)]
    pub schedule: ScheduleArg,
    /// Requests in the prefill batch (each then decodes).
    #[arg(long, default_value_t = 4)]
    pub requests: usize,
    /// Prompt tokens per request.
    #[arg(long, default_value_t = 512)]
    pub tokens: usize,
    /// Decode steps after the prefill (one token per request each).
    #[arg(long, default_value_t = 16)]
    pub decode_steps: usize,
    /// Let the planner pick the schedule and the F form on this chip's figures (910b, 950,
    /// h200, host) for the prefill's token count, instead of --schedule; prints what it picked
    /// and the predicted times behind it in one line.
    #[arg(long, value_name = "CHIP")]
    pub auto: Option<String>,
    /// The KDA core's operand dtype; default: the backend's choice (bf16 on Ascend where CANN
    /// has aclnnChunkKdaFwd, f32 elsewhere).
    #[arg(long, value_enum)]
    pub core_operands: Option<CoreArg>,
}

/// The op labels of each stage of the layer, for the per-stage report.
const STAGES: [(&str, &[&str]); 6] = [
    (
        "projections",
        &[
            labels::DYNAMIC_QUANT,
            labels::QKV_MATMUL,
            labels::QKV_LINEAR_QUANT,
            labels::PROJECT_BFG,
            labels::PROJECT_BFG_B,
            labels::PROJECT_BFG_F_A,
            labels::PROJECT_BFG_F_B,
            labels::PROJECT_BFG_G,
            labels::POSTPROCESS_BFG,
        ],
    ),
    ("conv", &["causal_conv", "causal_conv_update"]),
    ("gate + beta", &["l2norm", "kda_gate", "sigmoid", "beta_sigmoid"]),
    // The chunked prefill applies the gate in-kernel: its gate time is part of "recurrence".
    ("recurrence", &["kda_chunk", "kda_recurrent"]),
    ("output norm", &["gated_rms_norm"]),
    ("o_proj", &["o_proj"]),
];

/// The vector work the overlapped schedule hides, and the GEMMs it hides it under.
fn is_hidden_vector(s: &Span) -> bool {
    s.label == labels::DYNAMIC_QUANT || s.label == labels::POSTPROCESS_BFG
}

fn is_projection_gemm(s: &Span) -> bool {
    s.label == labels::QKV_MATMUL || s.label.starts_with(labels::PROJECT_BFG)
}

/// One layer with its own cache and buffers.
struct Path<B: Backend> {
    layer: KdaLayer<B>,
    cache: StateCache<B>,
    out: Tensor<B>,
    x_decode: Tensor<B>,
    out_decode: Tensor<B>,
}

impl<B: Backend> Path<B> {
    fn new(
        b: &Device<B>,
        s: &B::Stream,
        loaded: &model::Loaded,
        options: LayerOptions,
        w: &Workload,
    ) -> Result<Self, CliError> {
        let layer = KdaLayer::new(b, s, &loaded.weights, options)?;
        let hidden = layer.dims().hidden;
        Ok(Self {
            cache: layer.new_cache(s, w.requests, 0)?,
            out: b.alloc(DType::F32, &[w.prefill_tokens(), hidden])?,
            x_decode: b.alloc(DType::BF16, &[w.requests, hidden])?,
            out_decode: b.alloc(DType::F32, &[w.requests, hidden])?,
            layer,
        })
    }

    /// The prefill, timed from launch to completion.
    fn prefill(
        &mut self,
        b: &Device<B>,
        s: &B::Stream,
        x: &Tensor<B>,
        w: &Workload,
    ) -> Result<Duration, CliError> {
        b.synchronize(s)?;
        let start = Instant::now();
        self.layer.forward(s, x, &w.prefill_meta(), &mut self.cache, &mut self.out)?;
        b.synchronize(s)?;
        Ok(start.elapsed())
    }
}

fn f64_sum(values: &[f32]) -> f64 {
    values.iter().map(|&v| f64::from(v)).sum()
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

fn check_same(what: String, a: &[f32], b: &[f32]) -> Result<(), CliError> {
    if same_bits(a, b) {
        Ok(())
    } else {
        Err(CliError::Mismatch { what, a: "serial", b: "overlapped" })
    }
}

pub fn run(args: &RunArgs) -> Result<(), CliError> {
    let w = model::workload(&args.model, args.requests, args.tokens, args.decode_steps)?;
    // Checked mode: every launch is analysed for stream hazards (cheap next to the GEMMs); the
    // timeline gives each op's own time.
    let settings = Settings { checked: Some(true), timeline: true, ..Settings::default() };
    on_backend!(args.device.backend, &settings, |b| run_on(args, w, b))
}

fn run_on<B: CliBackend>(args: &RunArgs, w: Workload, b: Device<B>) -> Result<(), CliError> {
    let info = b.info();
    let main = b.new_stream()?;

    let loaded = model::load(&args.model)?;
    let (options, choice) = match &args.auto {
        Some(chip) => {
            let tokens = w.prefill_tokens();
            let (options, choice) =
                super::plan::auto_options(chip, &loaded.weights, BatchShape::Prefill, tokens)?;
            (options, Some(choice))
        }
        None => {
            let schedule = Some(args.schedule.into());
            (LayerOptions { schedule, ..LayerOptions::default() }, None)
        }
    };
    let options = LayerOptions { core_operands: args.core_operands.map(Into::into), ..options };
    let upload_start = Instant::now();
    let mut path = Path::new(&b, &main, &loaded, options, &w)?;
    // The serial schedule with the same F form, to compare with bit for bit.
    let mut serial = match path.layer.schedule() {
        ProjectionSchedule::Overlapped => {
            let schedule = Some(ProjectionSchedule::Serial);
            let serial = LayerOptions {
                schedule,
                forget: options.forget,
                core_operands: options.core_operands,
                ..LayerOptions::default()
            };
            Some(Path::new(&b, &main, &loaded, serial, &w)?)
        }
        ProjectionSchedule::Serial => None,
    };
    b.synchronize(&main)?;
    let upload_time = upload_start.elapsed();
    let dims = *path.layer.dims();
    let hidden = dims.hidden;

    // Prefill.
    let x = b.alloc(DType::BF16, &[w.prefill_tokens(), hidden])?;
    b.upload(&main, &x, &w.prefill_hidden(hidden))?;
    let serial_time = match serial.as_mut() {
        Some(p) => Some(p.prefill(&b, &main, &x, &w)?),
        None => None,
    };
    B::clear_timeline(&b);
    let prefill_time = path.prefill(&b, &main, &x, &w)?;
    let timeline = B::timeline(&b);
    let prefill_out: Vec<f32> = b.download(&main, &path.out)?;
    if let Some(p) = &serial {
        check_same("prefill output".into(), &b.download::<f32>(&main, &p.out)?, &prefill_out)?;
    }
    let mut checksum = f64_sum(&prefill_out);

    // Decode: one captured graph of a decode step, replayed per step with new inputs.
    let decode = w.decode_meta(0);
    b.begin_capture(&main)?;
    path.layer.forward(&main, &path.x_decode, &decode, &mut path.cache, &mut path.out_decode)?;
    let graph = b.end_capture(&main)?;
    let mut step_times = Vec::with_capacity(w.decode_steps);
    let mut serial_step_times = Vec::with_capacity(w.decode_steps);
    for step in 0..w.decode_steps {
        let input = w.decode_hidden(step, hidden);
        b.upload(&main, &path.x_decode, &input)?;
        b.synchronize(&main)?;
        let start = Instant::now();
        b.launch_graph(&graph, &main)?;
        b.synchronize(&main)?;
        step_times.push(start.elapsed());
        let out: Vec<f32> = b.download(&main, &path.out_decode)?;
        if let Some(p) = serial.as_mut() {
            b.upload(&main, &p.x_decode, &input)?;
            b.synchronize(&main)?;
            let start = Instant::now();
            let meta = w.decode_meta(step);
            p.layer.forward(&main, &p.x_decode, &meta, &mut p.cache, &mut p.out_decode)?;
            b.synchronize(&main)?;
            serial_step_times.push(start.elapsed());
            let expected: Vec<f32> = b.download(&main, &p.out_decode)?;
            check_same(format!("decode step {step} output"), &expected, &out)?;
        }
        checksum += f64_sum(&out);
    }
    if let Some(p) = &serial {
        let (a, c) = (p.cache.recurrent(), path.cache.recurrent());
        check_same(
            "final recurrent states".into(),
            &b.download(&main, a)?,
            &b.download(&main, c)?,
        )?;
    }
    let hazards = b.instrumentation().hazards();
    if let Some(first) = hazards.first() {
        return Err(CliError::Hazards { count: hazards.len(), first: first.to_string() });
    }

    // The report.
    let tp = loaded.tp;
    println!(
        "kda run: layer {} of the {}, TP rank {} of {} ({} backend, {}, checked)",
        args.model.layer, loaded.origin, tp.rank, tp.size, info.name, info.capabilities.execution
    );
    println!(
        "  shapes: hidden {hidden}, {} local heads of {}, QKV {}, gate {:?}, core operands {}",
        dims.local_heads,
        dims.head_dim,
        match loaded.config.qkv_format() {
            QkvFormat::Dense => "bf16".to_string(),
            QkvFormat::Mxfp8 { scale_alg } => format!("MXFP8 (scale_alg {})", scale_alg.code()),
        },
        loaded.weights.gate,
        path.layer.core_operands().dtype().name()
    );
    println!(
        "  load: checkpoint read and fused weights composed in {:.3} s; uploaded in {:.3} s",
        loaded.load_time.as_secs_f64(),
        upload_time.as_secs_f64()
    );
    let n = w.prefill_tokens();
    println!("  prefill: {} requests x {} tokens = {n} tokens", w.requests, w.prompt_tokens);
    if let Some(choice) = &choice {
        println!("  {}", choice.explain());
    }
    let policy = match path.layer.projection().matrix_overlap() {
        MatrixOverlap::Serialized => "GEMMs serialized",
        MatrixOverlap::Concurrent => "GEMMs concurrent",
    };
    match serial_time {
        Some(serial_time) => {
            println!("    serial      {:>10.2} ms", ms(serial_time));
            println!(
                "    overlapped  {:>10.2} ms ({policy}): speedup {:.2}x over serial",
                ms(prefill_time),
                serial_time.as_secs_f64() / prefill_time.as_secs_f64()
            );
        }
        None => println!("    serial      {:>10.2} ms", ms(prefill_time)),
    }
    if let Some(f) =
        timeline.as_ref().and_then(|t| t.hidden_fraction(is_hidden_vector, is_projection_gemm))
    {
        println!(
            "    hidden vector fraction {f:.3} (dynamic_quant and postprocess_bfg time under a \
             GEMM on the other stream)"
        );
    }
    println!("    prefill throughput {:.1} tokens/s", n as f64 / prefill_time.as_secs_f64());
    match &timeline {
        Some(timeline) => println!("    op time by stage: {}", stage_times(timeline)),
        None => println!(
            "    op time by stage, hidden vector fraction: not measured (the {} backend records \
             no op timeline; --backend reference does)",
            info.name
        ),
    }
    let median = |mut v: Vec<Duration>| {
        v.sort();
        v.get(v.len() / 2).copied()
    };
    if let Some(step) = median(step_times) {
        print!(
            "  decode: {} steps x {} requests from one captured graph: step latency {:.2} ms \
             (median)",
            w.decode_steps,
            w.requests,
            ms(step)
        );
        match median(serial_step_times) {
            Some(s) => println!("; serial eager {:.2} ms", ms(s)),
            None => println!(),
        }
    }
    if serial.is_some() {
        println!(
            "  serial and overlapped identical bit for bit: prefill, {} decode steps, final states",
            w.decode_steps
        );
    }
    println!("  checksum: {checksum:e}");
    println!(
        "  capture valid ({} streams joined, {} ops), no hazards ({} calls checked)",
        graph.streams(),
        graph.ops().len(),
        b.instrumentation().log().len()
    );
    Ok(())
}

/// `stage a ms, stage b ms, ..., other c ms` from the op spans of one forward (stages that ran
/// no op left out).
fn stage_times(t: &Timeline) -> String {
    let stage_of = |label: &str| STAGES.iter().position(|(_, ls)| ls.contains(&label));
    let mut totals = [None::<Duration>; STAGES.len() + 1];
    for s in &t.spans {
        let total = &mut totals[stage_of(&s.label).unwrap_or(STAGES.len())];
        *total = Some(total.unwrap_or_default() + s.duration());
    }
    let names = STAGES.iter().map(|(n, _)| *n).chain(["other"]);
    names
        .zip(totals)
        .filter_map(|(n, d)| d.map(|d| format!("{n} {:.2} ms", ms(d))))
        .collect::<Vec<_>>()
        .join(", ")
}
