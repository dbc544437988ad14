//! [`Layer`] and [`Cache`]: one KDA layer of a checkpoint on a [`Runtime`], run on the engine's
//! arrays (and, on a device backend, the engine's stream).

use std::path::Path;
use std::sync::{Mutex, PoisonError};

use kda_core::{Backend, DType, Tensor};
use kda_model::config::{KdaConfig, Tp};
use kda_model::layer::{BatchMeta, KdaLayer, KeepState, LayerOptions, RequestSlots, StateCache};
use kda_model::schedule::ProjectionSchedule;
use kda_model::weights::{Checkpoint, MemorySource, TensorSource, WeightError};

use crate::array::{ForeignArray, Import};
use crate::backends::{Family, KnownBackend, PerBackend};
use crate::error::{EmbedError, Result};
use crate::on_backend;
use crate::runtime::{Runtime, Session};

/// `"serial"` or `"overlapped"`.
pub fn parse_schedule(name: &str) -> Result<ProjectionSchedule> {
    match name {
        "serial" => Ok(ProjectionSchedule::Serial),
        "overlapped" => Ok(ProjectionSchedule::Overlapped),
        other => Err(EmbedError::Argument {
            param: "schedule",
            expected: "\"serial\" or \"overlapped\"",
            actual: other.to_string(),
        }),
    }
}

/// One request's state slots, as an engine passes them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SlotsArg {
    /// One slot.
    Single(i64),
    /// A speculative decode's slot list (`num_spec + 1` entries).
    Speculative(Vec<i64>),
}

/// One step's metadata as an engine passes it: `query_start_loc` (`R + 1` offsets),
/// `num_computed_tokens` (`None`: all fresh), `slots` (`None`: request `r` in slot `r`),
/// `num_accepted_tokens` (speculative requests only; `None`: none are speculative).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BatchArgs {
    pub query_start_loc: Vec<i64>,
    pub num_computed_tokens: Option<Vec<i64>>,
    pub slots: Option<Vec<SlotsArg>>,
    pub num_accepted_tokens: Option<Vec<i64>>,
}

fn non_negative(param: &'static str, index: usize, value: i64) -> Result<usize> {
    usize::try_from(value).map_err(|_| EmbedError::MetadataValue {
        param,
        index,
        value,
        expected: ">= 0".into(),
    })
}

fn expect_len(param: &'static str, len: usize, requests: usize) -> Result<()> {
    if len == requests {
        return Ok(());
    }
    Err(kda_model::layer::BatchError::Length {
        param,
        expected: format!("{requests} (one per request)"),
        actual: len,
    }
    .into())
}

impl BatchArgs {
    /// The [`BatchMeta`] these arguments describe (its own checks run in the layer).
    pub fn to_meta(&self) -> Result<BatchMeta> {
        let qsl = self
            .query_start_loc
            .iter()
            .enumerate()
            .map(|(i, &v)| non_negative("query_start_loc", i, v))
            .collect::<Result<Vec<usize>>>()?;
        let requests = qsl.len().saturating_sub(1);
        let num_computed = match &self.num_computed_tokens {
            None => vec![0; requests],
            Some(v) => {
                expect_len("num_computed_tokens", v.len(), requests)?;
                v.iter()
                    .enumerate()
                    .map(|(i, &n)| non_negative("num_computed_tokens", i, n))
                    .collect::<Result<_>>()?
            }
        };
        if let Some(v) = &self.num_accepted_tokens {
            expect_len("num_accepted_tokens", v.len(), requests)?;
        }
        let slots = match &self.slots {
            None => (0..requests).map(RequestSlots::Single).collect(),
            Some(v) => {
                expect_len("slots", v.len(), requests)?;
                v.iter()
                    .enumerate()
                    .map(|(r, s)| self.request_slots(r, s))
                    .collect::<Result<_>>()?
            }
        };
        Ok(BatchMeta {
            num_actual_tokens: qsl.last().copied().unwrap_or(0),
            query_start_loc: qsl,
            num_computed_tokens: num_computed,
            slots,
        })
    }

    fn request_slots(&self, r: usize, slots: &SlotsArg) -> Result<RequestSlots> {
        match slots {
            SlotsArg::Single(s) => Ok(RequestSlots::Single(non_negative("slots", r, *s)?)),
            SlotsArg::Speculative(list) => {
                let slots = list
                    .iter()
                    .map(|&s| non_negative("slots", r, s))
                    .collect::<Result<Vec<usize>>>()?;
                let accepted = match &self.num_accepted_tokens {
                    Some(v) => non_negative("num_accepted_tokens", r, v[r])?,
                    None => {
                        return Err(EmbedError::MetadataValue {
                            param: "num_accepted_tokens",
                            index: r,
                            value: -1,
                            expected: "given for every speculative request (it was None)".into(),
                        });
                    }
                };
                Ok(RequestSlots::Speculative { slots, num_accepted: accepted })
            }
        }
    }
}

