//! CANN's own KDA operators (`docs/ascend.md`, vendor operators) over the emulated runtime:
//!
//! - the backend maps `KdaChunk` onto `aclnnChunkKdaFwd` where its contract fits, and the result
//!   equals the reference's within the vendor route's tolerance (the emulator computes the
//!   vendor op in its own code at its kernels' precision, so a swapped flag, a k-first state or
//!   a missing `A_log` changes the numbers far beyond it, or is rejected);
//! - where it does not fit (a limit, a dtype, chunk-boundary states, capture), the backend runs
//!   its own kernel and never hands the vendor op something it rejects;
//! - the emulator rejects, with the documented code, every argument the documents rule out.
#![cfg(feature = "emulated")]
#![allow(clippy::expect_used, clippy::unwrap_used, reason = "tests")]

use std::ffi::{CString, c_void};
use std::sync::Arc;

use half::bf16;
use kda_ascend::{AscendBackend, AscendOptions, sys};
use kda_core::kda::{ChunkGate, ChunkHostMeta, GateForm, KdaChunk, L2Norm};
use kda_core::{Backend, DType, Device, Op, Tensor};
use kda_reference::ReferenceBackend;
use kda_testkit::oracle_kda::{max_abs, recurrence_tolerance};
use kda_testkit::{Gen, Tolerance};

fn ascend() -> Device<AscendBackend> {
    let options = AscendOptions { checked: false, ..AscendOptions::default() };
    AscendBackend::with_options(options).expect("ascend backend over the emulated runtime")
}

/// How many times this thread's calls named `api`.
fn calls(api: &str) -> usize {
    kda_acl_emu::calls_of_this_thread().iter().filter(|c| c.api == api).count()
}

/// One varlen prefill problem, as host data.
#[derive(Clone)]
struct Problem {
    lens: Vec<usize>,
    slots: Vec<i32>,
    has_initial: Vec<i32>,
    heads: usize,
    kd: usize,
    vd: usize,
    n_slots: usize,
    /// bf16 (the vendor op's) or f32 operands and output.
    dtype: DType,
    form: Option<GateForm>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    g: Vec<f32>,
    beta: Vec<f32>,
    cache: Vec<f32>,
}

impl Problem {
    fn new(lens: &[usize], (heads, kd, vd): (usize, usize, usize), form: Option<GateForm>) -> Self {
        let requests = lens.len();
        let tokens: usize = lens.iter().sum();
        let n_slots = requests + 2;
        let mut rng = Gen::new(lens.len() as u64 * 31 + kd as u64);
        let round = |x: Vec<f32>| x.into_iter().map(|v| bf16::from_f32(v).to_f32()).collect();
        Self {
            lens: lens.to_vec(),
            // Slots in reverse order, one spare at each end.
            slots: (0..requests).map(|b| (requests - b) as i32).collect(),
            has_initial: (0..requests).map(|b| i32::from(b % 3 != 1)).collect(),
            heads,
            kd,
            vd,
            n_slots,
            dtype: DType::BF16,
            form,
            q: round(rng.uniform_f32(tokens * heads * kd, -1.0, 1.0)),
            k: round(rng.uniform_f32(tokens * heads * kd, -1.0, 1.0)),
            v: round(rng.uniform_f32(tokens * heads * vd, -1.0, 1.0)),
            g: match form {
                // Raw logits, both sides of the softplus threshold and the saturation.
                Some(_) => rng.uniform_f32(tokens * heads * kd, -6.0, 4.0),
                None => rng.uniform_f32(tokens * heads * kd, -1.0, 0.0),
            },
            beta: rng.uniform_f32(tokens * heads, 0.0, 1.0),
            cache: rng.uniform_f32(n_slots * heads * vd * kd, -1.0, 1.0),
        }
    }

    fn tokens(&self) -> usize {
        self.lens.iter().sum()
    }

    fn offsets(&self) -> Vec<i32> {
        let mut at = 0;
        std::iter::once(0)
            .chain(self.lens.iter().map(|&l| {
                at += l as i32;
                at
            }))
            .collect()
    }

