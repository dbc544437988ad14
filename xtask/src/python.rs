//! The Python package's tests: build `crates/kda-py` into a virtual environment with maturin and
//! run its pytest suite.
//!
//! The interpreter is `KDA_PYTHON`, else `.venv/bin/python` at the workspace root; it needs
//! maturin, numpy and pytest (and ml_dtypes for the bf16 tests). Without one the step says why
//! it is skipped, except under CI (`CI` set), where `.ci/run` makes the venv and a missing one
//! is an error: the suite never silently skips there.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use crate::Counts;

/// Find the interpreter, or say why there is none.
pub(crate) fn interpreter(root: &Path) -> Result<PathBuf, String> {
    let python = match std::env::var_os("KDA_PYTHON") {
        Some(p) => PathBuf::from(p),
        None => root.join(".venv/bin/python"),
    };
    if !python.exists() {
        return Err(format!(
            "no Python environment ({} does not exist; set KDA_PYTHON, or make one with \
             `python3 -m venv .venv && .venv/bin/pip install maturin numpy pytest ml_dtypes`)",
            python.display()
        ));
    }
    let probe = Command::new(&python)
        .args(["-c", "import maturin, numpy, pytest"])
        .stderr(Stdio::null())
        .status()
        .map_err(|e| format!("cannot run {}: {e}", python.display()))?;
    if !probe.success() {
        return Err(format!(
            "{} lacks maturin, numpy or pytest (`{} -m pip install maturin numpy pytest ml_dtypes`)",
            python.display(),
            python.display()
        ));
    }
    Ok(python)
}

/// `maturin develop`: the `kda` package, built in release, into `python`'s venv.
pub(crate) fn develop(python: &Path, root: &Path) -> Result<(), String> {
    // The venv is the interpreter's: `bin/python` sits in it.
    let venv = python.parent().and_then(Path::parent).unwrap_or(root);
    let manifest = root.join("crates/kda-py/Cargo.toml");
    let manifest = manifest.to_string_lossy();
    crate::step(
        "maturin",
        &python.to_string_lossy(),
        &["-m", "maturin", "develop", "--release", "--quiet", "-m", &manifest],
        &[("VIRTUAL_ENV", &venv.to_string_lossy())],
    )
}

/// `maturin develop` + `pytest`, adding pytest's counts to `counts`.
pub(crate) fn pytest(counts: &mut Counts) -> Result<(), String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap_or(Path::new("."));
    let python = match interpreter(root) {
        Ok(p) => p,
        Err(why) if std::env::var_os("CI").is_none() => {
            eprintln!("==> pytest: skipped: {why}");
            return Ok(());
        }
        Err(why) => return Err(format!("pytest: {why} (CI must run the Python tests)")),
    };
    develop(&python, root)?;
    let tests = root.join("crates/kda-py/tests");
    eprintln!("==> pytest: {} -m pytest {}", python.display(), tests.display());
    let start = Instant::now();
    let output = Command::new(&python)
        .args(["-m", "pytest", "-q", "-p", "no:cacheprovider"])
        .arg(&tests)
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("pytest: cannot start {}: {e}", python.display()))?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    print!("{stdout}");
    eprintln!("    pytest took {:.1} s", start.elapsed().as_secs_f64());
    if let Some(summary) =
        stdout.lines().rev().find(|l| l.contains(" passed") || l.contains(" failed"))
    {
        add_pytest_counts(counts, summary);
    }
    // Exit code 5 (no tests collected) is a failure too: the suite must run.
    if output.status.success() { Ok(()) } else { Err(format!("pytest ({})", output.status)) }
}

/// Add `38 passed, 1 skipped, 2 failed in 3.19s` (possibly between `=` rules) to the totals.
fn add_pytest_counts(counts: &mut Counts, summary: &str) {
    for part in summary.trim_matches(|c: char| c == '=' || c.is_whitespace()).split(',') {
        let mut words = part.split_whitespace();
        if let (Some(n), Some(what)) = (words.next(), words.next()) {
            let Ok(n) = n.parse::<u64>() else { continue };
            match what {
                "passed" => counts.passed += n,
                "failed" | "error" | "errors" => counts.failed += n,
                "skipped" => counts.ignored += n,
                _ => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pytest_summaries_add_up() {
        let mut c = Counts::default();
        add_pytest_counts(&mut c, "38 passed, 1 skipped in 3.19s");
        add_pytest_counts(&mut c, "===== 2 failed, 5 passed, 1 error in 0.5s =====");
        assert_eq!((c.passed, c.failed, c.ignored), (43, 3, 1));
    }
}
