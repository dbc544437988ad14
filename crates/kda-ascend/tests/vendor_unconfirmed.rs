//! A CANN release whose vendor-op prototypes are not confirmed (an install record saying
//! CANN 8.3, in a test binary of its own: the release is read once per process): the ops are
//! present, but the backend does not call them — `kda info` says why — and a `KdaChunk` the
//! vendor op would take runs on the project's kernel, equal to the reference
//! (`docs/ascend.md`, vendor operators).
#![cfg(feature = "emulated")]
#![allow(clippy::expect_used, clippy::unwrap_used, reason = "tests")]

use std::sync::Arc;

use half::bf16;
use kda_ascend::{AscendBackend, AscendOptions};
use kda_core::kda::{CHUNK_SIZE, ChunkHostMeta, KdaChunk};
use kda_core::{Backend, DType, Device, Op};
use kda_reference::ReferenceBackend;
use kda_testkit::Gen;
use kda_testkit::oracle_kda::{max_abs, recurrence_tolerance};

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
fn an_unconfirmed_prototype_runs_the_projects_kernel_and_info_says_why() {
    let root = std::env::temp_dir().join(format!("kda-cann83-{}", std::process::id()));
    let record = root.join(format!("{}-linux", std::env::consts::ARCH));
    std::fs::create_dir_all(&record).unwrap();
    std::fs::write(record.join("ascend_ops_install.info"), "version=8.3.RC1\n").unwrap();
    // SAFETY: the only test of this binary sets the variables before anything reads them.
    unsafe {
        std::env::set_var("ASCEND_TOOLKIT_HOME", &root);
        std::env::remove_var("KDA_ASCEND_VENDOR_OPS");
    }
    let options = AscendOptions { checked: false, ..AscendOptions::default() };
    let b = AscendBackend::with_options(options).expect("ascend backend over the emulated runtime");
    assert!(b.raw().absent_symbols().iter().all(|s| !s.contains("Kda")), "the ops are present");
    let caps = b.info().capabilities;
    assert!(!caps.bf16_core, "no bf16 core without the vendor op");
    assert!(
        caps.execution.contains(
            "kda kernels instead: aclnnChunkKdaFwd's prototype is not confirmed for CANN 8.3"
        ),
        "{}",
        caps.execution
    );
    assert!(
        caps.execution.contains("aclnnRecurrentGatedDeltaRule's prototype"),
        "{}",
        caps.execution
    );
    let (o, state) = run(&b);
    let calls = kda_acl_emu::calls_of_this_thread();
    assert!(calls.iter().all(|c| c.api != "aclnnChunkKdaFwd"), "no vendor call");
    assert!(calls.iter().any(|c| c.api == "kda_chunk_prefill"), "the project's kernel ran");
    let (o_ref, state_ref) = run(&ReferenceBackend::new());
    // The kernel's own arithmetic (executed under the AscendC twin) against the reference's:
    // equal within the recurrence's fp32 rounding bound, as in the conformance suite.
    let tol = |want: &[f32]| {
        let wide: Vec<f64> = want.iter().map(|&v| f64::from(v)).collect();
        recurrence_tolerance(90, 16, CHUNK_SIZE, max_abs(&wide))
    };
    tol(&o_ref).assert_close(&[90, 2, 16], &o, &o_ref);
    tol(&state_ref).assert_close(&[2, 2, 16, 16], &state, &state_ref);
    let _ = std::fs::remove_dir_all(&root);
}
