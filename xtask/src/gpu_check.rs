//! `cargo xtask gpu-check`: the CUDA backend on a real GPU, in one run sized for a lent H200
//! (under 8 minutes), ending in one JSON report:
//!
//! 1. build kda-cuda (feature `cuda`) with its tests and the benchmark driver, release;
//! 2. its tests: unit, NVRTC compile check, and the whole conformance suite on the device (a
//!    run that skips any conformance trial, e.g. for want of a device, fails);
//! 3. `examples/gpu_bench`: the overlapped projection under capture (valid, bit-identical to
//!    serial, both matrix-overlap policies) and CUDA-event timings (projection at K3 TP8,
//!    chunked prefill tokens/s, decode latency).
//!
//! A GPU machine without cargo or network takes a bundle made elsewhere:
//! `cargo xtask gpu-check --bundle DIR` builds the binaries, the kernels' CUBINs (NVRTC only, no
//! GPU) and a copy of this tool into `DIR`; there, `DIR/xtask gpu-check --from DIR` runs steps 2
//! and 3 from it. The report goes to `--out PATH`, else `$OUT/gpu-check.json`, else
//! `target/gpu-check.json`. `--quick` shortens the benchmarks.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use crate::{Counts, add_counts, cargo};

const FEATURES: [&str; 5] = ["-p", "kda-cuda", "--features", "cuda", "--release"];

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
    let library_path = cuda_library_path();
    let mut env = vec![("LD_LIBRARY_PATH".to_string(), library_path.clone())];
    if let Some(dir) = &options.from {
        env.push(("KDA_CUDA_CUBIN_DIR".into(), dir.join("cubins").to_string_lossy().into()));
    }
    let start = Instant::now();
    let cargo = cargo();

    let (build_ok, build_log) = match &options.from {
        Some(_) => (true, String::new()),
        None => {
            let mut build = vec!["build", "--tests", "--examples"];
            build.extend(FEATURES);
            run(&cargo, &build, &env)?
        }
    };
    let build_s = start.elapsed().as_secs_f64();

    let mut test_log = String::new();
    let mut tests_ok = build_ok;
    if build_ok {
        match &options.from {
            Some(dir) => {
                for exe in list(&dir.join("tests"))? {
                    let (ok, log) = run(&exe.to_string_lossy(), &[], &env)?;
                    tests_ok &= ok;
                    test_log.push_str(&log);
                }
            }
            None => {
                let mut test = vec!["test"];
                test.extend(FEATURES);
                let (ok, log) = run(&cargo, &test, &env)?;
                tests_ok = ok;
                test_log = log;
            }
        }
    }
    let mut counts = Counts::default();
    for line in test_log.lines() {
        if let Some(summary) = line.strip_prefix("test result: ") {
            add_counts(&mut counts, summary);
        }
    }
    let test_s = start.elapsed().as_secs_f64() - build_s;

    let bench_path = out.with_file_name("gpu-bench.json");
    let bench_out = bench_path.to_string_lossy().into_owned();
    let mut bench_args = vec!["--out", &bench_out];
    if options.quick {
        bench_args.push("--quick");
    }
    let bench_ok = build_ok
        && match &options.from {
            Some(dir) => run(&dir.join("gpu_bench").to_string_lossy(), &bench_args, &env)?.0,
            None => {
                let mut bench = vec!["run"];
                bench.extend(FEATURES);
                bench.extend(["--example", "gpu_bench", "--"]);
                bench.extend(bench_args);
                run(&cargo, &bench, &env)?.0
            }
        };
    let bench_json = std::fs::read_to_string(&bench_path).unwrap_or_else(|_| "null".into());
    let total_s = start.elapsed().as_secs_f64();

    let ok = build_ok && tests_ok && bench_ok && counts.ignored == 0 && counts.passed > 0;
    let report = format!(
        "{{\n  \"ok\": {ok},\n  \"from_bundle\": {},\n  \"ld_library_path\": {},\n  \
         \"build\": {{ \"ok\": {build_ok}, \"seconds\": {build_s:.1} }},\n  \
         \"tests\": {{ \"ok\": {tests_ok}, \"passed\": {}, \"failed\": {}, \"ignored\": {}, \
         \"seconds\": {test_s:.1}, \"failures\": {} }},\n  \"bench\": {bench_json},\n  \
         \"seconds\": {total_s:.1}\n}}\n",
        options.from.is_some(),
        json_string(&library_path),
        counts.passed,
        counts.failed,
        counts.ignored,
        json_string(&failure_lines(&test_log, &build_log)),
    );
    if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| format!("gpu-check: {}: {e}", dir.display()))?;
    }
    std::fs::write(&out, &report).map_err(|e| format!("gpu-check: {}: {e}", out.display()))?;
    println!("{report}");
    eprintln!("gpu-check: report in {} ({total_s:.0} s)", out.display());
    if ok { Ok(()) } else { Err("gpu-check (see the report)".into()) }
}

