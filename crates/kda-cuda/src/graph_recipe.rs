//! How a HAL graph ([`kda_core::graph::Graph`]) becomes one CUDA graph: the host-side recipe
//! the backend replays into a `cuStreamBeginCapture` on the origin stream, instantiates once and
//! then launches with one `cuGraphLaunch`.
//!
//! The HAL has already validated the capture (every forked stream joined, no host block, no
//! event from outside); the recipe only decides whether the graph can run as device work alone
//! and how each captured stream's failure record is carried:
//!
//! - A fork's first node is always the wait that pulled it into the capture. Replayed, that wait
//!   *resets* the fork's failure record to the origin's snapshot (rather than only inheriting a
//!   failure): a fork's record is never read by a `synchronize`, so a failure that reached it in
//!   one launch must not outlive that launch.
//! - Host functions and downloads run on the host, so a graph holding one is not captured: it
//!   replays through the launch path, as on every backend. Uploads are device copies from a
//!   pinned buffer the CUDA graph owns, so they are captured.

use kda_core::Backend;
use kda_core::graph::{Graph, Node};
use kda_core::op::Op;

/// One captured call, in capture order, with its stream (0 = the origin).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// Node `node` of the HAL graph, an op.
    Launch { stream: usize, node: usize },
    /// Record event `event` on `stream`.
    Record { stream: usize, event: usize },
    /// `stream` waits on `event`; `first` when this wait is the fork's first node.
    Wait { stream: usize, event: usize, first: bool },
}

/// A HAL graph as one CUDA graph: its streams and events, and the calls to replay.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GraphRecipe {
    /// Captured streams, the origin included.
    pub streams: usize,
    /// Events recorded inside the capture.
    pub events: usize,
    pub steps: Vec<Step>,
}

/// Why a graph replays through the launch path instead of running as one CUDA graph.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum NotCapturable {
    /// A host function or a download (host work inside the graph).
    #[error("node {node} (`{label}`) runs on the host")]
    HostWork { node: usize, label: String },
    /// A fork whose first node is not the wait that joined it (never made by the HAL).
    #[error("stream {stream} does not start with the wait that forked it")]
    Unjoined { stream: usize },
}

/// The events recorded inside `graph` (its event indices are `0..` this).
pub fn event_count<B: Backend>(graph: &Graph<B>) -> usize {
    graph
        .nodes()
        .iter()
        .filter_map(|n| match n {
            Node::Record { event, .. } | Node::Wait { event, .. } => Some(event + 1),
            Node::Launch { .. } => None,
        })
        .max()
        .unwrap_or(0)
}

/// Plan `graph` as one CUDA graph, or say why it cannot be one.
pub fn recipe<B: Backend>(graph: &Graph<B>) -> Result<GraphRecipe, NotCapturable> {
    let mut seen = vec![false; graph.streams()];
    if let Some(origin) = seen.first_mut() {
        *origin = true;
    }
    let mut steps = Vec::with_capacity(graph.nodes().len());
    for (node, n) in graph.nodes().iter().enumerate() {
        let (stream, step) = match n {
            Node::Launch { stream, label, op } => {
                if matches!(op.op(), Op::Host { .. } | Op::Download { .. }) {
                    return Err(NotCapturable::HostWork { node, label: label.clone() });
                }
                (*stream, Step::Launch { stream: *stream, node })
            }
            Node::Record { stream, event } => {
                (*stream, Step::Record { stream: *stream, event: *event })
            }
            Node::Wait { stream, event } => {
                let first = !seen.get(*stream).copied().unwrap_or(true);
                (*stream, Step::Wait { stream: *stream, event: *event, first })
            }
        };
        match seen.get_mut(stream) {
            Some(s) if !*s && !matches!(step, Step::Wait { .. }) => {
                return Err(NotCapturable::Unjoined { stream });
            }
            Some(s) => *s = true,
            None => return Err(NotCapturable::Unjoined { stream }),
        }
        steps.push(step);
    }
    Ok(GraphRecipe { streams: graph.streams(), events: event_count(graph), steps })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kda_core::{DType, Device, HostFn};
    use kda_reference::ReferenceBackend;

    type B = ReferenceBackend;

    /// A fill on the origin, forked to a second stream for a copy, joined back, then a fill.
    fn forked(b: &Device<B>, host: Option<Op<B>>) -> Graph<B> {
        let main = b.new_stream().unwrap();
        let aux = b.new_stream().unwrap();
        let (fork, join) = (b.new_event().unwrap(), b.new_event().unwrap());
        let x = b.alloc(DType::F32, &[8]).unwrap();
        let y = b.alloc(DType::F32, &[8]).unwrap();
        b.begin_capture(&main).unwrap();
        b.launch(&main, Op::Fill { dst: x.clone(), value: 1.0 }).unwrap();
        b.record(&fork, &main).unwrap();
        b.wait(&aux, &fork).unwrap();
        b.launch(&aux, Op::Copy { src: x.clone(), dst: y.clone() }).unwrap();
        if let Some(op) = host {
            b.launch(&aux, op).unwrap();
        }
        b.record(&join, &aux).unwrap();
        b.wait(&main, &join).unwrap();
        b.launch(&main, Op::Fill { dst: x, value: 2.0 }).unwrap();
        b.end_capture(&main).unwrap()
    }

    #[test]
    fn a_fork_and_join_plans_as_one_graph_whose_fork_resets_at_its_first_wait() {
        let b = B::new();
        let recipe = recipe(&forked(&b, None)).unwrap();
        assert_eq!((recipe.streams, recipe.events), (2, 2));
        assert_eq!(
            recipe.steps,
            [
                Step::Launch { stream: 0, node: 0 },
                Step::Record { stream: 0, event: 0 },
                Step::Wait { stream: 1, event: 0, first: true },
                Step::Launch { stream: 1, node: 3 },
                Step::Record { stream: 1, event: 1 },
                Step::Wait { stream: 0, event: 1, first: false },
                Step::Launch { stream: 0, node: 6 },
            ]
        );
    }

    #[test]
    fn uploads_are_captured_and_host_work_is_not() {
        let b = B::new();
        let x = b.alloc(DType::F32, &[2]).unwrap();
        let upload = Op::Upload { dst: x.clone(), data: vec![0u8; 8].into() };
        assert!(recipe(&forked(&b, Some(upload))).is_ok());
        let host = Op::Host { name: "notify", f: HostFn::new(|| Ok(())) };
        assert_eq!(
            recipe(&forked(&b, Some(host))),
            Err(NotCapturable::HostWork { node: 4, label: "notify".into() })
        );
        let slot = kda_core::DownloadSlot::default();
        let download = Op::Download { src: x, slot };
        assert!(matches!(recipe(&forked(&b, Some(download))), Err(NotCapturable::HostWork { .. })));
    }

    #[test]
    fn an_origin_only_graph_has_no_events() {
        let b = B::new();
        let s = b.new_stream().unwrap();
        let x = b.alloc(DType::F32, &[4]).unwrap();
        b.begin_capture(&s).unwrap();
        b.launch(&s, Op::Fill { dst: x, value: 0.5 }).unwrap();
        let graph = b.end_capture(&s).unwrap();
        let recipe = recipe(&graph).unwrap();
        assert_eq!((recipe.streams, recipe.events, recipe.steps.len()), (1, 0, 1));
    }
}
