//! `kda precision`: how far the composed forget gate (one GEMM with `W_f = bf16(f_b · f_a)`) and
//! the staged one (two bf16 GEMMs) are from exact arithmetic, on K3-shaped weights.
//!
//! The fused BFG was once reverted over precision: the composed F rounds in different places
//! than the two GEMMs it replaces. This command measures both against an f64 oracle (the same
//! bf16 inputs, exact arithmetic), for the raw logits `g1` and for the activated gate in both
//! forms, and the same for Kimi Linear's low-rank output gate; `--write` turns the figures into
//! `docs/precision.md`. See that file for the method.

use std::fmt::Write as _;
use std::path::PathBuf;

use clap::Args;
use half::bf16;
use kda_core::kda::gate::exact::{gate_lower_bound, gate_softplus, sigmoid};
use kda_core::{DType, Device, Op};
use kda_model::config::{KdaConfig, Tp};
use kda_model::weights::source::read_all;
use kda_model::weights::{
    BfgBlock, BfgMode, FusedBfgLinear, TensorRead, TensorSource, WeightError, layer_prefix,
};
use kda_reference::ReferenceBackend;
use kda_synth::Gen;
use kda_synth::checkpoint::{SyntheticCheckpoint, SyntheticSpec};

use crate::error::CliError;

#[derive(Debug, Args)]
pub struct PrecisionArgs {
    /// Heads of the layer slice (Hd and D stay at K3's 7168 and 128).
    #[arg(long, default_value_t = 16)]
    pub heads: usize,
    /// Tokens of activations.
    #[arg(long, default_value_t = 256)]
    pub tokens: usize,
    /// Seed of the synthetic weights and activations.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Also write the report (method and figures) as Markdown to this file.
    #[arg(long)]
    pub write: Option<PathBuf>,
}

/// Error statistics of one quantity on one path against the oracle.
#[derive(Copy, Clone, Debug)]
pub struct Stats {
    pub max_rel: f64,
    pub mean_rel: f64,
    /// `‖y − y*‖₂ / ‖y*‖₂`.
    pub norm_rel: f64,
    /// `max |y − y*| / rms(y*)`.
    pub max_abs_rms: f64,
}

/// Elementwise relative error with the denominator floored at `1e-3 · rms(reference)`.
pub fn stats(got: &[f64], reference: &[f64]) -> Stats {
    let n = reference.len().max(1) as f64;
    let ref_sq: f64 = reference.iter().map(|r| r * r).sum();
    let floor = 1e-3 * (ref_sq / n).sqrt();
    let (mut max_rel, mut sum_rel, mut err_sq, mut max_abs) = (0.0f64, 0.0f64, 0.0f64, 0.0f64);
    for (&g, &r) in got.iter().zip(reference) {
        let e = (g - r).abs();
        let rel = e / r.abs().max(floor);
        max_rel = max_rel.max(rel);
        max_abs = max_abs.max(e);
        sum_rel += rel;
        err_sq += e * e;
    }
    let tiny = f64::MIN_POSITIVE;
    Stats {
        max_rel,
        mean_rel: sum_rel / n,
        norm_rel: (err_sq / ref_sq.max(tiny)).sqrt(),
        max_abs_rms: max_abs / (ref_sq / n).sqrt().max(tiny),
    }
}

/// Share of elements where `a` is strictly closer to the reference than `b`, and where they tie.
fn closer(a: &[f64], b: &[f64], reference: &[f64]) -> (f64, f64) {
    let n = reference.len().max(1) as f64;
    let (mut wins, mut ties) = (0usize, 0usize);
    for ((&x, &y), &r) in a.iter().zip(b).zip(reference) {
        let (ex, ey) = ((x - r).abs(), (y - r).abs());
        if ex < ey {
            wins += 1;
        } else if ex == ey {
            ties += 1;
        }
    }
    (wins as f64 / n, ties as f64 / n)
}

/// One row of the report: a quantity, composed and staged statistics, and who is closer.
struct Row {
    quantity: &'static str,
    composed: Stats,
    staged: Stats,
    /// The oracle rounded once to bf16: the best a bf16 output can do.
    floor: Stats,
    composed_closer: f64,
    ties: f64,
}

