//! Where the shared libraries the backend opens at run time are looked for.
//!
//! cudarc opens the driver (`libcuda.so.1`) itself, but its candidate names stop at `.so.12`:
//! CUDA 13's cuBLAS and NVRTC (`libcublas.so.13`, `libnvrtc.so.13`, e.g. from the
//! `nvidia-cublas` and `nvidia-cuda-nvrtc` wheels' `nvidia/cu13/lib`) would never be found.
//! kda therefore opens cuBLAS (`device::cublas`) and NVRTC (`nvrtc`) itself, by name through the
//! loader's own path first, then by full path in the directories [`search_dirs`] lists; a miss
//! names every name and directory it tried.

use std::fmt;
use std::path::{Path, PathBuf};

/// cuBLAS sonames, newest first (the driver of CUDA 13 runs both).
pub const CUBLAS_NAMES: [&str; 3] = ["libcublas.so.13", "libcublas.so.12", "libcublas.so"];

/// An environment variable naming the cuBLAS library file to open, before any search.
pub const CUBLAS_VAR: &str = "KDA_CUBLAS";

/// NVRTC sonames in the order they are tried, each in every directory before the next:
/// CUDA 12's first (its CUBINs load on the drivers of CUDA 12 and 13; CUDA 13's need a CUDA 13
/// driver), then CUDA 13's (`nvidia-cuda-nvrtc`), then an unversioned link.
pub const NVRTC_NAMES: [&str; 3] = ["libnvrtc.so.12", "libnvrtc.so.13", "libnvrtc.so"];

/// An environment variable naming the NVRTC library file to open, before any search.
pub const NVRTC_VAR: &str = "KDA_NVRTC";

/// The folder `.ci/run` installs the NVRTC wheels into (`--target`): `$KDA_NVRTC_DIR`, else
/// `$XDG_CACHE_HOME/kda/nvrtc`, else `~/.cache/kda/nvrtc`; searched like a site-packages.
pub fn nvrtc_cache_dir() -> Option<PathBuf> {
    let env = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty()).map(PathBuf::from);
    env("KDA_NVRTC_DIR")
        .or_else(|| env("XDG_CACHE_HOME").map(|d| d.join("kda/nvrtc")))
        .or_else(|| env("HOME").map(|d| d.join(".cache/kda/nvrtc")))
}

/// The library directories of the usual places, in order: `LD_LIBRARY_PATH`, `CUDA_HOME` /
/// `CUDA_PATH`, the toolkit's default prefix, the distribution's, and the `lib` folders of the
/// NVIDIA pip wheels (`nvidia/cu13/lib`, `nvidia/cublas/lib`, …) under every Python
/// site-packages directory found from `VIRTUAL_ENV`, `CONDA_PREFIX`, `PYTHONPATH`, the user's
/// and the system's Python prefixes.
pub fn search_dirs() -> Vec<PathBuf> {
    let env = |name: &str| std::env::var_os(name).map(PathBuf::from);
    let mut dirs: Vec<PathBuf> = std::env::var_os("LD_LIBRARY_PATH")
        .map(|p| std::env::split_paths(&p).filter(|d| !d.as_os_str().is_empty()).collect())
        .unwrap_or_default();
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(root) = env(var) {
            dirs.push(root.join("lib64"));
            dirs.push(root.join("lib"));
        }
    }
    dirs.extend(
        [
            "/usr/local/cuda/lib64",
            "/usr/local/cuda/targets/x86_64-linux/lib",
            "/usr/lib/x86_64-linux-gnu",
            "/usr/lib64",
        ]
        .map(PathBuf::from),
    );
    let mut prefixes: Vec<PathBuf> =
        ["VIRTUAL_ENV", "CONDA_PREFIX"].iter().filter_map(|v| env(v)).collect();
    if let Some(home) = env("HOME") {
        prefixes.push(home.join(".local"));
    }
    prefixes.extend(["/usr/local", "/usr", "/opt/conda"].map(PathBuf::from));
    let mut site: Vec<PathBuf> = std::env::var_os("PYTHONPATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    site.extend(nvrtc_cache_dir());
    for prefix in prefixes {
        for python in subdirs(&prefix.join("lib"), "python3") {
            site.push(python.join("site-packages"));
            site.push(python.join("dist-packages"));
        }
    }
    for s in site {
        dirs.extend(wheel_lib_dirs(&s));
    }
    dirs.dedup();
    dirs
}

