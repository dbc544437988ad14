//! A timeline drawn as SVG: one lane per stream, one box per op (to scale, named, with its
//! duration on hover), and an arrow per cross-stream wait, so overlap shows at a glance.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::time::Duration;

use kda_core::StreamId;
use kda_core::timeline::{Span, Timeline};

/// What to draw besides the timeline itself.
#[derive(Clone, Debug, Default)]
pub struct SvgOptions {
    /// A heading above the lanes.
    pub title: Option<String>,
    /// Lane names (`main`, `aux`, …); a stream without one is named by its id.
    pub lane_names: Vec<(StreamId, String)>,
    /// Drawing width in pixels (0: the default, 1200).
    pub width: u32,
}

const DEFAULT_WIDTH: f64 = 1200.0;
const LEFT: f64 = 120.0;
const RIGHT: f64 = 20.0;
const TOP: f64 = 64.0;
const LANE: f64 = 44.0;
const BOX: f64 = 28.0;
/// Roughly the width of one character of the box labels, for deciding what fits.
const CHAR: f64 = 6.2;
/// Colours by op name, so one op looks the same in every lane and every drawing (the plan's
/// chart colours its lines from the same palette).
pub(super) const PALETTE: [&str; 10] = [
    "#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7",
    "#9c755f", "#bab0ac",
];

/// FNV-1a of the label: a stable colour index.
fn colour(label: &str) -> &'static str {
    let hash = label
        .bytes()
        .fold(0xcbf2_9ce4_8422_2325_u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3));
    PALETTE[(hash % PALETTE.len() as u64) as usize]
}

/// `text` with XML's special characters escaped, for text and attribute values.
pub(super) fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            c => out.push(c),
        }
    }
    out
}

/// A duration for people: µs below a millisecond, ms above.
pub(super) fn human(d: Duration) -> String {
    let us = d.as_secs_f64() * 1e6;
    if us < 1000.0 { format!("{us:.1} µs") } else { format!("{:.3} ms", us / 1000.0) }
}

/// `us` microseconds with as many decimals as the tick spacing `step` needs.
fn tick_label(us: f64, step: f64) -> String {
    let (value, step, unit) =
        if step >= 1000.0 { (us / 1e3, step / 1e3, "ms") } else { (us, step, "µs") };
    let decimals = (-step.log10().floor()).max(0.0) as usize;
    format!("{value:.decimals$} {unit}")
}

/// A tick spacing of 1, 2 or 5 times a power of ten giving about `target` ticks over `span`.
fn tick_step(span: f64, target: f64) -> f64 {
    let raw = (span / target).max(f64::MIN_POSITIVE);
    let power = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 5.0, 10.0].into_iter().map(|m| m * power).find(|s| *s >= raw).unwrap_or(raw)
}

