//! The engine's own memory from C: its state cache used in place (`kda_cache_wrap`), a slot's
//! conv history (`kda_cache_conv_state`), prefix-cache states (`kda_layer_forward_keeping_states`)
//! and a layer built from weights in memory (`kda_layer_from_weights`). `docs/embedding.md`.

use std::ffi::{c_char, c_void};

use kda_core::DType;
use kda_embed::{CacheLayout, EmbedError, ForeignArray, KeepArg, Layer, Memory};
use kda_model::config::KdaConfig;
use kda_model::weights::WeightError;

use crate::{
    KdaBackend, KdaBatch, KdaCache, KdaLayer, KdaStatus, batch_args, bound, call, deref, dtype,
    give, null, schedule_of, slice, string,
};

/// The highest rank a weight of `kda_layer_from_weights` may give (checkpoint tensors have
/// one to three dimensions; DLPack's own limit is higher, but no layer tensor needs more).
const MAX_WEIGHT_RANK: usize = 8;

/// The layouts of an engine's state cache (pass as `int32_t`); `N` slots, `C = 3 lp` channels
/// (q | k | v), `L = W - 1 + num_spec`.
#[repr(C)]
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum KdaCacheLayout {
    /// vLLM's default ("SD"): conv `[N, L, C]`, recurrent `[N, lh, V, K]` f32.
    Vllm = 0,
    /// vLLM with `VLLM_SSM_CONV_STATE_LAYOUT=DS`: conv `[N, C, L]`, recurrent `[N, lh, V, K]`.
    VllmDimFirst = 1,
    /// transformers' `DynamicCache`: conv `[N, C, W]`, recurrent `[N, lh, K, V]` f32.
    Transformers = 2,
}

/// Element types of weights (pass as `int32_t`): the three floats of `KdaDtype`, and bytes for
/// MXFP8 data (E4M3) and scales (E8M0).
#[repr(C)]
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum KdaWeightDtype {
    F32 = 0,
    Bf16 = 1,
    F16 = 2,
    U8 = 3,
}

/// One named weight of `kda_layer_from_weights`: a dense row-major host array.
#[repr(C)]
#[derive(Copy, Clone, Debug)]
pub struct KdaWeight {
    /// The checkpoint's name (`model.layers.0.self_attn.q_proj.weight`), NUL-terminated.
    pub name: *const c_char,
    /// The elements, row-major.
    pub data: *const c_void,
    /// A `KdaWeightDtype`.
    pub dtype: i32,
    /// Dimensions.
    pub rank: usize,
    /// `[rank]` sizes.
    pub shape: *const usize,
}

fn memory_of(layer: &Layer) -> Memory {
    match layer.runtime().name() {
        "reference" => Memory::Host,
        name => Memory::Device { backend: name, device: 0 },
    }
}

/// A contiguous engine array of `shape`.
///
/// # Safety
/// `ptr` is valid for the elements of `shape` for as long as kda uses it.
unsafe fn engine_array(
    param: &'static str,
    ptr: *mut c_void,
    dtype: DType,
    shape: Vec<usize>,
    memory: Memory,
) -> Result<ForeignArray, EmbedError> {
    if ptr.is_null() {
        return Err(null(param));
    }
    // SAFETY: the caller's contract; the engine owns the memory, so the owner is nothing.
    unsafe { ForeignArray::new(ptr.cast(), dtype, shape, None, memory, Box::new(())) }
}

