//! Timelines: when each op ran, on which stream, under which label. A backend that can time its
//! ops (the reference backend with `ReferenceOptions::timeline`) hands one out; benchmarks
//! measure overlap from it, and `kda trace` draws it ([`Timeline::to_svg`],
//! [`Timeline::to_chrome_trace`]).
//!
//! Times are offsets from an epoch of the backend's choosing (its creation, say), so spans of
//! different streams compare directly.

mod chrome;
mod svg;

use std::time::Duration;

pub use svg::SvgOptions;
pub(crate) use svg::{PALETTE, escape, human};

use crate::resource::StreamId;

/// One op's execution: its stream, label, and start and end since the backend's epoch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Span {
    pub stream: StreamId,
    pub label: String,
    pub start: Duration,
    pub end: Duration,
}

impl Span {
    pub fn duration(&self) -> Duration {
        self.end.saturating_sub(self.start)
    }
}

/// A cross-stream wait that was satisfied: `stream` went on at `resumed` because `upstream`
/// had finished, at `satisfied`, the work the waited-on event recorded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WaitEdge {
    pub upstream: StreamId,
    pub satisfied: Duration,
    pub stream: StreamId,
    pub resumed: Duration,
}

/// Executed ops in the order they finished (per stream: in stream order), and the cross-stream
/// waits between them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Timeline {
    pub spans: Vec<Span>,
    pub waits: Vec<WaitEdge>,
}

impl Timeline {
    pub fn new(spans: Vec<Span>) -> Self {
        Self { spans, waits: Vec::new() }
    }

    pub fn with_waits(spans: Vec<Span>, waits: Vec<WaitEdge>) -> Self {
        Self { spans, waits }
    }

    /// The streams that ran an op, in order of first appearance.
    pub fn streams(&self) -> Vec<StreamId> {
        let mut streams = Vec::new();
        for s in &self.spans {
            if !streams.contains(&s.stream) {
                streams.push(s.stream);
            }
        }
        streams
    }

    pub fn is_empty(&self) -> bool {
        self.spans.is_empty()
    }

    /// The spans whose label `keep` accepts.
    pub fn filter(&self, keep: impl Fn(&Span) -> bool) -> Self {
        let spans = self.spans.iter().filter(|s| keep(s)).cloned().collect();
        Self { spans, waits: self.waits.clone() }
    }

    /// Total time of the spans `of` accepts (overlaps counted once per span).
    pub fn total(&self, of: impl Fn(&Span) -> bool) -> Duration {
        self.spans.iter().filter(|s| of(s)).map(Span::duration).sum()
    }

    /// From the first start to the last end (zero when empty).
    pub fn makespan(&self) -> Duration {
        let start = self.spans.iter().map(|s| s.start).min();
        let end = self.spans.iter().map(|s| s.end).max();
        match (start, end) {
            (Some(start), Some(end)) => end.saturating_sub(start),
            _ => Duration::ZERO,
        }
    }

    /// How much of the time of the spans `hidden` accepts passed while a span `under` accepts
    /// ran on **another** stream: the overlapped time over the total time of `hidden`, in
    /// `[0, 1]`; `None` when `hidden` matches nothing (or only instantaneous spans).
    pub fn hidden_fraction(
        &self,
        hidden: impl Fn(&Span) -> bool,
        under: impl Fn(&Span) -> bool,
    ) -> Option<f64> {
        let mut total = Duration::ZERO;
        let mut covered = Duration::ZERO;
        for h in self.spans.iter().filter(|s| hidden(s)) {
            total += h.duration();
            let others: Vec<(Duration, Duration)> = self
                .spans
                .iter()
                .filter(|u| u.stream != h.stream && under(u))
                .map(|u| (u.start.max(h.start), u.end.min(h.end)))
                .filter(|(a, b)| a < b)
                .collect();
            covered += union_length(others);
        }
        (!total.is_zero()).then(|| covered.as_secs_f64() / total.as_secs_f64())
    }
}

