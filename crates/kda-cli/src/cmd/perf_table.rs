//! The reference backend's performance figures: each the ratio of two rates measured in the
//! same run, the two timed alternately round after round (so a neighbour's load slows both
//! alike), reported as the median of the per-round ratios. `kda bench layer` prints them as one
//! table (and writes them with `--json`); `cargo xtask bench` runs it.

use std::time::{Duration, Instant};

use kda_core::{DType, Op, ScaleAlg};

use super::openblas::OpenBlas;
use crate::error::CliError;

/// Which way a figure should go.
#[derive(Copy, Clone, Debug)]
pub enum Target {
    AtMost(f64),
    AtLeast(f64),
}

impl Target {
    fn met(self, value: f64) -> bool {
        match self {
            Target::AtMost(t) => value <= t,
            Target::AtLeast(t) => value >= t,
        }
    }

    fn text(self) -> String {
        match self {
            Target::AtMost(t) => format!("<= {t}"),
            Target::AtLeast(t) => format!(">= {t}"),
        }
    }
}

/// One figure of the table.
#[derive(Clone, Debug)]
pub struct Figure {
    pub name: String,
    /// Median of the per-round ratios.
    pub ratio: f64,
    /// Smallest and largest per-round ratio.
    pub range: (f64, f64),
    pub rounds: usize,
    pub target: Target,
    /// The two rates behind the ratio (medians), in words.
    pub detail: String,
}

impl Figure {
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "figure": self.name,
            "ratio": self.ratio,
            "min": self.range.0,
            "max": self.range.1,
            "rounds": self.rounds,
            "target": self.target.text(),
            "met": self.target.met(self.ratio),
            "detail": self.detail,
        })
    }
}

/// Per-round times of two workloads timed alternately (after one untimed round).
#[derive(Clone, Debug, Default)]
pub struct Paired {
    pub a: Vec<Duration>,
    pub b: Vec<Duration>,
}

fn median<T: Copy + PartialOrd>(values: &[T]) -> T {
    let mut v = values.to_vec();
    v.sort_by(|x, y| x.partial_cmp(y).unwrap_or(std::cmp::Ordering::Equal));
    v[v.len() / 2]
}

impl Paired {
    /// Time `a` then `b`, `rounds` times after a warm-up round.
    pub fn run<E>(
        rounds: usize,
        mut a: impl FnMut() -> Result<Duration, E>,
        mut b: impl FnMut() -> Result<Duration, E>,
    ) -> Result<Self, E> {
        let mut p = Self::default();
        for round in 0..=rounds.max(1) {
            let (ta, tb) = (a()?, b()?);
            if round > 0 {
                p.a.push(ta);
                p.b.push(tb);
            }
        }
        Ok(p)
    }

    pub fn median_a(&self) -> Duration {
        median(&self.a)
    }

    pub fn median_b(&self) -> Duration {
        median(&self.b)
    }

    /// The figure whose per-round ratio is `ratio(time_a, time_b)`.
    pub fn figure(
        &self,
        name: &str,
        target: Target,
        detail: String,
        ratio: impl Fn(f64, f64) -> f64,
    ) -> Figure {
        let ratios: Vec<f64> = self
            .a
            .iter()
            .zip(&self.b)
            .map(|(a, b)| ratio(a.as_secs_f64(), b.as_secs_f64()))
            .collect();
        let (lo, hi) = ratios
            .iter()
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &r| (lo.min(r), hi.max(r)));
        Figure {
            name: name.to_string(),
            ratio: median(&ratios),
            range: (lo, hi),
            rounds: ratios.len(),
            target,
            detail,
        }
    }
}

/// How long `f` takes.
pub fn timed<E: Into<CliError>>(f: impl FnOnce() -> Result<(), E>) -> Result<Duration, CliError> {
    let start = Instant::now();
    f().map_err(Into::into)?;
    Ok(start.elapsed())
}

