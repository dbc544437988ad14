//! Every KDA op on small shapes, drawn by proptest: the token counts a decode step, a short
//! prefill and the chunk boundaries produce, `T ∈ {1, 2, 63, 64, 65, 129}`, with
//! `B ∈ {1, 3}`, `H ∈ {1, 3}` and `K, V ∈ {16, 32, 128}`, against the f64 oracles of
//! [`crate::oracle_kda`] under the tolerances the rest of the suite uses.
//!
//! The recurrence runs in both forms, from a given and from a zero initial state, on the cache's
//! v-first layout, on flash-linear-attention's K-first buffer handed over as a transposed view
//! (what `kda core` and `kda.core` do: a decode step on that view once failed instead of taking
//! the copying path) and on a v-first state whose rows lie apart in a wider buffer (a view only
//! the copying path takes); the chunked form on varlen batches that hold a one-token request,
//! and with the gate applied in-kernel. Every `T` is run once on purpose (the corners), then
//! proptest draws the rest from a fixed seed, so a run is reproducible and a failure is shrunk to
//! a small case that names itself.

use std::time::Duration;

use kda_core::kda::{
    CHUNK_SIZE, CausalConv, CausalConvUpdate, ChunkGate, GateForm, GatedRmsNorm, KdaChunk, KdaGate,
    KdaRecurrent, L2Norm, ZeroPadding,
};
use kda_core::{Backend, DType, Device, Layout, Op, Tensor};
use proptest::prelude::*;
use proptest::sample::select;
use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestError, TestRng, TestRunner};

use super::Factory;
use super::gemm::download_f64;
use super::kda::{f32_tensor, f64s, float_tensor, i32_tensor, offsets, swap_last};
use crate::oracle_kda::{
    KdaSequence, causal_conv, gate_lower_bound, gate_softplus, gated_rms_norm, kda_recurrence,
    l2norm, max_abs, recurrence_tolerance,
};
use crate::{Gen, Tolerance};

/// The token counts: a decode step, two tokens, and both sides of one and two chunks.
pub const TOKENS: [usize; 6] = [1, 2, 63, 64, 65, 129];
/// Head dims, `K` and `V` drawn apart.
pub const HEAD_DIMS: [usize; 3] = [16, 32, 128];
/// Cases drawn after the corners, per body and backend: the whole module adds a few seconds
/// per backend to a release run.
const CASES: u32 = 24;
/// How long a body may take before it counts as hung (it takes about a second).
const WATCHDOG: Duration = Duration::from_secs(120);
/// Conv width (the checkpoints' `W`).
const CONV_W: usize = 4;

/// One drawn shape.
#[derive(Clone, Debug)]
pub struct Shape {
    /// Tokens per request of the token-by-token form, and of the chunked form's first request.
    pub tokens: usize,
    pub batch: usize,
    pub heads: usize,
    pub kd: usize,
    pub vd: usize,
    /// The varlen lengths of the chunked form and of the prefill conv: `[tokens]` for one
    /// request; for three, `tokens`, one token and another count of [`TOKENS`], rotated.
    pub lens: Vec<usize>,
    /// Gates near the K3 lower bound (`g ∈ [-5, -4.5]`) rather than slow (`[-0.02, 0]`).
    pub fast_gates: bool,
    pub seed: u64,
}

impl Shape {
    fn new(
        (tokens, batch, heads, kd, vd): (usize, usize, usize, usize, usize),
        (other, rotate): (usize, usize),
        fast_gates: bool,
        seed: u64,
    ) -> Self {
        let lens = if batch == 1 {
            vec![tokens]
        } else {
            let mut lens = vec![tokens, 1, other];
            lens.resize(batch, 1);
            lens.rotate_left(rotate % batch);
            lens
        };
        Self { tokens, batch, heads, kd, vd, lens, fast_gates, seed }
    }

    /// One case per `T`, the other axes spread over them, the largest dims included.
    fn corners() -> Vec<Self> {
        TOKENS
            .iter()
            .enumerate()
            .map(|(i, &t)| {
                let (batch, heads) = ([3, 1][i % 2], [3, 1, 3][i % 3]);
                let (kd, vd) = (HEAD_DIMS[i % 3], HEAD_DIMS[(i + 1) % 3]);
                Self::new((t, batch, heads, kd, vd), (TOKENS[5 - i], i), i % 2 == 1, i as u64)
            })
            .collect()
    }
}

