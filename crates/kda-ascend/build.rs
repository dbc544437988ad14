//! Feature `acl`: link the CANN libraries of the toolkit the environment names. Without it
//! nothing is linked (the twin, or the emulated runtime, needs no toolkit).

use std::path::PathBuf;

/// The variables CANN's `set_env.sh` exports, in the order they are trusted.
const TOOLKIT_VARS: [&str; 3] =
    ["ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH", "ASCEND_CANN_PACKAGE_PATH"];
const DEFAULT_TOOLKIT: &str = "/usr/local/Ascend/ascend-toolkit/latest";

fn main() {
    for var in TOOLKIT_VARS {
        println!("cargo:rerun-if-env-changed={var}");
    }
    if std::env::var_os("CARGO_FEATURE_ACL").is_none() {
        return;
    }
    let root = TOOLKIT_VARS
        .iter()
        .find_map(std::env::var_os)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(DEFAULT_TOOLKIT));
    let lib = root.join("lib64");
    if !lib.join("libascendcl.so").exists() {
        println!(
            "cargo:warning=feature `acl`: no libascendcl.so under {} (set ASCEND_TOOLKIT_HOME, \
             e.g. by sourcing set_env.sh); linking will fail",
            lib.display()
        );
    }
    println!("cargo:rustc-link-search=native={}", lib.display());
    for name in ["ascendcl", "nnopbase", "opapi"] {
        println!("cargo:rustc-link-lib=dylib={name}");
    }
}
