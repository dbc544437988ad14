//! The whole KDA layer (`docs/design/kda.md#batches-and-dispatch`) on any backend: against the f64
//! layer oracle over mixed continuous batches, the identities an engine relies on (split prefills,
//! prefill then decodes, speculative steps, batches versus single requests, TP partial sums),
//! behaviours 1, 2, 3, 4, 7, 8, 11 (`docs/design/kda.md#behaviours`; the raw gate into the chunk
//! kernel, the v-first state back to the slot) and 12, the overlapped forward under the
//! sanitizer, as a captured graph and under jitter, and bad input that must leave the cache
//! alone.
//!
//! Weights come from tiny synthetic checkpoints shaped like the two real models: K3 (MXFP8 QKV,
//! lower-bound gate, full-rank output gate) and Kimi Linear (bf16 QKV, softplus gate, low-rank
//! output gate), with `H = 8` heads of `D = 8` and hidden 48 (one partial MX block).

use half::bf16;
use kda_core::kda::{CausalConv, KdaChunk, KdaGate};
use kda_core::sanitize::{Access, ByteRanges, Entry};
use kda_core::{Backend, BufferHandle, DType, Device, Error, Op, Tensor};
use kda_model::config::{KdaConfig, Tp};
use kda_model::layer::{
    BatchError, BatchMeta, BetaInput, CoreOperands, ForgetProjection, KdaLayer, KeepError,
    KeepState, LayerError, LayerOptions, QkvPath, RequestSlots, StateCache,
};
use kda_model::schedule::beta::BETA_SIGMOID;
use kda_model::schedule::{MatrixOverlap, ProjectionSchedule};
use kda_model::weights::{BfgMode, LayerWeights, LoadOptions, load_layer};

use super::Factory;
use super::gemm::download_f64;
use crate::checkpoint::{SyntheticCheckpoint, SyntheticSpec, scaled_config};
use crate::oracle_kda::max_abs;
use crate::oracle_layer::{LayerOracle, RequestState};
use crate::{Gen, Tolerance};

const HIDDEN: usize = 48;
const HEADS: usize = 8;
const HEAD_DIM: usize = 8;

/// Which real model the tiny checkpoint is shaped like.
#[derive(Copy, Clone, Debug, PartialEq)]
pub enum Model {
    K3,
    KimiLinear,
}

/// The tiny config of `model`. The output norm's epsilon is the checkpoint's own and large
/// enough to matter (`docs/design/kda.md#behaviour-3`: a layer that used a default would miss the
/// oracle).
pub fn tiny_config(model: Model) -> KdaConfig {
    let preset = match model {
        Model::K3 => KdaConfig::kimi_k3(),
        Model::KimiLinear => KdaConfig::kimi_linear_48b(),
    };
    let mut c = scaled_config(&preset, HIDDEN, HEADS, HEAD_DIM);
    c.rms_norm_eps = 1e-2;
    c
}

/// Rank `tp` of layer 0 of the synthetic checkpoint of `config`.
pub fn load(config: &KdaConfig, tp: Tp, seed: u64) -> LayerWeights {
    let source = SyntheticCheckpoint::new(SyntheticSpec::new(config.clone(), seed));
    load_layer(&source, config, tp, 0, LoadOptions::default()).unwrap().weights
}

fn layer<B: Backend>(
    b: &Device<B>,
    s: &B::Stream,
    w: &LayerWeights,
    options: LayerOptions,
) -> KdaLayer<B> {
    let layer = KdaLayer::new(b, s, w, options).unwrap();
    b.synchronize(s).unwrap();
    layer
}

fn bf16_tensor<B: Backend>(b: &Device<B>, s: &B::Stream, shape: &[usize], v: &[f32]) -> Tensor<B> {
    let t = b.alloc(DType::BF16, shape).unwrap();
    let data: Vec<bf16> = v.iter().map(|&x| bf16::from_f32(x)).collect();
    b.upload(s, &t, &data).unwrap();
    t
}

/// `rows` tokens of activations ~N(0, 1), rounded to bf16 (the values the layer sees).
fn tokens(rng: &mut Gen, rows: usize) -> Vec<f32> {
    rng.normal_f32(rows * HIDDEN, 0.0, 1.0)
        .into_iter()
        .map(|x| bf16::from_f32(x).to_f32())
        .collect()
}

/// An output buffer `[rows, Hd]` f32 holding `fill`.
fn out_buffer<B: Backend>(b: &Device<B>, s: &B::Stream, rows: usize, fill: f64) -> Tensor<B> {
    let t = b.alloc(DType::F32, &[rows, HIDDEN]).unwrap();
    b.launch(s, Op::Fill { dst: t.clone(), value: fill }).unwrap();
    t
}

/// Run `meta` on the activation rows `x` (plus `pad` padding rows of `pad_value`) into a fresh
/// output prefilled with `out_fill`; returns every output row.
#[allow(clippy::too_many_arguments)]
fn step<B: Backend>(
    b: &Device<B>,
    s: &B::Stream,
    layer: &KdaLayer<B>,
    cache: &mut StateCache<B>,
    meta: &BatchMeta,
    x: &[f32],
    pad: usize,
    pad_value: f32,
    out_fill: f64,
) -> Vec<f64> {
    let rows = x.len() / HIDDEN + pad;
    let mut all = x.to_vec();
    all.extend(std::iter::repeat_n(pad_value, pad * HIDDEN));
    let xt = bf16_tensor(b, s, &[rows, HIDDEN], &all);
    let mut out = out_buffer(b, s, rows, out_fill);
    layer.forward(s, &xt, meta, cache, &mut out).unwrap();
    download_f64(b, s, &out)
}

/// The recurrent state of `slot`, v-first `[lh, V, K]`.
fn slot_state<B: Backend>(
    b: &Device<B>,
    s: &B::Stream,
    cache: &StateCache<B>,
    slot: usize,
) -> Vec<f64> {
    download_f64(b, s, &cache.recurrent_slot(slot).unwrap())
}

/// Everything in the cache, bit for bit.
fn cache_bits<B: Backend>(
    b: &Device<B>,
    s: &B::Stream,
    cache: &StateCache<B>,
) -> (Vec<u32>, Vec<u32>) {
    let bits = |t: &Tensor<B>| -> Vec<u32> {
        b.download::<f32>(s, t).unwrap().into_iter().map(f32::to_bits).collect()
    };
    (bits(cache.recurrent()), bits(cache.conv()))
}

/// Outputs and states against the oracle: [`Tolerance::layer`].
fn layer_tolerance(expected: &[f64]) -> Tolerance {
    Tolerance::layer(max_abs(expected))
}

/// The oracle of what `layer` runs: its core operands and its QKV precision may be the backend's
/// choice (`CoreOperands`, `QkvPath`: bf16 QKV where the backend has no native MX ops).
fn oracle_of<B: Backend>(
    layer: &KdaLayer<B>,
    weights: &LayerWeights,
    forget: ForgetProjection,
) -> LayerOracle {
    let mut oracle = LayerOracle::new(weights, forget);
    if layer.core_operands() == CoreOperands::Bf16 {
        oracle = oracle.with_bf16_core_operands();
    }
    if layer.qkv_path() == QkvPath::Bf16 {
        oracle = oracle.with_bf16_qkv();
    }
    oracle
}

