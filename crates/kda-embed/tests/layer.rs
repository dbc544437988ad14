//! The embedded layer on engine-owned host arrays equals the plain Rust API bit for bit, reads
//! its input in place where the layout allows, and a rejected call changes nothing.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test setup")]

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use kda_core::DType;
use kda_embed::testing::{LayerSpec, Step, reference_run, write_synthetic_checkpoint};
use kda_embed::{BatchArgs, ErrorKind, ForeignArray, Import, Layer, Memory, Runtime, SlotsArg};
use kda_model::schedule::ProjectionSchedule;

/// An engine's f32 array: its memory, shared with the test so it can read the result.
type Shared = Arc<Mutex<Vec<f32>>>;

fn array(data: &Shared, shape: &[usize], strides: Option<Vec<isize>>) -> ForeignArray {
    let ptr = data.lock().unwrap().as_mut_ptr().cast::<u8>();
    // SAFETY: the `Arc` owner keeps the vector alive and unmoved; the test reads it only after
    // the (synchronous) forward returns.
    unsafe {
        ForeignArray::new(
            ptr,
            DType::F32,
            shape.to_vec(),
            strides,
            Memory::Host,
            Box::new(data.clone()),
        )
    }
    .unwrap()
}

fn checkpoint() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("embed-layer");
    write_synthetic_checkpoint(&dir, "tiny", 3).unwrap();
    dir
}

fn values(n: usize, seed: u64) -> Vec<f32> {
    kda_synth::Gen::new(seed).uniform_f32(n, -0.5, 0.5)
}

#[test]
fn embedded_forward_equals_the_rust_api_in_place_and_rejects_cleanly() {
    let dir = checkpoint();
    let runtime = Runtime::new("reference", 0).unwrap();
    let layer = Layer::load(&runtime, &dir, 0, 1, 0, ProjectionSchedule::Overlapped).unwrap();
    let hidden = layer.info().hidden_size;
    let cache = layer.new_cache(3, 0).unwrap();
    let rows = 9;
    let x: Shared = Arc::new(Mutex::new(values(rows * hidden, 7)));
    let out: Shared = Arc::new(Mutex::new(vec![f32::NAN; rows * hidden]));
    let batch = BatchArgs {
        query_start_loc: vec![0, 4, 7],
        slots: Some(vec![SlotsArg::Single(2), SlotsArg::Single(0)]),
        ..BatchArgs::default()
    };
    // SAFETY: `array`'s contract holds; no engine stream.
    let report = unsafe {
        layer.forward(
            array(&x, &[rows, hidden], None),
            &batch,
            &cache,
            array(&out, &[rows, hidden], None),
            None,
        )
    }
    .unwrap();
    assert_eq!(report.hidden_states, Import::InPlace);

    let spec = LayerSpec {
        dir: &dir,
        layer: 0,
        tp_size: 1,
        tp_rank: 0,
        schedule: ProjectionSchedule::Overlapped,
    };
    let step =
        Step { hidden: x.lock().unwrap().clone(), dtype: DType::F32, rows, batch: batch.clone() };
    let rust = reference_run(&spec, 3, 0, &[step]).unwrap();
    assert_eq!(*out.lock().unwrap(), rust.outputs[0], "written in place, bit for bit");
    let states: Vec<f32> = (0..3).flat_map(|s| cache.recurrent_state(&layer, s).unwrap()).collect();
    assert_eq!(states, rust.states);

    // A column-major copy of the same input is read through a copy, with the same result.
    let mut transposed = vec![0f32; rows * hidden];
    for (i, v) in x.lock().unwrap().iter().enumerate() {
        transposed[(i % hidden) * rows + i / hidden] = *v;
    }
    let xt: Shared = Arc::new(Mutex::new(transposed));
    let out2: Shared = Arc::new(Mutex::new(vec![0.0; rows * hidden]));
    let fresh = layer.new_cache(3, 0).unwrap();
    let strides = Some(vec![1, rows as isize]);
    // SAFETY: as above.
    let report = unsafe {
        layer.forward(
            array(&xt, &[rows, hidden], strides),
            &batch,
            &fresh,
            array(&out2, &[rows, hidden], None),
            None,
        )
    }
    .unwrap();
    assert_eq!(report.hidden_states, Import::Copied);
    assert_eq!(*out2.lock().unwrap(), rust.outputs[0]);

    // A rejected call (slot out of range) leaves the cache and `out` as they were.
    let before = out.lock().unwrap().clone();
    let bad = BatchArgs {
        query_start_loc: vec![0, 9],
        slots: Some(vec![SlotsArg::Single(3)]),
        ..BatchArgs::default()
    };
    // SAFETY: as above.
    let err = unsafe {
        layer.forward(
            array(&x, &[rows, hidden], None),
            &bad,
            &cache,
            array(&out, &[rows, hidden], None),
            None,
        )
    }
    .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Metadata);
    assert_eq!(err.message(), "batch metadata: request 0 uses slot 3, but the cache has 3 slots");
    assert_eq!(*out.lock().unwrap(), before);
    let after: Vec<f32> = (0..3).flat_map(|s| cache.recurrent_state(&layer, s).unwrap()).collect();
    assert_eq!(after, rust.states);
}

#[test]
fn backends_and_options_are_checked_by_name() {
    let err = Runtime::new("tpu", 0).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Argument);
    assert_eq!(err.message(), r#"backend: "tpu" is not one of "reference", "cuda" or "ascend""#);
    if let Err(e) = Runtime::new("cuda", 0) {
        assert!(matches!(e.kind(), ErrorKind::Unsupported | ErrorKind::Backend), "{e}");
    }
    assert_eq!(kda_embed::parse_schedule("both").unwrap_err().kind(), ErrorKind::Argument);
    let panicked = kda_embed::guard::<()>(|| panic!("boom"));
    assert_eq!(panicked.unwrap_err().kind(), ErrorKind::Internal);
}
