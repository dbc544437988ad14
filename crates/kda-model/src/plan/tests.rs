use super::*;
use kda_core::resource::{BufferId, InstanceId};
use kda_core::sanitize::{Access, ByteRanges};

struct Log {
    instance: InstanceId,
    entries: Vec<Entry>,
    durations: Vec<f64>,
}

impl Log {
    fn new() -> Self {
        Log { instance: InstanceId::fresh(), entries: Vec::new(), durations: Vec::new() }
    }
    fn stream(&self, index: u64) -> StreamId {
        StreamId { instance: self.instance, index }
    }
    fn event(&self, index: u64) -> EventId {
        EventId { instance: self.instance, index }
    }
    fn launch(&mut self, stream: u64, label: &str, unit: ComputeUnit, seconds: f64) {
        self.entries.push(Entry::Launch {
            stream: self.stream(stream),
            label: label.to_string(),
            reads: Vec::new(),
            writes: Vec::new(),
            unit: Some(unit),
            flops: 0,
        });
        self.durations.push(seconds);
    }
    fn record(&mut self, stream: u64, event: u64) {
        self.entries.push(Entry::Record { stream: self.stream(stream), event: self.event(event) });
        self.durations.push(0.0);
    }
    fn wait(&mut self, stream: u64, event: u64) {
        self.entries.push(Entry::Wait { stream: self.stream(stream), event: self.event(event) });
        self.durations.push(0.0);
    }
    fn simulate(&self, shared: bool) -> Simulation {
        simulate(&self.entries, 0.0, shared, |i, _| self.durations[i]).unwrap()
    }
}

const QKV: f64 = 10.0;
const QKV_VEC: f64 = 3.0;
const BFG: f64 = 8.0;
const BFG_VEC: f64 = 2.0;

/// The serial schedule: both GEMMs and their vector work in order on one stream.
fn serial() -> Log {
    let mut log = Log::new();
    log.launch(0, "qkv gemm", ComputeUnit::Matrix, QKV);
    log.launch(0, "conv+norm", ComputeUnit::Vector, QKV_VEC);
    log.launch(0, "bfg gemm", ComputeUnit::Matrix, BFG);
    log.launch(0, "gate", ComputeUnit::Vector, BFG_VEC);
    log
}

/// The overlapped serialised schedule: the QKV vector work moves to the side stream, behind the
/// QKV GEMM's event, while the main stream runs the BFG GEMM; the main stream joins at the end.
fn overlapped_serialised() -> Log {
    let mut log = Log::new();
    log.launch(0, "qkv gemm", ComputeUnit::Matrix, QKV);
    log.record(0, 0);
    log.wait(1, 0);
    log.launch(1, "conv+norm", ComputeUnit::Vector, QKV_VEC);
    log.launch(0, "bfg gemm", ComputeUnit::Matrix, BFG);
    log.launch(0, "gate", ComputeUnit::Vector, BFG_VEC);
    log.record(1, 1);
    log.wait(0, 1);
    log
}

/// The overlapped concurrent schedule: after a fork, each stream runs its GEMM and its vector
/// work; the main stream joins the side stream at the end.
fn overlapped_concurrent() -> Log {
    let mut log = Log::new();
    log.record(0, 0);
    log.wait(1, 0);
    log.launch(1, "qkv gemm", ComputeUnit::Matrix, QKV);
    log.launch(1, "conv+norm", ComputeUnit::Vector, QKV_VEC);
    log.launch(0, "bfg gemm", ComputeUnit::Matrix, BFG);
    log.launch(0, "gate", ComputeUnit::Vector, BFG_VEC);
    log.record(1, 1);
    log.wait(0, 1);
    log
}

#[test]
fn serial_is_the_sum_of_its_ops() {
    let sim = serial().simulate(true);
    assert_eq!(sim.makespan, QKV + QKV_VEC + BFG + BFG_VEC);
    assert_eq!(sim.busy(CostUnit::Matrix), QKV + BFG);
    assert_eq!(sim.busy(CostUnit::Vector), QKV_VEC + BFG_VEC);
}