/// One state to keep (`Layer::forward_keeping_states`), as an engine passes it: the state of
/// request `request` after `position` tokens of its sequence, written into slot `slot`.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct KeepArg {
    pub request: i64,
    pub position: i64,
    pub slot: i64,
}

impl KeepArg {
    fn to_keep(self, index: usize) -> Result<KeepState> {
        Ok(KeepState {
            request: non_negative("keep_states.request", index, self.request)?,
            position: non_negative("keep_states.position", index, self.position)?,
            slot: non_negative("keep_states.slot", index, self.slot)?,
        })
    }
}

/// Layers on each backend (boxed: the variants differ in size).
pub(crate) struct Layers;

impl Family for Layers {
    type Of<B: Backend> = Box<KdaLayer<B>>;
}

/// Caches on each backend.
pub(crate) struct Caches;

impl Family for Caches {
    type Of<B: Backend> = StateCache<B>;
}

/// `cache` is on another backend than the layer's `runtime`.
pub(crate) fn mismatch(runtime: &Runtime, cache: &PerBackend<Caches>) -> EmbedError {
    EmbedError::BackendMismatch { what: "cache", layer: runtime.name(), other: cache.kind().name() }
}

/// The sizes of a loaded layer.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct LayerInfo {
    pub hidden_size: usize,
    pub local_heads: usize,
    pub head_dim: usize,
    pub conv_width: usize,
}

/// What a forward did with the engine's arrays.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct ForwardReport {
    /// Whether `hidden_states` was read in place or copied first.
    pub hidden_states: Import,
}

/// One KDA layer of a checkpoint for one TP rank, on a [`Runtime`]. `Send + Sync`: calls from
/// several threads are serialised (a layer's schedule reuses its auxiliary stream and events).
pub struct Layer {
    pub(crate) runtime: Runtime,
    pub(crate) layer: PerBackend<Layers>,
    info: LayerInfo,
    schedule: ProjectionSchedule,
    lock: Mutex<()>,
}

impl std::fmt::Debug for Layer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Layer")
            .field("backend", &self.runtime.name())
            .field("info", &self.info)
            .field("schedule", &self.schedule)
            .finish()
    }
}

/// A layer's per-slot state (recurrent and conv), owned by the engine. `Send + Sync`.
pub struct Cache {
    pub(crate) cache: Mutex<PerBackend<Caches>>,
    pub(crate) slots: usize,
}

impl std::fmt::Debug for Cache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cache").field("slots", &self.slots).finish()
    }
}

fn load_on<B: Backend>(
    s: &Session<B>,
    dir: &Path,
    layer: usize,
    tp: Tp,
    schedule: ProjectionSchedule,
) -> Result<KdaLayer<B>> {
    let config = KdaConfig::from_file(&dir.join("config.json")).map_err(WeightError::from)?;
    let checkpoint = Checkpoint::open(dir)?;
    from_source_on(s, &checkpoint, &config, layer, tp, schedule)
}

fn from_source_on<B: Backend>(
    s: &Session<B>,
    source: &dyn TensorSource,
    config: &KdaConfig,
    layer: usize,
    tp: Tp,
    schedule: ProjectionSchedule,
) -> Result<KdaLayer<B>> {
    let options = LayerOptions { schedule: Some(schedule), ..LayerOptions::default() };
    let loaded = KdaLayer::load(&s.device, &s.stream, source, config, tp, layer, options)?;
    s.device.synchronize(&s.stream)?;
    Ok(loaded)
}

impl Layer {
    /// Load layer `layer` of the HF-style checkpoint in `dir` for TP rank `tp_rank` of
    /// `tp_size` on `runtime`.
    pub fn load(
        runtime: &Runtime,
        dir: &Path,
        layer: usize,
        tp_size: usize,
        tp_rank: usize,
        schedule: ProjectionSchedule,
    ) -> Result<Self> {
        let tp = Tp::new(tp_size, tp_rank).map_err(WeightError::from)?;
        let any = on_backend!(&*runtime.inner, |B, s| {
            B::wrap::<Layers>(Box::new(load_on(s, dir, layer, tp, schedule)?))
        });
        Ok(Self::wrap(runtime, any, schedule))
    }

