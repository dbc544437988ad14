//! `cargo xtask npu-check --bundle DIR`: everything a machine with CANN and one NPU needs for a
//! first, decisive run of the Ascend backend, without cargo there:
//!
//! - `tests/`: kda-ascend's test binaries built here with feature `acl` (the unit tests, the
//!   whole conformance suite — streams, GEMMs, KDA ops, MX, both schedules, the layer — and the
//!   event-timed schedules and layer of `tests/timing.rs`);
//! - `kernels/`: the AscendC sources and `build_kernels.sh`, the exact `cargo xtask kernels`
//!   commands (device-only compiles, device link) against `$ASCEND_TOOLKIT_HOME`;
//! - `run.sh [OUT]`: builds the kernels, then runs each step under its own time limit
//!   (`timeout`, killed past it), streams every line to `OUT/npu-check.log` as it comes, and
//!   rewrites `OUT/npu-check.json` (steps, test counts, failures, timings; `"complete": false`
//!   until the end) after every step, so a run cut short still reports what it saw.
//!
//! The binaries are built for this machine's architecture, or for `--target TRIPLE` (an
//! `aarch64-unknown-linux-gnu` bundle for the Kunpeng hosts of most Atlas A2/A3 servers).
//! A target other than the host's is built with cargo-zigbuild, which links against glibc
//! [`GLIBC_GOAL`] (openEuler 20.03, Kylin V10 and other hosts those servers run ship 2.28):
//! Debian's cross gcc would link against this machine's glibc 2.36 and the binaries would
//! not start there. `run.sh` names the bundle's architecture and the newest glibc its binaries
//! need, and refuses a host that does not match in one line. The build of the bundle itself
//! needs no toolkit (the CANN libraries are opened at run time).

use std::path::{Path, PathBuf};

use crate::ascend;
use crate::cargo;
use crate::gpu_check::{executables, run_quiet};
use crate::kernel_script;

/// The test binaries the bundle carries (by target name), each step's time limit, seconds,
/// and whether it also runs in the parallel pass (the timing step measures one schedule at a
/// time; its one-thread numbers are the ones to read).
const STEPS: [(&str, &str, u32, bool); 3] = [
    ("unit", "kda_ascend", 300, true),
    ("conformance", "conformance", 1200, true),
    ("timing", "timing", 600, false),
];
/// Compiling the kernels on the NPU machine.
const KERNELS_LIMIT: u32 = 900;
/// The oldest glibc a cross-built bundle runs on (cargo-zigbuild's `TRIPLE.2.28`).
pub(crate) const GLIBC_GOAL: (u32, u32) = (2, 28);

/// What `run.sh` is told about its binaries.
#[derive(Clone, Debug, PartialEq, Eq)]
struct BundleInfo {
    /// `uname -m` of the hosts the binaries run on.
    arch: String,
    /// The newest glibc symbol version the binaries need ("unknown" when none was found).
    glibc: String,
}

pub fn npu_check(args: &[String]) -> Result<(), String> {
    let usage = "usage: cargo xtask npu-check --bundle DIR [--target TRIPLE]";
    let (dir, target) = match args {
        [flag, dir] if flag == "--bundle" => (PathBuf::from(dir), None),
        [flag, dir, t, triple] if flag == "--bundle" && t == "--target" => {
            (PathBuf::from(dir), Some(triple.as_str()))
        }
        _ => return Err(usage.into()),
    };
    bundle(&dir, target).map(|_| ())
}

fn write(path: &Path, text: &str, executable: bool) -> Result<(), String> {
    std::fs::write(path, text).map_err(|e| format!("npu-check: {}: {e}", path.display()))?;
    if executable {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))
            .map_err(|e| format!("npu-check: {}: {e}", path.display()))?;
    }
    Ok(())
}

/// The `uname -m` name of a target triple's architecture.
fn triple_arch(triple: &str) -> &str {
    triple.split('-').next().unwrap_or(triple)
}

