//! `kda bench schedule`: the QKV/BFG projection schedules at Kimi K3 TP8 shapes on the reference
//! backend, one core per stream, with every op's start and end taken from the backend's
//! timeline (so `--backend` must name a backend that records one: the reference).
//!
//! For each token count it times, round-robin after a warm-up round, six configurations: serial,
//! overlapped with the GEMMs serialised (the seeds' order,
//! `docs/design/schedule.md#matrix-overlap`), overlapped with the GEMMs concurrent,
//! each with the composed and with the staged F. From the timelines: each op alone (the serial
//! runs, where nothing else runs), the hidden vector fraction of the serialised policy (the share
//! of DynamicQuant and post-process time during which a GEMM ran on the other stream), and the
//! concurrent policy against its ideal `max(quant + qkv_gemm, bfg_gemm + postprocess)`.
//!
//! Per-round ratios come with a 95 % confidence interval: a shared VM's run-to-run noise (10–15 %)
//! needs a few hundred rounds to pin a ratio to ±1 %. What the serialised policy costs on a CPU
//! is not in its events (it leaves a few microseconds between ops, fewer than serial) but in its
//! cores: each GEMM starts on a core that was idle (a waiting stream sleeps, see the reference
//! backend's streams), and a core fresh from idle runs the same GEMM a few percent slower on a VM
//! than one that just ran another; a busy-polling waiter would keep its core warm but slow the
//! GEMM on the other one by more.

use std::time::{Duration, Instant};

use clap::Args;
use half::bf16;
use kda_core::timeline::{Span, Timeline};
use kda_core::{Backend, DType, Device, Op, ScaleAlg, Tensor};
use kda_model::schedule::{
    BfgWeight, MatrixOverlap, ProjectionBuffers, ProjectionDims, ProjectionSchedule,
    ProjectionWeights, QkvBfgProjection, QkvWeight, labels,
};
use kda_synth::Gen;
use rand::seq::SliceRandom;

use super::backend::{self, BackendArg, CliBackend, Settings, on_backend};
use super::ms;
use crate::error::CliError;

#[derive(Debug, Args)]
pub struct ScheduleBenchArgs {
    /// Token counts, comma separated.
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 16, 128, 1024])]
    pub tokens: Vec<usize>,
    /// Timed rounds per token count, after a warm-up round (a round runs each configuration
    /// once, in turn). Default: as many as fit in about 15 s, from 1 to 40.
    #[arg(long)]
    pub repeats: Option<usize>,
    /// Scale algorithm of the activation's DynamicQuant: 0 (OCP floor) or 1 (round up).
    #[arg(long, default_value_t = 0)]
    pub scale_alg: u8,
    /// Seed of the synthetic weights and activations.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Also write every figure as JSON to this file.
    #[arg(long, value_name = "FILE")]
    pub json: Option<std::path::PathBuf>,
    #[command(flatten)]
    pub device: BackendArg,
}

/// Time the timed rounds of one token count aim for, when `--repeats` is not given.
const ROUNDS_BUDGET: Duration = Duration::from_secs(15);
const MAX_ROUNDS: usize = 40;

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Form {
    Composed,
    Staged,
}

#[derive(Copy, Clone, Debug)]
pub(crate) struct Config {
    pub(crate) name: &'static str,
    pub(crate) form: Form,
    pub(crate) schedule: ProjectionSchedule,
    pub(crate) policy: MatrixOverlap,
}

const fn config(
    name: &'static str,
    form: Form,
    schedule: ProjectionSchedule,
    policy: MatrixOverlap,
) -> Config {
    Config { name, form, schedule, policy }
}

use MatrixOverlap::{Concurrent, Serialized};
use ProjectionSchedule::{Overlapped, Serial};

/// Indices into `CONFIGS` the report uses.
const SERIAL: usize = 0;
const SERIALIZED: usize = 1;
const CONCURRENT: usize = 2;
const STAGED_SERIAL: usize = 3;
const STAGED_CONCURRENT: usize = 5;

