//! The reference layer with bf16 core operands (`docs/design/kda.md#core-operand-dtype`)
//! against the f64 layer oracle that rounds the same operands to bf16, over a prefill, decodes,
//! a speculative decode and a mixed batch; and the option really changes what the core stores.
#![allow(clippy::expect_used, clippy::unwrap_used, reason = "tests")]

use half::bf16;
use kda_core::{DType, Device, Op};
use kda_model::config::{KdaConfig, Tp};
use kda_model::layer::{BatchMeta, CoreOperands, KdaLayer, LayerOptions, RequestSlots, StateCache};
use kda_model::weights::{LayerWeights, LoadOptions, load_layer};
use kda_reference::ReferenceBackend;
use kda_testkit::checkpoint::{SyntheticCheckpoint, SyntheticSpec, scaled_config};
use kda_testkit::oracle_layer::{LayerOracle, RequestState};
use kda_testkit::{Gen, Tolerance};

const HIDDEN: usize = 64;
const HEADS: usize = 4;
const HEAD_DIM: usize = 16;

type R = ReferenceBackend;

fn weights(k3: bool) -> LayerWeights {
    let preset = if k3 { KdaConfig::kimi_k3() } else { KdaConfig::kimi_linear_48b() };
    let mut config = scaled_config(&preset, HIDDEN, HEADS, HEAD_DIM);
    config.rms_norm_eps = 1e-2;
    let source = SyntheticCheckpoint::new(SyntheticSpec::new(config.clone(), 31));
    load_layer(&source, &config, Tp::SINGLE, 0, LoadOptions::default()).unwrap().weights
}

fn layer(b: &Device<R>, s: &<R as kda_core::Resources>::Stream, w: &LayerWeights) -> KdaLayer<R> {
    let options =
        LayerOptions { core_operands: Some(CoreOperands::Bf16), ..LayerOptions::default() };
    KdaLayer::new(b, s, w, options).unwrap()
}

fn tokens(rng: &mut Gen, rows: usize) -> Vec<f32> {
    rng.normal_f32(rows * HIDDEN, 0.0, 1.0)
        .into_iter()
        .map(|x| bf16::from_f32(x).to_f32())
        .collect()
}

fn step(
    b: &Device<R>,
    s: &<R as kda_core::Resources>::Stream,
    layer: &KdaLayer<R>,
    cache: &mut StateCache<R>,
    meta: &BatchMeta,
    x: &[f32],
) -> Vec<f64> {
    let rows = x.len() / HIDDEN;
    let xt = b.alloc(DType::BF16, &[rows, HIDDEN]).unwrap();
    b.upload(s, &xt, &x.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>()).unwrap();
    let mut out = b.alloc(DType::F32, &[rows, HIDDEN]).unwrap();
    b.launch(s, Op::Fill { dst: out.clone(), value: f64::NAN }).unwrap();
    layer.forward(s, &xt, meta, cache, &mut out).unwrap();
    b.download::<f32>(s, &out).unwrap().into_iter().map(f64::from).collect()
}

/// The layer conformance suite's bound: the projection outputs are bf16 and one may round to
/// the other side of a midpoint than the oracle's; the same holds for each bf16 core operand
/// and the core output. 2^-8 relative plus 2^-8 of the largest magnitude.
fn check(what: &str, shape: &[usize], got: &[f64], want: &[f64]) {
    let max = want.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    if let Err(m) = Tolerance::new(1.0 / 256.0, max / 256.0).compare(shape, got, want) {
        panic!("{what}: {m}");
    }
}

fn rows(x: &[f32], r: std::ops::Range<usize>) -> &[f32] {
    &x[r.start * HIDDEN..r.end * HIDDEN]
}