fn shapes() -> impl Strategy<Value = Shape> {
    (
        (
            select(TOKENS.to_vec()),
            select(vec![1usize, 3]),
            select(vec![1usize, 3]),
            select(HEAD_DIMS.to_vec()),
            select(HEAD_DIMS.to_vec()),
        ),
        (select(TOKENS.to_vec()), 0usize..3),
        any::<bool>(),
        any::<u64>(),
    )
        .prop_map(|(dims, varlen, fast, seed)| Shape::new(dims, varlen, fast, seed))
}

/// Run `test` on every corner, then on [`CASES`] shapes drawn from a fixed seed; a failure
/// panics with proptest's smallest failing shape.
fn check_shapes(what: &str, test: impl Fn(&Shape) -> Result<(), TestCaseError>) {
    for shape in Shape::corners() {
        if let Err(e) = test(&shape) {
            panic!("{what}: {}\n  at {shape:?}", message(&e));
        }
    }
    let config = Config {
        cases: CASES,
        failure_persistence: None,
        max_shrink_iters: 64,
        ..Config::default()
    };
    let mut runner =
        TestRunner::new_with_rng(config, TestRng::deterministic_rng(RngAlgorithm::ChaCha));
    match runner.run(&shapes(), |shape| test(&shape)) {
        Ok(()) => {}
        Err(TestError::Fail(reason, shape)) => panic!("{what}: {reason}\n  smallest: {shape:?}"),
        Err(e) => panic!("{what}: {e}"),
    }
}

fn fail(what: String) -> TestCaseError {
    TestCaseError::fail(what)
}

/// A failure's message without proptest's prefix.
fn message(e: &TestCaseError) -> &str {
    match e {
        TestCaseError::Fail(r) | TestCaseError::Reject(r) => r.message(),
    }
}

/// Launch `op` on `s` and download `out` (f32): an error from either (the op failing when it
/// runs, reported by the download's synchronize) is the case's failure, naming the op.
fn launch_and_download<B: Backend>(
    (b, s): (&Device<B>, &B::Stream),
    op: Op<B>,
    out: &Tensor<B>,
) -> Result<Vec<f64>, TestCaseError> {
    let name = op.name();
    b.launch(s, op).map_err(|e| fail(format!("{name}: launch: {e}")))?;
    let got = b.download::<f32>(s, out).map_err(|e| fail(format!("{name}: {e}")))?;
    Ok(got.into_iter().map(f64::from).collect())
}

/// `tol` on `actual` against `expected`, a mismatch as a test-case failure naming `what`.
fn close(
    what: &str,
    tol: Tolerance,
    shape: &[usize],
    actual: &[f64],
    expected: &[f64],
) -> Result<(), TestCaseError> {
    tol.compare(shape, actual, expected).map_err(|e| fail(format!("{what}: {e}")))
}

// ---------------------------------------------------------------------------------------------
// The recurrence

/// One request's operands (`[T, H, K]`, `[T, H, V]`, `[T, H]`) and its K-first initial state.
struct Request {
    tokens: usize,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    g: Vec<f32>,
    beta: Vec<f32>,
    initial: Vec<f32>,
}

/// Requests of `lens` tokens, drawn from `rng`.
fn requests(rng: &mut Gen, shape: &Shape, lens: &[usize]) -> Vec<Request> {
    let (h, kd, vd) = (shape.heads, shape.kd, shape.vd);
    let g = if shape.fast_gates { (-5.0, -4.5) } else { (-0.02, 0.0) };
    lens.iter()
        .map(|&t| Request {
            tokens: t,
            q: rng.uniform_f32(t * h * kd, -1.0, 1.0),
            k: rng.uniform_f32(t * h * kd, -1.0, 1.0),
            v: rng.uniform_f32(t * h * vd, -1.0, 1.0),
            g: rng.uniform_f32(t * h * kd, g.0, g.1),
            beta: rng.uniform_f32(t * h, 0.0, 1.0),
            initial: rng.uniform_f32(h * kd * vd, -1.0, 1.0),
        })
        .collect()
}

/// The f64 recurrence of each request (L2 norm on, scale `K^-0.5`) from its initial state or
/// from zero: outputs `[T, H, V]` and final states `[H, K, V]`.
fn oracles(shape: &Shape, reqs: &[Request], initial: bool) -> Vec<(Vec<f64>, Vec<f64>)> {
    reqs.iter()
        .map(|r| {
            let (q, k, v, g, beta) =
                (f64s(&r.q), f64s(&r.k), f64s(&r.v), f64s(&r.g), f64s(&r.beta));
            let seq = KdaSequence {
                q: &q,
                k: &k,
                v: &v,
                g: &g,
                beta: &beta,
                heads: shape.heads,
                kd: shape.kd,
                vd: shape.vd,
            };
            let init = initial.then(|| f64s(&r.initial));
            kda_recurrence(seq, init.as_deref(), 1.0 / (shape.kd as f64).sqrt(), true)
        })
        .collect()
}

