//! `kda-capi`: kda's C ABI, a thin layer over [`kda_embed`]; `include/kda.h` is generated from
//! this file by cbindgen (`tests/header.rs` checks the committed header is current).
//!
//! Every function returns a [`KdaStatus`] (`KDA_STATUS_OK` or the class of the error) and, on
//! an error, leaves a message in a thread-local slot that [`kda_last_error`] returns. No
//! function unwinds into C: a panic becomes `KDA_STATUS_ERROR_INTERNAL`. Every handle has a
//! destroy function. The contract with the engine (memory, streams, threads) is
//! `docs/embedding.md`.

#![deny(unsafe_op_in_unsafe_fn)]

mod engine;

pub use engine::{
    KdaCacheLayout, KdaWeight, KdaWeightDtype, kda_cache_conv_state, kda_cache_wrap,
    kda_layer_forward_keeping_states, kda_layer_from_weights,
};

use std::cell::RefCell;
use std::ffi::{CStr, CString, c_char, c_void};
use std::path::PathBuf;

use kda_core::DType;
use kda_embed::{
    BatchArgs, Cache, EmbedError, ErrorKind, ForeignArray, Layer, Memory, Runtime, SlotsArg, guard,
};

/// What a call returned.
#[repr(C)]
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum KdaStatus {
    Ok = 0,
    /// An argument that is not one of the accepted values (a backend name, a dtype code), or a
    /// null pointer where one is required.
    ErrorArgument = 1,
    /// A tensor of the wrong shape, dtype or layout, or a cache of another layer.
    ErrorShape = 2,
    /// Batch metadata that is malformed or does not fit the cache.
    ErrorMetadata = 3,
    /// A checkpoint that cannot be read or does not hold the layer.
    ErrorCheckpoint = 4,
    /// What this backend or build cannot do.
    ErrorUnsupported = 5,
    /// A device call or an op failed.
    ErrorBackend = 6,
    /// A bug in kda (a panic caught at the boundary).
    ErrorInternal = 7,
}

/// Element types of the arrays a forward reads and writes (pass as `int32_t`).
#[repr(C)]
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum KdaDtype {
    F32 = 0,
    Bf16 = 1,
    F16 = 2,
}

/// The projection schedules (pass as `int32_t`).
#[repr(C)]
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum KdaSchedule {
    Serial = 0,
    Overlapped = 1,
}

/// A backend instance (`kda_backend_create`), shared by the layers loaded on it.
#[derive(Debug)]
pub struct KdaBackend {
    runtime: Runtime,
}

/// One KDA layer of a checkpoint for one TP rank (`kda_layer_load`).
#[derive(Debug)]
pub struct KdaLayer {
    layer: Layer,
}

/// A layer's per-slot state (`kda_cache_create`).
#[derive(Debug)]
pub struct KdaCache {
    cache: Cache,
}

/// The sizes of a loaded layer.
#[repr(C)]
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct KdaLayerInfo {
    pub hidden_size: usize,
    pub local_heads: usize,
    pub head_dim: usize,
    pub conv_width: usize,
}

