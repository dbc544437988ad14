//! The Ascend tasks.
//!
//! - `cargo xtask kernels`: compile the AscendC kernels (`crates/kda-ascend/kernels/*.cpp`)
//!   with `build_kernels.sh` (`kernel_script.rs`): the toolkit from set_env.sh's variables or
//!   the default install path, the compiler where asc-devkit's cmake looks for it, the flags
//!   of the release found (`bisheng_intf.cmake` before 9.0, the ASC language's `--npu-arch`
//!   from 9.0), each source compiled for the device only, then one device link into
//!   `target/ascend-kernels/kda_kernels.o`. Every command is printed before it runs.
//!   `KDA_ASCEND_NPU_ARCH` picks the architecture (`dav-2201`: A2/A3, the default;
//!   `dav-3510`: 950), `KDA_ASCEND_KERNEL_STYLE=asc|cce` overrides the flags. Without a
//!   toolkit it says exactly what it skipped and why, and succeeds.
//! - `cargo xtask kernels --check DEVKIT_DIR`: the sources' syntax and type check against
//!   asc-devkit's headers with the host compiler, no toolkit needed (see `kernel_check.rs`).
//! - `cargo xtask test --backend ascend`: on a machine with CANN and an NPU, compile the kernels
//!   and run kda-ascend's conformance suite, layer and schedule tests with feature `acl`.
//! - `cargo xtask npu-check --bundle DIR`: see `npu_check.rs`.
//! - In `cargo xtask test`: the workspace is built and tested with kda-ascend's `emulated`
//!   feature ([`EMULATED`]); [`twin_checks`] covers the feature-off twin.

use std::path::PathBuf;

use crate::{cargo, kernel_script, step};

/// The features `cargo xtask test` runs kda-ascend with: the emulated ACL runtime, also under
/// kda-embed (its engine-stream test on the Ascend path).
pub const EMULATED: &str = "kda-ascend/emulated,kda-embed/ascend-emulated";

pub(crate) const KERNELS_DIR: &str = "crates/kda-ascend/kernels";
const OUT_DIR: &str = "target/ascend-kernels";

/// The kernel sources, sorted.
pub(crate) fn sources() -> Result<Vec<PathBuf>, String> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(KERNELS_DIR)
        .map_err(|e| format!("kernels: cannot read {KERNELS_DIR}: {e}"))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "cpp"))
        .collect();
    found.sort();
    Ok(found)
}

/// The sources' file names.
pub(crate) fn source_names() -> Result<Vec<String>, String> {
    Ok(sources()?
        .iter()
        .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .collect())
}

/// One command line: program and arguments.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct CommandLine {
    pub program: String,
    pub args: Vec<String>,
}

impl CommandLine {
    /// As a shell would run it (arguments quoted where needed).
    pub(crate) fn shell(&self) -> String {
        let quote = |a: &str| {
            if a.chars().all(|c| c.is_ascii_alphanumeric() || "-_=./,+:$".contains(c)) {
                a.to_string()
            } else {
                format!("'{}'", a.replace('\'', "'\\''"))
            }
        };
        std::iter::once(self.program.as_str())
            .chain(self.args.iter().map(String::as_str))
            .map(quote)
            .collect::<Vec<_>>()
            .join(" ")
    }
}

/// Compile the kernels with `build_kernels.sh` (written to `target/ascend-kernels/`, the
/// same script the npu-check bundle runs); `Ok(None)` when there is no toolkit or compiler
/// (after saying what was skipped and why).
pub fn kernels() -> Result<Option<PathBuf>, String> {
    let names = source_names()?;
    std::fs::create_dir_all(OUT_DIR)
        .map_err(|e| format!("kernels: cannot create {OUT_DIR}: {e}"))?;
    let out = std::path::absolute(OUT_DIR).map_err(|e| format!("kernels: {e}"))?;
    let src = std::path::absolute(KERNELS_DIR).map_err(|e| format!("kernels: {e}"))?;
    let script = out.join("build_kernels.sh");
    std::fs::write(&script, kernel_script::script(&names))
        .map_err(|e| format!("kernels: {}: {e}", script.display()))?;
    println!("kernels: bash {} {} {}", script.display(), src.display(), out.display());
    let status = std::process::Command::new("bash")
        .arg(&script)
        .arg(&src)
        .arg(&out)
        .status()
        .map_err(|e| format!("kernels: cannot run bash: {e}"))?;
    match status.code() {
        Some(0) => Ok(Some(out.join(kernel_script::BINARY))),
        Some(kernel_script::NO_TOOLKIT) => {
            println!("kernels: skipped compiling {} AscendC sources (see above)", names.len());
            for s in &names {
                println!("  skipped {KERNELS_DIR}/{s}");
            }
            println!(
                "kernels: source CANN's set_env.sh (or set ASCEND_TOOLKIT_HOME) to build them"
            );
            Ok(None)
        }
        _ => Err(format!("kernels: the kernel build failed ({status}); its error is above")),
    }
}