    /// Build layer `layer` for TP rank `tp_rank` of `tp_size` from weights the engine holds in
    /// memory: `weights` maps the checkpoint's names (`model.layers.{i}.self_attn.q_proj.weight`,
    /// ...) to host arrays, read in place (a non-contiguous one is copied once). The same
    /// loader as [`Layer::load`] runs on them: the same checks and the same fused BFG, so the
    /// same layer bit for bit.
    #[allow(clippy::too_many_arguments)]
    pub fn from_weights(
        runtime: &Runtime,
        config: &KdaConfig,
        weights: &[(String, ForeignArray)],
        layer: usize,
        tp_size: usize,
        tp_rank: usize,
        schedule: ProjectionSchedule,
    ) -> Result<Self> {
        let tp = Tp::new(tp_size, tp_rank).map_err(WeightError::from)?;
        config.validate().map_err(WeightError::from)?;
        let bytes = weights
            .iter()
            .map(|(name, a)| a.host_bytes(name).map(|b| (name, a, b)))
            .collect::<Result<Vec<_>>>()?;
        let mut source = MemorySource::new("weights from memory");
        for (name, a, b) in &bytes {
            source.insert(name.as_str(), a.dtype(), a.shape(), b)?;
        }
        let c = config;
        let any = on_backend!(&*runtime.inner, |B, s| {
            B::wrap::<Layers>(Box::new(from_source_on(s, &source, c, layer, tp, schedule)?))
        });
        Ok(Self::wrap(runtime, any, schedule))
    }

    fn wrap(runtime: &Runtime, any: PerBackend<Layers>, schedule: ProjectionSchedule) -> Self {
        let dims = on_backend!(&any, |B, l| *l.dims());
        let info = LayerInfo {
            hidden_size: dims.hidden,
            local_heads: dims.local_heads,
            head_dim: dims.head_dim,
            conv_width: dims.conv_width,
        };
        Self { runtime: runtime.clone(), layer: any, info, schedule, lock: Mutex::new(()) }
    }

    pub fn info(&self) -> LayerInfo {
        self.info
    }

    pub fn schedule(&self) -> ProjectionSchedule {
        self.schedule
    }

    pub fn runtime(&self) -> &Runtime {
        &self.runtime
    }

    /// A zeroed cache of `num_slots` slots with room for `num_spec` speculative tokens per step.
    pub fn new_cache(&self, num_slots: usize, num_spec: usize) -> Result<Cache> {
        self.new_cache_unlabelled(num_slots, num_spec).map_err(|e| EmbedError::NewCache {
            num_slots,
            num_spec,
            source: Box::new(e),
        })
    }

    fn new_cache_unlabelled(&self, num_slots: usize, num_spec: usize) -> Result<Cache> {
        let (n, spec) = (num_slots, num_spec);
        let cache = on_backend!(&*self.runtime.inner, |B, s| {
            let l = B::get(&self.layer)
                .ok_or_else(|| EmbedError::Panic("a layer outside its runtime".into()))?;
            B::wrap::<Caches>(new_cache_on(s, l, n, spec)?)
        });
        Ok(Cache { cache: Mutex::new(cache), slots: num_slots })
    }

    /// Run the layer on `hidden_states` `[N, hidden]` (bf16 or f32) for `batch`, reading and
    /// updating `cache`, writing this rank's partial output (before the all-reduce) into `out`
    /// `[N, hidden]` (bf16, f16 or f32, written in place). With `stream` (a device backend's
    /// `CUstream` / `aclrtStream`), the work is queued on the engine's stream and the call
    /// returns at once; without, it runs on kda's own stream and the call returns with `out`
    /// and the cache complete. Every check runs before anything is queued: a rejected call
    /// leaves `out` and the cache as they were.
    ///
    /// # Safety
    /// `stream`, if given, is a live stream of this runtime's device that outlives the runtime
    /// (kda imports it once and keeps it, see `kda_core::Device::import_stream`), and the arrays'
    /// memory is ordered with it as `kda_core::Device::import_buffer` says.
    pub unsafe fn forward(
        &self,
        hidden_states: ForeignArray,
        batch: &BatchArgs,
        cache: &Cache,
        out: ForeignArray,
        stream: Option<usize>,
    ) -> Result<ForwardReport> {
        // SAFETY: the caller's contract, forwarded.
        unsafe { self.forward_keeping_states(hidden_states, batch, &[], cache, out, stream) }
    }

