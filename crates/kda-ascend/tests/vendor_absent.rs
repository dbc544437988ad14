//! A CANN release without the vendor KDA operators (`KDA_ACL_EMU_VENDOR_OPS=none`, in a test
//! binary of its own: the symbol table is installed once per process): the backend reports them
//! absent and a `KdaChunk` the vendor op would take runs on the project's kernel, equal to the
//! reference (`docs/ascend.md`, vendor operators).
#![cfg(feature = "emulated")]
#![allow(clippy::expect_used, clippy::unwrap_used, reason = "tests")]

use std::sync::Arc;

use half::bf16;
use kda_ascend::{AscendBackend, AscendOptions};
use kda_core::kda::{ChunkHostMeta, KdaChunk};
use kda_core::{Backend, DType, Device, Op};
use kda_reference::ReferenceBackend;
use kda_testkit::oracle_kda::{max_abs, recurrence_tolerance};
use kda_testkit::{Gen, Tolerance};

/// A bf16 chunk of two requests (20 and 70 tokens) with host metadata: what the vendor op takes.
fn run<B: Backend>(b: &Device<B>) -> (Vec<f32>, Vec<f32>) {
    let s = b.new_stream().unwrap();
    let (t, h, d) = (90, 2, 16);
    let mut rng = Gen::new(3);
    let bf = |shape: &[usize], v: Vec<f32>| {
        let x = b.alloc(DType::BF16, shape).unwrap();
        b.upload(&s, &x, &v.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>()).unwrap();
        x
    };
    let f32s = |shape: &[usize], v: Vec<f32>| {
        let x = b.alloc(DType::F32, shape).unwrap();
        b.upload(&s, &x, &v).unwrap();
        x
    };
    let ints = |v: &[i32]| {
        let x = b.alloc(DType::I32, &[v.len()]).unwrap();
        b.upload(&s, &x, v).unwrap();
        x
    };
    let (cu, slots, init) = ([0, 20, 90], [1, 0], [1, 0]);
    let state = f32s(&[2, h, d, d], rng.uniform_f32(2 * h * d * d, -1.0, 1.0));
    let o = b.alloc(DType::BF16, &[t, h, d]).unwrap();
    let op = KdaChunk {
        q: bf(&[t, h, d], rng.uniform_f32(t * h * d, -1.0, 1.0)),
        k: bf(&[t, h, d], rng.uniform_f32(t * h * d, -1.0, 1.0)),
        v: bf(&[t, h, d], rng.uniform_f32(t * h * d, -1.0, 1.0)),
        g: f32s(&[t, h, d], rng.uniform_f32(t * h * d, -1.0, 0.0)),
        gate: None,
        beta: f32s(&[t, h], rng.uniform_f32(t * h, 0.0, 1.0)),
        cu_seqlens: ints(&cu),
        state_slots: ints(&slots),
        has_initial_state: ints(&init),
        chunk_state_slots: None,
        host_meta: Some(ChunkHostMeta {
            cu_seqlens: Arc::from(cu),
            state_slots: Arc::from(slots),
            has_initial_state: Arc::from(init),
        }),
        state: state.clone(),
        o: o.clone(),
        scale: 0.25,
        qk_l2norm: true,
    };
    b.launch(&s, Op::KdaChunk(op)).unwrap();
    let o = b.download::<bf16>(&s, &o).unwrap().iter().map(|x| x.to_f32()).collect();
    (o, b.download::<f32>(&s, &state).unwrap())
}

#[test]
fn without_the_vendor_ops_the_chunk_runs_the_projects_kernel() {
    // SAFETY: the only test of this binary sets the variable before anything reads it.
    unsafe { std::env::set_var("KDA_ACL_EMU_VENDOR_OPS", "none") };
    let options = AscendOptions { checked: false, ..AscendOptions::default() };
    let b = AscendBackend::with_options(options).expect("ascend backend over the emulated runtime");
    let absent = b.raw().absent_symbols().to_vec();
    for symbol in ["aclnnChunkKdaFwd", "aclnnRecurrentGatedDeltaRule"] {
        assert!(absent.contains(&symbol), "{symbol} reported absent: {absent:?}");
    }
    let (o, state) = run(&b);
    let calls = kda_acl_emu::calls_of_this_thread();
    assert!(calls.iter().all(|c| c.api != "aclnnChunkKdaFwd"), "no vendor call");
    assert!(calls.iter().any(|c| c.api == "kda_chunk_prefill"), "the project's kernel ran");
    let (o_ref, state_ref) = run(&ReferenceBackend::new());
    // The kernel runs the recurrence token by token (under the twin), the reference in chunks:
    // equal within the recurrence's f32 bound, the bf16 output within one bf16 rounding more.
    let f64s = |v: &[f32]| v.iter().map(|&x| f64::from(x)).collect::<Vec<_>>();
    let (o, o_ref, state, state_ref) = (f64s(&o), f64s(&o_ref), f64s(&state), f64s(&state_ref));
    let rec = |r: &[f64]| recurrence_tolerance(90, 16, 64, max_abs(r));
    let bf16 = Tolerance::for_dtype(DType::BF16);
    bf16.with_abs(bf16.abs + rec(&o_ref).abs).assert_close(&[90, 2, 16], &o, &o_ref);
    rec(&state_ref).assert_close(&[2, 2, 16, 16], &state, &state_ref);
}
