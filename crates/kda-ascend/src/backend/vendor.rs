//! `KdaChunk` on CANN's own `aclnnChunkKdaFwd` (ops-transformer,
//! `attention/chunk_kda_fwd/docs/aclnnChunkKdaFwd.md`), where its contract fits the op; the
//! project's chunk kernel otherwise (`docs/ascend.md`, the per-op table).
//!
//! The vendor op takes its sequence offsets on the host (`cuSeqlens`, an `aclIntArray` fixed
//! when the executor is built), `q`/`k`/`v` and the output in f16 or bf16 only, no L2 norm, and
//! initial and final states as `[N, H, V, K]` arrays (`stateVFirst = true`) rather than slots of
//! a cache. So the route is taken only when every one of these holds, and [`chunk_route`] names
//! the first that does not:
//!
//! - the installed CANN has the op (its symbols resolved: a capability);
//! - the op is not being captured (a replayed graph may carry other offsets than the executor
//!   was built with) and carries its metadata on the host ([`KdaChunk::host_meta`]);
//! - no chunk-boundary states are asked for (its `hOut` is the state before each chunk in `q`'s
//!   dtype, not f32 states in caller-named slots);
//! - `q`, `k`, `v` and `o` share one dtype, f16 or bf16, `o` is contiguous (its outputs do not
//!   take strided tensors), `g` and `beta` are f32 or bf16;
//! - `H <= 128`, `K` and `V` are multiples of 16 in `[16, 256]`, a lower-bound gate's bound is in
//!   `[-5, 0)`; no request is empty or padding (the op has no notion of either).
//!
//! More than 1024 requests are split into calls of at most 1024 (the op's limit). The mapping:
//! `layout = "TND"`, `chunkSize = 64`, `stateVFirst = true`; with an in-kernel gate
//! `useGateInKernel = true`, `aLog = A_log`, `dtBias = dt_bias` seen as `[H·K]`, and for the
//! lower-bound form `safeGate = true`, `lowerBound = lower_bound`; the L2 norm, when asked for,
//! runs first (the `kda_l2norm` kernel, into `q`'s dtype); initial states are gathered from
//! the request slots (zero for fresh requests) and final states scattered back.
//!
//! `KdaRecurrent` (decode, speculative decode) on `aclnnRecurrentGatedDeltaRule`
//! (`attention/recurrent_gated_delta_rule/docs/aclnnRecurrentGatedDeltaRule.md`) where
//! [`recurrent_route`] finds its contract fits: the op is installed and takes an f32 state (a
//! release whose op takes only bf16 states rejects the first call's phase one; the backend then
//! remembers it and keeps to its own kernel), `q`/`k`/`v`/`beta`/`o` are bf16 (`o` contiguous),
//! `g` is f32, `H <= 256`, `K`, `V <= 512`, at most 8 tokens per request and no more tokens in
//! the call than state slots. The mapping: the flat `[T = B·n, ...]` views, `gk = g` (the
//! per-channel log decay), `g` absent, `ssmStateIndices = state_slots` (the slot after each
//! token; the initial one is entry `numAcceptedTokens - 1` of the request's row),
//! `actualSeqLengths = n` per request, `numAcceptedTokens` the op's or ones, the state `[N, H,
//! V, K]` f32 as `stateRef`. The L2 norm runs first, as for the chunk op. The layer's slots are
//! never negative (`RequestSlots` holds `usize`), so no padding request reaches the op.

use std::ffi::CStr;

use std::sync::atomic::{AtomicBool, Ordering};

use kda_core::kda::{ChunkHostMeta, GateForm, KdaChunk, KdaRecurrent, RecurrenceDims};
use kda_core::{DType, Result, Tensor};

use super::{KeepAlive, Prep, Step};
use crate::backend::AscendBackend;
use crate::backend::descriptor::AclTensor;
use crate::error::AscendError;
use crate::kernels::abi::names;
use crate::kernels::tiling;
use crate::sys;

type T = Tensor<AscendBackend>;

/// The vendor op's limits (its document's constraints).
pub(crate) const MAX_HEADS: usize = 128;
pub(crate) const MAX_SEQUENCES: usize = 1024;
const DIM_RANGE: std::ops::RangeInclusive<usize> = 16..=256;
/// `aclnnRecurrentGatedDeltaRule`'s limits: heads, head dims, tokens per request.
pub(crate) const RECURRENT_MAX_HEADS: usize = 256;
pub(crate) const RECURRENT_MAX_DIM: usize = 512;
pub(crate) const RECURRENT_MAX_TOKENS: usize = 8;

