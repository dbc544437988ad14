//! Calibration: per-op-kind costs fitted to measured op times
//! (docs/design/planner.md#calibration).
//!
//! One rate per unit misses what the host measurements show: the reference's MXFP8 GEMM at the
//! layer's shapes runs at 21–29 GFLOP/s against 37 for a square bf16 GEMM, each kind of vector
//! kernel moves bytes at its own rate, and an op whose bytes fit in a core's cache moves them
//! faster than one that streams from memory (the short conv: 2.3 GB/s at 16 tokens, 1.1 GB/s
//! from 128), and again once they are past the shared last-level cache (the decode conv state:
//! 1.4 GB/s at 128 requests, 10 MB of state, 0.4 GB/s at 1024, 85 MB). So each op kind (its
//! label) gets its own cost, `overhead + bytes · s_per_byte + flops · s_per_flop`
//! `+ (bytes − L2)⁺ · s_per_spilled_byte + (bytes − L3)⁺ · s_per_l3_spilled_byte`, fitted with
//! non-negative coefficients by least squares on the *relative* error, so that a 50 µs gate
//! weighs as much as a 300 ms GEMM.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::{OpWork, PlanError};

/// The fitted cost of one op kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct KindCost {
    /// Fixed cost per call, seconds (dispatch, thread hand-off, small-tensor overheads).
    pub overhead_s: f64,
    /// Seconds per byte read or written.
    pub s_per_byte: f64,
    /// Seconds per floating-point operation.
    pub s_per_flop: f64,
    /// Extra seconds per byte beyond a core's cache ([`CacheSizes::l2_bytes`]).
    #[serde(default)]
    pub s_per_spilled_byte: f64,
    /// Extra seconds per byte beyond the last-level cache ([`CacheSizes::l3_bytes`]), on top of
    /// [`Self::s_per_spilled_byte`].
    #[serde(default)]
    pub s_per_l3_spilled_byte: f64,
}

/// The host's cache levels an op's bytes are measured against, bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct CacheSizes {
    /// The cache of one core (its L2).
    pub l2_bytes: f64,
    /// The last-level cache (L3), shared by the cores.
    pub l3_bytes: f64,
}

impl KindCost {
    /// The time of an op doing `work` on a host with `caches`.
    pub fn time(&self, work: OpWork, caches: CacheSizes) -> f64 {
        let [one, bytes, flops, spilled, l3_spilled] = features(work, caches);
        self.overhead_s * one
            + bytes * self.s_per_byte
            + flops * self.s_per_flop
            + spilled * self.s_per_spilled_byte
            + l3_spilled * self.s_per_l3_spilled_byte
    }
}

/// One measured op: its kind, its work and how long it took.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    pub kind: String,
    pub work: OpWork,
    pub seconds: f64,
}

/// Per-op-kind costs fitted to measurements.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Calibration {
    pub kinds: BTreeMap<String, KindCost>,
    /// The caches an op's bytes spill past.
    pub caches: CacheSizes,
}

impl Calibration {
    /// Fits each kind of `samples` on its own, on a host with `caches`. Every
    /// sample needs a positive, finite time; a kind whose work never varies gets a pure
    /// per-call cost.
    pub fn fit(samples: &[Sample], caches: CacheSizes) -> Result<Self, PlanError> {
        let mut by_kind: BTreeMap<&str, Vec<&Sample>> = BTreeMap::new();
        for s in samples {
            if !(s.seconds.is_finite() && s.seconds > 0.0) {
                return Err(PlanError::BadSample { kind: s.kind.clone(), seconds: s.seconds });
            }
            by_kind.entry(&s.kind).or_default().push(s);
        }
        let kinds =
            by_kind.into_iter().map(|(k, s)| (k.to_string(), fit_kind(&s, caches))).collect();
        Ok(Calibration { kinds, caches })
    }

    /// The fitted time of an op of `kind`, or `None` for a kind never measured.
    pub fn time(&self, kind: &str, work: OpWork) -> Option<f64> {
        self.kinds.get(kind).map(|c| c.time(work, self.caches))
    }
}

/// The columns a kind's cost can use: per call, per byte, per FLOP, per byte beyond L2, per
/// byte beyond L3.
const COLUMNS: usize = 5;