/// Where `pip install ziglang cargo-zigbuild` put them (`.ci/run` installs them there).
fn zig_venv() -> PathBuf {
    let cache = std::env::var_os("XDG_CACHE_HOME").map(PathBuf::from).unwrap_or_else(|| {
        PathBuf::from(std::env::var_os("HOME").unwrap_or_else(|| "/tmp".into())).join(".cache")
    });
    cache.join("kda/zig/bin")
}

/// The PATH under which `cargo zigbuild` finds cargo-zigbuild and zig, or why it cannot.
pub(crate) fn zigbuild_path() -> Result<String, String> {
    let venv = zig_venv();
    let path = std::env::var("PATH").unwrap_or_default();
    let path = if venv.is_dir() { format!("{}:{path}", venv.display()) } else { path };
    let found = |exe: &str| path.split(':').any(|d| Path::new(d).join(exe).is_file());
    if found("cargo-zigbuild") {
        Ok(path)
    } else {
        Err(format!(
            "cargo-zigbuild is not installed (looked on PATH and in {}): python3 -m venv {1} && \
             {1}/bin/pip install ziglang cargo-zigbuild",
            venv.display(),
            venv.parent().map(|p| p.display().to_string()).unwrap_or_default()
        ))
    }
}

/// Build the bundle in `dir`; returns what `run.sh` was told.
fn bundle(dir: &Path, target: Option<&str>) -> Result<BundleInfo, String> {
    let host = std::env::consts::ARCH;
    let cross = target.filter(|t| triple_arch(t) != host);
    // Another architecture: `cargo zigbuild` (a `cargo build`, so `--tests` builds the test
    // binaries) for TRIPLE.2.28, linking against glibc 2.28's symbol versions.
    let zig_target = cross.map(|t| format!("{t}.{}.{}", GLIBC_GOAL.0, GLIBC_GOAL.1));
    let mut args = match &zig_target {
        Some(t) => vec!["zigbuild", "--tests", "--target", t.as_str()],
        None => vec!["test", "--no-run"],
    };
    args.extend(["--release", "-p", "kda-ascend", "--features", "acl"]);
    args.push("--message-format=json");
    if let (None, Some(t)) = (&zig_target, target) {
        args.extend(["--target", t]);
    }
    let env = match &zig_target {
        Some(_) => vec![("PATH".to_string(), zigbuild_path()?)],
        None => Vec::new(),
    };
    let program = cargo();
    let (ok, log) = run_quiet(&program, &args, &env)?;
    if !ok {
        return Err(format!("npu-check --bundle: building the tests failed:\n{log}"));
    }
    let tests = dir.join("tests");
    let kernels = dir.join("kernels");
    for d in [&tests, &kernels] {
        let _ = std::fs::remove_dir_all(d);
        std::fs::create_dir_all(d).map_err(|e| format!("npu-check: {}: {e}", d.display()))?;
    }
    let built: Vec<PathBuf> =
        executables(&log).into_iter().filter(|(test, _)| *test).map(|(_, p)| p).collect();
    let mut glibc: Option<(u32, u32)> = None;
    let arch = target.map_or(host, triple_arch).to_string();
    for (_, target_name_, _, _) in STEPS {
        let exe = built.iter().find(|p| target_name(p) == Some(target_name_)).ok_or_else(|| {
            format!("npu-check --bundle: no test binary `{target_name_}` was built")
        })?;
        let bytes = std::fs::read(exe).map_err(|e| format!("npu-check: {}: {e}", exe.display()))?;
        let machine = elf_arch(&bytes).unwrap_or("not an ELF file");
        if machine != arch {
            return Err(format!("npu-check: {} is {machine}, not {arch}", exe.display()));
        }
        glibc = glibc.max(newest_glibc(&bytes));
        let to = tests.join(target_name_);
        std::fs::copy(exe, &to)
            .map_err(|e| format!("npu-check: {} -> {}: {e}", exe.display(), to.display()))?;
    }
    if cross.is_some() && glibc > Some(GLIBC_GOAL) {
        return Err(format!(
            "npu-check: the {arch} binaries need glibc {}, newer than the goal {}.{}",
            glibc.map(|(a, b)| format!("{a}.{b}")).unwrap_or_default(),
            GLIBC_GOAL.0,
            GLIBC_GOAL.1
        ));
    }
    for src in ascend::sources()? {
        let name = src.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        std::fs::copy(&src, kernels.join(&name)).map_err(|e| format!("npu-check: {e}"))?;
    }
    // Every header the sources include (kda_kernel_abi.h, kda_kernel_util.h).
    let headers = std::fs::read_dir(ascend::KERNELS_DIR)
        .map_err(|e| format!("npu-check: {}: {e}", ascend::KERNELS_DIR))?;
    for header in headers.flatten().map(|e| e.path()) {
        if header.extension().is_some_and(|x| x == "h") {
            let name = header.file_name().map(|n| n.to_owned()).unwrap_or_default();
            std::fs::copy(&header, kernels.join(name))
                .map_err(|e| format!("npu-check: {}: {e}", header.display()))?;
        }
    }
    let script = kernel_script::script(&ascend::source_names()?);
    write(&kernels.join("build_kernels.sh"), &script, true)?;
    let info = BundleInfo {
        arch,
        glibc: glibc.map_or_else(|| "unknown".into(), |(a, b)| format!("{a}.{b}")),
    };
    write(&dir.join("run.sh"), &run_script(&info), true)?;
    eprintln!(
        "npu-check: bundle in {0} ({1}, glibc {2} or later); on the NPU machine: {0}/run.sh \
         [OUT] — the log streams to OUT/npu-check.log, the report is OUT/npu-check.json",
        dir.display(),
        info.arch,
        info.glibc
    );
    Ok(info)
}

