//! The Ascend tasks.
//!
//! - `cargo xtask kernels`: compile the AscendC kernels (`crates/kda-ascend/kernels/*.cpp`) the
//!   way CANN's `ascendc_fatbin_library` does (asc-devkit `cmake/asc/asc_modules/FindASC.cmake`):
//!   each source compiled for the device only (`--aicore-only`), then the device objects linked
//!   into one loadable binary with the toolkit's `ld.lld -m aicorelinux -Ttext=0 … -static`
//!   (`CMakeASCInformation.cmake`), `target/ascend-kernels/kda_kernels.o`. Every command is
//!   printed before it runs. `KDA_ASCEND_NPU_ARCH` picks the architecture (`dav-2201`: A2/A3,
//!   the default; `dav-3510`: 950); `KDA_ASCEND_KERNEL_STYLE=cce` uses the flags of CANN 8.x's
//!   `bisheng_intf.cmake` instead (`-xcce --cce-aicore-arch=dav-c220-vec --cce-aicore-only
//!   --cce-auto-sync`). Without a toolkit it says exactly what it skipped and why, and succeeds.
//! - `cargo xtask kernels --check DEVKIT_DIR`: the sources' syntax and type check against
//!   asc-devkit's headers with the host compiler, no toolkit needed (see `kernel_check.rs`).
//! - `cargo xtask test --backend ascend`: on a machine with CANN and an NPU, compile the kernels
//!   and run kda-ascend's conformance suite, layer and schedule tests with feature `acl`.
//! - `cargo xtask npu-check --bundle DIR`: see `npu_check.rs`.
//! - In `cargo xtask test`: the workspace is built and tested with kda-ascend's `emulated`
//!   feature ([`EMULATED`]); [`twin_checks`] covers the feature-off twin.

use std::path::{Path, PathBuf};

use crate::{cargo, step};

/// The features `cargo xtask test` runs kda-ascend with: the emulated ACL runtime, also under
/// kda-embed (its engine-stream test on the Ascend path).
pub const EMULATED: &str = "kda-ascend/emulated,kda-embed/ascend-emulated";

/// The variables CANN's `set_env.sh` exports, in the order they are trusted.
const TOOLKIT_VARS: [&str; 3] =
    ["ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH", "ASCEND_CANN_PACKAGE_PATH"];
const DEFAULT_TOOLKIT: &str = "/usr/local/Ascend/ascend-toolkit/latest";
pub(crate) const KERNELS_DIR: &str = "crates/kda-ascend/kernels";
const OUT_DIR: &str = "target/ascend-kernels";
/// A2/A3 (Ascend 910B / 910_93); `KDA_ASCEND_NPU_ARCH=dav-3510` for the 950.
const DEFAULT_ARCH: &str = "dav-2201";
/// The binary's name, which the backend looks for (`ascend-kernels/kda_kernels.o`).
pub(crate) const BINARY: &str = "kda_kernels.o";

/// The toolkit root, its `bisheng` and its `ld.lld`, or why there is none.
fn toolkit() -> Result<(PathBuf, PathBuf, PathBuf), String> {
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
    let bin = root.join("compiler/ccec_compiler/bin");
    let (bisheng, lld) = (bin.join("bisheng"), bin.join("ld.lld"));
    for tool in [&bisheng, &lld] {
        if !tool.is_file() {
            return Err(format!("the toolkit at {} has no {}", root.display(), tool.display()));
        }
    }
    Ok((root, bisheng, lld))
}

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

/// Which compiler flags the device compile uses.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Style {
    /// The asc-devkit's ASC language rules (`--npu-arch`, `--asc-aicore-lang`, `--aicore-only`).
    Asc,
    /// CANN 8.x's bisheng interface (`-xcce --cce-aicore-arch=… --cce-aicore-only`).
    Cce,
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

/// The vector architecture of the CCE style for an `--npu-arch` name.
fn cce_arch(arch: &str) -> &'static str {
    if arch == "dav-3510" { "dav-c310-vec" } else { "dav-c220-vec" }
}

/// The tools and target of a kernel build (paths as text: a script may name them by variable).
#[derive(Clone, Debug)]
pub(crate) struct Toolchain {
    /// The toolkit root.
    pub root: String,
    pub bisheng: String,
    pub lld: String,
    /// `--npu-arch` (`dav-2201`, `dav-3510`).
    pub arch: String,
    pub style: Style,
}

