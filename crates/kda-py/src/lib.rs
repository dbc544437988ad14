//! `kda-py`: the `kda` Python package's native module (`kda._kda`), a thin PyO3 layer over
//! [`kda_embed`]: `kda.Layer`, `kda.StateCache`, `kda.quant`, `kda.core`, the `kda.Error`
//! classes, and the helpers `kda._testing` re-exports. Arrays are read without a copy where
//! their layout allows (`array`), the GIL is released while kda computes, and no panic crosses
//! into Python. The package's guide is `docs/embedding.md`.

#![deny(unsafe_op_in_unsafe_fn)]

mod array;
mod errors;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use kda_embed::ops::{self, CoreAlgo, CoreArgs, CoreOptions};
use kda_embed::testing::{self, LayerSpec, Step};
use kda_embed::{
    BatchArgs, Cache, CacheLayout, EmbedError, Import, KeepArg, Layer, Memory, Runtime, SlotsArg,
    guard, parse_schedule,
};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::errors::{
    BackendError, CheckpointError, Error, MetadataError, ShapeError, UnsupportedError, to_py,
};

/// Forwards whose `hidden_states` had to be copied (a layout kda cannot read in place): what
/// the tests' no-copy assertions read, through `kda._testing.input_copies()`.
static INPUT_COPIES: AtomicU64 = AtomicU64::new(0);

/// One KDA layer of a checkpoint for one TP rank.
#[pyclass(frozen, name = "Layer", module = "kda")]
struct PyLayer {
    layer: Arc<Layer>,
}

/// A layer's per-slot state (recurrent v-first `[lh, V, K]` f32, and conv), owned by the engine.
#[pyclass(frozen, name = "StateCache", module = "kda")]
struct PyStateCache {
    layer: Arc<Layer>,
    cache: Arc<Cache>,
}

/// A Python int (taken as `i128`, so a negative one or one past `usize` is said as given) as
/// the size `param`.
fn size(param: &'static str, value: i128) -> PyResult<usize> {
    usize::try_from(value).map_err(|_| {
        to_py(EmbedError::Count { param, value, expected: format!("0..={}", usize::MAX) })
    })
}

/// A sequence of ints (list, tuple, numpy or torch integer array) as `i64`s.
fn ints(param: &'static str, obj: &Bound<'_, PyAny>) -> PyResult<Vec<i64>> {
    let list = if obj.hasattr("tolist")? { obj.call_method0("tolist")? } else { obj.clone() };
    list.extract::<Vec<i64>>().map_err(|_| {
        PyTypeError::new_err(format!("{param}: expected a sequence of ints, got {obj:?}"))
    })
}

fn optional_ints(
    param: &'static str,
    obj: Option<&Bound<'_, PyAny>>,
) -> PyResult<Option<Vec<i64>>> {
    obj.filter(|o| !o.is_none()).map(|o| ints(param, o)).transpose()
}

/// `slots`: ints (plain requests) or int sequences (speculative slot lists).
fn slot_args(obj: &Bound<'_, PyAny>) -> PyResult<Vec<SlotsArg>> {
    let list = if obj.hasattr("tolist")? { obj.call_method0("tolist")? } else { obj.clone() };
    let items: Vec<Bound<'_, PyAny>> = list
        .extract()
        .map_err(|_| PyTypeError::new_err(format!("slots: expected a sequence, got {obj:?}")))?;
    items
        .iter()
        .map(|item| match item.extract::<i64>() {
            Ok(s) => Ok(SlotsArg::Single(s)),
            Err(_) => Ok(SlotsArg::Speculative(ints("slots", item)?)),
        })
        .collect()
}

