//! [`Layer`] and [`Cache`]: one KDA layer of a checkpoint on a [`Runtime`], run on the engine's
//! arrays (and, on a device backend, the engine's stream).

use std::path::Path;
use std::sync::{Mutex, PoisonError};

use kda_core::{Backend, DType, Tensor};
use kda_model::config::{KdaConfig, Tp};
use kda_model::layer::{BatchMeta, KdaLayer, LayerOptions, RequestSlots, StateCache};
use kda_model::schedule::ProjectionSchedule;
use kda_model::weights::{Checkpoint, WeightError};

use crate::array::{ForeignArray, Import};
use crate::error::{EmbedError, Result};
use crate::runtime::{AnyRuntime, Runtime, Session};

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

/// A layer on one backend (boxed: the variants differ in size).
enum AnyLayer {
    Reference(Box<KdaLayer<kda_reference::ReferenceBackend>>),
    #[cfg(feature = "cuda")]
    Cuda(Box<KdaLayer<kda_cuda::CudaBackend>>),
    #[cfg(feature = "ascend")]
    Ascend(Box<KdaLayer<kda_ascend::AscendBackend>>),
}

/// A cache on one backend.
enum AnyCache {
    Reference(StateCache<kda_reference::ReferenceBackend>),
    #[cfg(feature = "cuda")]
    Cuda(StateCache<kda_cuda::CudaBackend>),
    #[cfg(feature = "ascend")]
    Ascend(StateCache<kda_ascend::AscendBackend>),
}

impl AnyCache {
    fn backend(&self) -> &'static str {
        match self {
            AnyCache::Reference(_) => "reference",
            #[cfg(feature = "cuda")]
            AnyCache::Cuda(_) => "cuda",
            #[cfg(feature = "ascend")]
            AnyCache::Ascend(_) => "ascend",
        }
    }
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
    runtime: Runtime,
    layer: AnyLayer,
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
    cache: Mutex<AnyCache>,
    slots: usize,
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
    let options = LayerOptions { schedule: Some(schedule), ..LayerOptions::default() };
    let loaded = KdaLayer::load(&s.device, &s.stream, &checkpoint, &config, tp, layer, options)?;
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
        let any = match &*runtime.inner {
            AnyRuntime::Reference(s) => {
                AnyLayer::Reference(Box::new(load_on(s, dir, layer, tp, schedule)?))
            }
            #[cfg(feature = "cuda")]
            AnyRuntime::Cuda(s) => AnyLayer::Cuda(Box::new(load_on(s, dir, layer, tp, schedule)?)),
            #[cfg(feature = "ascend")]
            AnyRuntime::Ascend(s) => {
                AnyLayer::Ascend(Box::new(load_on(s, dir, layer, tp, schedule)?))
            }
        };
        let dims = match &any {
            AnyLayer::Reference(l) => *l.dims(),
            #[cfg(feature = "cuda")]
            AnyLayer::Cuda(l) => *l.dims(),
            #[cfg(feature = "ascend")]
            AnyLayer::Ascend(l) => *l.dims(),
        };
        let info = LayerInfo {
            hidden_size: dims.hidden,
            local_heads: dims.local_heads,
            head_dim: dims.head_dim,
            conv_width: dims.conv_width,
        };
        Ok(Self { runtime: runtime.clone(), layer: any, info, schedule, lock: Mutex::new(()) })
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
        let cache = match (&*self.runtime.inner, &self.layer) {
            (AnyRuntime::Reference(s), AnyLayer::Reference(l)) => {
                AnyCache::Reference(new_cache_on(s, l, n, spec)?)
            }
            #[cfg(feature = "cuda")]
            (AnyRuntime::Cuda(s), AnyLayer::Cuda(l)) => {
                AnyCache::Cuda(new_cache_on(s, l, n, spec)?)
            }
            #[cfg(feature = "ascend")]
            (AnyRuntime::Ascend(s), AnyLayer::Ascend(l)) => {
                AnyCache::Ascend(new_cache_on(s, l, n, spec)?)
            }
            #[allow(unreachable_patterns)]
            _ => return Err(EmbedError::Panic("a layer outside its runtime".into())),
        };
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
        let meta = batch.to_meta()?;
        let _serial = self.lock.lock().unwrap_or_else(PoisonError::into_inner);
        let mut guard = cache.cache.lock().unwrap_or_else(PoisonError::into_inner);
        let rt_name = self.runtime.name();
        let rt = &*self.runtime.inner;
        match (rt, &self.layer, &mut *guard) {
            (AnyRuntime::Reference(s), AnyLayer::Reference(l), AnyCache::Reference(c)) => {
                // SAFETY: forwarded contract.
                unsafe { forward_on(s, l, c, hidden_states, &meta, out, stream) }
            }
            #[cfg(feature = "cuda")]
            (AnyRuntime::Cuda(s), AnyLayer::Cuda(l), AnyCache::Cuda(c)) => {
                // SAFETY: forwarded contract.
                unsafe { forward_on(s, l, c, hidden_states, &meta, out, stream) }
            }
            #[cfg(feature = "ascend")]
            (AnyRuntime::Ascend(s), AnyLayer::Ascend(l), AnyCache::Ascend(c)) => {
                // SAFETY: forwarded contract.
                unsafe { forward_on(s, l, c, hidden_states, &meta, out, stream) }
            }
            #[allow(unreachable_patterns)]
            (_, _, c) => Err(EmbedError::BackendMismatch {
                what: "cache",
                layer: rt_name,
                other: c.backend(),
            }),
        }
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
unsafe fn forward_on<B: Backend>(
    s: &Session<B>,
    layer: &KdaLayer<B>,
    cache: &mut StateCache<B>,
    hidden_states: ForeignArray,
    meta: &BatchMeta,
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
    layer.forward(stream, &x, meta, cache, &mut out)?;
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
        match &*guard {
            AnyCache::Reference(c) => c.dims().num_spec,
            #[cfg(feature = "cuda")]
            AnyCache::Cuda(c) => c.dims().num_spec,
            #[cfg(feature = "ascend")]
            AnyCache::Ascend(c) => c.dims().num_spec,
        }
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
        let rt_name = layer.runtime.name();
        match (&*layer.runtime.inner, &*guard) {
            (AnyRuntime::Reference(s), AnyCache::Reference(c)) => download_slot(s, c, slot),
            #[cfg(feature = "cuda")]
            (AnyRuntime::Cuda(s), AnyCache::Cuda(c)) => download_slot(s, c, slot),
            #[cfg(feature = "ascend")]
            (AnyRuntime::Ascend(s), AnyCache::Ascend(c)) => download_slot(s, c, slot),
            #[allow(unreachable_patterns)]
            (_, c) => Err(EmbedError::BackendMismatch {
                what: "cache",
                layer: rt_name,
                other: c.backend(),
            }),
        }
    }
}

fn download_slot<B: Backend>(s: &Session<B>, c: &StateCache<B>, slot: usize) -> Result<Vec<f32>> {
    let t = c.recurrent_slot(slot)?;
    Ok(s.device.download::<f32>(&s.stream, &t)?)
}
