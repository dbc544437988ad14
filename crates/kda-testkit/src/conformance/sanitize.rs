//! Checked mode and capture on hand-built schedules: a correct fork/join is clean, removing its
//! join is a hazard that names the consumer, frees are checked, and captures follow the ACL rule
//! and replay bit for bit.

use kda_core::sanitize::{Entry, HazardKind, analyze};
use kda_core::{
    Backend, BufferHandle, CaptureError, DType, Device, Error, Op, StreamHandle, Tensor,
};

use super::Factory;
use crate::Gen;

/// A two-stream fork/join in the shape of the overlapped projection schedule: the aux stream
/// projects `x` after `hidden_ready`, main consumes the projection after `bfg_ready`.
struct ForkJoin<B: Backend> {
    main: B::Stream,
    aux: B::Stream,
    x: Tensor<B>,
    w: Tensor<B>,
    projected: Tensor<B>,
    out: Tensor<B>,
}

impl<B: Backend> ForkJoin<B> {
    fn new(b: &Device<B>) -> Self {
        let (main, aux) = (b.new_stream().unwrap(), b.new_stream().unwrap());
        let x = b.alloc(DType::F32, &[4, 8]).unwrap();
        let w = b.alloc(DType::F32, &[6, 8]).unwrap();
        let mut rng = Gen::new(3);
        b.upload(&main, &x, &rng.uniform_f32(32, -1.0, 1.0)).unwrap();
        b.upload(&main, &w, &rng.uniform_f32(48, -1.0, 1.0)).unwrap();
        let projected = b.alloc(DType::F32, &[4, 6]).unwrap();
        let out = b.alloc(DType::F32, &[4, 6]).unwrap();
        Self { main, aux, x, w, projected, out }
    }

    /// Queue the schedule; `join` = whether main waits for the aux tail before consuming.
    fn run(&self, b: &Device<B>, join: bool) -> kda_core::Result<()> {
        let (hidden_ready, bfg_ready) = (b.new_event()?, b.new_event()?);
        b.record(&hidden_ready, &self.main)?;
        b.wait(&self.aux, &hidden_ready)?;
        let project = Op::Gemm { x: self.x.clone(), w: self.w.clone(), y: self.projected.clone() };
        b.launch_labeled(&self.aux, "project_bfg", project)?;
        b.record(&bfg_ready, &self.aux)?;
        if join {
            b.wait(&self.main, &bfg_ready)?;
        }
        let consume = Op::Copy { src: self.projected.clone(), dst: self.out.clone() };
        b.launch_labeled(&self.main, "consume_bfg", consume)
    }

    fn finish(&self, b: &Device<B>) -> Vec<f32> {
        b.synchronize(&self.aux).unwrap();
        b.download(&self.main, &self.out).unwrap()
    }
}

fn expect_hazard(r: kda_core::Result<()>) -> kda_core::sanitize::Hazard {
    match r {
        Err(Error::Hazard(h)) => *h,
        other => panic!("expected a stream hazard, got {other:?}"),
    }
}

pub fn fork_join_is_clean<B: Backend>(make: &impl Factory<B>) {
    let b = make();
    assert!(b.instrumentation().is_checked(), "the checked factory must build a checked backend");
    let f = ForkJoin::new(&b);
    f.run(&b, true).unwrap();
    let out = f.finish(&b);
    let projected: Vec<f32> = b.download(&f.main, &f.projected).unwrap();
    assert_eq!(out, projected);
    assert!(b.instrumentation().hazards().is_empty(), "{:?}", b.instrumentation().hazards());
    let launches =
        b.instrumentation().log().iter().filter(|e| matches!(e, Entry::Launch { .. })).count();
    assert_eq!(launches, 2 + 2 + 2, "uploads, project + consume, downloads");
}

pub fn missing_join_names_the_consumer<B: Backend>(make: &impl Factory<B>) {
    let b = make();
    let f = ForkJoin::new(&b);
    b.launch(&f.main, Op::Fill { dst: f.out.clone(), value: -1.0 }).unwrap();
    let h = expect_hazard(f.run(&b, false));
    assert_eq!(h.kind, HazardKind::ReadAfterWrite);
    assert_eq!((h.first.op.label.as_str(), h.first.param), ("project_bfg", "y"));
    assert_eq!((h.second.op.label.as_str(), h.second.param), ("consume_bfg", "src"));
    assert_eq!((h.first.op.stream, h.second.op.stream), (f.aux.id(), f.main.id()));
    assert_eq!(h.second.buffer, f.projected.buffer().id());
    assert_eq!(h.bytes, 0..4 * 6 * 4);
    let text = h.to_string();
    for needle in ["read-after-write", "project_bfg", "consume_bfg", &f.main.id().to_string()] {
        assert!(text.contains(needle), "{needle:?} missing from: {text}");
    }
    // The racing op was not run.
    assert_eq!(f.finish(&b), vec![-1.0; 24]);
}

