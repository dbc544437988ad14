//! Builds the AscendC twin (`../twin`: the AscendC API subset the kda kernels use, with the
//! device's rules checked) together with the unchanged kernel sources (`../kernels/*.cpp`) with
//! the host C++ compiler, as AscendC's CPU debug mode compiles kernels with g++.

use std::path::Path;

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let twin = root.join("twin");
    let kernels = root.join("kernels");
    println!("cargo:rerun-if-changed={}", twin.join("include").display());
    println!("cargo:rerun-if-changed={}", twin.join("src").display());
    println!("cargo:rerun-if-changed={}", kernels.display());
    let mut sources: Vec<_> = std::fs::read_dir(&kernels)
        .map(|dir| {
            dir.filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "cpp"))
                .collect()
        })
        .unwrap_or_default();
    sources.sort();
    for s in &sources {
        println!("cargo:rerun-if-changed={}", s.display());
    }
    cc::Build::new()
        .cpp(true)
        .std("c++17")
        .include(twin.join("include"))
        .include(&kernels)
        .file(twin.join("src/runtime.cpp"))
        .files(&sources)
        .opt_level(2)
        .warnings(false)
        .compile("kda_ascend_twin");
}
