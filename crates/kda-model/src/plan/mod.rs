//! The planner's cost model: a predicted time for each op of a recorded layer forward, and a
//! discrete-event simulation of the recorded streams, records and waits
//! (docs/design/planner.md#the-model).
//!
//! The input is the checked-mode log ([`Entry`]) that the sanitizer already records, with each
//! launch's FLOPs ([`OpDims::flops`](kda_core::op::OpDims::flops)), so nothing here needs a device. Each launch costs `launch_s` of host issue time, then runs for
//! `max(flops / matrix_flops, bytes / unit bandwidth)` on its unit; ops on one stream run in
//! order, a wait holds its stream until the event's last record completed, and when the chip's
//! matrix unit is shared ([`ChipFigures::shared_matrix_units`]) matrix ops of all streams take it
//! one at a time, in submission order.

pub mod calibrate;
pub mod chips;
pub mod recording;

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use kda_core::resource::{ComputeUnit, EventId, StreamId};
use kda_core::sanitize::Entry;
use kda_core::timeline::{Span, Timeline};

pub use calibrate::{CacheSizes, Calibration, KindCost, Sample};
pub use chips::{ChipFigures, Figure, Provenance};
pub use recording::{RecordedRun, Recording, Step};

/// The unit an op is costed on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CostUnit {
    Matrix,
    Vector,
    /// Ops without a compute unit (copies, fills, transfers): bound by copy bandwidth.
    Copy,
}

impl From<Option<ComputeUnit>> for CostUnit {
    fn from(unit: Option<ComputeUnit>) -> Self {
        match unit {
            Some(ComputeUnit::Matrix) => CostUnit::Matrix,
            Some(ComputeUnit::Vector) => CostUnit::Vector,
            None => CostUnit::Copy,
        }
    }
}

impl CostUnit {
    /// The compute unit a launch of this cost unit names (`None` for copies).
    pub fn compute_unit(self) -> Option<ComputeUnit> {
        match self {
            CostUnit::Matrix => Some(ComputeUnit::Matrix),
            CostUnit::Vector => Some(ComputeUnit::Vector),
            CostUnit::Copy => None,
        }
    }
}

/// The work of one op: floating-point operations and bytes moved.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct OpWork {
    pub flops: f64,
    pub bytes: f64,
    /// An MXFP8 GEMM (it reads an `a_scale`): costed at the chip's MXFP8 matrix rate.
    pub mx: bool,
}

/// Why a log cannot be simulated.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PlanError {
    /// A wait names an event that no earlier entry recorded.
    #[error("log entry #{index}: stream {stream} waits on event {event}, which was never recorded")]
    UnrecordedEvent { index: usize, stream: StreamId, event: EventId },
    /// Two logs recorded at different token counts do not run the same ops in the same order.
    #[error("the logs at {a} and {b} tokens differ at entry #{index}; they cannot be extrapolated")]
    Mismatch { a: usize, b: usize, index: usize },
    /// Extrapolation needs two different token counts.
    #[error("extrapolation needs two different token counts, got {0} twice")]
    SameTokens(usize),
    /// A plan without a recorded forward for the requested batch shape.
    #[error("the plan has no recorded forward for this batch shape")]
    NothingRecorded,
    /// A measured op time that cannot be fitted.
    #[error("a measured `{kind}` op took {seconds} s; expected a positive, finite time")]
    BadSample { kind: String, seconds: f64 },
    /// The host's cache sizes could not be read from the OS.
    #[error("the host's L{level} cache size: {reason}; expected a size in {path}")]
    NoCacheSize { level: u32, path: String, reason: String },
}

/// The bytes a launch reads and writes, from its recorded accesses.
pub fn accessed_bytes(entry: &Entry) -> f64 {
    let Entry::Launch { reads, writes, .. } = entry else { return 0.0 };
    reads
        .iter()
        .chain(writes)
        .flat_map(|a| a.bytes.intervals())
        .map(|r| (r.end - r.start) as f64)
        .sum()
}

/// The predicted run time of one op on `chip`, without its launch cost.
/// This is the roofline of the chip's figures; a calibrated chip
/// ([`ChipFigures::calibration`]) costs the kinds it measured by their fit instead
/// ([`ChipFigures::op_seconds`]).
pub fn op_time(chip: &ChipFigures, unit: CostUnit, work: OpWork) -> f64 {
    let bandwidth = match unit {
        CostUnit::Matrix | CostUnit::Vector => chip.vector_bytes_per_s.value,
        CostUnit::Copy => chip.copy_bytes_per_s.value,
    };
    let memory = work.bytes / bandwidth;
    let compute = match unit {
        CostUnit::Matrix if work.mx => work.flops / chip.mx_matrix_flops.value,
        CostUnit::Matrix => work.flops / chip.matrix_flops.value,
        CostUnit::Vector | CostUnit::Copy => 0.0,
    };
    memory.max(compute)
}

/// One simulated op: where and when it ran.
#[derive(Clone, Debug, PartialEq)]
pub struct SimOp {
    pub index: usize,
    pub label: String,
    pub stream: StreamId,
    pub unit: CostUnit,
    pub start: f64,
    pub end: f64,
}

