//! The whole layer on the Ascend backend over the emulated runtime with bf16 core operands
//! (`docs/design/kda.md#core-operand-dtype`), so that prefills run on `aclnnChunkKdaFwd` and
//! decodes and speculative decodes on `aclnnRecurrentGatedDeltaRule` (`docs/ascend.md`, vendor
//! operators): outputs and states against the reference layer with the same option, through
//! kda-testkit's tolerance, for prefill, decode, speculative decode and mixed batches. Every
//! test asserts from the emulator's call log that the vendor op it is about really ran.
#![cfg(feature = "emulated")]
#![allow(clippy::expect_used, clippy::unwrap_used, reason = "tests")]

use half::bf16;
use kda_ascend::{AscendBackend, AscendOptions};
use kda_core::{Backend, DType, Device, Op};
use kda_model::config::{KdaConfig, Tp};
use kda_model::layer::{BatchMeta, CoreOperands, KdaLayer, LayerOptions, RequestSlots, StateCache};
use kda_model::schedule::ProjectionSchedule;
use kda_model::weights::{LayerWeights, LoadOptions, load_layer};
use kda_reference::ReferenceBackend;
use kda_testkit::checkpoint::{SyntheticCheckpoint, SyntheticSpec, scaled_config};
use kda_testkit::{Gen, Tolerance};

/// Head dims the vendor ops take (multiples of 16); hidden 64 is two MX blocks.
const HIDDEN: usize = 64;
const HEADS: usize = 4;
const HEAD_DIM: usize = 16;
const SLOTS: usize = 12;

const CHUNK_OP: &str = "aclnnChunkKdaFwd";
const RECURRENT_OP: &str = "aclnnRecurrentGatedDeltaRule";

/// How many times this thread's calls named `api`.
fn calls(api: &str) -> usize {
    kda_acl_emu::calls_of_this_thread().iter().filter(|c| c.api == api).count()
}

fn ascend() -> Device<AscendBackend> {
    let options = AscendOptions { checked: false, ..AscendOptions::default() };
    AscendBackend::with_options(options).expect("ascend backend over the emulated runtime")
}

/// Layer 0 of a tiny synthetic K3 (MXFP8 QKV, lower-bound gate) or Kimi Linear (bf16 QKV,
/// softplus gate) checkpoint.
fn weights(k3: bool) -> LayerWeights {
    let preset = if k3 { KdaConfig::kimi_k3() } else { KdaConfig::kimi_linear_48b() };
    let mut config = scaled_config(&preset, HIDDEN, HEADS, HEAD_DIM);
    config.rms_norm_eps = 1e-2;
    let source = SyntheticCheckpoint::new(SyntheticSpec::new(config.clone(), 21));
    load_layer(&source, &config, Tp::SINGLE, 0, LoadOptions::default()).unwrap().weights
}

fn options(operands: CoreOperands) -> LayerOptions {
    LayerOptions {
        schedule: Some(ProjectionSchedule::Serial),
        core_operands: Some(operands),
        ..LayerOptions::default()
    }
}

/// One layer and its cache on one backend.
struct Side<B: Backend> {
    b: Device<B>,
    s: B::Stream,
    layer: KdaLayer<B>,
    cache: StateCache<B>,
}

impl<B: Backend> Side<B> {
    fn new(b: Device<B>, w: &LayerWeights, operands: CoreOperands) -> Self {
        Self::with_spec(b, w, operands, 2)
    }

    fn with_spec(b: Device<B>, w: &LayerWeights, operands: CoreOperands, spec: usize) -> Self {
        let s = b.new_stream().unwrap();
        let layer = KdaLayer::new(&b, &s, w, options(operands)).unwrap();
        let cache = layer.new_cache(&s, SLOTS, spec).unwrap();
        b.synchronize(&s).unwrap();
        Self { b, s, layer, cache }
    }