    /// Outputs and the whole state cache after `KdaChunk` on `b`. `prenormalize`: the reference
    /// pipeline the vendor route is (the L2 norm into the operands' dtype, then the chunk
    /// without it); else the op as the layer issues it.
    fn run<B: Backend>(&self, b: &Device<B>, prenormalize: bool) -> (Vec<f32>, Vec<f32>) {
        let s = b.new_stream().unwrap();
        let (t, h, kd, vd) = (self.tokens(), self.heads, self.kd, self.vd);
        let float = |shape: &[usize], v: &[f32], dtype: DType| -> Tensor<B> {
            let x = b.alloc(dtype, shape).unwrap();
            match dtype {
                DType::BF16 => {
                    let data: Vec<bf16> = v.iter().map(|&x| bf16::from_f32(x)).collect();
                    b.upload(&s, &x, &data).unwrap();
                }
                _ => b.upload(&s, &x, v).unwrap(),
            }
            x
        };
        let ints = |v: &[i32]| {
            let x = b.alloc(DType::I32, &[v.len()]).unwrap();
            b.upload(&s, &x, v).unwrap();
            x
        };
        let mut q = float(&[t, h, kd], &self.q, self.dtype);
        let mut k = float(&[t, h, kd], &self.k, self.dtype);
        if prenormalize {
            for x in [&mut q, &mut k] {
                let y = b.alloc(self.dtype, &[t, h, kd]).unwrap();
                b.launch(&s, Op::L2Norm(L2Norm { x: x.clone(), y: y.clone(), scale: 1.0 }))
                    .unwrap();
                *x = y;
            }
        }
        let gate = self.form.map(|form| {
            let mut rng = Gen::new(77);
            ChunkGate {
                a_log: float(&[h], &rng.uniform_f32(h, -1.0, 1.0), DType::F32),
                dt_bias: float(&[h, kd], &rng.uniform_f32(h * kd, -0.5, 0.5), DType::F32),
                form,
            }
        });
        let state = float(&[self.n_slots, h, vd, kd], &self.cache, DType::F32);
        let o = b.alloc(self.dtype, &[t, h, vd]).unwrap();
        let op = KdaChunk {
            q,
            k,
            v: float(&[t, h, vd], &self.v, self.dtype),
            g: float(&[t, h, kd], &self.g, DType::F32),
            gate,
            beta: float(&[t, h], &self.beta, DType::F32),
            cu_seqlens: ints(&self.offsets()),
            state_slots: ints(&self.slots),
            has_initial_state: ints(&self.has_initial),
            chunk_state_slots: None,
            host_meta: Some(ChunkHostMeta {
                cu_seqlens: Arc::from(self.offsets()),
                state_slots: Arc::from(self.slots.clone()),
                has_initial_state: Arc::from(self.has_initial.clone()),
            }),
            state: state.clone(),
            o: o.clone(),
            scale: 1.0 / (kd as f32).sqrt(),
            qk_l2norm: !prenormalize,
        };
        b.launch(&s, Op::KdaChunk(op)).unwrap();
        let o = match self.dtype {
            DType::BF16 => b.download::<bf16>(&s, &o).unwrap().iter().map(|x| x.to_f32()).collect(),
            _ => b.download::<f32>(&s, &o).unwrap(),
        };
        (o, b.download::<f32>(&s, &state).unwrap())
    }
}

/// The vendor route against the reference pipeline it stands for, within the allowance of an
/// operator that keeps its intermediates in bf16 ([`Tolerance::layer_bf16_intermediates`]: the
/// reference keeps them in f32), and the route really taken (`calls`: vendor calls expected).
fn check_vendor(p: &Problem, vendor_calls: usize) {
    let before = calls("aclnnChunkKdaFwd");
    let (o, state) = p.run(&ascend(), false);
    assert_eq!(calls("aclnnChunkKdaFwd") - before, vendor_calls, "aclnnChunkKdaFwd calls");
    let (o_ref, state_ref) = p.run(&ReferenceBackend::new(), true);
    let (t, h, kd, vd) = (p.tokens(), p.heads, p.kd, p.vd);
    let wide = |x: &[f32]| x.iter().map(|&v| f64::from(v)).collect::<Vec<_>>();
    let tol = |x: &[f32]| Tolerance::layer_bf16_intermediates(max_abs(&wide(x)));
    tol(&o_ref).assert_close(&[t, h, vd], &o, &o_ref);
    tol(&state_ref).assert_close(&[p.n_slots, h, vd, kd], &state, &state_ref);
}

