//! The KDA core ops (`docs/design/kda.md#inside-kda`) against the f64 oracles of
//! [`crate::oracle_kda`]: the short conv with its state protocol, the q/k norm, both gate forms,
//! the recurrence token by token and chunked, the gated RMSNorm and the padding mask; plus the
//! identities the layer relies on (split prefills, prefill then decode, speculative updates), bad
//! input, and NaN.
//!
//! Every body works on one stream, so checked mode has nothing to object to.

use half::bf16;
use kda_core::kda::{
    CHUNK_SIZE, CausalConv, CausalConvUpdate, ChunkGate, GateForm, GatedRmsNorm, KdaChunk, KdaGate,
    KdaRecurrent, L2Norm, ZeroPadding,
};
use kda_core::{Backend, DType, Device, Error, Layout, Op, Tensor};

use super::Factory;
use super::gemm::download_f64;
use crate::oracle_kda::{
    KdaSequence, causal_conv, gate_lower_bound, gate_softplus, gated_rms_norm, kda_recurrence,
    l2norm, max_abs, recurrence_tolerance,
};
use crate::{Gen, Tolerance};

/// `[0, l0, l0 + l1, …]`: request offsets from lengths.
pub(super) fn offsets(lens: &[usize]) -> Vec<i32> {
    let mut at = 0;
    std::iter::once(0)
        .chain(lens.iter().map(|&l| {
            at += l as i32;
            at
        }))
        .collect()
}

pub(super) fn f64s(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| f64::from(v)).collect()
}

/// A new f32 tensor holding `data`.
pub(super) fn f32_tensor<B: Backend>(
    b: &Device<B>,
    s: &B::Stream,
    shape: &[usize],
    data: &[f32],
) -> Tensor<B> {
    let t = b.alloc(DType::F32, shape).unwrap();
    b.upload(s, &t, data).unwrap();
    t
}

/// A new i32 tensor holding `data`.
pub(super) fn i32_tensor<B: Backend>(
    b: &Device<B>,
    s: &B::Stream,
    shape: &[usize],
    data: &[i32],
) -> Tensor<B> {
    let t = b.alloc(DType::I32, shape).unwrap();
    b.upload(s, &t, data).unwrap();
    t
}

/// A new tensor of `dtype` (f32 or bf16) holding `data` rounded to it; returns the tensor and
/// the values it really holds.
pub(super) fn float_tensor<B: Backend>(
    b: &Device<B>,
    s: &B::Stream,
    dtype: DType,
    shape: &[usize],
    data: &[f32],
) -> (Tensor<B>, Vec<f32>) {
    match dtype {
        DType::BF16 => {
            let v: Vec<bf16> = data.iter().map(|&x| bf16::from_f32(x)).collect();
            let t = b.alloc(DType::BF16, shape).unwrap();
            b.upload(s, &t, &v).unwrap();
            (t, v.iter().map(|x| x.to_f32()).collect())
        }
        _ => (f32_tensor(b, s, shape, data), data.to_vec()),
    }
}

// ---------------------------------------------------------------------------------------------
// Short conv

const CONV_C: usize = 24;
const CONV_W: usize = 4;

/// A varlen prefill batch (lengths 5, 1, 0, 70, 2, 3; one padding request; fresh and continued
/// histories; a shared state buffer with spare rows) against the oracle, for f32 and bf16 inputs:
/// outputs, the `W - 1` history rows written, and every other state row untouched.
pub fn conv_prefill_matches_f64<B: Backend>(make: &impl Factory<B>) {
    let b = make();
    let s = b.new_stream().unwrap();
    let (c, w) = (CONV_C, CONV_W);
    let lens = [5usize, 1, 0, 70, 2, 3];
    let slots = [3i32, 0, 5, 1, -1, 2];
    let has_initial = [1i32, 0, 1, 1, 0, 1];
    let (n_slots, len) = (6, w - 1 + 2);
    for (seed, dtype) in [(1u64, DType::F32), (2, DType::BF16)] {
        let mut rng = Gen::new(seed);
        let tokens: usize = lens.iter().sum();
        let starts = offsets(&lens);
        let (x, xv) =
            float_tensor(&b, &s, dtype, &[tokens, c], &rng.uniform_f32(tokens * c, -2.0, 2.0));
        let wv = rng.uniform_f32(c * w, -0.7, 0.7);
        let state0 = rng.uniform_f32(n_slots * len * c, -1.0, 1.0);
        let state = f32_tensor(&b, &s, &[n_slots, len, c], &state0);
        let y = b.alloc(DType::F32, &[tokens, c]).unwrap();
        b.launch(&s, Op::Fill { dst: y.clone(), value: 9.0 }).unwrap();
        let op = CausalConv {
            x,
            weight: f32_tensor(&b, &s, &[c, w], &wv),
            query_start_loc: i32_tensor(&b, &s, &[lens.len() + 1], &starts),
            state_slots: i32_tensor(&b, &s, &[lens.len()], &slots),
            has_initial_state: i32_tensor(&b, &s, &[lens.len()], &has_initial),
            state: state.clone(),
            y: y.clone(),
        };
        b.launch(&s, Op::CausalConv(op)).unwrap();
        let (got_y, got_state) = (download_f64(&b, &s, &y), download_f64(&b, &s, &state));

        let (mut want_y, mut want_state) = (vec![0.0; tokens * c], f64s(&state0));
        let hist = (w - 1) * c;
        for (r, &l) in lens.iter().enumerate() {
            let (at, slot) = (starts[r] as usize, slots[r]);
            if slot < 0 {
                continue;
            }
            let base = slot as usize * len * c;
            let history = if has_initial[r] != 0 {
                f64s(&state0[base..base + hist])
            } else {
                vec![0.0; hist]
            };
            let xr = f64s(&xv[at * c..(at + l) * c]);
            let yr = causal_conv(&history, &xr, &f64s(&wv), c, w);
            want_y[at * c..(at + l) * c].copy_from_slice(&yr);
            let all: Vec<f64> = history.iter().chain(&xr).copied().collect();
            want_state[base..base + hist].copy_from_slice(&all[all.len() - hist..]);
        }
        let tol = Tolerance::for_dtype(DType::F32);
        tol.assert_close(&[tokens, c], &got_y, &want_y);
        Tolerance::exact().assert_close(&[n_slots, len, c], &got_state, &want_state);
    }
}

/// Launch a decode/speculative conv update; returns the outputs `[B, n, C]`.
#[allow(clippy::too_many_arguments)]
fn conv_update<B: Backend>(
    b: &Device<B>,
    s: &B::Stream,
    weight: &Tensor<B>,
    state: &Tensor<B>,
    x: &[f32],
    (batch, n): (usize, usize),
    slots: &[i32],
    accepted: Option<&[i32]>,
) -> Vec<f64> {
    let c = CONV_C;
    let y = b.alloc(DType::F32, &[batch, n, c]).unwrap();
    let op = CausalConvUpdate {
        x: f32_tensor(b, s, &[batch, n, c], x),
        weight: weight.clone(),
        state_slots: i32_tensor(b, s, &[batch], slots),
        num_accepted_tokens: accepted.map(|a| i32_tensor(b, s, &[batch], a)),
        state: state.clone(),
        y: y.clone(),
    };
    b.launch(s, Op::CausalConvUpdate(op)).unwrap();
    download_f64(b, s, &y)
}

/// A prefill of one request into `slot` (fresh or continued); returns its outputs.
fn conv_prefill<B: Backend>(
    b: &Device<B>,
    s: &B::Stream,
    weight: &Tensor<B>,
    state: &Tensor<B>,
    x: &[f32],
    slot: i32,
    fresh: bool,
) -> Vec<f64> {
    let c = CONV_C;
    let tokens = x.len() / c;
    let y = b.alloc(DType::F32, &[tokens, c]).unwrap();
    let op = CausalConv {
        x: f32_tensor(b, s, &[tokens, c], x),
        weight: weight.clone(),
        query_start_loc: i32_tensor(b, s, &[2], &[0, tokens as i32]),
        state_slots: i32_tensor(b, s, &[1], &[slot]),
        has_initial_state: i32_tensor(b, s, &[1], &[i32::from(!fresh)]),
        state: state.clone(),
        y: y.clone(),
    };
    b.launch(s, Op::CausalConv(op)).unwrap();
    download_f64(b, s, &y)
}

/// A prefill of the first tokens, then decode updates one token at a time, equals one prefill
/// over the whole sequence: outputs and the final history.
pub fn conv_prefill_then_decode_equals_one_prefill<B: Backend>(make: &impl Factory<B>) {
    let b = make();
    let s = b.new_stream().unwrap();
    let (c, w) = (CONV_C, CONV_W);
    let mut rng = Gen::new(5);
    let weight = f32_tensor(&b, &s, &[c, w], &rng.uniform_f32(c * w, -0.7, 0.7));
    let x = rng.uniform_f32(12 * c, -2.0, 2.0);
    for prefix in [1usize, 2, 7] {
        let state =
            f32_tensor(&b, &s, &[2, w - 1, c], &rng.uniform_f32(2 * (w - 1) * c, -1.0, 1.0));
        let whole = conv_prefill(&b, &s, &weight, &state, &x, 0, true);
        let mut pieces = conv_prefill(&b, &s, &weight, &state, &x[..prefix * c], 1, true);
        for t in prefix..12 {
            pieces.extend(conv_update(
                &b,
                &s,
                &weight,
                &state,
                &x[t * c..(t + 1) * c],
                (1, 1),
                &[1],
                None,
            ));
        }
        let tol = Tolerance::for_dtype(DType::F32);
        tol.assert_close(&[12, c], &pieces, &whole);
        let states = download_f64(&b, &s, &state);
        let per_slot = (w - 1) * c;
        tol.assert_close(&[w - 1, c], &states[per_slot..], &states[..per_slot]);
    }
}

