//! Recorded runs: a forward's op log with each op's work and measured time, and the measured
//! makespans, as `kda plan --calibrate --record` writes them (docs/design/planner.md#calibration).
//! The calibration test reads one checked into the repository, so it asserts on numbers
//! measured once, never on wall time taken at test time.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::calibrate::{CacheSizes, Sample};
use super::{CostUnit, OpWork};
use kda_core::resource::{EventId, InstanceId, StreamId};
use kda_core::sanitize::Entry;

/// One step of a recorded forward, in submission order. Streams and events are numbered in
/// order of first appearance.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "step", rename_all = "snake_case")]
pub enum Step {
    Launch {
        stream: u64,
        label: String,
        unit: CostUnit,
        flops: f64,
        bytes: f64,
        mx: bool,
        /// The median measured duration of the op, seconds.
        seconds: f64,
    },
    Record {
        stream: u64,
        event: u64,
    },
    Wait {
        stream: u64,
        event: u64,
    },
}

/// One configuration of the layer at one token count, measured.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RecordedRun {
    /// The configuration's name (`serial`, `staged F: overlapped, concurrent`, …).
    pub config: String,
    pub tokens: usize,
    /// The forward's wall time (launch to synchronize) in each measured round, seconds.
    pub rounds_s: Vec<f64>,
    pub steps: Vec<Step>,
}

/// A set of measured runs and how they were made.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Recording {
    /// What was measured, where, with which command.
    pub about: String,
    /// The measured host cost of one launch, seconds.
    pub launch_s: f64,
    /// The host's caches, as the OS reported them when it recorded ([`super::chips::host_caches`]).
    pub caches: CacheSizes,
    pub runs: Vec<RecordedRun>,
}

impl RecordedRun {
    /// A run from a checked-mode log, each entry's work (as [`super::extrapolate`] returns)
    /// and each entry's measured duration (`None` for non-launches).
    pub fn from_log(
        config: &str,
        tokens: usize,
        entries: &[Entry],
        works: &[OpWork],
        seconds: &[Option<f64>],
        rounds_s: Vec<f64>,
    ) -> Self {
        let mut streams: BTreeMap<StreamId, u64> = BTreeMap::new();
        let mut events: BTreeMap<EventId, u64> = BTreeMap::new();
        let mut number_stream = |s: StreamId| {
            let next = streams.len() as u64;
            *streams.entry(s).or_insert(next)
        };
        let mut number_event = |e: EventId| {
            let next = events.len() as u64;
            *events.entry(e).or_insert(next)
        };
        let steps = entries
            .iter()
            .enumerate()
            .filter_map(|(i, e)| match e {
                Entry::Launch { stream, label, unit, .. } => {
                    let work = works.get(i).copied().unwrap_or_default();
                    Some(Step::Launch {
                        stream: number_stream(*stream),
                        label: label.clone(),
                        unit: CostUnit::from(*unit),
                        flops: work.flops,
                        bytes: work.bytes,
                        mx: work.mx,
                        seconds: seconds.get(i).copied().flatten().unwrap_or(0.0),
                    })
                }
                Entry::Record { stream, event } => Some(Step::Record {
                    stream: number_stream(*stream),
                    event: number_event(*event),
                }),
                Entry::Wait { stream, event } => {
                    Some(Step::Wait { stream: number_stream(*stream), event: number_event(*event) })
                }
                _ => None,
            })
            .collect();
        RecordedRun { config: config.to_string(), tokens, rounds_s, steps }
    }

    /// The median of the measured rounds, seconds (0 without rounds).
    pub fn measured_s(&self) -> f64 {
        let mut r = self.rounds_s.clone();
        r.sort_by(f64::total_cmp);
        match r.len() {
            0 => 0.0,
            n if n % 2 == 1 => r[n / 2],
            n => 0.5 * (r[n / 2 - 1] + r[n / 2]),
        }
    }

    /// How many cross-stream waits it has.
    pub fn waits(&self) -> usize {
        self.steps.iter().filter(|s| matches!(s, Step::Wait { .. })).count()
    }

    /// How many streams ran its ops.
    pub fn streams(&self) -> usize {
        let mut streams: Vec<u64> = self
            .steps
            .iter()
            .filter_map(|s| match s {
                Step::Launch { stream, .. } => Some(*stream),
                _ => None,
            })
            .collect();
        streams.sort_unstable();
        streams.dedup();
        streams.len()
    }

    /// The run as a log to simulate, and each entry's work.
    pub fn log(&self) -> (Vec<Entry>, Vec<OpWork>) {
        let instance = InstanceId::fresh();
        let stream = |index| StreamId { instance, index };
        let event = |index| EventId { instance, index };
        self.steps
            .iter()
            .map(|s| match s {
                Step::Launch { stream: s, label, unit, flops, bytes, mx, .. } => (
                    Entry::Launch {
                        stream: stream(*s),
                        label: label.clone(),
                        reads: Vec::new(),
                        writes: Vec::new(),
                        unit: unit.compute_unit(),
                        flops: *flops as u64,
                    },
                    OpWork { flops: *flops, bytes: *bytes, mx: *mx },
                ),
                Step::Record { stream: s, event: e } => {
                    (Entry::Record { stream: stream(*s), event: event(*e) }, OpWork::default())
                }
                Step::Wait { stream: s, event: e } => {
                    (Entry::Wait { stream: stream(*s), event: event(*e) }, OpWork::default())
                }
            })
            .unzip()
    }

    /// Each launch's kind, work and measured time.
    pub fn samples(&self) -> Vec<Sample> {
        self.steps
            .iter()
            .filter_map(|s| match s {
                Step::Launch { label, flops, bytes, mx, seconds, .. } => Some(Sample {
                    kind: label.clone(),
                    work: OpWork { flops: *flops, bytes: *bytes, mx: *mx },
                    seconds: *seconds,
                }),
                _ => None,
            })
            .collect()
    }
}