/// A cache for `layer` over the engine's own state arrays, used in place (kda reads and writes
/// them where they lie, never copies them): `conv_state` (`conv_dtype` a `KdaDtype`) and
/// `recurrent_state` (f32), dense row-major in `layout` (a `KdaCacheLayout`) with `num_slots`
/// slots and room for `num_spec` speculative tokens (vLLM layouts only), into `*out`. The
/// engine keeps both arrays alive while the cache is used. Reference backend only (a device
/// backend refuses it with `KDA_STATUS_ERROR_UNSUPPORTED` at the first forward).
///
/// # Safety
/// `layer` is live; the arrays hold the elements the layout gives, 4-byte aligned, valid and
/// untouched by others while the cache is used; `out` is valid for a write.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn kda_cache_wrap(
    layer: *const KdaLayer,
    conv_state: *mut c_void,
    conv_dtype: i32,
    recurrent_state: *mut c_void,
    layout: i32,
    num_slots: usize,
    num_spec: usize,
    out: *mut *mut KdaCache,
) -> KdaStatus {
    call(|| {
        // SAFETY: the caller's contract.
        let layer = unsafe { deref("layer", layer) }?;
        let info = layer.layer.info();
        let channels = 3 * info.local_heads * info.head_dim;
        let history = info.conv_width.saturating_sub(1);
        let Some(rows) = history.checked_add(num_spec) else {
            let why = format!(
                "at most {} (W - 1 + num_spec rows must fit a usize)",
                usize::MAX - history
            );
            return Err(bound("num_spec", num_spec, why));
        };
        let (d, h, n) = (info.head_dim, info.local_heads, num_slots);
        let (kind, conv_shape) = match layout {
            0 => (CacheLayout::Vllm, vec![n, rows, channels]),
            1 => (CacheLayout::Vllm, vec![n, channels, rows]),
            2 => (CacheLayout::Transformers, vec![n, channels, info.conv_width]),
            other => {
                return Err(EmbedError::Argument {
                    param: "layout",
                    expected: "KDA_CACHE_LAYOUT_VLLM, KDA_CACHE_LAYOUT_VLLM_DIM_FIRST or \
                               KDA_CACHE_LAYOUT_TRANSFORMERS",
                    actual: other.to_string(),
                });
            }
        };
        let memory = memory_of(&layer.layer);
        let conv_dtype = dtype("conv_dtype", conv_dtype)?;
        // SAFETY: the caller's contract: arrays of these shapes.
        let conv =
            unsafe { engine_array("conv_state", conv_state, conv_dtype, conv_shape, memory) }?;
        let rec_shape = vec![n, h, d, d];
        // SAFETY: as above.
        let rec = unsafe {
            engine_array("recurrent_state", recurrent_state, DType::F32, rec_shape, memory)
        }?;
        let cache = layer.layer.wrap_cache(conv, rec, kind, num_spec)?;
        // SAFETY: the caller's contract.
        unsafe { give(out, KdaCache { cache }) }
    })
}

/// Slot `slot`'s conv history of `cache` (`[conv_width - 1, 3 * local_heads * head_dim]` f32,
/// q | k | v channels, oldest input first) into `out`, which holds `len` floats (exactly that
/// many), once kda's own stream has finished.
///
/// # Safety
/// `layer` and `cache` are live; `out` is valid for `len` float writes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kda_cache_conv_state(
    layer: *const KdaLayer,
    cache: *const KdaCache,
    slot: usize,
    out: *mut f32,
    len: usize,
) -> KdaStatus {
    call(|| {
        // SAFETY: the caller's contract.
        let layer = unsafe { deref("layer", layer) }?;
        // SAFETY: the caller's contract.
        let cache = unsafe { deref("cache", cache) }?;
        let (values, _) = cache.cache.conv_state(&layer.layer, slot)?;
        if len != values.len() {
            return Err(kda_core::Error::HostSize {
                op: "kda_cache_conv_state",
                param: "out",
                expected: values.len() * 4,
                actual: len * 4,
            }
            .into());
        }
        if out.is_null() {
            return Err(null("out"));
        }
        // SAFETY: `out` holds `len` floats (the caller's contract).
        unsafe { std::ptr::copy_nonoverlapping(values.as_ptr(), out, len) };
        Ok(())
    })
}

/// `kda_layer_forward`, also keeping prefix-cache states: `keep_states` holds `num_keep`
/// `(request, position, slot)` int32 triples; for each, the state of prefill request `request`
/// after `position` tokens of its sequence (counting `num_computed_tokens`:
/// `num_computed_tokens + 64 j` or the request's end) is written into cache slot `slot`, both
/// the recurrent and the conv halves (`docs/design/kda.md#chunk-boundary-states`). A bad triple
/// is `KDA_STATUS_ERROR_METADATA` and nothing runs.
///
/// # Safety
/// As `kda_layer_forward`; `keep_states` is NULL (with `num_keep` 0) or valid for
/// `3 * num_keep` reads.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn kda_layer_forward_keeping_states(
    layer: *const KdaLayer,
    cache: *const KdaCache,
    hidden_states: *const c_void,
    hidden_dtype: i32,
    num_tokens: usize,
    batch: *const KdaBatch,
    keep_states: *const i32,
    num_keep: usize,
    out: *mut c_void,
    out_dtype: i32,
    stream: usize,
) -> KdaStatus {
    call(|| {
        // SAFETY: the caller's contract.
        let layer = unsafe { deref("layer", layer) }?;
        // SAFETY: the caller's contract.
        let cache = unsafe { deref("cache", cache) }?;
        // SAFETY: the caller's contract.
        let batch = unsafe { deref("batch", batch) }?;
        // SAFETY: the caller's contract on `batch`.
        let args = unsafe { batch_args(batch, num_tokens, &cache.cache) }?;
        // Every kept state needs a cache slot of its own: checked before the triples are read.
        let slots = cache.cache.num_slots();
        if num_keep > slots {
            let why = format!("at most {slots} (the cache's slots: each kept state needs its own)");
            return Err(bound("num_keep", num_keep, why));
        }
        // SAFETY: the caller's contract: `3 * num_keep` ints, `num_keep` now at most the
        // cache's slots (so the product cannot wrap: the cache holds far more bytes per slot).
        let triples = unsafe { slice("keep_states", keep_states, 3 * num_keep) }?;
        let keep: Vec<KeepArg> = triples
            .chunks_exact(3)
            .map(|t| KeepArg {
                request: i64::from(t[0]),
                position: i64::from(t[1]),
                slot: i64::from(t[2]),
            })
            .collect();
        if hidden_states.is_null() && num_tokens > 0 {
            return Err(null("hidden_states"));
        }
        if out.is_null() && num_tokens > 0 {
            return Err(null("out"));
        }
        let memory = memory_of(&layer.layer);
        let shape = vec![num_tokens, layer.layer.info().hidden_size];
        let x_dtype = dtype("hidden_dtype", hidden_dtype)?;
        // SAFETY: the caller's contract: arrays of these sizes, valid until the work completes.
        let x = unsafe {
            ForeignArray::new(
                hidden_states.cast_mut().cast(),
                x_dtype,
                shape.clone(),
                None,
                memory,
                Box::new(()),
            )
        }?;
        let y_dtype = dtype("out_dtype", out_dtype)?;
        // SAFETY: as above.
        let y =
            unsafe { ForeignArray::new(out.cast(), y_dtype, shape, None, memory, Box::new(())) }?;
        let stream = (stream != 0).then_some(stream);
        // SAFETY: the caller's contract.
        unsafe { layer.layer.forward_keeping_states(x, &args, &keep, &cache.cache, y, stream) }
            .map(|_| ())
    })
}