/// A speculative update of `n = 4` tokens followed by a step that accepted `k` of them gives the
/// outputs of `k` plain decode updates and then of decoding the next tokens: rejected tokens leave
/// no trace. Four requests in one launch accept 1, 2, 3 and 4 tokens.
pub fn conv_speculative_update_equals_accepted_decodes<B: Backend>(make: &impl Factory<B>) {
    let b = make();
    let s = b.new_stream().unwrap();
    let (c, w, n) = (CONV_C, CONV_W, 4usize);
    let len = w - 1 + (n - 1);
    let mut rng = Gen::new(6);
    let weight = f32_tensor(&b, &s, &[c, w], &rng.uniform_f32(c * w, -0.7, 0.7));
    let batch = 4;
    // Slots 0..4: speculative path; slots 4..8: decode path.
    let state = f32_tensor(&b, &s, &[2 * batch, len, c], &vec![0.0; 2 * batch * len * c]);
    let prompts: Vec<Vec<f32>> = (0..batch).map(|_| rng.uniform_f32(6 * c, -2.0, 2.0)).collect();
    for (r, prompt) in prompts.iter().enumerate() {
        conv_prefill(&b, &s, &weight, &state, prompt, r as i32, true);
        conv_prefill(&b, &s, &weight, &state, prompt, (batch + r) as i32, true);
    }
    let draft = rng.uniform_f32(batch * n * c, -2.0, 2.0);
    let next = rng.uniform_f32(batch * n * c, -2.0, 2.0);
    let spec_slots: Vec<i32> = (0..batch as i32).collect();
    let first = conv_update(&b, &s, &weight, &state, &draft, (batch, n), &spec_slots, None);
    let accepted: Vec<i32> = (1..=batch as i32).collect();
    let second =
        conv_update(&b, &s, &weight, &state, &next, (batch, n), &spec_slots, Some(&accepted));

    let tol = Tolerance::for_dtype(DType::F32);
    for r in 0..batch {
        let slot = [(batch + r) as i32];
        let k = accepted[r] as usize;
        let mut decoded = Vec::new();
        for t in 0..k {
            let at = (r * n + t) * c;
            decoded.extend(conv_update(
                &b,
                &s,
                &weight,
                &state,
                &draft[at..at + c],
                (1, 1),
                &slot,
                None,
            ));
        }
        tol.assert_close(&[k, c], &first[r * n * c..(r * n + k) * c], &decoded);
        let mut decoded = Vec::new();
        for t in 0..n {
            let at = (r * n + t) * c;
            decoded.extend(conv_update(
                &b,
                &s,
                &weight,
                &state,
                &next[at..at + c],
                (1, 1),
                &slot,
                None,
            ));
        }
        tol.assert_close(&[n, c], &second[r * n * c..(r + 1) * n * c], &decoded);
    }
}

// ---------------------------------------------------------------------------------------------
// Norms, gate, mask

/// The L2 norm with a scale, a zero row included (the epsilon keeps it zero, not NaN), into f32
/// and bf16 outputs.
pub fn l2norm_matches_f64<B: Backend>(make: &impl Factory<B>) {
    let b = make();
    let s = b.new_stream().unwrap();
    let (rows, d) = (7 * 3, 20);
    let mut values = Gen::new(8).uniform_f32(rows * d, -3.0, 3.0);
    values[2 * d..3 * d].fill(0.0);
    let x = f32_tensor(&b, &s, &[7, 3, d], &values);
    let want = l2norm(&f64s(&values), d, 0.3);
    for dtype in [DType::F32, DType::BF16] {
        let y = b.alloc(dtype, &[7, 3, d]).unwrap();
        b.launch(&s, Op::L2Norm(L2Norm { x: x.clone(), y: y.clone(), scale: 0.3 })).unwrap();
        let got = download_f64(&b, &s, &y);
        Tolerance::for_dtype(dtype).assert_close(&[rows, d], &got, &want);
        assert!(got[2 * d..3 * d].iter().all(|&v| v == 0.0), "a zero row stays zero");
    }
}

/// Both gate forms at extreme logits (±30, around the softplus threshold 20, 0) for three
/// `A_log`, against the formulas; the outputs are never positive, and the lower-bound form stays
/// strictly above its bound even where the sigmoid rounds to 1.
pub fn gate_forms_match_f64_at_extremes<B: Backend>(make: &impl Factory<B>) {
    let b = make();
    let s = b.new_stream().unwrap();
    let logits = [-30.0f32, -20.5, -1.0, -1e-3, 0.0, 1e-3, 1.0, 19.9, 20.0, 20.1, 30.0];
    let a_log = [-1.0f32, 0.0, 1.5];
    let (t, h, d) = (2, a_log.len(), logits.len());
    // Token 0: the logits as they are (dt_bias 0); token 1: shifted by a dt_bias of 0.25.
    let mut g1 = Vec::new();
    for tok in 0..t {
        for _ in 0..h {
            g1.extend(logits.iter().map(|&a| if tok == 0 { a } else { a - 0.25 }));
        }
    }
    let dt_bias: Vec<f32> = vec![0.0; h * d];
    let bias1: Vec<f32> = vec![0.25; h * d];
    for (form, lb) in
        [(GateForm::Softplus, 0.0f64), (GateForm::LowerBound { lower_bound: -5.0 }, -5.0)]
    {
        for bias in [&dt_bias, &bias1] {
            let g = b.alloc(DType::F32, &[t, h, d]).unwrap();
            let op = KdaGate {
                g1: f32_tensor(&b, &s, &[t, h, d], &g1),
                a_log: f32_tensor(&b, &s, &[h], &a_log),
                dt_bias: f32_tensor(&b, &s, &[h, d], bias),
                form,
                g: g.clone(),
            };
            b.launch(&s, Op::KdaGate(op)).unwrap();
            let got = download_f64(&b, &s, &g);
            let mut want = Vec::new();
            for (i, &x) in g1.iter().enumerate() {
                let (head, a) = ((i / d) % h, f64::from(x) + f64::from(bias[i % (h * d)]));
                let al = f64::from(a_log[head]);
                want.push(match form {
                    GateForm::Softplus => gate_softplus(al, a),
                    GateForm::LowerBound { .. } => gate_lower_bound(lb, al, a),
                });
            }
            Tolerance::for_dtype(DType::F32).assert_close(&[t, h, d], &got, &want);
            assert!(got.iter().all(|&v| v <= 0.0), "{form}: a positive log decay in {got:?}");
            if let GateForm::LowerBound { lower_bound } = form {
                let lb = f64::from(lower_bound);
                assert!(got.iter().all(|&v| v > lb), "{form}: a value at the bound in {got:?}");
            }
        }
    }
}

/// Gated RMSNorm over heads, f32 and bf16 inputs, a gate from -40 to 40.
pub fn gated_rms_norm_matches_f64<B: Backend>(make: &impl Factory<B>) {
    let b = make();
    let s = b.new_stream().unwrap();
    let (t, h, d) = (5, 3, 32);
    let mut rng = Gen::new(9);
    let xv = rng.uniform_f32(t * h * d, -2.0, 2.0);
    let gv = rng.uniform_f32(t * h * d, -40.0, 40.0);
    let wv = rng.uniform_f32(d, 0.5, 1.5);
    for dtype in [DType::F32, DType::BF16] {
        let (x, xr) = float_tensor(&b, &s, dtype, &[t, h, d], &xv);
        let (gate, gr) = float_tensor(&b, &s, dtype, &[t, h, d], &gv);
        let y = b.alloc(dtype, &[t, h, d]).unwrap();
        let op = GatedRmsNorm {
            x,
            gate,
            weight: f32_tensor(&b, &s, &[d], &wv),
            y: y.clone(),
            eps: 1e-5,
        };
        b.launch(&s, Op::GatedRmsNorm(op)).unwrap();
        let want = gated_rms_norm(&f64s(&xr), &f64s(&gr), &f64s(&wv), 1e-5, d);
        Tolerance::for_dtype(dtype).assert_close(&[t, h, d], &download_f64(&b, &s, &y), &want);
    }
}

/// Rows past the live count become zero (NaN included), the rest keep their bits; a count
/// outside `0..=T` fails at the next synchronize.
pub fn zero_padding_clears_rows<B: Backend>(make: &impl Factory<B>) {
    let b = make();
    let s = b.new_stream().unwrap();
    let mut values = Gen::new(10).uniform_f32(6 * 2 * 3, -1.0, 1.0);
    values[4 * 6] = f32::NAN;
    values[5 * 6 + 1] = f32::INFINITY;
    for dtype in [DType::F32, DType::BF16] {
        let (x, held) = float_tensor(&b, &s, dtype, &[6, 2, 3], &values);
        let count = i32_tensor(&b, &s, &[1], &[4]);
        b.launch(&s, Op::ZeroPadding(ZeroPadding { x: x.clone(), num_actual_tokens: count }))
            .unwrap();
        let got = download_f64(&b, &s, &x);
        let mut want = f64s(&held);
        want[4 * 6..].fill(0.0);
        Tolerance::exact().assert_close(&[6, 6], &got, &want);
    }
    let x = b.alloc(DType::F32, &[3, 2]).unwrap();
    let count = i32_tensor(&b, &s, &[1], &[4]);
    b.launch(&s, Op::ZeroPadding(ZeroPadding { x, num_actual_tokens: count })).unwrap();
    match b.synchronize(&s) {
        Err(Error::OpFailed { op, message, .. }) => {
            assert_eq!(op, "zero_padding");
            assert!(message.contains("num_actual_tokens = 4"), "{message}");
        }
        other => panic!("a count past the rows: {other:?}"),
    }
}