/// `keep_states`: `(request, position, slot)` triples, or `None`.
fn keep_args(obj: Option<&Bound<'_, PyAny>>) -> PyResult<Vec<KeepArg>> {
    let Some(obj) = obj.filter(|o| !o.is_none()) else { return Ok(Vec::new()) };
    let list = if obj.hasattr("tolist")? { obj.call_method0("tolist")? } else { obj.clone() };
    let triples: Vec<(i64, i64, i64)> = list.extract().map_err(|_| {
        PyTypeError::new_err(format!(
            "keep_states: expected a sequence of (request, position, slot) int triples, got {obj:?}"
        ))
    })?;
    Ok(triples
        .into_iter()
        .map(|(request, position, slot)| KeepArg { request, position, slot })
        .collect())
}

impl PyLayer {
    /// The forward both `forward` and `forward_spec` are.
    #[allow(clippy::too_many_arguments)]
    fn run<'py>(
        &self,
        py: Python<'py>,
        hidden_states: &Bound<'py, PyAny>,
        batch: BatchArgs,
        cache: &Bound<'py, PyStateCache>,
        out: Option<&Bound<'py, PyAny>>,
        stream: Option<usize>,
        keep: Vec<KeepArg>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let x = array::foreign(py, "hidden_states", hidden_states, stream)?;
        x.expect_rank("hidden_states", 2, "[N, hidden_size]").map_err(to_py)?;
        let rows = x.shape()[0];
        let out = match out.filter(|o| !o.is_none()) {
            Some(o) => {
                array::expect_writable("out", o)?;
                o.clone()
            }
            // A new numpy array is host memory: a device backend writes the engine's own.
            None if x.memory() != Memory::Host => {
                return Err(to_py(EmbedError::Array {
                    param: "out",
                    message: format!(
                        "not given, for hidden_states in {}: pass out= (a device tensor \
                         [N, hidden_size]) to write",
                        x.memory()
                    ),
                }));
            }
            None => array::numpy_empty(py, "float32", &[rows, self.layer.info().hidden_size])?,
        };
        let out_array = array::foreign(py, "out", &out, stream)?;
        let layer = &*self.layer;
        let cache = &*cache.get().cache;
        let report = py
            .detach(|| {
                guard(|| {
                    // SAFETY: the arrays are kept alive by their owners (references to the
                    // Python objects); `stream` is the engine's live stream (its contract).
                    unsafe {
                        layer.forward_keeping_states(x, &batch, &keep, cache, out_array, stream)
                    }
                })
            })
            .map_err(to_py)?;
        if report.hidden_states == Import::Copied {
            INPUT_COPIES.fetch_add(1, Ordering::Relaxed);
        }
        Ok(out)
    }
}

#[pymethods]
impl PyLayer {
    /// Load layer `layer` of the HF-style checkpoint in `checkpoint_dir` for TP rank `tp_rank`
    /// of `tp_size`, on `backend` ("reference", or "cuda" / "ascend" where built with them)
    /// device `device`, with the projection `schedule` ("serial" or "overlapped").
    #[staticmethod]
    #[pyo3(signature = (checkpoint_dir, layer=0, tp_size=1, tp_rank=0, backend="reference", schedule="overlapped", device=0))]
    #[allow(clippy::too_many_arguments)]
    fn load(
        py: Python<'_>,
        checkpoint_dir: PathBuf,
        layer: usize,
        tp_size: usize,
        tp_rank: usize,
        backend: &str,
        schedule: &str,
        device: i64,
    ) -> PyResult<Self> {
        let schedule = parse_schedule(schedule).map_err(to_py)?;
        let backend = backend.to_string();
        let layer = py
            .detach(|| {
                guard(|| {
                    let runtime = Runtime::new(&backend, device)?;
                    Layer::load(&runtime, &checkpoint_dir, layer, tp_size, tp_rank, schedule)
                })
            })
            .map_err(to_py)?;
        Ok(Self { layer: Arc::new(layer) })
    }

