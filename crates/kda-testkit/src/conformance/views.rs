//! Views (narrow, split, reshape) on device tensors: no copies, the right elements, and errors
//! for views that do not fit.

use kda_core::{Backend, BufferHandle, DType, Error, Layout, Op, Tensor, ViewError};

use super::Factory;
use super::gemm::download_f64;
use super::mx::upload_floats;

/// Views keep the buffer (same id) and describe it with the expected strides and offsets.
pub fn share_the_buffer<B: Backend>(make: &impl Factory<B>) {
    let b = make();
    // The K3 TP8 fused BFG output, [T, lh + 2*lp] = [4, 12 + 1536 + 1536].
    let bfg = b.alloc(DType::BF16, &[4, 3084]).unwrap();
    let parts = bfg.split(1, &[12, 1536, 1536]).unwrap();
    for p in &parts {
        assert_eq!(p.buffer().id(), bfg.buffer().id());
        assert_eq!(p.layout().strides(), &[3084, 1]);
    }
    assert_eq!(parts.iter().map(|p| p.layout().offset()).collect::<Vec<_>>(), vec![0, 12, 1548]);
    let g1 = parts[1].split_heads(1, 12).unwrap().reshape(&[1, 4, 12, 128]).unwrap();
    assert_eq!(g1.buffer().id(), bfg.buffer().id());
    assert_eq!(
        (g1.shape(), g1.layout().strides()),
        (&[1, 4, 12, 128][..], &[4 * 3084, 3084, 128, 1][..])
    );
    let row = bfg.narrow(0, 2, 1).unwrap();
    assert_eq!(row.layout().offset(), 2 * 3084);
    assert!(row.layout().is_contiguous());
    // Byte spans follow the dtype: bf16 is two bytes an element.
    assert_eq!(parts[2].byte_span(), 1548 * 2..(3 * 3084 + 3084) * 2);
}

/// Copies out of and fills into strided views touch exactly the viewed elements.
pub fn copy_and_fill_address_the_right_elements<B: Backend>(make: &impl Factory<B>) {
    let b = make();
    let s = b.new_stream().unwrap();
    let (rows, cols) = (3, 10);
    let m = b.alloc(DType::I32, &[rows, cols]).unwrap();
    let values: Vec<i32> = (0..(rows * cols) as i32).collect();
    b.upload(&s, &m, &values).unwrap();

    // Copy columns 4..9 as [rows, 2 heads, 3] into a dense tensor.
    let heads = m.narrow(1, 4, 6).unwrap().split_heads(1, 2).unwrap();
    let dense = b.alloc(DType::I32, &[rows, 2, 3]).unwrap();
    b.launch(&s, Op::Copy { src: heads, dst: dense.clone() }).unwrap();
    let got: Vec<i32> = b.download(&s, &dense).unwrap();
    let expected: Vec<i32> =
        (0..rows as i32).flat_map(|r| (4..10).map(move |c| r * 10 + c)).collect();
    assert_eq!(got, expected);

    // Fill column 1 and the last row; everything else keeps its value.
    b.launch(&s, Op::Fill { dst: m.narrow(1, 1, 1).unwrap(), value: -1.0 }).unwrap();
    b.launch(&s, Op::Fill { dst: m.narrow(0, 2, 1).unwrap(), value: -2.0 }).unwrap();
    let got: Vec<i32> = b.download(&s, &m).unwrap();
    let expected: Vec<i32> = values
        .iter()
        .enumerate()
        .map(|(i, &v)| match (i / cols, i % cols) {
            (2, _) => -2,
            (_, 1) => -1,
            _ => v,
        })
        .collect();
    assert_eq!(got, expected);

    // A transposed view downloads in its own logical order.
    let t = Tensor::new(
        m.buffer().clone(),
        Layout::strided(DType::I32, &[cols, rows], &[1, cols], 0).unwrap(),
    )
    .unwrap();
    let got: Vec<i32> = b.download(&s, &t).unwrap();
    assert_eq!(got[..3], [expected[0], expected[10], expected[20]]);
}

/// A copy between two float dtypes converts every element of a strided view: widening exactly,
/// narrowing to nearest-even, overflow to infinity, subnormals and NaN kept. The expected values
/// come from `half`'s conversions on the host.
pub fn copy_converts_between_float_dtypes<B: Backend>(make: &impl Factory<B>) {
    let b = make();
    let s = b.new_stream().unwrap();
    // Ties to even in bf16 and f16, values past f16's range, subnormals of each, and NaN.
    let values: Vec<f32> = vec![
        1.0,
        -2.5,
        f32::from_bits(0x3f80_8000), // halfway between two bf16: rounds to the even one
        f32::from_bits(0x3f81_8000), // halfway: rounds up to the even one
        1.000_488_3,                 // 1 + 2^-11: halfway between two f16
        65520.0,                     // rounds past f16's largest finite value
        -1.0e6,
        5.960_464_5e-8, // f16's smallest subnormal
        1.0e-40,        // an f32 subnormal
        f32::NAN,
        f32::INFINITY,
        -0.0,
    ];
    let n = values.len();
    let as_f64 = |dtype: DType, v: f32| -> f64 {
        match dtype {
            DType::BF16 => f64::from(half::bf16::from_f32(v)),
            DType::F16 => f64::from(half::f16::from_f32(v)),
            _ => f64::from(v),
        }
    };
    for from in [DType::F32, DType::BF16, DType::F16] {
        for to in [DType::F32, DType::BF16, DType::F16] {
            // The source: the values in `from`, at the odd columns of a [n, 2] tensor.
            let interleaved: Vec<f32> = values.iter().flat_map(|&v| [7.0, v]).collect();
            let (src, _) = upload_floats(&b, &s, from, &[n, 2], &interleaved);
            let dst = b.alloc(to, &[n]).unwrap();
            let view =
                Tensor::new(src.buffer().clone(), Layout::strided(from, &[n], &[2], 1).unwrap())
                    .unwrap();
            b.launch(&s, Op::Copy { src: view, dst: dst.clone() }).unwrap();
            let got = download_f64(&b, &s, &dst);
            for (i, &v) in values.iter().enumerate() {
                // What the source holds, then that value narrowed to `to`, both by `half`.
                let held = as_f64(from, v) as f32;
                let want = as_f64(to, held);
                let same = got[i].to_bits() == want.to_bits() || (got[i].is_nan() && want.is_nan());
                assert!(
                    same,
                    "{from} -> {to}, element {i} ({v:e}): got {:e}, want {want:e}",
                    got[i]
                );
            }
        }
    }
}

