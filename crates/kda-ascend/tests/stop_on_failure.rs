//! Under `ACL_STOP_ON_FAILURE` a failed task stops every stream of the context, not only its own
//! (hicann/runtime `hicann/runtime/docs/zh/dev_guide/03-02_stream_management.md`,
//! 配置任务遇错即停; the rules table of docs/ascend.md). Nothing in a process clears it but
//! tearing the context down, so this is its own test binary — its own process, its own emulated
//! context — with one test: a failing test beside others in one process would stop theirs too,
//! as on an NPU.
#![cfg(feature = "emulated")]
#![allow(clippy::expect_used, clippy::unwrap_used, reason = "tests")]

use std::time::{Duration, Instant};

use kda_ascend::{AscendBackend, AscendOptions, sys};
use kda_core::kda::ZeroPadding;
use kda_core::{DType, Error, Op};

fn raw_stream() -> sys::aclrtStream {
    let mut s = std::ptr::null_mut();
    // SAFETY: valid out-parameter.
    assert_eq!(unsafe { sys::aclrtCreateStream(&mut s) }, 0);
    s
}

/// An asynchronous host-to-device copy of one f32 on `s`: the task the checks below submit.
fn copy_one(s: sys::aclrtStream) -> sys::aclError {
    let mut dst = std::ptr::null_mut();
    // SAFETY: valid out-parameter.
    assert_eq!(unsafe { sys::aclrtMalloc(&mut dst, 4, sys::ACL_MEM_MALLOC_HUGE_FIRST) }, 0);
    let one = 1.0f32;
    // SAFETY: 4 readable host bytes, 4 bytes of device memory, a live stream; the emulator
    // stages host bytes at the call.
    unsafe {
        sys::aclrtMemcpyAsync(dst, 4, (&raw const one).cast(), 4, sys::ACL_MEMCPY_HOST_TO_DEVICE, s)
    }
}

fn assert_stopped_by_the_kernel(code: sys::aclError, what: &str) {
    assert_eq!(code, sys::ACL_ERROR_RT_AICORE_EXCEPTION, "{what}: {}", sys::recent_error());
    let text = sys::recent_error();
    assert!(
        text.contains("stop-on-failure") && text.contains("kda_zero_padding"),
        "{what}: {text}"
    );
}

/// A kernel fails on stream A (the backend's, which set the mode on its own streams only): from
/// then on stream B — created before, never set, idle — refuses tasks and reports the failure on
/// synchronize, as does a stream created afterwards; destroying streams does not clear it.
#[test]
fn a_failed_task_on_one_stream_stops_every_stream_of_the_context() {
    let b =
        AscendBackend::with_options(AscendOptions { checked: false, ..AscendOptions::default() })
            .unwrap();
    let other = raw_stream();
    assert_eq!(copy_one(other), 0, "{}", sys::recent_error());
    // SAFETY: a live stream.
    assert_eq!(unsafe { sys::aclrtSynchronizeStream(other) }, 0);

    // A zero-padding launch whose token count (4) exceeds the rows (3): the kernel faults when
    // it runs.
    let a = b.new_stream().unwrap();
    let x = b.alloc(DType::F32, &[3, 2]).unwrap();
    let count = b.alloc(DType::I32, &[1]).unwrap();
    b.upload(&a, &count, &[4i32]).unwrap();
    b.launch(&a, Op::ZeroPadding(ZeroPadding { x, num_actual_tokens: count })).unwrap();

    // The fault reaches the context when the kernel runs, before anyone synchronizes stream A.
    let deadline = Instant::now() + Duration::from_secs(30);
    let code = loop {
        // SAFETY: a live stream.
        let code = unsafe { sys::aclrtSynchronizeStream(other) };
        if code != 0 || Instant::now() > deadline {
            break code;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    assert_stopped_by_the_kernel(code, "synchronize of the idle stream");
    assert_stopped_by_the_kernel(copy_one(other), "a copy on the idle stream");
    let mut event = std::ptr::null_mut();
    // SAFETY: valid out-parameter.
    let created = unsafe { sys::aclrtCreateEventExWithFlag(&mut event, sys::ACL_EVENT_SYNC) };
    assert_eq!(created, 0);
    // SAFETY: a live event and stream.
    let recorded = unsafe { sys::aclrtRecordEvent(event, other) };
    assert_stopped_by_the_kernel(recorded, "an event record on the idle stream");

    // The failed stream itself reports it through the backend, naming the HAL op.
    match b.synchronize(&a) {
        Err(Error::OpFailed { op, message, .. }) => {
            assert_eq!(op, "zero_padding");
            assert!(message.contains(&sys::ACL_ERROR_RT_AICORE_EXCEPTION.to_string()), "{message}");
        }
        other => panic!("expected the kernel's failure, got {other:?}"),
    }

    // A stream created after the failure is created (setting its mode queues no task), and
    // refuses tasks too; destroying the stopped streams does not clear the context's failure.
    let late = raw_stream();
    // SAFETY: a live stream.
    assert_eq!(unsafe { sys::aclrtSetStreamFailureMode(late, sys::ACL_STOP_ON_FAILURE) }, 0);
    assert_stopped_by_the_kernel(copy_one(late), "a copy on a stream created afterwards");
    // SAFETY: live handles, destroyed once.
    unsafe {
        assert_eq!(sys::aclrtDestroyEvent(event), 0);
        assert_eq!(sys::aclrtDestroyStream(other), 0);
    }
    assert_stopped_by_the_kernel(copy_one(late), "a copy after the stopped streams are destroyed");
    // SAFETY: a live stream.
    assert_stopped_by_the_kernel(unsafe { sys::aclrtSynchronizeStream(late) }, "synchronize");
}