// ---------------------------------------------------------------------------------------------
// The recurrence

/// One sequence's operands (`[T, H, K]` …) and an optional initial state (`[H, K, V]`, K-first).
struct Seq {
    tokens: usize,
    heads: usize,
    kd: usize,
    vd: usize,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    g: Vec<f32>,
    beta: Vec<f32>,
    initial: Option<Vec<f32>>,
}

impl Seq {
    fn random(
        rng: &mut Gen,
        (tokens, heads, kd, vd): (usize, usize, usize, usize),
        g: (f32, f32),
        beta: (f32, f32),
        initial: bool,
    ) -> Self {
        let n = tokens * heads;
        Self {
            tokens,
            heads,
            kd,
            vd,
            q: rng.uniform_f32(n * kd, -1.0, 1.0),
            k: rng.uniform_f32(n * kd, -1.0, 1.0),
            v: rng.uniform_f32(n * vd, -1.0, 1.0),
            g: rng.uniform_f32(n * kd, g.0, g.1),
            beta: rng.uniform_f32(n, beta.0, beta.1),
            initial: initial.then(|| rng.uniform_f32(heads * kd * vd, -1.0, 1.0)),
        }
    }

    fn scale(&self) -> f32 {
        1.0 / (self.kd as f32).sqrt()
    }

    /// The f64 recurrence (with the L2 norm): outputs `[T, H, V]`, final state `[H, K, V]`.
    fn oracle(&self) -> (Vec<f64>, Vec<f64>) {
        let (q, k, v, g, beta) =
            (f64s(&self.q), f64s(&self.k), f64s(&self.v), f64s(&self.g), f64s(&self.beta));
        let seq = KdaSequence {
            q: &q,
            k: &k,
            v: &v,
            g: &g,
            beta: &beta,
            heads: self.heads,
            kd: self.kd,
            vd: self.vd,
        };
        let initial = self.initial.as_deref().map(f64s);
        kda_recurrence(seq, initial.as_deref(), f64::from(self.scale()), true)
    }

    /// The rows of tokens `range` (for split calls).
    fn slice(&self, range: std::ops::Range<usize>) -> Self {
        let hk = self.heads * self.kd;
        let hv = self.heads * self.vd;
        Self {
            tokens: range.len(),
            q: self.q[range.start * hk..range.end * hk].to_vec(),
            k: self.k[range.start * hk..range.end * hk].to_vec(),
            v: self.v[range.start * hv..range.end * hv].to_vec(),
            g: self.g[range.start * hk..range.end * hk].to_vec(),
            beta: self.beta[range.start * self.heads..range.end * self.heads].to_vec(),
            initial: None,
            ..*self
        }
    }
}

/// `[H, K, V]` to the cache's `[H, V, K]` and back.
pub(super) fn swap_last<T: Copy>(x: &[T], heads: usize, a: usize, c: usize) -> Vec<T> {
    let mut out = x.to_vec();
    for h in 0..heads {
        for i in 0..a {
            for j in 0..c {
                out[h * a * c + j * a + i] = x[h * a * c + i * c + j];
            }
        }
    }
    out
}

/// A one-slot v-first state cache holding `seq.initial` (zero if none).
fn state_cache<B: Backend>(b: &Device<B>, s: &B::Stream, seq: &Seq) -> Tensor<B> {
    let (h, kd, vd) = (seq.heads, seq.kd, seq.vd);
    let values = match &seq.initial {
        Some(init) => swap_last(init, h, kd, vd),
        None => vec![0.0; h * kd * vd],
    };
    f32_tensor(b, s, &[1, h, vd, kd], &values)
}

/// The chunked op on `seq` continuing from slot 0 of `state` when `carry`; returns the outputs.
fn run_chunk<B: Backend>(
    b: &Device<B>,
    s: &B::Stream,
    seq: &Seq,
    state: &Tensor<B>,
    carry: bool,
    dtype: DType,
) -> Vec<f64> {
    let (t, h, kd, vd) = (seq.tokens, seq.heads, seq.kd, seq.vd);
    let o = b.alloc(DType::F32, &[t, h, vd]).unwrap();
    let op = KdaChunk {
        chunk_state_slots: None,
        host_meta: None,
        q: float_tensor(b, s, dtype, &[t, h, kd], &seq.q).0,
        k: float_tensor(b, s, dtype, &[t, h, kd], &seq.k).0,
        v: float_tensor(b, s, dtype, &[t, h, vd], &seq.v).0,
        g: float_tensor(b, s, dtype, &[t, h, kd], &seq.g).0,
        gate: None,
        beta: float_tensor(b, s, dtype, &[t, h], &seq.beta).0,
        cu_seqlens: i32_tensor(b, s, &[2], &[0, t as i32]),
        state_slots: i32_tensor(b, s, &[1], &[0]),
        has_initial_state: i32_tensor(b, s, &[1], &[i32::from(carry)]),
        state: state.clone(),
        o: o.clone(),
        scale: seq.scale(),
        qk_l2norm: true,
    };
    b.launch(s, Op::KdaChunk(op)).unwrap();
    download_f64(b, s, &o)
}

/// The token-by-token op on `seq` as one request of `T` tokens, starting from and ending in slot
/// 0 of `state` (the initial state is read from the slot of the last token, the only one kept).
fn run_recurrent<B: Backend>(
    b: &Device<B>,
    s: &B::Stream,
    seq: &Seq,
    state: &Tensor<B>,
) -> Vec<f64> {
    let (t, h, kd, vd) = (seq.tokens, seq.heads, seq.kd, seq.vd);
    let o = b.alloc(DType::F32, &[1, t, h, vd]).unwrap();
    let mut slots = vec![-1i32; t];
    if let Some(last) = slots.last_mut() {
        *last = 0;
    }
    let op = KdaRecurrent {
        q: f32_tensor(b, s, &[1, t, h, kd], &seq.q),
        k: f32_tensor(b, s, &[1, t, h, kd], &seq.k),
        v: f32_tensor(b, s, &[1, t, h, vd], &seq.v),
        g: f32_tensor(b, s, &[1, t, h, kd], &seq.g),
        beta: f32_tensor(b, s, &[1, t, h], &seq.beta),
        state_slots: i32_tensor(b, s, &[1, t], &slots),
        num_accepted_tokens: Some(i32_tensor(b, s, &[1], &[t as i32])),
        state: state.clone(),
        o: o.clone(),
        scale: seq.scale(),
        qk_l2norm: true,
    };
    b.launch(s, Op::KdaRecurrent(op)).unwrap();
    download_f64(b, s, &o)
}

/// The final state of slot 0 as `[H, K, V]`.
fn final_state<B: Backend>(b: &Device<B>, s: &B::Stream, seq: &Seq, state: &Tensor<B>) -> Vec<f64> {
    swap_last(&download_f64(b, s, state), seq.heads, seq.vd, seq.kd)
}

/// Compare outputs and a final state with the oracle's under the recurrence tolerance.
fn check_against(
    what: &str,
    seq: &Seq,
    chunk: usize,
    (o, st): (&[f64], &[f64]),
    (o_ref, st_ref): (&[f64], &[f64]),
) {
    let (t, h, kd, vd) = (seq.tokens, seq.heads, seq.kd, seq.vd);
    let tol = recurrence_tolerance(t, kd, chunk, max_abs(o_ref));
    if let Err(e) = tol.compare(&[t, h, vd], o, o_ref) {
        panic!("{what}: outputs: {e}");
    }
    let tol = recurrence_tolerance(t, kd, chunk, max_abs(st_ref));
    if let Err(e) = tol.compare(&[h, kd, vd], st, st_ref) {
        panic!("{what}: final state: {e}");
    }
}

/// Chunked and token-by-token forms against the f64 recurrence, and against each other, for
/// `T ∈ {1, 2, 63, 64, 65, 200, 1000}` and `K = V ∈ {16, 128}`, crossed with a covering array of
/// heads (1, 3), initial state (without, with), gates (slow: `g ∈ [-0.02, 0]`; fast, near the
/// K3 lower bound: `g ∈ [-5, -4.5]`) and beta (near 0, near 1): every pair of those four
/// choices occurs for every `T` and `K`.
pub fn recurrence_and_chunk_match_f64<B: Backend>(make: &impl Factory<B>) {
    let b = make();
    let s = b.new_stream().unwrap();
    // (heads, initial, fast gates, beta near 1): all pairs of levels are covered.
    let covering = [
        (1, false, false, false),
        (1, true, true, true),
        (3, false, true, true),
        (3, true, false, true),
        (3, true, true, false),
    ];
    let mut seed = 100;
    for tokens in [1usize, 2, 63, 64, 65, 200, 1000] {
        for dim in [16usize, 128] {
            for &(heads, initial, fast, beta_one) in &covering {
                seed += 1;
                let g = if fast { (-5.0, -4.5) } else { (-0.02, 0.0) };
                let beta = if beta_one { (0.95, 1.0) } else { (0.0, 0.05) };
                let mut rng = Gen::new(seed);
                let seq = Seq::random(&mut rng, (tokens, heads, dim, dim), g, beta, initial);
                let (o_ref, s_ref) = seq.oracle();
                let what = format!(
                    "T={tokens} H={heads} K=V={dim} initial={initial} g={g:?} beta={beta:?}"
                );

                let state = state_cache(&b, &s, &seq);
                let o_chunk = run_chunk(&b, &s, &seq, &state, true, DType::F32);
                let s_chunk = final_state(&b, &s, &seq, &state);
                check_against(
                    &format!("chunk {what}"),
                    &seq,
                    CHUNK_SIZE,
                    (&o_chunk, &s_chunk),
                    (&o_ref, &s_ref),
                );

                let state = state_cache(&b, &s, &seq);
                let o_rec = run_recurrent(&b, &s, &seq, &state);
                let s_rec = final_state(&b, &s, &seq, &state);
                check_against(
                    &format!("recurrent {what}"),
                    &seq,
                    0,
                    (&o_rec, &s_rec),
                    (&o_ref, &s_ref),
                );

                // Each within its bound of the oracle, so within the sum of the bounds of each other.
                let tol = recurrence_tolerance(tokens, dim, CHUNK_SIZE, max_abs(&o_ref));
                let tol = tol.with_abs(2.0 * tol.abs).with_rel(2.0 * tol.rel);
                if let Err(e) = tol.compare(&[tokens, heads, dim], &o_chunk, &o_rec) {
                    panic!("chunk vs recurrent {what}: {e}");
                }
            }
        }
    }
}