    /// The layer's output `[rows, HIDDEN]` for `meta` on the activation rows `x`.
    fn step(&mut self, meta: &BatchMeta, x: &[f32]) -> Vec<f64> {
        let (b, s) = (&self.b, &self.s);
        let rows = x.len() / HIDDEN;
        let xt = b.alloc(DType::BF16, &[rows, HIDDEN]).unwrap();
        b.upload(s, &xt, &x.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>()).unwrap();
        let mut out = b.alloc(DType::F32, &[rows, HIDDEN]).unwrap();
        b.launch(s, Op::Fill { dst: out.clone(), value: f64::NAN }).unwrap();
        self.layer.forward(s, &xt, meta, &mut self.cache, &mut out).unwrap();
        b.download::<f32>(s, &out).unwrap().into_iter().map(f64::from).collect()
    }

    /// Every recurrent state of the cache, `[N, H, V, K]`.
    fn states(&self) -> Vec<f64> {
        let t = self.cache.recurrent();
        self.b.download::<f32>(&self.s, t).unwrap().into_iter().map(f64::from).collect()
    }
}

/// `rows` activations ~N(0, 1), rounded to bf16.
fn tokens(rng: &mut Gen, rows: usize) -> Vec<f32> {
    rng.normal_f32(rows * HIDDEN, 0.0, 1.0)
        .into_iter()
        .map(|x| bf16::from_f32(x).to_f32())
        .collect()
}

fn max_abs(x: &[f64]) -> f64 {
    x.iter().fold(0.0, |m, v| m.max(v.abs()))
}

/// The Ascend layer against the reference layer, both with bf16 core operands. Both round q,
/// k, v, beta and the core output to bf16 in the same places; the vendor ops also round the
/// L2-normalised q and k to bf16 before the op (it takes no f32 operand) and keep their own
/// intermediates in bf16 where their kernels do (`kda-acl-emu`'s `vendor/chunk_kda.rs`), which
/// the reference does not: [`Tolerance::layer_bf16_intermediates`], the vendor route's own
/// allowance against the f64 oracle (measured in
/// `vendor_route_is_within_its_tolerance_of_the_f64_oracle`).
fn tolerance(expected: &[f64]) -> Tolerance {
    Tolerance::layer_bf16_intermediates(max_abs(expected))
}

fn assert_close(what: &str, shape: &[usize], actual: &[f64], expected: &[f64]) {
    if let Err(m) = tolerance(expected).compare(shape, actual, expected) {
        panic!("{what}: {m}");
    }
}

/// The Ascend side (bf16 operands) and the reference side (the same option).
fn pair(k3: bool) -> (Side<AscendBackend>, Side<ReferenceBackend>) {
    let w = weights(k3);
    let asc = Side::new(ascend(), &w, CoreOperands::Bf16);
    let reference = Side::new(ReferenceBackend::new(), &w, CoreOperands::Bf16);
    (asc, reference)
}

/// Run `meta` on both sides, compare outputs and every state, and return the vendor calls the
/// Ascend step made (chunk, recurrent).
fn both(
    what: &str,
    asc: &mut Side<AscendBackend>,
    reference: &mut Side<ReferenceBackend>,
    meta: &BatchMeta,
    x: &[f32],
) -> (usize, usize) {
    let before = (calls(CHUNK_OP), calls(RECURRENT_OP));
    let got = asc.step(meta, x);
    let made = (calls(CHUNK_OP) - before.0, calls(RECURRENT_OP) - before.1);
    let want = reference.step(meta, x);
    let rows = x.len() / HIDDEN;
    assert_close(&format!("{what}: output"), &[rows, HIDDEN], &got, &want);
    let shape = [SLOTS, HEADS, HEAD_DIM, HEAD_DIM];
    assert_close(&format!("{what}: states"), &shape, &asc.states(), &reference.states());
    made
}

/// Fresh prefills of 5, 67 (crossing a chunk) and 3 tokens into slots 2, 5 and 0.
fn prefill(asc: &mut Side<AscendBackend>, reference: &mut Side<ReferenceBackend>, rng: &mut Gen) {
    let x = tokens(rng, 75);
    let meta = BatchMeta::prefills(&[5, 67, 3], &[2, 5, 0]);
    let (chunk, recurrent) = both("prefill", asc, reference, &meta, &x);
    assert_eq!((chunk, recurrent), (1, 0), "one aclnnChunkKdaFwd call, no recurrent call");
}