fn row(quantity: &'static str, paths: [&[f64]; 3], oracle: &[f64]) -> Row {
    let [composed, staged, rounded] = paths;
    let (composed_closer, ties) = closer(composed, staged, oracle);
    Row {
        quantity,
        composed: stats(composed, oracle),
        staged: stats(staged, oracle),
        floor: stats(rounded, oracle),
        composed_closer,
        ties,
    }
}

/// `y = x · w^T` on the reference backend: bf16 in, fp32 accumulation, bf16 out.
fn gemm_bf16(
    device: &Device<ReferenceBackend>,
    x: &[bf16],
    w: &[bf16],
    m: usize,
    n: usize,
    k: usize,
) -> Result<Vec<bf16>, CliError> {
    let stream = device.new_stream()?;
    let tx = device.alloc(DType::BF16, &[m, k])?;
    let tw = device.alloc(DType::BF16, &[n, k])?;
    let ty = device.alloc(DType::BF16, &[m, n])?;
    device.upload(&stream, &tx, x)?;
    device.upload(&stream, &tw, w)?;
    device.launch(&stream, Op::Gemm { x: tx, w: tw, y: ty.clone() })?;
    device.synchronize(&stream)?;
    Ok(device.download(&stream, &ty)?)
}

fn widen(v: &[bf16]) -> Vec<f64> {
    v.iter().map(|x| f64::from(x.to_f32())).collect()
}

fn as_bf16(t: &kda_model::weights::HostTensor) -> Result<Vec<bf16>, CliError> {
    t.as_bf16().map(<[bf16]>::to_vec).ok_or_else(|| CliError::Argument {
        arg: "weights",
        reason: format!("expected bf16 weights, got {}", t.dtype()),
    })
}

/// The low-rank projection `y = x · (b · a)^T` three ways: composed by the loader's
/// [`FusedBfgLinear`] then one GEMM, staged as two bf16 GEMMs, and exactly in f64.
struct LowRankRun {
    composed: Vec<f64>,
    staged: Vec<f64>,
    oracle: Vec<f64>,
    /// The oracle rounded to bf16.
    rounded: Vec<f64>,
}

fn low_rank_run(
    device: &Device<ReferenceBackend>,
    config: &KdaConfig,
    seed: u64,
    tokens: usize,
    output_gate: bool,
) -> Result<(LowRankRun, SyntheticCheckpoint), CliError> {
    let dims = config.dims(Tp::SINGLE).map_err(WeightError::from)?;
    let (hd, d, p) = (dims.hidden, dims.head_dim, dims.proj);
    let source = SyntheticCheckpoint::new(SyntheticSpec::new(config.clone(), seed));
    let pre = layer_prefix(0);
    let (a_name, b_name) = if output_gate {
        ("g_a_proj.weight", "g_b_proj.weight")
    } else {
        ("f_a_proj.weight", "f_b_proj.weight")
    };
    let a = read_all(&*source.tensor(&format!("{pre}{a_name}"))?)?;
    let b = read_all(&*source.tensor(&format!("{pre}{b_name}"))?)?;

    // Composed: exactly what the loader packs into the fused BFG weight.
    let mut bfg = FusedBfgLinear::deferred(dims, DType::BF16, BfgMode::Composed)?;
    if output_gate {
        bfg.load_g_a(&a)?;
        bfg.load_g_b(&b)?;
    } else {
        bfg.load_f_a(&a)?;
        bfg.load_f_b(&b)?;
    }
    bfg.materialize()?;
    let block = if output_gate { BfgBlock::Gate } else { BfgBlock::Forget };
    let (rows, Some(weight)) = (bfg.block_rows(block).unwrap_or(0..0), bfg.weight()) else {
        return Err(CliError::Argument { arg: "weights", reason: "no composed weight".into() });
    };
    let w_composed = as_bf16(&weight.read(&[rows, 0..hd])?)?;

    let x: Vec<bf16> = Gen::new(seed ^ 0x5eed)
        .normal_f32(tokens * hd, 0.0, 1.0)
        .into_iter()
        .map(bf16::from_f32)
        .collect();
    let composed = widen(&gemm_bf16(device, &x, &w_composed, tokens, p, hd)?);
    let (a16, b16) = (as_bf16(&a)?, as_bf16(&b)?);
    let h = gemm_bf16(device, &x, &a16, tokens, d, hd)?;
    let staged = widen(&gemm_bf16(device, &h, &b16, tokens, p, d)?);

    // f64 oracle from the same bf16 inputs: y = b (a x).
    let (xf, af, bf) = (widen(&x), widen(&a16), widen(&b16));
    let mut oracle = Vec::with_capacity(tokens * p);
    let mut hx = vec![0.0f64; d];
    for t in 0..tokens {
        let xr = &xf[t * hd..(t + 1) * hd];
        for (k, v) in hx.iter_mut().enumerate() {
            *v = af[k * hd..(k + 1) * hd].iter().zip(xr).map(|(u, w)| u * w).sum();
        }
        for c in 0..p {
            oracle.push(bf[c * d..(c + 1) * d].iter().zip(&hx).map(|(u, w)| u * w).sum());
        }
    }
    let rounded = oracle.iter().map(|&v| f64::from(bf16::from_f64(v).to_f32())).collect();
    Ok((LowRankRun { composed, staged, oracle, rounded }, source))
}

