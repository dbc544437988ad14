//! HAL graphs as CUDA graphs.
//!
//! The HAL captures as on every backend (recorded ops and event edges, validated at
//! `end_capture`: streams joined, no host block). On the first `launch_graph` of a graph on a
//! stream, the backend replays that record into a real stream capture on the stream
//! (`cuStreamBeginCapture`; forks and joins through the graph's own events; cuBLAS handles with
//! their workspaces made beforehand), instantiates it once, and from then on a launch is one
//! `cuGraphLaunch` (see [`crate::graph_recipe`] for what is captured and how failure records
//! travel).
//!
//! Graphs holding host work (host functions, downloads) replay through the façade instead, op
//! by op, as the HAL's default does. Checked mode and a capture open on the origin see a native
//! graph's nodes through the façade before it launches (`Device::launch_graph`).
//!
//! A CUDA graph keeps its own fork streams, events, snapshot slots, the scratch and pinned
//! staging its capture allocated, and clones of its ops (so the buffers it addresses outlive
//! it). Graphs are kept per (graph, origin stream), the most recent [`MAX_GRAPHS`];
//! [`CudaBackend::forget_graph`] releases one's at once.

use std::sync::{Arc, Mutex, PoisonError};

use cudarc::driver::{CudaContext, sys};
use kda_core::graph::{Graph, Node};
use kda_core::hal::GraphReplay;
use kda_core::{Backend, Op, Result, StreamHandle, Validated};

use super::memory::{DeviceMemory, driver};
use super::module::args;
use super::scratch::{self, Owned};
use super::{CudaBackend, CudaEvent, CudaStream};
use crate::graph_recipe::{self, GraphRecipe, Step};
use crate::{CudaError, GraphRoute};

/// CUDA graphs kept per instance before the least recently built is released.
pub const MAX_GRAPHS: usize = 32;

/// One graph's way of running on one origin stream.
enum Route {
    /// The instantiated graph, with the HAL streams and events standing for its forks and
    /// events (whose ids checked mode logs).
    Native { graph: Mutex<NativeGraph>, forks: Vec<CudaStream>, events: Vec<CudaEvent> },
    /// The forked streams and events a launch-path replay uses.
    Replay { reason: String, forks: Vec<CudaStream>, events: Vec<CudaEvent> },
}

/// A graph's id and the index of the stream it was built for.
type Key = (u64, u64);

/// The graphs built so far, oldest first.
#[derive(Default)]
pub(super) struct GraphCache {
    routes: Mutex<Vec<(Key, Arc<Route>)>>,
}

impl std::fmt::Debug for GraphCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.routes.lock().unwrap_or_else(PoisonError::into_inner).len();
        f.debug_struct("GraphCache").field("graphs", &n).finish()
    }
}

/// An instantiated CUDA graph and everything its nodes address.
struct NativeGraph {
    exec: sys::CUgraphExec,
    graph: sys::CUgraph,
    ctx: Arc<CudaContext>,
    _forks: Vec<CudaStream>,
    _events: Vec<CudaEvent>,
    _snapshots: DeviceMemory,
    _owned: Vec<Owned>,
    _ops: Vec<Op<CudaBackend>>,
}

// SAFETY: the graph and its executable are only used under the `Mutex` of their `Route`
// (CUDA graph objects must not be used by two threads at once); everything else it holds is
// `Send`, or device memory it owns.
unsafe impl Send for NativeGraph {}
// SAFETY: as for `Send`.
unsafe impl Sync for NativeGraph {}

impl Drop for NativeGraph {
    fn drop(&mut self) {
        // Failures leave nothing to recover (a torn-down context frees everything anyway).
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: both were created by `instantiate` and are destroyed once, here; a graph
            // still executing is released by the driver when it completes.
            unsafe {
                let _ = sys::cuGraphExecDestroy(self.exec);
                let _ = sys::cuGraphDestroy(self.graph);
            }
        }
    }
}