/// Identities between two device runs whose projections may round differently (GEMMs of
/// another M), checked with the same allowance.
fn assert_close(what: &str, shape: &[usize], actual: &[f64], expected: &[f64]) {
    if let Err(m) = layer_tolerance(expected).compare(shape, actual, expected) {
        panic!("{what}: {m}");
    }
}

fn rows(x: &[f32], r: std::ops::Range<usize>) -> &[f32] {
    &x[r.start * HIDDEN..r.end * HIDDEN]
}

/// A mixed batch on the given layer options against the oracle, over two steps: fresh prefills
/// (one crossing a 64-token chunk), then decodes, a speculative decode, a continued prefill and
/// a fresh one, in interleaved order with padding rows of NaN and an output holding NaN. Checks
/// every output row, every touched state (v-first), untouched slots, and the padding.
fn matches_oracle<B: Backend>(make: &impl Factory<B>, model: Model, options: LayerOptions) {
    let b = make();
    let s = b.new_stream().unwrap();
    let config = tiny_config(model);
    let w = load(&config, Tp::SINGLE, 11);
    let layer = layer(&b, &s, &w, options);
    let oracle = oracle_of(&layer, &w, options.forget);
    let mut cache = layer.new_cache(&s, 12, 2).unwrap();
    let mut rng = Gen::new(5);
    let mut tracked: Vec<RequestState> = (0..3).map(|_| oracle.fresh()).collect();

    // Step 1: fresh prefills of 5, 67 and 3 tokens into slots 2, 5 and 0.
    let lens = [5, 67, 3];
    let slots = [2, 5, 0];
    let x1 = tokens(&mut rng, 75);
    let meta = BatchMeta::prefills(&lens, &slots);
    let out = step(&b, &s, &layer, &mut cache, &meta, &x1, 2, f32::NAN, f64::NAN);
    let mut at = 0;
    for (r, &len) in lens.iter().enumerate() {
        let (want, next) = oracle.run(rows(&x1, at..at + len), &tracked[r]);
        let got = &out[at * HIDDEN..(at + len) * HIDDEN];
        if let Err(m) = layer_tolerance(&want).compare(&[len, HIDDEN], got, &want) {
            panic!("{model:?} {options:?} step 1 request {r}: {m}");
        }
        tracked[r] = next;
        at += len;
    }
    assert!(out[75 * HIDDEN..].iter().all(|&v| v == 0.0), "padding rows are zero");

    // Step 2, in this order: request 1 decodes (1 token), a fresh request of 4 tokens into
    // slot 7, request 2 speculates (3 tokens, slots [0, 9, 10], the previous step's state in
    // slots[0]), request 0 continues its prefill (6 tokens).
    let x2 = tokens(&mut rng, 14);
    let mut meta = BatchMeta::empty();
    meta.push(1, 67, RequestSlots::Single(5))
        .push(4, 0, RequestSlots::Single(7))
        .push(3, 3, RequestSlots::Speculative { slots: vec![0, 9, 10], num_accepted: 1 })
        .push(6, 5, RequestSlots::Single(2));
    assert_eq!(meta.num_actual_tokens, 1 + 4 + 3 + 6, "behaviour 2: spec + non-spec tokens");
    let (before_1, before_3) = (slot_state(&b, &s, &cache, 1), slot_state(&b, &s, &cache, 3));
    let out = step(&b, &s, &layer, &mut cache, &meta, &x2, 3, f32::NAN, f64::NAN);
    let check = |what: &str, got: &[f64], want: &[f64], shape: &[usize]| {
        if let Err(m) = layer_tolerance(want).compare(shape, got, want) {
            panic!("{model:?} {options:?} step 2 {what}: {m}");
        }
    };
    let out_rows = |r: std::ops::Range<usize>| &out[r.start * HIDDEN..r.end * HIDDEN];
    let state_shape = [HEADS, HEAD_DIM, HEAD_DIM];
    let v_first = |st: &RequestState| st.v_first(HEADS, HEAD_DIM);

    let (want, st) = oracle.run(rows(&x2, 0..1), &tracked[1]);
    check("decode output", out_rows(0..1), &want, &[1, HIDDEN]);
    check("decode state", &slot_state(&b, &s, &cache, 5), &v_first(&st), &state_shape);

    let (want, st) = oracle.run(rows(&x2, 1..5), &oracle.fresh());
    check("fresh prefill output", out_rows(1..5), &want, &[4, HIDDEN]);
    check("fresh prefill state", &slot_state(&b, &s, &cache, 7), &v_first(&st), &state_shape);

    // Every speculative token's output, and the state after token t in slots[t].
    let mut st = tracked[2].clone();
    for (t, slot) in [0usize, 9, 10].into_iter().enumerate() {
        let (want, next) = oracle.run(rows(&x2, 5 + t..6 + t), &st);
        check("speculative output", out_rows(5 + t..6 + t), &want, &[1, HIDDEN]);
        check(
            "speculative state",
            &slot_state(&b, &s, &cache, slot),
            &v_first(&next),
            &state_shape,
        );
        st = next;
    }

    let (want, st) = oracle.run(rows(&x2, 8..14), &tracked[0]);
    check("continued prefill output", out_rows(8..14), &want, &[6, HIDDEN]);
    check(
        "continued prefill state (behaviour 11: v-first)",
        &slot_state(&b, &s, &cache, 2),
        &v_first(&st),
        &state_shape,
    );

    assert!(out[14 * HIDDEN..].iter().all(|&v| v == 0.0), "behaviour 1: padding rows are zero");
    assert_eq!(slot_state(&b, &s, &cache, 1), before_1, "slot 1 is in no batch");
    assert_eq!(slot_state(&b, &s, &cache, 3), before_3, "slot 3 is in no batch");
    assert!(before_1.iter().all(|&v| v == 0.0));
}

/// Both models, both schedules and policies, staged and composed F, raw and preprocessed beta.
pub fn matches_f64_oracle<B: Backend>(make: &impl Factory<B>) {
    let defaults = LayerOptions::default();
    for model in [Model::K3, Model::KimiLinear] {
        matches_oracle(
            make,
            model,
            LayerOptions { schedule: Some(ProjectionSchedule::Serial), ..defaults },
        );
    }
    for policy in [MatrixOverlap::Serialized, MatrixOverlap::Concurrent] {
        let options = LayerOptions {
            schedule: Some(ProjectionSchedule::Overlapped),
            matrix_overlap: Some(policy),
            ..defaults
        };
        matches_oracle(make, Model::K3, options);
    }
    matches_oracle(
        make,
        Model::KimiLinear,
        LayerOptions { forget: ForgetProjection::Staged, ..defaults },
    );
    matches_oracle(make, Model::K3, LayerOptions { beta: BetaInput::Raw, ..defaults });
    // Both core operand dtypes, whichever the backend takes by default.
    for operands in [CoreOperands::F32, CoreOperands::Bf16] {
        matches_oracle(make, Model::K3, LayerOptions { core_operands: Some(operands), ..defaults });
    }
}

