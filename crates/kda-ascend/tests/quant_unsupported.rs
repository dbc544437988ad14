//! `DynamicQuant` on an A2/A3 chip (an emulated Ascend 910B3): CANN there has no
//! `aclnnDynamicMxQuantV3` and the project has no AscendC MXFP8 quantize kernel, so the op is a
//! typed refusal naming the op, the chip and the capability, before anything is queued. In its
//! own binary: the emulated SoC is chosen once per process.
#![cfg(feature = "emulated")]
#![allow(clippy::expect_used, clippy::unwrap_used, reason = "tests")]

use std::sync::Once;

use kda_ascend::{AscendBackend, AscendOptions};
use kda_core::mx::{ScaleAlg, num_blocks};
use kda_core::{DType, Device, Error, NativeOps, Op};

fn a2_backend() -> Device<AscendBackend> {
    static SOC: Once = Once::new();
    // SAFETY: set once, before this binary's first backend reads it; nothing else in this
    // binary touches the environment.
    SOC.call_once(|| unsafe { std::env::set_var("KDA_ACL_EMU_SOC", "Ascend910B3") });
    AscendBackend::with_options(AscendOptions { checked: true, ..AscendOptions::default() })
        .unwrap()
}

#[test]
fn dynamic_quant_on_a2_is_refused_before_anything_is_queued() {
    let b = a2_backend();
    assert_eq!(b.info().capabilities.native, NativeOps { mx_quant: false, mx_gemm: false });
    let s = b.new_stream().unwrap();
    let (m, k) = (3, 64);
    let x = b.alloc(DType::BF16, &[m, k]).unwrap();
    let data = b.alloc(DType::E4M3, &[m, k]).unwrap();
    let scale = b.alloc(DType::E8M0, &[m, num_blocks(k)]).unwrap();
    let from = kda_acl_emu::calls_of_this_thread().len();
    match b.launch(&s, Op::DynamicQuant { x, data, scale, alg: ScaleAlg::OcpFloor }) {
        Err(Error::Backend { backend: "ascend", message }) => {
            assert!(
                message.starts_with("DynamicQuant: no MXFP8 quantize on Ascend910B3"),
                "{message}"
            );
            assert!(message.contains("NativeOps::mx_quant is false"), "{message}");
        }
        other => panic!("expected the typed refusal, got {other:?}"),
    }
    let calls = kda_acl_emu::calls_of_this_thread().split_off(from);
    assert_eq!(calls, Vec::new(), "nothing reached the runtime");
}
