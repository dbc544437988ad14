//! `kda info` reports which op families each backend runs natively: the reference all of them;
//! the Ascend backend (where compiled in, over the emulated runtime) the MX ops on an Ascend 950
//! and none on an A2/A3 part whose CANN lacks them (`docs/design/kda.md#qkv-precision`); and
//! the core operands a layer takes by default: bf16 where CANN's `aclnnChunkKdaFwd` exists, f32
//! otherwise (`docs/design/kda.md#core-operand-dtype`).
#![allow(clippy::expect_used, clippy::unwrap_used, reason = "test setup")]

use std::process::Command;

/// `kda info`'s first line for `backend`, run with the emulated SoC `soc` (if any) and the
/// emulator's vendor-op setting `vendor` (if any).
fn info_line(backend: &str, soc: Option<&str>) -> String {
    info_line_with(backend, soc, None)
}

fn info_line_with(backend: &str, soc: Option<&str>, vendor: Option<&str>) -> String {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kda"));
    cmd.arg("info");
    if let Some(soc) = soc {
        cmd.env("KDA_ACL_EMU_SOC", soc);
    }
    if let Some(vendor) = vendor {
        cmd.env("KDA_ACL_EMU_VENDOR_OPS", vendor);
    }
    let o = cmd.output().expect("the kda binary runs");
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    out.lines()
        .find(|l| l.trim_start().starts_with(&format!("{backend} ")))
        .unwrap_or_else(|| panic!("no line for {backend} in:\n{out}"))
        .to_string()
}

#[test]
fn info_shows_the_native_op_families_of_each_backend() {
    let reference = info_line("reference", None);
    assert!(
        reference.ends_with("native ops: mx_quant, mx_gemm  core operands: f32"),
        "{reference}"
    );
    let ascend = info_line("ascend", None);
    if ascend.contains("not compiled in") {
        eprintln!("kda-ascend is not compiled in: checked the reference line only");
        return;
    }
    assert!(ascend.ends_with("native ops: mx_quant, mx_gemm  core operands: bf16"), "{ascend}");
    let a2 = info_line("ascend", Some("Ascend910B3"));
    assert!(a2.ends_with("native ops: none  core operands: bf16"), "{a2}");
    assert!(a2.contains("absent: aclnnDynamicMxQuantV3"), "{a2}");
    let no_vendor = info_line_with("ascend", Some("Ascend910B3"), Some("none"));
    assert!(no_vendor.ends_with("native ops: none  core operands: f32"), "{no_vendor}");
}