    /// [`Layer::forward`], also writing the states `keep` asks for: for each `(request,
    /// position, slot)`, the state of prefill request `request` after `position` tokens of its
    /// sequence (counting `num_computed_tokens`: `num_computed_tokens + 64·j` or the request's
    /// end) into cache slot `slot`, as `KdaLayer::forward_keeping_states` does
    /// (`docs/design/kda.md#chunk-boundary-states`). A bad entry is a metadata error and
    /// nothing is run.
    ///
    /// # Safety
    /// As [`Layer::forward`].
    pub unsafe fn forward_keeping_states(
        &self,
        hidden_states: ForeignArray,
        batch: &BatchArgs,
        keep: &[KeepArg],
        cache: &Cache,
        out: ForeignArray,
        stream: Option<usize>,
    ) -> Result<ForwardReport> {
        let meta = batch.to_meta()?;
        let keep = keep
            .iter()
            .enumerate()
            .map(|(i, k)| k.to_keep(i))
            .collect::<Result<Vec<KeepState>>>()?;
        let keep = &keep[..];
        let _serial = self.lock.lock().unwrap_or_else(PoisonError::into_inner);
        let mut guard = cache.cache.lock().unwrap_or_else(PoisonError::into_inner);
        let cache = &mut *guard;
        on_backend!(&*self.runtime.inner, |B, s| {
            let (Some(l), Some(c)) = (B::get(&self.layer), B::get_mut(cache)) else {
                return Err(mismatch(&self.runtime, cache));
            };
            // SAFETY: forwarded contract.
            unsafe { forward_on(s, l, c, hidden_states, &meta, keep, out, stream) }
        })
    }
}

fn new_cache_on<B: Backend>(
    s: &Session<B>,
    layer: &KdaLayer<B>,
    slots: usize,
    num_spec: usize,
) -> Result<StateCache<B>> {
    let cache = layer.new_cache(&s.stream, slots, num_spec)?;
    s.device.synchronize(&s.stream)?;
    Ok(cache)
}

/// The forward on one backend (see [`Layer::forward`]).
///
/// # Safety
/// As [`Layer::forward`].
#[allow(clippy::too_many_arguments)]
unsafe fn forward_on<B: Backend>(
    s: &Session<B>,
    layer: &KdaLayer<B>,
    cache: &mut StateCache<B>,
    hidden_states: ForeignArray,
    meta: &BatchMeta,
    keep: &[KeepState],
    out: ForeignArray,
    stream: Option<usize>,
) -> Result<ForwardReport> {
    let engine = match stream {
        // SAFETY: the caller's stream contract.
        Some(handle) => Some(unsafe { s.engine_stream(handle) }?),
        None => None,
    };
    let stream = engine.as_ref().unwrap_or(&s.stream);
    hidden_states.expect_rank("hidden_states", 2, "[N, hidden_size]")?;
    hidden_states.expect_dtype("hidden_states", &[DType::BF16, DType::F32])?;
    out.expect_dtype("out", &[DType::F32, DType::BF16, DType::F16])?;
    let (x, import) = hidden_states.to_tensor(&s.device, stream, "hidden_states", true)?;
    let mut out = output_tensor(s, stream, out)?;
    layer.forward_keeping_states(stream, &x, meta, keep, cache, &mut out)?;
    if engine.is_none() {
        s.device.synchronize(stream)?;
    }
    Ok(ForwardReport { hidden_states: import })
}

/// `out` as written in place: it must import without a copy.
fn output_tensor<B: Backend>(
    s: &Session<B>,
    stream: &B::Stream,
    out: ForeignArray,
) -> Result<Tensor<B>> {
    match out.to_tensor(&s.device, stream, "out", false)? {
        (t, Import::InPlace) => Ok(t),
        (_, Import::Copied) => Err(EmbedError::Array {
            param: "out",
            message: format!(
                "must be memory the {} backend writes in place (aligned to 4 bytes, \
                 non-negative strides)",
                s.device.info().name
            ),
        }),
    }
}

impl Cache {
    pub fn num_slots(&self) -> usize {
        self.slots
    }

    /// The speculative tokens per step the cache has room for (what bounds a batch's
    /// `num_spec`).
    pub fn num_spec(&self) -> usize {
        let guard = self.cache.lock().unwrap_or_else(PoisonError::into_inner);
        on_backend!(&*guard, |B, c| c.dims().num_spec)
    }

    /// Slot `slot`'s recurrent state `[lh, V, K]` f32 (v-first), once kda's own stream has
    /// finished (after a forward on an engine stream, synchronize that stream first).
    pub fn recurrent_state(&self, layer: &Layer, slot: usize) -> Result<Vec<f32>> {
        if slot >= self.slots {
            return Err(EmbedError::MetadataBound {
                param: "slot",
                value: slot as i128,
                expected: format!("< {} (the cache's slots)", self.slots),
            });
        }
        let guard = self.cache.lock().unwrap_or_else(PoisonError::into_inner);
        on_backend!(&*layer.runtime.inner, |B, s| match B::get(&*guard) {
            Some(c) => download_slot(s, c, slot),
            None => Err(mismatch(&layer.runtime, &guard)),
        })
    }
}

fn download_slot<B: Backend>(s: &Session<B>, c: &StateCache<B>, slot: usize) -> Result<Vec<f32>> {
    let t = c.recurrent_slot(slot)?;
    Ok(s.device.download::<f32>(&s.stream, &t)?)
}
