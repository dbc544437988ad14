//! Memory an engine owns, imported without a copy: read by a GEMM, written by another op, and
//! its owner kept alive until the last op that holds it has run.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test setup")]

use std::sync::{Arc, Barrier, Mutex};

use kda_core::{DType, Error, HostFn, Layout, Op, Tensor};
use kda_reference::{ExecutionMode, ReferenceBackend, ReferenceOptions};

/// What an engine array held when it was dropped (`None` while it lives).
type Last = Arc<Mutex<Option<Vec<f32>>>>;

/// The engine's array: its memory, and where its drop leaves its last contents.
struct EngineArray {
    data: Vec<f32>,
    last: Last,
}

impl Drop for EngineArray {
    fn drop(&mut self) {
        *self.last.lock().unwrap() = Some(self.data.clone());
    }
}

fn engine_array(data: Vec<f32>) -> (Box<EngineArray>, Last) {
    let last = Last::default();
    (Box::new(EngineArray { data, last: Arc::clone(&last) }), last)
}

#[test]
fn imported_host_memory_is_read_and_written_in_place_and_kept_alive() {
    let options = ReferenceOptions {
        mode: ExecutionMode::PerStream,
        jitter: None,
        checked: true,
        timeline: false,
        wait: kda_reference::WaitStrategy::Block,
    };
    let b = ReferenceBackend::with_options(options).unwrap();
    let s = b.new_stream().unwrap();
    let (m, k, n) = (3, 4, 2);
    // x [m, k] and y [m, n] live in the engine's arrays; w is kda's own.
    let (mut x_host, x_last) = engine_array((0..m * k).map(|i| i as f32).collect());
    let (mut y_host, y_last) = engine_array(vec![-1.0; m * n]);
    let x_ptr = x_host.data.as_mut_ptr().cast::<u8>();
    let y_ptr = y_host.data.as_mut_ptr().cast::<u8>();
    // SAFETY: each array's memory lives in its box, which the buffer keeps alive; nothing else
    // touches it until the stream is synchronized below.
    let (x_buf, y_buf) = unsafe {
        (
            b.import_buffer(x_ptr, m * k * 4, x_host).unwrap(),
            b.import_buffer(y_ptr, m * n * 4, y_host).unwrap(),
        )
    };
    let x = Tensor::new(x_buf, Layout::contiguous(DType::F32, &[m, k])).unwrap();
    let y = Tensor::new(y_buf, Layout::contiguous(DType::F32, &[m, n])).unwrap();
    let w = b.alloc(DType::F32, &[n, k]).unwrap();
    let w_values: Vec<f32> = (0..n * k).map(|i| if i % (k + 1) == 0 { 1.0 } else { 0.5 }).collect();
    b.upload(&s, &w, &w_values).unwrap();

    // Hold the stream until the handles are gone, so the ops below are still queued then.
    let gate = Arc::new(Barrier::new(2));
    let held = Arc::clone(&gate);
    let hold = HostFn::new(move || {
        held.wait();
        Ok(())
    });
    b.launch(&s, Op::Host { name: "engine_gate", f: hold }).unwrap();
    b.launch(&s, Op::Gemm { x: x.clone(), w: w.clone(), y: y.clone() }).unwrap();
    // A second op writes the engine's x in place after the GEMM read it.
    b.launch(&s, Op::Fill { dst: x.clone(), value: 7.0 }).unwrap();
    drop((x, y));
    assert!(x_last.lock().unwrap().is_none(), "x's owner dropped while ops still hold it");
    assert!(y_last.lock().unwrap().is_none(), "y's owner dropped while ops still hold it");
    gate.wait();
    b.synchronize(&s).unwrap();
    // Both owners were dropped by the last op holding them, after it ran: y holds the GEMM of
    // the original x, and x the fill that came after the GEMM read it.
    let x_final = x_last.lock().unwrap().take().expect("x's owner outlived the last op");
    let y_final = y_last.lock().unwrap().take().expect("y's owner outlived the last op");
    assert_eq!(x_final, vec![7.0; m * k]);
    let expected: Vec<f32> = (0..m)
        .flat_map(|r| {
            let w = &w_values;
            (0..n).map(move |c| (0..k).map(|i| ((r * k + i) as f32) * w[c * k + i]).sum::<f32>())
        })
        .collect();
    assert_eq!(y_final, expected);
    assert!(b.instrumentation().hazards().is_empty());
}

#[test]
fn imported_memory_results_are_the_engines_bytes() {
    let b = ReferenceBackend::new();
    let s = b.new_stream().unwrap();
    // The engine keeps its arrays alive in an `Arc` it also holds, and reads them after sync.
    let x = Arc::new(std::sync::Mutex::new(vec![1.0f32, 2.0, 3.0, 4.0]));
    let y = Arc::new(std::sync::Mutex::new(vec![0.0f32; 2]));
    let x_ptr = x.lock().unwrap().as_mut_ptr().cast::<u8>();
    let y_ptr = y.lock().unwrap().as_mut_ptr().cast::<u8>();
    // SAFETY: the `Arc`s keep both vectors alive and unmoved; the test reads them only after
    // synchronizing the stream, and writes neither while kda works on them.
    let (xb, yb) = unsafe {
        (
            b.import_buffer(x_ptr, 16, Box::new(Arc::clone(&x))).unwrap(),
            b.import_buffer(y_ptr, 8, Box::new(Arc::clone(&y))).unwrap(),
        )
    };
    let xt = Tensor::new(xb, Layout::contiguous(DType::F32, &[1, 4])).unwrap();
    let yt = Tensor::new(yb, Layout::contiguous(DType::F32, &[1, 2])).unwrap();
    let w = b.alloc(DType::F32, &[2, 4]).unwrap();
    b.upload(&s, &w, &[1.0f32, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0]).unwrap();
    b.launch(&s, Op::Gemm { x: xt, w, y: yt }).unwrap();
    b.synchronize(&s).unwrap();
    assert_eq!(*y.lock().unwrap(), vec![10.0, 6.0]);
    // The ops dropped their handles as they ran: kda holds the engine's arrays no longer.
    assert_eq!(Arc::strong_count(&x), 1);
    assert_eq!(Arc::strong_count(&y), 1);
}

#[test]
fn a_misaligned_pointer_or_a_foreign_stream_is_rejected() {
    let b = ReferenceBackend::new();
    let mut bytes = vec![0u8; 16];
    let odd = bytes.as_mut_ptr().wrapping_add(1);
    // SAFETY: rejected before any use.
    let err = unsafe { b.import_buffer(odd, 8, Box::new(())) }.unwrap_err();
    assert!(matches!(err, Error::Param { op: "import_buffer", param: "ptr", .. }), "{err}");
    // SAFETY: the reference backend has no foreign streams; nothing is dereferenced.
    let err = unsafe { b.import_stream(0x1234) }.unwrap_err();
    assert_eq!(err, Error::Unsupported { backend: "reference", feature: "import_stream".into() });
    assert_eq!(err.to_string(), "the reference backend does not support import_stream");
}