/// Build everything a GPU machine without cargo needs into `dir`: `tests/` (the kda-cuda test
/// binaries), `gpu_bench`, `cubins/` (sm_90, compiled here with NVRTC) and `xtask`.
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
        run(&dir.join("gpu_bench").to_string_lossy(), &["--write-cubins", &cubins], &env)?;
    if !ok {
        return Err(format!(
            "gpu-check --bundle: compiling the CUBINs failed (is libnvrtc on LD_LIBRARY_PATH?):\n{log}"
        ));
    }
    eprintln!(
        "gpu-check: bundle in {}; on the GPU machine run: {}/xtask gpu-check --from {0}",
        dir.display(),
        dir.display()
    );
    Ok(())
}

/// The `"executable"` paths of cargo's JSON messages, each with whether it is a test binary.
fn executables(json_lines: &str) -> Vec<(bool, PathBuf)> {
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

/// `LD_LIBRARY_PATH` extended with the directories that hold the libraries the backend opens
/// (cuBLAS, NVRTC) where toolkits and the PyPI wheels put them, so a machine that has them
/// anywhere usual runs the backend.
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
        candidates.extend(
            ["cuda_nvrtc", "cublas", "cuda_runtime"].map(|p| s.join("nvidia").join(p).join("lib")),
        );
    }
    for lib in ["libnvrtc.so.12", "libcublas.so.12", "libcublasLt.so.12"] {
        if dirs.iter().any(|d| d.join(lib).exists()) {
            continue;
        }
        if let Some(d) = candidates.iter().find(|d| d.join(lib).exists()) {
            dirs.push(d.clone());
        }
    }
    dirs.iter().map(|d| d.to_string_lossy()).collect::<Vec<_>>().join(":")
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

/// Run `program` with `args` and extra `env`, echoing and keeping its output; whether it
/// succeeded.
fn run(program: &str, args: &[&str], env: &[(String, String)]) -> Result<(bool, String), String> {
    let (ok, log) = run_quiet(program, args, env)?;
    eprint!("{log}");
    Ok((ok, log))
}

fn run_quiet(
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

/// The lines that say what failed (failing tests, panics, compile errors), at most 40.
fn failure_lines(test_log: &str, build_log: &str) -> String {
    let wanted = |l: &&str| {
        l.contains("FAILED")
            || l.contains("panicked")
            || l.starts_with("error")
            || l.ends_with("... ignored")
    };
    let lines: Vec<&str> =
        build_log.lines().chain(test_log.lines()).filter(wanted).take(40).collect();
    lines.join("\n")
}

/// `text` as a JSON string literal.
fn json_string(text: &str) -> String {
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
        let log =
            "test a ... ok\ntest b ... FAILED\nthread 'b' panicked at x\ntest c ... ignored\n";
        assert_eq!(
            failure_lines(log, "error[E0308]: x\nCompiling"),
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
}
