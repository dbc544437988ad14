//! The dense GEMM `y = x · w^T` against the f64 oracle, at awkward and at real shapes, through
//! strided views, and with bad operands.

use half::{bf16, f16};
use kda_core::{Backend, DType, Device, Error, Layout, Op, Tensor};

use super::Factory;
use crate::oracle::{dot_abs_bound, gemm_f64_at};
use crate::{Gen, Tolerance};

const F32_UNIT_ROUNDOFF: f64 = 1.0 / (1u64 << 24) as f64;

/// Upload seeded uniform values of `dtype` into `t`; returns the exact values as f64.
pub fn fill_random<B: Backend>(
    b: &Device<B>,
    s: &B::Stream,
    rng: &mut Gen,
    t: &Tensor<B>,
) -> Vec<f64> {
    let n = t.numel();
    match t.dtype() {
        DType::F32 => {
            let v = rng.uniform_f32(n, -1.0, 1.0);
            b.upload(s, t, &v).unwrap();
            v.iter().map(|&x| f64::from(x)).collect()
        }
        DType::BF16 => {
            let v = rng.uniform_bf16(n, -1.0, 1.0);
            b.upload(s, t, &v).unwrap();
            v.iter().map(|&x| x.to_f64()).collect()
        }
        DType::F16 => {
            let v = rng.uniform_f16(n, -1.0, 1.0);
            b.upload(s, t, &v).unwrap();
            v.iter().map(|&x| x.to_f64()).collect()
        }
        other => panic!("fill_random: {other} is not a float dtype"),
    }
}

/// Download a float tensor as f64.
pub fn download_f64<B: Backend>(b: &Device<B>, s: &B::Stream, t: &Tensor<B>) -> Vec<f64> {
    match t.dtype() {
        DType::F32 => b.download::<f32>(s, t).unwrap().into_iter().map(f64::from).collect(),
        DType::BF16 => b.download::<bf16>(s, t).unwrap().into_iter().map(|v| v.to_f64()).collect(),
        DType::F16 => b.download::<f16>(s, t).unwrap().into_iter().map(|v| v.to_f64()).collect(),
        other => panic!("download_f64: {other} is not a float dtype"),
    }
}

/// The tolerance for GEMM outputs: fp32 accumulation error (the worst-case dot-product bound
/// over the checked entries) plus one rounding to the output dtype.
fn gemm_tolerance(y: DType, k: usize, max_sum_abs_products: f64) -> Tolerance {
    let base = Tolerance::for_dtype(y);
    base.with_abs(base.abs + dot_abs_bound(k, max_sum_abs_products, F32_UNIT_ROUNDOFF))
}

/// Run one GEMM of the given shape and dtypes and check the `(m, n)` entries in `entries`
/// (all of them when `None`) against the f64 oracle.
fn check_gemm<B: Backend>(
    b: &Device<B>,
    (m, n, k): (usize, usize, usize),
    (xd, wd, yd): (DType, DType, DType),
    entries: Option<Vec<(usize, usize)>>,
    seed: u64,
) {
    let s = b.new_stream().unwrap();
    let mut rng = Gen::new(seed);
    let x = b.alloc(xd, &[m, k]).unwrap();
    let w = b.alloc(wd, &[n, k]).unwrap();
    let y = b.alloc(yd, &[m, n]).unwrap();
    let xv = fill_random(b, &s, &mut rng, &x);
    let wv = fill_random(b, &s, &mut rng, &w);
    b.launch(&s, Op::Gemm { x, w, y: y.clone() }).unwrap();
    let got = download_f64(b, &s, &y);
    let entries =
        entries.unwrap_or_else(|| (0..m).flat_map(|i| (0..n).map(move |j| (i, j))).collect());
    let row = |v: &[f64], i: usize| v[i * k..(i + 1) * k].to_vec();
    let mut max_sum_abs = 0.0f64;
    let expected: Vec<f64> = entries
        .iter()
        .map(|&(i, j)| {
            let (xr, wr) = (row(&xv, i), row(&wv, j));
            max_sum_abs = max_sum_abs.max(xr.iter().zip(&wr).map(|(a, b)| (a * b).abs()).sum());
            gemm_f64_at(k, &xr, &wr)
        })
        .collect();
    let actual: Vec<f64> = entries.iter().map(|&(i, j)| got[i * n + j]).collect();
    if let Err(report) =
        gemm_tolerance(yd, k, max_sum_abs).compare(&[entries.len()], &actual, &expected)
    {
        panic!("gemm m={m} n={n} k={k} x={xd} w={wd} y={yd}: {report}");
    }
}

