//! Captured HAL graphs as ACL model runtime instances (`aclmdlRI`).
//!
//! [`Device::begin_capture`]/[`Device::end_capture`] record and validate the graph in
//! kda-core (the ACL join rule, no host blocking, no frees). [`AscendBackend::instantiate`] then
//! replays it into `aclmdlRICaptureBegin` … `aclmdlRICaptureEnd` on the ACL streams — every
//! aclnn executor prepared and made repeatable *before* the capture begins — and
//! [`AclGraph::launch`] runs the instance with `aclmdlRIExecuteAsync`. The runtime checks the
//! join rule again at `aclmdlRICaptureEnd`.
//!
//! [`Device::launch_graph`] runs a graph of this instance the same way (through
//! [`Backend::prepare_graph`] and [`Backend::launch_native_graph`]): instantiated at its first
//! launch, cached by [`Graph::id`] and executed with `aclmdlRIExecuteAsync` on every launch. The one exception, decided per graph at its first launch: a graph with host
//! functions (`Host`, and `Download`, which uses one) cannot be captured by ACL, so it is
//! replayed op by op, as kda-core's default `launch_graph` does.
//!
//! [`Device::begin_capture`]: kda_core::Device::begin_capture
//! [`Device::end_capture`]: kda_core::Device::end_capture
//! [`Device::launch_graph`]: kda_core::Device::launch_graph

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use kda_core::graph::{Graph, Node};
use kda_core::hal::GraphReplay;
use kda_core::{Backend, Op, Result};

use super::acl::{self, check};
use super::host;
use super::ops::{self, Step};
use super::{AscendBackend, AscendEvent, AscendStream};
use crate::error::AscendError;
use crate::sys;

/// An instantiated graph: the model, and everything its captured work refers to (executors,
/// workspaces, descriptors, temporaries, forked streams, events).
#[derive(Clone, Debug)]
pub struct AclGraph {
    model: Arc<Model>,
}

#[derive(Debug)]
struct Model {
    ri: usize,
    // Dropped after `aclmdlRIDestroy` (field order): repeatable executors go with them.
    _steps: Vec<Vec<Step>>,
    handles: Handles,
}

impl Drop for Model {
    fn drop(&mut self) {
        // SAFETY: created by `aclmdlRICaptureEnd`, destroyed once, after every launch of it was
        // synchronized (launches keep the model alive in their stream).
        let _ = unsafe { sys::aclmdlRIDestroy(self.ri as sys::aclmdlRI) };
    }
}

/// The streams forked off the origin (graph stream `i` ≥ 1 is `forks[i - 1]`) and the events of
/// a graph, this instance's own.
#[derive(Clone, Debug)]
struct Handles {
    forks: Vec<AscendStream>,
    events: Vec<AscendEvent>,
}

impl Handles {
    fn new(b: &AscendBackend, graph: &Graph<AscendBackend>) -> Result<Self> {
        let event_count = graph
            .nodes()
            .iter()
            .filter_map(|n| match n {
                Node::Record { event, .. } | Node::Wait { event, .. } => Some(*event + 1),
                Node::Launch { .. } => None,
            })
            .max()
            .unwrap_or(0);
        Ok(Self {
            forks: (1..graph.streams()).map(|_| b.new_stream()).collect::<Result<_>>()?,
            events: (0..event_count).map(|_| b.new_event()).collect::<Result<_>>()?,
        })
    }

    /// The stream graph stream `i` runs on when `origin` is the graph's stream 0.
    fn stream<'a>(&'a self, origin: &'a AscendStream, i: usize) -> &'a AscendStream {
        if i == 0 { origin } else { &self.forks[i - 1] }
    }
}

impl AclGraph {
    /// Run the instance on `stream` (`aclmdlRIExecuteAsync`), after the work submitted on it
    /// before (work held behind a host function is issued first).
    pub fn launch(&self, stream: &AscendStream) -> Result<()> {
        host::drain(&stream.inner, 0)?;
        // SAFETY: a live model and stream.
        check("aclmdlRIExecuteAsync", unsafe {
            sys::aclmdlRIExecuteAsync(self.model.ri as sys::aclmdlRI, stream.raw().get())
        })?;
        stream.inner.keep(Arc::clone(&self.model));
        Ok(())
    }
}

/// How [`Device::launch_graph`](kda_core::Device::launch_graph) runs each graph of one instance, decided and built at the
/// graph's first launch and kept, keyed by [`Graph::id`], until
/// [`AscendBackend::release_graph`] or the instance is dropped.
#[derive(Debug, Default)]
pub(crate) struct GraphCache(Mutex<HashMap<u64, Replay>>);

#[derive(Clone, Debug)]
enum Replay {
    /// The graph as an ACL model: one `aclmdlRIExecuteAsync` per launch.
    Model(AclGraph),
    /// The graph has host functions, which ACL cannot capture: its ops are launched one by one
    /// on these streams and events.
    Eager(Handles),
}

/// Whether ACL can capture `op`: host functions (and downloads, which queue one) it cannot.
fn capturable(op: &Op<AscendBackend>) -> bool {
    !matches!(op, Op::Host { .. } | Op::Download { .. })
}

