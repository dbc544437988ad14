//! `cargo xtask gpu-check`: the CUDA backend on a real GPU, in one run sized for a lent H200,
//! ending in one JSON report. The steps run in the order of what they tell, each written to the
//! report before the next starts, so the first results survive anything later going wrong:
//!
//! 1. (without a bundle) build kda-cuda (feature `cuda`) with its tests and the benchmark
//!    driver, release;
//! 2. the probe (`gpu_bench --probe`): the device, where cuBLAS and the kernels came from, the
//!    fast paths in effect — whether the backend loads at all, in seconds;
//! 3. the test binaries, one at a time and each under its own limit, every trial on one thread
//!    (`--test-threads 1`: they share one CUDA context): unit, the whole conformance suite, the
//!    device trials, the engine import trials (a run that skips any trial, e.g. for want of a
//!    device, fails);
//! 4. `examples/gpu_bench`: the tensor-core chunk against the token-by-token kernel, graphs
//!    bit-identical to eager, the fast paths' differences from the exact ones, CUDA-event
//!    timings;
//! 5. the peer comparison ([`peers`]): kda against flash-linear-attention's `chunk_kda` and
//!    torch's bf16 matmul, and kda's schedules, graphs and whole layer, interleaved in rounds,
//!    medians, one table, rewritten after every round.
//!
//! Every child's output is written to `gpu-check.log` beside the report as it arrives, each
//! step runs under its own time limit and all of them within the run's (`--limit SECONDS`,
//! default [`RUN_LIMIT`]; a step with no time left is recorded as skipped), killed with its
//! children past it, and the report is rewritten after every step (`"complete": false` until
//! the end): a run that hangs or is cut short still returns what it saw.
//!
//! A GPU machine without cargo or network takes a bundle made here:
//! `cargo xtask gpu-check --bundle DIR` builds the binaries, the kernels' CUBINs (NVRTC only, no
//! GPU; CUDA 12's or 13's), fetches the peers' pure-Python wheels (`fla-core`, `einops`) and
//! copies this tool into `DIR`; there, `DIR/xtask gpu-check --from DIR` runs steps 2 to 5 from
//! it. The report goes to `--out PATH`, else `$OUT/gpu-check.json`, else
//! `target/gpu-check.json`. `--quick` shortens the benchmarks.

mod peers;
mod stream;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::{Counts, add_counts, cargo};
use stream::{Log, Outcome};

const FEATURES: [&str; 5] = ["-p", "kda-cuda", "--features", "cuda", "--release"];

/// The whole run's default limit, machine start not included: with the device tool's
/// `timeout_s` a minute above it, the report always comes back, and a 15-minute device budget
/// keeps room for a second, shorter run.
const RUN_LIMIT: Duration = Duration::from_secs(360);
/// The probe: the first process on a fresh machine pays for the driver's start and for loading
/// the CUBINs.
const PROBE_LIMIT: Duration = Duration::from_secs(45);
/// The test binaries in the order they run (by cargo's target name), each with its own limit,
/// so one that hangs cannot take the others' time: the unit tests (host side), the conformance
/// suite, the device trials, the engine import trials. Any other test binary runs after them.
const TEST_ORDER: [(&str, Duration); 4] = [
    ("kda_cuda", Duration::from_secs(20)),
    ("conformance", Duration::from_secs(100)),
    ("device", Duration::from_secs(50)),
    ("import", Duration::from_secs(40)),
];
const OTHER_TEST_LIMIT: Duration = Duration::from_secs(30);
const BENCH_LIMIT: Duration = Duration::from_secs(90);
const COMPARE_LIMIT: Duration = Duration::from_secs(200);
/// Building from source (only without a bundle; not counted in the run's limit).
const BUILD_LIMIT: Duration = Duration::from_secs(1800);

#[derive(Debug, Default)]
struct Options {
    out: Option<PathBuf>,
    quick: bool,
    bundle: Option<PathBuf>,
    from: Option<PathBuf>,
    /// The run's limit ([`RUN_LIMIT`] when not given).
    limit: Option<Duration>,
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
            "--limit" => {
                let seconds = rest.next().and_then(|v| v.parse::<u64>().ok()).filter(|&v| v > 0);
                let seconds = seconds.ok_or("gpu-check: --limit needs a number of seconds")?;
                o.limit = Some(Duration::from_secs(seconds));
            }
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
    /// The probe's JSON (`gpu_bench --probe`), verbatim.
    probe: Option<String>,
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
            probe: None,
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
             \"ignored\": {} }},\n  \"steps\": [\n{}\n  ],\n  \"probe\": {},\n  \
             \"bench\": {},\n  \"comparison\": {},\n  \"seconds\": {:.1}\n}}\n",
            self.ok,
            self.complete,
            self.from_bundle,
            json_string(&self.log.to_string_lossy()),
            json_string(&self.ld_library_path),
            c.passed,
            c.failed,
            c.ignored,
            steps.join(",\n"),
            self.probe.as_deref().unwrap_or("null"),
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

