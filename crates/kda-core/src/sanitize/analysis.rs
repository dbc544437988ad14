//! Happens-before over a recorded log, with vector clocks, and the hazards it implies.
//!
//! Each stream `s` has a vector clock `C[s]`; `C[s][s]` counts the ops (and frees) queued on
//! `s`, and `C[s][t]` is how many of `t`'s ops are known to finish before whatever `s` runs next.
//! A record snapshots `C[s]` into the event; a wait joins the event's snapshot of its most
//! recent record into the waiting stream; a host synchronize joins `C[s]` into the host's clock,
//! which every later call joins in turn (the host issues it afterwards). Op `a` (the `i`-th on
//! stream `s`) happens before a later op `b` on stream `t` iff `C_b[s] >= i`.
//!
//! The verdict for a pair is final as soon as the later op is queued: nothing queued afterwards
//! can order an op before one already queued. So hazards are found online, at the call that
//! creates them.
//!
//! Optionally ([`ExclusiveUnits`], off by default) the same happens-before relation also judges
//! ops that need an execution unit the streams share: two matrix (or two vector) ops on
//! different streams that nothing orders are a [`HazardKind::MatrixOverlap`]
//! ([`HazardKind::VectorOverlap`]). Not a data race, but on such a backend the two would contend
//! for one unit, which a schedule that hides vector work under matrix work must not do.

use std::collections::HashMap;

use crate::resource::{BufferId, Capabilities, ComputeUnit, EventId, StreamId};
use crate::sanitize::hazard::{Hazard, HazardKind, HazardSide};
use crate::sanitize::log::{Access, Entry, OpRef};
use crate::sanitize::ranges::ByteRanges;

type Clock = Vec<u64>;

fn join(into: &mut Clock, other: &Clock) {
    if into.len() < other.len() {
        into.resize(other.len(), 0);
    }
    for (a, &b) in into.iter_mut().zip(other) {
        *a = (*a).max(b);
    }
}

/// Which execution units the streams of a backend share, so that unordered ops needing the
/// same one are reported (see the module docs). Both off by default.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct ExclusiveUnits {
    /// The matrix units are one resource: unordered GEMMs on two streams are a hazard.
    pub matrix: bool,
    /// The vector units are one resource: unordered vector ops on two streams are a hazard.
    pub vector: bool,
}

impl ExclusiveUnits {
    /// What a backend reports: its matrix units are exclusive when it says they are shared
    /// between streams ([`Capabilities::shared_matrix_units`]).
    pub fn from_capabilities(caps: &Capabilities) -> Self {
        Self { matrix: caps.shared_matrix_units, vector: false }
    }

    /// Whether ops on `unit` are checked.
    pub fn covers(self, unit: ComputeUnit) -> bool {
        match unit {
            ComputeUnit::Matrix => self.matrix,
            ComputeUnit::Vector => self.vector,
        }
    }
}

/// A past access still able to conflict with future ones.
#[derive(Clone, Debug)]
struct Past {
    side: HazardSide,
    stream: usize,
    /// The op's own component: it is the `pos`-th op on its stream.
    pos: u64,
    bytes: ByteRanges,
    free: bool,
}

/// The online analysis: feed it entries in host order, get the hazards each one creates.
#[derive(Debug, Default)]
pub struct Analyzer {
    streams: HashMap<StreamId, usize>,
    clocks: Vec<Clock>,
    host: Clock,
    events: HashMap<EventId, Clock>,
    /// Memory each buffer lives on: its own, or a freed buffer's it reuses.
    regions: HashMap<BufferId, BufferId>,
    sizes: HashMap<BufferId, usize>,
    freed: HashMap<BufferId, OpRef>,
    /// Per memory region, per stream: past accesses in stream order (so the ones a stream is
    /// ordered after are always a prefix).
    past: HashMap<BufferId, Vec<Vec<Past>>>,
    /// Per exclusive unit, per stream: past ops on it, in stream order.
    unit_past: HashMap<ComputeUnit, Vec<Vec<Past>>>,
    exclusive: ExclusiveUnits,
    entries: usize,
}

impl Analyzer {
    pub fn new() -> Self {
        Self::default()
    }

    /// An analyzer that also applies the exclusive-unit rules `units`.
    pub fn with_exclusive_units(units: ExclusiveUnits) -> Self {
        Self { exclusive: units, ..Self::default() }
    }