const FLOATS: [DType; 2] = [DType::F32, DType::BF16];

/// Every combination of f32/bf16 operands (and an f16 one) at shapes including M = 1, K = 1,
/// sizes that are not multiples of 8 or 16, and N larger than one widening block of weights.
pub fn matches_f64_at_small_shapes<B: Backend>(make: &impl Factory<B>) {
    let b = make();
    let shapes = [
        (1, 1, 1),
        (1, 5, 1),
        (3, 7, 17),
        (13, 9, 33),
        (16, 16, 16),
        (17, 23, 70),
        (1, 300, 129),
        (33, 260, 5),
    ];
    let mut seed = 0;
    for &shape in &shapes {
        for xd in FLOATS {
            for wd in FLOATS {
                for yd in FLOATS {
                    seed += 1;
                    check_gemm(&b, shape, (xd, wd, yd), None, seed);
                }
            }
        }
        check_gemm(&b, shape, (DType::F16, DType::BF16, DType::F16), None, seed + 1000);
    }
}

/// The Kimi K3 TP8 projection shapes (M = 256 tokens, K = 7168, N = 3084 fused BFG and
/// N = 4608 fused QKV), checked at three whole rows, three whole columns and 500 random entries.
pub fn matches_f64_at_k3_tp8_shapes<B: Backend>(make: &impl Factory<B>) {
    let b = make();
    let (m, k) = (256, 7168);
    for (n, dtypes) in [
        (3084, (DType::BF16, DType::BF16, DType::BF16)),
        (3084, (DType::F32, DType::F32, DType::F32)),
        (4608, (DType::BF16, DType::BF16, DType::F32)),
        (4608, (DType::F32, DType::BF16, DType::BF16)),
    ] {
        let mut rng = Gen::new(n as u64);
        let mut entries: Vec<(usize, usize)> = Vec::new();
        for i in [0, 137, m - 1] {
            entries.extend((0..n).map(|j| (i, j)));
        }
        for j in [0, n / 2, n - 1] {
            entries.extend((0..m).map(|i| (i, j)));
        }
        entries.extend((0..500).map(|_| (rng.uniform_usize(0, m), rng.uniform_usize(0, n))));
        check_gemm(&b, (m, n, k), dtypes, Some(entries), n as u64 + 1);
    }
}

/// x a column slice of a wider matrix, w a transposed view, y a column slice: the result lands
/// exactly in the slice and the bytes around it keep their sentinel.
pub fn reads_and_writes_strided_views<B: Backend>(make: &impl Factory<B>) {
    let b = make();
    let s = b.new_stream().unwrap();
    let (m, n, k) = (5, 19, 37);
    for yd in FLOATS {
        let mut rng = Gen::new(42);
        let x_wide = b.alloc(DType::F32, &[m, k + 3]).unwrap();
        let x_all = fill_random(&b, &s, &mut rng, &x_wide);
        let x = x_wide.narrow(1, 2, k).unwrap();
        // w^T stored as [k, n]; w is the transposed view [n, k] with strides [1, n].
        let wt = b.alloc(DType::BF16, &[k, n]).unwrap();
        let wt_all = fill_random(&b, &s, &mut rng, &wt);
        let w_layout = Layout::strided(DType::BF16, &[n, k], &[1, n], 0).unwrap();
        let w = Tensor::new(wt.buffer().clone(), w_layout).unwrap();
        let y_wide = b.alloc(yd, &[m, 2 * n + 1]).unwrap();
        b.launch(&s, Op::Fill { dst: y_wide.clone(), value: -7.0 }).unwrap();
        let y = y_wide.narrow(1, n + 1, n).unwrap();
        b.launch(&s, Op::Gemm { x, w, y }).unwrap();
        let got = download_f64(&b, &s, &y_wide);

        let mut expected = vec![-7.0; m * (2 * n + 1)];
        let mut max_sum_abs = 0.0f64;
        for i in 0..m {
            let xr: Vec<f64> = (0..k).map(|kk| x_all[i * (k + 3) + 2 + kk]).collect();
            for j in 0..n {
                let wr: Vec<f64> = (0..k).map(|kk| wt_all[kk * n + j]).collect();
                max_sum_abs = max_sum_abs.max(xr.iter().zip(&wr).map(|(a, b)| (a * b).abs()).sum());
                expected[i * (2 * n + 1) + n + 1 + j] = gemm_f64_at(k, &xr, &wr);
            }
        }
        gemm_tolerance(yd, k, max_sum_abs).assert_close(&[m, 2 * n + 1], &got, &expected);
    }
}

