//! The façade is the one entry point: a backend sees only calls that passed its checks. A
//! counting backend (a raw `Backend` that records every call it receives) shows that bad ops,
//! foreign handles and hazards in checked mode are rejected before any backend code runs, and
//! that good ops reach it with the sizes validation computed.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use kda_core::hal::Allocation;
use kda_core::{
    Backend, BackendInfo, BufferHandle, BufferId, Capabilities, DType, Device, Error, EventHandle,
    EventId, GemmDims, InstanceId, NativeOps, Op, OpDims, Resources, Result, StreamHandle,
    StreamId, Validated,
};

#[derive(Clone, Debug)]
struct Stream(StreamId);
#[derive(Clone, Debug)]
struct Event(EventId);
#[derive(Clone, Debug)]
struct Buffer(BufferId, usize);

impl StreamHandle for Stream {
    fn id(&self) -> StreamId {
        self.0
    }
}
impl EventHandle for Event {
    fn id(&self) -> EventId {
        self.0
    }
}
impl BufferHandle for Buffer {
    fn id(&self) -> BufferId {
        self.0
    }
    fn len_bytes(&self) -> usize {
        self.1
    }
}

/// Records the names of the raw calls it receives and the sizes of every submitted op; runs
/// nothing.
#[derive(Clone, Debug)]
struct Counting {
    instance: InstanceId,
    next: Arc<AtomicU64>,
    calls: Arc<Mutex<Vec<String>>>,
    submitted: Arc<Mutex<Vec<(String, OpDims)>>>,
}

impl Counting {
    fn new() -> Self {
        Self {
            instance: InstanceId::fresh(),
            next: Arc::default(),
            calls: Arc::default(),
            submitted: Arc::default(),
        }
    }

    fn note(&self, call: &str) {
        self.calls.lock().unwrap_or_else(PoisonError::into_inner).push(call.to_string());
    }

