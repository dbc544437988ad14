//! Streams and events: real concurrency, CUDA/ACL wait semantics, ordering under injected
//! delays, and how failures surface.

use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use kda_core::{Backend, DType, Error, HostFn, Op};

use super::{Factory, with_watchdog};

/// How long a host function blocks on a latch before declaring the other stream never ran.
const LATCH_TIMEOUT: Duration = Duration::from_secs(10);
/// Watchdog for whole test bodies that could deadlock on a broken backend.
const BODY_LIMIT: Duration = Duration::from_secs(60);

/// A one-shot latch that host functions on different streams open and wait for.
#[derive(Clone, Default)]
struct Latch(Arc<(Mutex<bool>, Condvar)>);

impl Latch {
    fn opener(&self) -> HostFn {
        let latch = self.clone();
        HostFn::new(move || {
            let (open, cv) = &*latch.0;
            *open.lock().map_err(|e| e.to_string())? = true;
            cv.notify_all();
            Ok(())
        })
    }

    fn waiter(&self) -> HostFn {
        let latch = self.clone();
        HostFn::new(move || {
            let (open, cv) = &*latch.0;
            let guard = open.lock().map_err(|e| e.to_string())?;
            let (guard, timeout) = cv
                .wait_timeout_while(guard, LATCH_TIMEOUT, |open| !*open)
                .map_err(|e| e.to_string())?;
            if timeout.timed_out() && !*guard {
                Err(format!("latch not opened within {LATCH_TIMEOUT:?}"))
            } else {
                Ok(())
            }
        })
    }
}

fn host<B: Backend>(name: &'static str, f: HostFn) -> Op<B> {
    Op::Host { name, f }
}

/// An op on stream A that waits for a latch opened by an op on stream B completes: the streams
/// really run at the same time. A serialising backend fails (A times out) instead of hanging.
pub fn run_concurrently<B: Backend>(make: &impl Factory<B>) {
    let make = make.clone();
    with_watchdog("run_concurrently", BODY_LIMIT, move || {
        let b = make();
        let (a, s) = (b.new_stream().unwrap(), b.new_stream().unwrap());
        let latch = Latch::default();
        b.launch(&a, host("wait_for_latch", latch.waiter())).unwrap();
        b.launch(&s, host("open_latch", latch.opener())).unwrap();
        b.synchronize(&s).unwrap();
        b.synchronize(&a).expect("stream A must see the latch opened by stream B");
    });
}

/// Waiting on an event that was never recorded does not wait for anything: not even for a
/// record that comes later. If it did, B would wait for A, which waits for B.
pub fn wait_before_record_is_a_no_op<B: Backend>(make: &impl Factory<B>) {
    let make = make.clone();
    with_watchdog("wait_before_record_is_a_no_op", BODY_LIMIT, move || {
        let b = make();
        let (a, s) = (b.new_stream().unwrap(), b.new_stream().unwrap());
        let event = b.new_event().unwrap();
        let latch = Latch::default();
        b.wait(&s, &event).unwrap();
        b.launch(&a, host("wait_for_latch", latch.waiter())).unwrap();
        b.record(&event, &a).unwrap();
        b.launch(&s, host("open_latch", latch.opener())).unwrap();
        b.synchronize(&s).unwrap();
        b.synchronize(&a).unwrap();
    });
}

/// A wait binds to the record that was most recent when the wait was issued; recording the
/// event again afterwards does not move it. B copies the value A wrote before the first record.
pub fn rerecord_after_wait_keeps_the_earlier_snapshot<B: Backend>(make: &impl Factory<B>) {
    let make = make.clone();
    with_watchdog("rerecord_after_wait", BODY_LIMIT, move || {
        let b = make();
        let (a, s) = (b.new_stream().unwrap(), b.new_stream().unwrap());
        let x = b.alloc(DType::F32, &[4]).unwrap();
        let y = b.alloc(DType::F32, &[4]).unwrap();
        let event = b.new_event().unwrap();
        let latch = Latch::default();
        b.launch(&a, Op::Fill { dst: x.clone(), value: 3.0 }).unwrap();
        b.record(&event, &a).unwrap();
        b.wait(&s, &event).unwrap();
        b.launch(&a, host("wait_for_latch", latch.waiter())).unwrap();
        b.record(&event, &a).unwrap();
        b.launch(&s, Op::Copy { src: x.clone(), dst: y.clone() }).unwrap();
        b.launch(&s, host("open_latch", latch.opener())).unwrap();
        let copied: Vec<f32> = b.download(&s, &y).unwrap();
        b.synchronize(&a).unwrap();
        assert_eq!(copied, vec![3.0; 4]);
    });
}