pub(crate) const CONFIGS: [Config; 6] = [
    config("serial", Form::Composed, Serial, Serialized),
    config("overlapped, GEMMs serialized", Form::Composed, Overlapped, Serialized),
    config("overlapped, GEMMs concurrent", Form::Composed, Overlapped, Concurrent),
    config("staged F: serial", Form::Staged, Serial, Serialized),
    config("staged F: overlapped, serialized", Form::Staged, Overlapped, Serialized),
    config("staged F: overlapped, concurrent", Form::Staged, Overlapped, Concurrent),
];

const STAGED_LABELS: [&str; 4] = [
    labels::PROJECT_BFG_B,
    labels::PROJECT_BFG_F_A,
    labels::PROJECT_BFG_F_B,
    labels::PROJECT_BFG_G,
];

fn is_gemm(s: &Span) -> bool {
    s.label == labels::QKV_MATMUL || s.label.starts_with(labels::PROJECT_BFG)
}

fn is_vector(s: &Span) -> bool {
    s.label == labels::DYNAMIC_QUANT || s.label == labels::POSTPROCESS_BFG
}

/// One timed call: wall time from the first launch to main's synchronize, and its timeline.
struct Run {
    wall: Duration,
    timeline: Timeline,
}

fn median_duration(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v.get(v.len() / 2).copied().unwrap_or_default()
}

/// Upload seeded uniform bf16 values in `[-scale, scale)`.
pub(crate) fn random_bf16<B: Backend>(
    b: &Device<B>,
    s: &B::Stream,
    rng: &mut Gen,
    shape: &[usize],
    scale: f32,
) -> Result<Tensor<B>, CliError> {
    let t = b.alloc(DType::BF16, shape)?;
    b.upload(s, &t, &rng.uniform_bf16(t.numel(), -scale, scale))?;
    Ok(t)
}

/// The K3 TP8 rank-0 weights: MXFP8 QKV (quantized on the device with `alg`), and the BFG
/// linear both composed and staged.
pub(crate) fn weights<B: Backend>(
    b: &Device<B>,
    s: &B::Stream,
    rng: &mut Gen,
    alg: ScaleAlg,
) -> Result<[ProjectionWeights<B>; 2], CliError> {
    let dims = ProjectionDims::K3_TP8;
    let (hd, lh, lp, d) = (dims.hidden, dims.heads, dims.local_projection(), dims.head_dim);
    let dense = random_bf16(b, s, rng, &[dims.qkv_width(), hd], 0.05)?;
    let data = b.alloc(DType::E4M3, &[dims.qkv_width(), hd])?;
    let scale = b.alloc(DType::E8M0, &[dims.qkv_width(), kda_core::mx::num_blocks(hd)])?;
    b.launch(s, Op::DynamicQuant { x: dense, data: data.clone(), scale: scale.clone(), alg })?;
    let qkv = QkvWeight::Mxfp8 { data, scale, alg };
    let composed =
        BfgWeight::Composed { w: random_bf16(b, s, rng, &[dims.bfg_width(), hd], 0.05)? };
    let staged = BfgWeight::Staged {
        b: random_bf16(b, s, rng, &[lh, hd], 0.05)?,
        f_a: random_bf16(b, s, rng, &[d, hd], 0.05)?,
        f_b: random_bf16(b, s, rng, &[lp, d], 0.05)?,
        g: random_bf16(b, s, rng, &[lp, hd], 0.05)?,
    };
    b.synchronize(s)?;
    Ok([
        ProjectionWeights::new(dims, qkv.clone(), composed)?,
        ProjectionWeights::new(dims, qkv, staged)?,
    ])
}

/// Every output's bits (`mixed_qkv`, the fused BFG output, beta), to check that the schedules
/// agree.
type Bits = (Vec<bf16>, Vec<bf16>, Vec<u32>);

fn output_bits<B: Backend>(
    b: &Device<B>,
    s: &B::Stream,
    bufs: &ProjectionBuffers<B>,
) -> Result<Bits, CliError> {
    let beta: Vec<f32> = b.download(s, &bufs.beta)?;
    Ok((
        b.download(s, &bufs.mixed_qkv)?,
        b.download(s, &bufs.bfg)?,
        beta.into_iter().map(f32::to_bits).collect(),
    ))
}

