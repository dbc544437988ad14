//! `cargo xtask gpu-check`: the CUDA backend on a real GPU, in one run sized for a lent H200
//! (a 10-minute call), ending in one JSON report:
//!
//! 1. build kda-cuda (feature `cuda`) with its tests and the benchmark driver, release;
//! 2. its tests: unit, the whole conformance suite and the device trials (a run that skips any
//!    trial, e.g. for want of a device, fails);
//! 3. `examples/gpu_bench`: captures checked (valid, native CUDA graphs bit-identical to eager),
//!    the fast paths' differences from the exact ones, CUDA-event timings;
//! 4. the peer comparison ([`peers`]): kda against flash-linear-attention's `chunk_kda` and
//!    torch's bf16 matmul, and kda's schedules, graphs and whole layer, interleaved in rounds,
//!    medians, one table.
//!
//! Every child's output is written to `gpu-check.log` beside the report as it arrives, each
//! step runs under a time limit (killed with its children past it), and the report is
//! rewritten after every step (`"complete": false` until the end): a run that hangs or is cut
//! short still returns what it saw.
//!
//! A GPU machine without cargo or network takes a bundle made here:
//! `cargo xtask gpu-check --bundle DIR` builds the binaries, the kernels' CUBINs (NVRTC only, no
//! GPU), fetches the peers' pure-Python wheels (`fla-core`, `einops`) and copies this tool into
//! `DIR`; there, `DIR/xtask gpu-check --from DIR` runs steps 2 to 4 from it. The report goes to
//! `--out PATH`, else `$OUT/gpu-check.json`, else `target/gpu-check.json`. `--quick` shortens
//! the benchmarks.

mod peers;
mod stream;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::{Counts, add_counts, cargo};
use stream::{Log, Outcome};

const FEATURES: [&str; 5] = ["-p", "kda-cuda", "--features", "cuda", "--release"];

/// Time limits of the steps on the device, which together fit a 10-minute call with room for
/// the machine's start: every test binary together, the benchmark driver, the comparison.
const TESTS_LIMIT: Duration = Duration::from_secs(200);
const BENCH_LIMIT: Duration = Duration::from_secs(90);
const COMPARE_LIMIT: Duration = Duration::from_secs(200);
/// Building from source (only without a bundle).
const BUILD_LIMIT: Duration = Duration::from_secs(1800);

#[derive(Debug, Default)]
struct Options {
    out: Option<PathBuf>,
    quick: bool,
    bundle: Option<PathBuf>,
    from: Option<PathBuf>,
}

fn parse(args: &[String]) -> Result<Options, String> {
    let mut o = Options::default();
    let mut rest = args.iter();
    let path = |flag: &str, v: Option<&String>| {
        v.map(PathBuf::from).ok_or_else(|| format!("gpu-check: {flag} needs a path"))
    };
    while let Some(a) = rest.next() {
        match a.as_str() {
            "--out" => o.out = Some(path("--out", rest.next())?),
            "--bundle" => o.bundle = Some(path("--bundle", rest.next())?),
            "--from" => o.from = Some(path("--from", rest.next())?),
            "--quick" => o.quick = true,
            other => return Err(format!("gpu-check: unknown argument {other}")),
        }
    }
    Ok(o)
}

/// One finished step, as the report lists it.
#[derive(Debug, Default)]
struct StepRecord {
    name: String,
    ok: bool,
    timed_out: bool,
    code: Option<i32>,
    seconds: f64,
    /// Test counts, for test steps.
    counts: Option<Counts>,
    /// What failed (failing tests, panics, errors), at most 40 lines.
    failures: String,
}

/// The report, rewritten after every step.
#[derive(Debug)]
struct Report {
    path: PathBuf,
    log: PathBuf,
    from_bundle: bool,
    ld_library_path: String,
    steps: Vec<StepRecord>,
    /// gpu_bench's JSON report, verbatim.
    bench: Option<String>,
    /// The peer comparison's JSON, verbatim.
    comparison: Option<String>,
    complete: bool,
    ok: bool,
    start: Instant,
}