    fn calls(&self) -> Vec<String> {
        self.calls.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    fn submitted(&self) -> Vec<(String, OpDims)> {
        self.submitted.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    fn index(&self) -> u64 {
        self.next.fetch_add(1, Ordering::Relaxed)
    }
}

impl Resources for Counting {
    type Stream = Stream;
    type Event = Event;
    type Buffer = Buffer;
}

impl Backend for Counting {
    fn info(&self) -> BackendInfo {
        BackendInfo {
            name: "counting",
            instance: self.instance,
            capabilities: Capabilities {
                concurrent_streams: false,
                shared_matrix_units: false,
                bf16_core: false,
                device_faults_are_fatal: false,
                execution: "records calls".into(),
                threads: 1,
                gemm_inputs: vec![DType::BF16, DType::F32],
                native: NativeOps::default(),
            },
        }
    }
    fn instance(&self) -> InstanceId {
        self.instance
    }
    fn new_stream(&self) -> Result<Stream> {
        Ok(Stream(StreamId { instance: self.instance, index: self.index() }))
    }
    fn new_event(&self) -> Result<Event> {
        Ok(Event(EventId { instance: self.instance, index: self.index() }))
    }
    fn record(&self, _: &Event, _: &Stream) -> Result<()> {
        self.note("record");
        Ok(())
    }
    fn wait(&self, _: &Stream, _: &Event) -> Result<()> {
        self.note("wait");
        Ok(())
    }
    fn synchronize(&self, _: &Stream) -> Result<()> {
        self.note("synchronize");
        Ok(())
    }
    fn alloc(&self, bytes: usize) -> Result<Allocation<Buffer>> {
        self.note("alloc");
        let id = BufferId { instance: self.instance, index: self.index() };
        Ok(Allocation::fresh(Buffer(id, bytes)))
    }
    fn submit(&self, _: &Stream, label: &str, op: Validated<Self>) -> Result<()> {
        self.note("submit");
        let entry = (label.to_string(), op.dims());
        self.submitted.lock().unwrap_or_else(PoisonError::into_inner).push(entry);
        Ok(())
    }
}

fn gemm(d: &Device<Counting>, m: usize, n: usize, k: usize, y_rows: usize) -> Op<Counting> {
    let alloc = |shape: &[usize]| d.alloc(DType::BF16, shape).unwrap_or_else(|e| panic!("{e}"));
    Op::Gemm { x: alloc(&[m, k]), w: alloc(&[n, k]), y: alloc(&[y_rows, n]) }
}

#[test]
fn a_bad_op_never_reaches_the_backend() {
    let raw = Counting::new();
    let d = Device::with_checked(raw.clone(), false);
    let s = d.new_stream().unwrap_or_else(|e| panic!("{e}"));
    let bad = gemm(&d, 4, 3, 8, 5);
    let before = raw.calls();
    let e = d.launch(&s, bad).expect_err("y has 5 rows for an M of 4");
    assert!(matches!(&e, Error::Shape { op: "gemm", param: "y", actual, .. } if actual == &[5, 3]));
    assert_eq!(raw.calls(), before, "the backend saw nothing of the bad launch");

    // A handle of another instance: rejected at the call, nothing reaches the backend.
    let other = Device::with_checked(Counting::new(), false);
    let foreign = other.new_stream().unwrap_or_else(|e| panic!("{e}"));
    let (good, foreign_op) = (gemm(&d, 4, 3, 8, 4), gemm(&other, 4, 3, 8, 4));
    let before = raw.calls();
    let e = d.launch(&foreign, good).expect_err("foreign stream");
    assert!(matches!(e, Error::ForeignHandle { what: "stream", .. }), "{e}");
    let e = d.launch(&s, foreign_op).expect_err("foreign buffers");
    assert!(matches!(e, Error::ForeignHandle { what: "buffer", .. }), "{e}");
    assert_eq!(raw.calls(), before);

    // A good op arrives with the sizes the façade computed.
    d.launch(&s, gemm(&d, 4, 3, 8, 4)).unwrap_or_else(|e| panic!("{e}"));
    let dims = OpDims::Gemm(GemmDims { m: 4, n: 3, k: 8 });
    assert_eq!(raw.submitted(), vec![("gemm".to_string(), dims)]);
}

#[test]
fn checked_mode_rejects_a_race_before_the_backend_runs_it() {
    let raw = Counting::new();
    let d = Device::with_checked(raw.clone(), true);
    let (a, b) = (d.new_stream().unwrap(), d.new_stream().unwrap());
    let t = d.alloc(DType::F32, &[4]).unwrap();
    d.launch(&a, Op::Fill { dst: t.clone(), value: 1.0 }).unwrap();
    let submits = raw.submitted().len();
    let e = d.launch(&b, Op::Fill { dst: t, value: 2.0 }).expect_err("unordered writes");
    assert!(matches!(e, Error::Hazard(_)), "{e}");
    assert_eq!(raw.submitted().len(), submits, "the racing op was not submitted");
}

#[test]
fn capture_keeps_work_from_the_backend_and_native_replay_is_opt_in() {
    let raw = Counting::new();
    let d = Device::with_checked(raw.clone(), false);
    let s = d.new_stream().unwrap();
    d.begin_capture(&s).unwrap();
    d.launch(&s, gemm(&d, 2, 2, 2, 2)).unwrap();
    let graph = d.end_capture(&s).unwrap();
    assert!(raw.submitted().is_empty(), "captured work is not run");
    // The default `prepare_graph` replays node by node through the façade (validated again).
    d.launch_graph(&graph, &s).unwrap();
    d.launch_graph(&graph, &s).unwrap();
    let dims = OpDims::Gemm(GemmDims { m: 2, n: 2, k: 2 });
    assert_eq!(raw.submitted(), vec![("gemm".to_string(), dims); 2]);
}