    /// Change the exclusive-unit rules for the entries analysed from now on.
    pub fn set_exclusive_units(&mut self, units: ExclusiveUnits) {
        self.exclusive = units;
    }

    pub fn exclusive_units(&self) -> ExclusiveUnits {
        self.exclusive
    }

    /// Entries seen so far.
    pub fn len(&self) -> usize {
        self.entries
    }

    pub fn is_empty(&self) -> bool {
        self.entries == 0
    }

    fn stream(&mut self, id: StreamId) -> usize {
        let next = self.streams.len();
        let s = *self.streams.entry(id).or_insert(next);
        if s == self.clocks.len() {
            self.clocks.push(Clock::new());
        }
        // The host issued this call after everything it has synchronised with.
        let host = self.host.clone();
        join(&mut self.clocks[s], &host);
        s
    }

    fn tick(&mut self, s: usize) -> u64 {
        let clock = &mut self.clocks[s];
        if clock.len() <= s {
            clock.resize(s + 1, 0);
        }
        clock[s] += 1;
        clock[s]
    }

    fn region(&self, buffer: BufferId) -> BufferId {
        self.regions.get(&buffer).copied().unwrap_or(buffer)
    }

    /// Analyse the next entry; returns the hazards it creates.
    pub fn push(&mut self, entry: &Entry) -> Vec<Hazard> {
        let index = self.entries;
        self.entries += 1;
        match entry {
            Entry::Launch { stream, label, reads, writes, unit, .. } => {
                let s = self.stream(*stream);
                let pos = self.tick(s);
                let op = OpRef { index, label: label.clone(), stream: *stream };
                let mut hazards = Vec::new();
                let accesses =
                    reads.iter().map(|a| (a, false)).chain(writes.iter().map(|a| (a, true)));
                let accesses: Vec<(&Access, bool)> = accesses.collect();
                for &(access, write) in &accesses {
                    let side = HazardSide {
                        op: op.clone(),
                        param: access.param,
                        buffer: access.buffer,
                        writes: write,
                    };
                    if let Some(free) = self.freed.get(&access.buffer) {
                        hazards.push(Hazard {
                            kind: HazardKind::UseAfterFree,
                            first: HazardSide {
                                op: free.clone(),
                                param: "free",
                                buffer: access.buffer,
                                writes: true,
                            },
                            second: side.clone(),
                            bytes: access.bytes.hull(),
                        });
                    }
                    self.check(&mut hazards, s, &side, &access.bytes, false);
                }
                for (access, write) in accesses {
                    let side = HazardSide {
                        op: op.clone(),
                        param: access.param,
                        buffer: access.buffer,
                        writes: write,
                    };
                    let region = self.region(access.buffer);
                    let past =
                        Past { side, stream: s, pos, bytes: access.bytes.clone(), free: false };
                    self.remember(region, past);
                }
                let named = writes.first().map(|a| (a, true)).or(reads.first().map(|a| (a, false)));
                if let (Some(unit), Some((access, writes))) = (*unit, named)
                    && self.exclusive.covers(unit)
                {
                    let side =
                        HazardSide { op, param: access.param, buffer: access.buffer, writes };
                    self.check_unit(&mut hazards, s, unit, &side);
                    let past =
                        Past { side, stream: s, pos, bytes: ByteRanges::default(), free: false };
                    let streams = self.unit_past.entry(unit).or_default();
                    if streams.len() <= s {
                        streams.resize_with(s + 1, Vec::new);
                    }
                    streams[s].push(past);
                }
                hazards
            }
            Entry::Record { stream, event } => {
                let s = self.stream(*stream);
                self.events.insert(*event, self.clocks[s].clone());
                Vec::new()
            }
            Entry::Wait { stream, event } => {
                let s = self.stream(*stream);
                if let Some(snapshot) = self.events.get(event).cloned() {
                    join(&mut self.clocks[s], &snapshot);
                }
                Vec::new()
            }
            Entry::Synchronize { stream } => {
                let s = self.stream(*stream);
                let clock = self.clocks[s].clone();
                join(&mut self.host, &clock);
                self.prune();
                Vec::new()
            }
            Entry::Alloc { buffer, bytes } => {
                self.sizes.insert(*buffer, *bytes);
                Vec::new()
            }
            Entry::Free { stream, buffer } => {
                let s = self.stream(*stream);
                let pos = self.tick(s);
                let op = OpRef { index, label: "free".into(), stream: *stream };
                let side =
                    HazardSide { op: op.clone(), param: "buffer", buffer: *buffer, writes: true };
                let region = self.region(*buffer);
                let len = self.sizes.get(&region).copied().unwrap_or(usize::MAX);
                let bytes = ByteRanges::span(0..len);
                let mut hazards = Vec::new();
                self.check(&mut hazards, s, &side, &bytes, true);
                self.remember(region, Past { side, stream: s, pos, bytes, free: true });
                self.freed.insert(*buffer, op);
                hazards
            }
            Entry::Reuse { buffer, previous } => {
                let region = self.region(*previous);
                self.regions.insert(*buffer, region);
                Vec::new()
            }
        }
    }

