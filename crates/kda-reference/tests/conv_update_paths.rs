//! The conv update's two paths give the same bits: the in-place one (an f32 cache whose slots
//! are contiguous, the weights as the layer stores them, `[W, C]` seen transposed) against the
//! copying one (the same values in a cache whose slots are not contiguous, the weights as a
//! plain `[C, W]` tensor), for decode and speculative updates with a padding request, at conv
//! widths 1, 2 and 4.
#![allow(clippy::expect_used, clippy::unwrap_used, reason = "tests")]

use kda_core::kda::CausalConvUpdate;
use kda_core::layout::Layout;
use kda_core::{DType, Device, Op, Tensor};
use kda_reference::ReferenceBackend;
use kda_testkit::Gen;

type R = ReferenceBackend;
type S = <R as kda_core::Resources>::Stream;

const C: usize = 24;

fn upload(b: &Device<R>, s: &S, shape: &[usize], values: &[f32]) -> Tensor<R> {
    let t = b.alloc(DType::F32, shape).unwrap();
    b.upload(s, &t, values).unwrap();
    t
}

fn upload_i32(b: &Device<R>, s: &S, values: &[i32]) -> Tensor<R> {
    let t = b.alloc(DType::I32, &[values.len()]).unwrap();
    b.upload(s, &t, values).unwrap();
    t
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// One update of `x` (`[B, n, C]`) over `state` (`[slots, L, C]` values), both ways: the outputs
/// and the state after, in place and copied.
fn both_paths(
    w: usize,
    (batch, n, slots, len): (usize, usize, usize, usize),
    slot_of: &[i32],
    accepted: Option<&[i32]>,
    seed: u64,
) -> [(Vec<f32>, Vec<f32>); 2] {
    let b = ReferenceBackend::new();
    let s = b.new_stream().unwrap();
    let mut rng = Gen::new(seed);
    let weight = rng.uniform_f32(C * w, -0.7, 0.7);
    let x = rng.uniform_f32(batch * n * C, -2.0, 2.0);
    let state = rng.uniform_f32(slots * len * C, -1.0, 1.0);
    let by_tap: Vec<f32> = (0..w * C).map(|i| weight[(i % C) * w + i / C]).collect();
    let packed = upload(&b, &s, &[w, C], &by_tap);
    let transposed = Layout::strided(DType::F32, &[C, w], &[1, C], 0).unwrap();
    let weights = [
        Tensor::new(packed.buffer().clone(), transposed).unwrap(),
        upload(&b, &s, &[C, w], &weight),
    ];
    // The second cache holds each row's C values in the first half of a 2C-wide row.
    let wide: Vec<f32> = state
        .chunks(C)
        .flat_map(|row| row.iter().copied().chain(std::iter::repeat_n(9.0, C)))
        .collect();
    let wide = upload(&b, &s, &[slots, len, 2 * C], &wide).narrow(2, 0, C).unwrap();
    let states = [upload(&b, &s, &[slots, len, C], &state), wide];
    let mut out = Vec::new();
    for (weight, state) in weights.into_iter().zip(states) {
        let y = b.alloc(DType::F32, &[batch, n, C]).unwrap();
        b.launch(&s, Op::Fill { dst: y.clone(), value: f64::NAN }).unwrap();
        let op = CausalConvUpdate {
            x: upload(&b, &s, &[batch, n, C], &x),
            weight,
            state_slots: upload_i32(&b, &s, slot_of),
            num_accepted_tokens: accepted.map(|a| upload_i32(&b, &s, a)),
            state: state.clone(),
            y: y.clone(),
        };
        b.launch(&s, Op::CausalConvUpdate(op)).unwrap();
        out.push((b.download::<f32>(&s, &y).unwrap(), b.download::<f32>(&s, &state).unwrap()));
    }
    let copied = out.pop().unwrap();
    [out.pop().unwrap(), copied]
}

#[test]
fn in_place_and_copying_updates_give_the_same_bits() {
    for w in [1, 2, 4] {
        // Decode: four requests in permuted slots, one of them padding (-1).
        let decode = ((4, 1, 6, (w - 1).max(1)), &[4, 0, -1, 2][..], None);
        // Speculative: three tokens per request, history read after 1, 2 and 3 accepted tokens.
        let spec = ((3, 3, 4, w - 1 + 2), &[1, 3, 0][..], Some(&[1, 2, 3][..]));
        for (case, (dims, slots, accepted)) in [decode, spec].into_iter().enumerate() {
            let [(y_in, state_in), (y_copy, state_copy)] =
                both_paths(w, dims, slots, accepted, (10 * w + case) as u64);
            let what = format!("W {w}, case {case}");
            assert!(y_in.iter().all(|v| v.is_finite()), "{what}: every output written");
            assert_eq!(bits(&y_in), bits(&y_copy), "{what}: outputs");
            assert_eq!(bits(&state_in), bits(&state_copy), "{what}: states");
        }
    }
}
