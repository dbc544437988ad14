//! The plan's table drawn as a chart: predicted layer time against the token count T, one line
//! per configuration, both axes logarithmic, the recommended configuration at each T ringed
//! (docs/design/planner.md#the-chart).
//!
//! Both axes are log scale because the table spans decades on both: T from one decode token to
//! thousands of prefill tokens, times from launch-bound microseconds to GEMM-bound milliseconds.
//! On log axes a line's slope is its scaling exponent (flat: launch or weight-bytes bound; slope
//! one: linear in T), and equal ratios of time are equal distances, so "twice as fast" reads the
//! same at every T. The drawing primitives (escaping, the palette, durations for people) are the
//! timeline writer's (`timeline_svg`).

use std::fmt::Write as _;
use std::time::Duration;

use super::timeline::{PALETTE, escape, human};

/// One configuration's predicted times: one per token count of its [`TimeChart`].
#[derive(Clone, Debug, PartialEq)]
pub struct ChartSeries {
    /// The configuration's name, shown in the legend.
    pub name: String,
    /// Predicted seconds, in the order of [`TimeChart::tokens`].
    pub seconds: Vec<f64>,
    /// Drawn dashed (the CLI dashes the staged-F configurations, so the two F forms read apart).
    pub dashed: bool,
}

/// Predicted times of several configurations over token counts, and the one recommended at each.
#[derive(Clone, Debug, PartialEq)]
pub struct TimeChart {
    /// The heading (the CLI names the chip, TP and batch shape).
    pub title: String,
    /// The token counts, in any order; each line is drawn through them in increasing T.
    pub tokens: Vec<usize>,
    pub series: Vec<ChartSeries>,
    /// For each token count, the index in `series` of the recommended configuration.
    pub recommended: Vec<usize>,
}

/// A chart that cannot be drawn.
#[derive(Debug, thiserror::Error, PartialEq)]
#[error("plan chart: `{param}` must be {expected}, got {actual}")]
pub struct ChartError {
    pub param: &'static str,
    pub expected: String,
    pub actual: String,
}

const WIDTH: f64 = 1000.0;
const HEIGHT: f64 = 560.0;
/// The plot area; the legend sits to its right.
const PLOT_LEFT: f64 = 90.0;
const PLOT_RIGHT: f64 = 650.0;
const PLOT_TOP: f64 = 70.0;
const PLOT_BOTTOM: f64 = 470.0;
const LEGEND_X: f64 = 675.0;
/// The last series' marker radius and line width; earlier series are drawn larger and wider
/// (by these steps), so series with equal times show as nested rings and stacked bands
/// instead of hiding each other.
const MARKER_R: f64 = 3.0;
const MARKER_STEP: f64 = 0.8;
const LINE_W: f64 = 1.4;
const LINE_STEP: f64 = 0.6;
/// Larger than the largest marker of six series.
const RING_R: f64 = 10.0;

/// Whole decades `[lo, hi]` (exponents of ten) covering `min..=max`, at least one decade wide.
fn decades(min: f64, max: f64) -> (i32, i32) {
    // A value on a decade (1e-6 may come back from log10 a hair off -6) stays on it.
    const SLACK: f64 = 1e-9;
    let lo = (min.log10() + SLACK).floor() as i32;
    let hi = ((max.log10() - SLACK).ceil() as i32).max(lo + 1);
    (lo, hi)
}

/// A log axis: `v` in `[10^lo, 10^hi]` onto pixels `[from, to]`.
#[derive(Clone, Copy)]
struct LogAxis {
    lo: i32,
    hi: i32,
    from: f64,
    to: f64,
}

impl LogAxis {
    fn at(self, v: f64) -> f64 {
        let f = (v.log10() - f64::from(self.lo)) / f64::from(self.hi - self.lo);
        self.from + f * (self.to - self.from)
    }
}

/// `10^exp` seconds for an axis label: `1 µs`, `10 ms`, `100 s`.
fn seconds_decade(exp: i32) -> String {
    let (unit_exp, unit) = match exp {
        -9..=-7 => (-9, "ns"),
        -6..=-4 => (-6, "µs"),
        -3..=-1 => (-3, "ms"),
        0..=3 => (0, "s"),
        _ => return format!("1e{exp} s"),
    };
    format!("{} {unit}", 10u32.pow((exp - unit_exp) as u32))
}

