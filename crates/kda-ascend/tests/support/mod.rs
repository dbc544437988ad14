//! Shared by the vendor-route test binaries (each needs a process of its own: the release and
//! symbol table are read once per process).

use std::sync::Arc;

use half::bf16;
use kda_core::kda::{ChunkHostMeta, KdaChunk};
use kda_core::{Backend, DType, Device, Op};
use kda_testkit::Gen;

/// A bf16 chunk of two requests (20 and 70 tokens) with host metadata: what the vendor op takes.
pub fn run<B: Backend>(b: &Device<B>) -> (Vec<f32>, Vec<f32>) {
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
