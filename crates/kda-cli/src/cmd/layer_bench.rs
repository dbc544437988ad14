//! `kda bench layer`: the whole KDA layer on the reference (or `--backend`) at Kimi K3 TP8 shapes
//! (synthetic rank-0 weights): prefill tokens/s (4 fresh requests of 1024 tokens) and decode
//! latency (32 single-token requests), serial against overlapped, with the ops that took longest
//! where the backend times them; and the decode step time as a multiple of the time to read the
//! layer's weights once, with the host's memory bandwidth measured in the same run, and (on the
//! reference) of its compute floor: the step's GEMM multiply-adds at the host's peak rates.

use std::hint::black_box;
use std::time::{Duration, Instant};

use clap::Args;
use kda_core::timeline::Timeline;
use kda_core::{DType, Device, Tensor};
use kda_model::layer::{BatchMeta, KdaLayer, LayerOptions, LayerPlan, RequestSlots, StateCache};
use kda_model::schedule::ProjectionSchedule;
use kda_model::weights::LayerWeights;

use kda_reference::ReferenceBackend;
use kda_reference::peak::fma_rates;

use super::backend::{BackendArg, BackendKind, CliBackend, Settings, on_backend};
use super::model::{ModelArgs, load};
use super::perf_table::{Paired, Target, timed};
use super::{median_time, ms};
use crate::error::CliError;

#[derive(Debug, Args)]
pub struct LayerBenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Fresh prefill requests per prefill step.
    #[arg(long, default_value_t = 4)]
    pub prefill_requests: usize,
    /// Tokens per prefill request.
    #[arg(long, default_value_t = 1024)]
    pub prefill_len: usize,
    /// Single-token requests per decode step.
    #[arg(long, default_value_t = 32)]
    pub decode_batch: usize,
    /// Threads per op: 1 runs on the stream's own thread, more use a shared pool (reference
    /// backend).
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
    /// Timed prefill steps (after one warm-up).
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// Timed decode steps (after one warm-up).
    #[arg(long, default_value_t = 20)]
    pub decode_repeats: usize,
    /// Rounds of the figures table (each figure's two rates timed alternately per round).
    #[arg(long, default_value_t = 7)]
    pub rounds: usize,
    /// Skip the kernel figures of the table (the decode figure is always measured).
    #[arg(long)]
    pub no_kernels: bool,
    /// Also write the figures table as JSON to this file.
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
    #[command(flatten)]
    pub device: BackendArg,
}

/// One schedule's figures.
struct Figures {
    prefill: Duration,
    decode: Duration,
}

pub fn bench(args: &LayerBenchArgs) -> Result<(), CliError> {
    let (requests, len, decodes) = (args.prefill_requests, args.prefill_len, args.decode_batch);
    if requests == 0 || len == 0 || decodes == 0 {
        return Err(CliError::Argument {
            arg: "--prefill-requests/--prefill-len/--decode-batch",
            reason: "must be at least 1".into(),
        });
    }
    // Timed with the op timeline on (where the backend has one), for the per-op breakdown of
    // one extra step.
    let settings = Settings { threads: args.threads, timeline: true, ..Settings::default() };
    on_backend!(args.device.backend, &settings, |b| bench_on(args, b))
}