/// `10^exp` tokens for an axis label.
fn tokens_decade(exp: i32) -> String {
    if (0..=9).contains(&exp) { 10u64.pow(exp as u32).to_string() } else { format!("1e{exp}") }
}

fn check(
    ok: bool,
    param: &'static str,
    expected: &str,
    actual: impl FnOnce() -> String,
) -> Result<(), ChartError> {
    if ok { Ok(()) } else { Err(ChartError { param, expected: expected.into(), actual: actual() }) }
}

impl TimeChart {
    fn validate(&self) -> Result<(), ChartError> {
        let n = self.tokens.len();
        check(n > 0, "tokens", "one or more token counts", || "none".into())?;
        check(!self.tokens.contains(&0), "tokens", "counts of at least 1", || {
            format!("{:?}", self.tokens)
        })?;
        check(!self.series.is_empty(), "series", "one or more configurations", || "none".into())?;
        for s in &self.series {
            check(
                s.seconds.len() == n,
                "series.seconds",
                &format!("{n} times (one per T)"),
                || format!("{} for `{}`", s.seconds.len(), s.name),
            )?;
            let bad = s.seconds.iter().find(|v| !(v.is_finite() && **v > 0.0));
            check(bad.is_none(), "series.seconds", "positive and finite (a log axis)", || {
                format!("{:?} for `{}`", bad.copied().unwrap_or_default(), s.name)
            })?;
        }
        check(
            self.recommended.len() == n,
            "recommended",
            &format!("{n} indices (one per T)"),
            || self.recommended.len().to_string(),
        )?;
        let bad = self.recommended.iter().find(|&&i| i >= self.series.len());
        check(
            bad.is_none(),
            "recommended",
            &format!("indices below the {} series", self.series.len()),
            || format!("{:?}", self.recommended),
        )
    }

    /// The chart as a standalone SVG document. Each configuration is a `polyline` of class
    /// `series-line` through one point per T in increasing T, with a `circle` of class `point`
    /// per point (`data-tokens`, `data-seconds`); the recommended configuration at each T gets a
    /// `circle` of class `recommended` around its point; decade gridlines are `line`s of class
    /// `x-decade` / `y-decade` with `data-exp`.
    pub fn to_svg(&self) -> Result<String, ChartError> {
        self.validate()?;
        let (t_min, t_max) =
            self.tokens.iter().fold((usize::MAX, 0), |(lo, hi), &t| (lo.min(t), hi.max(t)));
        let all = self.series.iter().flat_map(|s| s.seconds.iter().copied());
        let (s_min, s_max) =
            all.fold((f64::INFINITY, 0.0f64), |(lo, hi), v| (lo.min(v), hi.max(v)));
        let (xlo, xhi) = decades(t_min as f64, t_max as f64);
        let (ylo, yhi) = decades(s_min, s_max);
        let x_axis = LogAxis { lo: xlo, hi: xhi, from: PLOT_LEFT, to: PLOT_RIGHT };
        let y_axis = LogAxis { lo: ylo, hi: yhi, from: PLOT_BOTTOM, to: PLOT_TOP };
        let mut order: Vec<usize> = (0..self.tokens.len()).collect();
        order.sort_by_key(|&i| self.tokens[i]);

        let mut svg = String::new();
        let _ = writeln!(
            svg,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH:.0}" height="{HEIGHT:.0}" viewBox="0 0 {WIDTH:.0} {HEIGHT:.0}" font-family="monospace" font-size="11">"#
        );
        svg.push_str("<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n");
        let _ = writeln!(
            svg,
            r##"<text class="title" x="8" y="18" font-size="13" font-weight="bold">{}</text><text x="8" y="36" fill="#444">predicted layer time against T, one line per configuration, both axes log scale</text><text x="8" y="52" fill="#444">a ring marks the recommended (fastest predicted) configuration at each T</text>"##,
            escape(&self.title)
        );