/// The commands that build the kernel binary: one device-only compile per source, then the
/// device link into `out/kda_kernels.o`. Every kernel is typed AIV-only in its source
/// (`KDA_VECTOR_KERNEL`), and `--cce-auto-sync` inserts the pipe barriers between the vector
/// pipes.
pub(crate) fn kernel_commands(
    tc: &Toolchain,
    sources: &[String],
    include: &str,
    out: &str,
) -> Vec<CommandLine> {
    let Toolchain { root, bisheng, lld, arch, style } = tc;
    let style = *style;
    let inc = |p: &str| format!("-I{root}/{p}");
    let includes = [
        inc("include"),
        inc("compiler/tikcpp/tikcfw"),
        inc("compiler/tikcpp/tikcfw/impl"),
        inc("compiler/tikcpp/tikcfw/interface"),
        inc("compiler/asc/include"),
        format!("-I{include}"),
    ];
    let mut commands = Vec::new();
    let mut objects = Vec::new();
    for src in sources {
        let stem = Path::new(src).file_stem().map_or("kernel".into(), |s| s.to_string_lossy());
        let obj = format!("{out}/{stem}.device.o");
        let mut args: Vec<String> = match style {
            Style::Asc => vec![format!("--npu-arch={arch}"), "-O2".into(), "-std=c++17".into()],
            Style::Cce => vec![
                "-xcce".into(),
                format!("--cce-aicore-arch={}", cce_arch(arch)),
                "--cce-aicore-only".into(),
                "-O2".into(),
                "-std=c++17".into(),
            ],
        };
        args.push("--cce-auto-sync".into());
        args.extend(includes.iter().cloned());
        args.extend(["-o".into(), obj.clone(), "-c".into()]);
        if style == Style::Asc {
            args.push("--asc-aicore-lang".into());
        }
        args.push(src.clone());
        if style == Style::Asc {
            args.push("--aicore-only".into());
        }
        commands.push(CommandLine { program: bisheng.clone(), args });
        objects.push(obj);
    }
    let mut link = vec!["-m".to_string(), "aicorelinux".into(), "-Ttext=0".into()];
    link.extend(objects);
    link.extend(["-static".into(), "-o".into(), format!("{out}/{BINARY}")]);
    commands.push(CommandLine { program: lld.clone(), args: link });
    commands
}

/// The style `KDA_ASCEND_KERNEL_STYLE` names (`asc`, the default, or `cce`).
pub(crate) fn style_from_env() -> Result<Style, String> {
    match std::env::var("KDA_ASCEND_KERNEL_STYLE").as_deref() {
        Err(_) | Ok("asc") => Ok(Style::Asc),
        Ok("cce") => Ok(Style::Cce),
        Ok(other) => Err(format!("KDA_ASCEND_KERNEL_STYLE={other}: expected asc or cce")),
    }
}