    fn remember(&mut self, region: BufferId, past: Past) {
        let streams = self.past.entry(region).or_default();
        if streams.len() <= past.stream {
            streams.resize_with(past.stream + 1, Vec::new);
        }
        streams[past.stream].push(past);
    }

    /// Compare one access with the past accesses to the same memory that it is not ordered
    /// after; hazards come out in log order.
    fn check(
        &self,
        out: &mut Vec<Hazard>,
        s: usize,
        side: &HazardSide,
        bytes: &ByteRanges,
        free: bool,
    ) {
        let region = self.region(side.buffer);
        let Some(streams) = self.past.get(&region) else { return };
        let clock = &self.clocks[s];
        let first_new = out.len();
        for (stream, past) in streams.iter().enumerate() {
            if stream == s {
                continue;
            }
            let known = clock.get(stream).copied().unwrap_or(0);
            let unordered = &past[past.partition_point(|p| p.pos <= known)..];
            for p in unordered {
                if !(p.side.writes || side.writes) {
                    continue;
                }
                let Some(overlap) = p.bytes.first_overlap(bytes) else { continue };
                let kind = if free {
                    HazardKind::FreeWhileInUse
                } else if p.free {
                    HazardKind::UseAfterFree
                } else {
                    match (p.side.writes, side.writes) {
                        (true, false) => HazardKind::ReadAfterWrite,
                        (false, true) => HazardKind::WriteAfterRead,
                        _ => HazardKind::WriteAfterWrite,
                    }
                };
                out.push(Hazard {
                    kind,
                    first: p.side.clone(),
                    second: side.clone(),
                    bytes: overlap,
                });
            }
        }
        out[first_new..].sort_by_key(|h| h.first.op.index);
    }

    /// Compare an op on an exclusive `unit` with the past ops on it that it is not ordered
    /// after.
    fn check_unit(&self, out: &mut Vec<Hazard>, s: usize, unit: ComputeUnit, side: &HazardSide) {
        let Some(streams) = self.unit_past.get(&unit) else { return };
        let kind = match unit {
            ComputeUnit::Matrix => HazardKind::MatrixOverlap,
            ComputeUnit::Vector => HazardKind::VectorOverlap,
        };
        let clock = &self.clocks[s];
        let first_new = out.len();
        for (stream, past) in streams.iter().enumerate() {
            if stream == s {
                continue;
            }
            let known = clock.get(stream).copied().unwrap_or(0);
            for p in &past[past.partition_point(|p| p.pos <= known)..] {
                out.push(Hazard { kind, first: p.side.clone(), second: side.clone(), bytes: 0..0 });
            }
        }
        out[first_new..].sort_by_key(|h| h.first.op.index);
    }

    /// Forget accesses every later call is ordered after (the host has synchronised past them).
    fn prune(&mut self) {
        let host = &self.host;
        for streams in self.past.values_mut().chain(self.unit_past.values_mut()) {
            for (stream, past) in streams.iter_mut().enumerate() {
                let known = host.get(stream).copied().unwrap_or(0);
                past.drain(..past.partition_point(|p| p.pos <= known));
            }
        }
    }
}

/// Analyse a whole log; returns every hazard, in the order the entries create them.
pub fn analyze(log: &[Entry]) -> Vec<Hazard> {
    analyze_with(log, ExclusiveUnits::default())
}