impl CudaBackend {
    /// `Backend::prepare_graph` on CUDA: the graph instantiated for `origin` (built on the first
    /// launch), or streams and events for a replay through the façade.
    pub(super) fn prepare_captured(
        &self,
        graph: &Graph<Self>,
        origin: &CudaStream,
    ) -> Result<GraphReplay<Self>> {
        Ok(match &*self.route(graph, origin)? {
            Route::Native { forks, events, .. } => {
                GraphReplay { forks: forks.clone(), events: events.clone(), native: true }
            }
            Route::Replay { forks, events, .. } => {
                GraphReplay { forks: forks.clone(), events: events.clone(), native: false }
            }
        })
    }

    /// `Backend::launch_native_graph` on CUDA: one `cuGraphLaunch`.
    pub(super) fn launch_captured(&self, graph: &Graph<Self>, stream: &CudaStream) -> Result<()> {
        let route = self.route(graph, stream)?;
        let Route::Native { graph: native, .. } = &*route else {
            return Err(CudaError::Driver {
                call: "cuGraphLaunch",
                message: "this graph replays op by op".into(),
            }
            .into());
        };
        let native = native.lock().unwrap_or_else(PoisonError::into_inner);
        self.bind()?;
        // SAFETY: a live executable of this context, launched on a live stream.
        unsafe { sys::cuGraphLaunch(native.exec, stream.raw()) }
            .result()
            .map_err(driver("cuGraphLaunch"))?;
        Ok(())
    }

    /// Build (if not yet built) how `graph` runs on `stream`, and say which way it is: a
    /// benchmark calls this before timing, a test to check a graph runs as one CUDA graph.
    pub fn instantiate_graph(
        &self,
        graph: &Graph<Self>,
        stream: &CudaStream,
    ) -> Result<GraphRoute> {
        Ok(match &*self.route(graph, stream)? {
            Route::Native { .. } => GraphRoute::Native,
            Route::Replay { reason, .. } => GraphRoute::Replay(reason.clone()),
        })
    }

    /// Release what was built for `graph` (its CUDA graphs, streams and memory) once its
    /// launches so far have finished.
    pub fn forget_graph(&self, graph: &Graph<Self>) {
        let mut routes = self.inner.graphs.routes.lock().unwrap_or_else(PoisonError::into_inner);
        routes.retain(|((id, _), _)| *id != graph.id());
    }

    fn route(&self, graph: &Graph<Self>, stream: &CudaStream) -> Result<Arc<Route>> {
        if graph.instance() != self.instance() || stream.id().instance != self.instance() {
            return Err(kda_core::CaptureError::ForeignGraph {
                graph: graph.instance(),
                backend: self.instance(),
            }
            .into());
        }
        let key = (graph.id(), stream.id().index);
        // Held while building: instantiation is rare, and two threads must not build twice.
        let mut routes = self.inner.graphs.routes.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((_, route)) = routes.iter().find(|(k, _)| *k == key) {
            return Ok(Arc::clone(route));
        }
        let route = Arc::new(self.build(graph, stream)?);
        if routes.len() >= MAX_GRAPHS {
            routes.remove(0);
        }
        routes.push((key, Arc::clone(&route)));
        Ok(route)
    }

    fn build(&self, graph: &Graph<Self>, stream: &CudaStream) -> Result<Route> {
        match graph_recipe::recipe(graph).map_err(|why| why.to_string()) {
            Ok(recipe) => {
                let native = self.instantiate(graph, &recipe, stream)?;
                let (forks, events) = (native._forks.clone(), native._events.clone());
                Ok(Route::Native { graph: Mutex::new(native), forks, events })
            }
            Err(reason) => {
                let forks =
                    (1..graph.streams()).map(|_| self.new_stream()).collect::<Result<_>>()?;
                let events = (0..graph_recipe::event_count(graph))
                    .map(|_| self.new_event())
                    .collect::<Result<_>>()?;
                Ok(Route::Replay { reason, forks, events })
            }
        }
    }