fn bench_on<B: CliBackend>(args: &LayerBenchArgs, b: Device<B>) -> Result<(), CliError> {
    let (requests, len, decodes) = (args.prefill_requests, args.prefill_len, args.decode_batch);
    let loaded = load(&args.model)?;
    let d = loaded.weights.dims;
    eprintln!(
        "loaded {} layer {} (tp {}/{}) in {:.1} s",
        loaded.origin,
        args.model.layer,
        loaded.tp.rank,
        loaded.tp.size,
        loaded.load_time.as_secs_f64()
    );
    let s = b.new_stream()?;
    let mut rng = kda_synth::Gen::new(args.model.seed);
    let prefill_x =
        super::random_tensor(&b, &s, &mut rng, DType::BF16, &[requests * len, d.hidden])?;
    let decode_x = super::random_tensor(&b, &s, &mut rng, DType::BF16, &[decodes, d.hidden])?;
    let prefill = BatchMeta::prefills(&vec![len; requests], &(0..requests).collect::<Vec<_>>());
    let mut decode = BatchMeta::empty();
    for slot in 0..decodes {
        decode.push(1, len, RequestSlots::Single(slot));
    }

    let mut figures = Vec::new();
    let mut weight_bytes = 0;
    let mut table = Vec::new();
    for schedule in [ProjectionSchedule::Serial, ProjectionSchedule::Overlapped] {
        let options = LayerOptions { schedule: Some(schedule), ..LayerOptions::default() };
        let layer = KdaLayer::new(&b, &s, &loaded.weights, options)?;
        weight_bytes = layer.weights().bytes();
        let mut cache = layer.new_cache(&s, requests.max(decodes), 0)?;
        let step = |x: &Tensor<_>, meta: &BatchMeta, cache: &mut StateCache<_>| {
            let mut out = b.alloc(DType::F32, &[x.shape()[0], d.hidden])?;
            layer.forward(&s, x, meta, cache, &mut out)?;
            Ok::<_, CliError>(b.synchronize(&s)?)
        };
        let prefill_time = median_time(args.repeats, || step(&prefill_x, &prefill, &mut cache))?;
        let decode_time =
            median_time(args.decode_repeats, || step(&decode_x, &decode, &mut cache))?;
        let name = format!("{schedule:?}").to_lowercase();
        B::clear_timeline(&b);
        step(&prefill_x, &prefill, &mut cache)?;
        let prefill_ops = breakdown::<B>(B::timeline(&b));
        B::clear_timeline(&b);
        step(&decode_x, &decode, &mut cache)?;
        let decode_ops = breakdown::<B>(B::timeline(&b));
        println!(
            "{name:>10}: prefill {requests} x {len} tokens {:.1} ms ({:.0} tokens/s); decode \
             {decodes} x 1 token {:.2} ms",
            ms(prefill_time),
            (requests * len) as f64 / prefill_time.as_secs_f64(),
            ms(decode_time),
        );
        println!("{:>10}  prefill ops: {prefill_ops}", "");
        println!("{:>10}  decode ops: {decode_ops}", "");
        if schedule == ProjectionSchedule::Overlapped {
            // The table's decode figure: a decode step and one pass over a buffer larger than
            // the caches, alternately, each round's read rate giving that round's weight read
            // time.
            let words: Vec<u64> = (0..weight_bytes.max(256 << 20) / 8).map(|i| i as u64).collect();
            let p = Paired::run(
                args.rounds,
                || timed(|| step(&decode_x, &decode, &mut cache)),
                || Ok::<_, CliError>(read_pass(&words, args.threads)),
            )?;
            let (wb, rb) = (weight_bytes as f64, (words.len() * 8) as f64);
            let detail = format!(
                "decode step {:.2} ms (overlapped, {} thread(s) per op); weights {:.1} MB read once in {:.2} ms at {:.1} GB/s",
                ms(p.median_a()),
                args.threads,
                wb / 1e6,
                ms(p.median_b()) * wb / rb,
                rb / p.median_b().as_secs_f64() / 1e9,
            );
            let name = format!("decode step ({decodes} x 1 token) / time to read the weights once");
            table.push(p.figure(&name, Target::AtMost(3.0), detail, |td, tr| td / (tr * wb / rb)));
        }
        figures.push((name, Figures { prefill: prefill_time, decode: decode_time }));
    }

    let bandwidth = read_bandwidth(weight_bytes.max(256 << 20), args.threads, args.repeats.max(3));
    let read_once = Duration::from_secs_f64(weight_bytes as f64 / bandwidth);
    println!(
        "weights {:.1} MB; memory read bandwidth {:.1} GB/s ({} thread(s), summing a buffer larger \
         than the caches): reading the weights once takes {:.2} ms",
        weight_bytes as f64 / 1e6,
        bandwidth / 1e9,
        args.threads,
        ms(read_once),
    );
    // A decode step also reads and writes each request's recurrent state: the floor is the
    // weights once plus the states twice.
    let state_bytes = decodes * d.local_heads * d.head_dim * d.head_dim * 4;
    let floor = Duration::from_secs_f64((weight_bytes + 2 * state_bytes) as f64 / bandwidth);
    println!(
        "decode states {:.1} MB (read and written): weights + states take {:.2} ms at that rate",
        state_bytes as f64 / 1e6,
        ms(floor),
    );
    let compute = if B::KIND == BackendKind::Reference {
        let options = LayerOptions {
            schedule: Some(ProjectionSchedule::Overlapped),
            ..LayerOptions::default()
        };
        Some(compute_floor(&loaded.weights, options, (&decode, decodes), read_once)?)
    } else {
        None
    };
    for (name, f) in &figures {
        let of_compute = compute.map_or(String::new(), |c| {
            format!(", {:.1} x the compute floor", f.decode.as_secs_f64() / c.as_secs_f64())
        });
        println!(
            "{name:>10}: decode step = {:.1} x the weight read time ({:.1} x weights + states{of_compute})",
            f.decode.as_secs_f64() / read_once.as_secs_f64(),
            f.decode.as_secs_f64() / floor.as_secs_f64(),
        );
    }
    if let [(_, serial), (_, overlapped)] = figures.as_slice() {
        println!(
            "overlapped / serial: prefill {:.2}x, decode {:.2}x (time ratio; < 1 is faster)",
            overlapped.prefill.as_secs_f64() / serial.prefill.as_secs_f64(),
            overlapped.decode.as_secs_f64() / serial.decode.as_secs_f64(),
        );
    }
    if !args.no_kernels {
        table.extend(super::perf_table::kernel_figures(args.rounds)?);
    }
    println!(
        "figures (each a ratio of two rates measured alternately in the same run; median of the rounds):"
    );
    super::perf_table::print(&table);
    if let Some(path) = &args.json {
        let value = serde_json::Value::Array(table.iter().map(|f| f.to_json()).collect());
        super::write_json(path, &value)?;
    }
    Ok(())
}