/// [`analyze`] with the exclusive-unit rules `units`.
pub fn analyze_with(log: &[Entry], units: ExclusiveUnits) -> Vec<Hazard> {
    let mut analyzer = Analyzer::with_exclusive_units(units);
    log.iter().flat_map(|e| analyzer.push(e)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resource::InstanceId;

    struct Ids(InstanceId);

    impl Ids {
        fn s(&self, index: u64) -> StreamId {
            StreamId { instance: self.0, index }
        }
        fn e(&self, index: u64) -> EventId {
            EventId { instance: self.0, index }
        }
        fn b(&self, index: u64) -> BufferId {
            BufferId { instance: self.0, index }
        }
        fn op(&self, stream: u64, label: &str, reads: &[u64], writes: &[u64]) -> Entry {
            let access = |list: &[u64], param| {
                list.iter()
                    .map(|&b| Access { param, buffer: self.b(b), bytes: ByteRanges::span(0..16) })
                    .collect()
            };
            Entry::Launch {
                stream: self.s(stream),
                label: label.into(),
                reads: access(reads, "in"),
                writes: access(writes, "out"),
                unit: None,
                flops: 0,
            }
        }
        fn unit_op(&self, stream: u64, label: &str, unit: ComputeUnit, writes: u64) -> Entry {
            match self.op(stream, label, &[], &[writes]) {
                Entry::Launch { stream, label, reads, writes, flops, .. } => {
                    Entry::Launch { stream, label, reads, writes, unit: Some(unit), flops }
                }
                other => other,
            }
        }
    }

    fn kinds(log: &[Entry]) -> Vec<(HazardKind, String, String)> {
        analyze(log).into_iter().map(|h| (h.kind, h.first.op.label, h.second.op.label)).collect()
    }

    #[test]
    fn reuse_on_another_stream_without_ordering_is_a_hazard() {
        let ids = Ids(InstanceId::fresh());
        let base = vec![
            Entry::Alloc { buffer: ids.b(0), bytes: 16 },
            ids.op(0, "produce", &[], &[0]),
            Entry::Free { stream: ids.s(0), buffer: ids.b(0) },
            Entry::Reuse { buffer: ids.b(1), previous: ids.b(0) },
        ];
        // The new owner writes the recycled memory on stream 1, unordered with the free.
        let mut racy = base.clone();
        racy.push(ids.op(1, "new_owner", &[], &[1]));
        assert_eq!(
            kinds(&racy),
            vec![
                (HazardKind::WriteAfterWrite, "produce".into(), "new_owner".into()),
                (HazardKind::UseAfterFree, "free".into(), "new_owner".into()),
            ]
        );
        // Ordered after the free through an event, the reuse is clean.
        let mut ordered = base;
        ordered.push(Entry::Record { stream: ids.s(0), event: ids.e(0) });
        ordered.push(Entry::Wait { stream: ids.s(1), event: ids.e(0) });
        ordered.push(ids.op(1, "new_owner", &[], &[1]));
        assert!(kinds(&ordered).is_empty());
    }

    #[test]
    fn free_and_use_after_free() {
        let ids = Ids(InstanceId::fresh());
        let log = vec![
            Entry::Alloc { buffer: ids.b(0), bytes: 16 },
            ids.op(0, "fill", &[], &[0]),
            Entry::Record { stream: ids.s(0), event: ids.e(0) },
            Entry::Wait { stream: ids.s(1), event: ids.e(0) },
            ids.op(1, "consume", &[0], &[]),
            // Freed on stream 0 without waiting for the consumer on stream 1.
            Entry::Free { stream: ids.s(0), buffer: ids.b(0) },
            // Used again on the freeing stream: ordered after the free, still a use after free.
            ids.op(0, "late", &[0], &[]),
        ];
        assert_eq!(
            kinds(&log),
            vec![
                (HazardKind::FreeWhileInUse, "consume".into(), "free".into()),
                (HazardKind::UseAfterFree, "free".into(), "late".into()),
            ]
        );
    }

    #[test]
    fn host_synchronize_orders_later_work_and_prunes() {
        let ids = Ids(InstanceId::fresh());
        let mut log = vec![ids.op(0, "write", &[], &[0]), Entry::Synchronize { stream: ids.s(0) }];
        log.push(ids.op(1, "read", &[0], &[]));
        assert!(kinds(&log).is_empty());
        let mut analyzer = Analyzer::new();
        for e in &log {
            analyzer.push(e);
        }
        let left: Vec<&str> =
            analyzer.past.values().flatten().flatten().map(|p| p.side.op.label.as_str()).collect();
        assert_eq!(left, vec!["read"]);
    }
    /// The projection schedule's shape: a GEMM on each of two streams, a vector op on each.
    fn two_stream_units(ids: &Ids, join: bool) -> Vec<Entry> {
        let mut log = vec![
            ids.unit_op(1, "project_bfg", ComputeUnit::Matrix, 0),
            Entry::Record { stream: ids.s(1), event: ids.e(0) },
            ids.unit_op(0, "dynamic_quant", ComputeUnit::Vector, 1),
        ];
        if join {
            log.push(Entry::Wait { stream: ids.s(0), event: ids.e(0) });
        }
        log.push(ids.unit_op(0, "qkv_matmul", ComputeUnit::Matrix, 2));
        log
    }

    #[test]
    fn unordered_matrix_ops_are_a_hazard_only_when_the_units_are_exclusive() {
        let ids = Ids(InstanceId::fresh());
        let unjoined = two_stream_units(&ids, false);
        assert!(analyze(&unjoined).is_empty(), "off by default");
        let matrix = ExclusiveUnits { matrix: true, vector: false };
        let found = analyze_with(&unjoined, matrix);
        assert_eq!(found.len(), 1, "{found:?}");
        let h = &found[0];
        assert_eq!(h.kind, HazardKind::MatrixOverlap);
        assert_eq!(
            (h.first.op.label.as_str(), h.second.op.label.as_str()),
            ("project_bfg", "qkv_matmul")
        );
        assert_eq!((h.first.op.stream, h.second.op.stream), (ids.s(1), ids.s(0)));
        assert_eq!((h.first.param, h.first.buffer, h.bytes.clone()), ("out", ids.b(0), 0..0));
        let text = h.to_string();
        for needle in ["matrix units shared", "project_bfg", "qkv_matmul"] {
            assert!(text.contains(needle), "{needle:?} missing from: {text}");
        }
        // Vector work overlapping matrix work is the point of the schedule: never reported.
        let all = ExclusiveUnits { matrix: true, vector: true };
        assert!(analyze_with(&two_stream_units(&ids, true), all).is_empty());
    }

    #[test]
    fn unordered_vector_ops_are_a_hazard_when_the_vector_units_are_exclusive() {
        let ids = Ids(InstanceId::fresh());
        let mut log = two_stream_units(&ids, true);
        log.push(ids.unit_op(1, "postprocess_bfg", ComputeUnit::Vector, 3));
        let vector = ExclusiveUnits { matrix: false, vector: true };
        let found: Vec<_> =
            analyze_with(&log, vector).into_iter().map(|h| (h.kind, h.first.op.label)).collect();
        assert_eq!(found, vec![(HazardKind::VectorOverlap, "dynamic_quant".to_string())]);
        // Ordered after the quant by an event: clean. A host synchronize orders it too.
        let mut ordered = two_stream_units(&ids, true);
        ordered.push(Entry::Record { stream: ids.s(0), event: ids.e(1) });
        ordered.push(Entry::Wait { stream: ids.s(1), event: ids.e(1) });
        ordered.push(ids.unit_op(1, "postprocess_bfg", ComputeUnit::Vector, 3));
        assert!(analyze_with(&ordered, vector).is_empty());
        let mut synced = two_stream_units(&ids, true);
        synced.push(Entry::Synchronize { stream: ids.s(0) });
        synced.push(ids.unit_op(1, "postprocess_bfg", ComputeUnit::Vector, 3));
        assert!(analyze_with(&synced, vector).is_empty());
    }

    #[test]
    fn exclusive_units_follow_the_capabilities() {
        let caps = |shared| Capabilities {
            concurrent_streams: true,
            shared_matrix_units: shared,
            bf16_core: false,
            device_faults_are_fatal: false,
            execution: String::new(),
            threads: 1,
            gemm_inputs: Vec::new(),
            native: crate::resource::NativeOps::default(),
        };
        assert_eq!(ExclusiveUnits::from_capabilities(&caps(false)), ExclusiveUnits::default());
        assert!(ExclusiveUnits::from_capabilities(&caps(true)).covers(ComputeUnit::Matrix));
        assert!(!ExclusiveUnits::from_capabilities(&caps(true)).covers(ComputeUnit::Vector));
    }
}