    /// Build layer `layer` for TP rank `tp_rank` of `tp_size` from weights in memory:
    /// `config` is the model's config (a dict, a JSON string, or an object with the HF fields,
    /// such as transformers' `KimiLinearConfig`), `weights` maps the checkpoint's names
    /// (`model.layers.{i}.self_attn.q_proj.weight`, ...) to host arrays (numpy, torch CPU,
    /// DLPack), read in place. The same checks and the same fused BFG as `Layer.load`: the
    /// same layer, bit for bit.
    #[staticmethod]
    #[pyo3(signature = (config, weights, layer=0, tp_size=1, tp_rank=0, backend="reference", schedule="overlapped", device=0))]
    #[allow(clippy::too_many_arguments)]
    fn from_weights(
        py: Python<'_>,
        config: &Bound<'_, PyAny>,
        weights: &Bound<'_, PyAny>,
        layer: usize,
        tp_size: usize,
        tp_rank: usize,
        backend: &str,
        schedule: &str,
        device: i64,
    ) -> PyResult<Self> {
        let schedule = parse_schedule(schedule).map_err(to_py)?;
        let helpers = py.import("kda._weights")?;
        let text: String = helpers.call_method1("config_json", (config,))?.extract()?;
        let config = kda_model::config::KdaConfig::from_json_str(&text, "config")
            .map_err(|e| to_py(kda_model::weights::WeightError::from(e).into()))?;
        let named: Vec<(String, Bound<'_, PyAny>)> =
            helpers.call_method1("named_arrays", (weights,))?.extract()?;
        let mut arrays = Vec::with_capacity(named.len());
        for (name, obj) in &named {
            arrays.push((name.clone(), array::foreign(py, "weights", obj, None)?));
        }
        let backend = backend.to_string();
        let layer = py
            .detach(|| {
                guard(|| {
                    let runtime = Runtime::new(&backend, device)?;
                    Layer::from_weights(
                        &runtime, &config, &arrays, layer, tp_size, tp_rank, schedule,
                    )
                })
            })
            .map_err(to_py)?;
        Ok(Self { layer: Arc::new(layer) })
    }

    /// A zeroed `kda.StateCache` of `num_slots` slots, with room for `num_spec` speculative
    /// tokens per step.
    #[pyo3(signature = (num_slots=8, num_spec=0))]
    fn new_cache(&self, py: Python<'_>, num_slots: i128, num_spec: i128) -> PyResult<PyStateCache> {
        let (num_slots, num_spec) = (size("num_slots", num_slots)?, size("num_spec", num_spec)?);
        let layer = &*self.layer;
        let cache = py.detach(|| guard(|| layer.new_cache(num_slots, num_spec))).map_err(to_py)?;
        Ok(PyStateCache { layer: Arc::clone(&self.layer), cache: Arc::new(cache) })
    }

    /// A `kda.StateCache` over the engine's own state tensors, used in place (kda reads and
    /// writes them, never copies them): `conv_state` (f32, bf16 or f16) and `recurrent_state`
    /// (f32), numpy / torch CPU / DLPack, in `layout`: `"vllm"` (conv `[N, W - 1 + num_spec,
    /// 3 lp]` or `[N, 3 lp, W - 1 + num_spec]`, recurrent `[N, lh, V, K]`) or `"transformers"`
    /// (conv `[B, 3 lp, W]`, recurrent `[B, lh, K, V]`, as `DynamicCache` holds them). The
    /// slots are the first dimension. On a device backend, device tensors of that backend
    /// (DLPack) are used in place the same way.
    #[pyo3(signature = (conv_state, recurrent_state, layout="vllm", num_spec=0))]
    fn wrap_cache(
        &self,
        py: Python<'_>,
        conv_state: &Bound<'_, PyAny>,
        recurrent_state: &Bound<'_, PyAny>,
        layout: &str,
        num_spec: usize,
    ) -> PyResult<PyStateCache> {
        let layout = CacheLayout::parse(layout).map_err(to_py)?;
        array::expect_writable("conv_state", conv_state)?;
        array::expect_writable("recurrent_state", recurrent_state)?;
        let conv = array::foreign(py, "conv_state", conv_state, None)?;
        let recurrent = array::foreign(py, "recurrent_state", recurrent_state, None)?;
        let layer = &*self.layer;
        let cache = py
            .detach(|| guard(|| layer.wrap_cache(conv, recurrent, layout, num_spec)))
            .map_err(to_py)?;
        Ok(PyStateCache { layer: Arc::clone(&self.layer), cache: Arc::new(cache) })
    }

    /// Run the layer on `hidden_states` `[N, hidden]` (bf16 or f32; read in place where its
    /// layout allows) for `R = len(query_start_loc) - 1` requests; request `r` uses
    /// `slots[r]` (default `r`) and continues from `num_computed_tokens[r]` cached tokens
    /// (default 0: a fresh prefill). Returns this rank's partial output `[N, hidden]` before
    /// the all-reduce: a new numpy float32 array, or `out` (written in place) when given.
    /// `stream`: on a device backend, the engine's stream handle to queue the work on
    /// (`torch.cuda.current_stream().cuda_stream`); kda imports it once and keeps it for the
    /// layer's backend, so it must outlive the layer. The call then returns once the work is
    /// queued, and the engine may capture it into a CUDA graph (`docs/embedding.md`).
    ///
    /// `keep_states`: `(request, position, slot)` triples (prefix caching): the state of
    /// prefill request `request` after `position` tokens of its sequence (counting
    /// `num_computed_tokens`; `num_computed_tokens + 64·j` or the request's end) is written to
    /// cache slot `slot`, recurrent and conv halves; a bad entry raises `kda.MetadataError`
    /// before anything runs.
    #[pyo3(signature = (hidden_states, query_start_loc, cache, slots=None, num_computed_tokens=None, out=None, stream=None, keep_states=None))]
    #[allow(clippy::too_many_arguments)]
    fn forward<'py>(
        &self,
        py: Python<'py>,
        hidden_states: &Bound<'py, PyAny>,
        query_start_loc: &Bound<'py, PyAny>,
        cache: &Bound<'py, PyStateCache>,
        slots: Option<&Bound<'py, PyAny>>,
        num_computed_tokens: Option<&Bound<'py, PyAny>>,
        out: Option<&Bound<'py, PyAny>>,
        stream: Option<usize>,
        keep_states: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let keep = keep_args(keep_states)?;
        let batch = BatchArgs {
            query_start_loc: ints("query_start_loc", query_start_loc)?,
            num_computed_tokens: optional_ints("num_computed_tokens", num_computed_tokens)?,
            slots: optional_ints("slots", slots)?
                .map(|v| v.into_iter().map(SlotsArg::Single).collect()),
            num_accepted_tokens: None,
        };
        self.run(py, hidden_states, batch, cache, out, stream, keep)
    }