/// The activated gate of every element from logits `g1` `[T, P]`.
fn activate(
    g1: &[f64],
    p: usize,
    d: usize,
    a_log: &[f64],
    dt_bias: &[f64],
    gate: impl Fn(f64, f64) -> f64,
) -> Vec<f64> {
    g1.iter()
        .enumerate()
        .map(|(i, &g)| {
            let c = i % p;
            gate(a_log[c / d], g + dt_bias[c])
        })
        .collect()
}

pub fn run(args: &PrecisionArgs) -> Result<(), CliError> {
    if let Some(path) = &args.write {
        crate::fsio::check_outputs(&[("--write", path)], &[])?;
    }
    if args.heads == 0 || args.tokens == 0 {
        return Err(CliError::Argument {
            arg: "--heads/--tokens",
            reason: "must be at least 1".into(),
        });
    }
    let device = ReferenceBackend::new();
    let k3 = KdaConfig::kimi_k3().with_heads(args.heads);
    let lower_bound = k3.linear_attn_config.gate_lower_bound.unwrap_or(-5.0);
    let (f, source) = low_rank_run(&device, &k3, args.seed, args.tokens, false)?;
    let pre = layer_prefix(0);
    let a_log =
        read_all(&*source.tensor(&format!("{pre}A_log"))?)?.to_f64_vec().unwrap_or_default();
    let dt_bias =
        read_all(&*source.tensor(&format!("{pre}dt_bias"))?)?.to_f64_vec().unwrap_or_default();
    let (p, d) = (args.heads * 128, 128);
    let act = |g1: &[f64], softplus: bool| {
        if softplus {
            activate(g1, p, d, &a_log, &dt_bias, gate_softplus)
        } else {
            activate(g1, p, d, &a_log, &dt_bias, |al, a| gate_lower_bound(lower_bound, al, a))
        }
    };
    let mut rows =
        vec![row("g1 (forget-gate logits)", [&f.composed, &f.staged, &f.rounded], &f.oracle)];
    for (softplus, name) in
        [(false, "g, lower-bound form (K3)"), (true, "g, softplus form (Kimi Linear)")]
    {
        let paths = [&f.composed, &f.staged, &f.rounded].map(|v| act(v, softplus));
        rows.push(row(name, [&paths[0], &paths[1], &paths[2]], &act(&f.oracle, softplus)));
    }

    let kl = KdaConfig::kimi_linear_48b().with_heads(args.heads);
    let (g, _) = low_rank_run(&device, &kl, args.seed, args.tokens, true)?;
    let sig = |v: &[f64]| v.iter().map(|&x| sigmoid(x)).collect::<Vec<f64>>();
    rows.push(row(
        "g2 (output-gate logits, Kimi Linear low rank)",
        [&g.composed, &g.staged, &g.rounded],
        &g.oracle,
    ));
    let paths = [&g.composed, &g.staged, &g.rounded].map(|v| sig(v));
    rows.push(row("sigmoid(g2)", [&paths[0], &paths[1], &paths[2]], &sig(&g.oracle)));

    let table = render_table(&rows);
    println!(
        "kda precision: composed vs staged low-rank gates against an f64 oracle \
         ({} tokens, {} heads of 128, Hd 7168 (K3) / 2304 (Kimi Linear), seed {})",
        args.tokens, args.heads, args.seed
    );
    print!("{table}");
    if let Some(path) = &args.write {
        let doc = render_doc(args, &rows, &table);
        crate::fsio::write_atomic(path, doc.as_bytes())?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

fn render_table(rows: &[Row]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "| quantity | path | max rel | mean rel | norm rel | max abs / rms | composed closer / tie |\n\
         |---|---|---|---|---|---|---|"
    );
    for r in rows {
        for (path, st) in
            [("composed", r.composed), ("staged", r.staged), ("bf16(oracle)", r.floor)]
        {
            let who = if path == "composed" {
                format!("{:.1}% / {:.1}%", 100.0 * r.composed_closer, 100.0 * r.ties)
            } else {
                String::new()
            };
            let _ = writeln!(
                s,
                "| {} | {path} | {:.3e} | {:.3e} | {:.3e} | {:.3e} | {who} |",
                r.quantity, st.max_rel, st.mean_rel, st.norm_rel, st.max_abs_rms
            );
        }
    }
    s
}

fn render_doc(args: &PrecisionArgs, rows: &[Row], table: &str) -> String {
    let (t, h) = (args.tokens, args.heads);
    let p = h * 128;
    let ratio = |a: f64, b: f64| a / b.max(f64::MIN_POSITIVE);
    let range = |f: &dyn Fn(&Row) -> f64| {
        rows.iter()
            .map(f)
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), x| (lo.min(x), hi.max(x)))
    };
    let mean = range(&|r| ratio(r.composed.mean_rel, r.staged.mean_rel));
    let norm = range(&|r| ratio(r.composed.norm_rel, r.staged.norm_rel));
    let wins = range(&|r| r.composed_closer);
    let losses = range(&|r| 1.0 - r.composed_closer - r.ties);
    let worst = mean.1.max(norm.1);
    let verdict = if worst <= 1.05 && mean.0 >= 0.95 && norm.0 >= 0.95 {
        "The two paths are equally accurate: every ratio below is within 5% of 1, and each path\n\
         is the closer one about equally often."
            .to_string()
    } else if worst <= 1.0 {
        "The composed path is at least as accurate as the staged one on every quantity.".to_string()
    } else {
        format!(
            "The composed path is less accurate than the staged one on some quantity, by a factor \
             of at most {worst:.2}."
        )
    };
    let g1 = &rows[0];
    format!(
        r#"# Precision of the composed forget gate

Generated by `kda precision --heads {h} --tokens {t} --seed {seed} --write docs/precision.md`;
rerun it to reproduce every figure below (a few seconds; `--seed` and `--heads` vary the draw).

## The question

The fused BFG linear replaces the forget gate's two bf16 GEMMs (staged:
`g1 = bf16(bf16(x · f_aᵀ) · f_bᵀ)`) by one GEMM against a weight composed at load time
(composed: `W_f = bf16(f_b · f_a)` computed in fp32 and rounded once, then
`g1 = bf16(x · W_fᵀ)`). Both round twice, in different places: the composed path rounds the
`[P, Hd]` weight and the output, the staged path rounds the `[T, D]` intermediate and the output.
The original change was once reverted because the composed F "rounds differently". Different
is not worse; this measures how far each path is from exact arithmetic.

