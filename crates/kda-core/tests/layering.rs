//! kda-core's modules import each other one way: every `crate::` path in a module names a
//! module of a lower layer (docs/design/architecture.md#layering). A new module must be given
//! its layer here, and an import that runs upward (or a circle) fails this test, naming it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Each top-level module with its layer; a module may import only modules of lower layers.
const LAYERS: &[(&str, u32)] = &[
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
    // The planner's cost model over checked-mode logs (no device needed).
    ("plan", 3),
    ("tensor", 4),
    // The KDA ops' descriptors and their validation (the ops as data).
    ("kda", 5),
    ("op", 6),
    ("graph", 7),
    // The raw backend trait, then the façade over it.
    ("hal", 8),
    ("device", 9),
    // The model half: configuration, checkpoints, schedules, the layer.
    ("config", 7),
    ("weights", 8),
    ("schedule", 10),
    ("layer", 11),
];

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

#[test]
fn modules_import_only_lower_layers() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let layer: BTreeMap<&str, u32> = LAYERS.iter().copied().collect();
    let mut found = BTreeSet::new();
    for entry in std::fs::read_dir(&src).into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().trim_end_matches(".rs").to_string();
        if name != "lib" {
            found.insert(name);
        }
    }
    let unplaced: Vec<_> = found.iter().filter(|m| !layer.contains_key(m.as_str())).collect();
    assert!(unplaced.is_empty(), "modules without a layer in LAYERS: {unplaced:?}");
    let modules: BTreeSet<&str> = layer.keys().copied().collect();
    let edges = imports(&src, &modules);
    assert!(edges.len() > 20, "the scan found too few imports ({}): is it broken?", edges.len());
    let upward: Vec<String> = edges
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
        .collect();
    assert!(upward.is_empty(), "imports against the layering:\n{}", upward.join("\n"));
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
