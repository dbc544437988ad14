//! `kda plan`: the planner's predicted layer times (docs/design/planner.md#kda-plan).
//!
//! Records the whole Kimi K3 layer (synthetic rank-0 weights at `--tp`'s shapes: projections,
//! conv, gate, chunked or recurrent KDA, gated norm, `o_proj`) in each of the six
//! configurations in checked mode on the reference backend at 1 and 2 tokens
//! ([`LayerPlan::record`]), extrapolates each op's FLOPs and bytes to every requested T, and
//! simulates the streams on the chosen chip's figures. `--svg` draws the table as a chart
//! ([`TimeChart`]: time against T per configuration, log-log), `--timeline-svg` the recommended
//! configuration's predicted timeline. `--calibrate` also measures the
//! configurations on this host and fits per-op-kind costs to the measurements
//! (docs/design/planner.md#calibration).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::{Args, ValueEnum};
use kda_core::sanitize::Entry;
use kda_core::timeline::Timeline;
use kda_model::layer::{
    BatchShape, Choice, KdaLayer, LayerOptions, LayerPlan, PLAN_CONFIGS, PlanConfig,
};
use kda_model::plan::chips::Chip;
use kda_model::plan::{self, ChipFigures, RecordedRun, Recording};

use crate::render::{self, ChartSeries, SvgOptions, TimeChart};
use kda_core::{DType, Device, Op, ScaleAlg};
use kda_model::weights::LayerWeights;
use kda_reference::ReferenceBackend;
use kda_synth::Gen;
use rand::seq::SliceRandom;

use super::backend::{CliBackend, Settings};
use super::model::{ModelArgs, Preset};
use super::schedule::random_bf16;
use crate::error::CliError;

/// `--shape`.
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum ShapeArg {
    /// One fresh request of T tokens (chunked prefill).
    Prefill,
    /// T single-token requests (recurrent decode).
    Decode,
}

impl From<ShapeArg> for BatchShape {
    fn from(s: ShapeArg) -> Self {
        match s {
            ShapeArg::Prefill => BatchShape::Prefill,
            ShapeArg::Decode => BatchShape::Decode,
        }
    }
}

#[derive(Debug, Args)]
pub struct PlanArgs {
    /// The chip whose figures predict the times: 910b, 950, h200, or host (this machine's
    /// figures, measured at start-up on the reference backend, one core).
    #[arg(long, default_value = "h200")]
    pub chip: String,
    /// Tensor-parallel degree: the layer's per-rank shapes come from the Kimi K3 config split
    /// over this many ranks (rank 0).
    #[arg(long, default_value_t = 8)]
    pub tp: usize,
    /// Token counts, comma separated.
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 16, 128, 1024, 8192])]
    pub tokens: Vec<usize>,
    /// The batch shape of T tokens.
    #[arg(long, value_enum, default_value_t = ShapeArg::Prefill)]
    pub shape: ShapeArg,
    /// Draw the table to this SVG file: predicted layer time against T, one line per
    /// configuration, both axes log scale, the recommended configuration at each T ringed.
    #[arg(long, value_name = "FILE")]
    pub svg: Option<PathBuf>,
    /// Draw the recommended configuration's predicted timeline at the first `--tokens` count
    /// to this SVG file (one lane per stream, one box per op).
    #[arg(long, value_name = "FILE")]
    pub timeline_svg: Option<PathBuf>,
    /// Measure every configuration at each `--tokens` count on this host (reference backend,
    /// one core per stream), fit per-op-kind costs to the measured op times, and print
    /// predicted against measured (implies --chip host).
    #[arg(long)]
    pub calibrate: bool,
    /// Measured rounds per configuration and T with --calibrate (after one warm-up).
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// With --calibrate: write the measured runs (op log, per-op medians, wall times) as JSON.
    #[arg(long, value_name = "FILE")]
    pub record: Option<PathBuf>,
    /// Calibrate the host's figures from runs recorded earlier by `--calibrate --record`
    /// instead of measuring them again (implies --chip host).
    #[arg(long, value_name = "FILE")]
    pub recording: Option<PathBuf>,
}