impl Report {
    /// An empty report at `path`, its log at `log`.
    fn new(path: PathBuf, log: PathBuf, from_bundle: bool, ld_library_path: String) -> Self {
        Self {
            path,
            log,
            from_bundle,
            ld_library_path,
            steps: Vec::new(),
            bench: None,
            comparison: None,
            complete: false,
            ok: false,
            start: Instant::now(),
        }
    }

    fn counts(&self) -> Counts {
        let mut total = Counts::default();
        for c in self.steps.iter().filter_map(|s| s.counts.as_ref()) {
            total.passed += c.passed;
            total.failed += c.failed;
            total.ignored += c.ignored;
        }
        total
    }

    fn json(&self) -> String {
        let steps: Vec<String> = self
            .steps
            .iter()
            .map(|s| {
                let counts = s.counts.as_ref().map_or(String::new(), |c| {
                    format!(
                        ", \"passed\": {}, \"failed\": {}, \"ignored\": {}",
                        c.passed, c.failed, c.ignored
                    )
                });
                format!(
                    "    {{ \"name\": {}, \"ok\": {}, \"timed_out\": {}, \"exit_code\": {}, \
                     \"seconds\": {:.1}{counts}, \"failures\": {} }}",
                    json_string(&s.name),
                    s.ok,
                    s.timed_out,
                    s.code.map_or("null".into(), |c| c.to_string()),
                    s.seconds,
                    json_string(&s.failures),
                )
            })
            .collect();
        let c = self.counts();
        format!(
            "{{\n  \"ok\": {},\n  \"complete\": {},\n  \"from_bundle\": {},\n  \"log\": {},\n  \
             \"ld_library_path\": {},\n  \"tests\": {{ \"passed\": {}, \"failed\": {}, \
             \"ignored\": {} }},\n  \"steps\": [\n{}\n  ],\n  \"bench\": {},\n  \
             \"comparison\": {},\n  \"seconds\": {:.1}\n}}\n",
            self.ok,
            self.complete,
            self.from_bundle,
            json_string(&self.log.to_string_lossy()),
            json_string(&self.ld_library_path),
            c.passed,
            c.failed,
            c.ignored,
            steps.join(",\n"),
            self.bench.as_deref().unwrap_or("null"),
            self.comparison.as_deref().unwrap_or("null"),
            self.start.elapsed().as_secs_f64(),
        )
    }

    fn write(&self) -> Result<(), String> {
        std::fs::write(&self.path, self.json())
            .map_err(|e| format!("gpu-check: {}: {e}", self.path.display()))
    }

    /// Run one step: its output to the log, killed past `limit`, its record added and the
    /// report rewritten.
    fn step(
        &mut self,
        log: &Log,
        name: &str,
        program: &str,
        args: &[&str],
        env: &[(String, String)],
        limit: Duration,
    ) -> Result<Outcome, String> {
        let outcome = stream::run(log, program, args, env, limit)?;
        let is_test = outcome.output.contains("test result: ");
        let counts = is_test.then(|| {
            let mut counts = Counts::default();
            for line in outcome.output.lines() {
                if let Some(summary) = line.strip_prefix("test result: ") {
                    add_counts(&mut counts, summary);
                }
            }
            counts
        });
        self.steps.push(StepRecord {
            name: name.to_string(),
            ok: outcome.ok,
            timed_out: outcome.timed_out,
            code: outcome.code,
            seconds: outcome.seconds,
            counts,
            failures: failure_lines(&outcome.output),
        });
        self.write()?;
        Ok(outcome)
    }
}

