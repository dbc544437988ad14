//! The kernel names the backend launches (and the emulated runtime implements) against the
//! AscendC sources `cargo xtask kernels` compiles: every name in `abi::names::ALL` has exactly
//! one entry point in `crates/kda-ascend/kernels/*.cpp`, no source declares a kernel the ABI
//! does not know, and each entry point takes one `GM_ADDR` per tensor of the name's ABI
//! parameter list followed by the `meta` pointer (`kda_kernel_abi.h`). The emulator runs a
//! kernel through the reference, so without this check it would emulate kernels that do not
//! exist on a real NPU.
#![allow(clippy::expect_used, clippy::unwrap_used, reason = "tests")]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use kda_ascend::kernels::abi::names;

/// How every kernel entry point opens (`kda_kernel_abi.h`: vector kernels launched by name).
const ENTRY: &str = "extern \"C\" __global__ __aicore__ void ";

fn kernel_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels")
}

/// An entry point as written: its name and its parameters (type and name, whitespace-normalised).
#[derive(Debug)]
struct Entry {
    file: String,
    params: Vec<String>,
}

/// The entry points declared in `source`: name and parameter list, from the opening text up to
/// the closing parenthesis (comments are not expected inside a parameter list).
fn entries_in(source: &str) -> Vec<(String, Vec<String>)> {
    let mut found = Vec::new();
    let mut rest = source;
    while let Some(at) = rest.find(ENTRY) {
        let after = &rest[at + ENTRY.len()..];
        let open = after.find('(').expect("an entry point has a parameter list");
        let close = after[open..].find(')').expect("a closed parameter list") + open;
        let name = after[..open].trim().to_string();
        let params = after[open + 1..close]
            .split(',')
            .map(|p| p.split_whitespace().collect::<Vec<_>>().join(" "))
            .filter(|p| !p.is_empty())
            .collect();
        found.push((name, params));
        rest = &after[close..];
    }
    found
}

/// Every entry point of every `.cpp` kernel source, by name (a name declared twice fails).
fn inventory() -> BTreeMap<String, Entry> {
    let mut all = BTreeMap::new();
    let dir = kernel_dir();
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("the kernel source directory")
        .map(|e| e.expect("a directory entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "cpp"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no kernel sources in {}", dir.display());
    for path in files {
        let source = std::fs::read_to_string(&path).expect("a kernel source");
        let file = path.file_name().unwrap().to_string_lossy().into_owned();
        for (name, params) in entries_in(&source) {
            let previous = all.insert(name.clone(), Entry { file: file.clone(), params });
            if let Some(p) = previous {
                panic!("kernel `{name}` is declared in both {} and {file}", p.file);
            }
        }
    }
    all
}

#[test]
fn the_parser_reads_an_entry_point() {
    let src = "// x\nextern \"C\" __global__ __aicore__ void k_a(GM_ADDR x,\n    GM_ADDR  y, GM_ADDR meta)\n{\n}\nextern \"C\" __global__ __aicore__ void k_b(GM_ADDR meta) {}";
    let e = entries_in(src);
    assert_eq!(e.len(), 2);
    assert_eq!(e[0].0, "k_a");
    assert_eq!(e[0].1, ["GM_ADDR x", "GM_ADDR y", "GM_ADDR meta"]);
    assert_eq!(e[1], ("k_b".to_string(), vec!["GM_ADDR meta".to_string()]));
}

#[test]
fn every_abi_kernel_has_exactly_one_source_and_no_source_is_unknown() {
    let sources = inventory();
    let declared: Vec<&str> = sources.keys().map(String::as_str).collect();
    let mut abi: Vec<&str> = names::ALL.to_vec();
    abi.sort_unstable();
    let missing: Vec<&str> = abi.iter().copied().filter(|n| !sources.contains_key(*n)).collect();
    let unknown: Vec<&str> = declared.iter().copied().filter(|n| !abi.contains(n)).collect();
    assert!(
        missing.is_empty() && unknown.is_empty(),
        "kernel names without an AscendC source: {missing:?}; sources the ABI does not list: \
         {unknown:?}"
    );
    assert_eq!(declared, abi);
}

#[test]
fn every_entry_point_takes_its_abi_tensors_then_meta() {
    for (name, entry) in inventory() {
        let Some(tensors) = names::tensors(&name) else {
            panic!("{}: `{name}` has no ABI parameter list", entry.file);
        };
        assert_eq!(
            entry.params.len(),
            tensors + 1,
            "{}: `{name}` takes {:?}; the ABI passes {tensors} tensors and meta",
            entry.file,
            entry.params
        );
        for p in &entry.params {
            assert!(
                p.starts_with("GM_ADDR "),
                "{}: `{name}` parameter `{p}` is not a GM_ADDR",
                entry.file
            );
        }
        assert_eq!(
            entry.params.last().map(String::as_str),
            Some("GM_ADDR meta"),
            "{}: `{name}` must end with the meta pointer",
            entry.file
        );
    }
}