    /// Replay `recipe` into a stream capture on `origin` and instantiate it.
    fn instantiate(
        &self,
        graph: &Graph<Self>,
        recipe: &GraphRecipe,
        origin: &CudaStream,
    ) -> Result<NativeGraph> {
        let ctx = &self.inner.ctx;
        let forks = (1..recipe.streams).map(|_| self.new_stream()).collect::<Result<Vec<_>>>()?;
        let stream_of = |i: usize| if i == 0 { origin } else { &forks[i - 1] };
        // Made before the capture: creating a handle allocates its workspace.
        for i in 0..recipe.streams {
            self.blas(stream_of(i))?;
        }
        let events = (0..recipe.events).map(|_| self.new_event()).collect::<Result<Vec<_>>>()?;
        // The graph's own snapshot slots, zeroed before the capture (zeroing waits for its stream).
        let snapshots = DeviceMemory::new(ctx, 4 * recipe.events.max(1))?;
        snapshots.zero()?;
        let ops = graph.launched_ops();
        self.bind()?;
        let relaxed = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        let mut cu_graph: sys::CUgraph = std::ptr::null_mut();
        // While the capture is open no other thread waits for the whole device (which would
        // invalidate it): see `memory::capturing`.
        let (replayed, owned, ended) = super::memory::capturing(|| {
            // SAFETY: a live stream of the bound context, not already capturing (the HAL allows
            // one capture per instance, and replays are built under the cache lock).
            unsafe { sys::cuStreamBeginCapture_v2(origin.raw(), relaxed) }
                .result()
                .map_err(driver("cuStreamBeginCapture"))?;
            let (replayed, owned) = scratch::capture_scope(|| {
                recipe.steps.iter().try_for_each(|step| {
                    self.capture_step(graph, *step, &stream_of, &events, snapshots.ptr)
                })
            });
            // SAFETY: ends the capture begun above on the same stream; `cu_graph` receives it.
            let ended = unsafe { sys::cuStreamEndCapture(origin.raw(), &mut cu_graph) }.result();
            Ok::<_, CudaError>((replayed, owned, ended))
        })?;
        let destroy = |g: sys::CUgraph| {
            if !g.is_null() {
                // SAFETY: a graph made by this capture, not instantiated, destroyed once.
                let _ = unsafe { sys::cuGraphDestroy(g) };
            }
        };
        if let Err(e) = replayed {
            destroy(cu_graph);
            return Err(e);
        }
        if let Err(e) = ended {
            destroy(cu_graph);
            return Err(driver("cuStreamEndCapture")(e).into());
        }
        let mut exec: sys::CUgraphExec = std::ptr::null_mut();
        // SAFETY: `cu_graph` is the complete graph of the capture; `exec` receives its
        // executable.
        if let Err(e) = unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, cu_graph, 0) }.result()
        {
            destroy(cu_graph);
            return Err(driver("cuGraphInstantiateWithFlags")(e).into());
        }
        Ok(NativeGraph {
            exec,
            graph: cu_graph,
            ctx: Arc::clone(ctx),
            _forks: forks,
            _events: events,
            _snapshots: snapshots,
            _owned: owned,
            _ops: ops,
        })
    }

    /// One step of a recipe, queued on a capturing stream.
    fn capture_step<'a>(
        &self,
        graph: &Graph<Self>,
        step: Step,
        stream_of: &impl Fn(usize) -> &'a CudaStream,
        events: &[CudaEvent],
        snapshots: u64,
    ) -> Result<()> {
        let slot = |event: usize| snapshots + 4 * event as u64;
        match step {
            Step::Launch { stream, node } => match &graph.nodes()[node] {
                Node::Launch { label, op, .. } => {
                    self.submit(stream_of(stream), label, Validated::clone(op))
                }
                _ => Err(CudaError::Driver {
                    call: "cuStreamBeginCapture",
                    message: format!("graph node {node} is not an op"),
                }
                .into()),
            },
            Step::Record { stream, event } => {
                let s = stream_of(stream);
                let (status, slot) = (s.inner.status, slot(event));
                let one = (1, 1, 1);
                self.inner.kernels.launch(
                    s.raw(),
                    "kda_status_snapshot",
                    one,
                    one,
                    args!(status, slot),
                )?;
                super::engine::record_raw(&events[event].inner.event, s.raw())?;
                Ok(())
            }
            Step::Wait { stream, event, first } => {
                let s = stream_of(stream);
                super::engine::wait_raw(s.raw(), &events[event].inner.event)?;
                let (status, slot) = (s.inner.status, slot(event));
                let kernel = if first { "kda_status_reset" } else { "kda_status_inherit" };
                let one = (1, 1, 1);
                self.inner.kernels.launch(s.raw(), kernel, one, one, args!(status, slot))?;
                Ok(())
            }
        }
    }
}