/// The figures of one token count.
struct Report {
    tokens: usize,
    rounds: usize,
    wall: [Duration; 6],
    quant: Duration,
    qkv: Duration,
    bfg: Duration,
    post: Duration,
    staged_parts: [Duration; 4],
    hidden: f64,
    hidden_quant: f64,
    hidden_post: f64,
    /// Per-round ratios (runs of one round are close in time, so a slow spell of the host
    /// affects both sides), medians over the rounds.
    overhead: Ratio,
    of_ideal: Ratio,
    speedup: Ratio,
    /// The serial time's spread over the rounds (fastest, slowest): the host's noise.
    serial_spread: (Duration, Duration),
}

impl Report {
    /// Every figure, times in milliseconds, configurations by name.
    fn to_json(&self) -> serde_json::Value {
        let wall: serde_json::Map<String, serde_json::Value> = CONFIGS
            .iter()
            .zip(self.wall)
            .map(|(c, w)| (c.name.to_string(), ms(w).into()))
            .collect();
        let staged: serde_json::Map<String, serde_json::Value> = STAGED_LABELS
            .iter()
            .zip(self.staged_parts)
            .map(|(l, d)| ((*l).to_string(), ms(d).into()))
            .collect();
        serde_json::json!({
            "tokens": self.tokens,
            "rounds": self.rounds,
            "wall_ms": wall,
            "ops_alone_ms": {
                "dynamic_quant": ms(self.quant), "qkv_matmul": ms(self.qkv),
                "project_bfg": ms(self.bfg), "postprocess_bfg": ms(self.post),
            },
            "staged_bfg_ms": staged,
            "hidden_vector_fraction": self.hidden,
            "hidden_fraction_dynamic_quant": self.hidden_quant,
            "hidden_fraction_postprocess": self.hidden_post,
            "serialized_over_serial": self.overhead.median,
            "serialized_over_serial_ci95": self.overhead.ci(),
            "concurrent_ideal_ms": ms(self.ideal()),
            "concurrent_of_ideal": self.of_ideal.median,
            "concurrent_of_ideal_ci95": self.of_ideal.ci(),
            "concurrent_speedup": self.speedup.median,
            "concurrent_speedup_ci95": self.speedup.ci(),
            "serial_spread_ms": [ms(self.serial_spread.0), ms(self.serial_spread.1)],
        })
    }

    fn ideal(&self) -> Duration {
        ideal(self.quant, self.qkv, self.bfg, self.post)
    }

    fn staged_bfg(&self) -> Duration {
        self.staged_parts.iter().sum()
    }
}

/// What the concurrent policy could at best achieve: `max(quant + qkv_gemm, bfg_gemm + post)`.
fn ideal(quant: Duration, qkv: Duration, bfg: Duration, post: Duration) -> Duration {
    (quant + qkv).max(bfg + post)
}

fn ratio(a: Duration, b: Duration) -> f64 {
    a.as_secs_f64() / b.as_secs_f64()
}

/// The median of per-round ratios with a distribution-free 95 % confidence interval: the order
/// statistics `n/2 ∓ 0.98 √n` (the normal approximation to the binomial count of rounds below
/// the true median). The host's run-to-run noise (10–15 % on a shared VM) makes this interval,
/// not the median alone, the figure to hold against a target.
#[derive(Copy, Clone, Debug, PartialEq)]
struct Ratio {
    median: f64,
    lo: f64,
    hi: f64,
}

impl Ratio {
    fn of(mut v: Vec<f64>) -> Self {
        v.sort_by(f64::total_cmp);
        let n = v.len();
        if n == 0 {
            return Self { median: f64::NAN, lo: f64::NAN, hi: f64::NAN };
        }
        let half_width = 0.98 * (n as f64).sqrt();
        let lo = ((n as f64 / 2.0 - half_width).floor().max(0.0)) as usize;
        let hi = ((n as f64 / 2.0 + half_width).ceil() as usize).min(n - 1);
        Self { median: v[n / 2], lo: v[lo], hi: v[hi] }
    }

    fn ci(&self) -> [f64; 2] {
        [self.lo, self.hi]
    }
}

impl std::fmt::Display for Ratio {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:.3} (95% CI {:.3}..{:.3})", self.median, self.lo, self.hi)
    }
}

