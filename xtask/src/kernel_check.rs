//! `cargo xtask kernels --check DEVKIT_DIR`: parse and type-check the AscendC kernel sources
//! against CANN's own AscendC headers with the host C++ compiler, without bisheng.
//!
//! The headers of asc-devkit (`include/`, `impl/`) have a CPU debug mode (`ASCENDC_CPU_DEBUG`,
//! asc-devkit `cmake/asc/legacy_modules/function.cmake`) in which a kernel is plain C++ for the
//! host compiler. Each kernel is compiled with `g++ -fsyntax-only` per architecture, with the
//! defines CANN's CPU debug library is built with (hicann/asc-tools `cpudebug/CMakeLists.txt`):
//! `__NPU_ARCH__`, `__CCE_AICORE__`, `__DAV_C…__`, `__CCE_KT_TEST__`.
//!
//! That mode also needs the CPU debug library's headers. `stub_def.h` (and the number types) are
//! public (hicann/asc-tools `cpudebug/include`), but `stub_fun.h`, which declares the compiler's
//! intrinsics and their enum types (`pipe_t`/`PIPE_V`, `event_t`/`EVENT_ID0`, `copy_gm_to_ubuf`,
//! `vadd`, …), ships only in CANN's toolkit (`tools/tikicpulib/lib/include`) and in asc-tools'
//! prebuilt dependency archive; the 950's headers also include the toolkit's `acl/acl.h`. Given
//! `--include` directories that hold them (a CANN toolkit's), the check is complete. Without
//! them it is *partial*: the missing files are empty placeholders (nothing is declared in their
//! place), the names the headers then lack are read from the compiler's own diagnostics (and a
//! constant-like name the kernels use undeclared counts as one of them when the devkit's headers
//! use it too), and only the errors in the kernel sources that neither involve one of those
//! names nor merely follow from one on the same line count. A partial pass
//! still proves that every AscendC call resolves to a declared overload with the right argument
//! types and that the sources are valid C++; it cannot see a misused intrinsic-level enum.
//!
//! Not part of `cargo xtask test`: CI has no devkit and downloads nothing.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::ascend::{CommandLine, KERNELS_DIR};

/// Where the check writes the generated `kernel_tiling.h` and the placeholders.
const OUT_DIR: &str = "target/ascend-kernels/check";
/// Errors printed per failing kernel.
const FIRST_ERRORS: usize = 8;

/// One target of the CPU debug mode: the defines asc-tools' CPU debug library is built with for
/// it (hicann/asc-tools `cpudebug/CMakeLists.txt`, `target_compile_definitions`).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct Arch {
    /// The `--npu-arch` name (`cmake/asc/asc_modules/CMakeASCInformation.cmake`).
    pub name: &'static str,
    pub npu_arch: u32,
    pub cce_aicore: u32,
    pub dav: &'static str,
    /// Toolkit headers this arch's CPU-mode headers include beyond `stub_fun.h`.
    pub toolkit_headers: &'static [&'static str],
}

/// A2/A3 (dav-2201) and the 950 (dav-3510), the two the backend builds for.
pub(crate) const ARCHES: [Arch; 2] = [
    Arch {
        name: "dav-2201",
        npu_arch: 2201,
        cce_aicore: 220,
        dav: "__DAV_C220__",
        toolkit_headers: &[],
    },
    // asc-tools `cpudebug/include/kernel_simt_cpu.h` includes the runtime's `acl/acl.h`.
    Arch {
        name: "dav-3510",
        npu_arch: 3510,
        cce_aicore: 310,
        dav: "__DAV_C310__",
        toolkit_headers: &["acl/acl.h"],
    },
];

/// The CPU debug library header every arch needs and no placeholder may replace: it defines
/// `__aicore__`, `__gm__` and the number types.
const REQUIRED: &str = "stub_def.h";
/// The toolkit-only header of every arch.
const STUB_FUN: &str = "stub_fun.h";

/// The include directories of one check, in search order.
#[derive(Clone, Debug)]
pub(crate) struct Includes {
    /// The asc-devkit tree (`include/`, `impl/`).
    pub devkit: String,
    /// `--include` directories (asc-tools `cpudebug/include`, a toolkit's
    /// `tools/tikicpulib/lib/include` and `include`).
    pub extra: Vec<String>,
    /// The directory holding `kernel_tiling/kernel_tiling.h`, when generated here.
    pub generated: Option<String>,
    /// The directory of empty placeholders, in a partial check.
    pub placeholders: Option<String>,
    /// The kernels' own directory (`kda_kernel_abi.h`, `kda_kernel_util.h`).
    pub kernels: String,
}