/// How the ops see the state cache.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum StateView {
    /// The cache's own `[N, H, V, K]`, contiguous.
    VFirst,
    /// A K-first `[N, H, K, V]` buffer as the transposed view `[N, H, V, K]`.
    KFirst,
    /// The v-first state inside a wider buffer `[N, H, V, K + PAD]`: each head's rows apart,
    /// a view no kernel can take as one run.
    Padded,
}

/// The columns [`StateView::Padded`] leaves between rows (they must keep their bytes).
const PAD: usize = 3;

/// A state cache of `B + 1` slots, request `r` in slot `B - r` and slot 0 spare, as the op sees
/// it and as its buffer holds it.
struct Cache<B: Backend> {
    view: Tensor<B>,
    buffer: Tensor<B>,
    layout: StateView,
    /// The slots' K-first values before the op.
    before: Vec<f32>,
}

impl<B: Backend> Cache<B> {
    fn new(
        b: &Device<B>,
        s: &B::Stream,
        shape: &Shape,
        layout: StateView,
        kfirst: Vec<f32>,
    ) -> Self {
        let (n, h, kd, vd) = (shape.batch + 1, shape.heads, shape.kd, shape.vd);
        let (buffer, view) = match layout {
            StateView::VFirst => {
                let t = f32_tensor(b, s, &[n, h, vd, kd], &swap_last(&kfirst, n * h, kd, vd));
                (t.clone(), t)
            }
            StateView::KFirst => {
                let t = f32_tensor(b, s, &[n, h, kd, vd], &kfirst);
                let strides = [h * kd * vd, kd * vd, 1, vd];
                let layout = Layout::strided(DType::F32, &[n, h, vd, kd], &strides, 0).unwrap();
                (t.clone(), Tensor::new(t.buffer().clone(), layout).unwrap())
            }
            StateView::Padded => {
                let vfirst = swap_last(&kfirst, n * h, kd, vd);
                let mut padded = vec![-7.0f32; n * h * vd * (kd + PAD)];
                for (row, src) in
                    padded.chunks_exact_mut(kd + PAD).zip(vfirst.chunks_exact(kd.max(1)))
                {
                    row[..kd].copy_from_slice(src);
                }
                let t = f32_tensor(b, s, &[n, h, vd, kd + PAD], &padded);
                (t.clone(), t.narrow(3, 0, kd).unwrap())
            }
        };
        Self { view, buffer, layout, before: kfirst }
    }

    fn slot(&self, r: usize) -> usize {
        self.slots() - 1 - r
    }

    fn slots(&self) -> usize {
        self.view.shape()[0]
    }

    /// Every slot's state after the op, K-first `[N, H, K, V]`.
    fn after(&self, b: &Device<B>, s: &B::Stream) -> Vec<f64> {
        let got = download_f64(b, s, &self.buffer);
        let [n, h, vd, kd] = <[usize; 4]>::try_from(self.view.shape()).unwrap();
        match self.layout {
            StateView::VFirst => swap_last(&got, n * h, vd, kd),
            StateView::KFirst => got,
            StateView::Padded => {
                let rows = got.chunks_exact(kd + PAD);
                assert!(
                    rows.clone().all(|r| r[kd..].iter().all(|&x| x == -7.0)),
                    "the padding between a padded state's rows keeps its bytes"
                );
                let vfirst: Vec<f64> = rows.flat_map(|r| r[..kd].iter().copied()).collect();
                swap_last(&vfirst, n * h, vd, kd)
            }
        }
    }
}

/// The requests' values of one operand, back to back.
fn cat(reqs: &[Request], f: impl Fn(&Request) -> &Vec<f32>) -> Vec<f32> {
    reqs.iter().flat_map(|r| f(r).iter().copied()).collect()
}

