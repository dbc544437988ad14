//! What the CLI draws: timelines as SVG ([`timeline_svg`]) or Chrome trace-event JSON
//! ([`chrome_trace`]), and the planner's time chart ([`TimeChart`]). Only `kda trace` and
//! `kda plan` draw, so the drawing lives here rather than in the HAL.

mod chart;
mod chrome;
mod timeline;

pub use chart::{ChartSeries, TimeChart};
pub use chrome::chrome_trace;
pub use timeline::{SvgOptions, timeline_svg};

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use kda_core::timeline::{Span, Timeline, WaitEdge};
    use kda_core::{InstanceId, StreamId};

    use super::*;

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
        let svg = timeline_svg(&t, &SvgOptions { lane_names: names, ..SvgOptions::default() });
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
        roxmltree::Document::parse(&timeline_svg(&odd, &SvgOptions::default())).expect("escaped");
    }

    #[test]
    fn chrome_trace_has_an_event_per_op_and_a_flow_per_wait() {
        let t = two_lanes();
        let trace = chrome_trace(&t, &[]);
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
}