## Method

- **Shapes.** Kimi K3: `Hd = 7168`, `D = 128`, lower-bound gate (`-5`). The layer is sliced to
  {h} heads (`P = {p}` forget-gate channels) instead of 96: every channel `c` is its own row
  `f_b[c]` against the same `f_a`, so all channels' errors have one distribution and more heads
  only add samples (and let the maximum grow slowly, like the maximum of more draws). The
  reduction lengths, which set the rounding errors, are exactly K3's (`Hd` for the first and the
  composed GEMM, `D` for the second).
- **Weights.** A synthetic K3 checkpoint (`kda_synth::checkpoint`, seed {seed}): projection
  weights `~ N(0, 0.02)` in bf16, `A_log = ln U(1, 16)`, `dt_bias = softplus⁻¹(U(0.001, 0.1))`.
- **Activations.** {t} tokens of `x ~ N(0, 1)` rounded to bf16: the RMS-normalised hidden state
  the projections see.
- **Composed path.** The loader's own code (`FusedBfgLinear`, `BfgMode::Composed`) composes
  `f_b · f_a` in fp32 and rounds once to bf16; `g1` is then one reference-device GEMM (fp32
  accumulation, bf16 output).
- **Staged path.** `h = x · f_aᵀ` (reference GEMM, bf16 output `[T, 128]`), then `g1 = h · f_bᵀ`
  (bf16 output).
