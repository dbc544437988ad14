//! The planner calibrated on recorded host measurements (docs/design/planner.md#calibration).
//!
//! `data/plan_host_prefill.json` and `data/plan_host_decode.json` were each written once by
//! `kda plan --calibrate --shape prefill|decode --tokens 16,128,1024 --rounds 7 --record …`
//! (run at `nice -n -10`) on the 2-vCPU development VM with nothing else running: the whole
//! Kimi K3 TP8 rank-0 layer in the six configurations, each op's median time, each round's wall
//! time and the host's cache sizes as the recorder read them. Nothing here measures anything:
//! the assertions are on those numbers. Each recording is held to the same checks, in a module
//! of its own, except the per-op one, which decode does not pass: one op kind there runs two
//! kernels across the recorded rows (docs/design/planner.md#calibration).
#![allow(clippy::expect_used, reason = "test setup")]

use kda_model::plan::{self, ChipFigures, RecordedRun, Recording};

/// One chunked prefill of T tokens.
mod prefill {
    const RECORDED: &str = include_str!("data/plan_host_prefill.json");
    /// The whole layer, not only its projections.
    const KINDS: [&str; 5] = ["qkv_matmul", "causal_conv", "kda_chunk", "gated_rms_norm", "o_proj"];

    #[test]
    fn the_recording_covers_six_configurations_at_three_token_counts() {
        super::covers_six_configurations_at_three_token_counts(&super::parse(RECORDED), &KINDS);
    }

    #[test]
    fn calibrated_model_predicts_each_recorded_op_within_25_percent() {
        super::predicts_each_recorded_op_within_25_percent(&super::parse(RECORDED));
    }

    #[test]
    fn calibrated_model_predicts_each_configuration_within_25_percent() {
        super::predicts_each_configuration_within_25_percent(&super::parse(RECORDED));
    }

    #[test]
    fn calibrated_model_ranks_the_configurations_as_measured() {
        super::ranks_the_configurations_as_measured(&super::parse(RECORDED));
    }

    #[test]
    fn calibration_carries_to_a_token_count_it_was_not_fitted_on() {
        super::carries_to_a_token_count_it_was_not_fitted_on(&super::parse(RECORDED));
    }
}

/// T single-token requests, one recurrent step each.
mod decode {
    const RECORDED: &str = include_str!("data/plan_host_decode.json");
    /// The whole decode step: the conv-state update and the recurrent KDA replace the prefill's
    /// conv and chunk kernel.
    const KINDS: [&str; 6] = [
        "qkv_matmul",
        "causal_conv_update",
        "kda_gate",
        "kda_recurrent",
        "gated_rms_norm",
        "o_proj",
    ];

    #[test]
    fn the_recording_covers_six_configurations_at_three_token_counts() {
        super::covers_six_configurations_at_three_token_counts(&super::parse(RECORDED), &KINDS);
    }

    #[test]
    fn calibrated_model_predicts_each_configuration_within_25_percent() {
        super::predicts_each_configuration_within_25_percent(&super::parse(RECORDED));
    }

    #[test]
    fn calibrated_model_ranks_the_configurations_as_measured() {
        super::ranks_the_configurations_as_measured(&super::parse(RECORDED));
    }

    #[test]
    fn calibration_carries_to_a_token_count_it_was_not_fitted_on() {
        super::carries_to_a_token_count_it_was_not_fitted_on(&super::parse(RECORDED));
    }
}

fn parse(recorded: &str) -> Recording {
    serde_json::from_str(recorded).expect("the checked-in recording parses")
}

/// The host's roofline figures do not matter once every recorded kind is calibrated; they are
/// set absurdly low so that a kind the calibration missed would show as a gross error.
fn calibrated(runs: &[&RecordedRun], rec: &Recording) -> ChipFigures {
    plan::calibrate(ChipFigures::host(1.0, 1.0, 1.0, rec.launch_s), runs, rec.caches)
        .expect("recorded times are positive")
}

fn predicted(figures: &ChipFigures, run: &RecordedRun) -> plan::Simulation {
    let (entries, works) = run.log();
    plan::predict_with(&entries, &works, figures).expect("the recorded log simulates")
}

/// An op whose measured time is below this share of its forward's is timer noise (a 4-byte
/// upload takes 1–5 µs in a forward of 50 ms and more); it still counts in the makespan.
const SIGNIFICANT: f64 = 0.005;

fn covers_six_configurations_at_three_token_counts(rec: &Recording, kinds: &[&str]) {
    let mut tokens: Vec<usize> = rec.runs.iter().map(|r| r.tokens).collect();
    tokens.sort_unstable();
    tokens.dedup();
    assert_eq!(tokens, [16, 128, 1024]);
    assert_eq!(rec.runs.len(), 18);
    for run in &rec.runs {
        let ran: Vec<String> = run.samples().into_iter().map(|s| s.kind).collect();
        for kind in kinds {
            assert!(ran.iter().any(|k| k == kind), "{} at T={}: no {kind}", run.config, run.tokens);
        }
    }
}