/// Outputs and states of one run against the oracle; the spare slot keeps its bytes.
fn check_run<B: Backend>(
    what: &str,
    (b, s): (&Device<B>, &B::Stream),
    shape: &Shape,
    reqs: &[Request],
    (o, cache): (&[f64], &Cache<B>),
    want: &[(Vec<f64>, Vec<f64>)],
    chunk: usize,
) -> Result<(), TestCaseError> {
    let (h, kd, vd) = (shape.heads, shape.kd, shape.vd);
    let per_slot = h * kd * vd;
    let states = cache.after(b, s);
    let mut at = 0;
    for (r, (req, (o_ref, s_ref))) in reqs.iter().zip(want).enumerate() {
        let rows = req.tokens * h * vd;
        let tol = recurrence_tolerance(req.tokens, kd, chunk, max_abs(o_ref));
        close(
            &format!("{what}: request {r} outputs"),
            tol,
            &[req.tokens, h, vd],
            &o[at..at + rows],
            o_ref,
        )?;
        at += rows;
        let slot = cache.slot(r) * per_slot;
        let tol = recurrence_tolerance(req.tokens, kd, chunk, max_abs(s_ref));
        let got = &states[slot..slot + per_slot];
        close(&format!("{what}: request {r} final state"), tol, &[h, kd, vd], got, s_ref)?;
    }
    let spare = &cache.before[..per_slot];
    close(
        &format!("{what}: spare slot"),
        Tolerance::exact(),
        &[per_slot],
        &states[..per_slot],
        &f64s(spare),
    )
}

/// The chunked form over the varlen batch `shape.lens` (with the gate in-kernel from `logits`
/// when given), in one launch.
fn run_chunk<B: Backend>(
    (b, s): (&Device<B>, &B::Stream),
    shape: &Shape,
    reqs: &[Request],
    cache: &Cache<B>,
    initial: bool,
    gate: Option<(Vec<f32>, ChunkGate<B>)>,
) -> Result<Vec<f64>, TestCaseError> {
    let (h, kd, vd) = (shape.heads, shape.kd, shape.vd);
    let total: usize = shape.lens.iter().sum();
    let batch = reqs.len();
    let slots: Vec<i32> = (0..batch).map(|r| cache.slot(r) as i32).collect();
    let o = b.alloc(DType::F32, &[total, h, vd]).unwrap();
    let (g, gate) = match gate {
        Some((logits, gate)) => (f32_tensor(b, s, &[total, h, kd], &logits), Some(gate)),
        None => (f32_tensor(b, s, &[total, h, kd], &cat(reqs, |r| &r.g)), None),
    };
    let op = KdaChunk {
        chunk_state_slots: None,
        host_meta: None,
        q: f32_tensor(b, s, &[total, h, kd], &cat(reqs, |r| &r.q)),
        k: f32_tensor(b, s, &[total, h, kd], &cat(reqs, |r| &r.k)),
        v: f32_tensor(b, s, &[total, h, vd], &cat(reqs, |r| &r.v)),
        g,
        gate,
        beta: f32_tensor(b, s, &[total, h], &cat(reqs, |r| &r.beta)),
        cu_seqlens: i32_tensor(b, s, &[batch + 1], &offsets(&shape.lens)),
        state_slots: i32_tensor(b, s, &[batch], &slots),
        has_initial_state: i32_tensor(b, s, &[batch], &vec![i32::from(initial); batch]),
        state: cache.view.clone(),
        o: o.clone(),
        scale: 1.0 / (kd as f32).sqrt(),
        qk_l2norm: true,
    };
    launch_and_download((b, s), Op::KdaChunk(op), &o)
}

/// The token-by-token form: `B` requests of `T` tokens, each starting from and ending in its
/// slot (as `kda core` runs it; with `accepted`, the initial state is read at the last token).
fn run_recurrent<B: Backend>(
    (b, s): (&Device<B>, &B::Stream),
    shape: &Shape,
    reqs: &[Request],
    cache: &Cache<B>,
    accepted: bool,
) -> Result<Vec<f64>, TestCaseError> {
    let (t, h, kd, vd) = (shape.tokens, shape.heads, shape.kd, shape.vd);
    let batch = reqs.len();
    let mut slots = vec![-1i32; batch * t];
    for r in 0..batch {
        // Without `accepted` the initial state is read at token 0: only a decode step (T = 1)
        // starts and ends in the same slot that way.
        slots[r * t + t - 1] = cache.slot(r) as i32;
    }
    let o = b.alloc(DType::F32, &[batch, t, h, vd]).unwrap();
    let op = KdaRecurrent {
        q: f32_tensor(b, s, &[batch, t, h, kd], &cat(reqs, |r| &r.q)),
        k: f32_tensor(b, s, &[batch, t, h, kd], &cat(reqs, |r| &r.k)),
        v: f32_tensor(b, s, &[batch, t, h, vd], &cat(reqs, |r| &r.v)),
        g: f32_tensor(b, s, &[batch, t, h, kd], &cat(reqs, |r| &r.g)),
        beta: f32_tensor(b, s, &[batch, t, h], &cat(reqs, |r| &r.beta)),
        state_slots: i32_tensor(b, s, &[batch, t], &slots),
        num_accepted_tokens: accepted.then(|| i32_tensor(b, s, &[batch], &vec![t as i32; batch])),
        state: cache.view.clone(),
        o: o.clone(),
        scale: 1.0 / (kd as f32).sqrt(),
        qk_l2norm: true,
    };
    launch_and_download((b, s), Op::KdaRecurrent(op), &o)
}

