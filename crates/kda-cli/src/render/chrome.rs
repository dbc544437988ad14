//! A timeline in the Chrome trace-event format (`chrome://tracing`, Perfetto): a complete
//! (`X`) event per op on a thread per stream, and a flow arrow per cross-stream wait.

use serde_json::{Value, json};

use kda_core::StreamId;
use kda_core::timeline::Timeline;

/// The trace-event JSON object (`{"traceEvents": [...]}`); times in microseconds.
/// `lane_names` names threads as [`SvgOptions::lane_names`](super::SvgOptions) does.
pub fn chrome_trace(timeline: &Timeline, lane_names: &[(StreamId, String)]) -> Value {
    let streams = timeline.streams();
    let tid = |s: StreamId| streams.iter().position(|x| *x == s).unwrap_or(streams.len());
    let us = |d: std::time::Duration| d.as_secs_f64() * 1e6;
    let mut events = Vec::with_capacity(2 * streams.len() + timeline.spans.len());
    for s in &streams {
        let name = lane_names
            .iter()
            .find(|(id, _)| id == s)
            .map_or_else(|| s.to_string(), |(_, n)| format!("{n} ({s})"));
        events.push(json!({
            "ph": "M", "name": "thread_name", "pid": 1, "tid": tid(*s),
            "args": { "name": name },
        }));
    }
    for s in &timeline.spans {
        events.push(json!({
            "ph": "X", "cat": "op", "name": s.label, "pid": 1, "tid": tid(s.stream),
            "ts": us(s.start), "dur": us(s.duration()),
        }));
    }
    for (id, w) in timeline.waits.iter().enumerate() {
        events.push(json!({
            "ph": "s", "cat": "wait", "name": "wait", "id": id, "pid": 1,
            "tid": tid(w.upstream), "ts": us(w.satisfied),
        }));
        events.push(json!({
            "ph": "f", "bp": "e", "cat": "wait", "name": "wait", "id": id, "pid": 1,
            "tid": tid(w.stream), "ts": us(w.resumed),
        }));
    }
    json!({ "traceEvents": events, "displayTimeUnit": "ms" })
}