/// Staged F from a loader in staged mode (where a low-rank G, Kimi Linear's, stays as factors
/// and is composed at upload) gives the bits of staged F from a composed-mode loader.
pub fn staged_loader_equals_composed_loader<B: Backend>(make: &impl Factory<B>) {
    let b = make();
    let s = b.new_stream().unwrap();
    let config = tiny_config(Model::KimiLinear);
    let source = SyntheticCheckpoint::new(SyntheticSpec::new(config.clone(), 13));
    let staged_options = LoadOptions { bfg_mode: BfgMode::Staged, ..LoadOptions::default() };
    let from_staged = load_layer(&source, &config, Tp::SINGLE, 0, staged_options).unwrap().weights;
    let from_composed = load(&config, Tp::SINGLE, 13);
    let options = LayerOptions { forget: ForgetProjection::Staged, ..LayerOptions::default() };
    let x = tokens(&mut Gen::new(13), 5);
    let meta = BatchMeta::prefills(&[5], &[0]);
    let outs: Vec<Vec<u64>> = [&from_staged, &from_composed]
        .into_iter()
        .map(|w| {
            let l = layer(&b, &s, w, options);
            let mut cache = l.new_cache(&s, 1, 0).unwrap();
            let out = step(&b, &s, &l, &mut cache, &meta, &x, 0, 0.0, 0.0);
            out.iter().map(|v| v.to_bits()).collect()
        })
        .collect();
    assert_eq!(outs[0], outs[1]);
    assert!(
        KdaLayer::new(&b, &s, &from_staged, LayerOptions::default()).is_err(),
        "a staged loader has no composed F to upload"
    );
}

/// Behaviour 3 (`docs/design/kda.md#behaviour-3`): the norm's epsilon is the checkpoint's. The
/// oracle with a default epsilon (1e-5) instead of the checkpoint's (1e-2) disagrees with the
/// layer, so the oracle test above would catch a layer that ignored the checkpoint.
pub fn norm_uses_the_checkpoint_eps<B: Backend>(make: &impl Factory<B>) {
    let b = make();
    let s = b.new_stream().unwrap();
    let config = tiny_config(Model::K3);
    let w = load(&config, Tp::SINGLE, 3);
    let layer = layer(&b, &s, &w, LayerOptions::default());
    let mut cache = layer.new_cache(&s, 1, 0).unwrap();
    let x = tokens(&mut Gen::new(9), 4);
    let out = step(&b, &s, &layer, &mut cache, &BatchMeta::prefills(&[4], &[0]), &x, 0, 0.0, 0.0);
    let oracle = oracle_of(&layer, &w, ForgetProjection::Composed);
    let (want, _) = oracle.run(&x, &oracle.fresh());
    layer_tolerance(&want).assert_close(&[4, HIDDEN], &out, &want);
    let mut default_eps = w.clone();
    default_eps.rms_norm_eps = 1e-5;
    let other = oracle_of(&layer, &default_eps, ForgetProjection::Composed);
    let (wrong, _) = other.run(&x, &other.fresh());
    assert!(
        layer_tolerance(&wrong).compare(&[4, HIDDEN], &out, &wrong).is_err(),
        "the epsilon must make a visible difference for this test to mean anything"
    );
}

/// A 20-token sequence: one prefill; a 12-token prefill then 8 single-token decodes; and two
/// prefill chunks (12 + 8) across calls: same outputs and final states.
pub fn prefill_whole_equals_parts_and_decodes<B: Backend>(make: &impl Factory<B>) {
    let b = make();
    let s = b.new_stream().unwrap();
    let w = load(&tiny_config(Model::K3), Tp::SINGLE, 21);
    let layer = layer(&b, &s, &w, LayerOptions::default());
    let x = tokens(&mut Gen::new(1), 20);
    let whole_meta = BatchMeta::prefills(&[20], &[1]);

    let mut whole = layer.new_cache(&s, 2, 0).unwrap();
    let out_whole = step(&b, &s, &layer, &mut whole, &whole_meta, &x, 0, 0.0, 0.0);
    let state_whole = slot_state(&b, &s, &whole, 1);

    let mut decoded = layer.new_cache(&s, 2, 0).unwrap();
    let first = BatchMeta::prefills(&[12], &[1]);
    let mut out_decoded = step(&b, &s, &layer, &mut decoded, &first, rows(&x, 0..12), 0, 0.0, 0.0);
    for t in 12..20 {
        let mut meta = BatchMeta::empty();
        meta.push(1, t, RequestSlots::Single(1));
        out_decoded.extend(step(
            &b,
            &s,
            &layer,
            &mut decoded,
            &meta,
            rows(&x, t..t + 1),
            0,
            0.0,
            0.0,
        ));
    }

    let mut chunked = layer.new_cache(&s, 2, 0).unwrap();
    let mut out_chunked = step(&b, &s, &layer, &mut chunked, &first, rows(&x, 0..12), 0, 0.0, 0.0);
    let mut second = BatchMeta::empty();
    second.push(8, 12, RequestSlots::Single(1));
    out_chunked.extend(step(&b, &s, &layer, &mut chunked, &second, rows(&x, 12..20), 0, 0.0, 0.0));

    let shape = [20, HIDDEN];
    assert_close("prefill + decodes", &shape, &out_decoded, &out_whole);
    assert_close("two chunks", &shape, &out_chunked, &out_whole);
    let state_shape = [HEADS, HEAD_DIM, HEAD_DIM];
    assert_close(
        "prefill + decodes state",
        &state_shape,
        &slot_state(&b, &s, &decoded, 1),
        &state_whole,
    );
    assert_close("two chunks state", &state_shape, &slot_state(&b, &s, &chunked, 1), &state_whole);
    // The decode path really continued the sequence: from a zero state it would differ.
    let mut fresh = layer.new_cache(&s, 2, 0).unwrap();
    let alone = step(
        &b,
        &s,
        &layer,
        &mut fresh,
        &BatchMeta::prefills(&[1], &[1]),
        rows(&x, 19..20),
        0,
        0.0,
        0.0,
    );
    assert!(
        layer_tolerance(&out_whole[19 * HIDDEN..])
            .compare(&[1, HIDDEN], &alone, &out_whole[19 * HIDDEN..])
            .is_err()
    );
}