/// Set once the installed `aclnnRecurrentGatedDeltaRule` has rejected an f32 state (an earlier
/// release takes bf16 states only): from then on `KdaRecurrent` runs on the project's kernel.
static RECURRENT_REJECTS_F32_STATE: AtomicBool = AtomicBool::new(false);

/// Whether the installed vendor ops take the prototypes kda binds (it binds by name only, so
/// another prototype would be undefined behaviour, not an error): `Err` says why not, and the
/// project's kernel runs. Decided once per process (the libraries are too).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Prototypes {
    /// `aclnnChunkKdaFwd`'s 30-argument prototype (`stateVFirst`, `safeGate`, `lowerBound`,
    /// `useGateInKernel` and eleven outputs).
    pub chunk: std::result::Result<(), String>,
    /// `aclnnRecurrentGatedDeltaRule` with a per-channel `gk` (the current document; the
    /// earlier English page reserves `gk`).
    pub recurrent: std::result::Result<(), String>,
}

/// The CANN releases whose vendor-op prototypes someone has checked against the ones kda binds
/// (the op, the first release confirmed). None yet: public ops-transformer trees carry 24-,
/// 26- and 30-argument `aclnnChunkKdaFwd` and no release tag maps them, so the first run on an
/// NPU adds the release it confirms here. `KDA_ASCEND_VENDOR_OPS=trust` takes the installed
/// prototypes as kda's (the owner's say-so, for that run).
const CONFIRMED: &[(&str, sys::Release)] = &[];

/// What decides [`Prototypes`]: the release found (and where), whether the runtime is kda's
/// emulator (which implements exactly the documents kda binds), and the owner's override.
pub(crate) fn prototypes_for(
    release: Option<(sys::Release, String)>,
    emulated: bool,
    trust: bool,
) -> Prototypes {
    let judge = |op: &str| -> std::result::Result<(), String> {
        if trust {
            return Ok(());
        }
        match &release {
            Some((r, source)) => {
                if CONFIRMED.iter().any(|(o, since)| *o == op && r >= since) {
                    Ok(())
                } else {
                    Err(format!(
                        "{op}'s prototype is not confirmed for CANN {r} ({source}); \
                         KDA_ASCEND_VENDOR_OPS=trust uses it anyway"
                    ))
                }
            }
            None if emulated => Ok(()),
            None => Err(format!(
                "CANN's release is unknown (no aclsysGetCANNVersion, no install record), so \
                 {op}'s prototype cannot be confirmed; KDA_ASCEND_VENDOR_OPS=trust uses it anyway"
            )),
        }
    };
    Prototypes {
        chunk: judge("aclnnChunkKdaFwd"),
        recurrent: judge("aclnnRecurrentGatedDeltaRule"),
    }
}

/// This process's [`Prototypes`].
pub(crate) fn prototypes() -> &'static Prototypes {
    static ONCE: std::sync::OnceLock<Prototypes> = std::sync::OnceLock::new();
    ONCE.get_or_init(|| {
        let trust = std::env::var("KDA_ASCEND_VENDOR_OPS").is_ok_and(|v| v == "trust");
        prototypes_for(sys::installed_release(), cfg!(not(feature = "acl")), trust)
    })
}

