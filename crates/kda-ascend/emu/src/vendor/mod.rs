//! The vendor KDA operators of CANN's ops-transformer, emulated from their documentation:
//! `aclnnChunkKdaFwd` (`attention/chunk_kda_fwd/docs/aclnnChunkKdaFwd.md`) and
//! `aclnnRecurrentGatedDeltaRule` (`attention/recurrent_gated_delta_rule/docs/
//! aclnnRecurrentGatedDeltaRule.md`), with the host integer arrays (`aclCreateIntArray`) the
//! first takes its offsets in.
//!
//! Phase one checks every argument the documents constrain and fails with the documented code
//! (`ACLNN_ERR_PARAM_NULLPTR` 161001 for a missing required tensor, `ACLNN_ERR_PARAM_INVALID`
//! 161002 for a dtype, shape, layout, limit or attribute out of range). Phase two computes in
//! the emulator's own code, at the precision the operators' kernel sources give every
//! intermediate ([`chunk_kda`], [`recurrent`]: which dtype each has and where it is rounded),
//! so a wrong mapping (a swapped flag, a k-first state passed as v-first, a missing `A_log`)
//! gives wrong numbers, and the bf16 rounding of the real op's intermediates is in the result.
//! `aqkOut` and `akkOut` are computed; the optional intermediate outputs (`gkOut` … `hOut`) are
//! filled with NaN, and the layouts `BNSD`/`NTD` fail with `ACLNN_ERR_INNER` naming the
//! emulator.
//!
//! `KDA_ACL_EMU_VENDOR_OPS=none` emulates a CANN release without these operators (the symbols
//! are absent from the table); `KDA_ACL_EMU_VENDOR_OPS=old` one whose
//! `aclnnRecurrentGatedDeltaRule` takes only a bf16 state (the English page of the same
//! document, an earlier release), which the backend finds out by probing.

use std::collections::HashMap;
use std::ffi::{CStr, c_char, c_void};
use std::sync::{LazyLock, Mutex, PoisonError};

use kda_core::{DType, HostFn};

use crate::host::{self, Store};
use crate::nn::{execute, prepare, tensor};
use crate::types::*;
use crate::{Emu, Res, T, array, call, emu};

mod chunk_kda;
mod recurrent;

/// Which vendor operators this emulated CANN ships (`KDA_ACL_EMU_VENDOR_OPS`).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum VendorOps {
    /// Both, with an f32 recurrent state (the current document).
    Current,
    /// Both, the recurrent op with a bf16 state only (the earlier release).
    Old,
    /// Neither.
    None,
}

pub(crate) fn vendor_ops() -> VendorOps {
    match std::env::var("KDA_ACL_EMU_VENDOR_OPS").as_deref() {
        Ok("none") => VendorOps::None,
        Ok("old") => VendorOps::Old,
        _ => VendorOps::Current,
    }
}

/// Put the vendor symbols into `api` unless this CANN lacks them.
pub(crate) fn register(api: &mut kda_ascend_sys::Api) {
    api.aclCreateIntArray = Some(aclCreateIntArray);
    api.aclDestroyIntArray = Some(aclDestroyIntArray);
    if vendor_ops() == VendorOps::None {
        return;
    }
    api.aclnnChunkKdaFwdGetWorkspaceSize = Some(aclnnChunkKdaFwdGetWorkspaceSize);
    api.aclnnChunkKdaFwd = Some(aclnnChunkKdaFwd);
    api.aclnnRecurrentGatedDeltaRuleGetWorkspaceSize =
        Some(aclnnRecurrentGatedDeltaRuleGetWorkspaceSize);
    api.aclnnRecurrentGatedDeltaRule = Some(aclnnRecurrentGatedDeltaRule);
}

static INT_ARRAYS: LazyLock<Mutex<HashMap<usize, Vec<i64>>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));

fn int_arrays() -> std::sync::MutexGuard<'static, HashMap<usize, Vec<i64>>> {
    INT_ARRAYS.lock().unwrap_or_else(PoisonError::into_inner)
}