/// Prefix caching (`docs/design/kda.md#chunk-boundary-states`): one batch prefills request B
/// (70 tokens) and request A (200 tokens), keeping A's state after 64, 128 and 200 tokens and
/// B's after 64 in spare slots. A prefill of A's last 72 tokens resumed from the state kept
/// after 128 tokens (its recurrent and conv halves moved into another cache) equals the rest of
/// the uninterrupted prefill, outputs and final state; the state kept after 64 tokens equals
/// the final state of a prefill cut there; a decode from the state kept at A's end equals the
/// decode from A's own slot. A position off the chunk boundaries is rejected before anything
/// runs.
pub fn prefill_resumes_from_kept_states<B: Backend>(make: &impl Factory<B>) {
    let b = make();
    let s = b.new_stream().unwrap();
    let w = load(&tiny_config(Model::K3), Tp::SINGLE, 23);
    let layer = layer(&b, &s, &w, LayerOptions::default());
    let x_b = tokens(&mut Gen::new(2), 70);
    let x_a = tokens(&mut Gen::new(3), 201);
    let mut meta = BatchMeta::empty();
    meta.push(70, 0, RequestSlots::Single(2)).push(200, 0, RequestSlots::Single(1));
    let keep = [
        KeepState { request: 1, position: 64, slot: 4 },
        KeepState { request: 1, position: 128, slot: 5 },
        KeepState { request: 1, position: 200, slot: 6 },
        KeepState { request: 0, position: 64, slot: 7 },
    ];
    let mut cache = layer.new_cache(&s, 8, 0).unwrap();
    let x: Vec<f32> = [x_b.as_slice(), rows(&x_a, 0..200)].concat();
    let xt = bf16_tensor(&b, &s, &[270, HIDDEN], &x);
    let mut out = out_buffer(&b, &s, 270, 0.0);
    // Off a chunk boundary: rejected, nothing runs.
    let before = cache_bits(&b, &s, &cache);
    let off = [KeepState { request: 1, position: 100, slot: 4 }];
    match layer.forward_keeping_states(&s, &xt, &meta, &off, &mut cache, &mut out) {
        Err(LayerError::Keep(KeepError::Position { position: 100, .. })) => {}
        other => panic!("a position off the chunk boundaries: {other:?}"),
    }
    assert!(cache_bits(&b, &s, &cache) == before, "a rejected call leaves the cache as it was");
    layer.forward_keeping_states(&s, &xt, &meta, &keep, &mut cache, &mut out).unwrap();
    let whole = download_f64(&b, &s, &out);
    let whole_a = &whole[70 * HIDDEN..];
    let state_a = slot_state(&b, &s, &cache, 1);
    let state_shape = [HEADS, HEAD_DIM, HEAD_DIM];

    // Resume A from the state kept after 128 tokens, in a cache of its own (slot 0).
    let mut resumed = layer.new_cache(&s, 2, 0).unwrap();
    for (from, to) in [
        (cache.recurrent_slot(5).unwrap(), resumed.recurrent_slot(0).unwrap()),
        (cache.conv_slot(5).unwrap(), resumed.conv_slot(0).unwrap()),
    ] {
        let v = b.download::<f32>(&s, &from).unwrap();
        b.upload(&s, &to, &v).unwrap();
    }
    let mut rest = BatchMeta::empty();
    rest.push(72, 128, RequestSlots::Single(0));
    let out_rest = step(&b, &s, &layer, &mut resumed, &rest, rows(&x_a, 128..200), 0, 0.0, 0.0);
    assert_close("resumed after 128 tokens", &[72, HIDDEN], &out_rest, &whole_a[128 * HIDDEN..]);
    assert_close(
        "resumed after 128 tokens: final state",
        &state_shape,
        &slot_state(&b, &s, &resumed, 0),
        &state_a,
    );

    // The state kept after 64 tokens of A is the final state of A cut at 64 (and B's of B).
    for (request_x, slot) in [(&x_a, 4usize), (&x_b, 7)] {
        let mut cut = layer.new_cache(&s, 1, 0).unwrap();
        let meta = BatchMeta::prefills(&[64], &[0]);
        step(&b, &s, &layer, &mut cut, &meta, rows(request_x, 0..64), 0, 0.0, 0.0);
        assert_close(
            &format!("slot {slot}: kept after 64 tokens vs a prefill cut there"),
            &state_shape,
            &slot_state(&b, &s, &cache, slot),
            &slot_state(&b, &s, &cut, 0),
        );
    }

    // A decode of token 200 from the state kept at A's end equals one from A's own slot.
    let mut decode = |slot: usize| {
        let mut meta = BatchMeta::empty();
        meta.push(1, 200, RequestSlots::Single(slot));
        step(&b, &s, &layer, &mut cache, &meta, rows(&x_a, 200..201), 0, 0.0, 0.0)
    };
    let from_kept = decode(6);
    let from_own = decode(1);
    assert_close("decode from the state kept at the end", &[1, HIDDEN], &from_kept, &from_own);
}

/// Speculative decode (num_spec = 2): a step of 3 tokens in slots [1, 2, 3] whose next step
/// accepts 2 equals decoding those 2 one by one; the next step (3 more tokens, accepted 2)
/// equals decoding its tokens one by one after them, so the rejected third token left no trace.
pub fn speculative_equals_single_decodes<B: Backend>(make: &impl Factory<B>) {
    let b = make();
    let s = b.new_stream().unwrap();
    let w = load(&tiny_config(Model::K3), Tp::SINGLE, 31);
    let layer = layer(&b, &s, &w, LayerOptions::default());
    let mut rng = Gen::new(2);
    let (p, t, u) = (tokens(&mut rng, 6), tokens(&mut rng, 3), tokens(&mut rng, 3));
    let prefill = BatchMeta::prefills(&[6], &[1]);
    let spec = |num_accepted| {
        let mut m = BatchMeta::empty();
        m.push(3, 6, RequestSlots::Speculative { slots: vec![1, 2, 3], num_accepted });
        m
    };
    let decode = |computed| {
        let mut m = BatchMeta::empty();
        m.push(1, computed, RequestSlots::Single(1));
        m
    };

    let mut x_cache = layer.new_cache(&s, 4, 2).unwrap();
    step(&b, &s, &layer, &mut x_cache, &prefill, &p, 0, 0.0, 0.0);
    let s1 = step(&b, &s, &layer, &mut x_cache, &spec(1), &t, 0, 0.0, 0.0);
    let after_s1 = slot_state(&b, &s, &x_cache, 2);
    let s2 = step(&b, &s, &layer, &mut x_cache, &spec(2), &u, 0, 0.0, 0.0);

    let mut y_cache = layer.new_cache(&s, 4, 2).unwrap();
    step(&b, &s, &layer, &mut y_cache, &prefill, &p, 0, 0.0, 0.0);
    let mut singles = Vec::new();
    for (i, tok) in [rows(&t, 0..1), rows(&t, 1..2)].into_iter().enumerate() {
        singles.extend(step(&b, &s, &layer, &mut y_cache, &decode(6 + i), tok, 0, 0.0, 0.0));
    }
    let state_shape = [HEADS, HEAD_DIM, HEAD_DIM];
    assert_close("accepted outputs", &[2, HIDDEN], &s1[..2 * HIDDEN], &singles);
    assert_close(
        "state after 2 accepted",
        &state_shape,
        &after_s1,
        &slot_state(&b, &s, &y_cache, 1),
    );
    let mut next = Vec::new();
    for i in 0..3 {
        next.extend(step(
            &b,
            &s,
            &layer,
            &mut y_cache,
            &decode(8 + i),
            rows(&u, i..i + 1),
            0,
            0.0,
            0.0,
        ));
        let st = slot_state(&b, &s, &y_cache, 1);
        assert_close(
            "state after the next step's token",
            &state_shape,
            &slot_state(&b, &s, &x_cache, 1 + i),
            &st,
        );
    }
    assert_close("next step after a rejected token", &[3, HIDDEN], &s2, &next);
}

