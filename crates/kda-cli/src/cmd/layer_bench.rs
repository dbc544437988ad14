//! `kda bench layer`: the whole KDA layer on the reference at Kimi K3 TP8 shapes (synthetic
//! rank-0 weights): prefill tokens/s (4 fresh requests of 1024 tokens) and decode latency (32
//! single-token requests), serial against overlapped; and the decode step time as a multiple of
//! the time to read the layer's weights once, with the memory bandwidth measured in the same run.

use std::hint::black_box;
use std::time::{Duration, Instant};

use clap::Args;
use kda_core::layer::{BatchMeta, KdaLayer, LayerOptions, RequestSlots, StateCache};
use kda_core::schedule::ProjectionSchedule;
use kda_core::timeline::Timeline;
use kda_core::{DType, Tensor};
use kda_reference::ReferenceBackend;

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
    /// Threads per op: 1 runs on the stream's own thread, more use a shared pool.
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
    // Timed with the op timeline on, for the per-op breakdown of one extra step.
    let mut options = super::bench::reference_with_threads(args.threads)?.raw().options().clone();
    options.timeline = true;
    let b = ReferenceBackend::with_options(options)?;
    let s = b.new_stream()?;
    let mut rng = kda_testkit::Gen::new(args.model.seed);
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
        b.raw().clear_timeline();
        step(&prefill_x, &prefill, &mut cache)?;
        let prefill_ops = breakdown(&b.raw().timeline());
        b.raw().clear_timeline();
        step(&decode_x, &decode, &mut cache)?;
        let decode_ops = breakdown(&b.raw().timeline());
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
    for (name, f) in &figures {
        println!(
            "{name:>10}: decode step = {:.1} x the weight read time ({:.1} x weights + states)",
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

/// The five op labels that took longest in `timeline` (summed over streams), with their share
/// of the summed op time.
fn breakdown(timeline: &Timeline) -> String {
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