/// Shape, dtype and aliasing errors are returned by `launch`, naming the op and parameter.
pub fn rejects_bad_operands<B: Backend>(make: &impl Factory<B>) {
    let b = make();
    let s = b.new_stream().unwrap();
    let t = |d: DType, shape: &[usize]| b.alloc(d, shape).unwrap();
    let gemm = |x: Tensor<B>, w: Tensor<B>, y: Tensor<B>| b.launch(&s, Op::Gemm { x, w, y });
    let f = DType::F32;

    match gemm(t(f, &[2, 3]), t(f, &[4, 5]), t(f, &[2, 4])) {
        Err(Error::Shape { op: "gemm", param: "w", actual, .. }) => assert_eq!(actual, vec![4, 5]),
        other => panic!("K mismatch: {other:?}"),
    }
    match gemm(t(f, &[2, 3]), t(f, &[4, 3]), t(f, &[4, 2])) {
        Err(Error::Shape { op: "gemm", param: "y", expected, .. }) => {
            assert_eq!(expected, "[2, 4]")
        }
        other => panic!("y shape: {other:?}"),
    }
    match gemm(t(f, &[2, 3, 1]), t(f, &[4, 3]), t(f, &[2, 4])) {
        Err(Error::Shape { op: "gemm", param: "x", .. }) => {}
        other => panic!("rank-3 x: {other:?}"),
    }
    match gemm(t(DType::I32, &[2, 3]), t(f, &[4, 3]), t(f, &[2, 4])) {
        Err(Error::DType { op: "gemm", param: "x", actual: DType::I32, .. }) => {}
        other => panic!("i32 x: {other:?}"),
    }
    let both = t(f, &[2, 6]);
    let (x, y) = (both.narrow(1, 0, 3).unwrap(), both.narrow(1, 2, 3).unwrap());
    match gemm(x, t(f, &[3, 3]), y) {
        Err(Error::Aliasing { op: "gemm", param: "y", other: "x", .. }) => {}
        other => panic!("y overlapping x: {other:?}"),
    }
    let broadcast =
        Tensor::new(t(f, &[4]).buffer().clone(), Layout::strided(f, &[2, 4], &[0, 1], 0).unwrap())
            .unwrap();
    match gemm(t(f, &[2, 3]), t(f, &[4, 3]), broadcast) {
        Err(Error::SelfOverlap { op: "gemm", param: "y", .. }) => {}
        other => panic!("self-overlapping y: {other:?}"),
    }
    b.synchronize(&s).expect("rejected ops never reach the stream");
}

/// This module's bodies, each registered for every backend: [`crate::conformance_tests!`] calls
/// this with the backend's factories. A public body missing here fails
/// `conformance::tests::every_body_is_registered`.
#[doc(hidden)]
#[macro_export]
macro_rules! conformance_gemm {
    ($plain:expr, $jittered:expr, $checked:expr) => {
        $crate::conformance_tests!(@tests
            gemm_matches_f64_at_small_shapes => gemm::matches_f64_at_small_shapes(&$plain),
            gemm_matches_f64_at_k3_tp8_shapes => gemm::matches_f64_at_k3_tp8_shapes(&$plain),
            gemm_reads_and_writes_strided_views => gemm::reads_and_writes_strided_views(&$plain),
            gemm_rejects_bad_operands => gemm::rejects_bad_operands(&$plain),
        );
    };
}