/// Why a `KdaChunk` runs on the project's kernel instead of `aclnnChunkKdaFwd`.
pub(crate) fn chunk_route<'c>(
    c: &'c KdaChunk<AscendBackend>,
    d: RecurrenceDims,
    capturing: bool,
    api: Option<&sys::Api>,
) -> std::result::Result<&'c ChunkHostMeta, String> {
    if !api.is_some_and(|a| a.has_all(&sys::CHUNK_KDA_SYMBOLS)) {
        return Err("aclnnChunkKdaFwd is absent from this CANN".into());
    }
    prototypes().chunk.clone()?;
    if capturing {
        return Err("captured: the executor's host offsets would not follow a replay".into());
    }
    let Some(meta) = &c.host_meta else {
        return Err("no host metadata (cuSeqlens is taken on the host)".into());
    };
    if c.chunk_state_slots.is_some() {
        return Err("chunk-boundary states asked for (hOut is not f32 in slots)".into());
    }
    let half = [DType::F16, DType::BF16];
    let dt = c.q.dtype();
    if !half.contains(&dt) || [&c.k, &c.v, &c.o].iter().any(|t| t.dtype() != dt) {
        return Err(format!(
            "q/k/v/o dtypes {}/{}/{}/{} (the op takes one of f16, bf16)",
            dt,
            c.k.dtype(),
            c.v.dtype(),
            c.o.dtype()
        ));
    }
    if !c.o.layout().is_contiguous() {
        return Err("o is strided (attnOut must be contiguous)".into());
    }
    let io = [DType::F32, DType::BF16];
    if !io.contains(&c.g.dtype()) || !io.contains(&c.beta.dtype()) {
        return Err(format!("g/beta dtypes {}/{} (f32 or bf16)", c.g.dtype(), c.beta.dtype()));
    }
    if d.heads == 0 || d.heads > MAX_HEADS {
        return Err(format!("H = {} (0 < H <= {MAX_HEADS})", d.heads));
    }
    for (name, x) in [("K", d.k), ("V", d.v)] {
        if !DIM_RANGE.contains(&x) || x % 16 != 0 {
            return Err(format!("{name} = {x} (a multiple of 16 in [16, 256])"));
        }
    }
    if let Some(gate) = &c.gate {
        if gate.a_log.dtype() != DType::F32 || gate.dt_bias.dtype() != DType::F32 {
            return Err("A_log / dt_bias not f32".into());
        }
        if !gate.dt_bias.layout().is_contiguous() {
            return Err("dt_bias is strided (dtBias is [H·K])".into());
        }
        if let GateForm::LowerBound { lower_bound } = gate.form
            && !(-5.0..0.0).contains(&lower_bound)
        {
            return Err(format!("lower_bound {lower_bound} (the op takes [-5, 0))"));
        }
    }
    if meta.cu_seqlens.windows(2).any(|w| w[1] <= w[0]) {
        return Err("an empty request".into());
    }
    if meta.state_slots.iter().any(|&s| s < 0 || s as usize >= d.slots) {
        return Err("a padding request (negative slot) or a slot out of range".into());
    }
    if meta.cu_seqlens.last().is_none_or(|&t| t as usize > d.tokens) {
        return Err("offsets past the tokens".into());
    }
    Ok(meta)
}

/// An `aclIntArray` destroyed with the steps (after the executor has run).
struct IntArray(usize);

// SAFETY: an opaque handle the runtime owns; it is only destroyed (once), from whichever thread
// drops the steps.
unsafe impl Send for IntArray {}
// SAFETY: as above; no method reads through it.
unsafe impl Sync for IntArray {}

impl IntArray {
    fn new(values: &[i64]) -> Result<Self> {
        // SAFETY: `values` is live for the call, which copies it.
        let raw = unsafe { sys::aclCreateIntArray(values.as_ptr(), values.len() as u64) };
        if raw.is_null() {
            return Err(AscendError::Acl {
                func: "aclCreateIntArray",
                code: sys::ACL_ERROR_INVALID_PARAM,
                message: sys::recent_error(),
            }
            .into());
        }
        Ok(Self(raw as usize))
    }

    fn ptr(&self) -> *const sys::aclIntArray {
        self.0 as *const sys::aclIntArray
    }
}

impl Drop for IntArray {
    fn drop(&mut self) {
        // SAFETY: created by `aclCreateIntArray`, destroyed once.
        let _ = unsafe { sys::aclDestroyIntArray(self.ptr()) };
    }
}