/// One step's batch metadata, arrays as vLLM keeps them (int32). Request `r` owns rows
/// `query_start_loc[r] .. query_start_loc[r + 1]` of the hidden states. kda checks the counts
/// before it reads an array they size (an impossible count is `KDA_STATUS_ERROR_METADATA`
/// naming it, its value and its bound) and every value it reads; that each array holds the
/// entries its counts say is the caller's contract (`docs/embedding.md`, "What kda checks").
#[repr(C)]
#[derive(Copy, Clone, Debug)]
pub struct KdaBatch {
    /// Requests `R`, at most `num_tokens` (every request has a token).
    pub num_requests: usize,
    /// `[R + 1]` offsets, starting at 0, strictly increasing, at most `num_tokens`; NULL only
    /// with `R` = 0.
    pub query_start_loc: *const i32,
    /// `[R]` tokens each request already processed (0: fresh), or NULL: all fresh.
    pub num_computed_tokens: *const i32,
    /// `[R]` each request's state slot (`0 ..` the cache's slots), or NULL: request `r` uses
    /// slot `r`.
    pub slots: *const i32,
    /// Speculative tokens per step (`num_spec`), at most the cache's; 0 without speculative
    /// decoding.
    pub num_spec: usize,
    /// `[R, num_spec + 1]` slot lists (`0 ..` the cache's slots), read for the speculative
    /// requests only; NULL without any.
    pub spec_slots: *const i32,
    /// `[R]` tokens the previous step accepted; `> 0` marks request `r` speculative (it then
    /// uses row `r` of `spec_slots`); NULL without speculative requests.
    pub num_accepted_tokens: *const i32,
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_last_error(message: String) {
    let message = CString::new(message.replace('\0', " ")).unwrap_or_default();
    LAST_ERROR.with(|slot| *slot.borrow_mut() = message);
}

fn status_of(kind: ErrorKind) -> KdaStatus {
    match kind {
        ErrorKind::Argument => KdaStatus::ErrorArgument,
        ErrorKind::Shape => KdaStatus::ErrorShape,
        ErrorKind::Metadata => KdaStatus::ErrorMetadata,
        ErrorKind::Checkpoint => KdaStatus::ErrorCheckpoint,
        ErrorKind::Unsupported => KdaStatus::ErrorUnsupported,
        ErrorKind::Backend => KdaStatus::ErrorBackend,
        ErrorKind::Internal => KdaStatus::ErrorInternal,
    }
}

/// Run `f` behind the boundary: a panic or an error becomes a status and the thread's last
/// error message.
fn call(f: impl FnOnce() -> Result<(), EmbedError>) -> KdaStatus {
    match guard(f) {
        Ok(()) => KdaStatus::Ok,
        Err(e) => {
            set_last_error(e.message());
            status_of(e.kind())
        }
    }
}

fn null(param: &'static str) -> EmbedError {
    EmbedError::Null { param }
}

/// `*ptr`, or an argument error naming `param`.
///
/// # Safety
/// `ptr` is null or valid for `'a`.
unsafe fn deref<'a, T>(param: &'static str, ptr: *const T) -> Result<&'a T, EmbedError> {
    // SAFETY: the caller's contract.
    unsafe { ptr.as_ref() }.ok_or_else(|| null(param))
}

/// `len` elements at `ptr`, or an argument error.
///
/// # Safety
/// `ptr` is null or valid for `len` reads.
unsafe fn slice<'a>(
    param: &'static str,
    ptr: *const i32,
    len: usize,
) -> Result<&'a [i32], EmbedError> {
    if len == 0 {
        return Ok(&[]);
    }
    if ptr.is_null() {
        return Err(null(param));
    }
    // SAFETY: the caller's contract.
    Ok(unsafe { std::slice::from_raw_parts(ptr, len) })
}

fn widen(values: &[i32]) -> Vec<i64> {
    values.iter().map(|&v| i64::from(v)).collect()
}

fn dtype(param: &'static str, code: i32) -> Result<DType, EmbedError> {
    match code {
        0 => Ok(DType::F32),
        1 => Ok(DType::BF16),
        2 => Ok(DType::F16),
        other => Err(EmbedError::Argument {
            param,
            expected: "KDA_DTYPE_F32, KDA_DTYPE_BF16 or KDA_DTYPE_F16",
            actual: other.to_string(),
        }),
    }
}

/// A `KdaSchedule` code.
fn schedule_of(code: i32) -> Result<kda_model::schedule::ProjectionSchedule, EmbedError> {
    match code {
        0 => Ok(kda_model::schedule::ProjectionSchedule::Serial),
        1 => Ok(kda_model::schedule::ProjectionSchedule::Overlapped),
        other => Err(EmbedError::Argument {
            param: "schedule",
            expected: "KDA_SCHEDULE_SERIAL or KDA_SCHEDULE_OVERLAPPED",
            actual: other.to_string(),
        }),
    }
}