/// The figures of the chip `name` names (`910b`, `950`, `h200`; `host` measures this machine's).
fn chip_figures(name: &str, arg: &'static str) -> Result<ChipFigures, CliError> {
    if name.eq_ignore_ascii_case("host") {
        let unchecked = Settings { checked: Some(false), timeline: false, threads: 1 };
        return measure_host(<ReferenceBackend as CliBackend>::open(&unchecked)?);
    }
    Chip::parse(name).map(Chip::figures).ok_or_else(|| CliError::Argument {
        arg,
        reason: format!("`{name}` is not one of 910b, 950, h200, host"),
    })
}

/// `kda run --auto` and `kda layer --auto`: the layer options the planner predicts fastest for
/// `weights` on the chip `chip` names, for a batch of `tokens` tokens of `shape`. The forwards
/// are recorded on the reference backend in checked mode (the op log does not depend on the
/// backend that will run the layer).
pub(crate) fn auto_options(
    chip: &str,
    weights: &LayerWeights,
    shape: BatchShape,
    tokens: usize,
) -> Result<(LayerOptions, Choice), CliError> {
    let figures = chip_figures(chip, "--auto")?;
    let checked = Settings { checked: Some(true), timeline: false, threads: 1 };
    let b = <ReferenceBackend as CliBackend>::open(&checked)?;
    let plan = LayerPlan::record(&b, &b.new_stream()?, weights)?;
    Ok(LayerOptions::auto(&plan, &figures, shape, tokens)?)
}

pub fn run(args: &PlanArgs) -> Result<(), CliError> {
    let host = args.calibrate || args.recording.is_some();
    let chip = if host { "host" } else { args.chip.as_str() };
    if Chip::parse(&args.chip).is_none() && !args.chip.eq_ignore_ascii_case("host") {
        return Err(CliError::Argument {
            arg: "--chip",
            reason: format!("`{}` is not one of 910b, 950, h200, host", args.chip),
        });
    }
    if args.tokens.is_empty() || args.tokens.contains(&0) {
        return Err(CliError::Argument {
            arg: "--tokens",
            reason: "needs one or more counts, each at least 1".into(),
        });
    }
    if args.record.is_some() && !args.calibrate {
        return Err(CliError::Argument {
            arg: "--record",
            reason: "only with --calibrate (it writes what --calibrate measures)".into(),
        });
    }
    let weights = rank_weights(args.tp)?;
    let checked = Settings { checked: Some(true), timeline: false, threads: 1 };
    let b = <ReferenceBackend as CliBackend>::open(&checked)?;
    let plan = LayerPlan::record(&b, &b.new_stream()?, &weights)?;
    let shape = BatchShape::from(args.shape);
    let mut figures = chip_figures(chip, "--chip")?;
    if let Some(path) = &args.recording {
        let recording = read_recording(path)?;
        figures = fit(figures, &recording)?;
        println!("kda plan --recording {}: {}\n", path.display(), recording.about);
        print_calibration(&figures, &recording)?;
        println!();
    }
    let title = format!(
        "Kimi K3 TP{} rank-0 layer ({} of T tokens: hidden {}, {} local heads of {})",
        args.tp,
        shape.name(),
        weights.dims.hidden,
        weights.dims.local_heads,
        weights.dims.head_dim
    );
    if args.calibrate {
        let timed = Settings { checked: Some(false), timeline: true, threads: 1 };
        let b = <ReferenceBackend as CliBackend>::open(&timed)?;
        let recording = measure_runs(&b, &weights, &plan, shape, &args.tokens, args.rounds)?;
        let recording = Recording { launch_s: figures.launch_s.value, ..recording };
        if let Some(path) = &args.record {
            let text = serde_json::to_string_pretty(&recording)
                .map_err(|e| CliError::Argument { arg: "--record", reason: e.to_string() })?;
            write_file(path, &(text + "\n"))?;
        }
        figures = fit(figures, &recording)?;
        println!("kda plan --calibrate: {title} on this host, reference backend\n");
        print_calibration(&figures, &recording)?;
        println!();
    }
    let choices = args
        .tokens
        .iter()
        .map(|&t| plan.choose(&figures, shape, t))
        .collect::<Result<Vec<_>, _>>()
        .map_err(plan_error)?;
    report(&title, &figures, &choices);
    print_f_bytes(&weights);
    if let Some(path) = &args.svg {
        let text = chart(&title, &figures, &choices)?
            .to_svg()
            .map_err(|e| CliError::Argument { arg: "--svg", reason: e.to_string() })?;
        write_file(path, &text)?;
        println!("wrote the predicted times against T to {}", path.display());
    }
    if let Some(path) = &args.timeline_svg {
        write_file(path, &timeline_svg(&title, &figures, &choices[0]))?;
        println!("wrote the predicted timeline to {}", path.display());
    }
    Ok(())
}