/// A batch of several requests (interleaved kinds, so dispatch gathers and scatters) equals each
/// request run alone, and the slots of requests outside the batch keep their bits.
pub fn batch_equals_each_alone<B: Backend>(make: &impl Factory<B>) {
    let b = make();
    let s = b.new_stream().unwrap();
    let w = load(&tiny_config(Model::KimiLinear), Tp::SINGLE, 41);
    let layer = layer(&b, &s, &w, LayerOptions::default());
    let mut rng = Gen::new(3);
    let warm = tokens(&mut rng, 9);
    let mut together = layer.new_cache(&s, 8, 0).unwrap();
    let mut alone = layer.new_cache(&s, 8, 0).unwrap();
    // Slots 0, 3 and 6 hold states; 6 stays outside the next batch.
    let warm_meta = BatchMeta::prefills(&[3, 4, 2], &[0, 3, 6]);
    for cache in [&mut together, &mut alone] {
        step(&b, &s, &layer, cache, &warm_meta, &warm, 0, 0.0, 0.0);
    }
    let outside = cache_bits(&b, &s, &together);

    // A fresh prefill (5 tokens, slot 4), a decode (slot 0), a continued prefill (2 tokens,
    // slot 3), a fresh one-token prefill (slot 5): both groups are split by the other.
    let x = tokens(&mut rng, 9);
    let parts: [(usize, usize, usize); 4] = [(5, 0, 4), (1, 3, 0), (2, 4, 3), (1, 0, 5)];
    let mut meta = BatchMeta::empty();
    for &(len, computed, slot) in &parts {
        meta.push(len, computed, RequestSlots::Single(slot));
    }
    let batched = step(&b, &s, &layer, &mut together, &meta, &x, 0, 0.0, 0.0);
    let mut at = 0;
    for &(len, computed, slot) in &parts {
        let mut one = BatchMeta::empty();
        one.push(len, computed, RequestSlots::Single(slot));
        let got = step(&b, &s, &layer, &mut alone, &one, rows(&x, at..at + len), 0, 0.0, 0.0);
        assert_close(
            &format!("request in slot {slot}"),
            &[len, HIDDEN],
            &batched[at * HIDDEN..(at + len) * HIDDEN],
            &got,
        );
        let shape = [HEADS, HEAD_DIM, HEAD_DIM];
        assert_close(
            "its state",
            &shape,
            &slot_state(&b, &s, &together, slot),
            &slot_state(&b, &s, &alone, slot),
        );
        at += len;
    }
    // Slots 1, 2, 6 and 7 were in no batch of the second step: their bits are unchanged.
    let after = cache_bits(&b, &s, &together);
    let dims = together.dims();
    let per_rec = HEADS * HEAD_DIM * HEAD_DIM;
    let per_conv = dims.conv_shape()[1] * dims.conv_shape()[2];
    for slot in [1, 2, 6, 7] {
        assert_eq!(
            after.0[slot * per_rec..(slot + 1) * per_rec],
            outside.0[slot * per_rec..(slot + 1) * per_rec],
            "recurrent slot {slot}"
        );
        assert_eq!(
            after.1[slot * per_conv..(slot + 1) * per_conv],
            outside.1[slot * per_conv..(slot + 1) * per_conv],
            "conv slot {slot}"
        );
    }
}

/// TP: the partial outputs of tp ∈ {2, 4, 8} ranks sum to the TP 1 output.
pub fn tp_partials_sum_to_tp1<B: Backend>(make: &impl Factory<B>) {
    let b = make();
    let s = b.new_stream().unwrap();
    let config = tiny_config(Model::K3);
    let x = tokens(&mut Gen::new(4), 7);
    let meta = BatchMeta::prefills(&[4, 3], &[0, 1]);
    let run = |tp: Tp| {
        let l = layer(&b, &s, &load(&config, tp, 51), LayerOptions::default());
        let mut cache = l.new_cache(&s, 2, 0).unwrap();
        step(&b, &s, &l, &mut cache, &meta, &x, 0, 0.0, 0.0)
    };
    let full = run(Tp::SINGLE);
    for size in [2, 4, 8] {
        let mut sum = vec![0.0; full.len()];
        for rank in 0..size {
            for (acc, v) in sum.iter_mut().zip(run(Tp::new(size, rank).unwrap())) {
                *acc += v;
            }
        }
        assert_close(&format!("tp {size}"), &[7, HIDDEN], &sum, &full);
    }
}

/// Behaviours 1 and 12 (`docs/design/kda.md#behaviours`): padding rows are exactly zero whatever
/// the input and output held there, live rows do not depend on them, and an empty batch zeroes an
/// output that held NaN without touching the cache.
pub fn padding_and_empty_batch<B: Backend>(make: &impl Factory<B>) {
    let b = make();
    let s = b.new_stream().unwrap();
    let w = load(&tiny_config(Model::K3), Tp::SINGLE, 61);
    let layer = layer(&b, &s, &w, LayerOptions::default());
    let x = tokens(&mut Gen::new(6), 5);
    let meta = BatchMeta::prefills(&[3, 2], &[0, 1]);
    let mut c1 = layer.new_cache(&s, 2, 0).unwrap();
    let clean = step(&b, &s, &layer, &mut c1, &meta, &x, 3, 0.0, 7.0);
    let mut c2 = layer.new_cache(&s, 2, 0).unwrap();
    let dirty = step(&b, &s, &layer, &mut c2, &meta, &x, 3, f32::NAN, f64::NAN);
    let live = 5 * HIDDEN;
    let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&clean[..live]), bits(&dirty[..live]), "live rows ignore the padding");
    assert!(clean[..live].iter().all(|v| v.is_finite()) && clean[..live].iter().any(|&v| v != 0.0));
    for out in [&clean, &dirty] {
        assert!(out[live..].iter().all(|&v| v == 0.0), "padding rows are exactly zero");
    }
    assert_eq!(cache_bits(&b, &s, &c1), cache_bits(&b, &s, &c2));

    let before = cache_bits(&b, &s, &c2);
    let empty = step(&b, &s, &layer, &mut c2, &BatchMeta::empty(), &x, 0, 0.0, f64::NAN);
    assert!(empty.iter().all(|&v| v == 0.0), "behaviour 12: an empty batch zeroes the output");
    assert_eq!(cache_bits(&b, &s, &c2), before, "an empty batch touches no state");
}

/// Behaviours 4, 7 and 8 (`docs/design/kda.md#behaviours`): the mixed path hands dispatch the
/// projection's preprocessed beta (a view: no sigmoid op in the layer), the ordinary path applies
/// exactly one fp32 sigmoid to the raw B columns, both give the same bits; the intermediates have
/// the post-process shapes.
pub fn beta_paths_and_intermediate_shapes<B: Backend>(make: &impl Factory<B>) {
    let b = make();
    let s = b.new_stream().unwrap();
    let w = load(&tiny_config(Model::K3), Tp::SINGLE, 71);
    let x = tokens(&mut Gen::new(7), 6);
    let meta = BatchMeta::prefills(&[6], &[0]);
    let mut results = Vec::new();
    for beta in [BetaInput::Preprocessed, BetaInput::Raw] {
        let options = LayerOptions { beta, ..LayerOptions::default() };
        let layer = layer(&b, &s, &w, options);
        let mut cache = layer.new_cache(&s, 1, 0).unwrap();
        let xt = bf16_tensor(&b, &s, &[6, HIDDEN], &x);
        let mut out = out_buffer(&b, &s, 6, 0.0);
        let before = b.instrumentation().log().len();
        let trace = layer.forward_traced(&s, &xt, &meta, &mut cache, &mut out).unwrap().unwrap();
        let sigmoids = b.instrumentation().log()[before..]
            .iter()
            .filter(|e| matches!(e, Entry::Launch { label, .. } if label == BETA_SIGMOID))
            .count();
        if b.instrumentation().is_checked() {
            let want = usize::from(beta == BetaInput::Raw);
            assert_eq!(sigmoids, want, "{beta:?}: sigmoids applied by dispatch");
        }
        assert_eq!(trace.beta.shape(), [6, HEADS]);
        assert_eq!(trace.beta.dtype(), layer.core_operands().dtype());
        for t in [&trace.g1, &trace.gate, &trace.g2, &trace.core_attn_out] {
            assert_eq!(t.shape(), [6, HEADS, HEAD_DIM]);
        }
        assert_eq!(trace.mixed_qkv.shape(), [6, 3 * HEADS * HEAD_DIM]);
        let beta_values = download_f64(&b, &s, &trace.beta);
        assert!(beta_values.iter().all(|&v| (0.0..=1.0).contains(&v)));
        let raw = download_f64(&b, &s, &trace.g1);
        let gate = download_f64(&b, &s, &trace.gate);
        assert!(gate.iter().all(|&g| (-5.0..=0.0).contains(&g)), "K3 gate in (lower_bound, 0]");
        assert_ne!(raw, gate, "the gate is activated");
        results.push((download_f64(&b, &s, &out), beta_values));
    }
    assert_eq!(results[0], results[1], "raw and preprocessed beta give the same bits");
}