fn features(work: OpWork, caches: CacheSizes) -> [f64; COLUMNS] {
    [
        1.0,
        work.bytes,
        work.flops,
        (work.bytes - caches.l2_bytes).max(0.0),
        (work.bytes - caches.l3_bytes).max(0.0),
    ]
}

/// Non-negative weighted least squares over the 5 columns: every subset of the columns is
/// solved by its normal equations, and the feasible (all coefficients ≥ 0) solution with the
/// smallest relative squared error wins. 31 systems of 5×5 or smaller: exact, no iteration.
fn fit_kind(samples: &[&Sample], caches: CacheSizes) -> KindCost {
    let mut best: Option<(f64, [f64; COLUMNS])> = None;
    for mask in 1u32..(1 << COLUMNS) {
        let cols: Vec<usize> = (0..COLUMNS).filter(|c| mask & (1 << c) != 0).collect();
        let Some(coef) = solve_subset(samples, &cols, caches) else { continue };
        if coef.iter().any(|c| *c < 0.0 || !c.is_finite()) {
            continue;
        }
        let err = relative_sse(samples, &coef, caches);
        if best.is_none_or(|(e, _)| err < e) {
            best = Some((err, coef));
        }
    }
    // The per-call column alone always has a solution (the mean of 1/y over the mean of
    // 1/y²), so `best` is set whenever there is a sample.
    let [overhead_s, s_per_byte, s_per_flop, s_per_spilled_byte, s_per_l3_spilled_byte] =
        best.map(|(_, c)| c).unwrap_or_default();
    KindCost { overhead_s, s_per_byte, s_per_flop, s_per_spilled_byte, s_per_l3_spilled_byte }
}

fn relative_sse(samples: &[&Sample], coef: &[f64; COLUMNS], caches: CacheSizes) -> f64 {
    samples
        .iter()
        .map(|s| {
            let f = features(s.work, caches);
            let predicted: f64 = (0..COLUMNS).map(|c| coef[c] * f[c]).sum();
            ((predicted - s.seconds) / s.seconds).powi(2)
        })
        .sum()
}

/// Minimises Σ ((Σ_c coef_c · f_c) / y − 1)² over the columns `cols` (others zero); `None` when
/// the system is singular (a column that never varies independently of the others).
fn solve_subset(samples: &[&Sample], cols: &[usize], caches: CacheSizes) -> Option<[f64; COLUMNS]> {
    let n = cols.len();
    let mut a = [[0.0f64; COLUMNS + 1]; COLUMNS];
    for s in samples {
        let f = features(s.work, caches);
        let row: Vec<f64> = cols.iter().map(|&c| f[c] / s.seconds).collect();
        for i in 0..n {
            for j in 0..n {
                a[i][j] += row[i] * row[j];
            }
            a[i][n] += row[i];
        }
    }
    // Columns scaled to unit diagonal so bytes (1e8) and FLOPs (1e11) do not swamp the pivot test.
    let scale: Vec<f64> = (0..n).map(|i| a[i][i].sqrt()).collect();
    if scale.iter().any(|s| s.is_nan() || *s <= 0.0) {
        return None;
    }
    for i in 0..n {
        for j in 0..n {
            a[i][j] /= scale[i] * scale[j];
        }
        a[i][n] /= scale[i];
    }
    for p in 0..n {
        let pivot = (p..n).max_by(|&x, &y| a[x][p].abs().total_cmp(&a[y][p].abs()))?;
        if a[pivot][p].abs() < 1e-9 {
            return None;
        }
        a.swap(p, pivot);
        let pivot_row = a[p];
        for (r, row) in a.iter_mut().enumerate().take(n) {
            if r != p {
                let factor = row[p] / pivot_row[p];
                for (x, y) in row.iter_mut().zip(&pivot_row).take(n + 1).skip(p) {
                    *x -= factor * y;
                }
            }
        }
    }
    let mut coef = [0.0; COLUMNS];
    for (i, &c) in cols.iter().enumerate() {
        coef[c] = a[i][n] / a[i][i] / scale[i];
    }
    Some(coef)
}