/// The op where the vendor route does not apply: the project's kernel, equal to the
/// reference's same op within the recurrence's bound (the kernel runs it token by token under
/// the twin, the reference in chunks; the output within one rounding to its dtype more), and no
/// call of the vendor op.
fn check_fallback(p: &Problem) {
    let before = calls("aclnnChunkKdaFwd");
    let (o, state) = p.run(&ascend(), false);
    assert_eq!(calls("aclnnChunkKdaFwd"), before, "the vendor op must not be called");
    let (o_ref, state_ref) = p.run(&ReferenceBackend::new(), false);
    let (t, h, kd, vd) = (p.tokens(), p.heads, p.kd, p.vd);
    let rec = |r: &[f32]| {
        let wide: Vec<f64> = r.iter().map(|&x| f64::from(x)).collect();
        recurrence_tolerance(p.tokens(), kd, 64, max_abs(&wide))
    };
    let out = Tolerance::for_dtype(p.dtype);
    out.with_abs(out.abs + rec(&o_ref).abs).assert_close(&[t, h, vd], &o, &o_ref);
    rec(&state_ref).assert_close(&[p.n_slots, h, vd, kd], &state, &state_ref);
}

/// `KdaChunk` on `aclnnChunkKdaFwd`: varlen (70, 5, 130, 64 tokens), slots out of order,
/// fresh and continued states, `K != V`; the raw gate in both forms (useGateInKernel with
/// A_log and dt_bias; safeGate and lowerBound for K3's) and the activated gate.
#[test]
fn chunk_on_the_vendor_op_equals_the_reference() {
    let lens = [70, 5, 130, 64];
    for form in [None, Some(GateForm::Softplus), Some(GateForm::LowerBound { lower_bound: -5.0 })] {
        check_vendor(&Problem::new(&lens, (2, 16, 32), form), 1);
    }
}

/// More than 1024 requests: two calls (1024, then 6).
#[test]
fn chunk_beyond_1024_sequences_is_split() {
    let lens = vec![1usize; 1030];
    check_vendor(&Problem::new(&lens, (1, 16, 16), Some(GateForm::Softplus)), 2);
}

/// Everything the vendor op would reject, or cannot express, runs on the project's kernel:
/// K not a multiple of 16, K above 256, a lower bound below -5, f32 operands, an empty
/// request, a padding request, H above 128.
#[test]
fn chunk_outside_the_vendor_contract_runs_the_projects_kernel() {
    let lb = |lower_bound| Some(GateForm::LowerBound { lower_bound });
    check_fallback(&Problem::new(&[70, 5], (2, 24, 32), lb(-5.0)));
    check_fallback(&Problem::new(&[9], (1, 272, 16), None));
    check_fallback(&Problem::new(&[70, 5], (2, 16, 16), lb(-6.0)));
    check_fallback(&Problem { dtype: DType::F32, ..Problem::new(&[70], (2, 16, 16), lb(-5.0)) });
    check_fallback(&Problem::new(&[3, 0, 4], (1, 16, 16), None));
    let mut padding = Problem::new(&[3, 4], (1, 16, 16), None);
    padding.slots[1] = -1;
    check_fallback(&padding);
    check_fallback(&Problem::new(&[2], (129, 16, 16), None));
}

// ---------------------------------------------------------------------------------------------
// The emulator's rejections, with the documents' codes.

/// A contiguous `aclTensor` of `shape` over the device memory at `ptr`.
fn contiguous_tensor(
    dtype: sys::aclDataType,
    shape: &[usize],
    ptr: *mut c_void,
) -> *mut sys::aclTensor {
    let dims: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
    let mut strides = vec![1i64; dims.len()];
    for i in (0..dims.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * dims[i + 1];
    }
    let storage = [shape.iter().product::<usize>() as i64];
    // SAFETY: arrays of the stated lengths, live for the call; `ptr` holds the storage.
    unsafe {
        sys::aclCreateTensor(
            dims.as_ptr(),
            dims.len() as u64,
            dtype,
            strides.as_ptr(),
            0,
            sys::ACL_FORMAT_ND,
            storage.as_ptr(),
            1,
            ptr,
        )
    }
}