pub fn gpu_check(args: &[String]) -> Result<(), String> {
    let options = parse(args)?;
    if let Some(dir) = &options.bundle {
        return bundle(dir);
    }
    let out = options.out.clone().unwrap_or_else(|| {
        std::env::var_os("OUT")
            .map(|d| PathBuf::from(d).join("gpu-check.json"))
            .unwrap_or_else(|| PathBuf::from("target/gpu-check.json"))
    });
    let out_dir = out.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(out_dir)
        .map_err(|e| format!("gpu-check: {}: {e}", out_dir.display()))?;
    let log_path = out_dir.join("gpu-check.log");
    let log = Log::create(&log_path, true)?;
    let library_path = cuda_library_path();
    let mut env = vec![("LD_LIBRARY_PATH".to_string(), library_path.clone())];
    if let Some(dir) = &options.from {
        env.push(("KDA_CUDA_CUBIN_DIR".into(), dir.join("cubins").to_string_lossy().into()));
    }
    let mut report = Report::new(out.clone(), log_path, options.from.is_some(), library_path);
    report.write()?;
    let cargo = cargo();

    let built = match &options.from {
        Some(_) => true,
        None => {
            let mut build = vec!["build", "--tests", "--examples"];
            build.extend(FEATURES);
            report.step(&log, "build", &cargo, &build, &env, BUILD_LIMIT)?.ok
        }
    };
    if built {
        let deadline = Instant::now() + TESTS_LIMIT;
        match &options.from {
            Some(dir) => {
                for exe in list(&dir.join("tests"))? {
                    let name = exe.file_name().map(|n| n.to_string_lossy().into_owned());
                    let left = deadline.saturating_duration_since(Instant::now());
                    let name = format!("test {}", name.unwrap_or_default());
                    report.step(&log, &name, &exe.to_string_lossy(), &[], &env, left)?;
                }
            }
            None => {
                let mut test = vec!["test"];
                test.extend(FEATURES);
                report.step(&log, "test", &cargo, &test, &env, TESTS_LIMIT)?;
            }
        }
        let bench_path = out.with_file_name("gpu-bench.json");
        let bench_out = bench_path.to_string_lossy().into_owned();
        let mut bench_args = vec!["--out", &bench_out];
        if options.quick {
            bench_args.push("--quick");
        }
        let bench_exe = bench_program(&options, &cargo);
        let (program, mut args) = (bench_exe.0.clone(), bench_exe.1.clone());
        args.extend(bench_args.iter().map(|s| s.to_string()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        report.step(&log, "bench", &program, &args, &env, BENCH_LIMIT)?;
        report.bench = std::fs::read_to_string(&bench_path).ok().filter(|t| !t.trim().is_empty());
        report.write()?;

        let compare_start = Instant::now();
        let wheels = match &options.from {
            Some(dir) => dir.join("peers"),
            None => PathBuf::from("target/gpu-peers"),
        };
        if options.from.is_none() {
            fetch_wheels(&wheels);
        }
        let setup = peers::Setup {
            kda: bench_exe,
            env: env.clone(),
            wheels,
            out_dir: out_dir.to_path_buf(),
            quick: options.quick,
            limit: COMPARE_LIMIT,
        };
        let compared = peers::compare(&log, &setup);
        let (ok, failures) = match &compared {
            Ok(c) => (c.complete, c.note.clone()),
            Err(e) => (false, e.clone()),
        };
        report.comparison = compared.ok().map(|c| c.json);
        report.steps.push(StepRecord {
            name: "compare".into(),
            ok,
            timed_out: !ok && compare_start.elapsed() >= COMPARE_LIMIT,
            seconds: compare_start.elapsed().as_secs_f64(),
            failures,
            ..StepRecord::default()
        });
        report.write()?;
    }

    let counts = report.counts();
    report.ok = report.steps.iter().all(|s| s.ok) && counts.ignored == 0 && counts.passed > 0;
    report.complete = true;
    report.write()?;
    println!("{}", report.json());
    eprintln!(
        "gpu-check: report in {}, log in {} ({:.0} s)",
        out.display(),
        report.log.display(),
        report.start.elapsed().as_secs_f64()
    );
    if report.ok { Ok(()) } else { Err("gpu-check (see the report)".into()) }
}

/// How to start `gpu_bench`: the bundle's binary, or through cargo.
fn bench_program(options: &Options, cargo: &str) -> (String, Vec<String>) {
    match &options.from {
        Some(dir) => (dir.join("gpu_bench").to_string_lossy().into_owned(), Vec::new()),
        None => {
            let mut args: Vec<String> = vec!["run".into(), "--quiet".into()];
            args.extend(FEATURES.iter().map(|s| s.to_string()));
            args.extend(["--example", "gpu_bench", "--"].map(String::from));
            (cargo.to_string(), args)
        }
    }
}

/// The peers' pure-Python wheels (`fla-core` for `chunk_kda`, and its one dependency
/// `einops`) into `dir`, best effort: without network, the comparison reports the peer
/// missing. The GPU machine has torch and Triton; these two are all it lacks.
fn fetch_wheels(dir: &Path) {
    if peers::wheels(dir).len() >= peers::WHEELS.len() {
        return;
    }
    let _ = std::fs::create_dir_all(dir);
    let dir = dir.to_string_lossy();
    let mut args = vec!["-m", "pip", "download", "--quiet", "--disable-pip-version-check"];
    args.extend(["--no-deps", "--only-binary=:all:", "--timeout", "15", "-d", &dir]);
    args.extend(peers::WHEELS);
    let status = Command::new("python3").args(&args).stdout(Stdio::null()).status();
    if !status.is_ok_and(|s| s.success()) {
        eprintln!("gpu-check: could not download {:?} into {dir}", peers::WHEELS);
    }
}

/// Build everything a GPU machine without cargo needs into `dir`: `tests/` (the kda-cuda test
/// binaries), `gpu_bench`, `cubins/` (sm_90, compiled here with NVRTC), `peers/` (the peers'
/// wheels) and `xtask`.
fn bundle(dir: &Path) -> Result<(), String> {
    let cargo = cargo();
    let env = vec![("LD_LIBRARY_PATH".to_string(), cuda_library_path())];
    let mut tests = vec!["test", "--no-run", "--message-format=json"];
    tests.extend(FEATURES);
    let (ok, log) = run_quiet(&cargo, &tests, &env)?;
    if !ok {
        return Err(format!("gpu-check --bundle: building the tests failed:\n{log}"));
    }
    let mut bench = vec!["build", "--example", "gpu_bench", "--message-format=json"];
    bench.extend(FEATURES);
    let (ok, bench_log) = run_quiet(&cargo, &bench, &env)?;
    if !ok {
        return Err(format!("gpu-check --bundle: building gpu_bench failed:\n{bench_log}"));
    }
    // Stripped (best effort), the bundle fits a device session's carry limit (64 MiB).
    let copy = |from: &Path, to: &Path| {
        std::fs::copy(from, to).map_err(|e| {
            format!("gpu-check --bundle: {} -> {}: {e}", from.display(), to.display())
        })?;
        let _ = Command::new("strip").arg(to).stderr(Stdio::null()).status();
        Ok::<(), String>(())
    };
    let test_dir = dir.join("tests");
    let _ = std::fs::remove_dir_all(&test_dir);
    std::fs::create_dir_all(&test_dir).map_err(|e| format!("gpu-check --bundle: {e}"))?;
    // The NVRTC check stays here: it is what built the CUBINs the bundle carries.
    for exe in executables(&log).into_iter().filter(|(test, _)| *test).map(|(_, exe)| exe) {
        match exe.file_name() {
            Some(name) if !name.to_string_lossy().starts_with("nvrtc-") => {
                copy(&exe, &test_dir.join(name))?
            }
            _ => {}
        }
    }
    let (_, bench_exe) =
        executables(&bench_log).pop().ok_or("gpu-check --bundle: no gpu_bench binary")?;
    copy(&bench_exe, &dir.join("gpu_bench"))?;
    let me = std::env::current_exe().map_err(|e| format!("gpu-check --bundle: {e}"))?;
    copy(&me, &dir.join("xtask"))?;
    let cubins = dir.join("cubins").to_string_lossy().into_owned();
    let (ok, log) =
        run_quiet(&dir.join("gpu_bench").to_string_lossy(), &["--write-cubins", &cubins], &env)?;
    if !ok {
        return Err(format!(
            "gpu-check --bundle: compiling the CUBINs failed (is libnvrtc on LD_LIBRARY_PATH?):\n{log}"
        ));
    }
    fetch_wheels(&dir.join("peers"));
    let wheels = peers::wheels(&dir.join("peers"));
    eprintln!(
        "gpu-check: bundle in {} (peer wheels: {}); on the GPU machine run: {}/xtask gpu-check \
         --from {0}",
        dir.display(),
        if wheels.is_empty() {
            "none, the comparison will lack fla".to_string()
        } else {
            wheels
                .iter()
                .filter_map(|w| w.file_name())
                .map(|n| n.to_string_lossy())
                .collect::<Vec<_>>()
                .join(", ")
        },
        dir.display(),
    );
    Ok(())
}

/// The `"executable"` paths of cargo's JSON messages, each with whether it is a test binary.
pub(crate) fn executables(json_lines: &str) -> Vec<(bool, PathBuf)> {
    const KEY: &str = "\"executable\":\"";
    json_lines
        .lines()
        .filter_map(|l| {
            let at = l.find(KEY)? + KEY.len();
            let end = l[at..].find('"')?;
            Some((l.contains("\"test\":true"), PathBuf::from(&l[at..at + end])))
        })
        .collect()
}

/// The files in `dir`, sorted.
fn list(dir: &Path) -> Result<Vec<PathBuf>, String> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| format!("gpu-check: {}: {e}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    Ok(files)
}

/// The libraries the backend opens (cuBLAS 13 or 12, NVRTC) and the directories they were
/// found in, where toolkits and the PyPI wheels put them.
const LIBRARIES: [&[&str]; 3] = [
    &["libcublas.so.13", "libcublas.so.12"],
    &["libcublasLt.so.13", "libcublasLt.so.12"],
    &["libnvrtc.so.13", "libnvrtc.so.12"],
];

/// `LD_LIBRARY_PATH` extended with the directories that hold the libraries the backend opens,
/// so a machine that has them anywhere usual runs the backend (the backend searches the same
/// places itself, `kda_cuda::libs`; children started here find them on the loader's path).
fn cuda_library_path() -> String {
    let mut dirs: Vec<PathBuf> = std::env::var("LD_LIBRARY_PATH")
        .unwrap_or_default()
        .split(':')
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
        .collect();
    let mut candidates: Vec<PathBuf> = ["CUDA_HOME", "CUDA_PATH"]
        .iter()
        .filter_map(|v| std::env::var_os(v).map(|d| PathBuf::from(d).join("lib64")))
        .collect();
    candidates.extend(
        [
            "/usr/local/cuda/lib64",
            "/usr/local/cuda/targets/x86_64-linux/lib",
            "/usr/lib/x86_64-linux-gnu",
        ]
        .map(PathBuf::from),
    );
    let mut site: Vec<PathBuf> = python_site_packages();
    if let Some(home) = std::env::var_os("HOME") {
        site.push(PathBuf::from(home).join(".cache/kda/nvrtc"));
    }
    for s in site {
        candidates.extend(wheel_lib_dirs(&s));
    }
    for names in LIBRARIES {
        let here = |d: &PathBuf| names.iter().any(|lib| d.join(lib).exists());
        if dirs.iter().any(here) {
            continue;
        }
        if let Some(d) = candidates.iter().find(|d| here(d)) {
            dirs.push(d.clone());
        }
    }
    dirs.iter().map(|d| d.to_string_lossy()).collect::<Vec<_>>().join(":")
}

/// The `lib` folders of the NVIDIA wheels under a site-packages directory: CUDA 13's unified
/// `nvidia/cu13/lib`, then CUDA 12's per-library folders (as `kda_cuda::libs` searches).
fn wheel_lib_dirs(site_packages: &Path) -> Vec<PathBuf> {
    let nvidia = site_packages.join("nvidia");
    ["cu13", "cublas", "cuda_nvrtc", "cuda_runtime"].map(|p| nvidia.join(p).join("lib")).into()
}

/// Python's site-packages directories, if there is a Python.
fn python_site_packages() -> Vec<PathBuf> {
    let script =
        "import site; print('\\n'.join(site.getsitepackages() + [site.getusersitepackages()]))";
    Command::new("python3")
        .args(["-c", script])
        .stderr(Stdio::null())
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).lines().map(PathBuf::from).collect())
        .unwrap_or_default()
}