    /// Record `name` as not run: the run's time was spent before it.
    fn skip(&mut self, name: &str) -> Result<(), String> {
        self.steps.push(StepRecord {
            name: name.to_string(),
            timed_out: true,
            failures: "skipped: the run's time limit was reached before this step".into(),
            ..StepRecord::default()
        });
        self.write()
    }

    /// [`Self::step`] within what is left of the run (`left`): at most `limit`, or skipped.
    #[allow(clippy::too_many_arguments, reason = "a step's description")]
    fn step_within(
        &mut self,
        log: &Log,
        name: &str,
        (program, args): (&str, &[&str]),
        env: &[(String, String)],
        limit: Duration,
        left: Duration,
    ) -> Result<Option<Outcome>, String> {
        if left < Duration::from_secs(1) {
            self.skip(name)?;
            return Ok(None);
        }
        self.step(log, name, program, args, env, limit.min(left)).map(Some)
    }
}

/// One test binary to run: its name in the report, how to start it, its own limit.
#[derive(Debug, PartialEq)]
struct TestRun {
    name: String,
    program: String,
    args: Vec<String>,
    limit: Duration,
}

/// Every trial on one thread: the trials share one CUDA context (see `kda_cuda_trials`).
const ONE_THREAD: [&str; 2] = ["--test-threads", "1"];

/// cargo's target name of a test binary (`conformance-0123abcd` → `conformance`).
fn target_of(file: &str) -> &str {
    file.rsplit_once('-').map_or(file, |(target, _)| target)
}

/// The bundle's test binaries in [`TEST_ORDER`], then any others by name.
fn bundle_tests(files: Vec<PathBuf>) -> Vec<TestRun> {
    let rank = |p: &PathBuf| {
        let file = p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let i = TEST_ORDER.iter().position(|(t, _)| *t == target_of(&file));
        (i.unwrap_or(TEST_ORDER.len()), file)
    };
    let mut files: Vec<((usize, String), PathBuf)> =
        files.into_iter().map(|p| (rank(&p), p)).collect();
    files.sort();
    files
        .into_iter()
        .map(|((i, file), path)| TestRun {
            name: format!("test {file}"),
            program: path.to_string_lossy().into_owned(),
            args: ONE_THREAD.map(String::from).into(),
            limit: TEST_ORDER.get(i).map_or(OTHER_TEST_LIMIT, |(_, limit)| *limit),
        })
        .collect()
}

/// The test targets through cargo, in [`TEST_ORDER`].
fn cargo_tests(cargo: &str) -> Vec<TestRun> {
    TEST_ORDER
        .iter()
        .map(|&(target, limit)| {
            let mut args: Vec<String> = vec!["test".into()];
            args.extend(FEATURES.iter().map(|s| s.to_string()));
            match target {
                "kda_cuda" => args.push("--lib".into()),
                t => args.extend(["--test".to_string(), t.to_string()]),
            }
            args.push("--".into());
            args.extend(ONE_THREAD.map(String::from));
            TestRun { name: format!("test {target}"), program: cargo.to_string(), args, limit }
        })
        .collect()
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
    let report = run(&options, &out, &cargo(), true)?;
    println!("{}", report.json());
    eprintln!(
        "gpu-check: report in {}, log in {} ({:.0} s)",
        out.display(),
        report.log.display(),
        report.start.elapsed().as_secs_f64()
    );
    if report.ok { Ok(()) } else { Err("gpu-check (see the report)".into()) }
}