/// The kernel figures of the table (all but the decode step): the chunked prefill against the
/// reference GEMM, DynamicQuant against a host memcpy, the f32 GEMM against OpenBLAS's sgemm
/// (one thread each; skipped when the system has no OpenBLAS).
pub fn kernel_figures(rounds: usize) -> Result<Vec<Figure>, CliError> {
    let b = super::bench::reference_with_threads(1)?;
    let s = b.new_stream()?;
    let mut rng = kda_testkit::Gen::new(29);
    let mut figures = Vec::new();

    // The reference f32 GEMM at the K3 TP8 BFG shape.
    let (m, n, k) = (256, 3084, 7168);
    let gemm_flops = 2.0 * (m * n * k) as f64;
    let xs = rng.uniform_f32(m * k, -1.0, 1.0);
    let ws = rng.uniform_f32(n * k, -1.0, 1.0);
    let (x, w, y) = (
        b.alloc(DType::F32, &[m, k])?,
        b.alloc(DType::F32, &[n, k])?,
        b.alloc(DType::F32, &[m, n])?,
    );
    b.upload(&s, &x, &xs)?;
    b.upload(&s, &w, &ws)?;
    let gemm = || {
        timed(|| {
            b.launch(&s, Op::Gemm { x: x.clone(), w: w.clone(), y: y.clone() })?;
            b.synchronize(&s)
        })
    };

    // Chunked prefill, T 4096, 12 heads of 128.
    let (op, flops) =
        super::core::prefill_workload(&b, &s, &mut rng, (4096, 12, 128), DType::BF16)?;
    let chunk = || {
        timed(|| {
            b.launch(&s, op.clone())?;
            b.synchronize(&s)
        })
    };
    let p = Paired::run(rounds, chunk, gemm)?;
    let detail = format!(
        "chunk {:.1} GFLOP/s, gemm {:.1} GFLOP/s",
        flops / p.median_a().as_secs_f64() / 1e9,
        gemm_flops / p.median_b().as_secs_f64() / 1e9
    );
    let name = "chunked prefill FLOP rate / reference GEMM FLOP rate (T 4096, 12 heads of 128)";
    figures.push(
        p.figure(name, Target::AtLeast(0.7), detail, |tc, tg| (flops / tc) / (gemm_flops / tg)),
    );

    // DynamicQuant of 1024 x 7168 bf16 against a host memcpy of the same bytes.
    let (qm, qk) = (1024, 7168);
    let qx = super::random_tensor(&b, &s, &mut rng, DType::BF16, &[qm, qk])?;
    let data = b.alloc(DType::E4M3, &[qm, qk])?;
    let scale = b.alloc(DType::E8M0, &[qm, kda_core::mx::num_blocks(qk)])?;
    let bytes = qm * qk * DType::BF16.size_bytes();
    let quant = || {
        timed(|| {
            let op = Op::DynamicQuant {
                x: qx.clone(),
                data: data.clone(),
                scale: scale.clone(),
                alg: ScaleAlg::OcpFloor,
            };
            b.launch(&s, op)?;
            b.synchronize(&s)
        })
    };
    let source = vec![1u8; bytes];
    let mut target = vec![0u8; bytes];
    let memcpy = || {
        timed(|| {
            target.copy_from_slice(std::hint::black_box(&source));
            std::hint::black_box(&mut target);
            Ok::<(), CliError>(())
        })
    };
    let p = Paired::run(rounds * 4, quant, memcpy)?;
    let gbs = |t: Duration| bytes as f64 / t.as_secs_f64() / 1e9;
    let detail = format!(
        "dynamic_quant {:.2} GB/s of input, memcpy {:.2} GB/s",
        gbs(p.median_a()),
        gbs(p.median_b())
    );
    let name = "DynamicQuant GB/s / host memcpy GB/s (1024 x 7168 bf16)";
    figures.push(p.figure(name, Target::AtLeast(0.8), detail, |tq, tm| tm / tq));

    // The f32 GEMM against OpenBLAS, one thread each.
    match OpenBlas::load() {
        Some(blas) => {
            let mut yb = vec![0.0f32; m * n];
            let sgemm = || {
                timed(|| {
                    blas.sgemm_nt((m, n, k), &xs, &ws, &mut yb).ok_or(CliError::Argument {
                        arg: "sgemm",
                        reason: "OpenBLAS rejected the shape".into(),
                    })
                })
            };
            let p = Paired::run(rounds, gemm, sgemm)?;
            let detail = format!(
                "reference {:.1} GFLOP/s, OpenBLAS {:.1} GFLOP/s",
                gemm_flops / p.median_a().as_secs_f64() / 1e9,
                gemm_flops / p.median_b().as_secs_f64() / 1e9
            );
            let name = "f32 GEMM / OpenBLAS sgemm, one thread, M 256 N 3084 K 7168";
            figures.push(p.figure(name, Target::AtLeast(1.0), detail, |tr, tb| tb / tr));
        }
        None => eprintln!(
            "OpenBLAS (libopenblas.so.0) not found: the f32 GEMM figure is skipped \
             (`apt-get install libopenblas0` adds it)"
        ),
    }
    Ok(figures)
}

/// The figures as an aligned table.
pub fn print(figures: &[Figure]) {
    let width = figures.iter().map(|f| f.name.len()).max().unwrap_or(0);
    println!(
        "{:width$}  {:>7}  {:>15}  {:>7}  {:>4}",
        "figure", "ratio", "rounds min-max", "target", "met"
    );
    for f in figures {
        println!(
            "{:width$}  {:>7.3}  {:>3} {:>5.2}-{:<5.2}  {:>7}  {:>4}",
            f.name,
            f.ratio,
            f.rounds,
            f.range.0,
            f.range.1,
            f.target.text(),
            if f.target.met(f.ratio) { "yes" } else { "no" },
        );
        println!("{:width$}  ({})", "", f.detail);
    }
}