/// `KdaChunk` as `aclnnChunkKdaFwd` calls (after [`chunk_route`] accepted it).
pub(super) fn chunk(
    p: &mut Prep<'_>,
    c: &KdaChunk<AscendBackend>,
    d: RecurrenceDims,
    meta: &ChunkHostMeta,
) -> Result<()> {
    let (h, kd, vd) = (d.heads, d.k, d.v);
    let (mut q, mut k) = (c.q.clone(), c.k.clone());
    if c.qk_l2norm {
        // The op does not normalise: the project's L2 norm first, into q's dtype.
        let rows = d.tokens * h;
        for x in [&mut q, &mut k] {
            let y = p.temp(x.dtype(), x.shape())?;
            let work = tiling::l2norm(rows, kd, x.dtype().size_bytes());
            p.kernel(names::L2NORM, work, &[Some(&*x), Some(&y)], &[1.0])?;
            *x = y;
        }
    }
    let requests = meta.state_slots.len();
    let mut first = 0;
    while first < requests {
        let last = (first + MAX_SEQUENCES).min(requests);
        call(p, c, (h, kd, vd), (&q, &k), meta, first..last)?;
        first = last;
    }
    Ok(())
}

/// One `aclnnChunkKdaFwd` call for requests `batch` (their tokens are one run of rows).
fn call(
    p: &mut Prep<'_>,
    c: &KdaChunk<AscendBackend>,
    (h, kd, vd): (usize, usize, usize),
    (q, k): (&T, &T),
    meta: &ChunkHostMeta,
    batch: std::ops::Range<usize>,
) -> Result<()> {
    const OP: &str = "aclnnChunkKdaFwd";
    let start = meta.cu_seqlens[batch.start] as usize;
    let end = meta.cu_seqlens[batch.end] as usize;
    let tokens = end - start;
    let n = batch.len();
    let rows = |t: &T| t.narrow(0, start, tokens);
    let (q, k, v, g, beta, o) =
        (rows(q)?, rows(k)?, rows(&c.v)?, rows(&c.g)?, rows(&c.beta)?, rows(&c.o)?);
    // Initial states gathered from the request slots (zero when fresh), finals scattered back.
    let initial = p.temp(DType::F32, &[n, h, vd, kd])?;
    let finals = p.temp(DType::F32, &[n, h, vd, kd])?;
    for (i, b) in batch.clone().enumerate() {
        let into = initial.narrow(0, i, 1)?;
        if meta.has_initial_state[b] != 0 {
            let slot = c.state.narrow(0, meta.state_slots[b] as usize, 1)?;
            p.copy(&slot, &into)?;
        } else {
            p.fill(&into, 0.0)?;
        }
    }
    let cu: Vec<i64> = meta.cu_seqlens[batch.start..=batch.end]
        .iter()
        .map(|&x| i64::from(x) - start as i64)
        .collect();
    let cu = IntArray::new(&cu)?;
    let chunk = 64usize;
    let aqk = p.temp(q.dtype(), &[h, tokens, chunk])?;
    let akk = p.temp(q.dtype(), &[h, tokens, chunk])?;
    let gate = c.gate.as_ref();
    let (safe_gate, lower_bound) = match gate.map(|g| g.form) {
        Some(GateForm::LowerBound { lower_bound }) => (true, f64::from(lower_bound)),
        _ => (false, 0.0),
    };
    let mut tensors = vec![
        AclTensor::of(OP, &q)?,
        AclTensor::of(OP, &k)?,
        AclTensor::of(OP, &v)?,
        AclTensor::of(OP, &g)?,
        AclTensor::of(OP, &beta)?,
        AclTensor::of(OP, &initial)?,
        AclTensor::of(OP, &o)?,
        AclTensor::of(OP, &finals)?,
        AclTensor::of(OP, &aqk)?,
        AclTensor::of(OP, &akk)?,
    ];
    if let Some(gate) = gate {
        tensors.push(AclTensor::of(OP, &gate.a_log)?);
        tensors.push(AclTensor::of(OP, &gate.dt_bias.reshape(&[h * kd])?)?);
    }
    let use_gate = gate.is_some();
    let scale = f64::from(c.scale);
    let cu_ptr = cu.ptr() as usize;
    p.aclnn(
        "aclnnChunkKdaFwdGetWorkspaceSize",
        OP,
        sys::aclnnChunkKdaFwd,
        tensors,
        None,
        Box::new(move |t, _, ws, ex| {
            let none = std::ptr::null();
            let (a_log, dt_bias) = if use_gate {
                (t[10].ptr().cast_const(), t[11].ptr().cast_const())
            } else {
                (none, none)
            };
            let layout: &CStr = c"TND";
            // SAFETY: live descriptors and int array, a static C string, null optional
            // operands, valid out-parameters.
            unsafe {
                sys::aclnnChunkKdaFwdGetWorkspaceSize(
                    t[0].ptr(),
                    t[1].ptr(),
                    t[2].ptr(),
                    t[3].ptr(),
                    t[4].ptr(),
                    a_log,
                    dt_bias,
                    t[5].ptr(),
                    cu_ptr as *const sys::aclIntArray,
                    std::ptr::null(),
                    layout.as_ptr(),
                    scale,
                    64,
                    safe_gate,
                    lower_bound,
                    use_gate,
                    true,
                    t[6].ptr(),
                    t[7].ptr(),
                    none,
                    t[8].ptr(),
                    t[9].ptr(),
                    none,
                    none,
                    none,
                    none,
                    none,
                    none,
                    ws,
                    ex,
                )
            }
        }),
    )?;
    p.steps.push(Step::Keep(KeepAlive(Box::new(cu))));
    for (i, b) in batch.enumerate() {
        let slot = c.state.narrow(0, meta.state_slots[b] as usize, 1)?;
        p.copy(&finals.narrow(0, i, 1)?, &slot)?;
    }
    Ok(())
}

