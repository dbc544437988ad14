//! A launch that fails mid-schedule: every stream's synchronize returns (no stream waits
//! forever) and nothing the backend created through the runtime is leaked; the ACL models
//! `launch_graph` builds are destroyed on `release_graph` and with the backend. In their own
//! binary, one at a time, because they count the emulated runtime's process-wide objects.
#![cfg(feature = "emulated")]
#![allow(clippy::expect_used, clippy::unwrap_used, reason = "tests")]

use std::sync::{Mutex, PoisonError};

use kda_ascend::{AscendBackend, AscendOptions};
use kda_core::{DType, Device, Error, HostFn, Op};

/// The tests count process-wide objects: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn backend() -> Device<AscendBackend> {
    let options = AscendOptions { checked: false, ..AscendOptions::default() };
    AscendBackend::with_options(options).unwrap()
}

#[test]
fn a_failed_launch_mid_schedule_leaks_nothing_and_hangs_nothing() {
    let _serial = SERIAL.lock().unwrap_or_else(PoisonError::into_inner);
    let before = kda_acl_emu::live();
    {
        let b = backend();
        let (main, aux) = (b.new_stream().unwrap(), b.new_stream().unwrap());
        let x = b.alloc(DType::F32, &[4, 8]).unwrap();
        let w = b.alloc(DType::F32, &[3, 8]).unwrap();
        let y = b.alloc(DType::F32, &[4, 3]).unwrap();
        b.launch(&main, Op::Fill { dst: x.clone(), value: 1.0 }).unwrap();
        b.launch(&main, Op::Fill { dst: w.clone(), value: 2.0 }).unwrap();
        let (fork, join) = (b.new_event().unwrap(), b.new_event().unwrap());
        b.record(&fork, &main).unwrap();
        b.wait(&aux, &fork).unwrap();
        b.launch(&aux, Op::Host { name: "failing", f: HostFn::new(|| Err("boom".into())) })
            .unwrap();
        b.launch(&aux, Op::Gemm { x: x.clone(), w: w.clone(), y: y.clone() }).unwrap();
        b.record(&join, &aux).unwrap();
        b.wait(&main, &join).unwrap();
        b.launch(&main, Op::Gemm { x, w, y }).unwrap();
        assert!(matches!(b.synchronize(&main), Err(Error::DependencyFailed { .. })));
        assert!(matches!(b.synchronize(&aux), Err(Error::OpFailed { .. })));
        b.synchronize(&main).unwrap();
        b.synchronize(&aux).unwrap();
    }
    let after = kda_acl_emu::live();
    assert_eq!(
        after, before,
        "every stream, event, descriptor, executor and allocation is released"
    );
}

/// Each graph launched through the HAL is one ACL model, built at its first launch and reused;
/// `release_graph` destroys it (with its executors), dropping the backend destroys the rest,
/// and nothing else the graphs needed is left behind.
#[test]
fn launch_graph_models_are_destroyed_on_release_and_with_the_backend() {
    let _serial = SERIAL.lock().unwrap_or_else(PoisonError::into_inner);
    let before = kda_acl_emu::live();
    {
        let b = backend();
        let main = b.new_stream().unwrap();
        let x = b.alloc(DType::F32, &[4, 8]).unwrap();
        let w = b.alloc(DType::F32, &[3, 8]).unwrap();
        let y = b.alloc(DType::F32, &[4, 3]).unwrap();
        let capture = |ops: Vec<Op<AscendBackend>>| {
            b.begin_capture(&main).unwrap();
            for op in ops {
                b.launch(&main, op).unwrap();
            }
            b.end_capture(&main).unwrap()
        };
        let fill = capture(vec![
            Op::Fill { dst: x.clone(), value: 1.0 },
            Op::Fill { dst: w.clone(), value: 2.0 },
        ]);
        let gemm = capture(vec![Op::Gemm { x: x.clone(), w: w.clone(), y: y.clone() }]);
        let models = |b: &Device<AscendBackend>| {
            b.synchronize(&main).unwrap();
            kda_acl_emu::live().models - before.models
        };
        assert_eq!(models(&b), 0, "nothing is instantiated before the first launch");
        for _ in 0..3 {
            b.launch_graph(&fill, &main).unwrap();
            b.launch_graph(&gemm, &main).unwrap();
        }
        assert_eq!(b.download::<f32>(&main, &y).unwrap(), vec![16.0; 12]);
        assert_eq!(models(&b), 2, "one model per graph, reused");
        let executors = kda_acl_emu::live().executors;
        assert!(b.raw().release_graph(&gemm));
        assert!(!b.raw().release_graph(&gemm), "released once");
        assert_eq!(models(&b), 1);
        assert_eq!(kda_acl_emu::live().executors, executors - 1, "the GEMM's executor");
        b.launch_graph(&gemm, &main).unwrap();
        assert_eq!(models(&b), 2, "a released graph is instantiated again");
        drop((fill, gemm));
        assert_eq!(models(&b), 2, "the cache, not the graph, owns the models");
    }
    assert_eq!(kda_acl_emu::live(), before, "every model, executor and stream destroyed");
}