#[test]
fn overlapped_serialised_is_serial_minus_hidden_vector_work() {
    let serial = serial().simulate(true).makespan;
    let sim = overlapped_serialised().simulate(true);
    // The QKV vector work (3) runs under the BFG GEMM (8): all of it is hidden.
    assert_eq!(sim.makespan, serial - QKV_VEC);
    // The GEMMs never overlap on the shared matrix unit.
    let gemms: Vec<_> = sim.ops.iter().filter(|o| o.unit == CostUnit::Matrix).collect();
    assert!(gemms[0].end <= gemms[1].start);
}

#[test]
fn overlapped_serialised_hides_only_what_fits_under_the_gemm() {
    let mut log = Log::new();
    log.launch(0, "qkv gemm", ComputeUnit::Matrix, QKV);
    log.record(0, 0);
    log.wait(1, 0);
    log.launch(1, "long vector", ComputeUnit::Vector, 12.0);
    log.launch(0, "bfg gemm", ComputeUnit::Matrix, BFG);
    log.record(1, 1);
    log.wait(0, 1);
    // Serial would be 10 + 12 + 8 = 30; only 8 of the 12 hide under the BFG GEMM.
    assert_eq!(log.simulate(true).makespan, 30.0 - BFG);
}

#[test]
fn concurrent_is_the_max_of_the_two_critical_paths() {
    let sim = overlapped_concurrent().simulate(false);
    assert_eq!(sim.makespan, (QKV + QKV_VEC).max(BFG + BFG_VEC));
    // With a shared matrix unit the same log serialises the GEMMs instead.
    let shared = overlapped_concurrent().simulate(true).makespan;
    // (QKV GEMM 0–10, its vector work 10–13 under the BFG GEMM 10–18, the gate 18–20.)
    assert_eq!(shared, QKV + BFG + BFG_VEC);
}

#[test]
fn launch_cost_delays_issue() {
    let log = serial();
    let sim = simulate(&log.entries, 1.0, true, |_, _| 0.0).unwrap();
    assert_eq!(sim.makespan, 4.0);
}

#[test]
fn waiting_on_an_unrecorded_event_is_an_error() {
    let mut log = Log::new();
    log.wait(1, 7);
    let err = simulate(&log.entries, 0.0, true, |_, _| 0.0).unwrap_err();
    assert!(matches!(err, PlanError::UnrecordedEvent { index: 0, .. }));
}

#[test]
fn op_cost_is_the_slower_of_compute_and_memory() {
    let chip = ChipFigures::host(1e9, 0.5e9, 1e9, 0.0);
    let gemm = OpWork { flops: 2e9, bytes: 1e9, mx: false };
    assert_eq!(op_time(&chip, CostUnit::Matrix, gemm), 2.0);
    assert_eq!(op_time(&chip, CostUnit::Matrix, OpWork { mx: true, ..gemm }), 4.0);
    assert_eq!(op_time(&chip, CostUnit::Vector, gemm), 1.0);
    let skinny = OpWork { flops: 1e8, bytes: 3e9, mx: false };
    assert_eq!(op_time(&chip, CostUnit::Matrix, skinny), 3.0);
}

#[test]
fn predict_counts_recorded_bytes() {
    let instance = InstanceId::fresh();
    let stream = StreamId { instance, index: 0 };
    let buffer = BufferId { instance, index: 0 };
    let entries = vec![Entry::Launch {
        stream,
        label: "copy".into(),
        reads: vec![Access { param: "src", buffer, bytes: ByteRanges::span(0..100) }],
        writes: vec![Access { param: "dst", buffer, bytes: ByteRanges::span(100..200) }],
        unit: None,
        flops: 0,
    }];
    assert_eq!(work(&entries[0]), OpWork { flops: 0.0, bytes: 200.0, mx: false });
    let chip = ChipFigures::host(1e9, 1e9, 100.0, 0.0);
    let sim = predict(&entries, &chip).unwrap();
    assert_eq!(sim.makespan, 2.0);
}

