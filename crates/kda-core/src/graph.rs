//! A captured graph: the launches, records and waits of a capture (see
//! [`crate::device::Device::begin_capture`]), with the rules already checked, replayable with
//! [`crate::device::Device::launch_graph`].

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

use crate::error::Result;
use crate::op::{Op, Validated};
use crate::resource::{InstanceId, Resources};

/// One captured call.
#[derive(Debug)]
pub enum Node<B: Resources> {
    /// An op as the façade validated it (its sizes included).
    Launch {
        stream: usize,
        label: String,
        op: Box<Validated<B>>,
    },
    Record {
        stream: usize,
        event: usize,
    },
    Wait {
        stream: usize,
        event: usize,
    },
}

/// A captured, validated graph: replayable with [`Device::launch_graph`](crate::Device::launch_graph). Stream 0 is the
/// origin; the others are forked and joined inside.
pub struct Graph<B: Resources> {
    pub(crate) instance: InstanceId,
    /// Unique in the process, never reused (see [`Graph::id`]).
    id: u64,
    pub(crate) nodes: Vec<Node<B>>,
    pub(crate) streams: usize,
    pub(crate) events: usize,
    /// The forked streams and events replays use, made on the first replay.
    handles: Mutex<Option<ReplayHandles<B>>>,
}

type ReplayHandles<B> = (Vec<<B as Resources>::Stream>, Vec<<B as Resources>::Event>);

impl<B: Resources> std::fmt::Debug for Graph<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Graph")
            .field("instance", &self.instance)
            .field("id", &self.id)
            .field("nodes", &self.nodes.len())
            .field("streams", &self.streams)
            .field("events", &self.events)
            .finish()
    }
}

impl<B: Resources> Graph<B> {
    /// The backend instance the graph was captured on (only that instance may launch it).
    pub fn instance(&self) -> InstanceId {
        self.instance
    }

    /// The graph's identity: unique among the graphs of this process and never reused, so a
    /// backend may key what it builds for a graph (an instantiated device graph) on it.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Captured streams, the origin included.
    pub fn streams(&self) -> usize {
        self.streams
    }

    /// Labels of the captured ops, in capture order, with their stream (0 = origin).
    pub fn ops(&self) -> Vec<(usize, &str)> {
        self.nodes
            .iter()
            .filter_map(|n| match n {
                Node::Launch { stream, label, .. } => Some((*stream, label.as_str())),
                _ => None,
            })
            .collect()
    }

    pub fn nodes(&self) -> &[Node<B>] {
        &self.nodes
    }

    /// Clones of the captured ops, in capture order: what a backend keeps alive while a native
    /// launch of the graph may still read their buffers.
    pub fn launched_ops(&self) -> Vec<Op<B>> {
        self.nodes
            .iter()
            .filter_map(|n| match n {
                Node::Launch { op, .. } => Some(op.op().clone()),
                _ => None,
            })
            .collect()
    }

    /// The streams (beyond the origin) and events a replay uses, made by `stream` and `event` on
    /// the first call and the same after.
    pub fn replay_handles(
        &self,
        stream: impl Fn() -> Result<B::Stream>,
        event: impl Fn() -> Result<B::Event>,
    ) -> Result<ReplayHandles<B>> {
        let mut handles = self.handles.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(h) = handles.as_ref() {
            return Ok(h.clone());
        }
        let streams = (1..self.streams).map(|_| stream()).collect::<Result<Vec<_>>>()?;
        let events = (0..self.events).map(|_| event()).collect::<Result<Vec<_>>>()?;
        *handles = Some((streams, events));
        Ok(handles.as_ref().map(Clone::clone).unwrap_or_default())
    }
}

impl<B: Resources> Graph<B> {
    /// A graph of checked `nodes` over `streams` captured streams and `events` events.
    pub(crate) fn new(
        instance: InstanceId,
        nodes: Vec<Node<B>>,
        streams: usize,
        events: usize,
    ) -> Self {
        static NEXT_GRAPH: AtomicU64 = AtomicU64::new(0);
        Self {
            instance,
            id: NEXT_GRAPH.fetch_add(1, Ordering::Relaxed),
            nodes,
            streams,
            events,
            handles: Mutex::new(None),
        }
    }
}
