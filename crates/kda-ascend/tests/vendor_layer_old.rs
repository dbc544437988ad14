//! A CANN release whose `aclnnRecurrentGatedDeltaRule` takes only a bf16 state
//! (`KDA_ACL_EMU_VENDOR_OPS=old`, in a test binary of its own: the variable is read by the
//! emulator and the backend remembers the rejection for the process): the layer with bf16 core
//! operands still runs its prefills on `aclnnChunkKdaFwd`, its decodes fall back to the
//! project's kernel after the op's phase one rejected the f32 state, and the results equal the
//! reference layer (`docs/ascend.md`, vendor operators).
#![cfg(feature = "emulated")]
#![allow(clippy::expect_used, clippy::unwrap_used, reason = "tests")]

use half::bf16;
use kda_ascend::{AscendBackend, AscendOptions};
use kda_core::{Backend, DType, Device, Op};
use kda_model::config::{KdaConfig, Tp};
use kda_model::layer::{BatchMeta, CoreOperands, KdaLayer, LayerOptions, RequestSlots, StateCache};
use kda_model::weights::{LayerWeights, LoadOptions, load_layer};
use kda_reference::ReferenceBackend;
use kda_testkit::checkpoint::{SyntheticCheckpoint, SyntheticSpec, scaled_config};
use kda_testkit::{Gen, Tolerance};

const HIDDEN: usize = 64;

fn calls(api: &str) -> usize {
    kda_acl_emu::calls_of_this_thread().iter().filter(|c| c.api == api).count()
}

fn weights() -> LayerWeights {
    let mut config = scaled_config(&KdaConfig::kimi_k3(), HIDDEN, 4, 16);
    config.rms_norm_eps = 1e-2;
    let source = SyntheticCheckpoint::new(SyntheticSpec::new(config.clone(), 41));
    load_layer(&source, &config, Tp::SINGLE, 0, LoadOptions::default()).unwrap().weights
}

/// Outputs of a prefill of 70 tokens and two decodes, then the cache's recurrent states.
fn run<B: Backend>(b: &Device<B>, w: &LayerWeights) -> (Vec<f64>, Vec<f64>) {
    let s = b.new_stream().unwrap();
    let options =
        LayerOptions { core_operands: Some(CoreOperands::Bf16), ..LayerOptions::default() };
    let layer = KdaLayer::new(b, &s, w, options).unwrap();
    let mut cache: StateCache<B> = layer.new_cache(&s, 4, 0).unwrap();
    let mut rng = Gen::new(9);
    let mut outs = Vec::new();
    let mut metas = vec![BatchMeta::prefills(&[70], &[1])];
    for at in [70, 71] {
        let mut meta = BatchMeta::empty();
        meta.push(1, at, RequestSlots::Single(1));
        metas.push(meta);
    }
    for meta in &metas {
        let rows = meta.num_actual_tokens;
        let x: Vec<bf16> =
            rng.normal_f32(rows * HIDDEN, 0.0, 1.0).into_iter().map(bf16::from_f32).collect();
        let xt = b.alloc(DType::BF16, &[rows, HIDDEN]).unwrap();
        b.upload(&s, &xt, &x).unwrap();
        let mut out = b.alloc(DType::F32, &[rows, HIDDEN]).unwrap();
        b.launch(&s, Op::Fill { dst: out.clone(), value: f64::NAN }).unwrap();
        layer.forward(&s, &xt, meta, &mut cache, &mut out).unwrap();
        outs.extend(b.download::<f32>(&s, &out).unwrap().into_iter().map(f64::from));
    }
    let states = b.download::<f32>(&s, cache.recurrent()).unwrap();
    (outs, states.into_iter().map(f64::from).collect())
}

#[test]
fn an_old_recurrent_op_is_probed_once_and_the_kernel_runs() {
    // SAFETY: the only test of this binary sets the variable before anything reads it.
    unsafe { std::env::set_var("KDA_ACL_EMU_VENDOR_OPS", "old") };
    let options = AscendOptions { checked: false, ..AscendOptions::default() };
    let b = AscendBackend::with_options(options).expect("ascend backend over the emulated runtime");
    let w = weights();
    let (out, states) = run(&b, &w);
    assert_eq!(calls("aclnnChunkKdaFwd"), 1, "the prefill on the vendor chunk op");
    assert_eq!(calls("aclnnRecurrentGatedDeltaRule"), 0, "no recurrent vendor call ran");
    assert_eq!(calls("kda_recurrent_step"), 2, "both decodes on the project's kernel");
    let (out_ref, states_ref) = run(&ReferenceBackend::new(), &w);
    // As in tests/vendor_layer.rs: the vendor chunk op keeps its intermediates in bf16 where
    // its kernels do, which the reference does not: the vendor route's own allowance.
    let max_abs = |x: &[f64]| x.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    let tolerance = |x: &[f64]| Tolerance::layer_bf16_intermediates(max_abs(x));
    tolerance(&out_ref).assert_close(&[72, HIDDEN], &out, &out_ref);
    tolerance(&states_ref).assert_close(&[4, 4, 16, 16], &states, &states_ref);
}