#[test]
fn every_chip_says_where_each_figure_comes_from() {
    for chip in chips::Chip::ALL {
        let figures = chip.figures();
        assert_eq!(chips::Chip::parse(chip.name()), Some(chip));
        let rows = figures.rows();
        assert_eq!(rows.len(), 8);
        for (_, _, provenance) in rows {
            assert!(!provenance.to_string().is_empty());
        }
    }
}

fn gemm_log(instance: InstanceId, tokens: usize) -> Vec<Entry> {
    let stream = StreamId { instance, index: 0 };
    let (x, w, y) = (
        BufferId { instance, index: 0 },
        BufferId { instance, index: 1 },
        BufferId { instance, index: 2 },
    );
    let (hidden, width) = (64usize, 32usize);
    vec![
        Entry::Launch {
            stream,
            label: "gemm".into(),
            reads: vec![
                Access { param: "a", buffer: x, bytes: ByteRanges::span(0..tokens * hidden * 2) },
                Access { param: "b", buffer: w, bytes: ByteRanges::span(0..width * hidden * 2) },
            ],
            writes: vec![Access {
                param: "c",
                buffer: y,
                bytes: ByteRanges::span(0..tokens * width * 2),
            }],
            unit: Some(ComputeUnit::Matrix),
            flops: (2 * tokens * hidden * width) as u64,
        },
        Entry::Synchronize { stream },
    ]
}

#[test]
fn extrapolation_is_exact_for_affine_work() {
    let instance = InstanceId::fresh();
    let (one, two) = (gemm_log(instance, 1), gemm_log(instance, 2));
    let works = extrapolate((1, &one), (2, &two), 1024).unwrap();
    assert_eq!(works[0], work(&gemm_log(instance, 1024)[0]));
    assert_eq!(works[1], OpWork::default());
    assert_eq!(extrapolate((2, &two), (2, &two), 8), Err(PlanError::SameTokens(2)));
    assert!(matches!(
        extrapolate((1, &one), (2, &two[..1]), 8),
        Err(PlanError::Mismatch { index: 1, .. })
    ));
}

const CACHE: CacheSizes = CacheSizes { l2_bytes: 1e6, l3_bytes: 32e6 };

fn sample(kind: &str, flops: f64, bytes: f64, cost: KindCost) -> Sample {
    let work = OpWork { flops, bytes, mx: false };
    Sample { kind: kind.into(), work, seconds: cost.time(work, CACHE) }
}

#[test]
fn the_fit_recovers_each_kinds_costs() {
    let gemm = KindCost {
        overhead_s: 2e-4,
        s_per_byte: 1e-10,
        s_per_flop: 4e-11,
        s_per_spilled_byte: 0.0,
        s_per_l3_spilled_byte: 0.0,
    };
    let norm = KindCost {
        overhead_s: 5e-6,
        s_per_byte: 1e-10,
        s_per_flop: 0.0,
        s_per_spilled_byte: 5e-10,
        s_per_l3_spilled_byte: 0.0,
    };
    // A state update whose bytes outgrow both caches (the decode conv state).
    let state = KindCost {
        overhead_s: 1e-6,
        s_per_byte: 2e-10,
        s_per_flop: 0.0,
        s_per_spilled_byte: 3e-10,
        s_per_l3_spilled_byte: 1.5e-9,
    };
    let mut samples = Vec::new();
    // Shapes on both sides of the cache, so that no column is a combination of the others.
    for (m, n, k) in [
        (8.0, 256.0, 256.0),
        (64.0, 512.0, 256.0),
        (512.0, 1024.0, 512.0),
        (2048.0, 2048.0, 1024.0),
    ] {
        let bytes = 2.0 * (m * k + n * k) + 4.0 * m * n;
        samples.push(sample("gemm", 2.0 * m * n * k, bytes, gemm));
    }
    for t in [4.0, 16.0, 128.0, 1024.0] {
        samples.push(sample("norm", 0.0, 8.0 * 4096.0 * t, norm));
    }
    for requests in [2.0, 16.0, 128.0, 1024.0, 4096.0] {
        samples.push(sample("state", 0.0, 83e3 * requests, state));
    }
    let fit = Calibration::fit(&samples, CACHE).unwrap();
    for (kind, want) in [("gemm", gemm), ("norm", norm), ("state", state)] {
        let got = fit.kinds[kind];
        for (g, w) in [
            (got.overhead_s, want.overhead_s),
            (got.s_per_byte, want.s_per_byte),
            (got.s_per_flop, want.s_per_flop),
            (got.s_per_spilled_byte, want.s_per_spilled_byte),
            (got.s_per_l3_spilled_byte, want.s_per_l3_spilled_byte),
        ] {
            assert!((g - w).abs() <= 1e-6 * w.abs().max(1e-15), "{kind}: {got:?} != {want:?}");
        }
    }
    assert_eq!(fit.time("absent", OpWork::default()), None);
}

