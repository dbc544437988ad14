//! Timelines: when each op ran, on which stream, under which label. A backend that can time its
//! ops (the reference backend with `ReferenceOptions::timeline`) hands one out; benchmarks
//! measure overlap from it, and `kda trace` draws it (as SVG or a Chrome trace: the CLI's
//! `render` module).
//!
//! Times are offsets from an epoch of the backend's choosing (its creation, say), so spans of
//! different streams compare directly.

use std::time::Duration;

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