/// A C string argument.
///
/// # Safety
/// `s` is null or a NUL-terminated string.
unsafe fn string(param: &'static str, s: *const c_char) -> Result<String, EmbedError> {
    if s.is_null() {
        return Err(null(param));
    }
    // SAFETY: the caller's contract.
    let s = unsafe { CStr::from_ptr(s) };
    s.to_str().map(str::to_string).map_err(|_| EmbedError::Argument {
        param,
        expected: "UTF-8",
        actual: s.to_string_lossy().into_owned(),
    })
}

/// Write `value` to `*out` as a new handle.
///
/// # Safety
/// `out` is null or valid for a write.
unsafe fn give<T>(out: *mut *mut T, value: T) -> Result<(), EmbedError> {
    if out.is_null() {
        return Err(null("out"));
    }
    // SAFETY: the caller's contract.
    unsafe { out.write(Box::into_raw(Box::new(value))) };
    Ok(())
}

/// Destroy a handle made by `give`.
///
/// # Safety
/// `handle` is null or a live handle of this type, not used afterwards.
unsafe fn destroy<T>(handle: *mut T) {
    if !handle.is_null() {
        // SAFETY: made by `Box::into_raw` in `give`; the caller gives it up.
        let boxed = unsafe { Box::from_raw(handle) };
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(boxed)));
    }
}

/// kda's version, `"major.minor.patch"` (a static string).
#[unsafe(no_mangle)]
pub extern "C" fn kda_version() -> *const c_char {
    static VERSION: &CStr =
        match CStr::from_bytes_with_nul(concat!(env!("CARGO_PKG_VERSION"), "\0").as_bytes()) {
            Ok(v) => v,
            Err(_) => c"unknown",
        };
    VERSION.as_ptr()
}

/// The message of the last call on this thread that failed (empty if none has): the Rust
/// error's text, naming the parameter, the expected and the actual value. Valid until the next
/// failing call on this thread.
#[unsafe(no_mangle)]
pub extern "C" fn kda_last_error() -> *const c_char {
    LAST_ERROR.with(|slot| slot.borrow().as_ptr())
}

/// Create the backend `name` (`"reference"`, or `"cuda"` / `"ascend"` where built with them) on
/// device `device` (ignored by the reference) into `*out`.
///
/// # Safety
/// `name` is a NUL-terminated string; `out` is valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kda_backend_create(
    name: *const c_char,
    device: i64,
    out: *mut *mut KdaBackend,
) -> KdaStatus {
    call(|| {
        // SAFETY: the caller's contract.
        let name = unsafe { string("name", name) }?;
        let runtime = Runtime::new(&name, device)?;
        // SAFETY: the caller's contract.
        unsafe { give(out, KdaBackend { runtime }) }
    })
}

/// Destroy a backend (layers loaded on it keep it alive until they are destroyed). NULL is a
/// no-op.
///
/// # Safety
/// `backend` is NULL or a live handle, not used afterwards.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kda_backend_destroy(backend: *mut KdaBackend) {
    // SAFETY: the caller's contract.
    unsafe { destroy(backend) }
}

/// Load layer `layer` of the HF-style checkpoint in directory `checkpoint_dir` for TP rank
/// `tp_rank` of `tp_size` on `backend`, with the projection `schedule` (a `KdaSchedule`), into
/// `*out`.
///
/// # Safety
/// `backend` is a live handle; `checkpoint_dir` a NUL-terminated string; `out` valid for a
/// write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kda_layer_load(
    backend: *const KdaBackend,
    checkpoint_dir: *const c_char,
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
        let dir = PathBuf::from(unsafe { string("checkpoint_dir", checkpoint_dir) }?);
        let schedule = schedule_of(schedule)?;
        let layer = Layer::load(&backend.runtime, &dir, layer, tp_size, tp_rank, schedule)?;
        // SAFETY: the caller's contract.
        unsafe { give(out, KdaLayer { layer }) }
    })
}