/// The launches in `log`, as (label, reads, writes).
fn launches(log: &[Entry]) -> Vec<(&str, &[Access], &[Access])> {
    log.iter()
        .filter_map(|e| match e {
            Entry::Launch { label, reads, writes, .. } => {
                Some((label.as_str(), &reads[..], &writes[..]))
            }
            _ => None,
        })
        .collect()
}

/// The one access of `param` among `accesses`.
fn access<'a>(accesses: &'a [Access], param: &str) -> &'a Access {
    let mut found = accesses.iter().filter(|a| a.param == param);
    match (found.next(), found.next()) {
        (Some(a), None) => a,
        _ => panic!("expected exactly one access of {param} in {accesses:?}"),
    }
}

/// Bytes an access covers.
fn bytes(a: &Access) -> usize {
    a.bytes.intervals().iter().map(|r| r.len()).sum()
}

/// Behaviour 11 (`docs/design/kda.md#behaviour-11`), for both models (both gate forms). A
/// prefill-only forward launches no `kda_gate`: its one `kda_chunk` reads the raw bf16 logits (the
/// traced forward shows they are the `g1` view itself) and the gate's parameters. The core
/// attention output and the v-first states written back to the slots equal, bit for bit, the former
/// pipeline run by hand on the trace's intermediates: `KdaGate` into an f32 tensor, then `KdaChunk`
/// on it (so the layer's output is unchanged by the move). The traced forward's extra `KdaGate`
/// (for the dump alone) changes no output bit. In a mixed batch, the decode still activates its own
/// rows (one `kda_gate` over exactly them) and the prefills, gathered from two runs, still pass the
/// raw gate.
pub fn prefill_passes_the_raw_gate_to_the_chunk<B: Backend>(make: &impl Factory<B>) {
    for model in [Model::K3, Model::KimiLinear] {
        let b = make();
        let s = b.new_stream().unwrap();
        let checked = b.instrumentation().is_checked();
        let w = load(&tiny_config(model), Tp::SINGLE, 111);
        // f32 core operands, as the hand-run pipeline below (the bf16 operands' route through a
        // vendor op is the backend's own test).
        let options = LayerOptions { core_operands: Some(CoreOperands::F32), ..Default::default() };
        let layer = layer(&b, &s, &w, options);
        let (lens, n) = ([5usize, 67], 72);
        let x = tokens(&mut Gen::new(11), n);
        let xt = bf16_tensor(&b, &s, &[n, HIDDEN], &x);
        let meta = BatchMeta::prefills(&lens, &[0, 1]);
        let raw_bytes = |rows: usize| rows * HEADS * HEAD_DIM * DType::BF16.size_bytes();
        let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();

        let mut cache = layer.new_cache(&s, 2, 0).unwrap();
        let mut out = out_buffer(&b, &s, n, f64::NAN);
        let before = b.instrumentation().log().len();
        layer.forward(&s, &xt, &meta, &mut cache, &mut out).unwrap();
        let log = b.instrumentation().log()[before..].to_vec();
        let plain = (bits(&download_f64(&b, &s, &out)), cache_bits(&b, &s, &cache));
        if checked {
            let ops = launches(&log);
            assert!(ops.iter().all(|op| op.0 != "kda_gate"), "{model:?}: a prefill ran kda_gate");
            let chunks: Vec<_> = ops.iter().filter(|op| op.0 == "kda_chunk").collect();
            assert_eq!(chunks.len(), 1, "{model:?}: one chunk launch");
            let reads = chunks[0].1;
            assert_eq!(bytes(access(reads, "g")), raw_bytes(n), "{model:?}: g is the bf16 g1");
            let a_log = access(reads, "a_log");
            assert_eq!(a_log.buffer, layer.weights().a_log.buffer().id());
            assert_eq!(access(reads, "dt_bias").buffer, layer.weights().dt_bias.buffer().id());
        }

        let mut traced_cache = layer.new_cache(&s, 2, 0).unwrap();
        let mut traced_out = out_buffer(&b, &s, n, f64::NAN);
        let before = b.instrumentation().log().len();
        let trace =
            layer.forward_traced(&s, &xt, &meta, &mut traced_cache, &mut traced_out).unwrap();
        let trace = trace.expect("a trace for a live batch");
        let log = b.instrumentation().log()[before..].to_vec();
        let traced = (bits(&download_f64(&b, &s, &traced_out)), cache_bits(&b, &s, &traced_cache));
        assert!(traced == plain, "{model:?}: the traced forward changed the results");
        if checked {
            let ops = launches(&log);
            let chunk = ops.iter().find(|op| op.0 == "kda_chunk").expect("a chunk launch");
            let g = access(chunk.1, "g");
            assert_eq!(trace.g1.dtype(), DType::BF16);
            assert_eq!(g.buffer, trace.g1.buffer().id(), "{model:?}: the chunk reads g1");
            assert_eq!(g.bytes, ByteRanges::of(trace.g1.layout()));
            let gates: Vec<_> = ops.iter().filter(|op| op.0 == "kda_gate").collect();
            assert_eq!(gates.len(), 1, "{model:?}: one kda_gate, for the trace");
            assert_eq!(access(gates[0].2, "g").buffer, trace.gate.buffer().id());
            let gate_buffer = trace.gate.buffer().id();
            assert!(chunk.1.iter().all(|a| a.buffer != gate_buffer), "the chunk reads no gate");
        }

        // The former pipeline by hand: conv, KdaGate, KdaChunk on the activated gate.
        let hand = layer.new_cache(&s, 2, 0).unwrap();
        let lp = HEADS * HEAD_DIM;
        let i32s = |v: &[i32]| {
            let t = b.alloc(DType::I32, &[v.len()]).unwrap();
            b.upload(&s, &t, v).unwrap();
            t
        };
        let (starts, slots, fresh) = (i32s(&[0, 5, 72]), i32s(&[0, 1]), i32s(&[0, 0]));
        let conv_out = b.alloc(DType::F32, &[n, 3 * lp]).unwrap();
        let conv = CausalConv {
            x: trace.mixed_qkv.clone(),
            weight: layer.weights().conv.clone(),
            query_start_loc: starts.clone(),
            state_slots: slots.clone(),
            has_initial_state: fresh.clone(),
            state: hand.conv().clone(),
            y: conv_out.clone(),
        };
        b.launch(&s, Op::CausalConv(conv)).unwrap();
        let w = layer.weights();
        let activated = b.alloc(DType::F32, &[n, HEADS, HEAD_DIM]).unwrap();
        let gate = KdaGate {
            g1: trace.g1.clone(),
            a_log: w.a_log.clone(),
            dt_bias: w.dt_bias.clone(),
            form: tiny_config(model).gate_form(),
            g: activated.clone(),
        };
        b.launch(&s, Op::KdaGate(gate)).unwrap();
        let qkv: Vec<Tensor<B>> = conv_out
            .split(1, &[lp, lp, lp])
            .unwrap()
            .iter()
            .map(|t| t.reshape(&[n, HEADS, HEAD_DIM]).unwrap())
            .collect();
        let core = b.alloc(DType::F32, &[n, HEADS, HEAD_DIM]).unwrap();
        let chunk = KdaChunk {
            chunk_state_slots: None,
            host_meta: None,
            q: qkv[0].clone(),
            k: qkv[1].clone(),
            v: qkv[2].clone(),
            g: activated,
            gate: None,
            beta: trace.beta.clone(),
            cu_seqlens: starts,
            state_slots: slots,
            has_initial_state: fresh,
            state: hand.recurrent().clone(),
            o: core.clone(),
            scale: (HEAD_DIM as f32).powf(-0.5),
            qk_l2norm: true,
        };
        b.launch(&s, Op::KdaChunk(chunk)).unwrap();
        let core_bits = |t: &Tensor<B>| bits(&download_f64(&b, &s, t));
        assert!(
            core_bits(&core) == core_bits(&trace.core_attn_out),
            "{model:?}: core attention output differs from KdaGate + KdaChunk"
        );
        assert!(
            cache_bits(&b, &s, &hand) == traced.1,
            "{model:?}: states differ from KdaGate + KdaChunk"
        );
        assert!(slot_state(&b, &s, &hand, 1).iter().any(|&v| v != 0.0));

        // A mixed batch: prefill (2 tokens, slot 1), decode (slot 0), fresh prefill (2, slot 2).
        let mut mixed = BatchMeta::empty();
        mixed.push(2, 67, RequestSlots::Single(1)).push(1, 5, RequestSlots::Single(0)).push(
            2,
            0,
            RequestSlots::Single(2),
        );
        let mut cache3 = layer.new_cache(&s, 3, 0).unwrap();
        step(&b, &s, &layer, &mut cache3, &meta, &x, 0, 0.0, 0.0);
        let before = b.instrumentation().log().len();
        let x2 = tokens(&mut Gen::new(12), 5);
        step(&b, &s, &layer, &mut cache3, &mixed, &x2, 0, 0.0, 0.0);
        if checked {
            let log = b.instrumentation().log()[before..].to_vec();
            let ops = launches(&log);
            let gates: Vec<_> = ops.iter().filter(|op| op.0 == "kda_gate").collect();
            assert_eq!(gates.len(), 1, "{model:?}: the decode group's gate");
            assert_eq!(bytes(access(gates[0].1, "g1")), raw_bytes(1), "the decode row only");
            let recurrent = ops.iter().find(|op| op.0 == "kda_recurrent").expect("a decode");
            assert_eq!(access(recurrent.1, "g").buffer, access(gates[0].2, "g").buffer);
            let chunk = ops.iter().find(|op| op.0 == "kda_chunk").expect("a prefill");
            assert_eq!(bytes(access(chunk.1, "g")), raw_bytes(4), "the gathered bf16 logits");
            access(chunk.1, "a_log");
        }
    }
}

