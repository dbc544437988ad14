//! The Ascend tasks.
//!
//! - `cargo xtask kernels`: compile the AscendC kernels (`crates/kda-ascend/kernels/*.cpp`) with
//!   the toolkit's `bisheng` into `target/ascend-kernels/kda_kernels.o`, the binary the backend
//!   loads (`KDA_ASCEND_KERNELS` overrides the path). Without a toolkit it says exactly what it
//!   skipped and why, and succeeds.
//! - `cargo xtask test --backend ascend`: on a machine with CANN and an NPU, compile the kernels
//!   and run kda-ascend's tests (the conformance suite included) with feature `acl`.
//! - In `cargo xtask test`: the workspace is built and tested with kda-ascend's `emulated`
//!   feature ([`EMULATED`]); [`twin_checks`] covers the feature-off twin.

use std::path::{Path, PathBuf};

use crate::{cargo, step};

/// The feature `cargo xtask test` runs kda-ascend with: the emulated ACL runtime.
pub const EMULATED: &str = "kda-ascend/emulated";

/// The variables CANN's `set_env.sh` exports, in the order they are trusted.
const TOOLKIT_VARS: [&str; 3] =
    ["ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH", "ASCEND_CANN_PACKAGE_PATH"];
const DEFAULT_TOOLKIT: &str = "/usr/local/Ascend/ascend-toolkit/latest";
const KERNELS_DIR: &str = "crates/kda-ascend/kernels";
const OUT_DIR: &str = "target/ascend-kernels";
/// A2/A3 (Ascend 910B / 910_93); `KDA_ASCEND_NPU_ARCH=dav-3510` for the 950.
const DEFAULT_ARCH: &str = "dav-2201";

/// The toolkit root and its `bisheng`, or why there is none.
fn toolkit() -> Result<(PathBuf, PathBuf), String> {
    let (root, origin) = TOOLKIT_VARS
        .iter()
        .find_map(|v| std::env::var_os(v).map(|p| (PathBuf::from(p), format!("${v}"))))
        .unwrap_or_else(|| (PathBuf::from(DEFAULT_TOOLKIT), "the default location".into()));
    if !root.is_dir() {
        return Err(format!(
            "no CANN toolkit: {} ({origin}) is not a directory; none of {} is set to one",
            root.display(),
            TOOLKIT_VARS.join(", ")
        ));
    }
    let bisheng = root.join("compiler/ccec_compiler/bin/bisheng");
    if !bisheng.is_file() {
        return Err(format!("the toolkit at {} has no {}", root.display(), bisheng.display()));
    }
    Ok((root, bisheng))
}

/// The kernel sources, sorted.
fn sources() -> Result<Vec<PathBuf>, String> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(KERNELS_DIR)
        .map_err(|e| format!("kernels: cannot read {KERNELS_DIR}: {e}"))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "cpp"))
        .collect();
    found.sort();
    Ok(found)
}

/// Compile the kernels; `Ok(None)` when there is no toolkit (after saying so).
pub fn kernels() -> Result<Option<PathBuf>, String> {
    let sources = sources()?;
    let (root, bisheng) = match toolkit() {
        Ok(t) => t,
        Err(why) => {
            println!("kernels: skipped compiling {} AscendC sources: {why}", sources.len());
            for s in &sources {
                println!("  skipped {}", s.display());
            }
            println!(
                "kernels: source CANN's set_env.sh (or set ASCEND_TOOLKIT_HOME) to build them"
            );
            return Ok(None);
        }
    };
    std::fs::create_dir_all(OUT_DIR)
        .map_err(|e| format!("kernels: cannot create {OUT_DIR}: {e}"))?;
    // One translation unit, so the runtime loads one binary with every kernel.
    let unity = Path::new(OUT_DIR).join("kda_kernels.cpp");
    let includes: String = sources
        .iter()
        .map(|s| {
            format!(
                "#include \"{}\"\n",
                std::path::absolute(s).unwrap_or_else(|_| s.clone()).display()
            )
        })
        .collect();
    std::fs::write(&unity, includes)
        .map_err(|e| format!("kernels: cannot write {}: {e}", unity.display()))?;
    let arch = std::env::var("KDA_ASCEND_NPU_ARCH").unwrap_or_else(|_| DEFAULT_ARCH.into());
    let out = Path::new(OUT_DIR).join("kda_kernels.o");
    let inc = |p: &str| format!("-I{}", root.join(p).display());
    let args = [
        "-xcce".to_string(),
        "-O2".into(),
        "-std=c++17".into(),
        format!("--npu-arch={arch}"),
        inc("include"),
        inc("compiler/tikcpp/tikcfw"),
        inc("compiler/tikcpp/tikcfw/impl"),
        inc("compiler/tikcpp/tikcfw/interface"),
        format!("-I{KERNELS_DIR}"),
        "-o".into(),
        out.display().to_string(),
        unity.display().to_string(),
    ];
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    step("kernels (bisheng)", &bisheng.display().to_string(), &args, &[])?;
    println!("kernels: {} ({arch}, {} sources)", out.display(), sources.len());
    Ok(Some(out))
}

/// `cargo xtask test --backend <name>`.
pub fn test_backend(backend: Option<&str>) -> Result<(), String> {
    match backend {
        Some("ascend") => {
            let Some(binary) = kernels()? else {
                return Err("test --backend ascend: needs a CANN toolkit (see above)".into());
            };
            let binary = binary.display().to_string();
            step(
                "test (kda-ascend on the NPU)",
                &cargo(),
                &["test", "--release", "-p", "kda-ascend", "--features", "acl"],
                &[("KDA_ASCEND_KERNELS", binary.as_str())],
            )
        }
        other => Err(format!("test --backend: unknown backend {other:?} (known: ascend)")),
    }
}

/// The configurations the workspace run does not build: the feature-off twin (lint and test;
/// the workspace run enables `emulated`, which replaces it) and feature `acl` (type-checked
/// against the declared FFI; linking needs CANN).
pub fn twin_checks() -> Result<(), String> {
    let cargo = cargo();
    step(
        "check (kda-ascend acl, not linked)",
        &cargo,
        &["check", "-p", "kda-ascend", "--features", "acl"],
        &[],
    )?;
    step(
        "clippy (kda-ascend twin)",
        &cargo,
        &["clippy", "-p", "kda-ascend", "--all-targets", "--", "-D", "warnings"],
        &[],
    )?;
    step("test (kda-ascend twin)", &cargo, &["test", "--release", "-p", "kda-ascend", "--lib"], &[])
}