/// The cache's K-first values: each request's initial state in its slot when `initial`; else
/// zeros for the token-by-token form (which always reads the slot) and noise for the chunked
/// form (which must not read it).
fn cache_values(
    shape: &Shape,
    reqs: &[Request],
    initial: bool,
    chunk: bool,
    rng: &mut Gen,
) -> Vec<f32> {
    let per_slot = shape.heads * shape.kd * shape.vd;
    let n = shape.batch + 1;
    let mut values = rng.uniform_f32(n * per_slot, -1.0, 1.0);
    for (r, req) in reqs.iter().enumerate() {
        let slot = (n - 1 - r) * per_slot;
        let dst = &mut values[slot..slot + per_slot];
        match (initial, chunk) {
            (true, _) => dst.copy_from_slice(&req.initial),
            (false, false) => dst.fill(0.0),
            (false, true) => {}
        }
    }
    values
}

/// `KdaChunk` and `KdaRecurrent` on every drawn shape against the f64 recurrence: both forms,
/// from a given and from a zero state, on the v-first cache, a transposed K-first view and a
/// padded one (each request's slot written, a spare slot and the padding untouched); the chunked
/// form on a varlen batch with a one-token request, and with the gate applied in-kernel; the
/// token-by-token form with and without `num_accepted_tokens` where both mean the same.
///
/// Under a watchdog: a failing op must be reported, never wait forever (a decode step that failed
/// on the emulated Ascend runtime once left its `synchronize` waiting).
pub fn recurrence_on_small_shapes_matches_f64<B: Backend>(make: &impl Factory<B>) {
    let make = make.clone();
    super::with_watchdog("kda_props recurrence", WATCHDOG, move || recurrence_bodies(&make));
}

fn recurrence_bodies<B: Backend>(make: &impl Factory<B>) {
    let b = make();
    let s = b.new_stream().unwrap();
    let dev = (&b, &s);
    check_shapes("kda recurrence", |shape| {
        let mut rng = Gen::new(shape.seed);
        let chunk_reqs = requests(&mut rng, shape, &shape.lens);
        let rec_reqs = requests(&mut rng, shape, &vec![shape.tokens; shape.batch]);
        for initial in [true, false] {
            let (chunk_want, rec_want) =
                (oracles(shape, &chunk_reqs, initial), oracles(shape, &rec_reqs, initial));
            for layout in [StateView::VFirst, StateView::KFirst, StateView::Padded] {
                let what =
                    |algo: &str| format!("{algo}, initial state {initial}, {layout:?} state");
                let values = cache_values(shape, &chunk_reqs, initial, true, &mut rng);
                let cache = Cache::new(&b, &s, shape, layout, values);
                let o = run_chunk(dev, shape, &chunk_reqs, &cache, initial, None)
                    .map_err(|e| fail(format!("{}: {}", what("chunk"), message(&e))))?;
                check_run(
                    &what("chunk"),
                    dev,
                    shape,
                    &chunk_reqs,
                    (&o, &cache),
                    &chunk_want,
                    CHUNK_SIZE,
                )?;

                for accepted in [true, false] {
                    if !accepted && shape.tokens > 1 {
                        continue;
                    }
                    let values = cache_values(shape, &rec_reqs, initial, false, &mut rng);
                    let cache = Cache::new(&b, &s, shape, layout, values);
                    let algo = format!("recurrent (num_accepted_tokens given: {accepted})");
                    let o = run_recurrent(dev, shape, &rec_reqs, &cache, accepted)
                        .map_err(|e| fail(format!("{}: {}", what(&algo), message(&e))))?;
                    check_run(&what(&algo), dev, shape, &rec_reqs, (&o, &cache), &rec_want, 0)?;
                }
            }
        }
        chunk_with_gate_in_kernel(dev, shape, &mut rng)
    });
}