#[test]
fn bf16_core_operands_match_the_f64_oracle() {
    for k3 in [true, false] {
        let w = weights(k3);
        let oracle = LayerOracle::new(&w, Default::default()).with_bf16_core_operands();
        let b = ReferenceBackend::new();
        let s = b.new_stream().unwrap();
        let layer = layer(&b, &s, &w);
        let mut cache = layer.new_cache(&s, 12, 2).unwrap();
        let mut rng = Gen::new(7);
        let slot = |c: &StateCache<R>, i: usize| -> Vec<f64> {
            let t = c.recurrent_slot(i).unwrap();
            b.download::<f32>(&s, &t).unwrap().into_iter().map(f64::from).collect()
        };
        let state_shape = [HEADS, HEAD_DIM, HEAD_DIM];
        let v_first = |st: &RequestState| st.v_first(HEADS, HEAD_DIM);

        // Prefills of 5, 67 and 3 tokens into slots 2, 5, 0.
        let x = tokens(&mut rng, 75);
        let out =
            step(&b, &s, &layer, &mut cache, &BatchMeta::prefills(&[5, 67, 3], &[2, 5, 0]), &x);
        let mut tracked = Vec::new();
        let mut at = 0;
        for (len, sl) in [(5, 2), (67, 5), (3, 0)] {
            let (want, st) = oracle.run(rows(&x, at..at + len), &oracle.fresh());
            check("prefill output", &[len, HIDDEN], &out[at * HIDDEN..(at + len) * HIDDEN], &want);
            check("prefill state", &state_shape, &slot(&cache, sl), &v_first(&st));
            tracked.push(st);
            at += len;
        }

        // Mixed: request 1 decodes, request 2 speculates over slots [0, 9, 10], request 0
        // continues by 6.
        let x = tokens(&mut rng, 10);
        let mut meta = BatchMeta::empty();
        meta.push(1, 67, RequestSlots::Single(5))
            .push(3, 3, RequestSlots::Speculative { slots: vec![0, 9, 10], num_accepted: 1 })
            .push(6, 5, RequestSlots::Single(2));
        let out = step(&b, &s, &layer, &mut cache, &meta, &x);
        let out_rows = |r: std::ops::Range<usize>| &out[r.start * HIDDEN..r.end * HIDDEN];
        let (want, st) = oracle.run(rows(&x, 0..1), &tracked[1]);
        check("decode output", &[1, HIDDEN], out_rows(0..1), &want);
        check("decode state", &state_shape, &slot(&cache, 5), &v_first(&st));
        let mut st = tracked[2].clone();
        for (t, sl) in [0usize, 9, 10].into_iter().enumerate() {
            let (want, next) = oracle.run(rows(&x, 1 + t..2 + t), &st);
            check("speculative output", &[1, HIDDEN], out_rows(1 + t..2 + t), &want);
            check("speculative state", &state_shape, &slot(&cache, sl), &v_first(&next));
            st = next;
        }
        let (want, st) = oracle.run(rows(&x, 4..10), &tracked[0]);
        check("continued prefill output", &[6, HIDDEN], out_rows(4..10), &want);
        check("continued prefill state", &state_shape, &slot(&cache, 2), &v_first(&st));
    }
}

#[test]
fn bf16_core_operands_store_a_bf16_core_output() {
    let w = weights(true);
    let b = ReferenceBackend::new();
    let s = b.new_stream().unwrap();
    let x = tokens(&mut Gen::new(8), 9);
    let meta = BatchMeta::prefills(&[9], &[0]);
    let mut cores = Vec::new();
    for operands in [CoreOperands::F32, CoreOperands::Bf16] {
        let options = LayerOptions { core_operands: Some(operands), ..LayerOptions::default() };
        let layer = KdaLayer::new(&b, &s, &w, options).unwrap();
        assert_eq!(layer.core_operands(), operands);
        let mut cache = layer.new_cache(&s, 1, 0).unwrap();
        let xt = b.alloc(DType::BF16, &[9, HIDDEN]).unwrap();
        b.upload(&s, &xt, &x.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>()).unwrap();
        let mut out = b.alloc(DType::F32, &[9, HIDDEN]).unwrap();
        let trace = layer.forward_traced(&s, &xt, &meta, &mut cache, &mut out).unwrap().unwrap();
        assert_eq!(trace.core_attn_out.dtype(), operands.dtype(), "{operands:?}");
        assert_eq!(trace.beta.dtype(), operands.dtype(), "{operands:?}: beta");
        let core: Vec<f32> = match operands {
            CoreOperands::F32 => b.download::<f32>(&s, &trace.core_attn_out).unwrap(),
            CoreOperands::Bf16 => {
                let v = b.download::<bf16>(&s, &trace.core_attn_out).unwrap();
                v.into_iter().map(bf16::to_f32).collect()
            }
        };
        cores.push(core);
    }
    // The bf16 core differs from the f32 one, and by no more than bf16's rounding of the
    // operands explains.
    let (f, h) = (&cores[0], &cores[1]);
    assert!(f.iter().zip(h).any(|(a, b)| a != b), "the option changes the core output");
    let want: Vec<f64> = f.iter().map(|&v| f64::from(v)).collect();
    let got: Vec<f64> = h.iter().map(|&v| f64::from(v)).collect();
    check("bf16 core against f32 core", &[9, HEADS, HEAD_DIM], &got, &want);
}
