//! The workspace's floors, checked from the sources:
//!
//! - inside kda-core and inside kda-model, modules import each other one way: every `crate::`
//!   path in a module names a module of a lower layer (docs/design/architecture.md#layering). A
//!   new module must be given its layer here, and an import that runs upward (or a circle) fails,
//!   naming it;
//! - kda-core is the HAL alone: it depends on no checkpoint crate and not on kda-model;
//! - no backend depends on kda-model (tests and examples may: `[dev-dependencies]`);
//! - the emulated ACL runtime (`kda-acl-emu`) does not depend on the reference backend.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// kda-core's top-level modules with their layers; a module may import only lower layers.
const CORE_LAYERS: &[(&str, u32)] = &[
    // The vocabulary: element types, the MXFP8 codec, ids and handle types.
    ("dtype", 0),
    ("mx", 1),
    ("resource", 1),
    ("layout", 1),
    // Opening files: regular files only, bounded reads (imports nothing of kda's).
    ("file", 1),
    ("timeline", 2),
    // Checked mode's analysis: log entries, happens-before, hazards (no device needed).
    ("sanitize", 2),
    ("error", 3),
    ("tensor", 4),
    // The KDA ops' descriptors and their validation (the ops as data).
    ("kda", 5),
    ("op", 6),
    ("graph", 7),
    // The raw backend trait, then the façade over it.
    ("hal", 8),
    ("device", 9),
];

/// kda-model's top-level modules with their layers (everything of kda-core is below them all).
const MODEL_LAYERS: &[(&str, u32)] = &[
    // The planner's cost model over checked-mode logs (no device needed).
    ("plan", 0),
    ("config", 0),
    ("weights", 1),
    ("schedule", 2),
    ("layer", 3),
];

/// Checkpoint and model crates the HAL must not pull into every backend.
const NOT_IN_CORE: &[&str] = &["kda-model", "safetensors", "memmap2", "serde_json", "serde"];

/// The backend crates (directories under `crates/`), which must not depend on the model.
const BACKENDS: &[&str] =
    &["kda-reference", "kda-cuda", "kda-ascend", "kda-ascend/emu", "kda-ascend/sys"];

fn crates_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The top-level modules each module's code names through `crate::`, with one file per edge.
fn imports(src: &Path, modules: &BTreeSet<&str>) -> BTreeMap<(String, String), PathBuf> {
    let mut files = Vec::new();
    sources(src, &mut files);
    let mut edges = BTreeMap::new();
    for file in files {
        let rel = file.strip_prefix(src).unwrap_or(&file);
        let Some(first) = rel.components().next() else { continue };
        let from = first.as_os_str().to_string_lossy().trim_end_matches(".rs").to_string();
        if from == "lib" {
            continue;
        }
        let text = std::fs::read_to_string(&file).unwrap_or_default();
        for line in text.lines() {
            let code = line.split("//").next().unwrap_or("");
            let mut rest = code;
            while let Some(at) = rest.find("crate::") {
                rest = &rest[at + "crate::".len()..];
                let names: Vec<&str> = if let Some(group) = rest.strip_prefix('{') {
                    group.split(['}', ',']).map(str::trim).collect()
                } else {
                    vec![rest]
                };
                for name in names {
                    let module: String =
                        name.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
                    if module != from && modules.contains(module.as_str()) {
                        edges.entry((from.clone(), module)).or_insert_with(|| file.clone());
                    }
                }
            }
        }
        // Multi-line `use crate::{ … }` groups.
        for group in text.split("use crate::{").skip(1) {
            let body = group.split('}').next().unwrap_or("");
            for name in body.split(',') {
                let module: String =
                    name.trim().chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
                if module != from && modules.contains(module.as_str()) {
                    edges.entry((from.clone(), module)).or_insert_with(|| file.clone());
                }
            }
        }
    }
    edges
}

/// The upward imports of the crate whose sources are in `src`, as messages.
fn upward_imports(src: &Path, layers: &[(&str, u32)]) -> Vec<String> {
    let layer: BTreeMap<&str, u32> = layers.iter().copied().collect();
    let mut found = BTreeSet::new();
    for entry in std::fs::read_dir(src).into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().trim_end_matches(".rs").to_string();
        if name != "lib" {
            found.insert(name);
        }
    }
    let unplaced: Vec<_> = found.iter().filter(|m| !layer.contains_key(m.as_str())).collect();
    assert!(unplaced.is_empty(), "modules of {} without a layer: {unplaced:?}", src.display());
    let modules: BTreeSet<&str> = layer.keys().copied().collect();
    let edges = imports(src, &modules);
    assert!(
        edges.len() >= layers.len(),
        "the scan found too few imports in {} ({}): is it broken?",
        src.display(),
        edges.len()
    );
    edges
        .iter()
        .filter(|((from, to), _)| layer[from.as_str()] <= layer[to.as_str()])
        .map(|((from, to), file)| {
            format!(
                "{from} (layer {}) imports {to} (layer {}) in {}",
                layer[from.as_str()],
                layer[to.as_str()],
                file.display()
            )
        })
        .collect()
}

#[test]
fn core_modules_import_only_lower_layers() {
    let upward = upward_imports(&crates_dir().join("kda-core/src"), CORE_LAYERS);
    assert!(upward.is_empty(), "imports against kda-core's layering:\n{}", upward.join("\n"));
}