/// The steps (see the module docs), the report at `out` rewritten after each.
fn run(options: &Options, out: &Path, cargo: &str, echo: bool) -> Result<Report, String> {
    let out_dir = out.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(out_dir)
        .map_err(|e| format!("gpu-check: {}: {e}", out_dir.display()))?;
    let log_path = out_dir.join("gpu-check.log");
    let log = Log::create(&log_path, echo)?;
    let library_path = cuda_library_path();
    let mut env = vec![("LD_LIBRARY_PATH".to_string(), library_path.clone())];
    if let Some(dir) = &options.from {
        env.push(("KDA_CUDA_CUBIN_DIR".into(), dir.join("cubins").to_string_lossy().into()));
    }
    let mut report = Report::new(out.to_path_buf(), log_path, options.from.is_some(), library_path);
    report.write()?;

    let built = match &options.from {
        Some(_) => true,
        None => {
            let mut build = vec!["build", "--tests", "--examples"];
            build.extend(FEATURES);
            report.step(&log, "build", cargo, &build, &env, BUILD_LIMIT)?.ok
        }
    };
    if !built {
        return finish(report);
    }
    let deadline = Instant::now() + options.limit.unwrap_or(RUN_LIMIT);
    let left = || deadline.saturating_duration_since(Instant::now());
    let bench_exe = bench_program(options, cargo);
    let bench = |extra: &[&str]| {
        let mut args = bench_exe.1.clone();
        args.extend(extra.iter().map(|s| s.to_string()));
        args
    };

    // What loaded, first: a backend that cannot start makes everything after it moot.
    let probe_path = out.with_file_name("gpu-probe.json");
    let _ = std::fs::remove_file(&probe_path);
    let probe_args = bench(&["--probe", "--out", &probe_path.to_string_lossy()]);
    let probe_args: Vec<&str> = probe_args.iter().map(String::as_str).collect();
    let program = (bench_exe.0.as_str(), probe_args.as_slice());
    report.step_within(&log, "probe", program, &env, PROBE_LIMIT, left())?;
    report.probe = read_json(&probe_path);
    report.write()?;

    let tests = match &options.from {
        Some(dir) => bundle_tests(list(&dir.join("tests"))?),
        None => cargo_tests(cargo),
    };
    for t in tests {
        let args: Vec<&str> = t.args.iter().map(String::as_str).collect();
        report.step_within(&log, &t.name, (&t.program, &args), &env, t.limit, left())?;
    }

    let bench_path = out.with_file_name("gpu-bench.json");
    let _ = std::fs::remove_file(&bench_path);
    let bench_out = bench_path.to_string_lossy().into_owned();
    let mut bench_args = vec!["--out", bench_out.as_str()];
    if options.quick {
        bench_args.push("--quick");
    }
    let bench_args = bench(&bench_args);
    let bench_args: Vec<&str> = bench_args.iter().map(String::as_str).collect();
    let program = (bench_exe.0.as_str(), bench_args.as_slice());
    report.step_within(&log, "bench", program, &env, BENCH_LIMIT, left())?;
    report.bench = read_json(&bench_path);
    report.write()?;

    let limit = COMPARE_LIMIT.min(left());
    if limit < Duration::from_secs(1) {
        report.skip("compare")?;
        return finish(report);
    }
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
        limit,
        request_limits: peers::REQUEST_LIMITS,
    };
    let compared = peers::compare(&log, &setup, &mut |so_far| {
        report.comparison = Some(so_far.json.clone());
        let _ = report.write();
    });
    let (ok, failures) = match &compared {
        Ok(c) => (c.complete, c.note.clone()),
        Err(e) => (false, e.clone()),
    };
    if let Ok(c) = compared {
        report.comparison = Some(c.json);
    }
    report.steps.push(StepRecord {
        name: "compare".into(),
        ok,
        timed_out: !ok && compare_start.elapsed() >= limit,
        seconds: compare_start.elapsed().as_secs_f64(),
        failures,
        ..StepRecord::default()
    });
    report.write()?;
    finish(report)
}

/// The report's verdict, written: every step passed, no trial skipped, some passed.
fn finish(mut report: Report) -> Result<Report, String> {
    let counts = report.counts();
    report.ok = report.steps.iter().all(|s| s.ok) && counts.ignored == 0 && counts.passed > 0;
    report.complete = true;
    report.write()?;
    Ok(report)
}