impl Includes {
    fn flags(&self) -> Vec<String> {
        let d = &self.devkit;
        // The devkit root: `impl/basic_api/kernel_macros.h` includes "impl/utils/sys_macros.h".
        let mut dirs = vec![
            d.clone(),
            format!("{d}/include"),
            format!("{d}/include/basic_api"),
            format!("{d}/include/adv_api"),
            format!("{d}/include/utils"),
        ];
        dirs.extend(self.extra.iter().cloned());
        dirs.extend(self.generated.iter().cloned());
        dirs.extend(self.placeholders.iter().cloned());
        dirs.push(self.kernels.clone());
        dirs.into_iter().map(|p| format!("-I{p}")).collect()
    }
}

/// The syntax check of `source` for `arch`: `cxx -std=c++17 -fsyntax-only` with the CPU debug
/// defines and every error shown (`-fmax-errors=0`).
pub(crate) fn check_command(cxx: &str, arch: &Arch, inc: &Includes, source: &str) -> CommandLine {
    let mut args: Vec<String> = vec![
        "-std=c++17".into(),
        "-fsyntax-only".into(),
        "-fmax-errors=0".into(),
        // asc-devkit `cmake/asc/legacy_modules/function.cmake`, RUN_MODE cpu.
        "-DASCENDC_CPU_DEBUG=1".into(),
        "-DASCENDC_DEBUG=1".into(),
        "-DASCENDC_DUMP=0".into(),
        "-D__CCE_KT_TEST__=1".into(),
        format!("-D__CCE_AICORE__={}", arch.cce_aicore),
        format!("-D{}", arch.dav),
        format!("-D__NPU_ARCH__={}", arch.npu_arch),
    ];
    args.extend(inc.flags());
    args.push(source.to_string());
    CommandLine { program: cxx.to_string(), args }
}

/// The asc-devkit script that writes `kernel_tiling/kernel_tiling.h` from the devkit's tiling
/// definitions (asc-devkit `impl/adv_api/gen_kernel_tiling.cmake`); the advanced API's headers
/// include it.
pub(crate) fn tiling_command(devkit: &str, out_dir: &str) -> CommandLine {
    CommandLine {
        program: "python3".into(),
        args: vec![
            format!("{devkit}/impl/adv_api/cmake/scripts/gen_kernel_tiling_data_def.py"),
            format!("{devkit}/include/adv_api"),
            format!("{out_dir}/kernel_tiling/kernel_tiling.h"),
        ],
    }
}

/// One `error:` line of the compiler.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Diagnostic {
    pub file: String,
    pub line: u32,
    pub message: String,
    /// The places of the `required from` notes that lead to it (a template instantiated there).
    pub required_from: Vec<(String, u32)>,
}

impl Diagnostic {
    /// As printed: where, what, and the innermost instantiating line under `kernels`.
    fn shown(&self, kernels: &str) -> String {
        let mut text = format!("{}:{}: {}", self.file, self.line, self.message);
        let from = self.required_from.iter().find(|(f, _)| under(f, kernels));
        if let Some((file, line)) = from.or(self.required_from.last()) {
            text.push_str(&format!(" (instantiated from {file}:{line})"));
        }
        text
    }
}

/// `FILE:LINE:COL` → (file, line).
fn location(head: &str) -> Option<(String, u32)> {
    let mut parts = head.rsplitn(3, ':');
    let _col: u32 = parts.next()?.trim().parse().ok()?;
    let line: u32 = parts.next()?.parse().ok()?;
    Some((parts.next()?.to_string(), line))
}

/// The `FILE:LINE:COL: error: MESSAGE` lines of `stderr` (`fatal error` included), each with the
/// `required from` notes printed since the previous error.
pub(crate) fn errors(stderr: &str) -> Vec<Diagnostic> {
    let mut found = Vec::new();
    let mut required_from = Vec::new();
    for l in stderr.lines() {
        if let Some((head, _)) = l.split_once(":   required from ") {
            required_from.extend(location(head));
            continue;
        }
        let Some((head, message)) =
            l.split_once(": error: ").or_else(|| l.split_once(": fatal error: "))
        else {
            continue;
        };
        if let Some((file, line)) = location(head) {
            let required_from = std::mem::take(&mut required_from);
            found.push(Diagnostic { file, line, message: message.to_string(), required_from });
        }
    }
    found
}