#[test]
fn the_fit_keeps_every_cost_non_negative() {
    // Times that fall with the work would need a negative rate: the fit takes a per-call cost.
    let samples: Vec<Sample> = [(1e6, 3e-3), (2e6, 2e-3), (4e6, 1e-3)]
        .into_iter()
        .map(|(bytes, seconds)| Sample {
            kind: "odd".into(),
            work: OpWork { flops: 0.0, bytes, mx: false },
            seconds,
        })
        .collect();
    let cost = Calibration::fit(&samples, CACHE).unwrap().kinds["odd"];
    assert!(cost.overhead_s > 0.0 && cost.s_per_byte == 0.0 && cost.s_per_flop == 0.0);
    let bad = [Sample { kind: "x".into(), work: OpWork::default(), seconds: 0.0 }];
    assert!(matches!(Calibration::fit(&bad, CACHE), Err(PlanError::BadSample { .. })));
}

#[test]
fn a_calibrated_kind_overrides_the_roofline_and_others_keep_it() {
    let mut kinds = std::collections::BTreeMap::new();
    kinds.insert("gemm".to_string(), KindCost { overhead_s: 1.0, ..KindCost::default() });
    let chip = ChipFigures::host(1e9, 1e9, 1e9, 0.0)
        .calibrated(Calibration { kinds, caches: CacheSizes::default() });
    let work = OpWork { flops: 2e9, bytes: 0.0, mx: false };
    assert_eq!(chip.op_seconds("gemm", CostUnit::Matrix, work), 1.0);
    assert_eq!(chip.op_seconds("other", CostUnit::Matrix, work), 2.0);
}

#[test]
fn a_recorded_run_simulates_like_its_log() {
    let log = overlapped_serialised();
    let works: Vec<OpWork> =
        log.durations.iter().map(|d| OpWork { flops: 0.0, bytes: *d, mx: false }).collect();
    let seconds: Vec<Option<f64>> = log.durations.iter().map(|d| Some(*d)).collect();
    let run = RecordedRun::from_log("x", 7, &log.entries, &works, &seconds, vec![3.0, 1.0, 2.0]);
    assert_eq!(run.measured_s(), 2.0);
    // One byte per second: the simulation of the run equals the hand-made log's.
    let chip = ChipFigures {
        shared_matrix_units: chips::Figure { value: true, provenance: Provenance::Measured },
        ..ChipFigures::host(1.0, 1.0, 1.0, 0.0)
    };
    let (entries, works) = run.log();
    let sim = predict_with(&entries, &works, &chip).unwrap();
    assert_eq!(sim.makespan, log.simulate(true).makespan);
    let json = serde_json::to_string(&run).unwrap();
    assert_eq!(serde_json::from_str::<RecordedRun>(&json).unwrap(), run);
}

#[test]
fn the_predicted_timeline_has_one_span_per_op() {
    let sim = overlapped_concurrent().simulate(false);
    let timeline = sim.timeline();
    assert_eq!(timeline.spans.len(), sim.ops.len());
    for (span, op) in timeline.spans.iter().zip(&sim.ops) {
        assert_eq!(span.label, op.label);
        assert_eq!(span.end.as_secs_f64(), op.end);
    }
    assert_eq!(timeline.makespan().as_secs_f64(), sim.makespan);
}