    /// `forward` with speculative decodes: `slots[r]` is an int (a plain request) or a list of
    /// `num_spec + 1` slots (a speculative decode of `num_spec + 1` tokens, reading the state in
    /// `slots[r][num_accepted_tokens[r] - 1]` and writing the state after token `t` to
    /// `slots[r][t]`); `num_accepted_tokens[r]` is read for speculative requests only.
    #[pyo3(signature = (hidden_states, query_start_loc, cache, slots, num_computed_tokens, num_accepted_tokens, out=None, stream=None))]
    #[allow(clippy::too_many_arguments)]
    fn forward_spec<'py>(
        &self,
        py: Python<'py>,
        hidden_states: &Bound<'py, PyAny>,
        query_start_loc: &Bound<'py, PyAny>,
        cache: &Bound<'py, PyStateCache>,
        slots: &Bound<'py, PyAny>,
        num_computed_tokens: &Bound<'py, PyAny>,
        num_accepted_tokens: &Bound<'py, PyAny>,
        out: Option<&Bound<'py, PyAny>>,
        stream: Option<usize>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let batch = BatchArgs {
            query_start_loc: ints("query_start_loc", query_start_loc)?,
            num_computed_tokens: Some(ints("num_computed_tokens", num_computed_tokens)?),
            slots: Some(slot_args(slots)?),
            num_accepted_tokens: Some(ints("num_accepted_tokens", num_accepted_tokens)?),
        };
        self.run(py, hidden_states, batch, cache, out, stream, Vec::new())
    }

    #[getter]
    fn hidden_size(&self) -> usize {
        self.layer.info().hidden_size
    }

    #[getter]
    fn local_heads(&self) -> usize {
        self.layer.info().local_heads
    }

    #[getter]
    fn head_dim(&self) -> usize {
        self.layer.info().head_dim
    }

    #[getter]
    fn conv_width(&self) -> usize {
        self.layer.info().conv_width
    }

    #[getter]
    fn backend(&self) -> &'static str {
        self.layer.runtime().name()
    }

    #[getter]
    fn schedule(&self) -> &'static str {
        match self.layer.schedule() {
            kda_model::schedule::ProjectionSchedule::Serial => "serial",
            kda_model::schedule::ProjectionSchedule::Overlapped => "overlapped",
        }
    }

    fn __repr__(&self) -> String {
        let i = self.layer.info();
        format!(
            "kda.Layer(backend={:?}, schedule={:?}, hidden_size={}, local_heads={}, head_dim={})",
            self.backend(),
            self.schedule(),
            i.hidden_size,
            i.local_heads,
            i.head_dim
        )
    }
}