/// A simulated forward: its ops and the time the last of them ended.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Simulation {
    pub ops: Vec<SimOp>,
    pub makespan: f64,
}

impl Simulation {
    /// Summed durations per unit (the serial cost of each op class).
    pub fn busy(&self, unit: CostUnit) -> f64 {
        self.ops.iter().filter(|o| o.unit == unit).map(|o| o.end - o.start).sum()
    }

    /// The predicted ops as a timeline (one span per op), to draw like a measured one.
    pub fn timeline(&self) -> Timeline {
        let at = |s: f64| Duration::from_secs_f64(s.max(0.0));
        Timeline::new(
            self.ops
                .iter()
                .map(|o| Span {
                    stream: o.stream,
                    label: o.label.clone(),
                    start: at(o.start),
                    end: at(o.end),
                })
                .collect(),
        )
    }
}

/// How the streams of a chip share it: which ops of different streams cannot run at the same
/// time, and what a cross-stream wait costs.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Sharing {
    /// Matrix ops of all streams take one matrix unit (Ascend's Cube).
    pub matrix: bool,
    /// Every op of every stream takes the one unit there is (a host whose second core is busy
    /// with other work: two streams measure no faster than one).
    pub all: bool,
    /// Seconds a wait on another stream's event adds to the waiting stream (waking its worker).
    pub wait_s: f64,
}

/// Simulates `entries` with each launch lasting `duration(index, entry)` seconds, `launch_s` of
/// host issue time per launch, and one matrix unit for all streams when `shared_matrix_units`.
pub fn simulate(
    entries: &[Entry],
    launch_s: f64,
    shared_matrix_units: bool,
    duration: impl FnMut(usize, &Entry) -> f64,
) -> Result<Simulation, PlanError> {
    let sharing = Sharing { matrix: shared_matrix_units, ..Sharing::default() };
    simulate_shared(entries, launch_s, sharing, duration)
}

/// [`simulate`] with any [`Sharing`] of the units between streams.
pub fn simulate_shared(
    entries: &[Entry],
    launch_s: f64,
    sharing: Sharing,
    mut duration: impl FnMut(usize, &Entry) -> f64,
) -> Result<Simulation, PlanError> {
    let mut host = 0.0_f64;
    let mut stream_ready: BTreeMap<StreamId, f64> = BTreeMap::new();
    let mut events: BTreeMap<EventId, f64> = BTreeMap::new();
    // When the shared unit (all ops: [0]; matrix ops: [1]) is next free.
    let mut unit_free = [0.0_f64; 2];
    let mut sim = Simulation::default();
    for (index, entry) in entries.iter().enumerate() {
        match entry {
            Entry::Launch { stream, label, unit, .. } => {
                host += launch_s;
                let unit = CostUnit::from(*unit);
                let ready = stream_ready.entry(*stream).or_insert(0.0);
                let mut start = ready.max(host);
                let shared = if sharing.all {
                    Some(0)
                } else if sharing.matrix && unit == CostUnit::Matrix {
                    Some(1)
                } else {
                    None
                };
                if let Some(u) = shared {
                    start = start.max(unit_free[u]);
                }
                let end = start + duration(index, entry).max(0.0);
                if let Some(u) = shared {
                    unit_free[u] = end;
                }
                *ready = end;
                sim.makespan = sim.makespan.max(end);
                sim.ops.push(SimOp {
                    index,
                    label: label.clone(),
                    stream: *stream,
                    unit,
                    start,
                    end,
                });
            }
            Entry::Record { stream, event } => {
                let at = stream_ready.get(stream).copied().unwrap_or(0.0).max(0.0);
                events.insert(*event, at);
            }
            Entry::Wait { stream, event } => {
                let Some(at) = events.get(event).copied() else {
                    return Err(PlanError::UnrecordedEvent {
                        index,
                        stream: *stream,
                        event: *event,
                    });
                };
                let ready = stream_ready.entry(*stream).or_insert(0.0);
                *ready = ready.max(at) + sharing.wait_s;
            }
            Entry::Synchronize { stream } => {
                host = host.max(stream_ready.get(stream).copied().unwrap_or(0.0));
            }
            Entry::Alloc { .. } | Entry::Free { .. } | Entry::Reuse { .. } => {}
        }
    }
    sim.makespan = sim.makespan.max(host);
    Ok(sim)
}

/// The work of one launch as recorded: its FLOPs and the bytes of its accesses.
pub fn work(entry: &Entry) -> OpWork {
    let (flops, mx) = match entry {
        Entry::Launch { flops, reads, .. } => {
            (*flops as f64, reads.iter().any(|a| a.param == "a_scale"))
        }
        _ => (0.0, false),
    };
    OpWork { flops, bytes: accessed_bytes(entry), mx }
}