/// The length of the union of intervals.
fn union_length(mut intervals: Vec<(Duration, Duration)>) -> Duration {
    intervals.sort();
    let mut length = Duration::ZERO;
    let mut current: Option<(Duration, Duration)> = None;
    for (a, b) in intervals {
        current = match current {
            Some((s, e)) if a <= e => Some((s, e.max(b))),
            Some((s, e)) => {
                length += e - s;
                Some((a, b))
            }
            None => Some((a, b)),
        };
    }
    if let Some((s, e)) = current {
        length += e - s;
    }
    length
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resource::InstanceId;

    /// One instance for every span of a test, as a backend produces.
    fn instance() -> InstanceId {
        static INSTANCE: std::sync::OnceLock<InstanceId> = std::sync::OnceLock::new();
        *INSTANCE.get_or_init(InstanceId::fresh)
    }

    fn span(stream: u64, label: &str, start: u64, end: u64) -> Span {
        Span {
            stream: StreamId { instance: instance(), index: stream },
            label: label.into(),
            start: Duration::from_micros(start),
            end: Duration::from_micros(end),
        }
    }

    /// Two lanes: a long GEMM, then a 1 µs op right behind a 2 ms one (rounding must not make
    /// them overlap), and one wait edge from lane 1 to lane 0.
    fn two_lanes() -> Timeline {
        let spans = vec![
            span(0, "dynamic_quant", 0, 40),
            span(0, "qkv_matmul", 2_040, 9_000),
            span(1, "project_bfg", 10, 2_000),
            span(1, "tiny", 2_000, 2_001),
            span(1, "postprocess_bfg", 2_001, 2_030),
        ];
        let (main, aux) = (spans[0].stream, spans[2].stream);
        let waits = vec![WaitEdge {
            upstream: aux,
            satisfied: Duration::from_micros(2_000),
            stream: main,
            resumed: Duration::from_micros(2_030),
        }];
        Timeline::with_waits(spans, waits)
    }

    #[test]
    fn svg_has_a_lane_per_stream_a_box_per_op_and_an_arrow_per_wait() {
        let t = two_lanes();
        let names = vec![(t.spans[0].stream, "main".to_string())];
        let svg = t.to_svg(&SvgOptions { lane_names: names, ..SvgOptions::default() });
        let doc = roxmltree::Document::parse(&svg).expect("well-formed SVG");
        let class = |n: &roxmltree::Node<'_, '_>, c: &str| n.attribute("class") == Some(c);
        let lanes: Vec<_> = doc.descendants().filter(|n| class(n, "lane")).collect();
        assert_eq!(lanes.len(), 2);
        assert!(svg.contains("main (s0)") && svg.contains(">s1<"), "lane names");
        let mut boxes = 0;
        for lane in &lanes {
            let mut rects: Vec<(f64, f64)> = lane
                .descendants()
                .filter(|n| class(n, "op"))
                .map(|n| {
                    let num = |a: &str| n.attribute(a).and_then(|v| v.parse::<f64>().ok());
                    let (x, w) = (num("x").expect("x"), num("width").expect("width"));
                    assert!(w >= 0.0);
                    (x, x + w)
                })
                .collect();
            boxes += rects.len();
            rects.sort_by(|a, b| a.0.total_cmp(&b.0));
            for pair in rects.windows(2) {
                assert!(pair[0].1 <= pair[1].0, "boxes overlap in a lane: {pair:?}");
            }
        }
        assert_eq!(boxes, t.spans.len());
        let arrows: Vec<_> = doc.descendants().filter(|n| class(n, "wait")).collect();
        assert_eq!(arrows.len(), 1);
        assert_eq!(arrows[0].attribute("data-from"), Some("s1"));
        // Labels are escaped.
        let odd = Timeline::new(vec![span(0, "a<b&c", 0, 10)]);
        roxmltree::Document::parse(&odd.to_svg(&SvgOptions::default())).expect("escaped");
    }

    #[test]
    fn chrome_trace_has_an_event_per_op_and_a_flow_per_wait() {
        let t = two_lanes();
        let trace = t.to_chrome_trace(&[]);
        let text = serde_json::to_string(&trace).expect("serialise");
        let parsed: serde_json::Value = serde_json::from_str(&text).expect("parse");
        let events = parsed["traceEvents"].as_array().expect("events");
        let phase = |p: &str| events.iter().filter(|e| e["ph"] == p).count();
        assert_eq!(phase("X"), t.spans.len());
        assert_eq!((phase("M"), phase("s"), phase("f")), (2, 1, 1));
        let gemm = events.iter().find(|e| e["name"] == "qkv_matmul").expect("gemm");
        assert_eq!((gemm["ts"].as_f64(), gemm["dur"].as_f64()), (Some(2_040.0), Some(6_960.0)));
        assert_eq!(gemm["tid"], 0);
    }

    #[test]
    fn hidden_fraction_counts_only_other_streams_and_merges_overlaps() {
        let spans = vec![
            span(0, "quant", 0, 100),
            span(1, "gemm_a", 20, 60),
            span(1, "gemm_b", 50, 80),
            span(0, "gemm_c", 100, 200),
            span(1, "post", 150, 250),
        ];
        let t = Timeline::new(spans);
        let is = |names: &'static [&'static str]| move |s: &Span| names.contains(&s.label.as_str());
        // quant is covered 20..80 = 60 of 100 µs; post 150..200 = 50 of 100 µs.
        let f = t.hidden_fraction(is(&["quant"]), is(&["gemm_a", "gemm_b", "gemm_c"])).unwrap();
        assert!((f - 0.6).abs() < 1e-12, "{f}");
        let f = t.hidden_fraction(is(&["quant", "post"]), |s| s.label.starts_with("gemm")).unwrap();
        assert!((f - 110.0 / 200.0).abs() < 1e-12, "{f}");
        assert_eq!(t.hidden_fraction(is(&["none"]), |_| true), None);
        assert_eq!(t.makespan(), Duration::from_micros(250));
        assert_eq!(t.total(is(&["gemm_a", "gemm_b"])), Duration::from_micros(70));
        assert_eq!(t.filter(is(&["post"])).spans.len(), 1);
    }
}