/// A contiguous `aclTensor` over fresh device memory (zeros), leaked with the test.
fn desc(dtype: sys::aclDataType, shape: &[usize]) -> *mut sys::aclTensor {
    let size = match dtype {
        sys::ACL_FLOAT | sys::ACL_INT32 => 4,
        _ => 2,
    };
    let n: usize = shape.iter().product();
    let mut ptr = std::ptr::null_mut();
    // SAFETY: a valid out-parameter.
    let rc = unsafe { sys::aclrtMalloc(&mut ptr, (n * size).max(size), 0) };
    assert_eq!(rc, 0, "aclrtMalloc");
    let t = contiguous_tensor(dtype, shape, ptr);
    assert!(!t.is_null(), "aclCreateTensor");
    t
}

/// The arguments of one `aclnnChunkKdaFwdGetWorkspaceSize` call (TND), valid by default.
#[derive(Clone)]
struct ChunkCall {
    t: usize,
    h: usize,
    hv: usize,
    kd: usize,
    vd: usize,
    qkv_dtype: sys::aclDataType,
    out_dtype: sys::aclDataType,
    cu: Option<Vec<i64>>,
    layout: &'static str,
    chunk: i64,
    safe_gate: bool,
    lower_bound: f64,
    use_gate: bool,
    a_log: bool,
    state_v_first: bool,
    /// The initial state's last two sizes (`[V, K]` for v-first).
    state_tail: Option<[usize; 2]>,
    null_q: bool,
}

impl Default for ChunkCall {
    fn default() -> Self {
        Self {
            t: 80,
            h: 2,
            hv: 2,
            kd: 16,
            vd: 32,
            qkv_dtype: sys::ACL_BF16,
            out_dtype: sys::ACL_BF16,
            cu: Some(vec![0, 50, 80]),
            layout: "TND",
            chunk: 64,
            safe_gate: true,
            lower_bound: -5.0,
            use_gate: true,
            a_log: true,
            state_v_first: true,
            state_tail: Some([32, 16]),
            null_q: false,
        }
    }
}

impl ChunkCall {
    /// The phase-one status.
    fn status(&self) -> sys::aclnnStatus {
        let _backend = ascend();
        let Self { t, h, hv, kd, vd, .. } = *self;
        let n = self.cu.as_ref().map_or(1, |c| c.len() - 1);
        let q = if self.null_q { std::ptr::null_mut() } else { desc(self.qkv_dtype, &[t, h, kd]) };
        let k = desc(self.qkv_dtype, &[t, h, kd]);
        let v = desc(self.qkv_dtype, &[t, hv, vd]);
        let g = desc(sys::ACL_FLOAT, &[t, hv, kd]);
        let beta = desc(sys::ACL_FLOAT, &[t, hv]);
        let a_log = if self.a_log { desc(sys::ACL_FLOAT, &[hv]) } else { std::ptr::null_mut() };
        let dt_bias = desc(sys::ACL_FLOAT, &[hv * kd]);
        let state = self.state_tail.map(|[a, b]| desc(sys::ACL_FLOAT, &[n, hv, a, b]));
        let attn = desc(self.out_dtype, &[t, hv, vd]);
        let fin = self.state_tail.map(|[a, b]| desc(sys::ACL_FLOAT, &[n, hv, a, b]));
        let c = self.chunk.max(1) as usize;
        let aqk = desc(self.out_dtype, &[hv, t, c]);
        let akk = desc(self.out_dtype, &[hv, t, c]);
        let cu = self.cu.as_ref().map(|c| {
            // SAFETY: `c` is live for the call, which copies it.
            unsafe { sys::aclCreateIntArray(c.as_ptr(), c.len() as u64) }
        });
        let layout = CString::new(self.layout).unwrap();
        let none: *const sys::aclTensor = std::ptr::null();
        let (mut ws, mut ex) = (0u64, std::ptr::null_mut());
        // SAFETY: descriptors and arrays created above, a C string, valid out-parameters.
        unsafe {
            sys::aclnnChunkKdaFwdGetWorkspaceSize(
                q,
                k,
                v,
                g,
                beta,
                a_log,
                dt_bias,
                state.unwrap_or(std::ptr::null_mut()),
                cu.unwrap_or(std::ptr::null_mut()),
                std::ptr::null(),
                layout.as_ptr(),
                0.25,
                self.chunk,
                self.safe_gate,
                self.lower_bound,
                self.use_gate,
                self.state_v_first,
                attn,
                fin.unwrap_or(std::ptr::null_mut()),
                none,
                aqk,
                akk,
                none,
                none,
                none,
                none,
                none,
                none,
                &mut ws,
                &mut ex,
            )
        }
    }
}

