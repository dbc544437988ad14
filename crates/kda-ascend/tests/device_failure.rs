//! A kernel that stops its core (here: an `ascendc_assert` on bad device data) fails its stream;
//! work queued behind it that waits on the host — a download, a host function — reports the
//! failure instead of waiting for a callback the stopped stream will never run. The fault stops
//! every stream of the context, so this is a binary of its own (its own process and context).
#![cfg(feature = "emulated")]
#![allow(clippy::expect_used, clippy::unwrap_used, reason = "tests")]

use kda_ascend::{AscendBackend, AscendOptions, sys};
use kda_core::kda::ZeroPadding;
use kda_core::{DType, Error, Op};

#[test]
fn a_download_behind_a_failed_kernel_reports_the_failure_instead_of_hanging() {
    let b =
        AscendBackend::with_options(AscendOptions { checked: false, ..AscendOptions::default() })
            .unwrap();
    let s = b.new_stream().unwrap();
    let x = b.alloc(DType::F32, &[3, 2]).unwrap();
    b.upload(&s, &x, &[1.0f32; 6]).unwrap();
    let count = b.alloc(DType::I32, &[1]).unwrap();
    b.upload(&s, &count, &[4i32]).unwrap();
    b.launch(&s, Op::ZeroPadding(ZeroPadding { x: x.clone(), num_actual_tokens: count })).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let worker = std::thread::spawn(move || {
        let got = b.download::<f32>(&s, &x);
        tx.send(()).unwrap();
        (got, b, s)
    });
    if rx.recv_timeout(std::time::Duration::from_secs(30)).is_err() {
        panic!("the download behind the failed kernel hangs");
    }
    let (got, b, s) = worker.join().unwrap();
    // Either the download's copy was queued before the kernel faulted, and the synchronize
    // reports the failed op; or the fault came first, and the stopped context refused the copy
    // with the kernel's failure (507015, its text naming the kernel and the bad count).
    match got {
        Err(Error::OpFailed { op, message, .. }) => {
            assert_eq!(op, "zero_padding");
            assert!(message.contains("num_actual_tokens = 4"), "{message}");
        }
        Err(Error::Backend { message, .. }) => {
            let code = sys::ACL_ERROR_RT_AICORE_EXCEPTION.to_string();
            assert!(message.contains(&code), "{message}");
            assert!(message.contains("kda_zero_padding"), "{message}");
            assert!(message.contains("num_actual_tokens = 4"), "{message}");
        }
        other => panic!("expected the kernel's failure, got {other:?}"),
    }
    // The fault stopped the context (stop-on-failure holds for every stream of it: the rules
    // table of docs/ascend.md): the fresh ACL stream the backend continues on, and any other
    // stream of the instance, refuse work with the kernel's failure.
    let refused = |got: Result<(), Error>, what: &str| {
        let text = format!("{got:?}");
        assert!(got.is_err(), "{what}: the stopped context accepted work");
        assert!(text.contains(&sys::ACL_ERROR_RT_AICORE_EXCEPTION.to_string()), "{what}: {text}");
    };
    let y = b.alloc(DType::F32, &[2]).unwrap();
    refused(b.upload(&s, &y, &[3.0f32, 4.0]), "an upload on the failed stream");
    let t = b.new_stream().unwrap();
    refused(b.upload(&t, &y, &[3.0f32, 4.0]), "an upload on a new stream");
}