/// Why a `KdaRecurrent` runs on the project's kernel instead of `aclnnRecurrentGatedDeltaRule`.
pub(crate) fn recurrent_route(
    r: &KdaRecurrent<AscendBackend>,
    d: RecurrenceDims,
    api: Option<&sys::Api>,
) -> std::result::Result<(), String> {
    if !api.is_some_and(|a| a.has_all(&sys::RECURRENT_GDR_SYMBOLS)) {
        return Err("aclnnRecurrentGatedDeltaRule is absent from this CANN".into());
    }
    prototypes().recurrent.clone()?;
    if RECURRENT_REJECTS_F32_STATE.load(Ordering::Relaxed) {
        return Err("this CANN's aclnnRecurrentGatedDeltaRule takes no f32 state".into());
    }
    let operands = [("q", &r.q), ("k", &r.k), ("v", &r.v), ("beta", &r.beta), ("o", &r.o)];
    if let Some((name, t)) = operands.iter().find(|(_, t)| t.dtype() != DType::BF16) {
        return Err(format!("{name} is {} (the op takes bf16 q/k/v/beta/out)", t.dtype()));
    }
    if r.g.dtype() != DType::F32 {
        return Err(format!("g is {} (gk is f32)", r.g.dtype()));
    }
    if !r.o.layout().is_contiguous() {
        return Err("o is strided (out must be contiguous)".into());
    }
    if d.batch == 0 || d.tokens == 0 || d.heads == 0 || d.k == 0 || d.v == 0 {
        return Err("an empty call (the op takes no empty tensors)".into());
    }
    if d.heads > RECURRENT_MAX_HEADS {
        return Err(format!("H = {} (at most {RECURRENT_MAX_HEADS})", d.heads));
    }
    if d.k > RECURRENT_MAX_DIM || d.v > RECURRENT_MAX_DIM {
        return Err(format!("K = {}, V = {} (at most {RECURRENT_MAX_DIM})", d.k, d.v));
    }
    if d.tokens > RECURRENT_MAX_TOKENS {
        return Err(format!("{} tokens per request (at most {RECURRENT_MAX_TOKENS})", d.tokens));
    }
    if d.batch * d.tokens > d.slots {
        return Err(format!("T = {} exceeds the {} state slots", d.batch * d.tokens, d.slots));
    }
    Ok(())
}