pub fn bench(args: &ScheduleBenchArgs) -> Result<(), CliError> {
    if let Some(path) = &args.json {
        crate::fsio::check_outputs(&[("--json", path)], &[])?;
    }
    let alg = ScaleAlg::try_from(args.scale_alg)
        .map_err(|e| CliError::Argument { arg: "--scale-alg", reason: e.to_string() })?;
    if args.tokens.is_empty() || args.tokens.contains(&0) {
        return Err(CliError::Argument {
            arg: "--tokens",
            reason: "needs one or more counts, each at least 1".into(),
        });
    }
    // One core per stream, unchecked, every op timed.
    let settings = Settings { checked: Some(false), timeline: true, threads: 1 };
    on_backend!(args.device.backend, &settings, |b| bench_on(args, alg, b))
}

fn bench_on<B: CliBackend>(
    args: &ScheduleBenchArgs,
    alg: ScaleAlg,
    b: Device<B>,
) -> Result<(), CliError> {
    backend::require_timeline(&b, "kda bench schedule")?;
    let main = b.new_stream()?;
    let mut rng = Gen::new(args.seed);
    eprintln!("kda bench schedule: generating K3 TP8 weights ...");
    let [composed, staged] = weights(&b, &main, &mut rng, alg)?;
    let projections = CONFIGS
        .iter()
        .map(|c| {
            let w = if c.form == Form::Composed { &composed } else { &staged };
            Ok(QkvBfgProjection::new(&b, w.clone(), c.schedule)?.with_matrix_overlap(c.policy))
        })
        .collect::<Result<Vec<_>, CliError>>()?;

    let dims = ProjectionDims::K3_TP8;
    println!(
        "kda bench schedule: Kimi K3 TP8 rank-0 projections (Hd {}, lh {}, lp {}; QKV MXFP8 \
         scale_alg {}, BFG bf16), reference backend, one core per stream; medians over rounds",
        dims.hidden,
        dims.heads,
        dims.local_projection(),
        alg.code()
    );
    let mut reports = Vec::new();
    let progress = super::progress_bar(0, "runs");
    for &t in &args.tokens {
        let x = random_bf16(&b, &main, &mut rng, &[t, dims.hidden], 1.0)?;
        let bufs =
            projections.iter().map(|p| p.alloc_buffers(&x)).collect::<Result<Vec<_>, _>>()?;
        b.synchronize(&main)?;
        let run = |i: usize| -> Result<Run, CliError> {
            B::clear_timeline(&b);
            let start = Instant::now();
            projections[i].forward_into(&main, &x, &bufs[i])?;
            b.synchronize(&main)?;
            Ok(Run { wall: start.elapsed(), timeline: B::timeline(&b).unwrap_or_default() })
        };
        progress.inc_length(CONFIGS.len() as u64);
        progress.set_message(format!("T={t}: warm-up"));
        let warm = Instant::now();
        for i in 0..CONFIGS.len() {
            run(i)?;
            progress.inc(1);
        }
        let fit = (ROUNDS_BUDGET.as_secs_f64() / warm.elapsed().as_secs_f64()).ceil() as usize;
        let rounds = args.repeats.unwrap_or(fit.clamp(1, MAX_ROUNDS)).max(1);
        progress.inc_length((rounds * CONFIGS.len()) as u64);
        let mut runs: Vec<Vec<Run>> = (0..CONFIGS.len()).map(|_| Vec::new()).collect();
        for round in 0..rounds {
            progress.set_message(format!("T={t}: round {}/{rounds}", round + 1));
            // Each round runs the configurations in a fresh seeded order, so none always runs
            // right after the same other one (a systematic neighbour would bias the ratios).
            let mut order: Vec<usize> = (0..CONFIGS.len()).collect();
            order.shuffle(rng.rng());
            for i in order {
                runs[i].push(run(i)?);
                progress.inc(1);
            }
        }
        // The schedules must agree bit for bit (each config's buffers hold its last run).
        let reference = output_bits(&b, &main, &bufs[SERIAL])?;
        for (i, c) in CONFIGS.iter().enumerate().take(3).skip(1) {
            if output_bits(&b, &main, &bufs[i])? != reference {
                return Err(CliError::Mismatch { what: format!("T={t}"), a: "serial", b: c.name });
            }
        }
        let r = report(t, rounds, &runs);
        progress.suspend(|| print_report(&r));
        reports.push(r);
    }
    progress.finish_and_clear();
    print_summary(&reports);
    if let Some(path) = &args.json {
        let json = serde_json::json!({
            "benchmark": "schedule",
            "shapes": { "hidden": dims.hidden, "heads": dims.heads,
                        "local_projection": dims.local_projection(), "head_dim": dims.head_dim },
            "scale_alg": alg.code(),
            "backend": "reference, one core per stream",
            "results": reports.iter().map(Report::to_json).collect::<Vec<_>>(),
        });
        super::write_json(path, &json)?;
        println!("figures written to {}", path.display());
    }
    Ok(())
}