/// The `lib` folders of the NVIDIA wheels under one site-packages directory: CUDA 13's
/// unified `nvidia/cu13/lib` (and any `nvidia/cu*/lib`), then the per-library folders of the
/// CUDA 12 wheels.
pub fn wheel_lib_dirs(site_packages: &Path) -> Vec<PathBuf> {
    let nvidia = site_packages.join("nvidia");
    let mut dirs: Vec<PathBuf> =
        subdirs(&nvidia, "cu").into_iter().map(|d| d.join("lib")).collect();
    dirs.sort_by(|a, b| b.cmp(a));
    dirs.extend(["cublas", "cuda_nvrtc", "cuda_runtime"].map(|p| nvidia.join(p).join("lib")));
    dirs
}

/// The subdirectories of `dir` whose names start with `prefix` (none if `dir` is unreadable).
fn subdirs(dir: &Path, prefix: &str) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut found: Vec<PathBuf> = entries
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with(prefix))
        .map(|e| e.path())
        .filter(|p| p.is_dir())
        .collect();
    found.sort();
    found
}

/// A library none of whose names was found in any of the directories searched.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NotFound {
    pub names: Vec<String>,
    pub dirs: Vec<PathBuf>,
}

impl fmt::Display for NotFound {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "none of {} was found in the loader's path", self.names.join(", "))?;
        if self.dirs.is_empty() {
            return Ok(());
        }
        let dirs: Vec<String> = self.dirs.iter().map(|d| d.display().to_string()).collect();
        write!(f, " nor in {}", dirs.join(", "))
    }
}

/// The first file named one of `names` in `dirs`: directory by directory (so the order of
/// `LD_LIBRARY_PATH` wins), the newest name first within one.
pub fn find(names: &[&str], dirs: &[PathBuf]) -> Result<PathBuf, NotFound> {
    dirs.iter().flat_map(|d| names.iter().map(move |n| d.join(n))).find(|p| p.is_file()).ok_or_else(
        || NotFound { names: names.iter().map(|n| n.to_string()).collect(), dirs: dirs.to_vec() },
    )
}

/// The first file named one of `names` in `dirs`, name by name (each name in every directory
/// before the next name): where the version matters more than the directory (NVRTC).
pub fn find_by_name(names: &[&str], dirs: &[PathBuf]) -> Result<PathBuf, NotFound> {
    names.iter().flat_map(|n| dirs.iter().map(move |d| d.join(n))).find(|p| p.is_file()).ok_or_else(
        || NotFound { names: names.iter().map(|n| n.to_string()).collect(), dirs: dirs.to_vec() },
    )
}