/// A → B → A chains, `iterations` times, each producing a distinct value that only the right
/// event order delivers: A fills x with i, B copies x to y after A's event, A copies y into row
/// i of z after B's event, and the next fill of x (and B's next write of y) must wait too.
pub fn event_chain_across_two_streams<B: Backend>(make: &impl Factory<B>, iterations: usize) {
    const WIDTH: usize = 64;
    let make = make.clone();
    with_watchdog("event_chain", BODY_LIMIT * 2, move || {
        let b = make();
        let (a, s) = (b.new_stream().unwrap(), b.new_stream().unwrap());
        let x = b.alloc(DType::F32, &[WIDTH]).unwrap();
        let y = b.alloc(DType::F32, &[WIDTH]).unwrap();
        let z = b.alloc(DType::F32, &[iterations, WIDTH]).unwrap();
        let (x_ready, y_ready) = (b.new_event().unwrap(), b.new_event().unwrap());
        for i in 0..iterations {
            b.launch(&a, Op::Fill { dst: x.clone(), value: i as f64 }).unwrap();
            b.record(&x_ready, &a).unwrap();
            b.wait(&s, &x_ready).unwrap();
            b.launch(&s, Op::Copy { src: x.clone(), dst: y.clone() }).unwrap();
            b.record(&y_ready, &s).unwrap();
            b.wait(&a, &y_ready).unwrap();
            let row = z.narrow(0, i, 1).unwrap().reshape(&[WIDTH]).unwrap();
            b.launch(&a, Op::Copy { src: y.clone(), dst: row }).unwrap();
        }
        let got: Vec<f32> = b.download(&a, &z).unwrap();
        b.synchronize(&s).unwrap();
        let wrong: Vec<usize> = (0..iterations)
            .filter(|&i| got[i * WIDTH..(i + 1) * WIDTH].iter().any(|&v| v != i as f32))
            .collect();
        assert!(
            wrong.is_empty(),
            "{} of {iterations} iterations saw a wrong value, first {:?}",
            wrong.len(),
            &wrong[..wrong.len().min(5)]
        );
    });
}

/// A failing op is reported by the next `synchronize` of its stream (once); ops queued after
/// it on that stream are skipped; a stream that waits on the failed work fails too; nothing
/// hangs.
pub fn execution_errors_surface_at_synchronize<B: Backend>(make: &impl Factory<B>) {
    let make = make.clone();
    with_watchdog("execution_errors", BODY_LIMIT, move || {
        let b = make();
        let (a, s) = (b.new_stream().unwrap(), b.new_stream().unwrap());
        let x = b.alloc(DType::F32, &[2]).unwrap();
        b.launch(&a, Op::Fill { dst: x.clone(), value: 1.0 }).unwrap();
        let failing = HostFn::new(|| Err("injected failure".to_string()));
        b.launch(&a, host("failing_host_fn", failing)).expect("launch only queues");
        b.launch(&a, Op::Fill { dst: x.clone(), value: 2.0 }).unwrap();
        let event = b.new_event().unwrap();
        b.record(&event, &a).unwrap();
        b.wait(&s, &event).unwrap();
        b.launch(&s, Op::Fill { dst: x.clone(), value: 5.0 }).unwrap();

        match b.synchronize(&s) {
            Err(Error::DependencyFailed { stream, upstream, message }) => {
                assert_eq!((stream, upstream), (s_id(&s), s_id(&a)));
                assert!(message.contains("injected failure"), "{message}");
            }
            other => panic!("waiting stream: expected DependencyFailed, got {other:?}"),
        }
        match b.synchronize(&a) {
            Err(Error::OpFailed { op, message, .. }) => {
                assert_eq!(op, "failing_host_fn");
                assert!(message.contains("injected failure"), "{message}");
            }
            other => panic!("failing stream: expected OpFailed, got {other:?}"),
        }
        b.synchronize(&a).expect("an error is reported once");
        // The fill after the failure on `a` and the fill after the failed wait on `s` were skipped.
        let v: Vec<f32> = b.download(&a, &x).unwrap();
        assert_eq!(v, vec![1.0, 1.0]);
    });
}

fn s_id<S: kda_core::StreamHandle>(s: &S) -> kda_core::StreamId {
    s.id()
}

/// Streams, events and buffers of one backend instance are errors in another, never a hang or
/// a panic.
pub fn handles_of_another_instance_are_rejected<B: Backend>(make: &impl Factory<B>) {
    let (one, two) = (make(), make());
    let (s1, s2) = (one.new_stream().unwrap(), two.new_stream().unwrap());
    let e2 = two.new_event().unwrap();
    let foreign = |r: kda_core::Result<()>, what: &str| match r {
        Err(Error::ForeignHandle { what: w, handle, backend }) => {
            assert_eq!(w, what);
            assert_eq!((handle, backend), (two.instance(), one.instance()));
        }
        other => panic!("expected ForeignHandle for {what}, got {other:?}"),
    };
    foreign(one.wait(&s1, &e2), "event");
    foreign(one.record(&e2, &s1), "event");
    foreign(one.synchronize(&s2), "stream");
    let t2 = two.alloc(DType::F32, &[3]).unwrap();
    foreign(one.launch(&s1, Op::Fill { dst: t2.clone(), value: 0.0 }), "buffer");
    foreign(
        one.launch(&s2, Op::Fill { dst: one.alloc(DType::F32, &[3]).unwrap(), value: 0.0 }),
        "stream",
    );
}

/// This module's bodies, each registered for every backend: [`crate::conformance_tests!`] calls
/// this with the backend's factories. A public body missing here fails
/// `conformance::tests::every_body_is_registered`.
#[doc(hidden)]
#[macro_export]
macro_rules! conformance_streams {
    ($plain:expr, $jittered:expr, $checked:expr) => {
        $crate::conformance_tests!(@tests
            streams_run_concurrently => streams::run_concurrently(&$plain),
            wait_before_record_is_a_no_op => streams::wait_before_record_is_a_no_op(&$plain),
            rerecord_after_wait_keeps_the_earlier_snapshot => streams::rerecord_after_wait_keeps_the_earlier_snapshot(&$plain),
            event_chain_across_two_streams_under_jitter => streams::event_chain_across_two_streams(&$jittered, 1000),
            execution_errors_surface_at_synchronize => streams::execution_errors_surface_at_synchronize(&$plain),
            handles_of_another_instance_are_rejected => streams::handles_of_another_instance_are_rejected(&$plain),
        );
    };
}