/// Destroy a layer. NULL is a no-op.
///
/// # Safety
/// `layer` is NULL or a live handle, not used afterwards (nor by a call still running).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kda_layer_destroy(layer: *mut KdaLayer) {
    // SAFETY: the caller's contract.
    unsafe { destroy(layer) }
}

/// The sizes of `layer` into `*out`.
///
/// # Safety
/// `layer` is a live handle; `out` valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kda_layer_info(
    layer: *const KdaLayer,
    out: *mut KdaLayerInfo,
) -> KdaStatus {
    call(|| {
        // SAFETY: the caller's contract.
        let layer = unsafe { deref("layer", layer) }?;
        if out.is_null() {
            return Err(null("out"));
        }
        let i = layer.layer.info();
        let info = KdaLayerInfo {
            hidden_size: i.hidden_size,
            local_heads: i.local_heads,
            head_dim: i.head_dim,
            conv_width: i.conv_width,
        };
        // SAFETY: the caller's contract.
        unsafe { out.write(info) };
        Ok(())
    })
}

/// A zeroed cache for `layer` of `num_slots` slots with room for `num_spec` speculative tokens
/// per step, into `*out`.
///
/// # Safety
/// `layer` is a live handle; `out` valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kda_cache_create(
    layer: *const KdaLayer,
    num_slots: usize,
    num_spec: usize,
    out: *mut *mut KdaCache,
) -> KdaStatus {
    call(|| {
        // SAFETY: the caller's contract.
        let layer = unsafe { deref("layer", layer) }?;
        let cache = layer.layer.new_cache(num_slots, num_spec)?;
        // SAFETY: the caller's contract.
        unsafe { give(out, KdaCache { cache }) }
    })
}

/// Destroy a cache. NULL is a no-op.
///
/// # Safety
/// `cache` is NULL or a live handle, not used afterwards.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kda_cache_destroy(cache: *mut KdaCache) {
    // SAFETY: the caller's contract.
    unsafe { destroy(cache) }
}

/// A count of the batch above what bounds it: the value as the caller gave it, and the bound.
pub(crate) fn bound(param: &'static str, value: usize, expected: String) -> EmbedError {
    EmbedError::MetadataBound { param, value: value as i128, expected }
}

/// `values` (slots the caller gave) checked against the cache's `slots`, as `i64`s.
fn slot_values(
    param: &'static str,
    first: usize,
    values: &[i32],
    slots: usize,
) -> Result<Vec<i64>, EmbedError> {
    values
        .iter()
        .enumerate()
        .map(|(i, &v)| match usize::try_from(v) {
            Ok(s) if s < slots => Ok(i64::from(v)),
            _ => Err(EmbedError::MetadataValue {
                param,
                index: first + i,
                value: i64::from(v),
                expected: format!("0..{slots} (the cache's slots)"),
            }),
        })
        .collect()
}