/// Build layer `layer` for TP rank `tp_rank` of `tp_size` on `backend` from weights in host
/// memory, into `*out`: `config_json` is the model's `config.json` text, `weights` a table of
/// `num_weights` named arrays (the checkpoint's names), read in place. The same checks and the
/// same fused BFG as `kda_layer_load`: the same layer, bit for bit.
///
/// # Safety
/// `backend` is live; `config_json` a NUL-terminated string; `weights` valid for `num_weights`
/// entries whose names are NUL-terminated, shapes valid for `rank` reads and data valid for
/// the elements they give, during the call; `out` valid for a write.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn kda_layer_from_weights(
    backend: *const KdaBackend,
    config_json: *const c_char,
    weights: *const KdaWeight,
    num_weights: usize,
    layer: usize,
    tp_size: usize,
    tp_rank: usize,
    schedule: i32,
    out: *mut *mut KdaLayer,
) -> KdaStatus {
    call(|| {
        // SAFETY: the caller's contract.
        let backend = unsafe { deref("backend", backend) }?;
        // SAFETY: the caller's contract.
        let text = unsafe { string("config_json", config_json) }?;
        let config = KdaConfig::from_json_str(&text, "config_json").map_err(WeightError::from)?;
        let schedule = schedule_of(schedule)?;
        if weights.is_null() && num_weights > 0 {
            return Err(null("weights"));
        }
        let table = if num_weights == 0 {
            &[][..]
        } else {
            // SAFETY: the caller's contract: `num_weights` entries.
            unsafe { std::slice::from_raw_parts(weights, num_weights) }
        };
        // Grown as entries are read, never sized from the caller's count.
        let mut arrays = Vec::new();
        for w in table {
            // SAFETY: the caller's contract.
            let name = unsafe { string("weights.name", w.name) }?;
            let dtype = match w.dtype {
                0 => DType::F32,
                1 => DType::BF16,
                2 => DType::F16,
                3 => DType::U8,
                other => {
                    return Err(EmbedError::Argument {
                        param: "weights.dtype",
                        expected: "a KdaWeightDtype",
                        actual: other.to_string(),
                    });
                }
            };
            if w.rank > MAX_WEIGHT_RANK {
                let why = format!("at most {MAX_WEIGHT_RANK} (a checkpoint tensor's rank)");
                return Err(bound("weights.rank", w.rank, why));
            }
            let shape = if w.rank == 0 {
                Vec::new()
            } else if w.shape.is_null() {
                return Err(null("weights.shape"));
            } else {
                // SAFETY: the caller's contract: `rank` sizes.
                unsafe { std::slice::from_raw_parts(w.shape, w.rank) }.to_vec()
            };
            // SAFETY: the caller's contract: host data of these elements, during the call.
            let a = unsafe {
                engine_array("weights.data", w.data.cast_mut(), dtype, shape, Memory::Host)
            }?;
            arrays.push((name, a));
        }
        let layer = Layer::from_weights(
            &backend.runtime,
            &config,
            &arrays,
            layer,
            tp_size,
            tp_rank,
            schedule,
        )?;
        // SAFETY: the caller's contract.
        unsafe { give(out, KdaLayer { layer }) }
    })
}
