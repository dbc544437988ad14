//! The happens-before analysis against a brute-force oracle: random logs over 2–4 streams with
//! random records, waits, host synchronizes and buffer ranges. The analysis must report exactly
//! the unordered conflicting pairs that reachability over the explicit happens-before graph
//! finds.

use std::collections::BTreeSet;

use kda_core::sanitize::{Access, ByteRanges, Entry, analyze};
use kda_core::{BufferId, EventId, InstanceId, StreamId};
use proptest::prelude::*;

const BUFFER_BYTES: usize = 64;

#[derive(Clone, Debug)]
enum Step {
    Launch { stream: u64, reads: Vec<(u64, usize, usize)>, writes: Vec<(u64, usize, usize)> },
    Record { stream: u64, event: u64 },
    Wait { stream: u64, event: u64 },
    Sync { stream: u64 },
}

fn access() -> impl Strategy<Value = (u64, usize, usize)> {
    (0u64..3, 0usize..BUFFER_BYTES - 1, 1usize..24)
}

fn step(streams: u64, events: u64) -> impl Strategy<Value = Step> {
    prop_oneof![
        5 => (0..streams, proptest::collection::vec(access(), 0..3), proptest::collection::vec(access(), 0..2))
            .prop_map(|(stream, reads, writes)| Step::Launch { stream, reads, writes }),
        3 => (0..streams, 0..events).prop_map(|(stream, event)| Step::Record { stream, event }),
        3 => (0..streams, 0..events).prop_map(|(stream, event)| Step::Wait { stream, event }),
        1 => (0..streams).prop_map(|stream| Step::Sync { stream }),
    ]
}

fn log_strategy() -> impl Strategy<Value = Vec<Step>> {
    (2u64..=4, 1u64..=4)
        .prop_flat_map(|(streams, events)| proptest::collection::vec(step(streams, events), 1..40))
}

fn to_log(steps: &[Step]) -> Vec<Entry> {
    let instance = InstanceId::fresh();
    let stream = |index| StreamId { instance, index };
    let event = |index| EventId { instance, index };
    let accesses = |list: &[(u64, usize, usize)], param| {
        list.iter()
            .map(|&(buffer, start, len)| Access {
                param,
                buffer: BufferId { instance, index: buffer },
                bytes: ByteRanges::span(start..(start + len).min(BUFFER_BYTES)),
            })
            .collect()
    };
    steps
        .iter()
        .enumerate()
        .map(|(i, s)| match s {
            Step::Launch { stream: s, reads, writes } => Entry::Launch {
                stream: stream(*s),
                label: format!("op{i}"),
                reads: accesses(reads, "in"),
                writes: accesses(writes, "out"),
                unit: None,
                flops: 0,
            },
            Step::Record { stream: s, event: e } => {
                Entry::Record { stream: stream(*s), event: event(*e) }
            }
            Step::Wait { stream: s, event: e } => {
                Entry::Wait { stream: stream(*s), event: event(*e) }
            }
            Step::Sync { stream: s } => Entry::Synchronize { stream: stream(*s) },
        })
        .collect()
}

/// Unordered conflicting pairs by explicit graph reachability.
fn oracle(steps: &[Step]) -> BTreeSet<(usize, usize)> {
    let n = steps.len();
    let mut edge = vec![vec![false; n]; n];
    let stream_of = |s: &Step| match s {
        Step::Launch { stream, .. }
        | Step::Record { stream, .. }
        | Step::Wait { stream, .. }
        | Step::Sync { stream } => *stream,
    };
    for j in 0..n {
        // Program order on the stream (a host synchronize joins the chain of its stream).
        if let Some(i) = (0..j).rev().find(|&i| stream_of(&steps[i]) == stream_of(&steps[j])) {
            edge[i][j] = true;
        }
        // A wait binds to the most recent record of its event.
        if let Step::Wait { event, .. } = steps[j]
            && let Some(i) = (0..j)
                .rev()
                .find(|&i| matches!(steps[i], Step::Record { event: e, .. } if e == event))
        {
            edge[i][j] = true;
        }
        // Everything the host issues after a synchronize comes after it.
        for i in 0..j {
            if matches!(steps[i], Step::Sync { .. }) {
                edge[i][j] = true;
            }
        }
    }
    // Reachability; edges only go forward, so successors' rows are complete first.
    let mut reach = vec![vec![false; n]; n];
    for i in (0..n).rev() {
        for j in i + 1..n {
            if edge[i][j] {
                reach[i][j] = true;
                let row = reach[j].clone();
                for (k, r) in row.into_iter().enumerate() {
                    reach[i][k] |= r;
                }
            }
        }
    }
    let overlaps = |a: &(u64, usize, usize), b: &(u64, usize, usize)| {
        let (ea, eb) = ((a.1 + a.2).min(BUFFER_BYTES), (b.1 + b.2).min(BUFFER_BYTES));
        a.0 == b.0 && a.1 < eb && b.1 < ea
    };
    let mut pairs = BTreeSet::new();
    for b in 0..n {
        let Step::Launch { stream: sb, reads: rb, writes: wb } = &steps[b] else { continue };
        for a in 0..b {
            let Step::Launch { stream: sa, reads: ra, writes: wa } = &steps[a] else { continue };
            if sa == sb || reach[a][b] {
                continue;
            }
            let conflict = wa.iter().any(|x| rb.iter().chain(wb).any(|y| overlaps(x, y)))
                || ra.iter().any(|x| wb.iter().any(|y| overlaps(x, y)));
            if conflict {
                pairs.insert((a, b));
            }
        }
    }
    pairs
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 4000, ..ProptestConfig::default() })]

    #[test]
    fn analysis_finds_exactly_the_unordered_conflicts(steps in log_strategy()) {
        let found: BTreeSet<(usize, usize)> =
            analyze(&to_log(&steps)).iter().map(|h| (h.first.op.index, h.second.op.index)).collect();
        prop_assert_eq!(found, oracle(&steps));
    }
}