/// The Rust target of most Atlas A2/A3 hosts (Kunpeng).
const AARCH64: &str = "aarch64-unknown-linux-gnu";

/// In `cargo xtask test`: the aarch64 bundle, built in `target/npu-bundle-aarch64`; [`bundle`]
/// refuses a binary that is not aarch64 ELF or that names a glibc symbol version newer than
/// [`GLIBC_GOAL`]. Skipped, saying why, without the Rust target or cargo-zigbuild (`.ci/run`
/// installs both).
pub fn aarch64_bundle() -> Result<(), String> {
    let installed = std::process::Command::new("rustup")
        .args(["target", "list", "--installed"])
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).lines().any(|l| l.trim() == AARCH64));
    let missing = if installed {
        zigbuild_path().err()
    } else {
        Some(format!("the Rust target is not installed (rustup target add {AARCH64})"))
    };
    if let Some(why) = missing {
        eprintln!("==> npu-check bundle ({AARCH64}): skipped: {why}");
        return Ok(());
    }
    let info = bundle(Path::new("target/npu-bundle-aarch64"), Some(AARCH64))?;
    eprintln!(
        "    npu-check bundle: {} binaries, newest glibc symbol {} (goal {}.{})",
        info.arch, info.glibc, GLIBC_GOAL.0, GLIBC_GOAL.1
    );
    Ok(())
}

/// A cargo test binary's target name: its file name without the `-<hash>` suffix.
fn target_name(path: &Path) -> Option<&str> {
    let name = path.file_name()?.to_str()?;
    Some(name.rsplit_once('-').map_or(name, |(stem, _)| stem))
}

/// The `uname -m` name of an ELF file's machine (`e_machine`, at byte 18, in the file's own
/// byte order), if it is one kda builds for.
pub(crate) fn elf_arch(bytes: &[u8]) -> Option<&'static str> {
    if bytes.get(..4) != Some(b"\x7fELF") {
        return None;
    }
    let raw = [*bytes.get(18)?, *bytes.get(19)?];
    let machine =
        if bytes.get(5) == Some(&2) { u16::from_be_bytes(raw) } else { u16::from_le_bytes(raw) };
    match machine {
        0x3e => Some("x86_64"),
        0xb7 => Some("aarch64"),
        _ => None,
    }
}