/// The chunked form in two calls, the state carried through the cache, equals one call: for
/// splits inside, at and next to chunk boundaries; the token-by-token form too. Also the chunked
/// form with bf16 operands.
pub fn chunk_split_equals_one_call<B: Backend>(make: &impl Factory<B>) {
    let b = make();
    let s = b.new_stream().unwrap();
    let mut rng = Gen::new(11);
    let seq = Seq::random(&mut rng, (300, 2, 32, 48), (-1.0, 0.0), (0.0, 1.0), true);
    let state = state_cache(&b, &s, &seq);
    let whole = run_chunk(&b, &s, &seq, &state, true, DType::F32);
    let whole_state = final_state(&b, &s, &seq, &state);
    for split in [1usize, 63, 64, 65, 150, 299] {
        let state = state_cache(&b, &s, &seq);
        let mut pieces = run_chunk(&b, &s, &seq.slice(0..split), &state, true, DType::F32);
        pieces.extend(run_chunk(&b, &s, &seq.slice(split..300), &state, true, DType::F32));
        let st = final_state(&b, &s, &seq, &state);
        let tol = recurrence_tolerance(300, 32, CHUNK_SIZE, max_abs(&whole));
        if let Err(e) = tol.compare(&[300, 2, 48], &pieces, &whole) {
            panic!("split at {split}: outputs: {e}");
        }
        let tol = recurrence_tolerance(300, 32, CHUNK_SIZE, max_abs(&whole_state));
        if let Err(e) = tol.compare(&[2, 32, 48], &st, &whole_state) {
            panic!("split at {split}: final state: {e}");
        }
    }
    // The token-by-token form, split the same way (it reads its initial state from the slot).
    let state = state_cache(&b, &s, &seq);
    let whole = run_recurrent(&b, &s, &seq, &state);
    let whole_state = final_state(&b, &s, &seq, &state);
    let state = state_cache(&b, &s, &seq);
    let mut pieces = run_recurrent(&b, &s, &seq.slice(0..150), &state);
    pieces.extend(run_recurrent(&b, &s, &seq.slice(150..300), &state));
    let tol = recurrence_tolerance(300, 32, 0, max_abs(&whole));
    tol.assert_close(&[300, 2, 48], &pieces, &whole);
    let tol = recurrence_tolerance(300, 32, 0, max_abs(&whole_state));
    tol.assert_close(&[2, 32, 48], &final_state(&b, &s, &seq, &state), &whole_state);
    // bf16 operands: the op widens them exactly, so the oracle on the rounded values applies.
    let state = state_cache(&b, &s, &seq);
    let o = run_chunk(&b, &s, &seq, &state, true, DType::BF16);
    let round = |x: &[f32]| x.iter().map(|&v| bf16::from_f32(v).to_f32()).collect::<Vec<_>>();
    let rounded = Seq {
        q: round(&seq.q),
        k: round(&seq.k),
        v: round(&seq.v),
        g: round(&seq.g),
        beta: round(&seq.beta),
        initial: seq.initial.clone(),
        ..seq
    };
    let (o_ref, s_ref) = rounded.oracle();
    check_against(
        "chunk, bf16 operands",
        &rounded,
        CHUNK_SIZE,
        (&o, &final_state(&b, &s, &seq, &state)),
        (&o_ref, &s_ref),
    );
}

/// Random requests of `lens` tokens (`g` in `g_range`, initial states), a random cache of
/// `n_slots` slots, and the requests' operands back to back: `[q, k, v, beta]` and `g`.
struct Varlen {
    seqs: Vec<Seq>,
    cache0: Vec<f32>,
    total: usize,
    operands: [Vec<f32>; 4],
    g: Vec<f32>,
}

impl Varlen {
    fn random(
        seed: u64,
        lens: &[usize],
        (h, kd, vd): (usize, usize, usize),
        g_range: (f32, f32),
        n_slots: usize,
    ) -> Self {
        let mut rng = Gen::new(seed);
        let seqs: Vec<Seq> = lens
            .iter()
            .map(|&t| Seq::random(&mut rng, (t, h, kd, vd), g_range, (0.0, 1.0), true))
            .collect();
        let cache0 = rng.uniform_f32(n_slots * h * vd * kd, -1.0, 1.0);
        let cat = |f: &dyn Fn(&Seq) -> &Vec<f32>| {
            seqs.iter().flat_map(|q| f(q).clone()).collect::<Vec<f32>>()
        };
        let operands = [cat(&|q| &q.q), cat(&|q| &q.k), cat(&|q| &q.v), cat(&|q| &q.beta)];
        let g = cat(&|q| &q.g);
        Self { total: lens.iter().sum(), seqs, cache0, operands, g }
    }
}

/// `KdaChunk` (scale 0.25, L2 norm on) over the requests `lens` with their `slots` and
/// initial-state flags, reading f32 `q`, `k`, `v`, `beta` (`[T, H, K]`, `[T, H, K]`,
/// `[T, H, V]`, `[T, H]`, the sizes of `g` and `o`) and `g` with its gate as given.
#[allow(clippy::too_many_arguments)]
fn varlen_chunk<B: Backend>(
    b: &Device<B>,
    s: &B::Stream,
    (lens, slots, has_initial): (&[usize], &[i32], &[i32]),
    [q, k, v, beta]: &[Vec<f32>; 4],
    g: Tensor<B>,
    gate: Option<ChunkGate<B>>,
    state: &Tensor<B>,
    o: &Tensor<B>,
) -> KdaChunk<B> {
    let [t, h, kd] = <[usize; 3]>::try_from(g.shape()).expect("g is [T, H, K]");
    let vd = o.shape()[2];
    let requests = lens.len();
    KdaChunk {
        chunk_state_slots: None,
        host_meta: None,
        q: f32_tensor(b, s, &[t, h, kd], q),
        k: f32_tensor(b, s, &[t, h, kd], k),
        v: f32_tensor(b, s, &[t, h, vd], v),
        g,
        gate,
        beta: f32_tensor(b, s, &[t, h], beta),
        cu_seqlens: i32_tensor(b, s, &[requests + 1], &offsets(lens)),
        state_slots: i32_tensor(b, s, &[requests], slots),
        has_initial_state: i32_tensor(b, s, &[requests], has_initial),
        state: state.clone(),
        o: o.clone(),
        scale: 0.25,
        qk_l2norm: true,
    }
}

/// A flat prefill batch of several requests (lengths 70, 0, 5, 130, 64; one padding request,
/// fresh and continued states, slots in any order) equals each request alone; padding rows
/// are zero and the padding request's slot keeps its bytes.
pub fn chunk_varlen_batch_matches_f64<B: Backend>(make: &impl Factory<B>) {
    let b = make();
    let s = b.new_stream().unwrap();
    let (h, kd, vd) = (2, 16, 24);
    let lens = [70usize, 0, 5, 130, 64];
    let slots = [2i32, 0, 4, -1, 1];
    let has_initial = [1i32, 1, 0, 1, 1];
    let n_slots = 5;
    let Varlen { seqs, cache0, total, operands, g } =
        Varlen::random(12, &lens, (h, kd, vd), (-2.0, 0.0), n_slots);
    let starts = offsets(&lens);
    let state = f32_tensor(&b, &s, &[n_slots, h, vd, kd], &cache0);
    let o = b.alloc(DType::F32, &[total, h, vd]).unwrap();
    b.launch(&s, Op::Fill { dst: o.clone(), value: 7.0 }).unwrap();
    let g = f32_tensor(&b, &s, &[total, h, kd], &g);
    let op = varlen_chunk(&b, &s, (&lens, &slots, &has_initial), &operands, g, None, &state, &o);
    b.launch(&s, Op::KdaChunk(op)).unwrap();
    let (got_o, got_state) = (download_f64(&b, &s, &o), download_f64(&b, &s, &state));
    let per_slot = h * vd * kd;
    for (r, seq) in seqs.iter().enumerate() {
        let rows = starts[r] as usize * h * vd..starts[r + 1] as usize * h * vd;
        if slots[r] < 0 {
            assert!(got_o[rows].iter().all(|&x| x == 0.0), "padding request's outputs are zero");
            continue;
        }
        let slot = slots[r] as usize * per_slot..(slots[r] as usize + 1) * per_slot;
        let initial = (has_initial[r] != 0).then(|| {
            swap_last(&cache0[slot.clone()], h, vd, kd)
                .iter()
                .map(|&x| f64::from(x))
                .collect::<Vec<_>>()
        });
        let (q, k, v, g, beta) =
            (f64s(&seq.q), f64s(&seq.k), f64s(&seq.v), f64s(&seq.g), f64s(&seq.beta));
        let sequence = KdaSequence { q: &q, k: &k, v: &v, g: &g, beta: &beta, heads: h, kd, vd };
        let (o_ref, s_ref) = kda_recurrence(sequence, initial.as_deref(), 0.25, true);
        let st = swap_last(&got_state[slot], h, vd, kd);
        check_against(
            &format!("request {r}"),
            seq,
            CHUNK_SIZE,
            (&got_o[rows], &st),
            (&o_ref, &s_ref),
        );
    }
    // Slot 3 belongs to no request; slot of the padding request (-1) is none.
    Tolerance::exact().assert_close(
        &[per_slot],
        &got_state[3 * per_slot..4 * per_slot],
        &f64s(&cache0[3 * per_slot..4 * per_slot]),
    );
}