/// Median time of the spans `of` accepts, per run, over the runs of one configuration.
fn op_time(runs: &[Run], of: impl Fn(&Span) -> bool + Copy) -> Duration {
    median_duration(runs.iter().map(|r| r.timeline.total(of)).collect())
}

fn report(tokens: usize, rounds: usize, runs: &[Vec<Run>]) -> Report {
    let wall = std::array::from_fn(|i| median_duration(runs[i].iter().map(|r| r.wall).collect()));
    let label = |l: &'static str| move |s: &Span| s.label == l;
    let serial = &runs[SERIAL];
    let fraction = |runs: &[Run], hidden: &dyn Fn(&Span) -> bool| {
        let fractions = runs.iter().filter_map(|r| r.timeline.hidden_fraction(hidden, is_gemm));
        Ratio::of(fractions.collect()).median
    };
    let serialized = &runs[SERIALIZED];
    let per_round = |f: &dyn Fn(usize) -> f64| Ratio::of((0..rounds).map(f).collect());
    let alone = |round: usize, l: &'static str| serial[round].timeline.total(label(l));
    let round_ideal = |r: usize| {
        let ops = [labels::DYNAMIC_QUANT, labels::QKV_MATMUL, labels::PROJECT_BFG];
        let [quant, qkv, bfg] = ops.map(|l| alone(r, l));
        ideal(quant, qkv, bfg, alone(r, labels::POSTPROCESS_BFG))
    };
    let walls = |c: usize| runs[c].iter().map(|r| r.wall);
    Report {
        tokens,
        rounds,
        wall,
        quant: op_time(serial, label(labels::DYNAMIC_QUANT)),
        qkv: op_time(serial, label(labels::QKV_MATMUL)),
        bfg: op_time(serial, label(labels::PROJECT_BFG)),
        post: op_time(serial, label(labels::POSTPROCESS_BFG)),
        staged_parts: STAGED_LABELS.map(|l| op_time(&runs[STAGED_SERIAL], label(l))),
        hidden: fraction(serialized, &is_vector),
        hidden_quant: fraction(serialized, &label(labels::DYNAMIC_QUANT)),
        hidden_post: fraction(serialized, &label(labels::POSTPROCESS_BFG)),
        overhead: per_round(&|r| ratio(runs[SERIALIZED][r].wall, serial[r].wall)),
        of_ideal: per_round(&|r| ratio(round_ideal(r), runs[CONCURRENT][r].wall)),
        speedup: per_round(&|r| ratio(serial[r].wall, runs[CONCURRENT][r].wall)),
        serial_spread: (
            walls(SERIAL).min().unwrap_or_default(),
            walls(SERIAL).max().unwrap_or_default(),
        ),
    }
}

fn verdict(composed: Duration, staged: Duration) -> &'static str {
    if composed < staged { "composed wins" } else { "staged wins" }
}