const NULLPTR: sys::aclnnStatus = sys::ACLNN_ERR_PARAM_NULLPTR;
const INVALID: sys::aclnnStatus = sys::ACLNN_ERR_PARAM_INVALID;

#[test]
fn the_emulated_chunk_op_accepts_the_backends_arguments() {
    assert_eq!(ChunkCall::default().status(), 0);
    let gva = ChunkCall { hv: 4, ..ChunkCall::default() };
    assert_eq!(gva.status(), 0, "HV a multiple of H (GVA)");
}

#[test]
fn the_emulated_chunk_op_rejects_a_null_required_tensor() {
    assert_eq!(ChunkCall { null_q: true, ..ChunkCall::default() }.status(), NULLPTR);
}

#[test]
fn the_emulated_chunk_op_rejects_the_in_kernel_gate_without_a_log() {
    assert_eq!(ChunkCall { a_log: false, ..ChunkCall::default() }.status(), NULLPTR);
}

#[test]
fn the_emulated_chunk_op_rejects_heads_beyond_its_limits() {
    let c = ChunkCall::default();
    assert_eq!(ChunkCall { h: 129, hv: 129, ..c.clone() }.status(), INVALID, "H > 128");
    assert_eq!(ChunkCall { h: 2, hv: 3, ..c.clone() }.status(), INVALID, "HV % H != 0");
    assert_eq!(ChunkCall { h: 4, hv: 2, ..c }.status(), INVALID, "HV < H");
}

#[test]
fn the_emulated_chunk_op_rejects_head_dims_off_its_grid() {
    let c = ChunkCall::default();
    let k24 = ChunkCall { kd: 24, state_tail: Some([32, 24]), ..c.clone() };
    assert_eq!(k24.status(), INVALID, "K = 24");
    let k272 = ChunkCall { kd: 272, state_tail: Some([32, 272]), ..c.clone() };
    assert_eq!(k272.status(), INVALID, "K = 272");
    let v8 = ChunkCall { vd: 8, state_tail: Some([8, 16]), ..c };
    assert_eq!(v8.status(), INVALID, "V = 8");
}

#[test]
fn the_emulated_chunk_op_rejects_more_than_1024_sequences() {
    let cu: Vec<i64> = (0..=1025).collect();
    let c = ChunkCall { t: 1025, cu: Some(cu), ..ChunkCall::default() };
    assert_eq!(c.status(), INVALID);
    let cu: Vec<i64> = (0..=1024).collect();
    assert_eq!(ChunkCall { t: 1024, cu: Some(cu), ..ChunkCall::default() }.status(), 0);
}

#[test]
fn the_emulated_chunk_op_rejects_a_lower_bound_outside_minus_5_to_0() {
    let c = ChunkCall::default();
    assert_eq!(ChunkCall { lower_bound: -5.5, ..c.clone() }.status(), INVALID);
    assert_eq!(ChunkCall { lower_bound: 0.0, ..c.clone() }.status(), INVALID);
    // Without safeGate the bound is not used.
    assert_eq!(ChunkCall { lower_bound: 0.0, safe_gate: false, ..c }.status(), 0);
}

#[test]
fn the_emulated_chunk_op_rejects_a_chunk_size_other_than_64_or_128() {
    let c = ChunkCall::default();
    assert_eq!(ChunkCall { chunk: 32, ..c.clone() }.status(), INVALID);
    assert_eq!(ChunkCall { chunk: 128, ..c }.status(), 0);
}