/// The quoted names of `message` (`'X'`, as g++ quotes them under `LC_ALL=C`).
fn quoted(message: &str) -> Vec<&str> {
    message.split('\'').skip(1).step_by(2).collect()
}

/// The phrases of g++'s "this name is not declared" errors; the name is the first quoted one.
const UNDECLARED: [&str; 4] = [
    "was not declared in this scope",
    "has not been declared",
    "does not name a type",
    "that depend on a template parameter",
];

/// The name an "undeclared" error is about, if `e` is one.
fn undeclared(e: &Diagnostic) -> Option<&str> {
    if !UNDECLARED.iter().any(|u| e.message.contains(u)) {
        return None;
    }
    let name = *quoted(&e.message).first()?;
    name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_').then_some(name)
}

/// Whether `file` lies in the directory `dir`.
fn under(file: &str, dir: &str) -> bool {
    file.strip_prefix(dir).is_some_and(|rest| rest.starts_with('/'))
}

/// The names the headers lack because a placeholder replaced a toolkit header: those g++ reports
/// as undeclared outside the kernel sources.
pub(crate) fn missing_names(errs: &[Diagnostic], kernels: &str) -> BTreeSet<String> {
    errs.iter()
        .filter(|e| !under(&e.file, kernels))
        .filter_map(undeclared)
        .map(str::to_string)
        .collect()
}

/// Whether the code `message` quotes names one of `names` as a whole identifier (only the quoted
/// code: a `static_assert`'s text may say "src" and "dst" in prose).
fn mentions(message: &str, names: &BTreeSet<String>) -> bool {
    quoted(message).into_iter().any(|code| {
        code.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).any(|w| names.contains(w))
    })
}

/// What one kernel's check found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Verdict {
    /// Errors in the kernel sources that count.
    pub errors: Vec<Diagnostic>,
    /// Errors in the kernel sources set aside: they involve a name a placeholder lacks.
    pub set_aside: usize,
    /// Those names.
    pub set_aside_names: BTreeSet<String>,
    /// Errors inside the headers (all of them count in a complete check).
    pub in_headers: usize,
}

impl Verdict {
    pub(crate) fn passed(&self, partial: bool) -> bool {
        self.errors.is_empty() && (partial || self.in_headers == 0)
    }
}

/// Whether `name` looks like an enumerator or macro (`EVENT_ID1`, `PIPE_MTE2`): the only kind of
/// name the kernels may use undeclared and still be excused because the devkit uses it too.
fn constant_like(name: &str) -> bool {
    name.contains('_')
        && name.starts_with(|c: char| c.is_ascii_uppercase())
        && name.chars().all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
}

/// The errors inside the headers that a kernel's template arguments or call arguments cause.
const ARGUMENT_ERRORS: [&str; 6] = [
    "static assertion failed",
    "no matching function for call to",
    "invalid conversion from",
    "cannot convert",
    "no member named",
    "is not a member of",
];

/// Whether `message` is only the consequence of an unusable name earlier on its line.
fn consequence(message: &str) -> bool {
    message.contains("<expression error>")
        || (message.starts_with("template argument") && message.ends_with("is invalid"))
}