/// Chunk-boundary states (`docs/design/kda.md#chunk-boundary-states`): over a varlen batch
/// (lengths 150, 64, 30, 0, 129; the last a padding request; continued and fresh states;
/// `K != V`), the states kept at chunk boundaries equal the f64 recurrence over the request's
/// prefix up to that boundary; the state kept after 128 tokens equals the final state of a
/// prefill cut there; a prefill resumed from the state kept after 64 tokens equals the rest of
/// the uninterrupted prefill (outputs and final state); unrequested boundaries, the padding
/// request's and unrelated slots keep their bytes; a wrong entry count or a kept slot shared
/// with a request's slot fails at synchronize. A backend without the output must reject it
/// with `Error::Unsupported` naming `chunk_state_slots`.
pub fn chunk_boundary_states_match_f64_and_resume<B: Backend>(make: &impl Factory<B>) {
    let b = make();
    let s = b.new_stream().unwrap();
    let (h, kd, vd) = (2, 16, 24);
    let lens = [150usize, 64, 30, 0, 129];
    let slots = [0i32, 1, 2, 3, -1];
    let has_initial = [1i32, 0, 1, 0, 0];
    // Chunks: 3, 1, 1, 0, 3. Request 0 keeps chunks 0 and 1 (after 64 and 128 tokens), request
    // 1 its only chunk (its final state, kept twice), the padding request asks for slot 9.
    let kept = [5i32, 6, -1, 7, -1, 9, -1, -1];
    let n_slots = 11;
    let Varlen { seqs, cache0, total, operands, g: g_all } =
        Varlen::random(19, &lens, (h, kd, vd), (-1.0, 0.0), n_slots);
    let state = f32_tensor(&b, &s, &[n_slots, h, vd, kd], &cache0);
    let o = b.alloc(DType::F32, &[total, h, vd]).unwrap();
    let g = f32_tensor(&b, &s, &[total, h, kd], &g_all);
    let mut op =
        varlen_chunk(&b, &s, (&lens, &slots, &has_initial), &operands, g, None, &state, &o);
    op.chunk_state_slots = Some(i32_tensor(&b, &s, &[kept.len()], &kept));
    match b.launch(&s, Op::KdaChunk(op.clone())) {
        Ok(()) => {}
        Err(Error::Unsupported { feature, .. }) => {
            assert_eq!(feature, "chunk_state_slots", "the rejection names the parameter");
            return;
        }
        Err(e) => panic!("chunk with chunk_state_slots: {e}"),
    }
    let (got_o, got_state) = (download_f64(&b, &s, &o), download_f64(&b, &s, &state));
    let per_slot = h * vd * kd;
    let slot_kfirst = |cache: &[f64], slot: usize| {
        swap_last(&cache[slot * per_slot..(slot + 1) * per_slot], h, vd, kd)
    };
    let initial_of =
        |r: usize| (has_initial[r] != 0).then(|| slot_kfirst(&f64s(&cache0), slots[r] as usize));
    // Kept states against the oracle over the prefix up to each boundary.
    for (r, end, slot) in [(0usize, 64usize, 5usize), (0, 128, 6), (1, 64, 7)] {
        let prefix = seqs[r].slice(0..end);
        let (q, k, v, g, beta) = (
            f64s(&prefix.q),
            f64s(&prefix.k),
            f64s(&prefix.v),
            f64s(&prefix.g),
            f64s(&prefix.beta),
        );
        let sequence = KdaSequence { q: &q, k: &k, v: &v, g: &g, beta: &beta, heads: h, kd, vd };
        let (_, s_ref) = kda_recurrence(sequence, initial_of(r).as_deref(), 0.25, true);
        let tol = recurrence_tolerance(end, kd, CHUNK_SIZE, max_abs(&s_ref));
        if let Err(e) = tol.compare(&[h, kd, vd], &slot_kfirst(&got_state, slot), &s_ref) {
            panic!("request {r}: state after {end} tokens (slot {slot}): {e}");
        }
    }
    // Request 1's only boundary is its end: the kept copy is its final state.
    Tolerance::exact().assert_close(
        &[per_slot],
        &got_state[7 * per_slot..8 * per_slot],
        &got_state[per_slot..2 * per_slot],
    );
    // Untouched: slots 4, 8, 10 (nobody's), 9 (asked for by the padding request).
    for slot in [4usize, 8, 9, 10] {
        let range = slot * per_slot..(slot + 1) * per_slot;
        Tolerance::exact().assert_close(
            &[per_slot],
            &got_state[range.clone()],
            &f64s(&cache0[range]),
        );
    }
    // A prefill cut at 128 tokens ends in the state kept after 128 tokens.
    let cut_seq = Seq { initial: seqs[0].initial.clone(), ..seqs[0].slice(0..128) };
    let cut_cache = f32_tensor(&b, &s, &[1, h, vd, kd], &cache0[..per_slot]);
    continue_chunk(&b, &s, &cut_seq, &cut_cache);
    let cut = download_f64(&b, &s, &cut_cache);
    let tol = recurrence_tolerance(128, kd, CHUNK_SIZE, max_abs(&cut));
    if let Err(e) = tol.compare(&[per_slot], &got_state[6 * per_slot..7 * per_slot], &cut) {
        panic!("state kept after 128 tokens vs a prefill cut there: {e}");
    }
    // Resume request 0 from the state kept after 64 tokens.
    let resume = f32_tensor(&b, &s, &[1, h, vd, kd], &{
        let v = &got_state[5 * per_slot..6 * per_slot];
        v.iter().map(|&x| x as f32).collect::<Vec<_>>()
    });
    let rest = continue_chunk(&b, &s, &seqs[0].slice(64..150), &resume);
    let whole = &got_o[64 * h * vd..150 * h * vd];
    let tol = recurrence_tolerance(150, kd, CHUNK_SIZE, max_abs(whole));
    if let Err(e) = tol.compare(&[86, h, vd], &rest, whole) {
        panic!("prefill resumed after 64 tokens: outputs: {e}");
    }
    let resumed = download_f64(&b, &s, &resume);
    let tol = recurrence_tolerance(150, kd, CHUNK_SIZE, max_abs(&resumed));
    if let Err(e) = tol.compare(&[per_slot], &resumed, &got_state[..per_slot]) {
        panic!("prefill resumed after 64 tokens: final state: {e}");
    }
    // Bad kept slots fail when the op runs.
    let fails_with = |kept: &[i32], needle: &str| {
        let mut bad = op.clone();
        bad.chunk_state_slots = Some(i32_tensor(&b, &s, &[kept.len()], kept));
        b.launch(&s, Op::KdaChunk(bad)).unwrap();
        match b.synchronize(&s) {
            Err(Error::OpFailed { message, .. }) => {
                assert!(message.contains(needle), "{needle}: {message}")
            }
            other => panic!("{needle}: {other:?}"),
        }
    };
    let cases: [(&[i32], &str); 3] = [
        (&[-1; 7], "chunk_state_slots"),
        (&[-1, -1, -1, 2, -1, -1, -1, -1], "chunk_state_slots[3] = 2"),
        (&[5, 5, -1, -1, -1, -1, -1, -1], "chunk_state_slots[1] = 5"),
    ];
    for (case, (kept, needle)) in cases.into_iter().enumerate() {
        if super::runs_fault_case(&b, case) {
            fails_with(kept, needle);
        }
    }
}

/// `KdaChunk` on `seq` as one request continuing from slot 0 of `state`, f32, scale 0.25 (as
/// [`varlen_chunk`]); returns the outputs.
fn continue_chunk<B: Backend>(
    b: &Device<B>,
    s: &B::Stream,
    seq: &Seq,
    state: &Tensor<B>,
) -> Vec<f64> {
    let (t, h, kd, vd) = (seq.tokens, seq.heads, seq.kd, seq.vd);
    let o = b.alloc(DType::F32, &[t, h, vd]).unwrap();
    let operands = [seq.q.clone(), seq.k.clone(), seq.v.clone(), seq.beta.clone()];
    let g = f32_tensor(b, s, &[t, h, kd], &seq.g);
    let op = varlen_chunk(b, s, (&[t], &[0], &[1]), &operands, g, None, state, &o);
    b.launch(s, Op::KdaChunk(op)).unwrap();
    download_f64(b, s, &o)
}