/// The chunked form with the gate applied in-kernel (K3's lower-bound form from raw logits)
/// against the f64 recurrence on the gate `KdaGate` computes from the same logits.
fn chunk_with_gate_in_kernel<B: Backend>(
    (b, s): (&Device<B>, &B::Stream),
    shape: &Shape,
    rng: &mut Gen,
) -> Result<(), TestCaseError> {
    let (h, kd) = (shape.heads, shape.kd);
    let total: usize = shape.lens.iter().sum();
    let mut reqs = requests(rng, shape, &shape.lens);
    let logits = rng.uniform_f32(total * h * kd, -3.0, 1.0);
    let (a_log, dt_bias) = (rng.uniform_f32(h, -1.0, 0.5), rng.uniform_f32(h * kd, -1.0, 0.0));
    let form = GateForm::LowerBound { lower_bound: -5.0 };
    let params = || ChunkGate {
        a_log: f32_tensor(b, s, &[h], &a_log),
        dt_bias: f32_tensor(b, s, &[h, kd], &dt_bias),
        form,
    };
    let g = b.alloc(DType::F32, &[total, h, kd]).unwrap();
    let gate = params();
    let op = KdaGate {
        g1: f32_tensor(b, s, &[total, h, kd], &logits),
        a_log: gate.a_log,
        dt_bias: gate.dt_bias,
        form,
        g: g.clone(),
    };
    b.launch(s, Op::KdaGate(op)).unwrap();
    let g: Vec<f32> = download_f64(b, s, &g).into_iter().map(|x| x as f32).collect();
    let mut at = 0;
    for r in &mut reqs {
        let n = r.tokens * h * kd;
        r.g = g[at..at + n].to_vec();
        at += n;
    }
    let want = oracles(shape, &reqs, true);
    let values = cache_values(shape, &reqs, true, true, rng);
    let cache = Cache::new(b, s, shape, StateView::VFirst, values);
    let o = run_chunk((b, s), shape, &reqs, &cache, true, Some((logits, params())))?;
    check_run("chunk, gate in-kernel", (b, s), shape, &reqs, (&o, &cache), &want, CHUNK_SIZE)
}

// ---------------------------------------------------------------------------------------------
// The other ops

/// The conv (varlen prefill with a one-token request, fresh and continued histories; a decode
/// update of every request), the L2 norm, both gate forms, the gated RMSNorm and the padding
/// mask on every drawn shape (rows `Σ lens × H`, widths `K` and `V`, conv channels `H·K`)
/// against their f64 oracles.
pub fn pointwise_ops_on_small_shapes_match_f64<B: Backend>(make: &impl Factory<B>) {
    let make = make.clone();
    super::with_watchdog("kda_props ops", WATCHDOG, move || pointwise_bodies(&make));
}

fn pointwise_bodies<B: Backend>(make: &impl Factory<B>) {
    let b = make();
    let s = b.new_stream().unwrap();
    let dev = (&b, &s);
    check_shapes("kda ops", |shape| {
        let mut rng = Gen::new(shape.seed);
        conv_prefill(dev, shape, &mut rng)?;
        conv_decode(dev, shape, &mut rng)?;
        norm_gate_mask(dev, shape, &mut rng)
    });
}

/// The expected outputs of a conv over `x` (`[T, C]`) after `history` (`W - 1` rows), and the
/// history it leaves (the last `W - 1` rows of both).
fn conv_oracle(history: &[f64], x: &[f64], w: &[f64], c: usize) -> (Vec<f64>, Vec<f64>) {
    let hist = (CONV_W - 1) * c;
    let y = causal_conv(history, x, w, c, CONV_W);
    let all: Vec<f64> = history.iter().chain(x).copied().collect();
    (y, all[all.len() - hist..].to_vec())
}