/// The decode step's compute floor on this host, printed with how it is made up: its GEMM
/// multiply-adds (from the op log of one forward of `decode`, `tokens` rows, with `options` on a checked
/// reference device), the exact MXFP8 ones at the host's peak f64 fused multiply-add rate and
/// the dense ones at its f32 rate, spread over every core. The other ops are left out: it is a
/// floor.
fn compute_floor(
    weights: &LayerWeights,
    options: LayerOptions,
    (decode, tokens): (&BatchMeta, usize),
    read_once: Duration,
) -> Result<Duration, CliError> {
    let checked = Settings { checked: Some(true), timeline: false, threads: 1 };
    let b = <ReferenceBackend as CliBackend>::open(&checked)?;
    let s = b.new_stream()?;
    let layer = KdaLayer::new(&b, &s, weights, options)?;
    let (mut exact, mut dense) = (0.0, 0.0);
    for entry in &LayerPlan::record_forward(&b, &s, &layer, decode, tokens)? {
        let work = kda_model::plan::work(entry);
        *(if work.mx { &mut exact } else { &mut dense }) += work.flops / 2.0;
    }
    let rates = fma_rates(Duration::from_millis(300));
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let seconds = (exact / rates.f64_per_s + dense / rates.f32_per_s) / cores as f64;
    println!(
        "decode compute floor: {:.3e} exact MXFP8 multiply-adds (f64) and {:.3e} dense ones \
         (f32) at {:.1} and {:.1} G/s per core (measured) on {cores} core(s): {:.2} ms, {:.1} x \
         the weight read time",
        exact,
        dense,
        rates.f64_per_s / 1e9,
        rates.f32_per_s / 1e9,
        seconds * 1e3,
        seconds / read_once.as_secs_f64(),
    );
    Ok(Duration::from_secs_f64(seconds))
}

/// The five op labels that took longest in `timeline` (summed over streams), with their share
/// of the summed op time; or why there is none.
fn breakdown<B: CliBackend>(timeline: Option<Timeline>) -> String {
    let Some(timeline) = timeline else {
        return format!("not timed (the {} backend records no op timeline)", B::KIND.name());
    };
    let mut by_label: Vec<(String, Duration)> = Vec::new();
    for span in &timeline.spans {
        match by_label.iter_mut().find(|(l, _)| *l == span.label) {
            Some((_, total)) => *total += span.duration(),
            None => by_label.push((span.label.clone(), span.duration())),
        }
    }
    let all: Duration = by_label.iter().map(|(_, d)| *d).sum();
    by_label.sort_by_key(|(_, d)| std::cmp::Reverse(*d));
    by_label
        .iter()
        .take(5)
        .map(|(label, d)| {
            format!(
                "{label} {:.1} ms ({:.0}%)",
                ms(*d),
                100.0 * d.as_secs_f64() / all.as_secs_f64()
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// How long `threads` threads take to sum disjoint parts of `words`.
fn read_pass(words: &[u64], threads: usize) -> Duration {
    let per = words.len().div_ceil(threads.max(1));
    let start = Instant::now();
    std::thread::scope(|scope| {
        for part in words.chunks(per.max(1)) {
            scope.spawn(move || black_box(part.iter().fold(0u64, |a, &w| a.wrapping_add(w))));
        }
    });
    start.elapsed()
}

/// Bytes per second read by `threads` threads summing disjoint parts of a `bytes`-byte buffer
/// (median of `repeats`).
fn read_bandwidth(bytes: usize, threads: usize, repeats: usize) -> f64 {
    let words: Vec<u64> = (0..bytes / 8).map(|i| i as u64).collect();
    let mut times: Vec<Duration> =
        (0..repeats + 1).map(|_| read_pass(&words, threads)).skip(1).collect();
    times.sort();
    let median = times[times.len() / 2];
    (words.len() * 8) as f64 / median.as_secs_f64()
}