        // Decade gridlines and labels.
        for exp in xlo..=xhi {
            let x = x_axis.at(10f64.powi(exp));
            let _ = writeln!(
                svg,
                r##"<line class="x-decade" data-exp="{exp}" x1="{x:.2}" y1="{PLOT_TOP}" x2="{x:.2}" y2="{PLOT_BOTTOM}" stroke="#ddd"/><text x="{x:.2}" y="{:.1}" text-anchor="middle" fill="#888">{}</text>"##,
                PLOT_BOTTOM + 34.0,
                tokens_decade(exp)
            );
        }
        for exp in ylo..=yhi {
            let y = y_axis.at(10f64.powi(exp));
            let _ = writeln!(
                svg,
                r##"<line class="y-decade" data-exp="{exp}" x1="{PLOT_LEFT}" y1="{y:.2}" x2="{PLOT_RIGHT}" y2="{y:.2}" stroke="#ddd"/><text x="{:.1}" y="{:.2}" text-anchor="end" fill="#444">{}</text>"##,
                PLOT_LEFT - 6.0,
                y + 4.0,
                seconds_decade(exp)
            );
        }
        // A tick at each T of the table.
        for &i in &order {
            let t = self.tokens[i];
            let x = x_axis.at(t as f64);
            let _ = writeln!(
                svg,
                r##"<line class="t-tick" data-tokens="{t}" x1="{x:.2}" y1="{PLOT_BOTTOM}" x2="{x:.2}" y2="{:.1}" stroke="#333"/><text x="{x:.2}" y="{:.1}" text-anchor="middle">{t}</text>"##,
                PLOT_BOTTOM + 5.0,
                PLOT_BOTTOM + 17.0
            );
        }
        let _ = writeln!(
            svg,
            r##"<rect x="{PLOT_LEFT}" y="{PLOT_TOP}" width="{:.1}" height="{:.1}" fill="none" stroke="#333"/><text x="{:.1}" y="{:.1}" text-anchor="middle">T, tokens (log scale; ticks at the planned T, grey: decades)</text><text transform="translate(18 {:.1}) rotate(-90)" text-anchor="middle">predicted layer time (log scale)</text>"##,
            PLOT_RIGHT - PLOT_LEFT,
            PLOT_BOTTOM - PLOT_TOP,
            0.5 * (PLOT_LEFT + PLOT_RIGHT),
            PLOT_BOTTOM + 54.0,
            0.5 * (PLOT_TOP + PLOT_BOTTOM)
        );