#[pymethods]
impl PyStateCache {
    /// Slot `slot`'s recurrent state, a numpy float32 array `[lh, V, K]` (v-first).
    fn recurrent_state<'py>(&self, py: Python<'py>, slot: i128) -> PyResult<Bound<'py, PyAny>> {
        let (layer, cache) = (&*self.layer, &*self.cache);
        // A negative slot is out of range like one past the cache's slots, and said as given.
        let slot = usize::try_from(slot).map_err(|_| {
            to_py(EmbedError::MetadataBound {
                param: "slot",
                value: slot,
                expected: format!("< {} (the cache's slots)", cache.num_slots()),
            })
        })?;
        let values = py.detach(|| guard(|| cache.recurrent_state(layer, slot))).map_err(to_py)?;
        let i = layer.info();
        array::numpy_from(py, "float32", &[i.local_heads, i.head_dim, i.head_dim], &values)
    }

    /// Slot `slot`'s conv history, a numpy float32 array `[W - 1, 3 lp]` (q | k | v channels,
    /// oldest input first).
    fn conv_state<'py>(&self, py: Python<'py>, slot: usize) -> PyResult<Bound<'py, PyAny>> {
        let (layer, cache) = (&*self.layer, &*self.cache);
        let (values, shape) =
            py.detach(|| guard(|| cache.conv_state(layer, slot))).map_err(to_py)?;
        array::numpy_from(py, "float32", &shape, &values)
    }

    #[getter]
    fn num_slots(&self) -> usize {
        self.cache.num_slots()
    }

    fn __repr__(&self) -> String {
        format!("kda.StateCache(num_slots={})", self.cache.num_slots())
    }
}

/// MXFP8 quantization of a `[K]` or `[N, K]` f32 / bf16 array, blocks of 32 along K:
/// `(data, scale)`, E4M3 bytes (uint8, the input's shape) and E8M0 bytes (uint8,
/// `[.., ceil(K/32)]`). `scale_alg`: 0 (OCP floor, Kimi K3's) or 1 (round up).
#[pyfunction]
#[pyo3(signature = (x, scale_alg=0))]
fn quant<'py>(
    py: Python<'py>,
    x: &Bound<'py, PyAny>,
    scale_alg: i64,
) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
    let x = array::foreign(py, "x", x, None)?;
    let q = py.detach(|| guard(|| ops::quant(&x, scale_alg))).map_err(to_py)?;
    Ok((
        array::numpy_from(py, "uint8", &q.data_shape, &q.data)?,
        array::numpy_from(py, "uint8", &q.scale_shape, &q.scale)?,
    ))
}