#[test]
fn prefill_on_the_vendor_chunk_op_equals_the_reference() {
    for k3 in [true, false] {
        let (mut asc, mut reference) = pair(k3);
        prefill(&mut asc, &mut reference, &mut Gen::new(1));
        // A second, continued prefill: initial states gathered from the slots.
        let x = tokens(&mut Gen::new(2), 9);
        let mut meta = BatchMeta::empty();
        meta.push(4, 5, RequestSlots::Single(2)).push(5, 3, RequestSlots::Single(0));
        let made = both("continued prefill", &mut asc, &mut reference, &meta, &x);
        assert_eq!(made, (1, 0), "k3 = {k3}: the continued prefill on the vendor op");
    }
}

#[test]
fn decode_on_the_vendor_recurrent_op_equals_the_reference() {
    let (mut asc, mut reference) = pair(true);
    let mut rng = Gen::new(3);
    prefill(&mut asc, &mut reference, &mut rng);
    for step in 0..3 {
        let x = tokens(&mut rng, 3);
        let mut meta = BatchMeta::empty();
        let at = [5 + step, 67 + step, 3 + step];
        meta.push(1, at[0], RequestSlots::Single(2)).push(1, at[1], RequestSlots::Single(5)).push(
            1,
            at[2],
            RequestSlots::Single(0),
        );
        let made = both(&format!("decode {step}"), &mut asc, &mut reference, &meta, &x);
        assert_eq!(made, (0, 1), "decode {step}: one aclnnRecurrentGatedDeltaRule call");
    }
}

/// A speculative step of 3 tokens with slots [0, 1, 2] after `accepted` tokens of the previous
/// one, on request 0's sequence (position `at`).
fn speculative(at: usize, accepted: usize) -> BatchMeta {
    let mut meta = BatchMeta::empty();
    let slots = RequestSlots::Speculative { slots: vec![0, 1, 2], num_accepted: accepted };
    meta.push(3, at, slots);
    meta
}

#[test]
fn speculative_decode_on_the_vendor_op_honours_num_accepted_tokens() {
    let w = weights(true);
    let mut asc = Side::new(ascend(), &w, CoreOperands::Bf16);
    let mut reference = Side::new(ReferenceBackend::new(), &w, CoreOperands::Bf16);
    // The same history on a third side whose last step accepts one token instead of two: what
    // a backend that ignored numAcceptedTokens (and read slots[0]) would compute.
    let mut ignoring = Side::new(ReferenceBackend::new(), &w, CoreOperands::Bf16);
    let mut rng = Gen::new(4);
    let x = tokens(&mut rng, 6);
    let meta = BatchMeta::prefills(&[6], &[0]);
    both("prefill", &mut asc, &mut reference, &meta, &x);
    ignoring.step(&meta, &x);
    // Step 1: three speculative tokens on the state in slot 0; the states after each token
    // land in slots 0, 1, 2 (different values).
    let x = tokens(&mut rng, 3);
    let made = both("speculative 1", &mut asc, &mut reference, &speculative(6, 1), &x);
    assert_eq!(made, (0, 1), "speculative 1 on aclnnRecurrentGatedDeltaRule");
    ignoring.step(&speculative(6, 1), &x);
    // Step 2: two of them were accepted, so the state is read from slots[1].
    let x = tokens(&mut rng, 3);
    let before = calls(RECURRENT_OP);
    let got = asc.step(&speculative(8, 2), &x);
    assert_eq!(calls(RECURRENT_OP) - before, 1, "speculative 2 on aclnnRecurrentGatedDeltaRule");
    let want = reference.step(&speculative(8, 2), &x);
    let wrong = ignoring.step(&speculative(8, 1), &x);
    assert_close("speculative 2: output", &[3, HIDDEN], &got, &want);
    let shape = [SLOTS, HEADS, HEAD_DIM, HEAD_DIM];
    assert_close("speculative 2: states", &shape, &asc.states(), &reference.states());
    // The test can fail: reading slots[0] gives an output outside the tolerance.
    assert!(
        tolerance(&want).compare(&[3, HIDDEN], &wrong, &want).is_err(),
        "ignoring num_accepted_tokens must change the output beyond the tolerance"
    );
}