/// Each distinct op (kind and work) of the single-stream (serial) runs, its measured time the
/// mean of its medians over the runs that ran it (the composed and staged serial runs share
/// every op but the BFG projection; on this VM the same `o_proj` measured 10.1 ms in one and
/// 6.2 ms in the other at T = 16, so one run's median alone is not the op's time). In an
/// overlapped run an op's wall time also holds the other stream's op sharing its core; those
/// runs are held to their makespans below.
fn predicts_each_recorded_op_within_25_percent(rec: &Recording) {
    let runs: Vec<&RecordedRun> = rec.runs.iter().collect();
    let figures = calibrated(&runs, rec);
    // (kind, flops, bytes, tokens) -> measured medians, and the forward's time.
    let mut ops: Vec<(plan::Sample, usize, Vec<f64>, f64)> = Vec::new();
    for run in rec.runs.iter().filter(|r| r.streams() == 1) {
        for sample in run.samples() {
            let same = ops.iter_mut().find(|(s, t, _, _)| {
                *t == run.tokens && s.kind == sample.kind && s.work == sample.work
            });
            match same {
                Some((_, _, times, _)) => times.push(sample.seconds),
                None => {
                    let seconds = sample.seconds;
                    ops.push((sample, run.tokens, vec![seconds], run.measured_s()));
                }
            }
        }
    }
    let (mut checked, mut misses) = (0, Vec::new());
    for (sample, tokens, times, forward) in &ops {
        let measured = times.iter().sum::<f64>() / times.len() as f64;
        if measured < SIGNIFICANT * forward {
            continue;
        }
        let p = figures.op_seconds(&sample.kind, plan::CostUnit::Vector, sample.work);
        let error = p / measured - 1.0;
        if error.abs() > 0.25 {
            misses.push(format!(
                "T={tokens}: {} predicted {:.3} ms, measured {:.3} ms ({:+.1} %) from {times:?}",
                sample.kind,
                p * 1e3,
                measured * 1e3,
                100.0 * error
            ));
        }
        checked += 1;
    }
    assert!(
        misses.is_empty(),
        "{} of {checked} ops off by more than 25 %:\n{}",
        misses.len(),
        misses.join("\n")
    );
    // The GEMMs, the conv, the chunk kernel and the norm at three token counts, at least.
    assert!(checked >= 18, "only {checked} significant ops");
}

fn predicts_each_configuration_within_25_percent(rec: &Recording) {
    let runs: Vec<&RecordedRun> = rec.runs.iter().collect();
    let figures = calibrated(&runs, rec);
    for run in &rec.runs {
        let (p, m) = (predicted(&figures, run).makespan, run.measured_s());
        assert!(
            (p / m - 1.0).abs() <= 0.25,
            "{} at T={}: predicted {:.2} ms, measured {:.2} ms",
            run.config,
            run.tokens,
            p * 1e3,
            m * 1e3
        );
    }
}

/// The `q` quantile (0..=1) of `values`, interpolated between the sorted values.
fn quantile(values: &[f64], q: f64) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let at = q * (v.len() - 1) as f64;
    let (lo, hi) = (at.floor() as usize, at.ceil() as usize);
    v[lo] + (at - lo as f64) * (v[hi] - v[lo])
}

/// Per T, every pair of configurations the measurement tells apart (the upper quartile of one's
/// rounds below the lower quartile of the other's) is ordered the same way by the prediction;
/// pairs whose interquartile ranges overlap are ties of the measurement, with no order to get
/// right.
fn ranks_the_configurations_as_measured(rec: &Recording) {
    let runs: Vec<&RecordedRun> = rec.runs.iter().collect();
    let figures = calibrated(&runs, rec);
    let (mut ordered, mut misses) = (0, Vec::new());
    for t in [16, 128, 1024] {
        let at: Vec<&RecordedRun> = rec.runs.iter().filter(|r| r.tokens == t).collect();
        let predictions: Vec<f64> = at.iter().map(|r| predicted(&figures, r).makespan).collect();
        for i in 0..at.len() {
            for j in 0..at.len() {
                if i == j || quantile(&at[i].rounds_s, 0.75) >= quantile(&at[j].rounds_s, 0.25) {
                    continue;
                }
                ordered += 1;
                if predictions[i] >= predictions[j] {
                    misses.push(format!(
                        "T={t}: measured {} faster than {}, predicted {:.2} ms against {:.2} ms",
                        at[i].config,
                        at[j].config,
                        predictions[i] * 1e3,
                        predictions[j] * 1e3
                    ));
                }
            }
        }
    }
    assert!(
        misses.is_empty(),
        "{} of {ordered} pairs misordered:\n{}",
        misses.len(),
        misses.join("\n")
    );
    // The measurement orders some pairs: the test is not vacuous.
    assert!(ordered >= 3, "only {ordered} distinguishable pairs");
}

/// Fitted on T = 16 and 1024 only, the model still predicts the T = 128 forwards.
fn carries_to_a_token_count_it_was_not_fitted_on(rec: &Recording) {
    let fit_on: Vec<&RecordedRun> = rec.runs.iter().filter(|r| r.tokens != 128).collect();
    let figures = calibrated(&fit_on, rec);
    for run in rec.runs.iter().filter(|r| r.tokens == 128) {
        let (p, m) = (predicted(&figures, run).makespan, run.measured_s());
        assert!(
            (p / m - 1.0).abs() <= 0.25,
            "{} at T=128 (held out): predicted {:.2} ms, measured {:.2} ms",
            run.config,
            p * 1e3,
            m * 1e3
        );
    }
}