/// The KDA recurrence in flash-linear-attention's conventions: `q`, `k`, `g` `[B, T, H, K]`
/// (`g` the activated log decay), `v` `[B, T, H, V]`, `beta` `[B, T, H]` (after the sigmoid),
/// optional `initial_state` `[B, H, K, V]`, each f32 or bf16, read where they lie when
/// row-major (copied otherwise). Returns `(o, final_state)`, float32 `[B, T, H, V]` and
/// `[B, H, K, V]`. `initial_state` is left as it was and `final_state` is a new array, unless
/// `inplace_final_state`: then `initial_state` (a writable float32 array) is updated in place
/// and returned as `final_state` (vLLM's `fused_recurrent_gated_delta_rule` convention).
/// `algo`: "chunk" or "recurrent"; `scale` multiplies q (default `K ** -0.5`); `l2norm`:
/// L2-normalise q and k first; `threads`: 1 runs the op on its stream's own thread, more on a
/// pool of that many.
#[pyfunction]
#[pyo3(name = "core", signature = (q, k, v, g, beta, initial_state=None, algo="chunk", scale=None, l2norm=false, threads=1, inplace_final_state=false))]
#[allow(clippy::too_many_arguments)]
fn kda_core_op<'py>(
    py: Python<'py>,
    q: &Bound<'py, PyAny>,
    k: &Bound<'py, PyAny>,
    v: &Bound<'py, PyAny>,
    g: &Bound<'py, PyAny>,
    beta: &Bound<'py, PyAny>,
    initial_state: Option<&Bound<'py, PyAny>>,
    algo: &str,
    scale: Option<f32>,
    l2norm: bool,
    threads: usize,
    inplace_final_state: bool,
) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
    let algo = CoreAlgo::parse(algo).map_err(to_py)?;
    let initial = initial_state.filter(|s| !s.is_none());
    let args = CoreArgs {
        q: array::foreign(py, "q", q, None)?,
        k: array::foreign(py, "k", k, None)?,
        v: array::foreign(py, "v", v, None)?,
        g: array::foreign(py, "g", g, None)?,
        beta: array::foreign(py, "beta", beta, None)?,
        initial_state: initial.map(|s| array::foreign(py, "initial_state", s, None)).transpose()?,
        in_place: inplace_final_state,
        options: CoreOptions { algo, scale, l2norm },
        threads,
    };
    let (dims, _) = args.check().map_err(to_py)?;
    let o = array::numpy_empty(py, "float32", &[dims.batch, dims.tokens, dims.heads, dims.v])?;
    let o_array = array::foreign(py, "o", &o, None)?;
    let (final_state, final_array) = match initial {
        Some(state) if inplace_final_state => {
            array::expect_writable("initial_state", state)?;
            (state.clone(), None)
        }
        _ => {
            let shape = [dims.batch, dims.heads, dims.k, dims.v];
            let state = array::numpy_empty(py, "float32", &shape)?;
            let foreign = array::foreign(py, "final_state", &state, None)?;
            (state, Some(foreign))
        }
    };
    py.detach(|| guard(|| ops::core(args, o_array, final_array))).map_err(to_py)?;
    Ok((o, final_state))
}

/// Test support (`kda._testing.write_synthetic_checkpoint`).
#[pyfunction]
#[pyo3(signature = (checkpoint_dir, preset="tiny", seed=0))]
fn _write_synthetic_checkpoint(
    py: Python<'_>,
    checkpoint_dir: PathBuf,
    preset: &str,
    seed: u64,
) -> PyResult<()> {
    let preset = preset.to_string();
    py.detach(|| guard(|| testing::write_synthetic_checkpoint(&checkpoint_dir, &preset, seed)))
        .map_err(to_py)
}