/// A JSON file's text, when there is one.
fn read_json(path: &Path) -> Option<String> {
    std::fs::read_to_string(path).ok().filter(|t| !t.trim().is_empty())
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
         --from {0} --out $OUT/gpu-check.json --limit 360 (with a minute more for the call's \
         own limit; docs/cuda.md, the first run)",
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

/// The libraries the backend opens, each soname on its own: a folder holding CUDA 13's does
/// not stand in for CUDA 12's (kda's NVRTC search takes CUDA 12's first, its cuBLAS search
/// CUDA 13's; either may be the one a machine can use).
const LIBRARIES: [&str; 6] = [
    "libcublas.so.13",
    "libcublas.so.12",
    "libcublasLt.so.13",
    "libcublasLt.so.12",
    "libnvrtc.so.12",
    "libnvrtc.so.13",
];

/// `LD_LIBRARY_PATH` extended with the directories that hold the libraries the backend opens,
/// so a machine that has them anywhere usual runs the backend (the backend searches the same
/// places itself, `kda_cuda::libs`; children started here find them on the loader's path).
fn cuda_library_path() -> String {
    let existing = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
    library_path(&existing, &candidate_dirs())
}

/// Where toolkits, the PyPI wheels and `.ci/run`'s NVRTC cache put the libraries.
fn candidate_dirs() -> Vec<PathBuf> {
    let env = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty()).map(PathBuf::from);
    let mut candidates: Vec<PathBuf> =
        ["CUDA_HOME", "CUDA_PATH"].iter().filter_map(|v| env(v).map(|d| d.join("lib64"))).collect();
    candidates.extend(
        [
            "/usr/local/cuda/lib64",
            "/usr/local/cuda/targets/x86_64-linux/lib",
            "/usr/lib/x86_64-linux-gnu",
        ]
        .map(PathBuf::from),
    );
    let mut site: Vec<PathBuf> = python_site_packages();
    site.extend(env("KDA_NVRTC_DIR"));
    site.extend(env("XDG_CACHE_HOME").map(|d| d.join("kda/nvrtc")));
    site.extend(env("HOME").map(|d| d.join(".cache/kda/nvrtc")));
    for s in site {
        candidates.extend(wheel_lib_dirs(&s));
    }
    candidates
}

/// `existing` (a `LD_LIBRARY_PATH`) with, for each of [`LIBRARIES`] none of its folders holds,
/// the first of `candidates` that holds it appended.
fn library_path(existing: &str, candidates: &[PathBuf]) -> String {
    let mut dirs: Vec<PathBuf> =
        existing.split(':').filter(|d| !d.is_empty()).map(PathBuf::from).collect();
    for lib in LIBRARIES {
        let here = |d: &PathBuf| d.join(lib).exists();
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
    // CUDA 13's wheels (`nvidia-cublas`, `nvidia-cuda-nvrtc`) share `nvidia/cu13/lib`; CUDA
    // 12's (`nvidia-cublas-cu12`, `nvidia-cuda-nvrtc-cu12`) have a folder each.
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
        let args: Vec<String> = ["--from", "b", "--quick", "--out", "r.json", "--limit", "300"]
            .map(String::from)
            .into();
        let o = parse(&args).unwrap();
        assert_eq!((o.from, o.quick, o.out), (Some("b".into()), true, Some("r.json".into())));
        assert_eq!(o.limit, Some(Duration::from_secs(300)));
        assert!(parse(&["--limit".to_string(), "soon".to_string()]).is_err());
        assert!(parse(&["--bogus".to_string()]).is_err());
        assert!(parse(&["--out".to_string()]).is_err());
    }

    /// CUDA 12's NVRTC folder is added though a folder on the path already holds CUDA 13's
    /// (and the other way round), and CUDA 13's cuBLAS folder for the libraries it holds.
    #[test]
    fn library_path_adds_cuda_12_and_13_folders_each() {
        let root = std::env::temp_dir().join(format!("xtask-libpath-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let (on_path, site) = (root.join("on-path"), root.join("site"));
        let (cu13, cu12) = (site.join("nvidia/cu13/lib"), site.join("nvidia/cuda_nvrtc/lib"));
        for (dir, libs) in [
            (&on_path, &["libnvrtc.so.13"][..]),
            (&cu13, &["libcublas.so.13", "libcublasLt.so.13", "libnvrtc.so.13"][..]),
            (&cu12, &["libnvrtc.so.12"][..]),
        ] {
            std::fs::create_dir_all(dir).unwrap();
            for lib in libs {
                std::fs::write(dir.join(lib), b"").unwrap();
            }
        }
        let shown = |dirs: &[&PathBuf]| {
            dirs.iter().map(|d| d.to_string_lossy().into_owned()).collect::<Vec<_>>().join(":")
        };
        let existing = on_path.to_string_lossy().into_owned();
        let path = library_path(&existing, &wheel_lib_dirs(&site));
        assert_eq!(path, shown(&[&on_path, &cu13, &cu12]));
        // Only CUDA 12's NVRTC on the path: CUDA 13's folder still comes for cuBLAS and NVRTC.
        let path = library_path(&cu12.to_string_lossy(), &wheel_lib_dirs(&site));
        assert_eq!(path, shown(&[&cu12, &cu13]));
        let _ = std::fs::remove_dir_all(root);
    }

    /// The device run's order: the probe, then the test binaries by what they tell (unit,
    /// conformance, device, import, then any other), each on one thread under its own limit.
    #[test]
    fn test_binaries_run_in_order_on_one_thread() {
        let files = ["zzz-9", "import-1", "device-2", "kda_cuda-3", "conformance-4"]
            .map(|f| PathBuf::from("/b/tests").join(f));
        let runs = bundle_tests(files.into());
        let names: Vec<&str> = runs.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "test kda_cuda-3",
                "test conformance-4",
                "test device-2",
                "test import-1",
                "test zzz-9"
            ]
        );
        assert!(runs.iter().all(|r| r.args == ["--test-threads", "1"]), "{runs:?}");
        assert_eq!(runs[1].limit, Duration::from_secs(100));
        assert_eq!(runs[4].limit, OTHER_TEST_LIMIT);
        let cargo = cargo_tests("cargo");
        assert_eq!(
            cargo[0].args[cargo[0].args.len() - 4..],
            ["--lib", "--", "--test-threads", "1"]
        );
        assert!(cargo[1].args.windows(2).any(|w| w == ["--test", "conformance"]));
        let total: Duration =
            TEST_ORDER.iter().map(|(_, l)| *l).sum::<Duration>() + PROBE_LIMIT + BENCH_LIMIT;
        assert!(total < RUN_LIMIT, "the probe, tests and bench fit the run with time to compare");
    }

    /// A whole run from a stand-in bundle: the steps in order, each test binary told to use one
    /// thread, the probe's JSON in the report, the comparison's rounds in it too, and a run
    /// limit that leaves no time for the last steps records them as skipped.
    #[test]
    fn a_run_from_a_bundle_writes_the_probe_first_and_keeps_to_its_limit() {
        let dir = std::env::temp_dir().join(format!("xtask-run-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("tests")).unwrap();
        let script = |path: PathBuf, body: &str| {
            std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
            let _ = Command::new("chmod").arg("+x").arg(&path).status();
        };
        let passed = "echo \"args: $*\"; echo 'test result: ok. 2 passed; 0 failed; 0 ignored; \
                      0 measured; 0 filtered out'";
        for name in ["device-2", "kda_cuda-3", "conformance-4"] {
            script(dir.join("tests").join(name), passed);
        }
        script(
            dir.join("gpu_bench"),
            "case \"$1\" in\n\
             --probe) echo '{\"device\": {\"name\": \"stand-in\"}}' > \"$3\";;\n\
             --serve) echo '@ready gemm chunk mx_gemm quant schedule layer_prefill layer_decode'; \
             while read id case target; do echo \"@result $id $case 1.5\"; done;;\n\
             --out) sleep 3; echo '{\"bench\": 1}' > \"$2\";;\n\
             esac",
        );
        let out = dir.join("out/gpu-check.json");
        let options = Options {
            from: Some(dir.clone()),
            quick: true,
            limit: Some(Duration::from_secs(60)),
            ..Options::default()
        };
        let report = run(&options, &out, "cargo", false).unwrap();
        let names: Vec<&str> = report.steps.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(
            names,
            ["probe", "test kda_cuda-3", "test conformance-4", "test device-2", "bench", "compare"]
        );
        let json = std::fs::read_to_string(&out).unwrap();
        assert!(json.contains("\"probe\": {\"device\": {\"name\": \"stand-in\"}}"), "{json}");
        assert!(json.contains("\"bench\": {\"bench\": 1}"), "{json}");
        assert!(json.contains("\"rounds\": 3, \"rounds_planned\": 3"), "{json}");
        let log = std::fs::read_to_string(dir.join("out/gpu-check.log")).unwrap();
        assert_eq!(log.matches("args: --test-threads 1").count(), 3, "{log}");
        // Two seconds: the probe and the tests run, the bench is cut short, the comparison
        // is skipped.
        let options = Options { limit: Some(Duration::from_secs(2)), ..options };
        let report = run(&options, &out, "cargo", false).unwrap();
        let bench = report.steps.iter().find(|s| s.name == "bench").unwrap();
        assert!(bench.timed_out, "{bench:?}");
        let compare = report.steps.iter().find(|s| s.name == "compare").unwrap();
        assert!(compare.failures.starts_with("skipped"), "{compare:?}");
        assert!(!report.ok && report.complete);
        let _ = std::fs::remove_dir_all(dir);
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
