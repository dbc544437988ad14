//! The planner's cost model: a predicted time for each op of a recorded layer forward, and a
//! discrete-event simulation of the recorded streams, records and waits
//! (docs/design/planner.md#the-model).
//!
//! The input is the checked-mode log ([`Entry`]) that the sanitizer already records, so nothing
//! here needs a device. Each launch costs `launch_s` of host issue time, then runs for
//! `max(flops / matrix_flops, bytes / unit bandwidth)` on its unit; ops on one stream run in
//! order, a wait holds its stream until the event's last record completed, and when the chip's
//! matrix unit is shared ([`ChipFigures::shared_matrix_units`]) matrix ops of all streams take it
//! one at a time, in submission order.

pub mod chips;

use std::collections::BTreeMap;

use crate::resource::{ComputeUnit, EventId, StreamId};
use crate::sanitize::Entry;

pub use chips::{ChipFigures, Figure, Provenance};

/// The unit an op is costed on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
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

/// The work of one op: floating-point operations and bytes moved.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct OpWork {
    pub flops: f64,
    pub bytes: f64,
}

/// Why a log cannot be simulated.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PlanError {
    /// A wait names an event that no earlier entry recorded.
    #[error("log entry #{index}: stream {stream} waits on event {event}, which was never recorded")]
    UnrecordedEvent { index: usize, stream: StreamId, event: EventId },
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
pub fn op_time(chip: &ChipFigures, unit: CostUnit, work: OpWork) -> f64 {
    let bandwidth = match unit {
        CostUnit::Matrix | CostUnit::Vector => chip.vector_bytes_per_s.value,
        CostUnit::Copy => chip.copy_bytes_per_s.value,
    };
    let memory = work.bytes / bandwidth;
    let compute = match unit {
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
}

/// Simulates `entries` with each launch lasting `duration(index, entry)` seconds, `launch_s` of
/// host issue time per launch, and one matrix unit for all streams when `shared_matrix_units`.
pub fn simulate(
    entries: &[Entry],
    launch_s: f64,
    shared_matrix_units: bool,
    mut duration: impl FnMut(usize, &Entry) -> f64,
) -> Result<Simulation, PlanError> {
    let mut host = 0.0_f64;
    let mut stream_ready: BTreeMap<StreamId, f64> = BTreeMap::new();
    let mut events: BTreeMap<EventId, f64> = BTreeMap::new();
    let mut matrix_free = 0.0_f64;
    let mut sim = Simulation::default();
    for (index, entry) in entries.iter().enumerate() {
        match entry {
            Entry::Launch { stream, label, unit, .. } => {
                host += launch_s;
                let unit = CostUnit::from(*unit);
                let ready = stream_ready.entry(*stream).or_insert(0.0);
                let mut start = ready.max(host);
                if shared_matrix_units && unit == CostUnit::Matrix {
                    start = start.max(matrix_free);
                }
                let end = start + duration(index, entry).max(0.0);
                if shared_matrix_units && unit == CostUnit::Matrix {
                    matrix_free = end;
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
                *ready = ready.max(at);
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

/// Predicts `entries` on `chip`: each launch's work is its recorded bytes and the FLOPs that
/// `flops(index, entry)` gives (the log holds no GEMM dims; the caller knows them).
pub fn predict(
    entries: &[Entry],
    chip: &ChipFigures,
    mut flops: impl FnMut(usize, &Entry) -> f64,
) -> Result<Simulation, PlanError> {
    simulate(entries, chip.launch_s.value, chip.shared_matrix_units.value, |i, e| {
        let unit = match e {
            Entry::Launch { unit, .. } => CostUnit::from(*unit),
            _ => CostUnit::Copy,
        };
        op_time(chip, unit, OpWork { flops: flops(i, e), bytes: accessed_bytes(e) })
    })
}

#[cfg(test)]
mod tests;
