//! `kda trace`: one layer forward with every op timed, drawn as an SVG timeline (a lane per
//! stream, a box per op, an arrow per cross-stream wait) and written as a Chrome/Perfetto
//! trace. The forward is a fresh prefill batch, or with `--decode` one decode step after it.
//! The op times are the reference backend's timeline: on other backends `kda trace` says so and
//! stops before loading anything.

use std::path::PathBuf;

use crate::render::{SvgOptions, chrome_trace, timeline_svg};
use clap::Args;
use kda_core::{DType, Device, StreamHandle};
use kda_model::layer::{KdaLayer, LayerOptions};
use kda_synth::workload::Workload;

use super::backend::{self, BackendArg, CliBackend, Settings, on_backend};
use super::model::{self, ModelArgs, ScheduleArg};
use crate::error::CliError;

#[derive(Debug, Args)]
pub struct TraceArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub device: BackendArg,
    /// Write the SVG timeline here.
    #[arg(long, value_name = "FILE")]
    pub svg: Option<PathBuf>,
    /// Write the Chrome trace-event JSON here (chrome://tracing, ui.perfetto.dev).
    #[arg(long, value_name = "FILE")]
    pub chrome: Option<PathBuf>,
    #[arg(long, value_enum, default_value_t = ScheduleArg::Overlapped)]
    pub schedule: ScheduleArg,
    /// Requests in the prefill batch.
    #[arg(long, default_value_t = 4)]
    pub requests: usize,
    /// Prompt tokens per request.
    #[arg(long, default_value_t = 64)]
    pub tokens: usize,
    /// Trace one decode step (one token per request) after the prefill instead of the prefill.
    #[arg(long)]
    pub decode: bool,
}

/// The model in a few words: the checkpoint directory, or the preset.
fn model_name(m: &ModelArgs) -> String {
    match &m.checkpoint {
        Some(dir) => dir.display().to_string(),
        None => format!("synthetic {}", m.preset.name()),
    }
}

pub fn run(args: &TraceArgs) -> Result<(), CliError> {
    if args.svg.is_none() && args.chrome.is_none() {
        return Err(CliError::Argument {
            arg: "--svg/--chrome",
            reason: "name at least one file to write".into(),
        });
    }
    let w = model::workload(&args.model, args.requests, args.tokens, 1)?;
    let settings = Settings { timeline: true, ..Settings::default() };
    on_backend!(args.device.backend, &settings, |b| trace_on(args, w, b))
}

fn trace_on<B: CliBackend>(args: &TraceArgs, w: Workload, b: Device<B>) -> Result<(), CliError> {
    backend::require_timeline(&b, "kda trace")?;
    let main = b.new_stream()?;
    let loaded = model::load(&args.model)?;
    let outputs: Vec<(&'static str, &std::path::Path)> =
        [("--svg", &args.svg), ("--chrome", &args.chrome)]
            .into_iter()
            .filter_map(|(flag, path)| Some((flag, path.as_deref()?)))
            .collect();
    let inputs: Vec<&std::path::Path> = loaded.files.iter().map(PathBuf::as_path).collect();
    crate::fsio::check_outputs(&outputs, &inputs)?;
    let options = LayerOptions { schedule: Some(args.schedule.into()), ..LayerOptions::default() };
    let layer = KdaLayer::new(&b, &main, &loaded.weights, options)?;
    let hidden = layer.dims().hidden;
    let mut cache = layer.new_cache(&main, w.requests, 0)?;

    let (rows, input, meta, what) = if args.decode {
        let x = b.alloc(DType::BF16, &[w.prefill_tokens(), hidden])?;
        b.upload(&main, &x, &w.prefill_hidden(hidden))?;
        let mut out = b.alloc(DType::F32, &[w.prefill_tokens(), hidden])?;
        layer.forward(&main, &x, &w.prefill_meta(), &mut cache, &mut out)?;
        let what = format!("decode step, {} requests after {} tokens", w.requests, w.prompt_tokens);
        (w.requests, w.decode_hidden(0, hidden), w.decode_meta(0), what)
    } else {
        let what = format!("prefill, {} requests x {} tokens", w.requests, w.prompt_tokens);
        (w.prefill_tokens(), w.prefill_hidden(hidden), w.prefill_meta(), what)
    };
    let x = b.alloc(DType::BF16, &[rows, hidden])?;
    b.upload(&main, &x, &input)?;
    let mut out = b.alloc(DType::F32, &[rows, hidden])?;
    b.synchronize(&main)?;
    B::clear_timeline(&b);
    layer.forward(&main, &x, &meta, &mut cache, &mut out)?;
    b.synchronize(&main)?;
    let timeline = B::timeline(&b).unwrap_or_default();

    let mut lanes = vec![(main.id(), "main".to_string())];
    if args.schedule == ScheduleArg::Overlapped {
        lanes.push((layer.projection().aux_stream().get(&b)?.id(), "aux".to_string()));
    }
    let schedule = format!("{:?}", layer.schedule()).to_lowercase();
    let title = format!(
        "kda trace: layer {} of the {}, TP rank {}/{}, {what}, {schedule} schedule",
        args.model.layer,
        model_name(&args.model),
        loaded.tp.rank,
        loaded.tp.size
    );
    println!("{title}");
    println!(
        "  recorded {} ops on {} streams, {} cross-stream waits; makespan {:.3} ms",
        timeline.spans.len(),
        timeline.streams().len(),
        timeline.waits.len(),
        timeline.makespan().as_secs_f64() * 1e3
    );
    if let Some(path) = &args.svg {
        let svg = timeline_svg(
            &timeline,
            &SvgOptions { title: Some(title.clone()), lane_names: lanes.clone(), width: 0 },
        );
        crate::fsio::write_atomic(path, svg.as_bytes())?;
        println!("  SVG timeline: {}", path.display());
    }
    if let Some(path) = &args.chrome {
        super::write_json(path, &chrome_trace(&timeline, &lanes))?;
        println!("  Chrome trace: {}", path.display());
    }
    Ok(())
}