fn conv_prefill<B: Backend>(
    (b, s): (&Device<B>, &B::Stream),
    shape: &Shape,
    rng: &mut Gen,
) -> Result<(), TestCaseError> {
    let (c, w, lens) = (shape.heads * shape.kd, CONV_W, &shape.lens);
    let (batch, n_slots, hist) = (lens.len(), lens.len() + 1, (CONV_W - 1) * c);
    let tokens: usize = lens.iter().sum();
    let xv = rng.uniform_f32(tokens * c, -2.0, 2.0);
    let wv = rng.uniform_f32(c * w, -0.7, 0.7);
    let state0 = rng.uniform_f32(n_slots * hist, -1.0, 1.0);
    let slots: Vec<i32> = (0..batch).map(|r| (batch - r) as i32).collect();
    let has_initial: Vec<i32> =
        (0..batch).map(|r| i32::from((shape.seed as usize + r).is_multiple_of(2))).collect();
    let state = f32_tensor(b, s, &[n_slots, w - 1, c], &state0);
    let y = b.alloc(DType::F32, &[tokens, c]).unwrap();
    let op = CausalConv {
        x: f32_tensor(b, s, &[tokens, c], &xv),
        weight: f32_tensor(b, s, &[c, w], &wv),
        query_start_loc: i32_tensor(b, s, &[batch + 1], &offsets(lens)),
        state_slots: i32_tensor(b, s, &[batch], &slots),
        has_initial_state: i32_tensor(b, s, &[batch], &has_initial),
        state: state.clone(),
        y: y.clone(),
    };
    b.launch(s, Op::CausalConv(op)).unwrap();
    let (got_y, got_state) = (download_f64(b, s, &y), download_f64(b, s, &state));
    let (mut want_y, mut want_state) = (Vec::with_capacity(tokens * c), f64s(&state0));
    let starts = offsets(lens);
    for r in 0..batch {
        let base = slots[r] as usize * hist;
        let history =
            if has_initial[r] != 0 { f64s(&state0[base..base + hist]) } else { vec![0.0; hist] };
        let x = f64s(&xv[starts[r] as usize * c..starts[r + 1] as usize * c]);
        let (yr, kept) = conv_oracle(&history, &x, &f64s(&wv), c);
        want_y.extend(yr);
        want_state[base..base + hist].copy_from_slice(&kept);
    }
    let tol = Tolerance::for_dtype(DType::F32);
    close("causal_conv outputs", tol, &[tokens, c], &got_y, &want_y)?;
    close("causal_conv state", Tolerance::exact(), &[n_slots, w - 1, c], &got_state, &want_state)
}

fn conv_decode<B: Backend>(
    (b, s): (&Device<B>, &B::Stream),
    shape: &Shape,
    rng: &mut Gen,
) -> Result<(), TestCaseError> {
    let (c, w, batch) = (shape.heads * shape.kd, CONV_W, shape.batch);
    let (n_slots, hist) = (batch + 1, (CONV_W - 1) * c);
    let xv = rng.uniform_f32(batch * c, -2.0, 2.0);
    let wv = rng.uniform_f32(c * w, -0.7, 0.7);
    let state0 = rng.uniform_f32(n_slots * hist, -1.0, 1.0);
    let slots: Vec<i32> = (0..batch).map(|r| (batch - r) as i32).collect();
    let state = f32_tensor(b, s, &[n_slots, w - 1, c], &state0);
    let y = b.alloc(DType::F32, &[batch, 1, c]).unwrap();
    let op = CausalConvUpdate {
        x: f32_tensor(b, s, &[batch, 1, c], &xv),
        weight: f32_tensor(b, s, &[c, w], &wv),
        state_slots: i32_tensor(b, s, &[batch], &slots),
        num_accepted_tokens: None,
        state: state.clone(),
        y: y.clone(),
    };
    b.launch(s, Op::CausalConvUpdate(op)).unwrap();
    let (got_y, got_state) = (download_f64(b, s, &y), download_f64(b, s, &state));
    let (mut want_y, mut want_state) = (Vec::with_capacity(batch * c), f64s(&state0));
    for r in 0..batch {
        let base = slots[r] as usize * hist;
        let x = f64s(&xv[r * c..(r + 1) * c]);
        let (yr, kept) = conv_oracle(&f64s(&state0[base..base + hist]), &x, &f64s(&wv), c);
        want_y.extend(yr);
        want_state[base..base + hist].copy_from_slice(&kept);
    }
    let tol = Tolerance::for_dtype(DType::F32);
    close("causal_conv_update outputs", tol, &[batch, c], &got_y, &want_y)?;
    close(
        "causal_conv_update state",
        Tolerance::exact(),
        &[n_slots, w - 1, c],
        &got_state,
        &want_state,
    )
}