pub fn disjoint_views_do_not_conflict<B: Backend>(make: &impl Factory<B>) {
    let b = make();
    let (main, aux) = (b.new_stream().unwrap(), b.new_stream().unwrap());
    // B | F | G column blocks of one [T, lh + 2 lp] buffer, written by two streams unordered.
    let bfg = b.alloc(DType::BF16, &[5, 2 + 6 + 6]).unwrap();
    let parts = bfg.split(1, &[2, 6, 6]).unwrap();
    b.launch(&main, Op::Fill { dst: parts[0].clone(), value: 1.0 }).unwrap();
    b.launch(&aux, Op::Fill { dst: parts[1].clone(), value: 2.0 }).unwrap();
    b.launch(&main, Op::Fill { dst: parts[2].clone(), value: 3.0 }).unwrap();
    assert!(b.instrumentation().hazards().is_empty());
    // Reading the whole buffer on main without waiting for aux is a hazard on F's bytes.
    let copy = Op::Copy { src: bfg.clone(), dst: b.alloc(DType::BF16, &[5, 14]).unwrap() };
    let h = expect_hazard(b.launch_labeled(&main, "read_all", copy));
    assert_eq!((h.kind, h.first.op.stream), (HazardKind::ReadAfterWrite, aux.id()));
    assert_eq!(h.bytes, 2 * 2..8 * 2, "first conflicting bytes: F's block in row 0");
    b.synchronize(&aux).unwrap();
    b.synchronize(&main).unwrap();
}

pub fn free_while_in_use_is_reported<B: Backend>(make: &impl Factory<B>) {
    let b = make();
    let (main, aux) = (b.new_stream().unwrap(), b.new_stream().unwrap());
    let ready = b.new_event().unwrap();
    let x = b.alloc(DType::F32, &[16]).unwrap();
    let y = b.alloc(DType::F32, &[16]).unwrap();
    b.launch(&main, Op::Fill { dst: x.clone(), value: 1.0 }).unwrap();
    b.record(&ready, &main).unwrap();
    b.wait(&aux, &ready).unwrap();
    b.launch_labeled(&aux, "aux_reads_x", Op::Copy { src: x.clone(), dst: y.clone() }).unwrap();
    // Freeing x on main while aux may still read it breaks the record_stream contract.
    let h = expect_hazard(b.free(&main, x.buffer().clone()));
    assert_eq!(h.kind, HazardKind::FreeWhileInUse);
    assert_eq!((h.first.op.label.as_str(), h.second.op.label.as_str()), ("aux_reads_x", "free"));
    assert_eq!(h.second.buffer, x.buffer().id());

    // Ordered correctly, the free is clean; a later use is a use after free.
    let b2 = make();
    let (main, aux) = (b2.new_stream().unwrap(), b2.new_stream().unwrap());
    let (ready, done) = (b2.new_event().unwrap(), b2.new_event().unwrap());
    let x = b2.alloc(DType::F32, &[16]).unwrap();
    let y = b2.alloc(DType::F32, &[16]).unwrap();
    b2.launch(&main, Op::Fill { dst: x.clone(), value: 1.0 }).unwrap();
    b2.record(&ready, &main).unwrap();
    b2.wait(&aux, &ready).unwrap();
    b2.launch(&aux, Op::Copy { src: x.clone(), dst: y.clone() }).unwrap();
    b2.record(&done, &aux).unwrap();
    b2.wait(&main, &done).unwrap();
    b2.free(&main, x.buffer().clone()).unwrap();
    let h = expect_hazard(b2.launch_labeled(
        &main,
        "late_fill",
        Op::Fill { dst: x.clone(), value: 0.0 },
    ));
    assert_eq!((h.kind, h.second.op.label.as_str()), (HazardKind::UseAfterFree, "late_fill"));
    b2.synchronize(&main).unwrap();
    b2.synchronize(&aux).unwrap();
}

/// The recorded log is data: dropping the join wait, or moving it after the consumer, and
/// analysing again finds the hazard; the untouched log is clean.
pub fn log_can_be_edited_and_reanalysed<B: Backend>(make: &impl Factory<B>) {
    let b = make();
    let f = ForkJoin::new(&b);
    f.run(&b, true).unwrap();
    f.finish(&b);
    let log = b.instrumentation().log();
    assert!(analyze(&log).is_empty());
    let join = log
        .iter()
        .position(|e| matches!(e, Entry::Wait { stream, .. } if *stream == f.main.id()))
        .expect("main waits once");
    let consumer = log
        .iter()
        .position(|e| matches!(e, Entry::Launch { label, .. } if label == "consume_bfg"))
        .expect("the consumer is logged");

    let mut dropped = log.clone();
    dropped.remove(join);
    let hazards = analyze(&dropped);
    assert_eq!(hazards.len(), 1, "{hazards:?}");
    assert_eq!(hazards[0].second.op.label, "consume_bfg");

    let mut moved = log.clone();
    let wait = moved.remove(join);
    moved.insert(consumer, wait);
    assert_eq!(analyze(&moved).len(), 1);
}