#[test]
fn the_emulated_chunk_op_rejects_an_unknown_layout() {
    assert_eq!(ChunkCall { layout: "TNd", ..ChunkCall::default() }.status(), INVALID);
}

#[test]
fn the_emulated_chunk_op_rejects_f32_operands_and_a_mismatched_output() {
    let c = ChunkCall::default();
    let f32s = ChunkCall { qkv_dtype: sys::ACL_FLOAT, out_dtype: sys::ACL_FLOAT, ..c.clone() };
    assert_eq!(f32s.status(), INVALID, "f32 q, k, v");
    assert_eq!(ChunkCall { out_dtype: sys::ACL_FLOAT16, ..c }.status(), INVALID, "attnOut f16");
}

#[test]
fn the_emulated_chunk_op_rejects_a_state_in_the_other_order() {
    // A v-first cache `[N, H, V, K]` passed with stateVFirst = false (the k-first mistake).
    let c = ChunkCall { state_v_first: false, ..ChunkCall::default() };
    assert_eq!(c.status(), INVALID);
}

#[test]
fn the_emulated_chunk_op_rejects_offsets_that_do_not_end_at_t() {
    let c = ChunkCall::default();
    assert_eq!(ChunkCall { cu: Some(vec![0, 50, 79]), ..c.clone() }.status(), INVALID);
    assert_eq!(ChunkCall { cu: Some(vec![0, 50, 40, 80]), ..c }.status(), INVALID);
}

/// The arguments of one `aclnnRecurrentGatedDeltaRuleGetWorkspaceSize` call, valid by
/// default: B = 2 requests of 2 tokens, f32 state of 6 blocks.
#[derive(Clone)]
struct RecurrentCall {
    t: usize,
    nk: usize,
    nv: usize,
    dk: usize,
    dv: usize,
    blocks: usize,
    qkv_dtype: sys::aclDataType,
    accepted: bool,
}

impl Default for RecurrentCall {
    fn default() -> Self {
        Self {
            t: 4,
            nk: 2,
            nv: 2,
            dk: 16,
            dv: 16,
            blocks: 6,
            qkv_dtype: sys::ACL_BF16,
            accepted: true,
        }
    }
}

impl RecurrentCall {
    fn status(&self) -> sys::aclnnStatus {
        let _backend = ascend();
        let Self { t, nk, nv, dk, dv, blocks, .. } = *self;
        let accepted =
            if self.accepted { desc(sys::ACL_INT32, &[2]) } else { std::ptr::null_mut() };
        let (mut ws, mut ex) = (0u64, std::ptr::null_mut());
        // SAFETY: descriptors created above, valid out-parameters.
        unsafe {
            sys::aclnnRecurrentGatedDeltaRuleGetWorkspaceSize(
                desc(self.qkv_dtype, &[t, nk, dk]),
                desc(self.qkv_dtype, &[t, nk, dk]),
                desc(self.qkv_dtype, &[t, nv, dv]),
                desc(sys::ACL_BF16, &[t, nv]),
                desc(sys::ACL_FLOAT, &[blocks, nv, dv, dk]),
                desc(sys::ACL_INT32, &[2]),
                desc(sys::ACL_INT32, &[t]),
                std::ptr::null(),
                desc(sys::ACL_FLOAT, &[t, nv, dk]),
                accepted,
                0.25,
                desc(sys::ACL_BF16, &[t, nv, dv]),
                &mut ws,
                &mut ex,
            )
        }
    }
}

#[test]
fn the_emulated_recurrent_op_checks_its_documented_limits() {
    let c = RecurrentCall::default();
    assert_eq!(c.status(), 0);
    assert_eq!(RecurrentCall { accepted: false, ..c.clone() }.status(), NULLPTR);
    assert_eq!(RecurrentCall { qkv_dtype: sys::ACL_FLOAT, ..c.clone() }.status(), INVALID);
    assert_eq!(RecurrentCall { nk: 2, nv: 3, ..c.clone() }.status(), INVALID, "Nv % Nk");
    assert_eq!(RecurrentCall { dk: 513, ..c.clone() }.status(), INVALID, "Dk > 512");
    assert_eq!(RecurrentCall { blocks: 3, ..c }.status(), INVALID, "T > BlockNum");
}

