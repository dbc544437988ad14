use kda_core::{Backend, DType, Op};
use kda_reference::ReferenceBackend;

#[test]
fn gemm_smoke() {
    let b = ReferenceBackend::new();
    let s = b.new_stream().unwrap();
    let x = b.alloc(DType::F32, &[2, 3]).unwrap();
    let w = b.alloc(DType::BF16, &[2, 3]).unwrap();
    let y = b.alloc(DType::F32, &[2, 2]).unwrap();
    b.upload(&s, &x, &[1f32, 2., 3., 4., 5., 6.]).unwrap();
    b.upload(&s, &w, &[1f32, 0., 0., 0., 1., 1.].map(half::bf16::from_f32)).unwrap();
    b.launch(&s, Op::Gemm { x: x.clone(), w: w.clone(), y: y.clone() }).unwrap();
    let out: Vec<f32> = b.download(&s, &y).unwrap();
    assert_eq!(out, vec![1., 5., 4., 11.]);
}
