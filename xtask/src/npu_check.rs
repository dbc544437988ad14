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
//! The binaries are built for this machine's architecture; `run.sh` says so and stops on a host
//! of another one. The build of the bundle itself needs no toolkit (the CANN libraries are
//! opened at run time).

use std::path::{Path, PathBuf};

use crate::ascend::{self, CommandLine, Style};
use crate::cargo;
use crate::gpu_check::{executables, run_quiet};

/// The test binaries the bundle carries (by target name) and each step's time limit, seconds.
const STEPS: [(&str, &str, u32); 3] =
    [("unit", "kda_ascend", 300), ("conformance", "conformance", 1200), ("timing", "timing", 600)];
/// Compiling the kernels on the NPU machine.
const KERNELS_LIMIT: u32 = 900;

pub fn npu_check(args: &[String]) -> Result<(), String> {
    let dir = match args {
        [flag, dir] if flag == "--bundle" => PathBuf::from(dir),
        _ => return Err("usage: cargo xtask npu-check --bundle DIR".into()),
    };
    bundle(&dir)
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

fn bundle(dir: &Path) -> Result<(), String> {
    let args = [
        "test",
        "--no-run",
        "--release",
        "-p",
        "kda-ascend",
        "--features",
        "acl",
        "--message-format=json",
    ];
    let (ok, log) = run_quiet(&cargo(), &args, &[])?;
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
    for (_, target, _) in STEPS {
        let exe = built
            .iter()
            .find(|p| target_name(p) == Some(target))
            .ok_or_else(|| format!("npu-check --bundle: no test binary `{target}` was built"))?;
        let to = tests.join(target);
        std::fs::copy(exe, &to)
            .map_err(|e| format!("npu-check: {} -> {}: {e}", exe.display(), to.display()))?;
    }
    let mut sources = Vec::new();
    for src in ascend::sources()? {
        let name = src.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        std::fs::copy(&src, kernels.join(&name)).map_err(|e| format!("npu-check: {e}"))?;
        sources.push(name);
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
    write(&kernels.join("build_kernels.sh"), &build_script(&sources), true)?;
    write(&dir.join("run.sh"), &run_script(std::env::consts::ARCH), true)?;
    eprintln!(
        "npu-check: bundle in {0}; on the NPU machine (CANN's set_env.sh sourced): {0}/run.sh \
         [OUT] — the log streams to OUT/npu-check.log, the report is OUT/npu-check.json",
        dir.display()
    );
    Ok(())
}

/// A cargo test binary's target name: its file name without the `-<hash>` suffix.
fn target_name(path: &Path) -> Option<&str> {
    let name = path.file_name()?.to_str()?;
    Some(name.rsplit_once('-').map_or(name, |(stem, _)| stem))
}

/// `build_kernels.sh`: the `cargo xtask kernels` commands for the bundle's sources.
fn build_script(sources: &[String]) -> String {
    let tool = "$ASCEND_TOOLKIT_HOME";
    let bin = format!("{tool}/compiler/ccec_compiler/bin");
    let sources: Vec<String> = sources.iter().map(|s| format!("$HERE/{s}")).collect();
    let lines = |style: Style| -> String {
        let toolchain = ascend::Toolchain {
            root: tool.into(),
            bisheng: format!("{bin}/bisheng"),
            lld: format!("{bin}/ld.lld"),
            arch: "$ARCH".into(),
            style,
        };
        ascend::kernel_commands(&toolchain, &sources, "$HERE", "$HERE")
            .iter()
            .map(|c: &CommandLine| format!("    run {}\n", c.shell()))
            .collect()
    };
    format!(
        "#!/usr/bin/env bash\n\
         # The kda kernels, built as `cargo xtask kernels` builds them (ascendc_fatbin_library:\n\
         # device-only compiles, then the device link). Needs CANN's set_env.sh sourced.\n\
         set -euo pipefail\n\
         HERE=\"$(cd \"$(dirname \"$0\")\" && pwd)\"\n\
         : \"${{ASCEND_TOOLKIT_HOME:?source the set_env.sh of CANN first}}\"\n\
         ARCH=\"${{KDA_ASCEND_NPU_ARCH:-dav-2201}}\"\n\
         run() {{ echo \"+ $*\"; \"$@\"; }}\n\
         if [ \"${{KDA_ASCEND_KERNEL_STYLE:-asc}}\" = cce ]; then\n{}else\n{}fi\n\
         echo \"kernels: $HERE/{} ($ARCH)\"\n",
        lines(Style::Cce),
        lines(Style::Asc),
        ascend::BINARY,
    )
}

/// `run.sh`: the steps, each under `timeout`, streamed to the log, the report after each.
fn run_script(arch: &str) -> String {
    let steps: String = STEPS
        .iter()
        .map(|(name, target, limit)| {
            let extra = if *name == "timing" { " --nocapture" } else { "" };
            format!("step {name} {limit} \"$HERE/tests/{target}\"{extra}\n")
        })
        .collect();
    format!(
        r#"#!/usr/bin/env bash
# kda npu-check: the Ascend backend on one NPU (feature `acl`), from a bundle made by
# `cargo xtask npu-check --bundle DIR`. Usage: run.sh [OUT]. Needs CANN's set_env.sh sourced.
set -u
HERE="$(cd "$(dirname "$0")" && pwd)"
OUT="${{1:-$HERE/out}}"
mkdir -p "$OUT"
LOG="$OUT/npu-check.log"
REPORT="$OUT/npu-check.json"
: > "$LOG"
STEPS_JSON=""
TIMINGS=""
OK=true
START=$(date +%s)

report() {{
    local complete=$1
    printf '{{\n  "ok": %s,\n  "complete": %s,\n  "log": "%s",\n  "host_arch": "%s",\n  "bundle_arch": "{arch}",\n  "seconds": %s,\n  "steps": [%s\n  ],\n  "timings": [%s\n  ]\n}}\n' \
        "$OK" "$complete" "$LOG" "$(uname -m)" "$(( $(date +%s) - START ))" "$STEPS_JSON" "$TIMINGS" > "$REPORT.tmp"
    mv "$REPORT.tmp" "$REPORT"
}}

# step NAME LIMIT COMMAND...: run under `timeout`, every line to the log as it comes.
step() {{
    local name=$1 limit=$2
    shift 2
    local out="$OUT/$name.out" t0 code timed_out=false
    t0=$(date +%s)
    echo "==> $name (limit ${{limit}}s): $*" | tee -a "$LOG"
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOG" > "$out"
    code=${{PIPESTATUS[0]}}
    if [ "$code" = 124 ] || [ "$code" = 137 ]; then timed_out=true; echo "$name: killed after ${{limit}}s" | tee -a "$LOG"; fi
    [ "$code" = 0 ] || OK=false
    local counts
    counts=$(grep -h '^test result:' "$out" | awk '{{for (i = 1; i < NF; i++) {{ if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i; if ($(i+1) ~ /^ignored/) g += $i }}}} END {{ printf "%d %d %d", p, f, g }}')
    set -- $counts
    local failures
    failures=$(grep -E 'FAILED|panicked|^error' "$out" | head -40 | sed 's/\\/\\\\/g; s/"/\\"/g' | awk '{{ printf "%s\\n", $0 }}')
    [ -z "$STEPS_JSON" ] || STEPS_JSON="$STEPS_JSON,"
    STEPS_JSON="$STEPS_JSON
    {{ \"name\": \"$name\", \"ok\": $([ "$code" = 0 ] && echo true || echo false), \"timed_out\": $timed_out, \"exit_code\": $code, \"seconds\": $(( $(date +%s) - t0 )), \"passed\": $1, \"failed\": $2, \"ignored\": $3, \"failures\": \"$failures\" }}"
    while IFS= read -r line; do
        [ -z "$TIMINGS" ] || TIMINGS="$TIMINGS,"
        TIMINGS="$TIMINGS
    ${{line#KDA_TIMING }}"
    done < <(grep -h '^KDA_TIMING ' "$out")
    report false
}}

report false
if [ "$(uname -m)" != "{arch}" ]; then
    echo "npu-check: the bundle's binaries are {arch}, this host is $(uname -m): rebuild the bundle there" | tee -a "$LOG"
    OK=false
    report true
    exit 1
fi
: "${{ASCEND_TOOLKIT_HOME:?source the set_env.sh of CANN first}}"
export KDA_ASCEND_KERNELS="$HERE/kernels/{binary}"
step kernels {kernels_limit} bash "$HERE/kernels/build_kernels.sh"
{steps}report true
$OK
"#,
        binary = ascend::BINARY,
        kernels_limit = KERNELS_LIMIT,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_binaries_are_named_by_target() {
        assert_eq!(target_name(Path::new("/t/deps/conformance-0a1b2c")), Some("conformance"));
        assert_eq!(target_name(Path::new("/t/deps/kda_ascend-ffee")), Some("kda_ascend"));
    }

    /// Every step runs under its own limit, streams to the log, and the report is written
    /// before the first step, after each, and complete at the end.
    #[test]
    fn the_run_script_times_out_streams_and_reports_after_every_step() {
        let script = run_script("x86_64");
        assert!(
            script.contains("timeout --kill-after=10 \"$limit\" \"$@\" 2>&1 | tee -a \"$LOG\"")
        );
        assert!(script.contains("step kernels 900 bash \"$HERE/kernels/build_kernels.sh\""));
        assert!(script.contains("step conformance 1200 \"$HERE/tests/conformance\""));
        assert!(script.contains("step timing 600 \"$HERE/tests/timing\" --nocapture"));
        assert!(script.contains("export KDA_ASCEND_KERNELS=\"$HERE/kernels/kda_kernels.o\""));
        let step_body = script.split("step() {").nth(1).expect("a step function");
        assert!(step_body.contains("report false"), "the report after every step");
        assert!(script.trim_end().ends_with("report true\n$OK"));
        assert!(script.contains("\"bundle_arch\": \"x86_64\""));
    }

    /// The bundle builds the kernels with the same commands as `cargo xtask kernels`.
    #[test]
    fn the_kernel_script_runs_the_xtask_commands() {
        let script = build_script(&["kda_gate.cpp".into()]);
        assert!(script.contains(
            "run $ASCEND_TOOLKIT_HOME/compiler/ccec_compiler/bin/bisheng --npu-arch=$ARCH"
        ));
        assert!(script.contains("-c --asc-aicore-lang $HERE/kda_gate.cpp --aicore-only"));
        assert!(script.contains(
            "run $ASCEND_TOOLKIT_HOME/compiler/ccec_compiler/bin/ld.lld -m aicorelinux -Ttext=0 \
             $HERE/kda_gate.device.o -static -o $HERE/kda_kernels.o"
        ));
        assert!(script.contains("--cce-aicore-arch=dav-c220-vec"));
    }
}