/// `KdaRecurrent` as one `aclnnRecurrentGatedDeltaRule` call (after [`recurrent_route`]
/// accepted it). `Ok(false)`: this CANN's op rejected the f32 state; nothing was queued and
/// the caller runs the project's kernel.
pub(super) fn recurrent(
    p: &mut Prep<'_>,
    r: &KdaRecurrent<AscendBackend>,
    d: RecurrenceDims,
) -> Result<bool> {
    const OP: &str = "aclnnRecurrentGatedDeltaRule";
    let mark = p.steps.len();
    let (b, n, h, kd, vd) = (d.batch, d.tokens, d.heads, d.k, d.v);
    let t = b * n;
    let flat = |x: &T, tail: &[usize]| x.reshape(&[&[t][..], tail].concat());
    let (q, k) = (flat(&r.q, &[h, kd])?, flat(&r.k, &[h, kd])?);
    // The op's own inputs first; what fills them is queued after its phase one succeeded (and
    // moved before it), so a rejection leaves no executor behind.
    let (qn, kn) = if r.qk_l2norm {
        (p.temp(q.dtype(), q.shape())?, p.temp(k.dtype(), k.shape())?)
    } else {
        (q.clone(), k.clone())
    };
    let lens = p.temp(DType::I32, &[b])?;
    let (accepted, ones) = match &r.num_accepted_tokens {
        Some(a) => (a.clone(), None),
        None => {
            let ones = p.temp(DType::I32, &[b])?;
            (ones.clone(), Some(ones))
        }
    };
    let tensors = vec![
        AclTensor::of(OP, &qn)?,
        AclTensor::of(OP, &kn)?,
        AclTensor::of(OP, &flat(&r.v, &[h, vd])?)?,
        AclTensor::of(OP, &flat(&r.beta, &[h])?)?,
        AclTensor::of(OP, &r.state)?,
        AclTensor::of(OP, &lens)?,
        AclTensor::of(OP, &flat(&r.state_slots, &[])?)?,
        AclTensor::of(OP, &flat(&r.g, &[h, kd])?)?,
        AclTensor::of(OP, &accepted)?,
        AclTensor::of(OP, &flat(&r.o, &[h, vd])?)?,
    ];
    let scale = r.scale;
    let status = std::sync::Arc::new(std::sync::atomic::AtomicI32::new(0));
    let call_at = p.steps.len();
    let seen = status.clone();
    let queued = p.aclnn(
        "aclnnRecurrentGatedDeltaRuleGetWorkspaceSize",
        OP,
        sys::aclnnRecurrentGatedDeltaRule,
        tensors,
        None,
        Box::new(move |t, _, ws, ex| {
            // SAFETY: live descriptors, a null optional `g`, valid out-parameters.
            let code = unsafe {
                sys::aclnnRecurrentGatedDeltaRuleGetWorkspaceSize(
                    t[0].ptr(),
                    t[1].ptr(),
                    t[2].ptr(),
                    t[3].ptr(),
                    t[4].ptr(),
                    t[5].ptr(),
                    t[6].ptr(),
                    std::ptr::null(),
                    t[7].ptr(),
                    t[8].ptr(),
                    scale,
                    t[9].ptr(),
                    ws,
                    ex,
                )
            };
            seen.store(code, Ordering::Relaxed);
            code
        }),
    );
    match queued {
        Ok(()) => {
            if r.qk_l2norm {
                // The op does not normalise: the project's L2 norm first, into bf16.
                for (x, y) in [(&q, &qn), (&k, &kn)] {
                    let work = tiling::l2norm(t * h, kd, x.dtype().size_bytes());
                    p.kernel(names::L2NORM, work, &[Some(x), Some(y)], &[1.0])?;
                }
            }
            p.fill(&lens, n as f64)?;
            if let Some(ones) = &ones {
                p.fill(ones, 1.0)?;
            }
            p.steps[call_at..].rotate_left(1);
            Ok(true)
        }
        Err(e) if status.load(Ordering::Relaxed) == sys::ACLNN_ERR_PARAM_INVALID => {
            // Everything the call was routed on fits the current document, so the one
            // argument an earlier release rejects is the f32 state: remember it, drop what was
            // queued for the call, and let the project's kernel run.
            tracing::warn!(error = %e, "{OP} rejects the f32 state: the project's kernel runs");
            RECURRENT_REJECTS_F32_STATE.store(true, Ordering::Relaxed);
            p.steps.truncate(mark);
            Ok(false)
        }
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vendor_prototypes_are_used_only_where_confirmed() {
        let old = Some((sys::Release::new(8, 3), "a record".to_string()));
        let p = prototypes_for(old.clone(), true, false);
        let why = p.chunk.expect_err("8.3 is not confirmed");
        assert!(why.contains("not confirmed for CANN 8.3 (a record)"), "{why}");
        assert!(p.recurrent.is_err());
        assert!(prototypes_for(None, false, false).chunk.is_err(), "unknown release on hardware");
        assert_eq!(prototypes_for(None, true, false).chunk, Ok(()), "the emulator's documents");
        assert_eq!(prototypes_for(old, false, true).recurrent, Ok(()), "the owner's override");
    }
}