/// `aclCreateIntArray`: a host copy of `size` int64 values.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn aclCreateIntArray(value: *const i64, size: u64) -> *mut aclIntArray {
    let mut handle = std::ptr::null_mut();
    let code = call(|| {
        // SAFETY: CANN's contract: `value` holds `size` values.
        let values = unsafe { array(value, size as usize) }?;
        let h = emu().handle();
        int_arrays().insert(h, values);
        handle = h as *mut aclIntArray;
        Ok(())
    });
    if code == ACL_SUCCESS { handle } else { std::ptr::null_mut() }
}

#[unsafe(no_mangle)]
pub extern "C" fn aclDestroyIntArray(array: *const aclIntArray) -> aclnnStatus {
    call(|| match int_arrays().remove(&(array as usize)) {
        Some(_) => Ok(()),
        None => Err((ACLNN_ERR_PARAM_INVALID, format!("aclDestroyIntArray: unknown {array:?}"))),
    })
}

fn ints(api: &str, param: &str, a: *const aclIntArray) -> Res<Option<Vec<i64>>> {
    if a.is_null() {
        return Ok(None);
    }
    int_arrays().get(&(a as usize)).cloned().map(Some).ok_or_else(|| {
        (ACLNN_ERR_PARAM_INVALID, format!("{api}: {param}: unknown aclIntArray {a:?}"))
    })
}

fn param_invalid<V>(api: &str, message: impl std::fmt::Display) -> Res<V> {
    Err((ACLNN_ERR_PARAM_INVALID, format!("{api}: {message}")))
}

fn not_emulated<V>(api: &str, message: impl std::fmt::Display) -> Res<V> {
    Err((ACLNN_ERR_INNER, format!("{api}: {message} is not emulated (kda-acl-emu)")))
}

fn optional(emu: &Emu, api: &str, param: &str, t: *const aclTensor) -> Res<Option<T>> {
    if t.is_null() { Ok(None) } else { tensor(emu, api, param, t).map(|(t, _)| Some(t)) }
}

fn require_dtype(api: &str, param: &str, t: &T, allowed: &[DType]) -> Res<()> {
    if allowed.contains(&t.dtype()) {
        Ok(())
    } else {
        param_invalid(api, format!("{param} dtype {} (supported: {allowed:?})", t.dtype()))
    }
}

fn require_shape(api: &str, param: &str, t: &T, want: &[usize]) -> Res<()> {
    if t.shape() == want {
        Ok(())
    } else {
        param_invalid(api, format!("{param} shape {:?}, expected {want:?}", t.shape()))
    }
}

/// The document's dimension limits: `0 < H <= HV <= 128`, `HV % H == 0`, `K` and `V` multiples
/// of 16 in `[16, 256]`.
fn check_chunk_dims(api: &str, h: usize, hv: usize, k: usize, v: usize) -> Res<()> {
    if h == 0 || hv < h || hv > 128 || !hv.is_multiple_of(h) {
        return param_invalid(
            api,
            format!("H = {h}, HV = {hv}: need 0 < H <= HV <= 128, HV % H == 0"),
        );
    }
    for (name, d) in [("K", k), ("V", v)] {
        if !(16..=256).contains(&d) || d % 16 != 0 {
            return param_invalid(api, format!("{name} = {d}: need a multiple of 16 in [16, 256]"));
        }
    }
    Ok(())
}

/// A prepared `aclnnChunkKdaFwd`: its tensors and attributes, run on the stream.
struct ChunkJob {
    q: T,
    k: T,
    v: T,
    g: T,
    beta: T,
    /// `A_log`, `dt_bias` and `safeGate`'s lower bound, with `useGateInKernel`.
    gate: Option<(T, Option<T>, Option<f32>)>,
    initial: Option<T>,
    final_state: Option<T>,
    attn: T,
    aqk: T,
    akk: T,
    /// Optional outputs the emulator does not compute: filled with NaN.
    intermediates: Vec<T>,
    /// `H`, `HV`, `K`, `V`.
    dims: (usize, usize, usize, usize),
    chunk: usize,
    /// `B` of the layout (1 for `TND`).
    batch: usize,
    offsets: Vec<usize>,
    state_v_first: bool,
    scale: f32,
    store: Store,
    safe_gate: bool,
}