/// The cargo arguments of `test --backend ascend`: every test target of kda-ascend that runs
/// with feature `acl` (the lib's units, `conformance`, `timing`, `linking`).
pub(crate) const BACKEND_TEST_ARGS: [&str; 6] =
    ["test", "--release", "-p", "kda-ascend", "--features", "acl"];

/// `cargo xtask test --backend <name>`.
pub fn test_backend(backend: Option<&str>) -> Result<(), String> {
    match backend {
        // The unit tests, the whole conformance suite (streams, GEMMs, views, sanitizer, KDA
        // ops, MX, both schedules, the layer) and the event-timed schedules, on the NPU.
        Some("ascend") => {
            let Some(binary) = kernels()? else {
                return Err("test --backend ascend: needs a CANN toolkit (see above)".into());
            };
            let binary = binary.display().to_string();
            step(
                "test (kda-ascend on the NPU)",
                &cargo(),
                &BACKEND_TEST_ARGS,
                &[("KDA_ASCEND_KERNELS", binary.as_str())],
            )
        }
        other => Err(format!("test --backend: unknown backend {other:?} (known: ascend)")),
    }
}

/// The configurations the workspace run does not build: the feature-off twin (lint and test;
/// the workspace run enables `emulated`, which replaces it) and feature `acl`, which builds here
/// without CANN (symbols resolve at run time) and fails at creation naming the missing library.
pub fn twin_checks() -> Result<(), String> {
    let cargo = cargo();
    step(
        "clippy (kda-ascend acl)",
        &cargo,
        &[
            "clippy",
            "-p",
            "kda-ascend",
            "--all-targets",
            "--features",
            "acl",
            "--",
            "-D",
            "warnings",
        ],
        &[],
    )?;
    step(
        "test (kda-ascend acl without CANN)",
        &cargo,
        &["test", "--release", "-p", "kda-ascend", "--features", "acl", "--test", "linking"],
        &[],
    )?;
    step(
        "clippy (kda-ascend twin)",
        &cargo,
        &["clippy", "-p", "kda-ascend", "--all-targets", "--", "-D", "warnings"],
        &[],
    )?;
    step(
        "test (kda-ascend twin)",
        &cargo,
        &["test", "--release", "-p", "kda-ascend", "--lib"],
        &[],
    )?;
    a2_conformance()
}

/// The whole emulated conformance suite on an Atlas A2 profile (`KDA_ACL_EMU_SOC=Ascend910B3`: no
/// MX aclnn ops, no mixed bf16 `aclnnMatmul`, the A2's UB size and ReduceSum order under the
/// AscendC twin); the workspace tests above run it on the 950 profile (the emulator's default).
/// The bodies ask the backend's capabilities: DynamicQuant and MXFP8 projections are refused by
/// design there, the MX GEMM route (dequantize, then the bf16 GEMM) is held to its stated
/// tolerance, and the layer bodies compare with the oracle of the bf16 QKV a layer runs there.
fn a2_conformance() -> Result<(), String> {
    let cargo = cargo();
    step(
        "test (kda-ascend conformance, emulated A2)",
        &cargo,
        &[
            "test",
            "--release",
            "-p",
            "kda-ascend",
            "--features",
            "emulated",
            "--test",
            "conformance",
        ],
        &[("KDA_ACL_EMU_SOC", "Ascend910B3")],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments_with_spaces_are_quoted() {
        let c =
            CommandLine { program: "/a b/bisheng".into(), args: vec!["-o".into(), "x y".into()] };
        assert_eq!(c.shell(), "'/a b/bisheng' -o 'x y'");
    }
}