impl AscendBackend {
    /// Capture `graph` (from [`Device::end_capture`](kda_core::Device::end_capture)) into an ACL model runtime instance whose
    /// origin is `origin`. Host functions (and downloads, which use them) cannot be captured by
    /// ACL and are rejected.
    pub fn instantiate(&self, graph: &Graph<Self>, origin: &AscendStream) -> Result<AclGraph> {
        self.enter()?;
        let handles = Handles::new(self, graph)?;
        // Phase one of every op before the capture begins.
        let mut steps = Vec::new();
        for node in graph.nodes() {
            if let Node::Launch { stream, label, op } = node {
                if !capturable(op.op()) {
                    return Err(AscendError::Unsupported {
                        op: "aclmdlRICaptureBegin",
                        message: format!(
                            "`{label}` needs a host function, which ACL cannot capture"
                        ),
                    }
                    .into());
                }
                let s = handles.stream(origin, *stream);
                steps.push(ops::prepare(self, s, op, true)?);
            }
        }
        // Work held on the host behind a host function is issued before the capture begins.
        host::drain(&origin.inner, 0)?;
        // No reuse event is queried while the capture is open.
        let _open = self.inner.pool.capture_open();
        // SAFETY: a live stream.
        check("aclmdlRICaptureBegin", unsafe {
            sys::aclmdlRICaptureBegin(origin.raw().get(), sys::ACL_MODEL_RI_CAPTURE_MODE_RELAXED)
        })?;
        let queued = queue(graph, &steps, &handles, origin);
        let mut ri: sys::aclmdlRI = std::ptr::null_mut();
        // Always end the capture, so a failure leaves no stream capturing.
        // SAFETY: a capturing stream, a valid out-parameter.
        let ended = check("aclmdlRICaptureEnd", unsafe {
            sys::aclmdlRICaptureEnd(origin.raw().get(), &mut ri)
        });
        let model = Model { ri: ri as usize, _steps: steps, handles };
        queued?;
        ended?;
        Ok(AclGraph { model: Arc::new(model) })
    }

    /// Drop what [`Device::launch_graph`](kda_core::Device::launch_graph) built for `graph` (its ACL model, or its replay
    /// streams and events) once the launches already queued have run; a later launch builds it
    /// again. Returns whether anything was cached. Dropping the backend (every clone) releases
    /// all of them.
    pub fn release_graph(&self, graph: &Graph<Self>) -> bool {
        self.inner
            .graphs
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&graph.id())
            .is_some()
    }

    /// The cached way to run `graph`, built on its first launch (the ACL capture on `origin`).
    fn replay_of(&self, graph: &Graph<Self>, origin: &AscendStream) -> Result<Replay> {
        let mut cache = self.inner.graphs.0.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(replay) = cache.get(&graph.id()) {
            return Ok(replay.clone());
        }
        let all_capturable = graph.nodes().iter().all(|n| match n {
            Node::Launch { op, .. } => capturable(op.op()),
            _ => true,
        });
        let replay = if all_capturable {
            Replay::Model(self.instantiate(graph, origin)?)
        } else {
            tracing::debug!(graph = graph.id(), "host functions: the graph is replayed eagerly");
            Replay::Eager(Handles::new(self, graph)?)
        };
        cache.insert(graph.id(), replay.clone());
        Ok(replay)
    }

    /// [`Backend::prepare_graph`]: the graph's ACL model (built on its first launch, with
    /// `origin` as the capture's origin) and its streams and events, or, for a graph with host
    /// functions, streams and events to replay it op by op on.
    pub(crate) fn prepare_graph_impl(
        &self,
        graph: &Graph<Self>,
        origin: &AscendStream,
    ) -> Result<GraphReplay<Self>> {
        self.enter()?;
        Ok(match self.replay_of(graph, origin)? {
            Replay::Eager(h) => GraphReplay { forks: h.forks, events: h.events, native: false },
            Replay::Model(m) => {
                let h = &m.model.handles;
                GraphReplay { forks: h.forks.clone(), events: h.events.clone(), native: true }
            }
        })
    }

    /// [`Backend::launch_native_graph`]: one `aclmdlRIExecuteAsync` of the graph's model.
    pub(crate) fn launch_native_graph_impl(
        &self,
        graph: &Graph<Self>,
        stream: &AscendStream,
    ) -> Result<()> {
        self.enter()?;
        let Replay::Model(model) = self.replay_of(graph, stream)? else {
            return Err(AscendError::Unsupported {
                op: "aclmdlRIExecuteAsync",
                message: "a graph with host functions is replayed op by op".into(),
            }
            .into());
        };
        model.launch(stream)?;
        // The ops' views keep their buffers alive until the stream has run the model, even if
        // the caller drops the graph at once.
        let ops = graph.launched_ops();
        stream.inner.keep(ops);
        Ok(())
    }
}

fn queue(
    graph: &Graph<AscendBackend>,
    steps: &[Vec<Step>],
    handles: &Handles,
    origin: &AscendStream,
) -> Result<()> {
    let mut prepared = steps.iter();
    for node in graph.nodes() {
        match node {
            Node::Launch { stream, .. } => {
                let Some(steps) = prepared.next() else { break };
                ops::issue_steps(handles.stream(origin, *stream), steps)?;
            }
            Node::Record { stream, event } => {
                handles.events[*event].inner.raw.record(handles.stream(origin, *stream).raw())?
            }
            Node::Wait { stream, event } => {
                acl::wait(handles.stream(origin, *stream).raw(), &handles.events[*event].inner.raw)?
            }
        }
    }
    Ok(())
}