/// The in-kernel gate (`docs/design/kda.md#behaviour-11`): `KdaChunk` given the raw logits and the
/// gate's parameters equals `KdaGate` followed by `KdaChunk` on the activated gate, bit for bit
/// (outputs and every state slot), for both gate forms, over a varlen batch (lengths 70, 0, 5,
/// 65, 3; a padding request; fresh and continued states), with f32 logits and with bf16 logits
/// read through a column view of a wider tensor (as the layer's `g1` is). Logits span both
/// sides of the softplus threshold and of the lower bound's saturation.
pub fn chunk_in_kernel_gate_equals_gate_then_chunk<B: Backend>(make: &impl Factory<B>) {
    let b = make();
    let s = b.new_stream().unwrap();
    let (h, kd, vd) = (3, 16, 8);
    let lens = [70usize, 0, 5, 65, 3];
    let slots = [2i32, 0, 4, 1, -1];
    let has_initial = [1i32, 1, 0, 1, 0];
    let n_slots = 5;
    let total: usize = lens.iter().sum();
    let (hk, hv) = (h * kd, h * vd);
    let mut rng = Gen::new(16);
    let operands = [
        rng.uniform_f32(total * hk, -1.0, 1.0),
        rng.uniform_f32(total * hk, -1.0, 1.0),
        rng.uniform_f32(total * hv, -1.0, 1.0),
        rng.uniform_f32(total * h, 0.0, 1.0),
    ];
    // Logits ~U(-8, 8), every 7th one past the softplus threshold (up to 30).
    let mut g1 = rng.uniform_f32(total * hk, -8.0, 8.0);
    for (i, x) in g1.iter_mut().enumerate().step_by(7) {
        *x = 20.0 + (i % 11) as f32;
    }
    let a_log = [-1.0f32, 0.0, 1.5];
    let dt_bias = rng.uniform_f32(hk, -1.0, 1.0);
    let cache0 = rng.uniform_f32(n_slots * hv * kd, -1.0, 1.0);
    let starts = offsets(&lens);
    let run = |g: Tensor<B>, gate: Option<ChunkGate<B>>| {
        let state = f32_tensor(&b, &s, &[n_slots, h, vd, kd], &cache0);
        let o = b.alloc(DType::F32, &[total, h, vd]).unwrap();
        b.launch(&s, Op::Fill { dst: o.clone(), value: 7.0 }).unwrap();
        let meta = (&lens[..], &slots[..], &has_initial[..]);
        let op = varlen_chunk(&b, &s, meta, &operands, g, gate, &state, &o);
        b.launch(&s, Op::KdaChunk(op)).unwrap();
        let bits = |t: &Tensor<B>| -> Vec<u32> {
            b.download::<f32>(&s, t).unwrap().into_iter().map(f32::to_bits).collect()
        };
        (bits(&o), bits(&state))
    };
    for form in [GateForm::Softplus, GateForm::LowerBound { lower_bound: -5.0 }] {
        for dtype in [DType::F32, DType::BF16] {
            let logits = if dtype == DType::BF16 {
                // The middle third of a [T, 3·H·K] tensor, viewed as [T, H, K].
                let mut wide = rng.uniform_f32(total * 3 * hk, -1.0, 1.0);
                for (t, row) in wide.chunks_exact_mut(3 * hk).enumerate() {
                    row[hk..2 * hk].copy_from_slice(&g1[t * hk..(t + 1) * hk]);
                }
                let (wide, _) = float_tensor(&b, &s, dtype, &[total, 3 * hk], &wide);
                wide.split(1, &[hk, hk, hk]).unwrap()[1].reshape(&[total, h, kd]).unwrap()
            } else {
                f32_tensor(&b, &s, &[total, h, kd], &g1)
            };
            let params = ChunkGate {
                a_log: f32_tensor(&b, &s, &[h], &a_log),
                dt_bias: f32_tensor(&b, &s, &[h, kd], &dt_bias),
                form,
            };
            let activated = b.alloc(DType::F32, &[total, h, kd]).unwrap();
            let gate = KdaGate {
                g1: logits.clone(),
                a_log: params.a_log.clone(),
                dt_bias: params.dt_bias.clone(),
                form,
                g: activated.clone(),
            };
            b.launch(&s, Op::KdaGate(gate)).unwrap();
            let two_ops = run(activated, None);
            let fused = run(logits.clone(), Some(params));
            assert!(
                fused.0 == two_ops.0,
                "{form} {dtype:?}: outputs differ from KdaGate + KdaChunk"
            );
            assert!(
                fused.1 == two_ops.1,
                "{form} {dtype:?}: states differ from KdaGate + KdaChunk"
            );
            // Not vacuous: the logits themselves as a log decay give other results.
            let raw = run(logits, None);
            assert!(
                raw.0 != fused.0 && raw.1 != fused.1,
                "{form} {dtype:?}: the gate changed nothing"
            );
            let out: Vec<f32> = fused.0.iter().map(|&x| f32::from_bits(x)).collect();
            assert!(out.iter().all(|x| x.is_finite()), "{form} {dtype:?}: outputs not finite");
            let pad = starts[4] as usize * hv..;
            assert!(out[pad].iter().all(|&x| x == 0.0), "{form} {dtype:?}: padding request");
        }
    }
}

/// Speculative decode: each request starts from slot `state_slots[b, a-1]` and keeps the state
/// after token `t` in `state_slots[b, t]` (not where the slot is negative); a padding request
/// (negative initial slot) outputs zeros and writes nothing.
pub fn recurrent_speculative_reads_and_writes_slots<B: Backend>(make: &impl Factory<B>) {
    let b = make();
    let s = b.new_stream().unwrap();
    let (batch, n, h, kd, vd) = (3usize, 4usize, 2usize, 16usize, 16usize);
    let n_slots = 12;
    let mut rng = Gen::new(13);
    let seq = Seq::random(&mut rng, (batch * n, h, kd, vd), (-1.0, 0.0), (0.0, 1.0), false);
    let cache0 = rng.uniform_f32(n_slots * h * vd * kd, -1.0, 1.0);
    // Request 0 accepted 2 (starts from slot 1), request 1 accepted 4 (slot 7), request 2 is
    // padding. Request 0 keeps no state after its token 2.
    let slots = [0i32, 1, -1, 3, 4, 5, 6, 7, -1, 8, 9, 10];
    let accepted = [2i32, 4, 1];
    let state = f32_tensor(&b, &s, &[n_slots, h, vd, kd], &cache0);
    let o = b.alloc(DType::F32, &[batch, n, h, vd]).unwrap();
    let op = KdaRecurrent {
        q: f32_tensor(&b, &s, &[batch, n, h, kd], &seq.q),
        k: f32_tensor(&b, &s, &[batch, n, h, kd], &seq.k),
        v: f32_tensor(&b, &s, &[batch, n, h, vd], &seq.v),
        g: f32_tensor(&b, &s, &[batch, n, h, kd], &seq.g),
        beta: f32_tensor(&b, &s, &[batch, n, h], &seq.beta),
        state_slots: i32_tensor(&b, &s, &[batch, n], &slots),
        num_accepted_tokens: Some(i32_tensor(&b, &s, &[batch], &accepted)),
        state: state.clone(),
        o: o.clone(),
        scale: seq.scale(),
        qk_l2norm: true,
    };
    b.launch(&s, Op::KdaRecurrent(op)).unwrap();
    let (got_o, got_state) = (download_f64(&b, &s, &o), download_f64(&b, &s, &state));
    let per_slot = h * vd * kd;
    let slot_kfirst = |cache: &[f64], slot: usize| {
        swap_last(&cache[slot * per_slot..(slot + 1) * per_slot], h, vd, kd)
    };
    let cache64 = f64s(&cache0);
    let mut want_state = cache64.clone();
    for r in 0..2 {
        let initial = slot_kfirst(&cache64, slots[r * n + accepted[r] as usize - 1] as usize);
        for t in 0..n {
            // The oracle over the request's first t + 1 tokens.
            let prefix = seq.slice(r * n..r * n + t + 1);
            let (q, k, v, g, beta) = (
                f64s(&prefix.q),
                f64s(&prefix.k),
                f64s(&prefix.v),
                f64s(&prefix.g),
                f64s(&prefix.beta),
            );
            let sequence =
                KdaSequence { q: &q, k: &k, v: &v, g: &g, beta: &beta, heads: h, kd, vd };
            let (o_ref, s_ref) =
                kda_recurrence(sequence, Some(&initial), f64::from(seq.scale()), true);
            let o_at = (r * n + t) * h * vd;
            let tol = recurrence_tolerance(t + 1, kd, 0, max_abs(&o_ref));
            tol.assert_close(&[h, vd], &got_o[o_at..o_at + h * vd], &o_ref[t * h * vd..]);
            let slot = slots[r * n + t];
            if slot >= 0 {
                let at = slot as usize * per_slot;
                want_state[at..at + per_slot].copy_from_slice(&swap_last(&s_ref, h, kd, vd));
            }
        }
    }
    let tol = recurrence_tolerance(n, kd, 0, max_abs(&want_state));
    tol.assert_close(&[n_slots, h, vd, kd], &got_state, &want_state);
    assert!(got_o[2 * n * h * vd..].iter().all(|&x| x == 0.0), "padding request outputs zeros");
}

// ---------------------------------------------------------------------------------------------
// Bad input and NaN