/// Device memory holding `bytes`, and its `aclTensor` (contiguous `shape`, `dtype`).
fn device_tensor(
    stream: sys::aclrtStream,
    dtype: sys::aclDataType,
    shape: &[usize],
    bytes: &[u8],
) -> (*mut c_void, *mut sys::aclTensor) {
    let mut ptr = std::ptr::null_mut();
    // SAFETY: a valid out-parameter.
    assert_eq!(unsafe { sys::aclrtMalloc(&mut ptr, bytes.len().max(4), 0) }, 0);
    // SAFETY: `ptr` holds `bytes.len()` bytes; `bytes` is live until the stream is synchronized
    // below.
    let rc = unsafe {
        sys::aclrtMemcpyAsync(
            ptr,
            bytes.len(),
            bytes.as_ptr().cast(),
            bytes.len(),
            sys::ACL_MEMCPY_HOST_TO_DEVICE,
            stream,
        )
    };
    assert_eq!(rc, 0);
    // SAFETY: a live stream.
    assert_eq!(unsafe { sys::aclrtSynchronizeStream(stream) }, 0);
    let t = contiguous_tensor(dtype, shape, ptr);
    assert!(!t.is_null());
    (ptr, t)
}

fn bytes_of<T: bytemuck::Pod>(v: &[T]) -> Vec<u8> {
    bytemuck::cast_slice(v).to_vec()
}

