//! `kda plan`: the planner's predicted projection times (docs/design/planner.md#the-model).
//!
//! Records one K3 TP8 rank-0 projection forward per configuration (serial, overlapped with the
//! GEMMs serialised, overlapped with the GEMMs concurrent; composed or staged F) in checked mode
//! on the reference backend at 1 and 2 tokens, extrapolates each op's FLOPs and bytes to every
//! requested T (they are affine in T), and simulates the streams on the chosen chip's figures.

use clap::Args;
use kda_core::plan::chips::Chip;
use kda_core::plan::{self, ChipFigures};
use kda_core::sanitize::Entry;
use kda_core::schedule::{ProjectionDims, QkvBfgProjection};
use kda_core::{DType, Device, Op, ScaleAlg};
use kda_synth::Gen;

use super::backend::{CliBackend, Settings};
use super::schedule::{CONFIGS, Form, random_bf16, weights};
use crate::error::CliError;

#[derive(Debug, Args)]
pub struct PlanArgs {
    /// The chip whose figures predict the times: 910b, 950, h200, or host (this machine's
    /// figures, measured at start-up on the reference backend, one core).
    #[arg(long, default_value = "h200")]
    pub chip: String,
    /// Tensor-parallel degree (only 8, the K3 TP8 shapes, for now).
    #[arg(long, default_value_t = 8)]
    pub tp: usize,
    /// Token counts, comma separated.
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 16, 128, 1024, 8192])]
    pub tokens: Vec<usize>,
}

/// The two token counts the forward is recorded at.
const RECORDED: [usize; 2] = [1, 2];

pub fn run(args: &PlanArgs) -> Result<(), CliError> {
    let host = args.chip.eq_ignore_ascii_case("host");
    let chip = Chip::parse(&args.chip);
    if chip.is_none() && !host {
        return Err(CliError::Argument {
            arg: "--chip",
            reason: format!("`{}` is not one of 910b, 950, h200, host", args.chip),
        });
    }
    if args.tp != 8 {
        return Err(CliError::Argument {
            arg: "--tp",
            reason: "only 8 (the K3 TP8 shapes) is planned for now".into(),
        });
    }
    if args.tokens.is_empty() || args.tokens.contains(&0) {
        return Err(CliError::Argument {
            arg: "--tokens",
            reason: "needs one or more counts, each at least 1".into(),
        });
    }
    let settings = Settings { checked: Some(true), timeline: false, threads: 1 };
    let logs = record(<kda_reference::ReferenceBackend as CliBackend>::open(&settings)?)?;
    let figures = match chip {
        Some(chip) => chip.figures(),
        None => {
            let unchecked = Settings { checked: Some(false), timeline: false, threads: 1 };
            measure_host(<kda_reference::ReferenceBackend as CliBackend>::open(&unchecked)?)?
        }
    };
    report(&figures, &args.tokens, &logs)
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

/// Per configuration, the forward's log at each of [`RECORDED`] token counts.
type Logs = Vec<[Vec<Entry>; 2]>;

fn record<B: CliBackend>(b: Device<B>) -> Result<Logs, CliError> {
    let main = b.new_stream()?;
    let mut rng = Gen::new(0);
    let [composed, staged] = weights(&b, &main, &mut rng, ScaleAlg::OcpFloor)?;
    let dims = ProjectionDims::K3_TP8;
    let mut logs = Vec::new();
    for c in &CONFIGS {
        let w = if c.form == Form::Composed { &composed } else { &staged };
        let projection =
            QkvBfgProjection::new(&b, w.clone(), c.schedule)?.with_matrix_overlap(c.policy);
        let mut pair: [Vec<Entry>; 2] = Default::default();
        for (slot, &t) in pair.iter_mut().zip(&RECORDED) {
            let x = random_bf16(&b, &main, &mut rng, &[t, dims.hidden], 1.0)?;
            let bufs = projection.alloc_buffers(&x)?;
            b.synchronize(&main)?;
            let start = b.instrumentation().log().len();
            projection.forward_into(&main, &x, &bufs)?;
            b.synchronize(&main)?;
            *slot = b.instrumentation().log().split_off(start);
        }
        logs.push(pair);
    }
    Ok(logs)
}

/// The weight bytes one decode step reads for the forget gate F, composed and staged.
fn f_weight_bytes(dims: ProjectionDims) -> (usize, usize) {
    let (hd, lp, d) = (dims.hidden, dims.local_projection(), dims.head_dim);
    (2 * lp * hd, 2 * (d * hd + lp * d))
}

fn report(chip: &ChipFigures, tokens: &[usize], logs: &Logs) -> Result<(), CliError> {
    let plan_err = |e: plan::PlanError| CliError::Argument { arg: "plan", reason: e.to_string() };
    println!("kda plan: Kimi K3 TP8 rank-0 QKV/BFG projections on {}", chip.name);
    for (name, value, provenance) in chip.rows() {
        println!("  {name:<20} {value:>12}  {provenance}");
    }
    print!("\n{:>7}", "T");
    for c in &CONFIGS {
        print!("  {:>14}", short(c.name));
    }
    println!("  recommended");
    for &t in tokens {
        let mut times = Vec::new();
        for pair in logs {
            let works = plan::extrapolate((RECORDED[0], &pair[0]), (RECORDED[1], &pair[1]), t)
                .map_err(plan_err)?;
            let sim = plan::predict_with(&pair[0], &works, chip).map_err(plan_err)?;
            times.push(sim.makespan);
        }
        print!("{t:>7}");
        for time in &times {
            print!("  {:>11.1} µs", time * 1e6);
        }
        let best = (0..times.len()).min_by(|&a, &b| times[a].total_cmp(&times[b])).unwrap_or(0);
        println!("  {}", CONFIGS[best].name);
    }
    let (composed, staged) = f_weight_bytes(ProjectionDims::K3_TP8);
    println!(
        "\nweight bytes of F read per decode step (per layer, per rank): composed {:.2} MB, \
         staged (f_a + f_b shard) {:.2} MB",
        composed as f64 / 1e6,
        staged as f64 / 1e6
    );
    Ok(())
}

/// A column header for a configuration.
fn short(name: &str) -> String {
    let form = if name.starts_with("staged") { "st" } else { "co" };
    let schedule = if name.contains("concurrent") {
        "conc"
    } else if name.contains("serialized") {
        "ser'd"
    } else {
        "serial"
    };
    format!("{form} {schedule}")
}
