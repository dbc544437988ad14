//! The reference backend's timeline: one span per op on the stream that ran it, and
//! one wait edge per satisfied cross-stream wait, pointing from the moment the upstream work
//! finished to the moment the waiting stream went on.
#![allow(clippy::expect_used, reason = "test setup")]

use std::time::Duration;

use kda_core::{HostFn, Op, StreamHandle};
use kda_reference::{ReferenceBackend, ReferenceOptions};

fn sleep_op(name: &'static str, ms: u64) -> Op<ReferenceBackend> {
    Op::Host {
        name,
        f: HostFn::new(move || {
            std::thread::sleep(Duration::from_millis(ms));
            Ok(())
        }),
    }
}

#[test]
fn spans_and_wait_edges_follow_the_event_order() {
    let options = ReferenceOptions { timeline: true, ..ReferenceOptions::default() };
    let b = ReferenceBackend::with_options(options).expect("backend");
    let (main, aux) = (b.new_stream().expect("stream"), b.new_stream().expect("stream"));
    let ready = b.new_event().expect("event");

    b.launch_labeled(&aux, "producer", sleep_op("producer", 20)).expect("launch");
    b.record(&ready, &aux).expect("record");
    b.wait(&main, &ready).expect("wait");
    b.launch_labeled(&main, "consumer", sleep_op("consumer", 1)).expect("launch");
    // An op launched without a label is a span under its op name (a host function's own name).
    b.launch(&main, sleep_op("unlabelled", 1)).expect("launch");
    b.synchronize(&main).expect("sync");
    b.synchronize(&aux).expect("sync");

    let t = b.raw().timeline();
    let labels: Vec<&str> = t.spans.iter().map(|s| s.label.as_str()).collect();
    assert_eq!(labels, ["producer", "consumer", "unlabelled"]);
    assert_eq!(t.streams(), [aux.id(), main.id()]);
    let (producer, consumer) = (&t.spans[0], &t.spans[1]);
    assert_eq!((producer.stream, consumer.stream), (aux.id(), main.id()));
    assert!(producer.duration() >= Duration::from_millis(20), "{producer:?}");

    assert_eq!(t.waits.len(), 1, "{:?}", t.waits);
    let edge = &t.waits[0];
    assert_eq!((edge.upstream, edge.stream), (aux.id(), main.id()));
    assert!(producer.end <= edge.satisfied, "{edge:?} after {producer:?}");
    assert!(edge.satisfied <= edge.resumed, "{edge:?}");
    assert!(edge.resumed <= consumer.start, "{edge:?} before {consumer:?}");

    b.raw().clear_timeline();
    assert!(b.raw().timeline().is_empty() && b.raw().timeline().waits.is_empty());
}

#[test]
fn a_wait_on_the_same_stream_or_before_any_record_draws_no_edge() {
    let options = ReferenceOptions { timeline: true, ..ReferenceOptions::default() };
    let b = ReferenceBackend::with_options(options).expect("backend");
    let s = b.new_stream().expect("stream");
    let (own, unrecorded) = (b.new_event().expect("event"), b.new_event().expect("event"));
    b.launch_labeled(&s, "work", sleep_op("work", 1)).expect("launch");
    b.record(&own, &s).expect("record");
    b.wait(&s, &own).expect("wait");
    b.wait(&s, &unrecorded).expect("wait");
    b.synchronize(&s).expect("sync");
    assert_eq!(b.raw().timeline().spans.len(), 1);
    assert!(b.raw().timeline().waits.is_empty(), "{:?}", b.raw().timeline().waits);
}