/// Compile the kernels; `Ok(None)` when there is no toolkit (after saying so).
pub fn kernels() -> Result<Option<PathBuf>, String> {
    let sources = sources()?;
    let (root, bisheng, lld) = match toolkit() {
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
    let arch = std::env::var("KDA_ASCEND_NPU_ARCH").unwrap_or_else(|_| DEFAULT_ARCH.into());
    let text = |p: &Path| p.display().to_string();
    let absolute = |p: &Path| std::path::absolute(p).map(|a| text(&a)).unwrap_or_else(|_| text(p));
    let toolchain = Toolchain {
        root: text(&root),
        bisheng: text(&bisheng),
        lld: text(&lld),
        arch: arch.clone(),
        style: style_from_env()?,
    };
    let commands = kernel_commands(
        &toolchain,
        &sources.iter().map(|s| absolute(s)).collect::<Vec<_>>(),
        &absolute(Path::new(KERNELS_DIR)),
        &absolute(Path::new(OUT_DIR)),
    );
    for (i, c) in commands.iter().enumerate() {
        println!("kernels [{}/{}]: {}", i + 1, commands.len(), c.shell());
        let args: Vec<&str> = c.args.iter().map(String::as_str).collect();
        step("kernels", &c.program, &args, &[])?;
    }
    let out = std::path::absolute(Path::new(OUT_DIR).join(BINARY))
        .map_err(|e| format!("kernels: {e}"))?;
    println!("kernels: {} ({arch}, {} sources)", out.display(), sources.len());
    Ok(Some(out))
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

/// The emulated conformance suite on an Atlas A2 profile (`KDA_ACL_EMU_SOC=Ascend910B3`: no MX
/// aclnn ops, no mixed bf16 `aclnnMatmul`, the A2's UB size and ReduceSum order under the
/// AscendC twin); the workspace tests above run it on the 950 profile (the emulator's default).
/// Skipped here until their conformance bodies ask the backend's capabilities: the MX and
/// schedule bodies (they quantize with `DynamicQuant`, which A2 refuses by design) and the two
/// layer bodies that compare the default layer (bf16 QKV on A2) with the MXFP8 oracle.
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
            "--",
            "--skip",
            "mx_",
            "--skip",
            "schedule_",
            "--skip",
            "layer_matches_f64_oracle",
            "--skip",
            "layer_norm_uses_the_checkpoint_eps",
        ],
        &[("KDA_ACL_EMU_SOC", "Ascend910B3")],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(style: Style, arch: &str) -> Vec<String> {
        let sources = ["/k/kda_gate.cpp".to_string(), "/k/kda_sigmoid.cpp".to_string()];
        let tc = Toolchain {
            root: "/cann".into(),
            bisheng: "/cann/bisheng".into(),
            lld: "/cann/ld.lld".into(),
            arch: arch.into(),
            style,
        };
        kernel_commands(&tc, &sources, "/k", "/out").iter().map(CommandLine::shell).collect()
    }

    /// `ascendc_fatbin_library`: device-only compiles, then one device link.
    #[test]
    fn kernels_build_as_a_device_only_compile_then_a_device_link() {
        let all = lines(Style::Asc, "dav-2201");
        assert_eq!(all.len(), 3);
        let inc = "-I/cann/include -I/cann/compiler/tikcpp/tikcfw \
                   -I/cann/compiler/tikcpp/tikcfw/impl -I/cann/compiler/tikcpp/tikcfw/interface \
                   -I/cann/compiler/asc/include -I/k";
        let inc = inc.split_whitespace().collect::<Vec<_>>().join(" ");
        assert_eq!(
            all[0],
            format!(
                "/cann/bisheng --npu-arch=dav-2201 -O2 -std=c++17 --cce-auto-sync {inc} \
                 -o /out/kda_gate.device.o -c --asc-aicore-lang /k/kda_gate.cpp --aicore-only"
            )
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
        );
        assert!(
            all[1].contains("-o /out/kda_sigmoid.device.o -c --asc-aicore-lang /k/kda_sigmoid.cpp")
        );
        assert_eq!(
            all[2],
            "/cann/ld.lld -m aicorelinux -Ttext=0 /out/kda_gate.device.o \
             /out/kda_sigmoid.device.o -static -o /out/kda_kernels.o"
                .split_whitespace()
                .collect::<Vec<_>>()
                .join(" ")
        );
    }

    #[test]
    fn the_cce_style_uses_the_vector_arch_and_auto_sync() {
        let a2 = lines(Style::Cce, "dav-2201");
        assert!(a2[0].starts_with(
            "/cann/bisheng -xcce --cce-aicore-arch=dav-c220-vec --cce-aicore-only -O2 -std=c++17 \
             --cce-auto-sync"
                .split_whitespace()
                .collect::<Vec<_>>()
                .join(" ")
                .as_str()
        ), "{}", a2[0]);
        assert!(!a2[0].contains("--asc-aicore-lang") && !a2[0].contains("--npu-arch"));
        assert!(lines(Style::Cce, "dav-3510")[1].contains("--cce-aicore-arch=dav-c310-vec"));
        assert!(a2[2].starts_with("/cann/ld.lld -m aicorelinux -Ttext=0"));
    }

    #[test]
    fn arguments_with_spaces_are_quoted() {
        let c =
            CommandLine { program: "/a b/bisheng".into(), args: vec!["-o".into(), "x y".into()] };
        assert_eq!(c.shell(), "'/a b/bisheng' -o 'x y'");
    }
}