/// Rank 0's layer 0 of a synthetic Kimi K3 checkpoint split over `tp` ranks.
pub(crate) fn rank_weights(tp: usize) -> Result<LayerWeights, CliError> {
    let model = ModelArgs {
        checkpoint: None,
        layer: 0,
        preset: Preset::KimiK3Tp8,
        tp_size: Some(tp),
        tp_rank: 0,
        seed: 0,
    };
    let heads = model.preset.config().linear_attn_config.num_heads;
    if tp == 0 || !heads.is_multiple_of(tp) {
        return Err(CliError::Argument {
            arg: "--tp",
            reason: format!("must divide the {heads} heads of Kimi K3, got {tp}"),
        });
    }
    Ok(super::model::load(&model)?.weights)
}

fn plan_error(e: plan::PlanError) -> CliError {
    CliError::Argument { arg: "plan", reason: e.to_string() }
}

fn read_recording(path: &Path) -> Result<Recording, CliError> {
    let text = std::fs::read_to_string(path).map_err(|source| CliError::Io {
        action: "read",
        path: path.display().to_string(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|e| CliError::Argument {
        arg: "--recording",
        reason: format!("{}: not a `kda plan --record` file: {e}", path.display()),
    })
}

/// `figures` calibrated on `recording` ([`plan::calibrate()`]).
fn fit(figures: ChipFigures, recording: &Recording) -> Result<ChipFigures, CliError> {
    let runs: Vec<&RecordedRun> = recording.runs.iter().collect();
    plan::calibrate(figures, &runs, recording.caches).map_err(plan_error)
}

/// The median wall time of `f` over a few runs, after a warm-up.
fn median_s(mut f: impl FnMut() -> Result<(), CliError>) -> Result<f64, CliError> {
    Ok(super::median_time(5, &mut f)?.as_secs_f64())
}

/// This machine's figures on the reference backend, one core: a bf16 GEMM's rate, a large copy's
/// bandwidth (bytes read plus written), and the cost of a launch (tiny copies, back to back).
fn measure_host<B: CliBackend>(b: Device<B>) -> Result<ChipFigures, CliError> {
    let s = b.new_stream()?;
    let mut rng = Gen::new(1);
    let (m, n, k) = (128usize, 1024usize, 2048usize);
    let x = random_bf16(&b, &s, &mut rng, &[m, k], 1.0)?;
    let w = random_bf16(&b, &s, &mut rng, &[n, k], 1.0)?;
    let y = b.alloc(DType::F32, &[m, n])?;
    let gemm = median_s(|| {
        b.launch(&s, Op::Gemm { x: x.clone(), w: w.clone(), y: y.clone() })?;
        Ok(b.synchronize(&s)?)
    })?;
    let quantized = |t: &kda_core::Tensor<B>, rows: usize| -> Result<_, CliError> {
        let data = b.alloc(DType::E4M3, &[rows, k])?;
        let scale = b.alloc(DType::E8M0, &[rows, kda_core::mx::num_blocks(k)])?;
        let alg = ScaleAlg::OcpFloor;
        b.launch(
            &s,
            Op::DynamicQuant { x: t.clone(), data: data.clone(), scale: scale.clone(), alg },
        )?;
        Ok((data, scale))
    };
    let ((a, a_scale), (wq, w_scale)) = (quantized(&x, m)?, quantized(&w, n)?);
    let mx_gemm = median_s(|| {
        let op = Op::MxGemm {
            a: a.clone(),
            a_scale: a_scale.clone(),
            w: wq.clone(),
            w_scale: w_scale.clone(),
            y: y.clone(),
        };
        b.launch(&s, op)?;
        Ok(b.synchronize(&s)?)
    })?;
    let len = 8 << 20;
    let (src, dst) = (b.alloc(DType::F32, &[len])?, b.alloc(DType::F32, &[len])?);
    let copy = median_s(|| {
        b.launch(&s, Op::Copy { src: src.clone(), dst: dst.clone() })?;
        Ok(b.synchronize(&s)?)
    })?;
    let (one_a, one_b) = (b.alloc(DType::F32, &[1])?, b.alloc(DType::F32, &[1])?);
    let launches = 200;
    let launch = median_s(|| {
        for _ in 0..launches {
            b.launch(&s, Op::Copy { src: one_a.clone(), dst: one_b.clone() })?;
        }
        Ok(b.synchronize(&s)?)
    })? / launches as f64;
    let flops = 2.0 * (m * n * k) as f64 / gemm.max(1e-9);
    let mx_flops = 2.0 * (m * n * k) as f64 / mx_gemm.max(1e-9);
    let bytes = 2.0 * (len * 4) as f64 / copy.max(1e-9);
    Ok(ChipFigures::host(flops, mx_flops, bytes, launch))
}

/// Each launch of `log` gets the duration of the timeline span that ran it: a stream of the log
/// is matched to the timeline stream that ran the same labels in the same order.
fn op_durations(log: &[Entry], timeline: &Timeline) -> Result<Vec<Option<f64>>, CliError> {
    let mut log_streams: BTreeMap<_, Vec<usize>> = BTreeMap::new();
    for (i, e) in log.iter().enumerate() {
        if let Entry::Launch { stream, .. } = e {
            log_streams.entry(*stream).or_default().push(i);
        }
    }
    let lanes: Vec<Vec<&kda_core::timeline::Span>> = timeline
        .streams()
        .into_iter()
        .map(|s| timeline.spans.iter().filter(|span| span.stream == s).collect())
        .collect();
    let label = |i: usize| match &log[i] {
        Entry::Launch { label, .. } => label.as_str(),
        _ => "",
    };
    let mut used = vec![false; lanes.len()];
    let mut durations = vec![None; log.len()];
    for indices in log_streams.values() {
        let lane = (0..lanes.len()).find(|&l| {
            !used[l]
                && lanes[l].len() == indices.len()
                && lanes[l].iter().zip(indices).all(|(span, &i)| span.label == label(i))
        });
        let Some(lane) = lane else {
            return Err(CliError::CheckFailed {
                reason: format!(
                    "no stream of the measured timeline ran the recorded ops {:?}",
                    indices.iter().map(|&i| label(i)).collect::<Vec<_>>()
                ),
            });
        };
        used[lane] = true;
        for (span, &i) in lanes[lane].iter().zip(indices) {
            durations[i] = Some(span.duration().as_secs_f64());
        }
    }
    Ok(durations)
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    match values.len() {
        0 => 0.0,
        n if n % 2 == 1 => values[n / 2],
        n => 0.5 * (values[n / 2 - 1] + values[n / 2]),
    }
}

/// Measures every configuration at each of `tokens` on `b` (unchecked, with the timeline):
/// `rounds` rounds after a warm-up, each running the six configurations in a fresh seeded
/// order (so a change of the machine's load falls on all of them alike); each op's median
/// duration and each round's wall time.
fn measure_runs(
    b: &Device<ReferenceBackend>,
    weights: &LayerWeights,
    plan: &LayerPlan,
    shape: BatchShape,
    tokens: &[usize],
    rounds: usize,
) -> Result<Recording, CliError> {
    let s = b.new_stream()?;
    let mut rng = Gen::new(2);
    let hidden = weights.dims.hidden;
    let mut layers = Vec::new();
    for config in PLAN_CONFIGS {
        let forward = plan
            .forwards
            .iter()
            .find(|f| f.config == config && f.shape == shape)
            .ok_or_else(|| plan_error(plan::PlanError::NothingRecorded))?;
        layers.push((forward, KdaLayer::new(b, &s, weights, config.options())?));
    }
    let mut runs = Vec::new();
    for &t in tokens {
        let x = random_bf16(b, &s, &mut rng, &[t, hidden], 1.0)?;
        let meta = shape.meta(t);
        let mut state = Vec::new();
        for (_, layer) in &layers {
            state.push((b.alloc(DType::F32, &[t, hidden])?, layer.new_cache(&s, t, 0)?));
        }
        let mut step = |i: usize| -> Result<f64, CliError> {
            let (out, cache) = &mut state[i];
            let start = Instant::now();
            layers[i].1.forward(&s, &x, &meta, cache, out)?;
            b.synchronize(&s)?;
            Ok(start.elapsed().as_secs_f64())
        };
        let mut per_op: Vec<Vec<Vec<f64>>> =
            layers.iter().map(|(f, _)| vec![Vec::new(); f.logs[0].len()]).collect();
        let mut walls: Vec<Vec<f64>> = vec![Vec::new(); layers.len()];
        for i in 0..layers.len() {
            step(i)?;
        }
        for _ in 0..rounds.max(1) {
            let mut order: Vec<usize> = (0..layers.len()).collect();
            order.shuffle(rng.rng());
            for i in order {
                <ReferenceBackend as CliBackend>::clear_timeline(b);
                walls[i].push(step(i)?);
                let timeline = b.raw().timeline();
                for (op, d) in
                    op_durations(&layers[i].0.logs[0], &timeline)?.into_iter().enumerate()
                {
                    per_op[i][op].extend(d);
                }
            }
        }
        for (i, (forward, _)) in layers.iter().enumerate() {
            let [one, two] = &forward.logs;
            let seconds: Vec<Option<f64>> =
                per_op[i].iter().map(|d| (!d.is_empty()).then(|| median(d.clone()))).collect();
            let works = plan::extrapolate((1, one), (2, two), t).map_err(plan_error)?;
            let name = forward.config.name;
            runs.push(RecordedRun::from_log(name, t, one, &works, &seconds, walls[i].clone()));
        }
        eprintln!("measured the six configurations at T = {t}");
    }
    Ok(Recording {
        about: format!(
            "kda plan --calibrate: Kimi K3 rank-0 layer ({} shape, hidden {}, {} local heads), \
             reference backend one core per stream, {} round(s) after a warm-up, the six \
             configurations in a fresh seeded order each round; per-op seconds are medians \
             over the rounds, rounds_s the forwards' wall times",
            shape.name(),
            hidden,
            weights.dims.local_heads,
            rounds.max(1)
        ),
        launch_s: 0.0,
        caches: plan::chips::host_caches().map_err(plan_error)?,
        runs,
    })
}

/// Predicted against measured per configuration and T, and the error per op kind.
fn print_calibration(figures: &ChipFigures, recording: &Recording) -> Result<(), CliError> {
    println!(
        "{:>7}  {:<34} {:>12} {:>12} {:>8}",
        "T", "configuration", "predicted", "measured", "error"
    );
    let mut per_kind: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for run in &recording.runs {
        let (entries, works) = run.log();
        let sim = plan::predict_with(&entries, &works, figures).map_err(plan_error)?;
        let measured = run.measured_s();
        println!(
            "{:>7}  {:<34} {:>9.2} ms {:>9.2} ms {:>+7.1}%",
            run.tokens,
            run.config,
            sim.makespan * 1e3,
            measured * 1e3,
            100.0 * (sim.makespan / measured - 1.0)
        );
        // An op's own time is measured only where no other stream shares its core.
        if run.streams() == 1 {
            for sample in run.samples() {
                let predicted =
                    figures.op_seconds(&sample.kind, plan::CostUnit::Vector, sample.work);
                per_kind.entry(sample.kind).or_default().push(predicted / sample.seconds - 1.0);
            }
        }
    }
    println!(
        "\nper op kind: fitted cost, and the largest relative error over its ops in the \
         single-stream runs"
    );
    let kinds = figures.calibration.as_ref().map(|c| &c.kinds);
    for (kind, errors) in &per_kind {
        let worst = errors.iter().fold(0.0f64, |m, e| m.max(e.abs()));
        let cost = kinds.and_then(|k| k.get(kind)).copied().unwrap_or_default();
        let rate = |per: f64| if per > 0.0 { 1.0 / per } else { f64::INFINITY };
        println!(
            "  {kind:<28} {:>8.1} µs/call {:>9.2} GB/s {:>9.2} GFLOP/s   max error {:>5.1}% over {} ops",
            cost.overhead_s * 1e6,
            rate(cost.s_per_byte) / 1e9,
            rate(cost.s_per_flop) / 1e9,
            100.0 * worst,
            errors.len()
        );
    }
    Ok(())
}

/// The weight bytes one decode step reads for the forget gate F, composed and staged.
fn f_weight_bytes(w: &LayerWeights) -> (usize, usize) {
    let (hd, d) = (w.dims.hidden, w.dims.head_dim);
    let lp = w.dims.local_heads * d;
    (2 * lp * hd, 2 * (d * hd + lp * d))
}

fn report(title: &str, chip: &ChipFigures, choices: &[Choice]) {
    println!("kda plan: {title} on {}", chip.name);
    for (name, value, provenance) in chip.rows() {
        println!("  {name:<20} {value:>12}  {provenance}");
    }
    if let Some(c) = &chip.calibration {
        println!(
            "  {:<20} {:>12}  measured (per-op-kind fit)",
            "calibrated op kinds",
            c.kinds.len()
        );
    }
    print!("\n{:>7}", "T");
    for c in &PLAN_CONFIGS {
        print!("  {:>14}", short(c));
    }
    println!("  recommended");
    for choice in choices {
        print!("{:>7}", choice.tokens);
        for p in &choice.predictions {
            print!("  {:>11.1} µs", p.simulation.makespan * 1e6);
        }
        println!("  {}", choice.config().name);
    }
}

/// Prints the F weight bytes of a decode step (both forms) for `weights`.
fn print_f_bytes(weights: &LayerWeights) {
    let (composed, staged) = f_weight_bytes(weights);
    println!(
        "\nweight bytes of F read per decode step (per layer, per rank): composed {:.2} MB, \
         staged (f_a + f_b shard) {:.2} MB",
        composed as f64 / 1e6,
        staged as f64 / 1e6
    );
}

/// The table as a chart: one line per configuration through its predicted time at each T,
/// staged F dashed, and the recommended configuration at each T.
fn chart(title: &str, chip: &ChipFigures, choices: &[Choice]) -> Result<TimeChart, CliError> {
    use kda_model::layer::ForgetProjection;
    let seconds = |config: &PlanConfig| -> Result<Vec<f64>, CliError> {
        choices
            .iter()
            .map(|choice| {
                let p = choice.predictions.iter().find(|p| p.config == *config);
                p.map(|p| p.simulation.makespan)
                    .ok_or_else(|| plan_error(plan::PlanError::NothingRecorded))
            })
            .collect()
    };
    let series = PLAN_CONFIGS
        .iter()
        .map(|c| {
            let dashed = c.forget == ForgetProjection::Staged;
            Ok(ChartSeries { name: c.name.to_string(), seconds: seconds(c)?, dashed })
        })
        .collect::<Result<Vec<_>, CliError>>()?;
    let recommended = choices
        .iter()
        .map(|choice| {
            PLAN_CONFIGS
                .iter()
                .position(|c| *c == choice.config())
                .ok_or_else(|| plan_error(plan::PlanError::NothingRecorded))
        })
        .collect::<Result<Vec<_>, CliError>>()?;
    Ok(TimeChart {
        title: format!("{title} on {}: predicted layer time", chip.name),
        tokens: choices.iter().map(|c| c.tokens).collect(),
        series,
        recommended,
    })
}

/// The recommended configuration's predicted timeline at `choice`'s T, as SVG.
fn timeline_svg(title: &str, chip: &ChipFigures, choice: &Choice) -> String {
    let sim = &choice.predictions[choice.chosen].simulation;
    let options = SvgOptions {
        title: Some(format!(
            "{title}, T = {}, {} on {}: predicted {:.1} µs",
            choice.tokens,
            choice.config().name,
            chip.name,
            sim.makespan * 1e6
        )),
        ..SvgOptions::default()
    };
    render::timeline_svg(&sim.timeline(), &options)
}

fn write_file(path: &Path, text: &str) -> Result<(), CliError> {
    std::fs::write(path, text).map_err(|source| CliError::Io {
        action: "write",
        path: path.display().to_string(),
        source,
    })
}

/// A column header for a configuration.
fn short(c: &PlanConfig) -> String {
    use kda_model::layer::ForgetProjection;
    use kda_model::schedule::{MatrixOverlap, ProjectionSchedule};
    let form = if c.forget == ForgetProjection::Staged { "st" } else { "co" };
    let schedule = match (c.schedule, c.matrix_overlap) {
        (ProjectionSchedule::Serial, _) => "serial",
        (ProjectionSchedule::Overlapped, MatrixOverlap::Serialized) => "ser'd",
        (ProjectionSchedule::Overlapped, MatrixOverlap::Concurrent) => "conc",
    };
    format!("{form} {schedule}")
}