/// The batch as the layer's arguments. Every count is checked against what bounds it before
/// the array it sizes is read, so an impossible count is an error, never a read or an
/// allocation: `num_requests` by `num_tokens` (every request needs a token), `num_spec` by the
/// cache's, the speculative requests' slot lists by the tokens they need. Slot values are
/// checked against the cache's slots as they are read (`slots` for plain requests,
/// `spec_slots` rows for speculative ones; the other entries are not read). What is read and
/// kept is at most a few integers per token of `num_tokens`.
///
/// # Safety
/// `batch`'s pointers are NULL or valid for the lengths its fields give, when those pass the
/// checks.
unsafe fn batch_args(
    batch: &KdaBatch,
    num_tokens: usize,
    cache: &Cache,
) -> Result<BatchArgs, EmbedError> {
    let r = batch.num_requests;
    if r > num_tokens {
        let why = format!("at most {num_tokens} (num_tokens: every request needs a token)");
        return Err(bound("num_requests", r, why));
    }
    let (num_slots, cache_spec) = (cache.num_slots(), cache.num_spec());
    if batch.num_spec > cache_spec {
        let why = format!("at most {cache_spec} (the cache's num_spec)");
        return Err(bound("num_spec", batch.num_spec, why));
    }
    let len = match r.checked_add(1) {
        _ if r == 0 && batch.query_start_loc.is_null() => 0,
        Some(len) => len,
        None => return Err(bound("num_requests", r, format!("at most {}", usize::MAX - 1))),
    };
    // SAFETY: the caller's contract on `batch`: `len` is `num_requests + 1`, now known to be
    // at most `num_tokens + 1`.
    let qsl = widen(unsafe { slice("query_start_loc", batch.query_start_loc, len) }?);
    let optional = |param, ptr: *const i32| -> Result<Option<&[i32]>, EmbedError> {
        if ptr.is_null() {
            return Ok(None);
        }
        // SAFETY: non-null, valid for `r` reads per the caller's contract (`r` checked above).
        Ok(Some(unsafe { slice(param, ptr, r) }?))
    };
    let computed = optional("num_computed_tokens", batch.num_computed_tokens)?.map(widen);
    let slots = optional("slots", batch.slots)?;
    let accepted = optional("num_accepted_tokens", batch.num_accepted_tokens)?;
    let single = |i: usize| -> Result<SlotsArg, EmbedError> {
        match slots {
            Some(s) => Ok(SlotsArg::Single(slot_values("slots", i, &s[i..=i], num_slots)?[0])),
            None => Ok(SlotsArg::Single(i as i64)),
        }
    };
    let slots = match (accepted, batch.spec_slots.is_null()) {
        (Some(_), true) => return Err(null("spec_slots")),
        (Some(acc), false) => {
            // Each speculative request has `num_spec + 1` tokens and as many slots: the rows of
            // `spec_slots` read are bounded by the tokens before any is read.
            let width = batch.num_spec + 1; // `num_spec` <= the cache's, which fits its rows.
            let speculative = acc.iter().filter(|&&a| a > 0).count();
            if speculative > 0 {
                if speculative.checked_mul(width).is_none_or(|n| n > num_tokens) {
                    let why = format!(
                        "at most {} ({speculative} speculative requests of num_spec + 1 tokens \
                         each in {num_tokens} tokens)",
                        num_tokens / speculative - 1
                    );
                    return Err(bound("num_spec", batch.num_spec, why));
                }
                // The rows are addressed as `[R, num_spec + 1]` i32s: the offsets must fit.
                let largest = isize::MAX as usize / 4;
                if r.checked_mul(width).is_none_or(|n| n > largest) {
                    let why = format!(
                        "at most {} (spec_slots [num_requests = {r}, num_spec + 1] \
                                       within the address space)",
                        largest / r - 1
                    );
                    return Err(bound("num_spec", batch.num_spec, why));
                }
            }
            (0..r)
                .map(|i| {
                    if acc[i] <= 0 {
                        return single(i);
                    }
                    // SAFETY: row `i` of the caller's `[num_requests, num_spec + 1]` array; the
                    // offset fits (`r · width` checked above).
                    let row =
                        unsafe { slice("spec_slots", batch.spec_slots.add(i * width), width) }?;
                    Ok(SlotsArg::Speculative(slot_values("spec_slots", i * width, row, num_slots)?))
                })
                .collect::<Result<Vec<_>, _>>()?
        }
        (None, _) => (0..r).map(single).collect::<Result<Vec<_>, _>>()?,
    };
    Ok(BatchArgs {
        query_start_loc: qsl,
        num_computed_tokens: computed,
        slots: Some(slots),
        num_accepted_tokens: accepted.map(widen),
    })
}