/// The overlapped layer forward (both policies) on a checked backend: no hazard, and a captured
/// forward replayed equals the eager forward bit for bit (outputs and every cache byte), once
/// and again as the next step.
pub fn overlapped_forward_is_clean_and_replays<B: Backend>(make: &impl Factory<B>) {
    for policy in [MatrixOverlap::Serialized, MatrixOverlap::Concurrent] {
        let b = make();
        let s = b.new_stream().unwrap();
        let w = load(&tiny_config(Model::K3), Tp::SINGLE, 81);
        let options = LayerOptions {
            schedule: Some(ProjectionSchedule::Overlapped),
            matrix_overlap: Some(policy),
            ..LayerOptions::default()
        };
        let layer = layer(&b, &s, &w, options);
        let mut rng = Gen::new(8);
        let warm = tokens(&mut rng, 7);
        let x = tokens(&mut rng, 6);
        let mut meta = BatchMeta::empty();
        meta.push(1, 3, RequestSlots::Single(0)).push(5, 0, RequestSlots::Single(2));
        let mut caches = [layer.new_cache(&s, 3, 0).unwrap(), layer.new_cache(&s, 3, 0).unwrap()];
        for c in &mut caches {
            step(&b, &s, &layer, c, &BatchMeta::prefills(&[3, 4], &[0, 1]), &warm, 0, 0.0, 0.0);
        }
        let eager = step(&b, &s, &layer, &mut caches[0], &meta, &x, 2, 0.0, f64::NAN);
        assert!(
            b.instrumentation().hazards().is_empty(),
            "{policy:?}: {:?}",
            b.instrumentation().hazards()
        );

        let xt = bf16_tensor(&b, &s, &[8, HIDDEN], &{
            let mut v = x.clone();
            v.extend(std::iter::repeat_n(0.0, 2 * HIDDEN));
            v
        });
        let mut out = out_buffer(&b, &s, 8, f64::NAN);
        b.synchronize(&s).unwrap();
        b.begin_capture(&s).unwrap();
        layer.forward(&s, &xt, &meta, &mut caches[1], &mut out).unwrap();
        let graph = b.end_capture(&s).unwrap();
        b.launch_graph(&graph, &s).unwrap();
        let replayed = download_f64(&b, &s, &out);
        let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&replayed), bits(&eager), "{policy:?}: replayed output");
        assert_eq!(
            cache_bits(&b, &s, &caches[1]),
            cache_bits(&b, &s, &caches[0]),
            "{policy:?}: replayed cache"
        );
        // The same graph again is the next step (the decode continues from the state the first
        // replay wrote): the caller's buffers make it reusable across steps.
        let eager = step(&b, &s, &layer, &mut caches[0], &meta, &x, 2, 0.0, f64::NAN);
        b.launch_graph(&graph, &s).unwrap();
        assert_eq!(bits(&download_f64(&b, &s, &out)), bits(&eager), "{policy:?}: second replay");
        assert_eq!(cache_bits(&b, &s, &caches[1]), cache_bits(&b, &s, &caches[0]));
        assert!(b.instrumentation().hazards().is_empty());
    }
}