/// Each launch's work at `tokens`, from two logs of the same forward recorded at `a.0` and `b.0`
/// tokens: a projection's FLOPs and bytes are affine in the token count (its weights are read
/// once, its activations grow with T), so two small recordings give every larger T exactly.
/// The result has one entry per entry of `a.1` (zero work for non-launches).
pub fn extrapolate(
    a: (usize, &[Entry]),
    b: (usize, &[Entry]),
    tokens: usize,
) -> Result<Vec<OpWork>, PlanError> {
    let ((ta, la), (tb, lb)) = (a, b);
    if ta == tb {
        return Err(PlanError::SameTokens(ta));
    }
    let mismatch = |index| PlanError::Mismatch { a: ta, b: tb, index };
    if la.len() != lb.len() {
        return Err(mismatch(la.len().min(lb.len())));
    }
    let scale = (tokens as f64 - ta as f64) / (tb as f64 - ta as f64);
    la.iter()
        .zip(lb)
        .enumerate()
        .map(|(index, (ea, eb))| match (ea, eb) {
            (
                Entry::Launch { label: x, unit: ux, stream: sx, .. },
                Entry::Launch { label: y, unit: uy, stream: sy, .. },
            ) if x == y && ux == uy && sx == sy => {
                let (wa, wb) = (work(ea), work(eb));
                let at = |va: f64, vb: f64| (va + scale * (vb - va)).max(0.0);
                Ok(OpWork {
                    flops: at(wa.flops, wb.flops),
                    bytes: at(wa.bytes, wb.bytes),
                    mx: wa.mx,
                })
            }
            (Entry::Launch { .. }, _) | (_, Entry::Launch { .. }) => Err(mismatch(index)),
            _ if std::mem::discriminant(ea) == std::mem::discriminant(eb) => Ok(OpWork::default()),
            _ => Err(mismatch(index)),
        })
        .collect()
}

/// Simulates `entries` on `chip` with each launch's work given by `works` (one per entry, as
/// [`extrapolate`] returns).
pub fn predict_with(
    entries: &[Entry],
    works: &[OpWork],
    chip: &ChipFigures,
) -> Result<Simulation, PlanError> {
    simulate_shared(entries, chip.launch_s.value, chip.sharing(), |i, e| {
        chip.entry_seconds(e, works.get(i).copied().unwrap_or_default())
    })
}

/// Predicts `entries` on `chip`: each launch's work is what the log recorded ([`work`]).
pub fn predict(entries: &[Entry], chip: &ChipFigures) -> Result<Simulation, PlanError> {
    simulate_shared(entries, chip.launch_s.value, chip.sharing(), |_, e| {
        chip.entry_seconds(e, work(e))
    })
}

/// Calibrates `base` (this host's measured figures) on recorded runs: each op kind's cost is
/// fitted on the ops of the single-stream runs (there an op's time is its own; in an
/// overlapped run the other stream's op may share its core). Then, for each value of whether
/// the streams share the units, the cost of a cross-stream wait is fitted to the multi-stream
/// runs' makespans (one least-squares coefficient on the relative error, at least 0), and the
/// pair that predicts every run's makespan best is kept.
pub fn calibrate(
    base: ChipFigures,
    runs: &[&RecordedRun],
    caches: CacheSizes,
) -> Result<ChipFigures, PlanError> {
    let single: Vec<&&RecordedRun> = runs.iter().filter(|r| r.streams() == 1).collect();
    let samples: Vec<Sample> = if single.is_empty() {
        runs.iter().flat_map(|r| r.samples()).collect()
    } else {
        single.iter().flat_map(|r| r.samples()).collect()
    };
    let calibrated = base.calibrated(Calibration::fit(&samples, caches)?);
    let logs: Vec<_> = runs.iter().map(|r| (r.log(), r.measured_s(), r.waits())).collect();
    let predict = |figures: &ChipFigures| -> Result<Vec<f64>, PlanError> {
        logs.iter()
            .map(|((entries, works), _, _)| Ok(predict_with(entries, works, figures)?.makespan))
            .collect()
    };
    let mut best: Option<(f64, ChipFigures)> = None;
    for shared in [false, true] {
        let mut figures = ChipFigures {
            shared_streams: Figure { value: shared, provenance: Provenance::Measured },
            wait_s: Figure { value: 0.0, provenance: Provenance::Measured },
            ..calibrated.clone()
        };
        // Each wait adds its cost to its stream; with the streams sharing the units (or on the
        // critical path) it adds to the makespan, so the fit is linear: p + n·w against m.
        let free = predict(&figures)?;
        let (mut num, mut den) = (0.0, 0.0);
        for ((_, m, n), p) in logs.iter().zip(&free) {
            let (m, n) = (m.max(f64::MIN_POSITIVE), *n as f64);
            num += n / m * (1.0 - p / m);
            den += (n / m).powi(2);
        }
        if den > 0.0 {
            figures.wait_s.value = (num / den).max(0.0);
        }
        let error: f64 = predict(&figures)?
            .iter()
            .zip(&logs)
            .map(|(p, (_, m, _))| (p / m.max(f64::MIN_POSITIVE) - 1.0).powi(2))
            .sum();
        if best.as_ref().is_none_or(|(e, _)| error < *e) {
            best = Some((error, figures));
        }
    }
    Ok(best.map(|(_, f)| f).unwrap_or(calibrated))
}

#[cfg(test)]
mod tests;