- **Oracle.** `g1* = f_b · (f_a · x)` in f64 from the same bf16 `x`, `f_a`, `f_b`: exact up to
  f64 rounding, far below every figure here.
- **Activated gate.** From each path's `g1`, in f64, so that only the projection differs:
  lower-bound form `g = -5 · σ(e^A_log · (g1 + dt_bias))` (K3) and softplus form
  `g = -e^A_log · softplus(g1 + dt_bias)` (Kimi Linear's form, here on K3-shaped logits).
- **Output gate.** Kimi Linear's low-rank output gate (`g_a_proj` `[D, Hd]`, `g_b_proj`
  `[P, D]`, `Hd = 2304`) is composed into the fused weight the same way; its logits `g2` and
  `σ(g2)` are measured the same way.
- **Metrics.** Over all `T · P` = {n} elements of each quantity: the relative error
  `|y − y*| / max(|y*|, τ)` with `τ = 10⁻³ · rms(y*)` (so logits within a thousandth of the RMS
  of zero do not turn a tiny absolute error into an unbounded relative one), its maximum and
  mean; the normwise error `‖y − y*‖₂ / ‖y*‖₂`; the largest absolute error over `rms(y*)`; and
  the share of elements where the composed value is strictly closer to the oracle than the
  staged one, and where both are equally close (mostly the same bf16 value).
- **Floor.** The `bf16(oracle)` lines round the oracle's logits once to bf16 (and compute the
  gates from those): the best any projection with a bf16 output can do.

## Results

{table}
## Reading

{verdict}

Over the five quantities, composed/staged is {m0:.3}–{m1:.3} for the mean relative error and
{n0:.3}–{n1:.3} for the normwise error; the composed value is the closer one for
{w0:.1}–{w1:.1}% of elements and the staged value for {l0:.1}–{l1:.1}%.

- Both paths are bf16-accurate: their normwise error on the logits ({g1n:.2e} composed,
  {g1s:.2e} staged) is below bf16's unit roundoff `u = 2⁻⁸ ≈ 3.9e-3`. The oracle rounded once to
  bf16 (the `bf16(oracle)` lines, the best any bf16 output can do) is at {g1f:.2e}; the rest,
  {xc:.2e} (composed) and {xs:.2e} (staged) in quadrature, is the one rounding each path makes
  before its last reduction: the composed weight, or the staged intermediate `h`. Either rounds
  the terms of a sum whose terms have random signs, so it costs about as much as rounding the
  sum itself, whichever of the two is rounded.
- The large maximum relative error of the logits (`{g1m:.2}`) is the near-zero logits: its
  absolute counterpart is {g1a:.2e} of the logits' RMS, for both paths alike.
- The gates see `g1 + dt_bias`, larger in magnitude than the logits (`|dt_bias|` ≈ 2.3–6.9), so
  their relative errors are smaller. The lower-bound form multiplies a logit error by
  `e^A_log · (1 − σ)` (up to 16), which sets its maximum; softplus and `σ(g2)` damp it. (Its
  gate values span many orders of magnitude, so its "max abs / rms" says little; the column is
  for the logits.)
- So composing at load time keeps the projection at bf16 precision; the staged mode
  (`BfgMode::Staged`) remains for comparisons and as a fallback. The low-rank output gate of Kimi
  Linear is composed for the same reason, with the same result.
"#,
        seed = args.seed,
        n = t * p,
        m0 = mean.0,
        m1 = mean.1,
        n0 = norm.0,
        n1 = norm.1,
        w0 = 100.0 * wins.0,
        w1 = 100.0 * wins.1,
        l0 = 100.0 * losses.0,
        l1 = 100.0 * losses.1,
        g1n = g1.composed.norm_rel,
        g1m = g1.composed.max_rel,
        g1a = g1.composed.max_abs_rms,
        g1f = g1.floor.norm_rel,
        g1s = g1.staged.norm_rel,
        xc = (g1.composed.norm_rel.powi(2) - g1.floor.norm_rel.powi(2)).max(0.0).sqrt(),
        xs = (g1.staged.norm_rel.powi(2) - g1.floor.norm_rel.powi(2)).max(0.0).sqrt(),
    )
}