/// Sort `stderr`'s errors for the sources under `kernels`. In a partial check, an error is set
/// aside when it names a [`missing_names`] name, or a constant-like name the kernels use
/// undeclared that the devkit's headers use too (`in_devkit`: some CANN header declares it and
/// none given here does, as `EVENT_ID1` of `stub_fun.h`'s `event_t`), or when it is only the
/// [`consequence`] of such an error on its line.
pub(crate) fn judge(
    stderr: &str,
    kernels: &str,
    partial: bool,
    in_devkit: &mut dyn FnMut(&str) -> bool,
) -> Verdict {
    let errs = errors(stderr);
    let (ours, headers): (Vec<_>, Vec<_>) = errs.iter().partition(|e| under(&e.file, kernels));
    let mut missing = BTreeSet::new();
    if partial {
        missing = missing_names(&errs, kernels);
        for name in ours.iter().filter_map(|e| undeclared(e)) {
            if !missing.contains(name) && constant_like(name) && in_devkit(name) {
                missing.insert(name.to_string());
            }
        }
    }
    let lines: BTreeSet<(&str, u32)> = ours
        .iter()
        .filter(|e| mentions(&e.message, &missing))
        .map(|e| (e.file.as_str(), e.line))
        .collect();
    let (aside, mut counted): (Vec<_>, Vec<_>) = ours.into_iter().partition(|e| {
        mentions(&e.message, &missing)
            || (consequence(&e.message) && lines.contains(&(e.file.as_str(), e.line)))
    });
    // In a partial check, an error inside the headers counts when a kernel instantiated the
    // template it is in, it is of a kind a kernel's arguments cause (a failed `static_assert` on
    // an element type, say; not one that follows from a missing type, such as a `void`
    // constant) and it quotes no missing name.
    let (headers, instantiated): (Vec<_>, Vec<_>) = headers.into_iter().partition(|e| {
        !partial
            || !e.required_from.iter().any(|(f, _)| under(f, kernels))
            || !ARGUMENT_ERRORS.iter().any(|k| e.message.starts_with(k))
            || mentions(&e.message, &missing)
    });
    counted.extend(instantiated);
    let names = aside
        .iter()
        .flat_map(|e| quoted(&e.message))
        .filter(|n| missing.contains(*n))
        .map(str::to_string)
        .collect();
    Verdict {
        errors: counted.into_iter().cloned().collect(),
        set_aside: aside.len(),
        set_aside_names: names,
        in_headers: headers.len(),
    }
}

/// Whether a file under `dirs` uses `name` as a whole word.
fn used_in(dirs: &[PathBuf], name: &str) -> bool {
    let is_word = |text: &str| {
        text.match_indices(name).any(|(at, _)| {
            let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
            let before = text[..at].chars().next_back().is_none_or(|c| !ident(c));
            let after = text[at + name.len()..].chars().next().is_none_or(|c| !ident(c));
            before && after
        })
    };
    let mut stack: Vec<PathBuf> = dirs.to_vec();
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else { continue };
        for p in entries.filter_map(|e| e.ok().map(|e| e.path())) {
            if p.is_dir() {
                stack.push(p);
            } else if std::fs::read_to_string(&p).is_ok_and(|t| is_word(&t)) {
                return true;
            }
        }
    }
    false
}

/// The parsed `kernels --check` arguments.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Options {
    pub devkit: PathBuf,
    pub include: Vec<PathBuf>,
    pub arches: Vec<Arch>,
    pub kernels: PathBuf,
}

pub(crate) const USAGE: &str = "\
usage: cargo xtask kernels --check DEVKIT_DIR [--include DIR]... [--arch dav-2201|dav-3510]...
                           [--kernels DIR]