/// Out-of-range views, mismatched transfers and copies, and unrepresentable fill values are
/// errors, not panics.
pub fn bad_input_is_an_error<B: Backend>(make: &impl Factory<B>) {
    let b = make();
    let s = b.new_stream().unwrap();
    let t = b.alloc(DType::F32, &[4, 6]).unwrap();
    assert!(matches!(
        t.narrow(1, 5, 2),
        Err(Error::View(ViewError::RangeOutOfBounds { dim: 1, size: 6, .. }))
    ));
    assert!(matches!(
        t.narrow(2, 0, 1),
        Err(Error::View(ViewError::DimOutOfRange { dim: 2, rank: 2, .. }))
    ));
    assert!(matches!(t.split(0, &[1, 2]), Err(Error::View(ViewError::SplitSizes { .. }))));
    assert!(matches!(t.reshape(&[5, 5]), Err(Error::View(ViewError::ReshapeNumel { .. }))));
    assert!(matches!(t.split_heads(1, 4), Err(Error::View(ViewError::HeadsDoNotDivide { .. }))));
    let past_end = Layout::strided(DType::F32, &[4, 6], &[6, 1], 1).unwrap();
    assert!(matches!(
        Tensor::<B>::new(t.buffer().clone(), past_end),
        Err(Error::OutOfBounds { len: 96, needed: (4, 100), .. })
    ));

    match b.upload(&s, &t, &[0f32; 5]) {
        Err(Error::HostSize { op: "upload", expected: 96, actual: 20, .. }) => {}
        other => panic!("short upload: {other:?}"),
    }
    match b.upload(&s, &t, &[0i32; 24]) {
        Err(Error::DType { op: "upload", actual: DType::I32, .. }) => {}
        other => panic!("upload of the wrong type: {other:?}"),
    }
    // A copy converts between floats only.
    let other = b.alloc(DType::I32, &[4, 6]).unwrap();
    match b.launch(&s, Op::Copy { src: t.clone(), dst: other }) {
        Err(Error::DType { op: "copy", param: "dst", actual: DType::I32, .. }) => {}
        other => panic!("copy from f32 to i32: {other:?}"),
    }
    match b.launch(&s, Op::Copy { src: t.clone(), dst: b.alloc(DType::F32, &[6, 4]).unwrap() }) {
        Err(Error::Shape { op: "copy", param: "dst", actual, .. }) => {
            assert_eq!(actual, vec![6, 4])
        }
        other => panic!("copy across shapes: {other:?}"),
    }
    let bytes = b.alloc(DType::U8, &[3]).unwrap();
    for bad in [256.0, -1.0, 0.5, f64::NAN] {
        match b.launch(&s, Op::Fill { dst: bytes.clone(), value: bad }) {
            Err(Error::Value { op: "fill", dtype: DType::U8, .. }) => {}
            other => panic!("fill u8 with {bad}: {other:?}"),
        }
    }
    match b.launch(&s, Op::Fill { dst: b.alloc(DType::BF16, &[1]).unwrap(), value: 1e300 }) {
        Err(Error::Value { op: "fill", dtype: DType::BF16, .. }) => {}
        other => panic!("fill bf16 with 1e300: {other:?}"),
    }
    b.synchronize(&s).expect("rejected ops never reach the stream");
}

/// This module's bodies, each registered for every backend: [`crate::conformance_tests!`] calls
/// this with the backend's factories. A public body missing here fails
/// `conformance::tests::every_body_is_registered`.
#[doc(hidden)]
#[macro_export]
macro_rules! conformance_views {
    ($plain:expr, $jittered:expr, $checked:expr) => {
        $crate::conformance_tests!(@tests
            views_share_the_buffer => views::share_the_buffer(&$plain),
            views_copy_and_fill_address_the_right_elements => views::copy_and_fill_address_the_right_elements(&$plain),
            views_copy_converts_between_float_dtypes => views::copy_converts_between_float_dtypes(&$plain),
            views_bad_input_is_an_error => views::bad_input_is_an_error(&$plain),
        );
    };
}