/// Run `layer` on `hidden_states` (`[num_tokens, hidden_size]` row-major, `hidden_dtype` a
/// `KdaDtype`: bf16 or f32) for `batch`, reading and updating `cache`, and write this rank's
/// partial output (before the all-reduce) into `out` (`[num_tokens, hidden_size]` row-major,
/// `out_dtype` f32, bf16 or f16). Both arrays are used in place: host memory on the reference
/// backend, device memory of the layer's device on the others. `stream` 0: kda's own stream,
/// and the call returns with `out` and the cache complete; otherwise the engine's stream
/// (`CUstream`, `aclrtStream`) on a device backend: the work is queued on it, in its order, and
/// the call returns at once. A rejected call changes neither `out` nor the cache.
///
/// Checked before anything is read: the dtype codes, that `num_tokens` rows fit the address
/// space, the batch's counts against their bounds (`KdaBatch`), then every value read.
///
/// # Safety
/// `layer`, `cache` and `batch` are live; `batch`'s arrays hold the entries its counts say
/// (whenever those pass the checks); `hidden_states` and `out` point to arrays of the
/// sizes above, aligned to 4 bytes, valid until the work completes (the call's return with
/// `stream` 0, else the engine stream passing it), untouched by others meanwhile; `stream`
/// is 0 or a live stream of the layer's device that outlives the backend (kda imports it once
/// and keeps it).
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn kda_layer_forward(
    layer: *const KdaLayer,
    cache: *const KdaCache,
    hidden_states: *const c_void,
    hidden_dtype: i32,
    num_tokens: usize,
    batch: *const KdaBatch,
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
        let (hidden_dtype, out_dtype) =
            (dtype("hidden_dtype", hidden_dtype)?, dtype("out_dtype", out_dtype)?);
        let hidden = layer.layer.info().hidden_size;
        let shape = vec![num_tokens, hidden];
        // `num_tokens` sizes both arrays: rows that no memory can hold are refused before it
        // bounds anything else.
        for (param, dtype) in [("hidden_states", hidden_dtype), ("out", out_dtype)] {
            if kda_core::layout::checked_size_bytes(dtype, &shape).is_err() {
                return Err(EmbedError::Array {
                    param,
                    message: format!(
                        "num_tokens = {num_tokens} rows of {hidden} {dtype} elements do not fit \
                         the address space"
                    ),
                });
            }
        }
        if hidden_states.is_null() && num_tokens > 0 {
            return Err(null("hidden_states"));
        }
        if out.is_null() && num_tokens > 0 {
            return Err(null("out"));
        }
        // SAFETY: the caller's contract on `batch`.
        let args = unsafe { batch_args(batch, num_tokens, &cache.cache) }?;
        let memory = match layer.layer.runtime().name() {
            "reference" => Memory::Host,
            name => Memory::Device { backend: name, device: 0 },
        };
        // SAFETY: the caller's contract: arrays of these sizes, valid until the work
        // completes; the engine owns them, so the owner is nothing.
        let x = unsafe {
            ForeignArray::new(
                hidden_states.cast_mut().cast(),
                hidden_dtype,
                shape.clone(),
                None,
                memory,
                Box::new(()),
            )
        }?;
        // SAFETY: as above.
        let y =
            unsafe { ForeignArray::new(out.cast(), out_dtype, shape, None, memory, Box::new(())) }?;
        let stream = (stream != 0).then_some(stream);
        // SAFETY: the caller's contract.
        unsafe { layer.layer.forward(x, &args, &cache.cache, y, stream) }.map(|_| ())
    })
}

/// Slot `slot`'s recurrent state of `cache` (`[local_heads, head_dim, head_dim]` f32, v-first:
/// `[lh, V, K]`) into `out`, which holds `len` floats (exactly that many), once kda's own
/// stream has finished (after a forward on an engine stream, synchronize that stream first).
///
/// # Safety
/// `layer` and `cache` are live; `out` is valid for `len` float writes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kda_cache_recurrent_state(
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
        let values = cache.cache.recurrent_state(&layer.layer, slot)?;
        if len != values.len() {
            return Err(EmbedError::Array {
                param: "out",
                message: format!(
                    "len = {len} floats, expected {} ([local_heads, head_dim, head_dim])",
                    values.len()
                ),
            });
        }
        if out.is_null() {
            return Err(null("out"));
        }
        // SAFETY: `out` holds `len` floats (the caller's contract).
        unsafe { std::ptr::copy_nonoverlapping(values.as_ptr(), out, len) };
        Ok(())
    })
}