/// Bad input: each call fails with an error naming the problem, and neither the cache nor the
/// output changes.
pub fn bad_input_leaves_the_cache_unchanged<B: Backend>(make: &impl Factory<B>) {
    let b = make();
    let s = b.new_stream().unwrap();
    let w = load(&tiny_config(Model::K3), Tp::SINGLE, 91);
    let layer = layer(&b, &s, &w, LayerOptions::default());
    let mut cache = layer.new_cache(&s, 3, 1).unwrap();
    let x = tokens(&mut Gen::new(9), 4);
    step(&b, &s, &layer, &mut cache, &BatchMeta::prefills(&[2, 2], &[0, 1]), &x, 0, 0.0, 0.0);
    let before = cache_bits(&b, &s, &cache);
    let xt = bf16_tensor(&b, &s, &[4, HIDDEN], &x);
    let ok = BatchMeta::prefills(&[3, 1], &[0, 2]);
    let spec = |slots: Vec<usize>, num_accepted| {
        let mut m = BatchMeta::empty();
        m.push(2, 2, RequestSlots::Speculative { slots, num_accepted });
        m
    };
    let mut not_increasing = ok.clone();
    not_increasing.query_start_loc = vec![0, 3, 3];
    let mut live = ok.clone();
    live.num_actual_tokens = 2;
    let mut bad_slot = ok.clone();
    bad_slot.slots[1] = RequestSlots::Single(3);
    let mut twice = ok.clone();
    twice.slots[1] = RequestSlots::Single(0);
    let cases = [
        (
            "offsets not increasing",
            not_increasing,
            BatchError::NotIncreasing { request: 1, start: 3, end: 3 },
        ),
        ("live count", live, BatchError::LiveTokens { expected: 4, actual: 2 }),
        (
            "slot beyond the cache",
            bad_slot,
            BatchError::SlotOutOfRange { request: 1, slot: 3, slots: 3 },
        ),
        ("slot twice", twice, BatchError::DuplicateSlot { slot: 0, first: 0, second: 1 }),
        (
            "accepted > num_spec + 1",
            spec(vec![0, 1], 3),
            BatchError::Accepted { request: 0, actual: 3, max: 2 },
        ),
    ];
    let check_unchanged = |what: &str, cache: &StateCache<B>, out: &Tensor<B>| {
        assert_eq!(cache_bits(&b, &s, cache), before, "{what}: the cache changed");
        let o = download_f64(&b, &s, out);
        assert!(o.iter().all(|&v| v == 3.0), "{what}: the output changed");
    };
    let mut out = out_buffer(&b, &s, 4, 3.0);
    for (what, meta, expected) in cases {
        let e = layer.forward(&s, &xt, &meta, &mut cache, &mut out).unwrap_err();
        assert!(matches!(&e, LayerError::Batch(b) if *b == expected), "{what}: {e}");
        assert!(e.to_string().contains("batch metadata"), "{what}: {e}");
        check_unchanged(what, &cache, &out);
    }
    // A hidden size that does not match the config.
    let narrow = bf16_tensor(&b, &s, &[4, HIDDEN - 1], &x[..4 * (HIDDEN - 1)]);
    let e = layer.forward(&s, &narrow, &ok, &mut cache, &mut out).unwrap_err();
    assert!(
        matches!(&e, LayerError::Device(Error::Shape { param: "hidden_states", actual, .. }) if actual == &[4, HIDDEN - 1]),
        "{e}"
    );
    check_unchanged("hidden size", &cache, &out);
    // An output buffer of the wrong shape.
    let mut wrong = out_buffer(&b, &s, 3, 3.0);
    let e = layer.forward(&s, &xt, &ok, &mut cache, &mut wrong).unwrap_err();
    assert!(
        matches!(&e, LayerError::Device(Error::Shape { param: "out", actual, .. }) if actual == &[3, HIDDEN]),
        "{e}"
    );
    check_unchanged("output shape", &cache, &wrong);
    // A cache made for another layer shape.
    let mut other =
        StateCache::new(&b, &s, kda_model::layer::CacheDims { heads: 4, ..cache.dims() }).unwrap();
    let e = layer.forward(&s, &xt, &ok, &mut other, &mut out).unwrap_err();
    assert!(matches!(&e, LayerError::Device(Error::Param { param: "cache", .. })), "{e}");
    check_unchanged("foreign cache", &cache, &out);
    // An output that is a view of the cache.
    let layout = kda_core::Layout::contiguous(DType::F32, &[4, HIDDEN]);
    let mut inside = Tensor::new(cache.recurrent().buffer().clone(), layout).unwrap();
    let e = layer.forward(&s, &xt, &ok, &mut cache, &mut inside).unwrap_err();
    assert!(
        matches!(&e, LayerError::Device(Error::Aliasing { param: "out", other: "cache", .. })),
        "{e}"
    );
    check_unchanged("output inside the cache", &cache, &out);
    // The good batch still works on the untouched cache.
    layer.forward(&s, &xt, &ok, &mut cache, &mut out).unwrap();
    assert!(download_f64(&b, &s, &out).iter().all(|v| v.is_finite()));
}

/// Under random delays before every queued item, the overlapped layer (both policies) gives
/// the serial layer's bits, `rounds` times over a mixed batch: a missing event would let a
/// consumer read a half-written projection in some round.
pub fn jittered_overlapped_equals_serial<B: Backend>(make: &impl Factory<B>, rounds: usize) {
    let b = make();
    let s = b.new_stream().unwrap();
    let w = load(&tiny_config(Model::K3), Tp::SINGLE, 101);
    let x = tokens(&mut Gen::new(10), 7);
    let meta = BatchMeta::prefills(&[4, 3], &[0, 1]);
    let run = |options: LayerOptions| {
        let l = layer(&b, &s, &w, options);
        let mut cache = l.new_cache(&s, 2, 0).unwrap();
        let out = step(&b, &s, &l, &mut cache, &meta, &x, 1, 0.0, f64::NAN);
        (out.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), cache_bits(&b, &s, &cache))
    };
    let serial =
        run(LayerOptions { schedule: Some(ProjectionSchedule::Serial), ..LayerOptions::default() });
    for round in 0..rounds {
        let policy = [MatrixOverlap::Serialized, MatrixOverlap::Concurrent][round % 2];
        let options = LayerOptions {
            schedule: Some(ProjectionSchedule::Overlapped),
            matrix_overlap: Some(policy),
            ..LayerOptions::default()
        };
        assert!(run(options) == serial, "round {round} ({policy:?}) differs from serial");
    }
}

/// This module's bodies, each registered for every backend: [`crate::conformance_tests!`] calls
/// this with the backend's factories. A public body missing here fails
/// `conformance::tests::every_body_is_registered`.
#[doc(hidden)]
#[macro_export]
macro_rules! conformance_layer {
    ($plain:expr, $jittered:expr, $checked:expr) => {
        $crate::conformance_tests!(@tests
            layer_matches_f64_oracle => layer::matches_f64_oracle(&$plain),
            layer_staged_loader_equals_composed_loader => layer::staged_loader_equals_composed_loader(&$plain),
            layer_norm_uses_the_checkpoint_eps => layer::norm_uses_the_checkpoint_eps(&$plain),
            layer_prefill_whole_equals_parts_and_decodes => layer::prefill_whole_equals_parts_and_decodes(&$plain),
            layer_prefill_resumes_from_kept_states => layer::prefill_resumes_from_kept_states(&$plain),
            layer_speculative_equals_single_decodes => layer::speculative_equals_single_decodes(&$plain),
            layer_batch_equals_each_alone => layer::batch_equals_each_alone(&$plain),
            layer_tp_partials_sum_to_tp1 => layer::tp_partials_sum_to_tp1(&$plain),
            layer_padding_and_empty_batch => layer::padding_and_empty_batch(&$plain),
            layer_beta_paths_and_intermediate_shapes => layer::beta_paths_and_intermediate_shapes(&$checked),
            layer_prefill_passes_the_raw_gate_to_the_chunk => layer::prefill_passes_the_raw_gate_to_the_chunk(&$checked),
            layer_overlapped_forward_is_clean_and_replays => layer::overlapped_forward_is_clean_and_replays(&$checked),
            layer_bad_input_leaves_the_cache_unchanged => layer::bad_input_leaves_the_cache_unchanged(&$plain),
            layer_jittered_overlapped_equals_serial => layer::jittered_overlapped_equals_serial(&$jittered, 20),
        );
    };
}