/// Fill `out` with a sentinel, so a captured op that ran early would show.
fn reset<B: Backend>(b: &Device<B>, s: &B::Stream, outs: &[&Tensor<B>]) {
    for t in outs {
        b.launch(s, Op::Fill { dst: (*t).clone(), value: -3.0 }).unwrap();
    }
    b.synchronize(s).unwrap();
}

pub fn capture_fork_join_replays_to_identical_results<B: Backend>(make: &impl Factory<B>) {
    let b = make();
    let main = b.new_stream().unwrap();
    let aux = b.new_stream().unwrap();
    let mut rng = Gen::new(11);
    let x = b.alloc(DType::BF16, &[7, 40]).unwrap();
    let (w1, w2) =
        (b.alloc(DType::BF16, &[9, 40]).unwrap(), b.alloc(DType::BF16, &[5, 40]).unwrap());
    for t in [&x, &w1, &w2] {
        b.upload(&main, t, &rng.uniform_bf16(t.numel(), -1.0, 1.0)).unwrap();
    }
    let (y1, y2) = (b.alloc(DType::F32, &[7, 9]).unwrap(), b.alloc(DType::F32, &[7, 5]).unwrap());
    let (fork, join) = (b.new_event().unwrap(), b.new_event().unwrap());
    let schedule = || -> kda_core::Result<()> {
        b.record(&fork, &main)?;
        b.wait(&aux, &fork)?;
        b.launch_labeled(
            &aux,
            "aux_gemm",
            Op::Gemm { x: x.clone(), w: w1.clone(), y: y1.clone() },
        )?;
        b.record(&join, &aux)?;
        b.launch_labeled(
            &main,
            "main_gemm",
            Op::Gemm { x: x.clone(), w: w2.clone(), y: y2.clone() },
        )?;
        b.wait(&main, &join)
    };
    let read = |b: &Device<B>| -> (Vec<f32>, Vec<f32>) {
        (b.download(&main, &y1).unwrap(), b.download(&main, &y2).unwrap())
    };

    reset(&b, &main, &[&y1, &y2]);
    schedule().unwrap();
    let eager = read(&b);

    reset(&b, &main, &[&y1, &y2]);
    b.begin_capture(&main).unwrap();
    schedule().unwrap();
    let graph = b.end_capture(&main).unwrap();
    assert_eq!(graph.streams(), 2);
    assert_eq!(graph.ops(), vec![(1, "aux_gemm"), (0, "main_gemm")]);
    b.synchronize(&main).unwrap();
    assert_eq!(read(&b), (vec![-3.0; 63], vec![-3.0; 35]), "captured ops must not run");

    for _ in 0..2 {
        b.launch_graph(&graph, &main).unwrap();
        assert_eq!(read(&b), eager, "replay equals eager bit for bit");
        reset(&b, &main, &[&y1, &y2]);
    }
    assert!(b.instrumentation().hazards().is_empty(), "{:?}", b.instrumentation().hazards());
}

fn expect_capture_error(r: kda_core::Result<impl std::fmt::Debug>) -> CaptureError {
    match r {
        Err(Error::Capture(e)) => e,
        other => panic!("expected a capture error, got {other:?}"),
    }
}

