//! `cargo xtask bench`'s peer comparison (`cargo xtask bench peer` alone): `kda.core` against
//! the CPU engine people run Kimi Linear with, llama.cpp, whose KDA core is ggml's
//! `ggml_gated_delta_net` with a per-channel gate.
//!
//! ggml is built from the llama-cpp-python sdist on PyPI (it vendors llama.cpp) at a pinned
//! version, once: the sdist, the build and the small C wrapper `xtask/peer/ggml_kda.c` are
//! cached under `target/peer/`. The build needs the benchmark venv (the Python suite's:
//! `KDA_PYTHON` or `.venv/`, see `python.rs`), pip, a C compiler and cmake (the venv's, from the
//! `cmake` wheel, when none is on the path). `xtask/peer/peer.py` then loads the wrapper and
//! times ggml and `kda.core` alternately, in one process, on the same inputs, and checks the
//! numbers. Never part of `cargo xtask test`: it downloads, and takes minutes.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The llama-cpp-python release whose vendored llama.cpp is compared with.
const LLAMA_CPP_PYTHON: &str = "0.3.36";

/// Build what is missing, then run the comparison.
pub(crate) fn compare() -> Result<(), String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap_or(Path::new("."));
    let python = match crate::python::interpreter(root) {
        Ok(p) => p,
        Err(why) => {
            eprintln!("==> peer comparison: skipped: {why}");
            return Ok(());
        }
    };
    let python_s = python.to_string_lossy().into_owned();
    let cache = root.join("target/peer");
    std::fs::create_dir_all(&cache).map_err(|e| format!("{}: {e}", cache.display()))?;
    let lib = wrapper(&python_s, root, &cache)?;
    crate::python::develop(&python, root)?;
    let script = root.join("xtask/peer/peer.py");
    crate::step(
        "peer comparison (ggml vs kda.core)",
        &python_s,
        &[&script.to_string_lossy(), "--lib", &lib.to_string_lossy()],
        &[],
    )
}

/// `target/peer/libggml_kda.so`: the C wrapper over the ggml built from the sdist, built once.
fn wrapper(python: &str, root: &Path, cache: &Path) -> Result<PathBuf, String> {
    let lib = cache.join(format!("libggml_kda-{LLAMA_CPP_PYTHON}.so"));
    let source = root.join("xtask/peer/ggml_kda.c");
    let fresh = |out: &Path| {
        let modified = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
        matches!((modified(out), modified(&source)), (Some(o), Some(s)) if o >= s)
    };
    if fresh(&lib) {
        eprintln!("==> peer: {} is built", lib.display());
        return Ok(lib);
    }
    let ggml = ggml(python, cache)?;
    let include = ggml.source.join("include");
    let libdir = ggml.libdir.to_string_lossy().into_owned();
    crate::step(
        "peer: C wrapper",
        "cc",
        &[
            "-O2",
            "-shared",
            "-fPIC",
            "-I",
            &include.to_string_lossy(),
            &source.to_string_lossy(),
            "-L",
            &libdir,
            "-lggml",
            "-lggml-base",
            "-lggml-cpu",
            &format!("-Wl,-rpath,{libdir}"),
            "-o",
            &lib.to_string_lossy(),
        ],
        &[],
    )?;
    Ok(lib)
}

/// Where the ggml of the sdist lives: its sources and its built shared libraries.
struct Ggml {
    source: PathBuf,
    libdir: PathBuf,
}

/// Download, unpack and build ggml (shared libraries, the CPU backend for this machine),
/// unless a finished build is cached.
fn ggml(python: &str, cache: &Path) -> Result<Ggml, String> {
    let name = format!("llama_cpp_python-{LLAMA_CPP_PYTHON}");
    let llama = cache.join(&name).join("vendor/llama.cpp");
    let source = llama.join("ggml");
    let build = cache.join(format!("ggml-build-{LLAMA_CPP_PYTHON}"));
    let done = build.join("kda-peer-built");
    if !done.exists() {
        let sdist = cache.join(format!("{name}.tar.gz"));
        if !sdist.exists() {
            // The sdist only: `--no-binary` for this package alone, so pip may take the build
            // backend's own dependencies as wheels to read the sdist's metadata.
            crate::step(
                "peer: download the llama-cpp-python sdist",
                python,
                &[
                    "-m",
                    "pip",
                    "download",
                    "--no-deps",
                    "--no-binary",
                    "llama-cpp-python",
                    &format!("llama-cpp-python=={LLAMA_CPP_PYTHON}"),
                    "-d",
                    &cache.to_string_lossy(),
                ],
                &[],
            )?;
        }
        if !source.exists() {
            crate::step(
                "peer: unpack",
                "tar",
                &["xzf", &sdist.to_string_lossy(), "-C", &cache.to_string_lossy()],
                &[],
            )?;
        }
        let cmake = cmake(python)?;
        let jobs = std::thread::available_parallelism().map_or(2, usize::from).to_string();
        // From llama.cpp's top level (the sdist's ggml alone lacks files its own CMakeLists
        // needs), with everything but ggml switched off; ggml's CPU backend for this machine,
        // on its own thread pool (no OpenMP).
        crate::step(
            "peer: configure ggml",
            &cmake,
            &[
                "-S",
                &llama.to_string_lossy(),
                "-B",
                &build.to_string_lossy(),
                "-DCMAKE_BUILD_TYPE=Release",
                "-DBUILD_SHARED_LIBS=ON",
                "-DGGML_NATIVE=ON",
                "-DGGML_OPENMP=OFF",
                "-DGGML_CCACHE=OFF",
                "-DLLAMA_BUILD_COMMON=OFF",
                "-DLLAMA_BUILD_TESTS=OFF",
                "-DLLAMA_BUILD_EXAMPLES=OFF",
                "-DLLAMA_BUILD_SERVER=OFF",
                "-DLLAMA_BUILD_TOOLS=OFF",
                "-DLLAMA_CURL=OFF",
            ],
            &[],
        )?;
        crate::step(
            "peer: build ggml",
            &cmake,
            &["--build", &build.to_string_lossy(), "-j", &jobs, "--target", "ggml", "ggml-cpu"],
            &[],
        )?;
        std::fs::write(&done, LLAMA_CPP_PYTHON).map_err(|e| format!("{}: {e}", done.display()))?;
    }
    let libdir = find(&build, "libggml-base.so")
        .ok_or_else(|| format!("peer: no libggml-base.so under {}", build.display()))?;
    Ok(Ggml { source, libdir })
}

/// cmake from the path, else the venv's (installing the `cmake` wheel there if needed).
fn cmake(python: &str) -> Result<String, String> {
    let works =
        |c: &str| Command::new(c).arg("--version").output().is_ok_and(|o| o.status.success());
    if works("cmake") {
        return Ok("cmake".into());
    }
    let venv_cmake = Path::new(python).with_file_name("cmake");
    let venv_cmake = venv_cmake.to_string_lossy().into_owned();
    if !works(&venv_cmake) {
        crate::step("peer: cmake wheel", python, &["-m", "pip", "install", "cmake"], &[])?;
    }
    Ok(venv_cmake)
}

/// The directory under `dir` holding a file named `name`.
fn find(dir: &Path, name: &str) -> Option<PathBuf> {
    for entry in std::fs::read_dir(dir).ok()?.flatten() {
        let path = entry.path();
        if path.file_name().is_some_and(|n| n == name) {
            return Some(dir.to_path_buf());
        }
        if path.is_dir()
            && let Some(found) = find(&path, name)
        {
            return Some(found);
        }
    }
    None
}