        let point =
            |s: &ChartSeries, i: usize| (x_axis.at(self.tokens[i] as f64), y_axis.at(s.seconds[i]));
        let dash = |s: &ChartSeries| if s.dashed { r#" stroke-dasharray="6 4""# } else { "" };
        let later = |k: usize| (self.series.len() - 1 - k) as f64;
        let radius = |k: usize| MARKER_R + MARKER_STEP * later(k);
        let line_width = |k: usize| LINE_W + LINE_STEP * later(k);
        for (k, s) in self.series.iter().enumerate() {
            let (colour, r, w) = (PALETTE[k % PALETTE.len()], radius(k), line_width(k));
            let name = escape(&s.name);
            let points: Vec<String> = order
                .iter()
                .map(|&i| {
                    let (x, y) = point(s, i);
                    format!("{x:.2},{y:.2}")
                })
                .collect();
            let _ = writeln!(
                svg,
                r#"<g class="series" data-config="{name}"><polyline class="series-line" data-config="{name}" points="{}" fill="none" stroke="{colour}" stroke-width="{w:.1}"{}/>"#,
                points.join(" "),
                dash(s)
            );
            for &i in &order {
                let (x, y) = point(s, i);
                let (t, v) = (self.tokens[i], s.seconds[i]);
                let _ = writeln!(
                    svg,
                    r#"<circle class="point" data-config="{name}" data-tokens="{t}" data-seconds="{v:e}" cx="{x:.2}" cy="{y:.2}" r="{r:.1}" fill="{colour}"><title>{name} at T = {t}: {}</title></circle>"#,
                    escape(&human(Duration::from_secs_f64(v)))
                );
            }
            svg.push_str("</g>\n");
        }
        for &i in &order {
            let s = &self.series[self.recommended[i]];
            let (x, y) = point(s, i);
            let t = self.tokens[i];
            let name = escape(&s.name);
            let _ = writeln!(
                svg,
                r##"<circle class="recommended" data-config="{name}" data-tokens="{t}" cx="{x:.2}" cy="{y:.2}" r="{RING_R}" fill="none" stroke="#222" stroke-width="1.5"><title>recommended at T = {t}: {name}, {}</title></circle>"##,
                escape(&human(Duration::from_secs_f64(s.seconds[i])))
            );
        }

        // The legend.
        let row = |k: usize| PLOT_TOP + 8.0 + 20.0 * k as f64;
        svg.push_str("<g class=\"legend\">\n");
        for (k, s) in self.series.iter().enumerate() {
            let (colour, y) = (PALETTE[k % PALETTE.len()], row(k));
            let _ = writeln!(
                svg,
                r#"<line x1="{LEGEND_X}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="{colour}" stroke-width="{LINE_W}"{}/><circle cx="{:.1}" cy="{y:.1}" r="{MARKER_R}" fill="{colour}"/><text class="legend-entry" x="{:.1}" y="{:.1}">{}</text>"#,
                LEGEND_X + 28.0,
                dash(s),
                LEGEND_X + 14.0,
                LEGEND_X + 36.0,
                y + 4.0,
                escape(&s.name)
            );
        }
        let y = row(self.series.len()) + 6.0;
        let _ = writeln!(
            svg,
            r##"<circle cx="{:.1}" cy="{y:.1}" r="{RING_R}" fill="none" stroke="#222" stroke-width="1.5"/><text x="{:.1}" y="{:.1}">recommended at that T</text>"##,
            LEGEND_X + 14.0,
            LEGEND_X + 36.0,
            y + 4.0
        );
        // Which configuration each ring is, in words.
        for (n, &i) in order.iter().enumerate() {
            let y = row(self.series.len() + 2) + 16.0 * n as f64;
            let _ = writeln!(
                svg,
                r##"<text class="recommended-entry" x="{LEGEND_X}" y="{y:.1}" fill="#444">T = {}: {}</text>"##,
                self.tokens[i],
                escape(&self.series[self.recommended[i]].name)
            );
        }
        svg.push_str("</g>\n</svg>\n");
        Ok(svg)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "test")]

    use super::*;

    fn chart(tokens: Vec<usize>, a: Vec<f64>, b: Vec<f64>, recommended: Vec<usize>) -> TimeChart {
        TimeChart {
            title: "T & <chart>".into(),
            tokens,
            series: vec![
                ChartSeries { name: "fast".into(), seconds: a, dashed: false },
                ChartSeries { name: "slow \"one\"".into(), seconds: b, dashed: true },
            ],
            recommended,
        }
    }

    fn attr(n: roxmltree::Node<'_, '_>, name: &str) -> f64 {
        n.attribute(name).unwrap().parse().unwrap()
    }

    /// Points of class `class` as (tokens, x, y), in document order.
    fn circles(doc: &roxmltree::Document<'_>, class: &str, config: &str) -> Vec<(usize, f64, f64)> {
        doc.descendants()
            .filter(|n| n.attribute("class") == Some(class))
            .filter(|n| n.attribute("data-config") == Some(config))
            .map(|n| {
                (n.attribute("data-tokens").unwrap().parse().unwrap(), attr(n, "cx"), attr(n, "cy"))
            })
            .collect()
    }

    /// Points land where the log axes put them: one decade of T or of time is the plot's extent
    /// over the number of decades; the lines run through the points in increasing T.
    #[test]
    fn points_sit_on_log_axes() {
        // T from 1 to 100: two decades across; times from 1 µs to 1 ms: three decades up.
        let c =
            chart(vec![100, 1, 10], vec![1e-3, 1e-6, 1e-5], vec![2e-4, 2e-6, 2e-5], vec![1, 0, 0]);
        let svg = c.to_svg().unwrap();
        let doc = roxmltree::Document::parse(&svg).unwrap();
        let x_decade = (PLOT_RIGHT - PLOT_LEFT) / 2.0;
        let y_decade = (PLOT_BOTTOM - PLOT_TOP) / 3.0;
        let fast = circles(&doc, "point", "fast");
        assert_eq!(fast.iter().map(|p| p.0).collect::<Vec<_>>(), [1, 10, 100]);
        for (t, x, y) in &fast {
            let decades_t = (*t as f64).log10();
            assert!((x - (PLOT_LEFT + decades_t * x_decade)).abs() < 0.01, "T = {t}: x {x}");
            // 1 µs, 10 µs, 1 ms: 0, 1 and 3 decades above the bottom.
            let up = [(1, 0.0), (10, 1.0), (100, 3.0)].iter().find(|p| p.0 == *t).unwrap().1;
            assert!((y - (PLOT_BOTTOM - up * y_decade)).abs() < 0.01, "T = {t}: y {y}");
        }
        // Twice the time is log10(2) of a decade higher, at every T.
        let slow = circles(&doc, "point", "slow \"one\"");
        for (f, s) in fast.iter().zip(&slow).take(2) {
            assert!((f.2 - s.2 - 2f64.log10() * y_decade).abs() < 0.02, "{f:?} {s:?}");
        }
        let line = doc
            .descendants()
            .find(|n| {
                n.attribute("class") == Some("series-line")
                    && n.attribute("data-config") == Some("fast")
            })
            .unwrap();
        let drawn: Vec<(f64, f64)> = line
            .attribute("points")
            .unwrap()
            .split(' ')
            .map(|p| {
                let (x, y) = p.split_once(',').unwrap();
                (x.parse().unwrap(), y.parse().unwrap())
            })
            .collect();
        let expected: Vec<(f64, f64)> = fast.iter().map(|p| (p.1, p.2)).collect();
        assert_eq!(drawn, expected);
        // The rings: the slow line at T = 100, the fast one below.
        let rings: Vec<(String, usize)> = doc
            .descendants()
            .filter(|n| n.attribute("class") == Some("recommended"))
            .map(|n| {
                (
                    n.attribute("data-config").unwrap().into(),
                    n.attribute("data-tokens").unwrap().parse().unwrap(),
                )
            })
            .collect();
        let name = |s: &str| s.to_string();
        assert_eq!(rings, [(name("fast"), 1), (name("fast"), 10), (name("slow \"one\""), 100)]);
        let decade_exps = |class: &str| -> Vec<i32> {
            doc.descendants()
                .filter(|n| n.attribute("class") == Some(class))
                .map(|n| n.attribute("data-exp").unwrap().parse().unwrap())
                .collect()
        };
        assert_eq!(decade_exps("x-decade"), [0, 1, 2]);
        assert_eq!(decade_exps("y-decade"), [-6, -5, -4, -3]);
        assert!(svg.contains(">1 µs<") && svg.contains(">1 ms<") && svg.contains(">100<"));
        assert!(svg.contains("T &amp; &lt;chart&gt;"), "the title is escaped");
    }

    /// One T, or times within one decade, still give a one-decade axis (no division by zero).
    #[test]
    fn a_single_point_gets_a_decade() {
        let c = chart(vec![10], vec![3e-5], vec![4e-5], vec![0]);
        let svg = c.to_svg().unwrap();
        let doc = roxmltree::Document::parse(&svg).unwrap();
        let (_, x, y) = circles(&doc, "point", "fast")[0];
        assert!((x - PLOT_LEFT).abs() < 0.01, "10 is the bottom of the decade 10..100: {x}");
        let expected = PLOT_BOTTOM - 3f64.log10() * (PLOT_BOTTOM - PLOT_TOP);
        assert!((y - expected).abs() < 0.01, "{y} against {expected}");
    }

    #[test]
    fn bad_charts_name_the_parameter() {
        let err = |c: TimeChart| c.to_svg().unwrap_err();
        let e = err(chart(vec![], vec![], vec![], vec![]));
        assert_eq!(e.param, "tokens");
        let e = err(chart(vec![0, 4], vec![1.0, 1.0], vec![1.0, 1.0], vec![0, 0]));
        assert_eq!((e.param, e.actual.as_str()), ("tokens", "[0, 4]"));
        let e = err(chart(vec![1, 4], vec![1.0], vec![1.0, 1.0], vec![0, 0]));
        assert_eq!(e.param, "series.seconds");
        assert!(e.to_string().contains("2 times (one per T), got 1 for `fast`"), "{e}");
        let e = err(chart(vec![1], vec![0.0], vec![1.0], vec![0]));
        assert!(e.to_string().contains("positive and finite"), "{e}");
        let e = err(chart(vec![1], vec![f64::NAN], vec![1.0], vec![0]));
        assert_eq!(e.param, "series.seconds");
        let e = err(chart(vec![1], vec![1.0], vec![1.0], vec![2]));
        assert_eq!((e.param, e.actual.as_str()), ("recommended", "[2]"));
        let e = err(chart(vec![1], vec![1.0], vec![1.0], vec![]));
        assert_eq!(e.param, "recommended");
    }

    #[test]
    fn decade_labels() {
        assert_eq!(seconds_decade(-6), "1 µs");
        assert_eq!(seconds_decade(-4), "100 µs");
        assert_eq!(seconds_decade(-3), "1 ms");
        assert_eq!(seconds_decade(-9), "1 ns");
        assert_eq!(seconds_decade(1), "10 s");
        assert_eq!(seconds_decade(-12), "1e-12 s");
        assert_eq!(tokens_decade(0), "1");
        assert_eq!(tokens_decade(4), "10000");
    }
}