/// The newest `GLIBC_x.y` symbol version a binary names (its version-needed entries are
/// strings in `.dynstr`; `GLIBC_PRIVATE` and the like are not versions and are skipped).
pub(crate) fn newest_glibc(bytes: &[u8]) -> Option<(u32, u32)> {
    const TAG: &[u8] = b"GLIBC_2.";
    let mut newest = None;
    let mut at = 0;
    while let Some(i) = bytes[at..].windows(TAG.len()).position(|w| w == TAG) {
        let start = at + i + TAG.len();
        let digits: Vec<u8> =
            bytes[start..].iter().take_while(|b| b.is_ascii_digit()).copied().collect();
        if let Ok(minor) = std::str::from_utf8(&digits).unwrap_or("").parse::<u32>() {
            newest = newest.max(Some((2, minor)));
        }
        at = start;
    }
    newest
}

/// `run.sh`: the host checks, the toolkit, the kernels (stopping on a failed build), then each
/// test binary on one thread, and in parallel after a clean first pass.
fn run_script(info: &BundleInfo) -> String {
    let quoted =
        |list: &[&str]| list.iter().map(|s| format!("\"{s}\"")).collect::<Vec<_>>().join(" ");
    let serial: String = STEPS
        .iter()
        .map(|(name, target, limit, _)| {
            let extra = if *name == "timing" { " --nocapture" } else { "" };
            format!(
                "step {name} {limit} \"$HERE/tests/{target}\" --test-threads=1{extra} || \
                 SERIAL_CLEAN=false\n"
            )
        })
        .collect();
    let parallel: String = STEPS
        .iter()
        .filter(|(_, _, _, parallel)| *parallel)
        .map(|(name, target, limit, _)| {
            format!("    step {name}-parallel {limit} \"$HERE/tests/{target}\"\n")
        })
        .collect();
    include_str!("run.sh.in")
        .replace("@BUNDLE_ARCH@", &info.arch)
        .replace("@BUNDLE_GLIBC@", &info.glibc)
        .replace("@GLIBC_GOAL@", &format!("{}.{}", GLIBC_GOAL.0, GLIBC_GOAL.1))
        .replace("@TOOLKIT_VARS@", &kernel_script::TOOLKIT_VARS.join(" "))
        .replace("@DEFAULT_ROOTS_TEXT@", &kernel_script::DEFAULT_ROOTS.join(", "))
        .replace("@DEFAULT_ROOTS@", &quoted(&kernel_script::DEFAULT_ROOTS))
        .replace("@BINARY@", kernel_script::BINARY)
        .replace("@KERNELS_LIMIT@", &KERNELS_LIMIT.to_string())
        .replace("@SERIAL_STEPS@", &serial)
        .replace("@PARALLEL_STEPS@", &parallel)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel_script::tests::{fake_cann, scratch, write_exe};
    use std::process::Command;

    #[test]
    fn test_binaries_are_named_by_target() {
        assert_eq!(target_name(Path::new("/t/deps/conformance-0a1b2c")), Some("conformance"));
        assert_eq!(target_name(Path::new("/t/deps/kda_ascend-ffee")), Some("kda_ascend"));
    }

    fn host() -> BundleInfo {
        BundleInfo { arch: std::env::consts::ARCH.into(), glibc: "2.17".into() }
    }

    /// Every step runs under its own limit, streams to the log, and the report is written
    /// before the first step, after each, and complete at the end; each test binary runs on
    /// one thread first.
    #[test]
    fn the_run_script_times_out_streams_and_reports_after_every_step() {
        let script = run_script(&BundleInfo { arch: "aarch64".into(), glibc: "2.28".into() });
        assert!(
            script.contains("timeout --kill-after=10 \"$limit\" \"$@\" 2>&1 | tee -a \"$LOG\"")
        );
        assert!(script.contains("step kernels 900 bash \"$HERE/kernels/build_kernels.sh\""));
        assert!(script.contains(
            "step conformance 1200 \"$HERE/tests/conformance\" --test-threads=1 || \
             SERIAL_CLEAN=false"
        ));
        assert!(
            script.contains("step timing 600 \"$HERE/tests/timing\" --test-threads=1 --nocapture")
        );
        assert!(
            script.contains("    step conformance-parallel 1200 \"$HERE/tests/conformance\"\n")
        );
        assert!(!script.contains("timing-parallel"));
        assert!(script.contains("export KDA_ASCEND_KERNELS=\"$HERE/kernels/kda_kernels.o\""));
        let step_body = script.split("step() {").nth(1).expect("a step function");
        assert!(step_body.contains("report false"), "the report after every step");
        assert!(script.trim_end().ends_with("report true\n$OK"));
        assert!(
            script.contains("BUNDLE_ARCH=\"aarch64\"") && script.contains("BUNDLE_GLIBC=\"2.28\"")
        );
        let placeholder = script.match_indices('@').find_map(|(at, _)| {
            let word: String = script[at + 1..]
                .chars()
                .take_while(|c| c.is_ascii_uppercase() || *c == '_')
                .collect();
            let closed = script[at + 1 + word.len()..].starts_with('@');
            (!word.is_empty() && closed).then_some(word)
        });
        assert_eq!(placeholder, None, "every placeholder filled");
    }

    /// A bundle made of the real scripts, a fake CANN tree and fake test binaries (scripts
    /// recording their arguments and printing a libtest summary).
    fn fake_bundle(name: &str, info: &BundleInfo, failing_test: Option<&str>) -> PathBuf {
        let dir = scratch(name);
        let b = dir.join("bundle");
        write_exe(&b.join("run.sh"), &run_script(info));
        write_exe(
            &b.join("kernels/build_kernels.sh"),
            &kernel_script::script(&["kda_gate.cpp".into()]),
        );
        std::fs::write(b.join("kernels/kda_gate.cpp"), "// a kernel\n").expect("a source");
        for (_, target, _, _) in STEPS {
            let fails = failing_test == Some(target);
            let body = format!(
                "#!/usr/bin/env bash\necho \"{target} $*\" >> '{log}'\n\
                 echo 'test result: {r}. 3 passed; {f} failed; 1 ignored'\nexit {code}\n",
                log = dir.join("tests.log").display(),
                r = if fails { "FAILED" } else { "ok" },
                f = u8::from(fails),
                code = u8::from(fails),
            );
            write_exe(&b.join("tests").join(target), &body);
        }
        dir
    }

    fn run_bundle(dir: &Path, cann: Option<&Path>) -> (i32, String, String) {
        let mut cmd = Command::new("bash");
        cmd.arg(dir.join("bundle/run.sh")).arg(dir.join("out"));
        for v in kernel_script::TOOLKIT_VARS {
            cmd.env_remove(v);
        }
        cmd.env("HOME", dir).env("PATH", "/usr/bin:/bin");
        if let Some(root) = cann {
            cmd.env("ASCEND_TOOLKIT_HOME", root);
        }
        let out = cmd.output().expect("bash runs");
        let report = std::fs::read_to_string(dir.join("out/npu-check.json")).unwrap_or_default();
        (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stdout).into(), report)
    }

    /// A failed kernel build stops the run: no test runs, and the report opens with the
    /// compiler's own message.
    #[test]
    fn run_sh_stops_on_a_failed_kernel_build_with_the_compilers_message_first() {
        let dir = fake_bundle("kfail", &host(), None);
        let cann = dir.join("cann");
        fake_cann(&cann, &format!("{}-linux", std::env::consts::ARCH), "8.5.0", true);
        let (code, stdout, report) = run_bundle(&dir, Some(&cann));
        assert_eq!(code, 1, "{stdout}");
        let first = report.lines().nth(1).unwrap_or_default();
        assert!(first.starts_with("  \"stopped\": \"the kernel build failed"), "{report}");
        assert!(
            first.contains("kda_gate.cpp:12:3: error: use of undeclared identifier"),
            "{report}"
        );
        assert!(report.contains("\"complete\": true"), "{report}");
        assert!(!dir.join("tests.log").exists(), "no test ran after the failed build");
    }

    /// A clean build runs each binary on one thread, then (all clean) in parallel; a failure
    /// in the first pass skips the parallel pass.
    #[test]
    fn run_sh_runs_one_thread_first_and_parallel_only_after_a_clean_pass() {
        let arch_dir = format!("{}-linux", std::env::consts::ARCH);
        let dir = fake_bundle("clean", &host(), None);
        let cann = dir.join("cann");
        fake_cann(&cann, &arch_dir, "8.5.0", false);
        let (code, stdout, report) = run_bundle(&dir, Some(&cann));
        assert_eq!(code, 0, "{stdout}\n{report}");
        let calls = std::fs::read_to_string(dir.join("tests.log")).expect("the tests ran");
        assert_eq!(
            calls.lines().collect::<Vec<_>>(),
            [
                "kda_ascend --test-threads=1",
                "conformance --test-threads=1",
                "timing --test-threads=1 --nocapture",
                "kda_ascend ",
                "conformance ",
            ]
        );
        assert!(report.contains("\"name\": \"conformance-parallel\", \"ok\": true"), "{report}");

        let dir = fake_bundle("serialfail", &host(), Some("kda_ascend"));
        let cann = dir.join("cann");
        fake_cann(&cann, &arch_dir, "8.5.0", false);
        let (code, stdout, _) = run_bundle(&dir, Some(&cann));
        assert_eq!(code, 1, "{stdout}");
        let calls = std::fs::read_to_string(dir.join("tests.log")).expect("the tests ran");
        assert_eq!(calls.lines().count(), 3, "{calls}");
        assert!(stdout.contains("the one-thread pass failed: no parallel pass"), "{stdout}");
    }

    /// Another architecture, a host glibc older than the binaries need, or no toolkit: one
    /// line, and nothing runs.
    #[test]
    fn run_sh_refuses_another_arch_an_older_glibc_and_a_missing_toolkit_in_one_line() {
        let other = BundleInfo { arch: "riscv64".into(), glibc: "2.17".into() };
        let dir = fake_bundle("arch", &other, None);
        let (code, stdout, report) = run_bundle(&dir, None);
        assert_eq!(code, 1);
        let line = format!(
            "npu-check: stopped: the bundle's binaries are riscv64, this host is {}",
            std::env::consts::ARCH
        );
        assert!(stdout.contains(&line), "{stdout}");
        assert!(report.contains("\"bundle_arch\": \"riscv64\""), "{report}");

        let future = BundleInfo { arch: std::env::consts::ARCH.into(), glibc: "2.999".into() };
        let dir = fake_bundle("glibc", &future, None);
        let (code, stdout, _) = run_bundle(&dir, None);
        assert_eq!(code, 1);
        assert!(
            stdout.contains("the bundle's binaries need glibc 2.999, this host has"),
            "{stdout}"
        );

        let dir = fake_bundle("nocann", &host(), None);
        let (code, stdout, _) = run_bundle(&dir, None);
        assert_eq!(code, 1);
        assert!(
            stdout.contains("stopped: no CANN toolkit: none of ASCEND_TOOLKIT_HOME"),
            "{stdout}"
        );
        assert!(!dir.join("tests.log").exists());
    }

    #[test]
    fn the_newest_glibc_and_the_elf_machine_are_read_from_the_binary() {
        let bytes = b"\x00GLIBC_2.17\x00GLIBC_2.34\x00GLIBC_PRIVATE\x00GLIBC_2.3.4\x00";
        assert_eq!(newest_glibc(bytes), Some((2, 34)));
        assert_eq!(newest_glibc(b"no versions"), None);
        let me = std::fs::read(std::env::current_exe().expect("this test")).expect("readable");
        assert_eq!(elf_arch(&me), Some(std::env::consts::ARCH));
        assert!(newest_glibc(&me).is_some_and(|v| v >= (2, 2)));
        assert_eq!(elf_arch(b"#!/bin/sh"), None);
    }
}