/// Shape, dtype and parameter errors are returned by `launch`, naming the op and parameter.
pub fn kda_ops_reject_bad_operands<B: Backend>(make: &impl Factory<B>) {
    let b = make();
    let s = b.new_stream().unwrap();
    // Zero-filled, so the ops that are accepted run on defined data.
    let f = |shape: &[usize]| f32_tensor(&b, &s, shape, &vec![0.0; shape.iter().product()]);
    let i = |shape: &[usize]| i32_tensor(&b, &s, shape, &vec![0; shape.iter().product()]);
    let (t, h, kd, vd) = (5, 2, 8, 6);
    let chunk = || KdaChunk {
        chunk_state_slots: None,
        host_meta: None,
        q: f(&[t, h, kd]),
        k: f(&[t, h, kd]),
        v: f(&[t, h, vd]),
        g: f(&[t, h, kd]),
        gate: None,
        beta: f(&[t, h]),
        cu_seqlens: i(&[2]),
        state_slots: i(&[1]),
        has_initial_state: i(&[1]),
        state: f(&[1, h, vd, kd]),
        o: f(&[t, h, vd]),
        scale: 0.5,
        qk_l2norm: true,
    };
    let expect = |r: kda_core::Result<()>, param: &str| match r {
        Err(
            Error::Shape { param: p, .. }
            | Error::DType { param: p, .. }
            | Error::Param { param: p, .. },
        ) if p == param => {}
        other => panic!("{param}: {other:?}"),
    };
    let launch = |op: KdaChunk<B>| b.launch(&s, Op::KdaChunk(op));
    b.launch(&s, Op::KdaChunk(chunk())).unwrap();
    expect(launch(KdaChunk { k: f(&[t, h, kd + 1]), ..chunk() }), "k");
    expect(launch(KdaChunk { v: f(&[t, h + 1, vd]), ..chunk() }), "v");
    expect(launch(KdaChunk { g: f(&[t, h, kd - 1]), ..chunk() }), "g");
    expect(launch(KdaChunk { beta: f(&[t, h, 1]), ..chunk() }), "beta");
    expect(launch(KdaChunk { o: f(&[t, h, kd]), ..chunk() }), "o");
    // The K-first layout is the classic mistake: the cache is [N, H, V, K].
    match launch(KdaChunk { state: f(&[1, h, kd, vd]), ..chunk() }) {
        Err(Error::Shape { op: "kda_chunk", param: "state", expected, actual }) => {
            assert!(
                expected.contains("[1, 2, 6, 8]") && expected.contains("v-first"),
                "{expected}"
            );
            assert_eq!(actual, vec![1, h, kd, vd]);
        }
        other => panic!("k-first state: {other:?}"),
    }
    expect(
        launch(KdaChunk { state: b.alloc(DType::BF16, &[1, h, vd, kd]).unwrap(), ..chunk() }),
        "state",
    );
    expect(launch(KdaChunk { cu_seqlens: f(&[2]), ..chunk() }), "cu_seqlens");
    expect(launch(KdaChunk { state_slots: i(&[2]), ..chunk() }), "state_slots");
    expect(launch(KdaChunk { q: i(&[t, h, kd]), ..chunk() }), "q");
    expect(launch(KdaChunk { scale: f32::NAN, ..chunk() }), "scale");
    // The in-kernel gate's parameters, checked as KdaGate checks them (`g` holds the logits).
    let gated = |a_log: Tensor<B>, dt_bias: Tensor<B>, form| KdaChunk {
        chunk_state_slots: None,
        host_meta: None,
        gate: Some(ChunkGate { a_log, dt_bias, form }),
        ..chunk()
    };
    let lb = GateForm::LowerBound { lower_bound: -5.0 };
    b.launch(&s, Op::KdaChunk(gated(f(&[h]), f(&[h, kd]), lb))).unwrap();
    match launch(gated(f(&[h + 1]), f(&[h, kd]), lb)) {
        Err(Error::Shape { op: "kda_chunk", param: "a_log", expected, actual }) => {
            assert!(expected.contains("[2]") && expected.contains("of g"), "{expected}");
            assert_eq!(actual, vec![h + 1]);
        }
        other => panic!("a_log: {other:?}"),
    }
    expect(launch(gated(i(&[h]), f(&[h, kd]), lb)), "a_log");
    expect(launch(gated(f(&[h]), f(&[h, vd]), lb)), "dt_bias");
    expect(launch(gated(f(&[h]), i(&[h, kd]), lb)), "dt_bias");
    let positive = GateForm::LowerBound { lower_bound: 1.0 };
    expect(launch(gated(f(&[h]), f(&[h, kd]), positive)), "lower_bound");
    let infinite = GateForm::LowerBound { lower_bound: f32::NEG_INFINITY };
    expect(launch(gated(f(&[h]), f(&[h, kd]), infinite)), "lower_bound");
    expect(launch(KdaChunk { g: i(&[t, h, kd]), ..gated(f(&[h]), f(&[h, kd]), lb) }), "g");

    let rec = || KdaRecurrent {
        q: f(&[2, 3, h, kd]),
        k: f(&[2, 3, h, kd]),
        v: f(&[2, 3, h, vd]),
        g: f(&[2, 3, h, kd]),
        beta: f(&[2, 3, h]),
        state_slots: i(&[2, 3]),
        num_accepted_tokens: None,
        state: f(&[4, h, vd, kd]),
        o: f(&[2, 3, h, vd]),
        scale: 0.5,
        qk_l2norm: false,
    };
    let launch = |op: KdaRecurrent<B>| b.launch(&s, Op::KdaRecurrent(op));
    expect(launch(KdaRecurrent { state_slots: i(&[2]), ..rec() }), "state_slots");
    expect(
        launch(KdaRecurrent { num_accepted_tokens: Some(i(&[3])), ..rec() }),
        "num_accepted_tokens",
    );
    expect(launch(KdaRecurrent { beta: f(&[2, 3]), ..rec() }), "beta");

    let (c, w) = (6, 4);
    let conv = || CausalConv {
        x: f(&[t, c]),
        weight: f(&[c, w]),
        query_start_loc: i(&[2]),
        state_slots: i(&[1]),
        has_initial_state: i(&[1]),
        state: f(&[2, w - 1, c]),
        y: f(&[t, c]),
    };
    let launch = |op: CausalConv<B>| b.launch(&s, Op::CausalConv(op));
    expect(launch(CausalConv { weight: f(&[c + 1, w]), ..conv() }), "weight");
    expect(launch(CausalConv { weight: f(&[c, 0]), ..conv() }), "weight");
    expect(launch(CausalConv { state: f(&[2, w - 2, c]), ..conv() }), "state");
    expect(launch(CausalConv { query_start_loc: i(&[0]), ..conv() }), "query_start_loc");
    let update = || CausalConvUpdate {
        x: f(&[2, 3, c]),
        weight: f(&[c, w]),
        state_slots: i(&[2]),
        num_accepted_tokens: None,
        state: f(&[2, w + 1, c]),
        y: f(&[2, 3, c]),
    };
    b.launch(&s, Op::CausalConvUpdate(update())).unwrap();
    // Three tokens need W - 2 + 3 = 5 state rows.
    expect(
        b.launch(&s, Op::CausalConvUpdate(CausalConvUpdate { state: f(&[2, w, c]), ..update() })),
        "state",
    );

    let gate = |form| KdaGate {
        g1: f(&[t, h, kd]),
        a_log: f(&[h]),
        dt_bias: f(&[h, kd]),
        form,
        g: f(&[t, h, kd]),
    };
    expect(
        b.launch(&s, Op::KdaGate(gate(GateForm::LowerBound { lower_bound: 5.0 }))),
        "lower_bound",
    );
    let mut bad = gate(GateForm::Softplus);
    bad.a_log = f(&[h, 1]);
    expect(b.launch(&s, Op::KdaGate(bad)), "a_log");
    let mut bad = gate(GateForm::Softplus);
    bad.g = b.alloc(DType::BF16, &[t, h, kd]).unwrap();
    expect(b.launch(&s, Op::KdaGate(bad)), "g");
    let norm = || GatedRmsNorm {
        x: f(&[t, h, kd]),
        gate: f(&[t, h, kd]),
        weight: f(&[kd]),
        y: f(&[t, h, kd]),
        eps: 1e-5,
    };
    expect(
        b.launch(&s, Op::GatedRmsNorm(GatedRmsNorm { weight: f(&[kd + 1]), ..norm() })),
        "weight",
    );
    expect(b.launch(&s, Op::GatedRmsNorm(GatedRmsNorm { eps: -1.0, ..norm() })), "eps");
    expect(b.launch(&s, Op::L2Norm(L2Norm { x: f(&[3, 4]), y: f(&[4, 3]), scale: 1.0 })), "y");
    expect(
        b.launch(&s, Op::ZeroPadding(ZeroPadding { x: f(&[3]), num_actual_tokens: i(&[2]) })),
        "num_actual_tokens",
    );
    b.synchronize(&s).expect("rejected ops never reach the stream");
}