/// `[N, HV, a, b]` as `[N, HV, b, a]`.
fn transpose_states(x: &[f32], a: usize, b: usize) -> Vec<f32> {
    let mut out = vec![0.0; x.len()];
    for (src, dst) in x.chunks(a * b).zip(out.chunks_mut(a * b)) {
        for i in 0..a {
            for j in 0..b {
                dst[j * a + i] = src[i * b + j];
            }
        }
    }
    out
}

impl ChunkJob {
    fn run(&self) -> Result<(), String> {
        let (h, hv, kd, vd) = self.dims;
        // SAFETY: the executor's tensors keep their buffers alive; the stream runs this task
        // in order with the work that writes and reads them, as the device would.
        let read = |t: &T| unsafe { host::read_f32(t) };
        let initial = self.initial.as_ref().map(|t| {
            let x = read(t);
            if self.state_v_first { transpose_states(&x, vd, kd) } else { x }
        });
        let gate = self.gate.as_ref().map(|(a_log, dt_bias, lower_bound)| chunk_kda::Gate {
            a_log: read(a_log),
            dt_bias: dt_bias.as_ref().map(read),
            lower_bound: *lower_bound,
        });
        let op = chunk_kda::Chunk {
            h,
            hv,
            k: kd,
            v: vd,
            chunk: self.chunk,
            q: read(&self.q),
            key: read(&self.k),
            value: read(&self.v),
            g: read(&self.g),
            beta: read(&self.beta),
            gate,
            offsets: self.offsets.clone(),
            initial,
            scale: self.scale,
            store: self.store,
            safe_gate: self.safe_gate,
        };
        let out = op.run();
        // aqkOut / akkOut are `[B, HV, S, C]`; the computation's are `[HV, B·S, C]`.
        let head_major = |x: &[f32]| -> Vec<f32> {
            let tokens = x.len() / (hv * self.chunk).max(1);
            let seq = tokens / self.batch.max(1);
            let row = seq * self.chunk;
            let mut y = vec![0.0; x.len()];
            for head in 0..hv {
                for b in 0..self.batch {
                    let src = &x[(head * tokens + b * seq) * self.chunk..][..row];
                    y[(b * hv + head) * row..][..row].copy_from_slice(src);
                }
            }
            y
        };
        // SAFETY: as above; the outputs are this task's to write.
        unsafe {
            host::write_f32(&self.attn, &out.o);
            host::write_f32(&self.aqk, &head_major(&out.aqk));
            host::write_f32(&self.akk, &head_major(&out.akk));
            if let Some(f) = &self.final_state {
                let x = out.final_state;
                let x = if self.state_v_first { transpose_states(&x, kd, vd) } else { x };
                host::write_f32(f, &x);
            }
            for t in &self.intermediates {
                host::write_f32(t, &vec![f32::NAN; t.numel()]);
            }
        }
        Ok(())
    }
}

/// The most sequences one varlen call takes.
pub const MAX_SEQUENCES: usize = 1024;