/// The cuBLASLt file beside a cuBLAS file of the same major version (`libcublas.so.13` →
/// `libcublasLt.so.13`), which cuBLAS needs loaded first when its folder is not on the
/// loader's path.
pub fn companion_lt(cublas: &Path) -> Option<PathBuf> {
    let name = cublas.file_name()?.to_str()?;
    let version = name.strip_prefix("libcublas.so")?;
    let lt = cublas.with_file_name(format!("libcublasLt.so{version}"));
    lt.is_file().then_some(lt)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh empty directory under the system's temp dir.
    fn scratch_dir(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("kda-cuda-libs-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create a scratch directory");
        dir
    }

    #[test]
    fn a_cuda_13_cublas_in_a_wheel_folder_is_found() {
        let root = scratch_dir("wheel");
        let lib = root.join("nvidia/cu13/lib");
        std::fs::create_dir_all(&lib).expect("mkdir");
        std::fs::write(lib.join("libcublas.so.13"), b"").expect("write");
        std::fs::write(lib.join("libcublasLt.so.13"), b"").expect("write");
        let dirs = wheel_lib_dirs(&root);
        assert_eq!(dirs[0], lib, "{dirs:?}");
        let found = find(&CUBLAS_NAMES, &dirs).expect("found");
        assert_eq!(found, lib.join("libcublas.so.13"));
        assert_eq!(companion_lt(&found), Some(lib.join("libcublasLt.so.13")));
        let _ = std::fs::remove_dir_all(root);
    }

    #[test]
    fn directories_come_first_then_the_newest_name() {
        let root = scratch_dir("order");
        let (first, second) = (root.join("first"), root.join("second"));
        for (dir, name) in [(&first, "libcublas.so.12"), (&second, "libcublas.so.13")] {
            std::fs::create_dir_all(dir).expect("mkdir");
            std::fs::write(dir.join(name), b"").expect("write");
        }
        let dirs = vec![first.clone(), second.clone()];
        assert_eq!(find(&CUBLAS_NAMES, &dirs), Ok(first.join("libcublas.so.12")));
        std::fs::write(first.join("libcublas.so.13"), b"").expect("write");
        assert_eq!(find(&CUBLAS_NAMES, &dirs), Ok(first.join("libcublas.so.13")));
        assert_eq!(companion_lt(&first.join("libcublas.so.13")), None, "no Lt beside it");
        let _ = std::fs::remove_dir_all(root);
    }

    /// Both NVRTC wheels in one site-packages (CUDA 13's `nvidia/cu13/lib` listed first, as
    /// for cuBLAS): CUDA 12's library is taken; with only CUDA 13's, that one.
    #[test]
    fn nvrtc_of_cuda_12_or_13_is_found_in_the_wheels_folders() {
        let root = scratch_dir("nvrtc");
        let (cu13, cu12) = (root.join("nvidia/cu13/lib"), root.join("nvidia/cuda_nvrtc/lib"));
        std::fs::create_dir_all(&cu13).expect("mkdir");
        std::fs::write(cu13.join("libnvrtc.so.13"), b"").expect("write");
        let dirs = wheel_lib_dirs(&root);
        assert_eq!(find_by_name(&NVRTC_NAMES, &dirs), Ok(cu13.join("libnvrtc.so.13")));
        std::fs::create_dir_all(&cu12).expect("mkdir");
        std::fs::write(cu12.join("libnvrtc.so.12"), b"").expect("write");
        assert_eq!(find_by_name(&NVRTC_NAMES, &dirs), Ok(cu12.join("libnvrtc.so.12")));
        assert_eq!(find(&NVRTC_NAMES, &dirs), Ok(cu13.join("libnvrtc.so.13")), "dir by dir");
        let miss = find_by_name(&NVRTC_NAMES, &[root.join("none")]).unwrap_err();
        assert!(miss.to_string().starts_with("none of libnvrtc.so.12, libnvrtc.so.13"), "{miss}");
        let _ = std::fs::remove_dir_all(root);
    }

    #[test]
    fn a_miss_names_what_was_searched() {
        let dirs = vec![PathBuf::from("/nowhere/a"), PathBuf::from("/nowhere/b")];
        let miss = find(&CUBLAS_NAMES, &dirs).unwrap_err();
        assert_eq!(
            miss.to_string(),
            "none of libcublas.so.13, libcublas.so.12, libcublas.so was found in the loader's \
             path nor in /nowhere/a, /nowhere/b"
        );
    }

    #[test]
    fn the_usual_places_are_searched() {
        let dirs = search_dirs();
        assert!(dirs.contains(&PathBuf::from("/usr/local/cuda/lib64")), "{dirs:?}");
    }
}