#[test]
fn mixed_batch_on_both_vendor_ops_equals_the_reference() {
    for k3 in [true, false] {
        let (mut asc, mut reference) = pair(k3);
        let mut rng = Gen::new(5);
        prefill(&mut asc, &mut reference, &mut rng);
        // Request 1 decodes, a fresh prefill of 4 into slot 7, request 2 speculates (slots
        // [0, 9, 10]), request 0 continues its prefill by 6; then padding rows.
        let mut x = tokens(&mut rng, 14);
        x.extend(std::iter::repeat_n(0.5, 2 * HIDDEN));
        let mut meta = BatchMeta::empty();
        meta.push(1, 67, RequestSlots::Single(5))
            .push(4, 0, RequestSlots::Single(7))
            .push(3, 3, RequestSlots::Speculative { slots: vec![0, 9, 10], num_accepted: 1 })
            .push(6, 5, RequestSlots::Single(2));
        let (chunk, recurrent) = both("mixed", &mut asc, &mut reference, &meta, &x);
        assert_eq!(chunk, 1, "k3 = {k3}: the prefill group on aclnnChunkKdaFwd");
        // The decode and the speculative decode are groups of their own.
        assert_eq!(recurrent, 2, "k3 = {k3}: both decode groups on the recurrent op");
    }
}

#[test]
fn f32_core_operands_keep_to_the_projects_kernels() {
    let w = weights(true);
    let mut asc = Side::new(ascend(), &w, CoreOperands::F32);
    let mut reference = Side::new(ReferenceBackend::new(), &w, CoreOperands::F32);
    assert_eq!(asc.layer.core_operands(), CoreOperands::F32);
    let mut rng = Gen::new(6);
    let x = tokens(&mut rng, 70);
    let made = both("prefill", &mut asc, &mut reference, &BatchMeta::prefills(&[70], &[3]), &x);
    assert_eq!(made, (0, 0), "f32 operands: no vendor op");
    let mut meta = BatchMeta::empty();
    meta.push(1, 70, RequestSlots::Single(3));
    let made = both("decode", &mut asc, &mut reference, &meta, &tokens(&mut rng, 1));
    assert_eq!(made, (0, 0), "f32 operands: no vendor op");
}

/// Nine tokens per request are beyond the recurrent op's limit of eight: the project's kernel
/// runs the speculative step, still equal to the reference.
#[test]
fn speculative_decode_beyond_the_vendor_limit_runs_the_projects_kernel() {
    let w = weights(true);
    let mut asc = Side::with_spec(ascend(), &w, CoreOperands::Bf16, 8);
    let mut reference = Side::with_spec(ReferenceBackend::new(), &w, CoreOperands::Bf16, 8);
    let mut rng = Gen::new(10);
    let meta = BatchMeta::prefills(&[6], &[0]);
    both("prefill", &mut asc, &mut reference, &meta, &tokens(&mut rng, 6));
    let mut meta = BatchMeta::empty();
    let slots = RequestSlots::Speculative { slots: (0..9).collect(), num_accepted: 1 };
    meta.push(9, 6, slots);
    let kernel = calls("kda_recurrent_step");
    let made = both("speculative of 9", &mut asc, &mut reference, &meta, &tokens(&mut rng, 9));
    assert_eq!(made, (0, 0), "no vendor op beyond 8 tokens per request");
    assert_eq!(calls("kda_recurrent_step") - kernel, 1, "the project's kernel ran");
}