#[test]
fn model_modules_import_only_lower_layers() {
    let upward = upward_imports(&crates_dir().join("kda-model/src"), MODEL_LAYERS);
    assert!(upward.is_empty(), "imports against kda-model's layering:\n{}", upward.join("\n"));
}

/// The crate names in a manifest's `[dependencies]` tables (plain and per-target), not its
/// dev- or build-dependencies.
fn dependencies(manifest: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut in_deps = false;
    for line in manifest.lines().map(str::trim) {
        if line.starts_with('[') {
            in_deps = line == "[dependencies]"
                || (line.starts_with("[target.") && line.ends_with(".dependencies]"));
            continue;
        }
        if in_deps
            && !line.starts_with('#')
            && let Some((name, _)) = line.split_once('=')
        {
            names.insert(name.trim().trim_end_matches(".workspace").to_string());
        }
    }
    names
}

fn manifest_dependencies(dir: &str) -> BTreeSet<String> {
    let path = crates_dir().join(dir).join("Cargo.toml");
    let text = std::fs::read_to_string(&path).unwrap_or_default();
    let deps = dependencies(&text);
    assert!(!deps.is_empty(), "no [dependencies] read from {}", path.display());
    deps
}

#[test]
fn core_depends_on_no_checkpoint_or_model_crate() {
    let deps = manifest_dependencies("kda-core");
    let bad: Vec<_> = NOT_IN_CORE.iter().filter(|c| deps.contains(**c)).collect();
    assert!(bad.is_empty(), "kda-core's [dependencies] name {bad:?}");
}

#[test]
fn no_backend_depends_on_the_model() {
    for backend in BACKENDS {
        let deps = manifest_dependencies(backend);
        assert!(!deps.contains("kda-model"), "{backend}'s [dependencies] name kda-model");
    }
}

/// The emulated ACL runtime is its own runtime, not a layer over the reference backend: its
/// streams, events, capture, memory and aclnn math are its own code (issue #29), so a
/// reference-backend bug cannot hide in both sides of an Ascend test. Its tests may compare
/// against the reference (`[dev-dependencies]`).
#[test]
fn the_emulated_acl_runtime_does_not_depend_on_the_reference_backend() {
    let deps = manifest_dependencies("kda-ascend/emu");
    assert!(!deps.contains("kda-reference"), "kda-acl-emu's [dependencies] name kda-reference");
}

#[test]
fn the_manifest_reader_sees_only_dependencies() {
    let manifest = "[package]\nname = \"x\"\n[dependencies]\nkda-core.workspace = true\n\
                    half = \"2\"\n[target.'cfg(unix)'.dependencies]\nlibc = \"0.2\"\n\
                    [dev-dependencies]\nkda-model.workspace = true\n";
    let names: Vec<_> = dependencies(manifest).into_iter().collect();
    assert_eq!(names, ["half", "kda-core", "libc"]);
}

#[test]
fn the_scan_sees_upward_imports() {
    // The scanner itself: a fixture tree where `a` (layer 0) imports `b` (layer 1).
    let dir = std::env::temp_dir().join(format!("kda-layering-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("b")).unwrap_or_default();
    std::fs::write(dir.join("a.rs"), "use crate::{\n    b::Thing,\n};\n").unwrap_or_default();
    std::fs::write(dir.join("b/mod.rs"), "// crate::a in a comment\nuse std::fmt;\n")
        .unwrap_or_default();
    let modules: BTreeSet<&str> = ["a", "b"].into_iter().collect();
    let edges = imports(&dir, &modules);
    let _ = std::fs::remove_dir_all(&dir);
    let pairs: Vec<_> = edges.keys().cloned().collect();
    assert_eq!(pairs, vec![("a".to_string(), "b".to_string())]);
}

/// Rust lines under `dir` (every `.rs` file, `target/` and hidden directories left out).
fn rust_lines(dir: &Path) -> usize {
    let mut files = Vec::new();
    sources(dir, &mut files);
    files
        .iter()
        .filter(|f| !f.components().any(|c| c.as_os_str() == "target"))
        .map(|f| std::fs::read_to_string(f).map_or(0, |t| t.lines().count()))
        .sum()
}

#[test]
fn no_crate_holds_more_than_a_fifth_of_the_code() {
    // Each folder under crates/ with its nested crates (kda-ascend with its emulator and sys),
    // against every crate's and xtask's Rust lines.
    let crates = crates_dir();
    let mut sizes: Vec<(String, usize)> = std::fs::read_dir(&crates)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.path().join("Cargo.toml").is_file())
        .map(|e| (e.file_name().to_string_lossy().to_string(), rust_lines(&e.path())))
        .collect();
    let total: usize =
        sizes.iter().map(|(_, n)| n).sum::<usize>() + rust_lines(&crates.join("../xtask"));
    sizes.sort_by_key(|(_, n)| std::cmp::Reverse(*n));
    assert!(sizes.len() >= 10 && total > 10_000, "the scan found too little: {sizes:?}");
    let (name, biggest) = &sizes[0];
    assert!(
        *biggest * 5 <= total,
        "{name} holds {biggest} of the workspace's {total} Rust lines ({:.1} %), more than 20 %",
        100.0 * *biggest as f64 / total as f64
    );
}