/// The timeline as a standalone SVG document. Boxes of one lane never overlap (a box is cut
/// short where the next one of its lane starts, so rounding cannot make them touch).
pub fn timeline_svg(timeline: &Timeline, options: &SvgOptions) -> String {
    let width = if options.width == 0 { DEFAULT_WIDTH } else { f64::from(options.width) };
    let streams = timeline.streams();
    let lane_of: HashMap<StreamId, usize> =
        streams.iter().enumerate().map(|(i, s)| (*s, i)).collect();
    let origin = timeline.spans.iter().map(|s| s.start).min().unwrap_or_default();
    let end = timeline.spans.iter().map(|s| s.end).max().unwrap_or_default();
    let span_us = (end.saturating_sub(origin).as_secs_f64() * 1e6).max(1.0);
    let scale = (width - LEFT - RIGHT) / span_us;
    let x = |t: Duration| LEFT + (t.saturating_sub(origin).as_secs_f64() * 1e6) * scale;
    let lane_y = |lane: usize| TOP + lane as f64 * LANE;
    let height = lane_y(streams.len()) + 24.0;

    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0}" height="{height:.0}" viewBox="0 0 {width:.0} {height:.0}" font-family="monospace" font-size="11">"#
    );
    svg.push_str(concat!(
        r#"<defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" "#,
        r#"markerHeight="7" orient="auto-start-reverse"><path d="M 0 0 L 10 5 L 0 10 z" "#,
        r##"fill="#333"/></marker></defs>"##,
        "\n",
        r#"<rect width="100%" height="100%" fill="white"/>"#,
        "\n"
    ));
    let title = options.title.as_deref().unwrap_or("timeline");
    let _ = writeln!(
        svg,
        r##"<text x="8" y="16" font-size="13" font-weight="bold">{}</text><text x="8" y="31" fill="#444">{}</text>"##,
        escape(title),
        escape(&format!(
            "{} ops on {} streams, {} cross-stream waits (arrow: from when the awaited work \
             finished to when the waiting stream went on); makespan {}",
            timeline.spans.len(),
            streams.len(),
            timeline.waits.len(),
            human(timeline.makespan())
        ))
    );

    // Time axis.
    let step = tick_step(span_us, 8.0);
    let mut tick = 0.0;
    while tick <= span_us + 1e-9 {
        let tx = LEFT + tick * scale;
        let _ = writeln!(
            svg,
            r##"<line class="tick" x1="{tx:.2}" y1="{:.1}" x2="{tx:.2}" y2="{:.1}" stroke="#ddd"/><text x="{tx:.2}" y="{:.1}" text-anchor="middle" fill="#666">{}</text>"##,
            TOP - 8.0,
            height - 20.0,
            TOP - 12.0,
            tick_label(tick, step)
        );
        tick += step;
    }

    for (lane, stream) in streams.iter().enumerate() {
        let name = options
            .lane_names
            .iter()
            .find(|(s, _)| s == stream)
            .map_or_else(|| stream.to_string(), |(_, n)| format!("{n} ({stream})"));
        let y = lane_y(lane);
        let _ = writeln!(
            svg,
            r##"<g class="lane" data-stream="{stream}"><text x="8" y="{:.1}" font-weight="bold">{}</text><line x1="{LEFT}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="#eee"/>"##,
            y + BOX / 2.0 + 4.0,
            escape(&name),
            y + BOX + 6.0,
            width - RIGHT,
            y + BOX + 6.0
        );
        let mut spans: Vec<&Span> = timeline.spans.iter().filter(|s| s.stream == *stream).collect();
        spans.sort_by_key(|s| s.start);
        for (i, s) in spans.iter().enumerate() {
            let x0 = x(s.start);
            let next = spans.get(i + 1).map_or(f64::INFINITY, |n| x(n.start));
            // At least half a pixel wide; at most up to the next box, less a gap larger
            // than the printed rounding (3 decimals), so printed boxes never touch either.
            let x1 = x(s.end).max(x0 + 0.5).min(next - 0.002).max(x0);
            let label = escape(&s.label);
            let _ = write!(
                svg,
                r#"<rect class="op" data-label="{label}" data-start-us="{:.3}" data-end-us="{:.3}" x="{x0:.3}" y="{y:.1}" width="{:.3}" height="{BOX}" fill="{}" stroke="white" stroke-width="0.5"><title>{label}: {}</title></rect>"#,
                s.start.saturating_sub(origin).as_secs_f64() * 1e6,
                s.end.saturating_sub(origin).as_secs_f64() * 1e6,
                x1 - x0,
                colour(&s.label),
                escape(&human(s.duration()))
            );
            if x1 - x0 >= CHAR * (s.label.chars().count() as f64 + 1.0) {
                let _ = write!(
                    svg,
                    r#"<text x="{:.3}" y="{:.1}" fill="white" pointer-events="none">{label}</text>"#,
                    x0 + 3.0,
                    y + BOX / 2.0 + 4.0
                );
            }
            svg.push('\n');
        }
        svg.push_str("</g>\n");
    }

    for w in &timeline.waits {
        let (Some(&from), Some(&to)) = (lane_of.get(&w.upstream), lane_of.get(&w.stream)) else {
            continue;
        };
        let (y0, y1) = (lane_y(from) + BOX / 2.0, lane_y(to) + BOX / 2.0);
        let _ = writeln!(
            svg,
            r##"<line class="wait" data-from="{}" data-to="{}" x1="{:.3}" y1="{y0:.1}" x2="{:.3}" y2="{y1:.1}" stroke="#333" stroke-width="1.2" marker-end="url(#arrow)"/>"##,
            w.upstream,
            w.stream,
            x(w.satisfied),
            x(w.resumed)
        );
    }
    svg.push_str("</svg>\n");
    svg
}