Parse and type-check every AscendC kernel source (DIR/*.cpp, default crates/kda-ascend/kernels)
with the host g++ (or $CXX) against CANN's AscendC headers in their CPU debug mode, for each
arch (default: dav-2201 and dav-3510), and report each kernel's pass or fail with its first
errors. No device code is generated and nothing runs.

DEVKIT_DIR  an extracted asc-devkit tree (its include/ and impl/)
--include   more header directories, searched in order after the devkit's: hicann/asc-tools'
            cpudebug/include (stub_def.h, required), and for a complete check a CANN toolkit's
            tools/tikicpulib/lib/include (stub_fun.h) and include (acl/acl.h, for dav-3510).
            Without stub_fun.h the check is partial (docs/ascend.md, \"Checking the kernel
            sources against asc-devkit\").

A developer's (or a CI with a devkit) command: `cargo xtask test` does not run it, and it
downloads nothing.";

/// Parse `--check DEVKIT_DIR …`; `Ok(None)` for `--help`.
pub(crate) fn parse(args: &[String]) -> Result<Option<Options>, String> {
    let mut devkit = None;
    let mut include = Vec::new();
    let mut arches = Vec::new();
    let mut kernels = PathBuf::from(KERNELS_DIR);
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        if flag == "--help" || flag == "-h" {
            return Ok(None);
        }
        let mut value = |name: &str| {
            it.next().cloned().ok_or_else(|| format!("kernels: {name} needs a value\n{USAGE}"))
        };
        match flag.as_str() {
            "--check" => devkit = Some(PathBuf::from(value("--check")?)),
            "--include" => include.push(PathBuf::from(value("--include")?)),
            "--kernels" => kernels = PathBuf::from(value("--kernels")?),
            "--arch" => {
                let name = value("--arch")?;
                let arch = ARCHES.iter().find(|a| a.name == name).ok_or_else(|| {
                    format!("kernels: --arch {name}: expected dav-2201 or dav-3510")
                })?;
                arches.push(*arch);
            }
            other => return Err(format!("kernels: unknown argument {other:?}\n{USAGE}")),
        }
    }
    let devkit = devkit.ok_or_else(|| format!("kernels: --check needs DEVKIT_DIR\n{USAGE}"))?;
    if arches.is_empty() {
        arches = ARCHES.to_vec();
    }
    Ok(Some(Options { devkit, include, arches, kernels }))
}

fn text(p: &Path) -> String {
    std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf()).display().to_string()
}

/// The first of `dirs` holding `name`.
fn find(dirs: &[PathBuf], name: &str) -> Option<PathBuf> {
    dirs.iter().map(|d| d.join(name)).find(|p| p.is_file())
}

/// Run the command, printing it first; its stderr and whether it ran to a zero exit.
fn run(c: &CommandLine) -> Result<(String, bool), String> {
    println!("  $ LC_ALL=C {}", c.shell());
    let out = Command::new(&c.program)
        .args(&c.args)
        .env("LC_ALL", "C")
        .output()
        .map_err(|e| format!("kernels --check: cannot start {}: {e}", c.program))?;
    Ok((String::from_utf8_lossy(&out.stderr).into_owned(), out.status.success()))
}

/// `cargo xtask kernels --check …`.
pub fn check(args: &[String]) -> Result<(), String> {
    let Some(opts) = parse(args)? else {
        println!("{USAGE}");
        return Ok(());
    };
    for dir in ["include", "impl"] {
        if !opts.devkit.join(dir).is_dir() {
            return Err(format!(
                "kernels --check: DEVKIT_DIR {} has no {dir}/ (expected an extracted asc-devkit)",
                opts.devkit.display()
            ));
        }
    }
    let mut search: Vec<PathBuf> = opts.include.clone();
    if find(&search, REQUIRED).is_none() {
        let given: Vec<String> = search.iter().map(|p| p.display().to_string()).collect();
        return Err(format!(
            "kernels --check: {REQUIRED} is in no --include directory (given: {}); pass \
             hicann/asc-tools' cpudebug/include or a CANN toolkit's tools/tikicpulib/lib/include",
            if given.is_empty() { "none".to_string() } else { given.join(", ") }
        ));
    }
    let kernels = text(&opts.kernels);
    let mut sources: Vec<PathBuf> = std::fs::read_dir(&opts.kernels)
        .map_err(|e| format!("kernels --check: cannot read {kernels}: {e}"))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "cpp"))
        .collect();
    sources.sort();
    if sources.is_empty() {
        return Err(format!("kernels --check: no *.cpp under {kernels}"));
    }
    let out = PathBuf::from(OUT_DIR);
    let devkit = text(&opts.devkit);
    // The advanced API includes kernel_tiling/kernel_tiling.h, which a toolkit ships and the
    // devkit's sources generate.
    let generated = if find(&search, "kernel_tiling/kernel_tiling.h").is_some() {
        None
    } else {
        let dir = text(&out.join("generated"));
        let c = tiling_command(&devkit, &dir);
        let (stderr, ok) = run(&c)?;
        if !ok {
            return Err(format!("kernels --check: generating kernel_tiling.h failed:\n{stderr}"));
        }
        search.push(PathBuf::from(&dir));
        Some(dir)
    };
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "g++".into());
    let devkit_dirs = [opts.devkit.join("include"), opts.devkit.join("impl")];
    let mut seen: std::collections::BTreeMap<String, bool> = Default::default();
    let mut failed = Vec::new();
    for arch in &opts.arches {
        let wanted: Vec<&str> =
            std::iter::once(STUB_FUN).chain(arch.toolkit_headers.iter().copied()).collect();
        let absent: Vec<&str> = wanted.into_iter().filter(|h| find(&search, h).is_none()).collect();
        let placeholders = if absent.is_empty() {
            None
        } else {
            let dir = out.join(format!("placeholders-{}", arch.name));
            for h in &absent {
                let p = dir.join(h);
                if let Some(parent) = p.parent() {
                    std::fs::create_dir_all(parent)
                        .map_err(|e| format!("kernels --check: {}: {e}", parent.display()))?;
                }
                std::fs::write(&p, "// empty: this toolkit header is not public\n")
                    .map_err(|e| format!("kernels --check: {}: {e}", p.display()))?;
            }
            Some(text(&dir))
        };
        let partial = placeholders.is_some();
        println!(
            "kernels --check {}: {}",
            arch.name,
            if partial {
                format!(
                    "PARTIAL (no {}: empty placeholders; errors naming what they would declare \
                     are set aside)",
                    absent.join(", ")
                )
            } else {
                "complete".into()
            }
        );
        let inc = Includes {
            devkit: devkit.clone(),
            extra: opts.include.iter().map(|p| text(p)).collect(),
            generated: generated.clone(),
            placeholders,
            kernels: kernels.clone(),
        };
        for src in &sources {
            let c = check_command(&cxx, arch, &inc, &text(src));
            let (stderr, _) = run(&c)?;
            let mut in_devkit = |name: &str| {
                *seen.entry(name.to_string()).or_insert_with(|| used_in(&devkit_dirs, name))
            };
            let v = judge(&stderr, &kernels, partial, &mut in_devkit);
            let name = src.file_name().map_or_else(String::new, |n| n.to_string_lossy().into());
            let verdict = if v.passed(partial) { "pass" } else { "FAIL" };
            println!(
                "  {verdict} {} {name}: {} error(s) counted, {} set aside, {} other(s) in the \
                 headers",
                arch.name,
                v.errors.len(),
                v.set_aside,
                v.in_headers
            );
            for e in v.errors.iter().take(FIRST_ERRORS) {
                println!("      {}", e.shown(&kernels));
            }
            if !v.set_aside_names.is_empty() {
                let names: Vec<&str> = v.set_aside_names.iter().map(String::as_str).collect();
                println!("      set aside (undeclared without the toolkit): {}", names.join(" "));
            }
            if !partial && v.errors.is_empty() {
                for e in errors(&stderr).iter().take(FIRST_ERRORS) {
                    println!("      {}", e.shown(&kernels));
                }
            }
            if !v.passed(partial) {
                failed.push(format!("{} {name}", arch.name));
            }
        }
    }
    if failed.is_empty() {
        println!("kernels --check: every kernel passed");
        Ok(())
    } else {
        Err(format!("kernels --check: {} failed: {}", failed.len(), failed.join(", ")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn includes(placeholders: Option<&str>) -> Includes {
        Includes {
            devkit: "/dk".into(),
            extra: vec!["/tools/cpudebug/include".into()],
            generated: Some("/gen".into()),
            placeholders: placeholders.map(Into::into),
            kernels: "/k".into(),
        }
    }

    fn words(s: &str) -> String {
        s.split_whitespace().collect::<Vec<_>>().join(" ")
    }

    #[test]
    fn each_arch_compiles_with_its_cpu_debug_defines_and_the_devkit_includes() {
        let a2 = check_command("g++", &ARCHES[0], &includes(None), "/k/kda_gate.cpp");
        assert_eq!(
            a2.shell(),
            words(
                "g++ -std=c++17 -fsyntax-only -fmax-errors=0 -DASCENDC_CPU_DEBUG=1 \
                 -DASCENDC_DEBUG=1 -DASCENDC_DUMP=0 -D__CCE_KT_TEST__=1 -D__CCE_AICORE__=220 \
                 -D__DAV_C220__ -D__NPU_ARCH__=2201 -I/dk -I/dk/include -I/dk/include/basic_api \
                 -I/dk/include/adv_api -I/dk/include/utils -I/tools/cpudebug/include -I/gen -I/k \
                 /k/kda_gate.cpp"
            )
        );
        let a5 = check_command("g++", &ARCHES[1], &includes(Some("/ph")), "/k/kda_gate.cpp");
        let line = a5.shell();
        assert!(line.contains("-D__CCE_AICORE__=310 -D__DAV_C310__ -D__NPU_ARCH__=3510"), "{line}");
        // The placeholders come after every real directory: a real header always wins.
        assert!(line.contains("-I/gen -I/ph -I/k /k/kda_gate.cpp"), "{line}");
        assert_eq!(ARCHES[1].toolkit_headers, ["acl/acl.h"]);
    }

    #[test]
    fn one_command_per_kernel_per_arch() {
        let inc = includes(None);
        let sources = ["/k/a.cpp", "/k/b.cpp", "/k/c.cpp"];
        let all: Vec<String> = ARCHES
            .iter()
            .flat_map(|a| sources.iter().map(|s| check_command("g++", a, &inc, s).shell()))
            .collect();
        assert_eq!(all.len(), 6);
        let unique: BTreeSet<&String> = all.iter().collect();
        assert_eq!(unique.len(), 6);
        assert!(all[5].ends_with("/k/c.cpp") && all[5].contains("__NPU_ARCH__=3510"));
    }

    #[test]
    fn the_tiling_header_is_generated_by_the_devkit_script() {
        assert_eq!(
            tiling_command("/dk", "/out").shell(),
            "python3 /dk/impl/adv_api/cmake/scripts/gen_kernel_tiling_data_def.py \
             /dk/include/adv_api /out/kernel_tiling/kernel_tiling.h"
        );
    }

    const STDERR: &str = "\
In file included from /k/kda_sigmoid.cpp:5:
/dk/impl/basic_api/kernel_event.h:40:5: error: 'pipe_t' does not name a type
/dk/impl/basic_api/x.h:12:9: error: 'PIPE_V' was not declared in this scope
/k/kda_sigmoid.cpp:53:25: error: 'PIPE_V' was not declared in this scope
/k/kda_sigmoid.cpp:53:32: error: template argument 1 is invalid
/k/kda_sigmoid.cpp:55:32: error: no matching function for call to 'PipeBarrier<PIPE_V>()'
/k/kda_sigmoid.cpp:81:5: error: reference to 'Sigmoid' is ambiguous
/k/kda_sigmoid.cpp:81:14: error: expected primary-expression before '>' token
/k/kda_sigmoid.cpp:81:16: error: 'k' was not declared in this scope
/k/kda_kernel_util.h:91:36: fatal error: 'EVENT_ID9' was not declared in this scope
";

    #[test]
    fn errors_are_read_with_file_and_line() {
        let e = errors(STDERR);
        assert_eq!(e.len(), 9);
        assert_eq!(
            e[5],
            Diagnostic {
                file: "/k/kda_sigmoid.cpp".into(),
                line: 81,
                message: "reference to 'Sigmoid' is ambiguous".into(),
                required_from: vec![],
            }
        );
        assert_eq!(e[8].line, 91);
        assert!(under("/k/a.h", "/k") && !under("/k2/a.h", "/k") && !under("/k", "/k"));
        let names: Vec<String> = missing_names(&e, "/k").into_iter().collect();
        assert_eq!(names, ["PIPE_V", "pipe_t"]);
    }

    #[test]
    fn a_partial_check_sets_aside_only_what_a_placeholder_explains() {
        let mut asked = Vec::new();
        let mut in_devkit = |n: &str| {
            asked.push(n.to_string());
            n == "EVENT_ID1"
        };
        let v = judge(STDERR, "/k", true, &mut in_devkit);
        assert_eq!(asked, ["EVENT_ID9"]);
        // Line 53's invalid template argument goes with its undeclared PIPE_V; the ambiguity, what
        // follows from it on line 81, and undeclared names the headers never lacked still count
        // (`k` is not even asked about: only constant-like names can be a toolkit's).
        assert_eq!(v.set_aside, 3);
        assert_eq!(v.in_headers, 2);
        let lines: Vec<u32> = v.errors.iter().map(|e| e.line).collect();
        assert_eq!(lines, [81, 81, 81, 91]);
        assert_eq!(v.set_aside_names.iter().collect::<Vec<_>>(), ["PIPE_V"]);
        assert!(!v.passed(true));
        // A name the devkit itself uses (declared by a toolkit header) is set aside too.
        let with_id1 = format!(
            "{STDERR}/k/kda_recurrent.cpp:149:36: error: 'EVENT_ID1' was not declared in this scope\n"
        );
        let v1 = judge(&with_id1, "/k", true, &mut |n: &str| n == "EVENT_ID1");
        assert_eq!((v1.errors.len(), v1.set_aside), (4, 4));
        assert!(v1.set_aside_names.contains("EVENT_ID1"));
        // A complete check excuses nothing.
        let full = judge(STDERR, "/k", false, &mut |_: &str| true);
        assert_eq!((full.errors.len(), full.set_aside), (7, 0));
        assert!(constant_like("EVENT_ID1") && constant_like("PIPE_MTE2"));
        assert!(!constant_like("k") && !constant_like("PIPE") && !constant_like("Event_ID1"));
        // Header errors fail a complete check even when the kernel lines are clean.
        let clean = Verdict {
            errors: vec![],
            set_aside: 0,
            set_aside_names: BTreeSet::new(),
            in_headers: 1,
        };
        assert!(clean.passed(true) && !clean.passed(false));
    }

    #[test]
    fn a_header_error_a_kernel_instantiated_counts_unless_a_name_is_missing() {
        let stderr = "\
/dk/x_impl.h: In instantiation of 'void AscendC::ExpIntrinsicsImpl(T*) [with T = bfloat16_t]':
/dk/x_impl.h:190:9:   required from 'void AscendC::ExpImpl(T*) [with T = bfloat16_t]'
/k/kda_sigmoid.cpp:56:13:   required from here
/dk/x_impl.h:45:5: error: static assertion failed: Failed to check dtype in Exp, src and dst
/dk/tpipe_impl.h: In instantiation of 'bool AscendC::TPipe::InitBuffer(T&)':
/k/kda_sigmoid.cpp:28:25:   required from here
/dk/tpipe_impl.h:301:19: error: 'AscendCBufInit' was not declared in this scope
/dk/y.h:10:1: error: expected ')' before 'memT'
/dk/z.h:3:1: error: 'dst' was not declared in this scope
/dk/unary.h: In instantiation of 'void AscendC::ExpImpl(T*) [with T = float]':
/k/kda_kernel_util.h:159:5:   required from here
/dk/unary.h:261:20: error: 'constexpr const void modeValue' has incomplete type
";
        let e = errors(stderr);
        assert_eq!(
            e[0].required_from,
            [("/dk/x_impl.h".to_string(), 190), ("/k/kda_sigmoid.cpp".to_string(), 56)]
        );
        assert!(e[2].required_from.is_empty());
        assert_eq!(
            e[0].shown("/k"),
            "/dk/x_impl.h:45: static assertion failed: Failed to check dtype in Exp, src and \
             dst (instantiated from /k/kda_sigmoid.cpp:56)"
        );
        let v = judge(stderr, "/k", true, &mut |_: &str| false);
        assert_eq!(v.errors, [e[0].clone()]);
        // The void constant follows from a missing type: it is no argument error.
        assert_eq!((v.in_headers, v.set_aside), (4, 0));
        assert!(!v.passed(true));
        // A complete check counts every header error as a header error.
        let full = judge(stderr, "/k", false, &mut |_: &str| false);
        assert_eq!((full.errors.len(), full.in_headers), (0, 5));
    }

    #[test]
    fn a_name_counts_as_used_by_the_devkit_only_as_a_whole_word() {
        let dir = std::env::temp_dir().join(format!("kda-kernel-check-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("impl/basic_api")).unwrap();
        std::fs::write(dir.join("impl/basic_api/a.h"), "f(EVENT_ID1); g(PIPE_VX);\n").unwrap();
        let dirs = [dir.join("include"), dir.join("impl")];
        assert!(used_in(&dirs, "EVENT_ID1"));
        assert!(!used_in(&dirs, "PIPE_V"));
        assert!(!used_in(&dirs, "EVENT_ID"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn arguments_parse_and_help_says_it_is_not_part_of_the_test_run() {
        let args = |s: &str| s.split_whitespace().map(String::from).collect::<Vec<_>>();
        let o =
            parse(&args("--check /dk --include /a --include /b --arch dav-3510")).unwrap().unwrap();
        assert_eq!(o.devkit, PathBuf::from("/dk"));
        assert_eq!(o.include, [PathBuf::from("/a"), PathBuf::from("/b")]);
        assert_eq!(o.arches, [ARCHES[1]]);
        assert_eq!(o.kernels, PathBuf::from(KERNELS_DIR));
        assert_eq!(parse(&args("--check /dk")).unwrap().unwrap().arches, ARCHES.to_vec());
        assert!(parse(&args("--check /dk --help")).unwrap().is_none());
        assert!(parse(&args("--include /a")).unwrap_err().contains("needs DEVKIT_DIR"));
        assert!(parse(&args("--check /dk --arch dav-9999")).unwrap_err().contains("dav-9999"));
        assert!(parse(&args("--check")).unwrap_err().contains("--check needs a value"));
        assert!(USAGE.contains("`cargo xtask test` does not run it"));
    }
}