#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments, reason = "CANN's signature")]
pub unsafe extern "C" fn aclnnChunkKdaFwdGetWorkspaceSize(
    q: *const aclTensor,
    k: *const aclTensor,
    v: *const aclTensor,
    g: *const aclTensor,
    beta: *const aclTensor,
    a_log: *const aclTensor,
    dt_bias: *const aclTensor,
    initial_state: *const aclTensor,
    cu_seqlens: *const aclIntArray,
    chunk_indices: *const aclIntArray,
    layout: *const c_char,
    scale: f64,
    chunk_size: i64,
    safe_gate: bool,
    lower_bound: f64,
    use_gate_in_kernel: bool,
    state_v_first: bool,
    attn_out: *const aclTensor,
    final_state_out: *const aclTensor,
    gk_out: *const aclTensor,
    aqk_out: *const aclTensor,
    akk_out: *const aclTensor,
    w_out: *const aclTensor,
    u_out: *const aclTensor,
    qg_out: *const aclTensor,
    kg_out: *const aclTensor,
    v_new_out: *const aclTensor,
    h_out: *const aclTensor,
    workspace_size: *mut u64,
    executor: *mut *mut aclOpExecutor,
) -> aclnnStatus {
    const API: &str = "aclnnChunkKdaFwd";
    // SAFETY: `layout` is null or a C string (CANN's contract).
    let layout = (!layout.is_null()).then(|| unsafe { CStr::from_ptr(layout) }.to_owned());
    let intermediates = [
        ("gkOut", gk_out),
        ("wOut", w_out),
        ("uOut", u_out),
        ("qgOut", qg_out),
        ("kgOut", kg_out),
        ("vNewOut", v_new_out),
        ("hOut", h_out),
    ];
    // SAFETY: forwarded out-parameters.
    unsafe {
        prepare(API, 0, workspace_size, executor, |emu| {
            // Required tensors (161001).
            let (q, _) = tensor(emu, API, "q", q)?;
            let (k, _) = tensor(emu, API, "k", k)?;
            let (v, _) = tensor(emu, API, "v", v)?;
            let (g, _) = tensor(emu, API, "g", g)?;
            let (beta, _) = tensor(emu, API, "beta", beta)?;
            let (attn, _) = tensor(emu, API, "attnOut", attn_out)?;
            let (aqk, _) = tensor(emu, API, "aqkOut", aqk_out)?;
            let (akk, _) = tensor(emu, API, "akkOut", akk_out)?;
            if use_gate_in_kernel && a_log.is_null() {
                return Err((
                    ACLNN_ERR_PARAM_NULLPTR,
                    format!("{API}: aLogOptional is null with useGateInKernel = true"),
                ));
            }
            let a_log = optional(emu, API, "aLogOptional", a_log)?;
            let dt_bias = optional(emu, API, "dtBiasOptional", dt_bias)?;
            let initial = optional(emu, API, "initialStateOptional", initial_state)?;
            let final_state = optional(emu, API, "finalStateOut", final_state_out)?;
            let cu = ints(API, "cuSeqlensOptional", cu_seqlens)?;
            let indices = ints(API, "chunkIndicesOptional", chunk_indices)?;

            // Layout and sizes.
            let layout = layout.as_ref().map(|l| l.to_string_lossy().into_owned());
            let (batch, seq) = match layout.as_deref() {
                Some("TND") => match *q.shape() {
                    [t, _, _] => (1, t),
                    _ => return param_invalid(API, format!("q shape {:?} for TND", q.shape())),
                },
                Some("BSND") => match *q.shape() {
                    [b, s, _, _] => (b, s),
                    _ => return param_invalid(API, format!("q shape {:?} for BSND", q.shape())),
                },
                Some(l @ ("BNSD" | "NTD")) => return not_emulated(API, format!("layout {l}")),
                other => {
                    return param_invalid(API, format!("layout {other:?}: BSND, BNSD, TND or NTD"));
                }
            };
            let tokens = batch * seq;
            let rank = q.shape().len();
            let (h, kd) = (q.shape()[rank - 2], q.shape()[rank - 1]);
            let (hv, vd) = match v.shape() {
                s if s.len() == rank && s[..rank - 2] == q.shape()[..rank - 2] => {
                    (s[rank - 2], s[rank - 1])
                }
                s => return param_invalid(API, format!("v shape {s:?} against q {:?}", q.shape())),
            };
            if tokens == 0 || kd == 0 || vd == 0 {
                return param_invalid(API, "empty tensors are not supported");
            }
            check_chunk_dims(API, h, hv, kd, vd)?;
            let lead = &q.shape()[..rank - 2];
            let with = |tail: &[usize]| [lead, tail].concat();
            require_shape(API, "k", &k, q.shape())?;
            require_shape(API, "g", &g, &with(&[hv, kd]))?;
            require_shape(API, "beta", &beta, &with(&[hv]))?;
            require_shape(API, "attnOut", &attn, &with(&[hv, vd]))?;
            let half = [DType::F16, DType::BF16];
            require_dtype(API, "q", &q, &half)?;
            for (name, t) in
                [("k", &k), ("v", &v), ("attnOut", &attn), ("aqkOut", &aqk), ("akkOut", &akk)]
            {
                if t.dtype() != q.dtype() {
                    return param_invalid(
                        API,
                        format!("{name} dtype {}, q is {}", t.dtype(), q.dtype()),
                    );
                }
            }
            require_dtype(API, "g", &g, &[DType::F32, DType::BF16])?;
            require_dtype(API, "beta", &beta, &[DType::F32, DType::BF16])?;
            if !matches!(chunk_size, 64 | 128) {
                return param_invalid(API, format!("chunkSize {chunk_size}: 64 or 128"));
            }
            let c = chunk_size as usize;
            let head_major = if rank == 3 { vec![hv, tokens, c] } else { vec![batch, hv, seq, c] };
            require_shape(API, "aqkOut", &aqk, &head_major)?;
            require_shape(API, "akkOut", &akk, &head_major)?;
            if use_gate_in_kernel && safe_gate && !(-5.0..0.0).contains(&lower_bound) {
                return param_invalid(
                    API,
                    format!("lowerBound {lower_bound}: in [-5, 0) with safeGate"),
                );
            }
            if let Some(a) = &a_log {
                require_dtype(API, "aLogOptional", a, &[DType::F32])?;
                require_shape(API, "aLogOptional", a, &[hv])?;
            }
            if let Some(d) = &dt_bias {
                require_dtype(API, "dtBiasOptional", d, &[DType::F32])?;
                require_shape(API, "dtBiasOptional", d, &[hv * kd])?;
            }

            // Sequences.
            let offsets: Vec<usize> = match &cu {
                Some(cu) => {
                    if rank == 4 && batch != 1 {
                        return param_invalid(API, format!("varlen BSND needs B = 1, got {batch}"));
                    }
                    let ok = cu.first() == Some(&0)
                        && cu.windows(2).all(|w| w[0] <= w[1])
                        && cu.last().copied() == i64::try_from(tokens).ok();
                    if !ok || cu.len() < 2 {
                        return param_invalid(
                            API,
                            format!("cuSeqlens {cu:?}: non-decreasing from 0 to {tokens}"),
                        );
                    }
                    if cu.len() - 1 > MAX_SEQUENCES {
                        return param_invalid(
                            API,
                            format!("{} sequences: at most {MAX_SEQUENCES} per call", cu.len() - 1),
                        );
                    }
                    cu.iter().map(|&x| x as usize).collect()
                }
                None => (0..=batch).map(|b| b * seq).collect(),
            };
            let n = offsets.len() - 1;
            if let Some(indices) = &indices {
                if cu.is_none() {
                    return param_invalid(API, "chunkIndices without cuSeqlens");
                }
                let canonical: Vec<i64> = offsets
                    .windows(2)
                    .enumerate()
                    .flat_map(|(s, w)| {
                        (0..(w[1] - w[0]).div_ceil(c)).flat_map(move |i| [s as i64, i as i64])
                    })
                    .collect();
                if *indices != canonical {
                    return param_invalid(
                        API,
                        "chunkIndices not in sequence-major canonical order",
                    );
                }
            }
            let state_shape = if state_v_first { vec![n, hv, vd, kd] } else { vec![n, hv, kd, vd] };
            for (name, s) in [("initialStateOptional", &initial), ("finalStateOut", &final_state)] {
                if let Some(s) = s {
                    require_dtype(API, name, s, &[DType::F32])?;
                    require_shape(API, name, s, &state_shape)?;
                }
            }

            // The computation, in the emulator's own code at the kernel's precision
            // (`chunk_kda.rs`), on the stream when the executor runs.
            let mut extra = Vec::new();
            for (name, t) in intermediates {
                if let Some(t) = optional(emu, API, name, t)? {
                    extra.push(t);
                }
            }
            let gate = match (use_gate_in_kernel, a_log) {
                (true, Some(a_log)) => {
                    Some((a_log, dt_bias, safe_gate.then_some(lower_bound as f32)))
                }
                _ => None,
            };
            let Some(store) = Store::of(q.dtype()) else {
                return param_invalid(API, format!("q dtype {}", q.dtype()));
            };
            let job = ChunkJob {
                q,
                k,
                v,
                g,
                beta,
                gate,
                initial,
                final_state,
                attn,
                aqk,
                akk,
                intermediates: extra,
                dims: (h, hv, kd, vd),
                chunk: c,
                batch,
                offsets,
                state_v_first,
                scale: scale as f32,
                store,
                safe_gate,
            };
            let run = HostFn::new(move || job.run());
            let ops = vec![run];
            Ok(ops)
        })
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn aclnnChunkKdaFwd(
    ws: *mut c_void,
    size: u64,
    ex: *mut aclOpExecutor,
    stream: aclrtStream,
) -> aclnnStatus {
    execute("aclnnChunkKdaFwd", ws, size, ex, stream)
}

/// The recurrent op's limits: `0 < L_i <= 8`, `0 < Nk <= Nv <= 256`, `Nv % Nk == 0`,
/// `0 < Dk, Dv <= 512`, `T <= BlockNum`.
pub const MAX_RECURRENT_TOKENS: usize = 8;

#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments, reason = "CANN's signature")]
pub unsafe extern "C" fn aclnnRecurrentGatedDeltaRuleGetWorkspaceSize(
    query: *const aclTensor,
    key: *const aclTensor,
    value: *const aclTensor,
    beta: *const aclTensor,
    state_ref: *mut aclTensor,
    actual_seq_lengths: *const aclTensor,
    ssm_state_indices: *const aclTensor,
    g: *const aclTensor,
    gk: *const aclTensor,
    num_accepted_tokens: *const aclTensor,
    scale_value: f32,
    out: *mut aclTensor,
    workspace_size: *mut u64,
    executor: *mut *mut aclOpExecutor,
) -> aclnnStatus {
    const API: &str = "aclnnRecurrentGatedDeltaRule";
    // SAFETY: forwarded out-parameters.
    unsafe {
        prepare(API, 0, workspace_size, executor, |emu| {
            let (q, _) = tensor(emu, API, "query", query)?;
            let (k, _) = tensor(emu, API, "key", key)?;
            let (v, _) = tensor(emu, API, "value", value)?;
            let (beta, _) = tensor(emu, API, "beta", beta)?;
            let (state, _) = tensor(emu, API, "stateRef", state_ref)?;
            let (lens, _) = tensor(emu, API, "actualSeqLengths", actual_seq_lengths)?;
            let (indices, _) = tensor(emu, API, "ssmStateIndices", ssm_state_indices)?;
            let (accepted, _) = tensor(emu, API, "numAcceptedTokens", num_accepted_tokens)?;
            let (o, _) = tensor(emu, API, "out", out)?;
            let g = optional(emu, API, "g", g)?;
            let gk = optional(emu, API, "gk", gk)?;
            let [t, nk, dk] = *q.shape() else {
                return param_invalid(
                    API,
                    format!("query shape {:?}, expected (T, Nk, Dk)", q.shape()),
                );
            };
            let [_, nv, dv] = *v.shape() else {
                return param_invalid(
                    API,
                    format!("value shape {:?}, expected (T, Nv, Dv)", v.shape()),
                );
            };
            let [b] = *lens.shape() else {
                return param_invalid(API, format!("actualSeqLengths shape {:?}", lens.shape()));
            };
            if t == 0 || b == 0 || nk == 0 || dk == 0 || dv == 0 {
                return param_invalid(API, "empty tensors are not supported");
            }
            if nk > 256 || nv < nk || nv > 256 || nv % nk != 0 {
                return param_invalid(
                    API,
                    format!("Nk = {nk}, Nv = {nv}: need 0 < Nk <= Nv <= 256, Nv % Nk == 0"),
                );
            }
            if dk > 512 || dv > 512 {
                return param_invalid(API, format!("Dk = {dk}, Dv = {dv}: at most 512"));
            }
            for (name, x) in
                [("query", &q), ("key", &k), ("value", &v), ("beta", &beta), ("out", &o)]
            {
                require_dtype(API, name, x, &[DType::BF16])?;
            }
            let state_dtypes: &[DType] = match vendor_ops() {
                VendorOps::Old => &[DType::BF16],
                _ => &[DType::BF16, DType::F32],
            };
            require_dtype(API, "stateRef", &state, state_dtypes)?;
            for (name, x) in [
                ("actualSeqLengths", &lens),
                ("ssmStateIndices", &indices),
                ("numAcceptedTokens", &accepted),
            ] {
                require_dtype(API, name, x, &[DType::I32])?;
            }
            require_shape(API, "key", &k, q.shape())?;
            require_shape(API, "beta", &beta, &[t, nv])?;
            require_shape(API, "out", &o, &[t, nv, dv])?;
            require_shape(API, "ssmStateIndices", &indices, &[t])?;
            require_shape(API, "numAcceptedTokens", &accepted, &[b])?;
            let blocks = state.shape().first().copied().unwrap_or(0);
            require_shape(API, "stateRef", &state, &[blocks, nv, dv, dk])?;
            if t > blocks {
                return param_invalid(API, format!("T = {t} exceeds BlockNum = {blocks}"));
            }
            if let Some(g) = &g {
                require_dtype(API, "g", g, &[DType::F32])?;
                require_shape(API, "g", g, &[t, nv])?;
            }
            if let Some(gk) = &gk {
                require_dtype(API, "gk", gk, &[DType::F32])?;
                require_shape(API, "gk", gk, &[t, nv, dk])?;
            }
            // The computation, in the emulator's own code at the kernel's precision
            // (`recurrent.rs`), on the stream when the executor runs.
            let (Some(out_store), Some(state_store)) =
                (Store::of(o.dtype()), Store::of(state.dtype()))
            else {
                return param_invalid(API, "out and stateRef must be float tensors");
            };
            let job = RecurrentJob {
                q,
                k,
                v,
                beta,
                state,
                lens,
                indices,
                accepted,
                g,
                gk,
                o,
                dims: (nk, nv, dk, dv),
                scale: scale_value,
                out_store,
                state_store,
            };
            let run = HostFn::new(move || job.run());
            let ops = vec![run];
            Ok(ops)
        })
    }
}

/// A prepared `aclnnRecurrentGatedDeltaRule`: its tensors and attributes, run on the stream.
struct RecurrentJob {
    q: T,
    k: T,
    v: T,
    beta: T,
    state: T,
    lens: T,
    indices: T,
    accepted: T,
    g: Option<T>,
    gk: Option<T>,
    o: T,
    /// `Nk`, `Nv`, `Dk`, `Dv`.
    dims: (usize, usize, usize, usize),
    scale: f32,
    out_store: Store,
    state_store: Store,
}

impl RecurrentJob {
    fn run(&self) -> Result<(), String> {
        let (nk, nv, dk, dv) = self.dims;
        // SAFETY: the executor's tensors keep their buffers alive; the stream runs this task
        // in order with the work that writes and reads them, as the device would.
        let read = |t: &T| unsafe { host::read_f32(t) };
        // SAFETY: as above.
        let ints = |t: &T| unsafe { host::read_i64(t) };
        let op = recurrent::Recurrent {
            nk,
            nv,
            dk,
            dv,
            q: read(&self.q),
            key: read(&self.k),
            value: read(&self.v),
            beta: read(&self.beta),
            g: self.g.as_ref().map(read),
            gk: self.gk.as_ref().map(read),
            lens: ints(&self.lens),
            indices: ints(&self.indices),
            accepted: Some(ints(&self.accepted)),
            scale: self.scale,
            out: self.out_store,
            state_store: self.state_store,
        };
        if let Some(l) = op.lens.iter().find(|&&l| l < 0 || l > MAX_RECURRENT_TOKENS as i64) {
            return Err(format!(
                "aclnnRecurrentGatedDeltaRule: a sequence of {l} tokens (0 < L <= {MAX_RECURRENT_TOKENS})"
            ));
        }
        let mut state = read(&self.state);
        let out = op.run(&mut state).map_err(|e| format!("aclnnRecurrentGatedDeltaRule: {e}"))?;
        // SAFETY: as above; `out` and `stateRef` are this task's to write.
        unsafe {
            host::write_f32(&self.o, &out);
            host::write_f32(&self.state, &state);
        }
        Ok(())
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn aclnnRecurrentGatedDeltaRule(
    ws: *mut c_void,
    size: u64,
    ex: *mut aclOpExecutor,
    stream: aclrtStream,
) -> aclnnStatus {
    execute("aclnnRecurrentGatedDeltaRule", ws, size, ex, stream)
}