/// Left to the backend, the layer's core operands are bf16 (the emulated CANN has
/// `aclnnChunkKdaFwd`). A forward captured through the HAL and launched as an ACL model then
/// takes the same route as an eager one for a decode (`aclnnRecurrentGatedDeltaRule`, bit for
/// bit), but not for a prefill: the eager one runs `aclnnChunkKdaFwd`, the captured one the
/// project's chunk kernel (the vendor op's offsets are host data fixed in its executor), and
/// the two agree within the tolerance of this file, not bit for bit (`docs/ascend.md`).
#[test]
fn captured_forwards_take_the_vendor_route_where_a_replay_can() {
    let b = ascend();
    let s = b.new_stream().unwrap();
    let w = weights(true);
    let layer = KdaLayer::new(&b, &s, &w, LayerOptions::default()).unwrap();
    assert_eq!(layer.core_operands(), CoreOperands::Bf16, "the backend's choice");
    let mut rng = Gen::new(31);
    let run = |cache: &mut StateCache<AscendBackend>,
               meta: &BatchMeta,
               x: &[f32],
               capture: bool| {
        let rows = x.len() / HIDDEN;
        let xt = b.alloc(DType::BF16, &[rows, HIDDEN]).unwrap();
        b.upload(&s, &xt, &x.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>()).unwrap();
        let mut out = b.alloc(DType::F32, &[rows, HIDDEN]).unwrap();
        b.launch(&s, Op::Fill { dst: out.clone(), value: f64::NAN }).unwrap();
        let before = (calls(CHUNK_OP), calls(RECURRENT_OP));
        if capture {
            b.begin_capture(&s).unwrap();
            layer.forward(&s, &xt, meta, cache, &mut out).unwrap();
            let graph = b.end_capture(&s).unwrap();
            b.launch_graph(&graph, &s).unwrap();
        } else {
            layer.forward(&s, &xt, meta, cache, &mut out).unwrap();
        }
        let out: Vec<f64> =
            b.download::<f32>(&s, &out).unwrap().into_iter().map(f64::from).collect();
        let states: Vec<f64> =
            b.download::<f32>(&s, cache.recurrent()).unwrap().into_iter().map(f64::from).collect();
        (out, states, (calls(CHUNK_OP) - before.0, calls(RECURRENT_OP) - before.1))
    };
    let mut caches =
        [layer.new_cache(&s, SLOTS, 0).unwrap(), layer.new_cache(&s, SLOTS, 0).unwrap()];
    let [eager, captured] = &mut caches;

    // A prefill of 5 and 67 tokens.
    let x = tokens(&mut rng, 72);
    let meta = BatchMeta::prefills(&[5, 67], &[2, 5]);
    let (want, want_states, made) = run(eager, &meta, &x, false);
    assert_eq!(made, (1, 0), "the eager prefill runs aclnnChunkKdaFwd");
    let (got, got_states, made) = run(captured, &meta, &x, true);
    assert_eq!(made, (0, 0), "the captured prefill runs the project's kernel");
    assert_close("captured prefill: output", &[72, HIDDEN], &got, &want);
    let shape = [SLOTS, HEADS, HEAD_DIM, HEAD_DIM];
    assert_close("captured prefill: states", &shape, &got_states, &want_states);

    // A decode step from the same states on both caches: the same route, the same bits.
    let copy = Op::Copy { src: eager.recurrent().clone(), dst: captured.recurrent().clone() };
    b.launch(&s, copy).unwrap();
    let copy = Op::Copy { src: eager.conv().clone(), dst: captured.conv().clone() };
    b.launch(&s, copy).unwrap();
    let x = tokens(&mut rng, 2);
    let mut meta = BatchMeta::empty();
    meta.push(1, 5, RequestSlots::Single(2)).push(1, 67, RequestSlots::Single(5));
    let (want, want_states, made) = run(eager, &meta, &x, false);
    assert_eq!(made, (0, 1), "the eager decode runs aclnnRecurrentGatedDeltaRule");
    let (got, got_states, made) = run(captured, &meta, &x, true);
    assert_eq!(made, (0, 1), "so does the captured one");
    let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&got), bits(&want), "captured decode: output bit for bit");
    assert_eq!(bits(&got_states), bits(&want_states), "captured decode: states bit for bit");
}