/// Each invalid capture is rejected by `end_capture` with its own diagnostic naming the stream.
pub fn capture_invalid_cases_are_rejected<B: Backend>(make: &impl Factory<B>) {
    let setup = || {
        let b = make();
        let (main, aux) = (b.new_stream().unwrap(), b.new_stream().unwrap());
        let t = b.alloc(DType::F32, &[8]).unwrap();
        let (e1, e2) = (b.new_event().unwrap(), b.new_event().unwrap());
        (b, main, aux, t, e1, e2)
    };
    let fill = |t: &Tensor<B>| Op::Fill { dst: t.clone(), value: 1.0 };

    // Forked but never joined.
    let (b, main, aux, t, e1, _) = setup();
    b.begin_capture(&main).unwrap();
    b.record(&e1, &main).unwrap();
    b.wait(&aux, &e1).unwrap();
    b.launch(&aux, fill(&t)).unwrap();
    match expect_capture_error(b.end_capture(&main)) {
        CaptureError::NotJoined { stream, origin } => {
            assert_eq!((stream, origin), (aux.id(), main.id()))
        }
        other => panic!("not joined: {other:?}"),
    }

    // Joined, then more work on the joined stream.
    let (b, main, aux, t, e1, e2) = setup();
    b.begin_capture(&main).unwrap();
    b.record(&e1, &main).unwrap();
    b.wait(&aux, &e1).unwrap();
    b.launch(&aux, fill(&t)).unwrap();
    b.record(&e2, &aux).unwrap();
    b.wait(&main, &e2).unwrap();
    b.launch_labeled(&aux, "late_work", fill(&t)).unwrap();
    match expect_capture_error(b.end_capture(&main)) {
        CaptureError::WorkAfterJoin { stream, label, .. } => {
            assert_eq!((stream, label.as_str()), (aux.id(), "late_work"))
        }
        other => panic!("work after join: {other:?}"),
    }

    // A host synchronize, and a blocking download, inside the capture.
    for call in ["synchronize", "download"] {
        let (b, main, _aux, t, _, _) = setup();
        b.begin_capture(&main).unwrap();
        b.launch(&main, fill(&t)).unwrap();
        let blocked = if call == "synchronize" {
            b.synchronize(&main)
        } else {
            b.download::<f32>(&main, &t).map(|_| ())
        };
        let expected =
            CaptureError::HostSyncInCapture { stream: main.id(), origin: main.id(), call };
        assert_eq!(expect_capture_error(blocked), expected);
        assert_eq!(expect_capture_error(b.end_capture(&main)), expected);
    }

    // A free on a captured stream.
    let (b, main, _aux, t, _, _) = setup();
    b.begin_capture(&main).unwrap();
    let expected = CaptureError::FreeInCapture { stream: main.id(), origin: main.id() };
    assert_eq!(expect_capture_error(b.free(&main, t.buffer().clone())), expected);
    assert_eq!(expect_capture_error(b.end_capture(&main)), expected);

    // A captured stream waits on an event recorded before the capture.
    let (b, main, aux, t, e1, e2) = setup();
    b.record(&e2, &main).unwrap();
    b.begin_capture(&main).unwrap();
    b.record(&e1, &main).unwrap();
    b.wait(&aux, &e1).unwrap();
    b.wait(&aux, &e2).unwrap();
    b.launch(&aux, fill(&t)).unwrap();
    match expect_capture_error(b.end_capture(&main)) {
        CaptureError::ExternalEvent { stream, event, .. } => {
            assert_eq!((stream, event), (aux.id(), kda_core::EventHandle::id(&e2)))
        }
        other => panic!("external event: {other:?}"),
    }
}

/// Ending a capture never begun, beginning twice, replaying on another instance: typed errors.
pub fn capture_bad_calls_are_typed_errors<B: Backend>(make: &impl Factory<B>) {
    let b = make();
    let (main, other) = (b.new_stream().unwrap(), b.new_stream().unwrap());
    assert_eq!(
        expect_capture_error(b.end_capture(&main)),
        CaptureError::NotCapturing { stream: main.id() }
    );
    b.begin_capture(&main).unwrap();
    assert_eq!(
        expect_capture_error(b.begin_capture(&other)),
        CaptureError::AlreadyCapturing { stream: other.id(), origin: main.id() }
    );
    assert_eq!(
        expect_capture_error(b.end_capture(&other)),
        CaptureError::NotCapturing { stream: other.id() }
    );
    let graph = b.end_capture(&main).unwrap();
    let b2 = make();
    let s2 = b2.new_stream().unwrap();
    assert_eq!(
        expect_capture_error(b2.launch_graph(&graph, &s2)),
        CaptureError::ForeignGraph { graph: b.instance(), backend: b2.instance() }
    );
}

/// This module's bodies, each registered for every backend: [`crate::conformance_tests!`] calls
/// this with the backend's factories. A public body missing here fails
/// `conformance::tests::every_body_is_registered`.
#[doc(hidden)]
#[macro_export]
macro_rules! conformance_sanitize {
    ($plain:expr, $jittered:expr, $checked:expr) => {
        $crate::conformance_tests!(@tests
            sanitize_fork_join_is_clean => sanitize::fork_join_is_clean(&$checked),
            sanitize_missing_join_names_the_consumer => sanitize::missing_join_names_the_consumer(&$checked),
            sanitize_disjoint_views_do_not_conflict => sanitize::disjoint_views_do_not_conflict(&$checked),
            sanitize_free_while_in_use_is_reported => sanitize::free_while_in_use_is_reported(&$checked),
            sanitize_log_can_be_edited_and_reanalysed => sanitize::log_can_be_edited_and_reanalysed(&$checked),
            capture_fork_join_replays_to_identical_results => sanitize::capture_fork_join_replays_to_identical_results(&$checked),
            capture_invalid_cases_are_rejected => sanitize::capture_invalid_cases_are_rejected(&$plain),
            capture_bad_calls_are_typed_errors => sanitize::capture_bad_calls_are_typed_errors(&$plain),
        );
    };
}