fn norm_gate_mask<B: Backend>(
    (b, s): (&Device<B>, &B::Stream),
    shape: &Shape,
    rng: &mut Gen,
) -> Result<(), TestCaseError> {
    let (h, kd, vd) = (shape.heads, shape.kd, shape.vd);
    let t: usize = shape.lens.iter().sum();
    let rows = t * h;
    // The output dtype alternates with the seed: f32 or bf16.
    let dtype = if shape.seed.is_multiple_of(2) { DType::F32 } else { DType::BF16 };

    let xv = rng.uniform_f32(rows * kd, -3.0, 3.0);
    let scale = 1.0 / (kd as f32).sqrt();
    let y = b.alloc(dtype, &[t, h, kd]).unwrap();
    let x = f32_tensor(b, s, &[t, h, kd], &xv);
    b.launch(s, Op::L2Norm(L2Norm { x, y: y.clone(), scale })).unwrap();
    let want = l2norm(&f64s(&xv), kd, f64::from(scale));
    close("l2norm", Tolerance::for_dtype(dtype), &[rows, kd], &download_f64(b, s, &y), &want)?;

    let logits = rng.uniform_f32(rows * kd, -25.0, 25.0);
    let (a_log, dt_bias) = (rng.uniform_f32(h, -1.0, 1.5), rng.uniform_f32(h * kd, -1.0, 1.0));
    for form in [GateForm::Softplus, GateForm::LowerBound { lower_bound: -5.0 }] {
        let g = b.alloc(DType::F32, &[t, h, kd]).unwrap();
        let op = KdaGate {
            g1: f32_tensor(b, s, &[t, h, kd], &logits),
            a_log: f32_tensor(b, s, &[h], &a_log),
            dt_bias: f32_tensor(b, s, &[h, kd], &dt_bias),
            form,
            g: g.clone(),
        };
        b.launch(s, Op::KdaGate(op)).unwrap();
        let want: Vec<f64> = logits
            .iter()
            .enumerate()
            .map(|(i, &x)| {
                let a = f64::from(x) + f64::from(dt_bias[i % (h * kd)]);
                let al = f64::from(a_log[(i / kd) % h]);
                match form {
                    GateForm::Softplus => gate_softplus(al, a),
                    GateForm::LowerBound { lower_bound } => {
                        gate_lower_bound(f64::from(lower_bound), al, a)
                    }
                }
            })
            .collect();
        let got = download_f64(b, s, &g);
        close(
            &format!("kda_gate {form}"),
            Tolerance::for_dtype(DType::F32),
            &[t, h, kd],
            &got,
            &want,
        )?;
        if got.iter().any(|&v| v > 0.0) {
            return Err(fail(format!("kda_gate {form}: a positive log decay")));
        }
    }

    let (xv, gv) = (rng.uniform_f32(rows * vd, -2.0, 2.0), rng.uniform_f32(rows * vd, -40.0, 40.0));
    let wv = rng.uniform_f32(vd, 0.5, 1.5);
    let (x, xr) = float_tensor(b, s, dtype, &[t, h, vd], &xv);
    let (gate, gr) = float_tensor(b, s, dtype, &[t, h, vd], &gv);
    let y = b.alloc(dtype, &[t, h, vd]).unwrap();
    let weight = f32_tensor(b, s, &[vd], &wv);
    b.launch(s, Op::GatedRmsNorm(GatedRmsNorm { x, gate, weight, y: y.clone(), eps: 1e-5 }))
        .unwrap();
    let want = gated_rms_norm(&f64s(&xr), &f64s(&gr), &f64s(&wv), 1e-5, vd);
    let got = download_f64(b, s, &y);
    close("gated_rms_norm", Tolerance::for_dtype(dtype), &[t, h, vd], &got, &want)?;

    // The live rows: the first request's, as a padded decode batch keeps.
    let live = shape.lens[0];
    let (x, held) = float_tensor(b, s, dtype, &[t, h, vd], &xv);
    let count = i32_tensor(b, s, &[1], &[live as i32]);
    b.launch(s, Op::ZeroPadding(ZeroPadding { x: x.clone(), num_actual_tokens: count })).unwrap();
    let mut want = f64s(&held);
    want[live * h * vd..].fill(0.0);
    close("zero_padding", Tolerance::exact(), &[t, h, vd], &download_f64(b, s, &x), &want)
}

/// This module's bodies, each registered for every backend: [`crate::conformance_tests!`] calls
/// this with the backend's factories. A public body missing here fails
/// `conformance::tests::every_body_is_registered`.
#[doc(hidden)]
#[macro_export]
macro_rules! conformance_kda_props {
    ($plain:expr, $jittered:expr, $checked:expr) => {
        $crate::conformance_tests!(@tests
            kda_props_recurrence_on_small_shapes_matches_f64 => kda_props::recurrence_on_small_shapes_matches_f64(&$plain),
            kda_props_pointwise_ops_on_small_shapes_match_f64 => kda_props::pointwise_ops_on_small_shapes_match_f64(&$plain),
        );
    };
}