/// The layer with bf16 core operands against the f64 oracle of that option
/// (`LayerOracle::with_bf16_core_operands`), on the vendor route (this backend: prefills on
/// `aclnnChunkKdaFwd`, decodes on `aclnnRecurrentGatedDeltaRule`, both at their kernels'
/// precision) and on the reference backend (the same option, f32 intermediates) for
/// comparison: prefills of 5, 67, 3 and 200 tokens (up to four chunks), then three decode
/// steps of each request, for both model shapes. The reference route holds
/// [`Tolerance::layer`]; the vendor route its own [`Tolerance::layer_bf16_intermediates`].
/// With `--nocapture` it prints, per route, the largest share of `Tolerance::layer` used and
/// the largest error as a fraction of the largest output magnitude (`docs/ascend.md`).
#[test]
fn vendor_route_is_within_its_tolerance_of_the_f64_oracle() {
    use kda_testkit::oracle_layer::LayerOracle;
    for k3 in [true, false] {
        let w = weights(k3);
        let oracle = LayerOracle::new(&w, Default::default()).with_bf16_core_operands();
        let mut asc = Side::new(ascend(), &w, CoreOperands::Bf16);
        let mut reference = Side::new(ReferenceBackend::new(), &w, CoreOperands::Bf16);
        let lens = [5, 67, 3, 200];
        let slots = [2, 5, 0, 7];
        let mut rng = Gen::new(41);
        let mut tracked: Vec<_> = lens.iter().map(|_| oracle.fresh()).collect();
        // (share of Tolerance::layer, |error| / max |expected|) per route, worst over the run.
        let mut worst = [(0.0f64, 0.0f64); 2];
        // The same share per route and stage (prefill output, decode output, state).
        let mut stages = std::collections::BTreeMap::<(usize, &str), f64>::new();
        let mut record = |what: &'static str, route: usize, got: &[f64], want: &[f64]| {
            let m = max_abs(want);
            let usage = Tolerance::layer(m).usage(got, want);
            let err = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max) / m;
            worst[route].0 = worst[route].0.max(usage);
            worst[route].1 = worst[route].1.max(err);
            let e = stages.entry((route, what)).or_insert(0.0);
            *e = e.max(usage);
            let tol = if route == 0 {
                Tolerance::layer_bf16_intermediates(m)
            } else {
                Tolerance::layer(m)
            };
            if let Err(e) = tol.compare(&[got.len()], got, want) {
                panic!("k3 = {k3}, {}: {what}: {e}", ["vendor route", "reference"][route]);
            }
        };
        let x = tokens(&mut rng, lens.iter().sum());
        let meta = BatchMeta::prefills(&lens, &slots);
        let before = calls(CHUNK_OP);
        let outs = [asc.step(&meta, &x), reference.step(&meta, &x)];
        assert_eq!(calls(CHUNK_OP) - before, 1, "the prefill on aclnnChunkKdaFwd");
        let mut at = 0;
        for (r, &len) in lens.iter().enumerate() {
            let (want, next) = oracle.run(&x[at * HIDDEN..(at + len) * HIDDEN], &tracked[r]);
            for (route, out) in outs.iter().enumerate() {
                record("prefill", route, &out[at * HIDDEN..(at + len) * HIDDEN], &want);
            }
            tracked[r] = next;
            at += len;
        }
        for step in 0..3 {
            let x = tokens(&mut rng, lens.len());
            let mut meta = BatchMeta::empty();
            for (&len, &slot) in lens.iter().zip(&slots) {
                meta.push(1, len + step, RequestSlots::Single(slot));
            }
            let before = calls(RECURRENT_OP);
            let outs = [asc.step(&meta, &x), reference.step(&meta, &x)];
            assert_eq!(calls(RECURRENT_OP) - before, 1, "the decode on the recurrent op");
            for r in 0..lens.len() {
                let (want, next) = oracle.run(&x[r * HIDDEN..(r + 1) * HIDDEN], &tracked[r]);
                for (route, out) in outs.iter().enumerate() {
                    record("decode", route, &out[r * HIDDEN..(r + 1) * HIDDEN], &want);
                }
                tracked[r] = next;
            }
        }
        for (r, &slot) in slots.iter().enumerate() {
            let want = tracked[r].v_first(HEADS, HEAD_DIM);
            let block = HEADS * HEAD_DIM * HEAD_DIM;
            let states = [asc.states(), reference.states()];
            for (route, s) in states.iter().enumerate() {
                record("state", route, &s[slot * block..(slot + 1) * block], &want);
            }
        }

        eprintln!("k3 = {k3}: share of Tolerance::layer per (route, stage): {stages:?}");
        for (route, (usage, err)) in worst.iter().enumerate() {
            eprintln!(
                "k3 = {k3}, {}: {usage:.3} of Tolerance::layer used, largest error {err:.3e} of \
                 the largest magnitude",
                ["vendor route", "reference"][route]
            );
        }
    }
}