/// `aclnnRecurrentGatedDeltaRule` as the emulator computes it from its document: two requests of
/// three speculative tokens, per-channel decay `gk`, per-token `ssmStateIndices` with the second
/// request resuming from its second slot (`numAcceptedTokens` 2), against the reference's
/// `KdaRecurrent` on the same values (both f32 recurrences, so within twice the recurrence's
/// rounding bound; a slot, decay or acceptance read wrongly is far outside it).
#[test]
fn the_emulated_recurrent_op_computes_its_document() {
    let _backend = ascend();
    let (b, n, h, d, blocks) = (2usize, 3usize, 2usize, 16usize, 8usize);
    let t = b * n;
    let mut rng = Gen::new(9);
    let bf = |v: Vec<f32>| v.into_iter().map(bf16::from_f32).collect::<Vec<bf16>>();
    let q = bf(rng.uniform_f32(t * h * d, -0.3, 0.3));
    let k = bf(rng.uniform_f32(t * h * d, -0.3, 0.3));
    let v = bf(rng.uniform_f32(t * h * d, -1.0, 1.0));
    let beta = bf(rng.uniform_f32(t * h, 0.1, 0.9));
    let gk = rng.uniform_f32(t * h * d, -1.0, -0.01);
    let state = rng.uniform_f32(blocks * h * d * d, -1.0, 1.0);
    let indices = [0i32, 1, 2, 3, 4, 5];
    let accepted = [1i32, 2];
    let lens = [3i32, 3];
    let mut stream = std::ptr::null_mut();
    // SAFETY: a valid out-parameter.
    assert_eq!(unsafe { sys::aclrtCreateStream(&mut stream) }, 0);
    let td = |dtype, shape: &[usize], bytes: Vec<u8>| device_tensor(stream, dtype, shape, &bytes);
    let (_, qt) = td(sys::ACL_BF16, &[t, h, d], bytes_of(&q));
    let (_, kt) = td(sys::ACL_BF16, &[t, h, d], bytes_of(&k));
    let (_, vt) = td(sys::ACL_BF16, &[t, h, d], bytes_of(&v));
    let (_, bt) = td(sys::ACL_BF16, &[t, h], bytes_of(&beta));
    let (state_ptr, st) = td(sys::ACL_FLOAT, &[blocks, h, d, d], bytes_of(&state));
    let (_, lt) = td(sys::ACL_INT32, &[b], bytes_of(&lens));
    let (_, it) = td(sys::ACL_INT32, &[t], bytes_of(&indices));
    let (_, gkt) = td(sys::ACL_FLOAT, &[t, h, d], bytes_of(&gk));
    let (_, at) = td(sys::ACL_INT32, &[b], bytes_of(&accepted));
    let (out_ptr, ot) = td(sys::ACL_BF16, &[t, h, d], vec![0; t * h * d * 2]);
    let (mut ws, mut ex) = (0u64, std::ptr::null_mut());
    // SAFETY: descriptors created above, valid out-parameters, a live stream.
    unsafe {
        let rc = sys::aclnnRecurrentGatedDeltaRuleGetWorkspaceSize(
            qt,
            kt,
            vt,
            bt,
            st,
            lt,
            it,
            std::ptr::null(),
            gkt,
            at,
            0.25,
            ot,
            &mut ws,
            &mut ex,
        );
        assert_eq!(rc, 0, "phase one");
        assert_eq!(sys::aclnnRecurrentGatedDeltaRule(std::ptr::null_mut(), 0, ex, stream), 0);
        assert_eq!(sys::aclrtSynchronizeStream(stream), 0);
    }
    let read = |ptr: *mut c_void, len: usize| {
        let mut host = vec![0u8; len];
        // SAFETY: `ptr` holds `len` bytes; `host` is live until the synchronize.
        unsafe {
            let kind = sys::ACL_MEMCPY_DEVICE_TO_HOST;
            let rc = sys::aclrtMemcpyAsync(host.as_mut_ptr().cast(), len, ptr, len, kind, stream);
            assert_eq!(rc, 0);
            assert_eq!(sys::aclrtSynchronizeStream(stream), 0);
        }
        host
    };
    let out: Vec<f32> = read(out_ptr, t * h * d * 2)
        .chunks(2)
        .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
        .collect();
    let st_out: Vec<f32> = read(state_ptr, blocks * h * d * d * 4)
        .chunks(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();

    // The reference: KdaRecurrent, the document's variables in the HAL's names.
    let r = ReferenceBackend::new();
    let s = r.new_stream().unwrap();
    let up_bf = |shape: &[usize], v: &[bf16]| {
        let x = r.alloc(DType::BF16, shape).unwrap();
        r.upload(&s, &x, v).unwrap();
        x
    };
    let up_f = |shape: &[usize], v: &[f32]| {
        let x = r.alloc(DType::F32, shape).unwrap();
        r.upload(&s, &x, v).unwrap();
        x
    };
    let up_i = |shape: &[usize], v: &[i32]| {
        let x = r.alloc(DType::I32, shape).unwrap();
        r.upload(&s, &x, v).unwrap();
        x
    };
    let o = r.alloc(DType::BF16, &[b, n, h, d]).unwrap();
    let ref_state = up_f(&[blocks, h, d, d], &state);
    let op = kda_core::kda::KdaRecurrent {
        q: up_bf(&[b, n, h, d], &q),
        k: up_bf(&[b, n, h, d], &k),
        v: up_bf(&[b, n, h, d], &v),
        g: up_f(&[b, n, h, d], &gk),
        beta: up_bf(&[b, n, h], &beta),
        state_slots: up_i(&[b, n], &indices),
        num_accepted_tokens: Some(up_i(&[b], &accepted)),
        state: ref_state.clone(),
        o: o.clone(),
        scale: 0.25,
        qk_l2norm: false,
    };
    r.launch(&s, Op::KdaRecurrent(op)).unwrap();
    let o_ref: Vec<f32> = r.download::<bf16>(&s, &o).unwrap().iter().map(|x| x.to_f32()).collect();
    let st_ref = r.download::<f32>(&s, &ref_state).unwrap();
    // Both compute the recurrence in f32 (the vendor kernel scales q first and sums in its own
    // order), so each is within the recurrence's bound of the f64 result: twice that apart.
    let wide = |x: &[f32]| x.iter().map(|&v| f64::from(v)).collect::<Vec<_>>();
    let rec = |x: &[f32]| {
        let one = recurrence_tolerance(n, d, 0, max_abs(&wide(x)));
        one.with_abs(2.0 * one.abs).with_rel(2.0 * one.rel)
    };
    let out_tol = Tolerance::for_dtype(DType::BF16);
    out_tol.with_abs(out_tol.abs + rec(&o_ref).abs).assert_close(&[t, h, d], &out, &o_ref);
    rec(&st_ref).assert_close(&[blocks, h, d, d], &st_out, &st_ref);
}