/// Run `program` with `args` and extra `env`, keeping its output; whether it succeeded.
pub(crate) fn run_quiet(
    program: &str,
    args: &[&str],
    env: &[(String, String)],
) -> Result<(bool, String), String> {
    eprintln!("==> {program} {}", args.join(" "));
    let output = Command::new(program)
        .args(args)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .map_err(|e| format!("gpu-check: cannot start {program}: {e}"))?;
    let mut log = String::from_utf8_lossy(&output.stdout).into_owned();
    log.push_str(&String::from_utf8_lossy(&output.stderr));
    Ok((output.status.success(), log))
}

/// The lines that say what failed (failing tests, panics, errors, skipped trials), at most 40.
fn failure_lines(log: &str) -> String {
    let wanted = |l: &&str| {
        l.contains("FAILED")
            || l.contains("panicked")
            || l.starts_with("error")
            || l.ends_with("... ignored")
            || l.contains("killed after")
    };
    let lines: Vec<&str> = log.lines().filter(wanted).take(40).collect();
    lines.join("\n")
}

/// `text` as a JSON string literal.
pub(crate) fn json_string(text: &str) -> String {
    let mut s = String::with_capacity(text.len() + 2);
    s.push('"');
    for c in text.chars() {
        match c {
            '"' => s.push_str("\\\""),
            '\\' => s.push_str("\\\\"),
            '\n' => s.push_str("\\n"),
            c if (c as u32) < 0x20 => s.push_str(&format!("\\u{:04x}", c as u32)),
            c => s.push(c),
        }
    }
    s.push('"');
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_strings_escape_quotes_newlines_and_controls() {
        assert_eq!(json_string("a \"b\"\n\\c\t"), "\"a \\\"b\\\"\\n\\\\c\\u0009\"");
    }

    #[test]
    fn failure_lines_keep_what_failed() {
        let log = "error[E0308]: x\nCompiling\ntest a ... ok\ntest b ... FAILED\n\
                   thread 'b' panicked at x\ntest c ... ignored\n";
        assert_eq!(
            failure_lines(log),
            "error[E0308]: x\ntest b ... FAILED\nthread 'b' panicked at x\ntest c ... ignored"
        );
    }

    #[test]
    fn executables_are_read_off_cargo_messages() {
        let log = "{\"reason\":\"compiler-artifact\",\"profile\":{\"test\":true},\"executable\":\"/t/release/deps/conformance-ab12\",\"fresh\":true}\n\
                   {\"reason\":\"compiler-artifact\",\"executable\":null}\n\
                   {\"reason\":\"build-finished\",\"success\":true}\n";
        assert_eq!(
            executables(log),
            vec![(true, PathBuf::from("/t/release/deps/conformance-ab12"))]
        );
    }

    #[test]
    fn options_parse_and_unknown_flags_are_errors() {
        let args: Vec<String> =
            ["--from", "b", "--quick", "--out", "r.json"].map(String::from).into();
        let o = parse(&args).unwrap();
        assert_eq!((o.from, o.quick, o.out), (Some("b".into()), true, Some("r.json".into())));
        assert!(parse(&["--bogus".to_string()]).is_err());
        assert!(parse(&["--out".to_string()]).is_err());
    }

    /// A step that hangs is killed at its limit, and the run keeps its log and a partial report
    /// that says so (what a device session cut short brings back).
    #[test]
    fn a_hanging_step_leaves_a_log_and_a_partial_report() {
        let dir = std::env::temp_dir().join(format!("xtask-gpu-check-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let log = Log::create(&dir.join("gpu-check.log"), false).unwrap();
        let mut report =
            Report::new(dir.join("gpu-check.json"), dir.join("gpu-check.log"), true, String::new());
        let ok = "echo 'test result: ok. 3 passed; 0 failed; 0 ignored; 0 measured'";
        report.step(&log, "test unit", "sh", &["-c", ok], &[], Duration::from_secs(20)).unwrap();
        let hang = "echo 'running 79 tests'; echo 'test suite::a ... ok'; sleep 60";
        let out = report
            .step(&log, "test conformance", "sh", &["-c", hang], &[], Duration::from_millis(500))
            .unwrap();
        assert!(out.timed_out);
        let json = std::fs::read_to_string(dir.join("gpu-check.json")).unwrap();
        assert!(json.contains("\"complete\": false"), "{json}");
        assert!(json.contains("\"name\": \"test unit\", \"ok\": true"), "{json}");
        assert!(
            json.contains("\"name\": \"test conformance\", \"ok\": false, \"timed_out\": true"),
            "{json}"
        );
        assert!(json.contains("\"passed\": 3"), "{json}");
        let text = std::fs::read_to_string(dir.join("gpu-check.log")).unwrap();
        assert!(text.contains("test suite::a ... ok") && text.contains("killed after"), "{text}");
        let _ = std::fs::remove_dir_all(dir);
    }
}