/// Test support (`kda._testing.reference_forward`): `steps` (dicts of the `forward` /
/// `forward_spec` arguments) through the plain Rust API, on kda's own buffers and stream.
/// Returns `(outputs, states)`: each step's float32 output and every slot's final recurrent
/// state `[num_slots, lh, V, K]`.
#[pyfunction]
#[pyo3(signature = (checkpoint_dir, steps, layer=0, tp_size=1, tp_rank=0, schedule="overlapped", num_slots=8, num_spec=0))]
#[allow(clippy::too_many_arguments)]
fn _reference_forward<'py>(
    py: Python<'py>,
    checkpoint_dir: PathBuf,
    steps: &Bound<'py, PyList>,
    layer: usize,
    tp_size: usize,
    tp_rank: usize,
    schedule: &str,
    num_slots: usize,
    num_spec: usize,
) -> PyResult<(Bound<'py, PyList>, Bound<'py, PyAny>)> {
    let schedule = parse_schedule(schedule).map_err(to_py)?;
    let mut runs = Vec::with_capacity(steps.len());
    for step in steps.iter() {
        let step = step.cast::<PyDict>()?;
        let get = |key: &str| step.get_item(key);
        let hidden = get("hidden_states")?
            .ok_or_else(|| PyTypeError::new_err("a step needs hidden_states"))?;
        let x = array::foreign(py, "hidden_states", &hidden, None)?;
        x.expect_rank("hidden_states", 2, "[N, hidden_size]").map_err(to_py)?;
        let qsl = get("query_start_loc")?
            .ok_or_else(|| PyTypeError::new_err("a step needs query_start_loc"))?;
        let slots = match get("slots")?.filter(|s| !s.is_none()) {
            Some(s) => Some(slot_args(&s)?),
            None => None,
        };
        runs.push(Step {
            hidden: x.to_f32("hidden_states").map_err(to_py)?,
            dtype: x.dtype(),
            rows: x.shape()[0],
            batch: BatchArgs {
                query_start_loc: ints("query_start_loc", &qsl)?,
                num_computed_tokens: optional_ints(
                    "num_computed_tokens",
                    get("num_computed_tokens")?.as_ref(),
                )?,
                slots,
                num_accepted_tokens: optional_ints(
                    "num_accepted_tokens",
                    get("num_accepted_tokens")?.as_ref(),
                )?,
            },
        });
    }
    let spec = LayerSpec { dir: &checkpoint_dir, layer, tp_size, tp_rank, schedule };
    let run = py
        .detach(|| guard(|| testing::reference_run(&spec, num_slots, num_spec, &runs)))
        .map_err(to_py)?;
    let outputs = PyList::empty(py);
    for (o, step) in run.outputs.iter().zip(&runs) {
        outputs.append(array::numpy_from(py, "float32", &[step.rows, run.hidden_size], o)?)?;
    }
    let states = array::numpy_from(py, "float32", &run.states_shape, &run.states)?;
    Ok((outputs, states))
}

/// Test support (`kda._testing.input_copies`): forwards so far whose input was copied.
#[pyfunction]
fn _input_copies() -> u64 {
    INPUT_COPIES.load(Ordering::Relaxed)
}

/// kda: Kimi Delta Attention for inference engines (see the package's `docs/embedding.md`).
#[pymodule]
fn _kda(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<PyLayer>()?;
    m.add_class::<PyStateCache>()?;
    m.add_function(wrap_pyfunction!(quant, m)?)?;
    m.add_function(wrap_pyfunction!(kda_core_op, m)?)?;
    m.add_function(wrap_pyfunction!(_write_synthetic_checkpoint, m)?)?;
    m.add_function(wrap_pyfunction!(_reference_forward, m)?)?;
    m.add_function(wrap_pyfunction!(_input_copies, m)?)?;
    m.add("Error", py.get_type::<Error>())?;
    m.add("ShapeError", py.get_type::<ShapeError>())?;
    m.add("MetadataError", py.get_type::<MetadataError>())?;
    m.add("CheckpointError", py.get_type::<CheckpointError>())?;
    m.add("BackendError", py.get_type::<BackendError>())?;
    m.add("UnsupportedError", py.get_type::<UnsupportedError>())?;
    m.add("__version__", kda_embed::VERSION)?;
    Ok(())
}
