//! A kernel binary without one of the kernels the backend launches (as one built from older
//! sources would be): the op that needs it fails with a typed error naming the kernel, the HAL
//! op and the binary's path, before anything is queued; the ops whose kernels the binary has
//! still run and compute their values.
#![cfg(feature = "emulated")]
#![allow(clippy::expect_used, clippy::unwrap_used, reason = "tests")]

use std::path::PathBuf;

use kda_ascend::kernels::abi::names;
use kda_ascend::{AscendBackend, AscendOptions};
use kda_core::kda::CausalConv;
use kda_core::{DType, Device, Error, Op};
use kda_testkit::{Gen, Tolerance};

/// A stand-in binary with every kernel but `kda_conv_prefill`, and a backend that loads it.
fn backend_without_conv_prefill() -> (Device<AscendBackend>, PathBuf) {
    let dir = std::env::temp_dir().join(format!("kda-missing-kernel-{}", std::process::id()));
    let path = std::path::absolute(dir.join("old_kernels.o")).unwrap();
    let kept: Vec<&str> =
        names::ALL.iter().copied().filter(|n| *n != names::CONV_PREFILL).collect();
    assert_eq!(kept.len(), names::ALL.len() - 1);
    kda_acl_emu::write_stand_in(&path, &kept).unwrap();
    let options =
        AscendOptions { checked: false, kernels: Some(path.clone()), ..AscendOptions::default() };
    (AscendBackend::with_options(options).unwrap(), path)
}

#[test]
fn a_kernel_missing_from_the_binary_is_a_typed_error_and_the_others_run() {
    let (b, path) = backend_without_conv_prefill();
    let s = b.new_stream().unwrap();
    let (tokens, channels, width) = (5, 16, 4);
    let i32s = |v: &[i32]| {
        let t = b.alloc(DType::I32, &[v.len()]).unwrap();
        b.upload(&s, &t, v).unwrap();
        t
    };
    let conv = CausalConv {
        x: b.alloc(DType::F32, &[tokens, channels]).unwrap(),
        weight: b.alloc(DType::F32, &[channels, width]).unwrap(),
        query_start_loc: i32s(&[0, tokens as i32]),
        state_slots: i32s(&[0]),
        has_initial_state: i32s(&[0]),
        state: b.alloc(DType::F32, &[1, width - 1, channels]).unwrap(),
        y: b.alloc(DType::F32, &[tokens, channels]).unwrap(),
    };
    b.synchronize(&s).unwrap();
    let from = kda_acl_emu::calls_of_this_thread().len();
    match b.launch(&s, Op::CausalConv(conv)) {
        Err(Error::Backend { backend: "ascend", message }) => {
            assert!(message.starts_with("kernel `kda_conv_prefill`"), "{message}");
            assert!(message.contains("needed by HAL op `causal_conv`"), "{message}");
            assert!(message.contains(&path.display().to_string()), "{message}");
            assert!(message.contains("aclrtBinaryGetFunction"), "{message}");
        }
        other => panic!("expected the missing-kernel error, got {other:?}"),
    }
    let calls = kda_acl_emu::calls_of_this_thread().split_off(from);
    let launched: Vec<_> = calls.iter().filter(|c| c.api.starts_with("kda_")).collect();
    assert!(launched.is_empty(), "nothing queued: {calls:?}");

    // A kernel the binary has: the sigmoid, against f64 arithmetic.
    let n = 40;
    let xs = Gen::new(11).normal_f32(n, 0.0, 3.0);
    let x = b.alloc(DType::F32, &[n]).unwrap();
    b.upload(&s, &x, &xs).unwrap();
    let y = b.alloc(DType::F32, &[n]).unwrap();
    b.launch(&s, Op::Sigmoid { x, y: y.clone() }).unwrap();
    let got: Vec<f64> = b.download::<f32>(&s, &y).unwrap().into_iter().map(f64::from).collect();
    let want: Vec<f64> = xs.iter().map(|&v| 1.0 / (1.0 + (-f64::from(v)).exp())).collect();
    Tolerance::new(1e-6, 1e-6).assert_close(&[n], &got, &want);
}
