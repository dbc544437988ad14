//! Graph capture with the ACL rule: every stream forked into a capture must be joined back to
//! the origin stream before the capture ends.
//!
//! While a capture is open, work queued on a captured stream is not run: it becomes a node of
//! the graph. A stream joins the capture by waiting on an event recorded inside it (directly or
//! through another captured stream). Ending the capture checks the rules with vector clocks
//! over the captured nodes, as the device runtime would reject the capture.

use std::collections::HashMap;

use crate::error::CaptureError;
use crate::error::Result;
use crate::graph::{Graph, Node};
use crate::op::Validated;
use crate::resource::{EventId, InstanceId, Resources, StreamId};

/// Per captured stream: its index, nodes so far, and its vector clock over captured streams.
#[derive(Debug, Default)]
struct CapStream {
    index: usize,
    count: u64,
    clock: HashMap<usize, u64>,
    last_label: String,
}

/// An open capture.
pub(crate) struct Capture<B: Resources> {
    origin: StreamId,
    streams: HashMap<StreamId, CapStream>,
    order: Vec<StreamId>,
    /// Events recorded inside the capture: their index and the snapshot of the record.
    events: HashMap<EventId, (usize, HashMap<usize, u64>)>,
    event_count: usize,
    nodes: Vec<Node<B>>,
    violation: Option<CaptureError>,
}

impl<B: Resources> Capture<B> {
    pub(crate) fn new(origin: StreamId) -> Self {
        let mut capture = Self {
            origin,
            streams: HashMap::new(),
            order: Vec::new(),
            events: HashMap::new(),
            event_count: 0,
            nodes: Vec::new(),
            violation: None,
        };
        capture.join(origin);
        capture
    }

    pub(crate) fn origin(&self) -> StreamId {
        self.origin
    }

    pub(crate) fn is_captured(&self, stream: StreamId) -> bool {
        self.streams.contains_key(&stream)
    }

    /// Whether a wait on `event` pulls a stream into this capture.
    pub(crate) fn is_captured_event(&self, event: EventId) -> bool {
        self.events.contains_key(&event)
    }

    fn join(&mut self, stream: StreamId) -> &mut CapStream {
        let index = self.order.len();
        if !self.streams.contains_key(&stream) {
            self.order.push(stream);
        }
        self.streams.entry(stream).or_insert_with(|| CapStream { index, ..CapStream::default() })
    }

    fn tick(&mut self, stream: StreamId, label: &str) -> usize {
        let s = self.join(stream);
        s.count += 1;
        let (index, count) = (s.index, s.count);
        s.clock.insert(index, count);
        s.last_label = label.to_string();
        index
    }

    pub(crate) fn launch(&mut self, stream: StreamId, label: &str, op: Validated<B>) {
        let index = self.tick(stream, label);
        self.nodes.push(Node::Launch { stream: index, label: label.to_string(), op: Box::new(op) });
    }

    pub(crate) fn record(&mut self, event: EventId, stream: StreamId) {
        let index = self.tick(stream, "record");
        let snapshot = self.streams[&stream].clock.clone();
        let next = self.event_count;
        let slot = self.events.entry(event).or_insert((next, HashMap::new()));
        if slot.0 == next {
            self.event_count += 1;
        }
        slot.1 = snapshot;
        let event_index = slot.0;
        self.nodes.push(Node::Record { stream: index, event: event_index });
    }

    /// A wait while the capture is open: on an event recorded inside it, the waiting stream joins
    /// the capture; a captured stream must not wait on any other event.
    pub(crate) fn wait(&mut self, stream: StreamId, event: EventId) {
        let Some((event_index, snapshot)) = self.events.get(&event).cloned() else {
            if self.is_captured(stream) {
                self.violate(CaptureError::ExternalEvent { stream, origin: self.origin, event });
            }
            return;
        };
        let index = self.tick(stream, "wait");
        let s = self.streams.get_mut(&stream).map(|s| &mut s.clock);
        if let Some(clock) = s {
            for (k, v) in snapshot {
                let entry = clock.entry(k).or_insert(0);
                *entry = (*entry).max(v);
            }
        }
        self.nodes.push(Node::Wait { stream: index, event: event_index });
    }

    /// An event re-recorded outside the capture no longer pulls streams into it.
    pub(crate) fn forget_event(&mut self, event: EventId) {
        self.events.remove(&event);
    }

    /// A free on a captured stream: not capturable.
    pub(crate) fn free(&mut self, stream: StreamId) -> CaptureError {
        let error = CaptureError::FreeInCapture { stream, origin: self.origin };
        self.violate(error.clone());
        error
    }

    /// The host blocked on a captured stream.
    pub(crate) fn host_sync(&mut self, stream: StreamId, call: &'static str) -> CaptureError {
        let error = CaptureError::HostSyncInCapture { stream, origin: self.origin, call };
        self.violate(error.clone());
        error
    }

    fn violate(&mut self, error: CaptureError) {
        self.violation.get_or_insert(error);
    }

    /// Check the rules and turn the capture into a graph.
    pub(crate) fn finish(self, instance: InstanceId) -> Result<Graph<B>, CaptureError> {
        if let Some(v) = self.violation {
            return Err(v);
        }
        let origin = &self.streams[&self.origin];
        for stream in self.order.iter().skip(1) {
            let s = &self.streams[stream];
            let seen = origin.clock.get(&s.index).copied().unwrap_or(0);
            if seen == 0 {
                return Err(CaptureError::NotJoined { stream: *stream, origin: self.origin });
            }
            if seen < s.count {
                return Err(CaptureError::WorkAfterJoin {
                    stream: *stream,
                    origin: self.origin,
                    label: s.last_label.clone(),
                });
            }
        }
        Ok(Graph::new(instance, self.nodes, self.order.len(), self.event_count))
    }
}