fn print_report(r: &Report) {
    {
        let t = r.tokens;
        println!("T={t} ({} timed round{}):", r.rounds, if r.rounds == 1 { "" } else { "s" });
        for (c, wall) in CONFIGS.iter().zip(r.wall) {
            println!("  {:<34} {:>10.3} ms", c.name, ms(wall));
        }
        let (fast, slow) = r.serial_spread;
        println!(
            "  (serial over the rounds: {:.3} .. {:.3} ms, the host's noise)",
            ms(fast),
            ms(slow)
        );
        println!(
            "  ops alone: dynamic_quant {:.3} ms, qkv_matmul {:.3} ms, project_bfg {:.3} ms, \
             postprocess_bfg {:.3} ms; staged F: b {:.3} + f_a {:.3} + f_b {:.3} + g {:.3} = {:.3} ms",
            ms(r.quant),
            ms(r.qkv),
            ms(r.bfg),
            ms(r.post),
            ms(r.staged_parts[0]),
            ms(r.staged_parts[1]),
            ms(r.staged_parts[2]),
            ms(r.staged_parts[3]),
            ms(r.staged_bfg()),
        );
        println!(
            "  serialized GEMMs: hidden vector fraction {:.3} (dynamic_quant {:.3}, postprocess_bfg \
             {:.3}; target >= 0.9 for T >= 16), overlapped / serial {} (target <= 1.03; per-round \
             median)",
            r.hidden, r.hidden_quant, r.hidden_post, r.overhead
        );
        println!(
            "  concurrent GEMMs: ideal max(quant + qkv, bfg + post) {:.3} ms, achieved {} of \
             ideal (target >= 0.9 for T >= 128), speedup {} over serial (per-round medians)",
            ms(r.ideal()),
            r.of_ideal,
            r.speedup
        );
        println!(
            "  composed vs staged F: BFG projection {:.3} vs {:.3} ms ({}); serial {:.3} vs {:.3} \
             ms ({}); overlapped concurrent {:.3} vs {:.3} ms ({})",
            ms(r.bfg),
            ms(r.staged_bfg()),
            verdict(r.bfg, r.staged_bfg()),
            ms(r.wall[SERIAL]),
            ms(r.wall[STAGED_SERIAL]),
            verdict(r.wall[SERIAL], r.wall[STAGED_SERIAL]),
            ms(r.wall[CONCURRENT]),
            ms(r.wall[STAGED_CONCURRENT]),
            verdict(r.wall[CONCURRENT], r.wall[STAGED_CONCURRENT]),
        );
        println!("  serial and both overlapped outputs identical bit for bit");
    }
}

fn print_summary(reports: &[Report]) {
    println!("summary (ms; hidden = hidden vector fraction of the serialized policy):");
    println!(
        "  {:>6} {:>10} {:>10} {:>10} {:>7} {:>7} {:>13} {:>10} {:>8} {:>8} {:>10} {:>10}",
        "T",
        "serial",
        "ovl-ser",
        "ovl-conc",
        "hidden",
        "ser/sr",
        "ser/sr 95% CI",
        "ideal",
        "of-ideal",
        "speedup",
        "bfg comp",
        "bfg staged"
    );
    for r in reports {
        println!(
            "  {:>6} {:>10.3} {:>10.3} {:>10.3} {:>7.3} {:>7.3} {:>13} {:>10.3} {:>8.3} {:>7.2}x {:>10.3} {:>10.3}",
            r.tokens,
            ms(r.wall[SERIAL]),
            ms(r.wall[SERIALIZED]),
            ms(r.wall[CONCURRENT]),
            r.hidden,
            r.overhead.median,
            format!("{:.3}..{:.3}", r.overhead.lo, r.overhead.hi),
            ms(r.ideal()),
            r.of_ideal.median,
            r.speedup.median,
            ms(r.bfg),
            ms(r.staged_bfg()),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::Ratio;

    #[test]
    fn the_median_comes_with_order_statistic_bounds() {
        // 100 rounds: the 41st and 61st values bound the median (50 ∓ 9.8, rounded outwards).
        let r = Ratio::of((0..100).rev().map(f64::from).collect());
        assert_eq!(r, Ratio { median: 50.0, lo: 40.0, hi: 60.0 });
        // Too few rounds for any confidence: the whole range.
        let r = Ratio::of(vec![1.2, 0.9, 1.0]);
        assert_eq!(r, Ratio { median: 1.0, lo: 0.9, hi: 1.2 });
        assert!(Ratio::of(Vec::new()).median.is_nan());
    }
}
