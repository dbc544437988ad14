//! `kda trace` and `kda check` end to end.
#![allow(clippy::expect_used, reason = "test setup")]

mod common;

use common::{TempDir, kda, stderr, stdout};

/// The count in "recorded N ops on M streams".
fn recorded(out: &str) -> (usize, usize) {
    let line = out.lines().find(|l| l.contains("recorded ")).expect("a recorded line");
    let words: Vec<&str> = line.split_whitespace().collect();
    let at = |w: &str| words.iter().position(|x| *x == w).expect(w);
    let num = |i: usize| words[i].parse::<usize>().expect("a count");
    (num(at("recorded") + 1), num(at("on") + 1))
}

/// Run `kda trace` on the tiny preset: its stdout, the SVG text and the Chrome JSON.
fn trace(dir: &TempDir, extra: &[&str]) -> (String, String, serde_json::Value) {
    let (svg, chrome) = (dir.path("t.svg"), dir.path("t.json"));
    let mut args = vec!["trace", "--preset", "tiny", "--tokens", "40", "--requests", "3"];
    args.extend_from_slice(extra);
    args.extend([
        "--svg",
        svg.to_str().expect("utf-8"),
        "--chrome",
        chrome.to_str().expect("utf-8"),
    ]);
    let o = kda(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = std::fs::read_to_string(&svg).expect("svg");
    let json =
        serde_json::from_str(&std::fs::read_to_string(&chrome).expect("json")).expect("JSON");
    (stdout(&o), text, json)
}

fn check_drawing(
    out: &str,
    doc: &roxmltree::Document<'_>,
    json: &serde_json::Value,
    streams: usize,
) {
    let (ops, on) = recorded(out);
    assert_eq!(on, streams, "{out}");
    let class = |n: &roxmltree::Node<'_, '_>, c: &str| n.attribute("class") == Some(c);
    let lanes: Vec<_> = doc.descendants().filter(|n| class(n, "lane")).collect();
    assert_eq!(lanes.len(), streams, "one lane per stream");
    let mut boxes = 0;
    for lane in &lanes {
        let mut spans: Vec<(f64, f64)> = lane
            .descendants()
            .filter(|n| class(n, "op"))
            .map(|n| {
                let num = |a: &str| n.attribute(a).and_then(|v| v.parse::<f64>().ok()).expect(a);
                (num("x"), num("x") + num("width"))
            })
            .collect();
        boxes += spans.len();
        spans.sort_by(|a, b| a.0.total_cmp(&b.0));
        for pair in spans.windows(2) {
            assert!(pair[0].1 <= pair[1].0, "overlapping boxes in a lane: {pair:?}");
        }
    }
    assert_eq!(boxes, ops, "one box per recorded op");
    let events = json["traceEvents"].as_array().expect("traceEvents");
    assert_eq!(events.iter().filter(|e| e["ph"] == "X").count(), ops, "the same op count");
}

#[test]
fn trace_draws_a_lane_per_stream_and_a_box_per_op() {
    let dir = TempDir::new("trace");
    let (out, svg, json) = trace(&dir, &[]);
    let doc = roxmltree::Document::parse(&svg).expect("well-formed SVG");
    check_drawing(&out, &doc, &json, 2);
    // The overlapped projections: their GEMMs on two lanes, joined by waits.
    let labels: Vec<&str> = doc.descendants().filter_map(|n| n.attribute("data-label")).collect();
    for label in ["dynamic_quant", "qkv_matmul", "project_bfg", "postprocess_bfg", "o_proj"] {
        assert!(labels.contains(&label), "{label} in {labels:?}");
    }
    let waits = doc.descendants().filter(|n| n.attribute("class") == Some("wait")).count();
    assert!(waits >= 1, "arrows for the waits");

    let (out, svg, json) = trace(&dir, &["--schedule", "serial", "--decode"]);
    let doc = roxmltree::Document::parse(&svg).expect("well-formed SVG");
    check_drawing(&out, &doc, &json, 1);
    assert!(out.contains("decode step"), "{out}");
}

#[test]
fn trace_needs_an_output() {
    let o = kda(&["trace", "--preset", "tiny"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--svg"), "{}", stderr(&o));
}

#[test]
fn check_passes_a_valid_schedule_and_fails_a_broken_join() {
    for schedule in ["overlapped", "serial"] {
        let o = kda(&["check", "--preset", "tiny", "--schedule", schedule]);
        assert!(o.status.success(), "{schedule}: {}{}", stdout(&o), stderr(&o));
        let out = stdout(&o);
        assert!(out.contains("capture: valid") && out.contains("hazards: none"), "{out}");
        assert!(out.contains("replay: equals eager"), "{out}");
    }
    let o = kda(&["check", "--preset", "tiny", "--break-join"]);
    assert!(!o.status.success(), "a dropped join must fail the check");
    let out = stdout(&o);
    assert!(out.contains("capture: INVALID") && out.contains("never joined back"), "{out}");
}