/// Offsets, slots and counts are device data: bad values fail the op when it runs, at the next
/// synchronize, with a message naming the parameter; nothing is half written past the check.
pub fn kda_bad_metadata_fails_at_synchronize<B: Backend>(make: &impl Factory<B>) {
    let b = make();
    let s = b.new_stream().unwrap();
    let (t, h, kd) = (6, 1, 4);
    let zeros = |shape: &[usize]| f32_tensor(&b, &s, shape, &vec![0.0; shape.iter().product()]);
    let chunk = |starts: &[i32], slot: i32| KdaChunk {
        chunk_state_slots: None,
        host_meta: None,
        q: zeros(&[t, h, kd]),
        k: zeros(&[t, h, kd]),
        v: zeros(&[t, h, kd]),
        g: zeros(&[t, h, kd]),
        gate: None,
        beta: zeros(&[t, h]),
        cu_seqlens: i32_tensor(&b, &s, &[3], starts),
        state_slots: i32_tensor(&b, &s, &[2], &[0, slot]),
        has_initial_state: i32_tensor(&b, &s, &[2], &[0, 0]),
        state: zeros(&[2, h, kd, kd]),
        o: zeros(&[t, h, kd]),
        scale: 1.0,
        qk_l2norm: true,
    };
    let fails_with = |op: Op<B>, needle: &str| {
        b.launch(&s, op).unwrap();
        match b.synchronize(&s) {
            Err(Error::OpFailed { message, .. }) => {
                assert!(message.contains(needle), "{needle}: {message}")
            }
            other => panic!("{needle}: {other:?}"),
        }
    };
    let mut cases: Vec<(Op<B>, &str)> = vec![
        (Op::KdaChunk(chunk(&[0, 4, 3], 1)), "cu_seqlens"),
        (Op::KdaChunk(chunk(&[0, 4, 7], 1)), "cu_seqlens"),
        (Op::KdaChunk(chunk(&[0, 4, 6], 2)), "state_slots[1] = 2"),
    ];
    let rec = |accepted: i32| KdaRecurrent {
        q: zeros(&[1, 2, h, kd]),
        k: zeros(&[1, 2, h, kd]),
        v: zeros(&[1, 2, h, kd]),
        g: zeros(&[1, 2, h, kd]),
        beta: zeros(&[1, 2, h]),
        state_slots: i32_tensor(&b, &s, &[1, 2], &[0, 1]),
        num_accepted_tokens: Some(i32_tensor(&b, &s, &[1], &[accepted])),
        state: zeros(&[2, h, kd, kd]),
        o: zeros(&[1, 2, h, kd]),
        scale: 1.0,
        qk_l2norm: true,
    };
    cases.push((Op::KdaRecurrent(rec(0)), "num_accepted_tokens[0] = 0"));
    cases.push((Op::KdaRecurrent(rec(3)), "num_accepted_tokens[0] = 3"));
    let update = CausalConvUpdate {
        x: zeros(&[1, 1, 3]),
        weight: zeros(&[3, 4]),
        state_slots: i32_tensor(&b, &s, &[1], &[0]),
        num_accepted_tokens: Some(i32_tensor(&b, &s, &[1], &[3])),
        state: zeros(&[1, 4, 3]),
        y: zeros(&[1, 1, 3]),
    };
    cases.push((Op::CausalConvUpdate(update), "num_accepted_tokens[0] = 3"));
    let good = Op::KdaChunk(chunk(&[0, 4, 6], 1));
    for (case, (op, needle)) in cases.into_iter().enumerate() {
        if super::runs_fault_case(&b, case) {
            fails_with(op, needle);
        }
    }
    if b.info().capabilities.device_faults_are_fatal {
        // The device stays failed: good work fails (when queued or at synchronize) with the
        // fault already reported.
        let after = b.launch(&s, good).and_then(|()| b.synchronize(&s));
        assert!(after.is_err(), "work after a fatal device fault must fail: {after:?}");
    } else {
        // The stream works again after the errors were reported.
        b.launch(&s, good).unwrap();
        b.synchronize(&s).unwrap();
    }
}

/// NaN in the inputs propagates and never crashes: a NaN key at token 70 of head 1 makes that
/// head's outputs NaN from token 70 on (the chunked form may also poison the earlier tokens of
/// that chunk, 64..70) and its final state NaN; the other head, and everything before the chunk,
/// is exactly as without the NaN. The gate and the norms pass NaN through element-wise.
pub fn nan_inputs_propagate_without_crashing<B: Backend>(make: &impl Factory<B>) {
    let b = make();
    let s = b.new_stream().unwrap();
    let mut rng = Gen::new(14);
    let clean = Seq::random(&mut rng, (150, 2, 16, 16), (-0.5, 0.0), (0.0, 1.0), true);
    let mut poisoned = Seq {
        q: clean.q.clone(),
        k: clean.k.clone(),
        v: clean.v.clone(),
        g: clean.g.clone(),
        beta: clean.beta.clone(),
        initial: clean.initial.clone(),
        ..clean
    };
    poisoned.k[(70 * 2 + 1) * 16 + 3] = f32::NAN;
    let (h, vd) = (2, 16);
    for form in ["chunk", "recurrent"] {
        let run = |seq: &Seq| {
            let state = state_cache(&b, &s, seq);
            let o = if form == "chunk" {
                run_chunk(&b, &s, seq, &state, true, DType::F32)
            } else {
                run_recurrent(&b, &s, seq, &state)
            };
            (o, final_state(&b, &s, seq, &state))
        };
        let ((o_clean, s_clean), (o_nan, s_nan)) = (run(&clean), run(&poisoned));
        let first_unspecified = if form == "chunk" { 64 } else { 70 };
        for t in 0..150 {
            for head in 0..h {
                let at = (t * h + head) * vd;
                let (got, want) = (&o_nan[at..at + vd], &o_clean[at..at + vd]);
                if head == 0 || t < first_unspecified {
                    Tolerance::exact().assert_close(&[vd], got, want);
                } else if t >= 70 {
                    assert!(
                        got.iter().all(|x| x.is_nan()),
                        "{form}: token {t} head 1 should be NaN: {got:?}"
                    );
                }
            }
        }
        let per_head = 16 * 16;
        Tolerance::exact().assert_close(&[per_head], &s_nan[..per_head], &s_clean[..per_head]);
        assert!(s_nan[per_head..].iter().all(|x| x.is_nan()), "{form}: head 1's state is NaN");
    }
    // Element-wise ops: NaN in, NaN out, neighbours untouched.
    let g1 = f32_tensor(&b, &s, &[1, 1, 3], &[0.5, f32::NAN, -0.5]);
    let g = b.alloc(DType::F32, &[1, 1, 3]).unwrap();
    let op = KdaGate {
        g1,
        a_log: f32_tensor(&b, &s, &[1], &[0.0]),
        dt_bias: f32_tensor(&b, &s, &[1, 3], &[0.0; 3]),
        form: GateForm::LowerBound { lower_bound: -5.0 },
        g: g.clone(),
    };
    b.launch(&s, Op::KdaGate(op)).unwrap();
    let got = download_f64(&b, &s, &g);
    assert!(got[1].is_nan() && got[0].is_finite() && got[2].is_finite(), "{got:?}");
    let x = f32_tensor(&b, &s, &[2, 2], &[f32::NAN, 1.0, 3.0, 4.0]);
    let y = b.alloc(DType::F32, &[2, 2]).unwrap();
    b.launch(&s, Op::L2Norm(L2Norm { x, y: y.clone(), scale: 1.0 })).unwrap();
    let got = download_f64(&b, &s, &y);
    assert!(got[0].is_nan() && got[1].is_nan() && (got[2] - 0.6).abs() < 1e-6, "{got:?}");
}

/// A K-first state (flash-linear-attention's `[B, H, K, V]`) can be handed to the ops as the
/// transposed view `[B, H, V, K]` of its buffer: strided state views are read and written in
/// place.
pub fn chunk_reads_and_writes_a_transposed_state_view<B: Backend>(make: &impl Factory<B>) {
    let b = make();
    let s = b.new_stream().unwrap();
    let mut rng = Gen::new(15);
    let seq = Seq::random(&mut rng, (40, 2, 8, 12), (-0.5, 0.0), (0.0, 1.0), true);
    let (h, kd, vd) = (2, 8, 12);
    let kfirst = f32_tensor(&b, &s, &[1, h, kd, vd], seq.initial.as_deref().unwrap_or(&[]));
    let layout =
        Layout::strided(DType::F32, &[1, h, vd, kd], &[h * kd * vd, kd * vd, 1, vd], 0).unwrap();
    let view = Tensor::new(kfirst.buffer().clone(), layout).unwrap();
    let o = run_chunk(&b, &s, &seq, &view, true, DType::F32);
    let (o_ref, s_ref) = seq.oracle();
    check_against(
        "transposed state view",
        &seq,
        CHUNK_SIZE,
        (&o, &download_f64(&b, &s, &kfirst)),
        (&o_ref, &s_ref),
    );
}

/// This module's bodies, each registered for every backend: [`crate::conformance_tests!`] calls
/// this with the backend's factories. A public body missing here fails
/// `conformance::tests::every_body_is_registered`.
#[doc(hidden)]
#[macro_export]
macro_rules! conformance_kda {
    ($plain:expr, $jittered:expr, $checked:expr) => {
        $crate::conformance_tests!(@tests
            kda_conv_prefill_matches_f64 => kda::conv_prefill_matches_f64(&$plain),
            kda_conv_prefill_then_decode_equals_one_prefill => kda::conv_prefill_then_decode_equals_one_prefill(&$plain),
            kda_conv_speculative_update_equals_accepted_decodes => kda::conv_speculative_update_equals_accepted_decodes(&$plain),
            kda_l2norm_matches_f64 => kda::l2norm_matches_f64(&$plain),
            kda_gate_forms_match_f64_at_extremes => kda::gate_forms_match_f64_at_extremes(&$plain),
            kda_gated_rms_norm_matches_f64 => kda::gated_rms_norm_matches_f64(&$plain),
            kda_recurrence_and_chunk_match_f64 => kda::recurrence_and_chunk_match_f64(&$plain),
            kda_chunk_split_equals_one_call => kda::chunk_split_equals_one_call(&$plain),
            kda_chunk_varlen_batch_matches_f64 => kda::chunk_varlen_batch_matches_f64(&$plain),
            kda_chunk_in_kernel_gate_equals_gate_then_chunk => kda::chunk_in_kernel_gate_equals_gate_then_chunk(&$plain),
            kda_recurrent_speculative_reads_and_writes_slots => kda::recurrent_speculative_reads_and_writes_slots(&$plain),
            kda_ops_reject_bad_operands => kda::kda_ops_reject_bad_operands(&$plain),
            kda_nan_inputs_propagate_without_crashing => kda::nan_inputs_propagate_without_crashing(&$plain),
            kda_chunk_reads_and_writes_a_transposed_state_view => kda::chunk_reads_and_writes_a_transposed_state_view(&$plain),
        );
        // Each faults the device on purpose: processes of their own, one per fault case.
        $crate::conformance_tests!(@isolated
            kda_zero_padding_clears_rows => 1 cases: kda::zero_padding_clears_rows(&$plain),
            kda_chunk_boundary_states_match_f64_and_resume => 3 cases: kda::chunk_boundary_states_match_f64_and_resume(&$plain),
            kda_bad_metadata_fails_at_synchronize => 6 cases: kda::kda_bad_metadata_fails_at_synchronize(&$plain),
        );
    };
}
