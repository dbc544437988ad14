//! The `import-cycles` step of `cargo xtask test`: inside each crate, the files import each
//! other without circles, except the ones `docs/design/architecture.md#layering` names and
//! explains ([`KNOWN`]). A new circle fails the step, naming its files.
//!
//! A file's imports are the `crate::…` and `super::…` paths in its code (comments and its
//! `#[cfg(test)] mod tests` left out), resolved to the deepest module file they reach; an edge
//! between a module and one of its own ancestors or descendants (a `mod.rs` re-exporting its
//! children) is not a circle between siblings and is ignored. Circles are the strongly connected
//! components of more than one file.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The circles left on purpose, each as its crate directory and its files' module paths
/// (sorted), as `docs/design/architecture.md#layering` lists them.
const KNOWN: &[(&str, &[&str])] = &[
    ("crates/kda-ascend", &["backend/host", "backend/ops"]),
    ("crates/kda-reference", &["forecast", "stream"]),
];

type Module = Vec<String>;

/// Check every crate under `root`; `Err` names each unexpected circle.
pub fn check(root: &Path) -> Result<(), String> {
    eprintln!("==> import-cycles: circles between a crate's files in {}", root.display());
    let mut crates = Vec::new();
    find_crates(root, &mut crates);
    let mut unexpected = Vec::new();
    let mut found = 0;
    for dir in &crates {
        let rel = dir.strip_prefix(root).unwrap_or(dir).to_string_lossy().replace('\\', "/");
        for circle in circles(&dir.join("src")) {
            found += 1;
            let names: Vec<String> = circle.iter().map(|m| m.join("/")).collect();
            let known = KNOWN.iter().any(|(c, files)| *c == rel && *files == names.as_slice());
            if !known {
                unexpected.push(format!("{rel}: {}", names.join(" <-> ")));
            }
        }
    }
    for u in &unexpected {
        eprintln!("    import circle: {u}");
    }
    if unexpected.is_empty() {
        eprintln!("    import-cycles: {} crates, {found} circles, each a known one", crates.len());
        Ok(())
    } else {
        Err(format!(
            "import-cycles ({} new circles; break them, or explain one in \
             docs/design/architecture.md#layering and list it in xtask/src/import_cycles.rs)",
            unexpected.len()
        ))
    }
}

/// Directories holding a `Cargo.toml` and a `src/`, outside `target/` and hidden directories.
fn find_crates(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    let mut subdirs: Vec<PathBuf> = Vec::new();
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().to_string();
        if path.is_dir() && !name.starts_with('.') && name != "target" && name != "shared" {
            subdirs.push(path);
        }
    }
    if dir.join("Cargo.toml").is_file() && dir.join("src").is_dir() {
        out.push(dir.to_path_buf());
    }
    subdirs.sort();
    for d in subdirs {
        find_crates(&d, out);
    }
}

/// The module path of the source file `file` under `src` (`a/mod.rs` and `a.rs` are `a`).
fn module_of(src: &Path, file: &Path) -> Module {
    let rel = file.strip_prefix(src).unwrap_or(file).with_extension("");
    let mut parts: Module =
        rel.components().map(|c| c.as_os_str().to_string_lossy().to_string()).collect();
    if parts.last().is_some_and(|p| p == "mod" || p == "lib" || p == "main") {
        parts.pop();
    }
    parts
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// `text` without line comments and without its unit-test module.
fn code(text: &str) -> String {
    let body = match text.find("#[cfg(test)]\nmod tests") {
        Some(at) => &text[..at],
        None => text,
    };
    body.lines().map(|l| l.split("//").next().unwrap_or("")).collect::<Vec<_>>().join("\n")
}

/// The leading identifier of `s`.
fn ident(s: &str) -> &str {
    let end = s.find(|c: char| !(c.is_alphanumeric() || c == '_')).unwrap_or(s.len());
    &s[..end]
}

/// The paths a file's code names from `crate::` or `super::`, as (from the crate root?,
/// segments; a `super::` path keeps its leading `super`s), with `use` groups expanded one level.
fn paths(code: &str) -> Vec<(bool, Vec<String>)> {
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(found) =
        code[from..].find("crate::").into_iter().chain(code[from..].find("super::")).min()
    {
        let at = from + found;
        from = at + 1;
        if code[..at].ends_with(|c: char| c.is_alphanumeric() || c == '_' || c == ':') {
            continue;
        }
        let root = code[at..].starts_with("crate::");
        let mut segments: Vec<String> = if root { Vec::new() } else { vec!["super".into()] };
        let mut rest = &code[at + "crate::".len()..];
        loop {
            let name = ident(rest);
            if name.is_empty() {
                if let Some(group) = rest.strip_prefix('{') {
                    for item in group.split('}').next().unwrap_or("").split(',') {
                        let name = ident(item.trim());
                        if !name.is_empty() && name != "self" {
                            let mut p = segments.clone();
                            p.push(name.to_string());
                            out.push((root, p));
                        }
                    }
                }
                break;
            }
            segments.push(name.to_string());
            match rest[name.len()..].strip_prefix("::") {
                Some(next) => rest = next,
                None => break,
            }
        }
        out.push((root, segments));
    }
    out
}

/// The strongly connected components of more than one file among the crate's modules, each
/// sorted, in a stable order.
fn circles(src: &Path) -> Vec<Vec<Module>> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let modules: BTreeMap<Module, PathBuf> =
        files.iter().map(|f| (module_of(src, f), f.clone())).collect();
    let mut edges: BTreeMap<Module, BTreeSet<Module>> = BTreeMap::new();
    for (module, file) in &modules {
        let text = std::fs::read_to_string(file).unwrap_or_default();
        for (from_root, segments) in paths(&code(&text)) {
            let mut at: Module = if from_root { Vec::new() } else { module.clone() };
            for s in &segments {
                if s == "super" {
                    at.pop();
                    continue;
                }
                let mut next = at.clone();
                next.push(s.clone());
                if modules.contains_key(&next) {
                    at = next;
                } else {
                    break;
                }
            }
            let related = at.starts_with(module) || module.starts_with(&at);
            if !at.is_empty() && !related {
                edges.entry(module.clone()).or_default().insert(at);
            }
        }
    }
    strongly_connected(&modules.keys().cloned().collect::<Vec<_>>(), &edges)
}

/// Tarjan's algorithm over `nodes`; components of one node are left out.
fn strongly_connected(
    nodes: &[Module],
    edges: &BTreeMap<Module, BTreeSet<Module>>,
) -> Vec<Vec<Module>> {
    struct State<'a> {
        edges: &'a BTreeMap<Module, BTreeSet<Module>>,
        index: BTreeMap<Module, usize>,
        low: BTreeMap<Module, usize>,
        stack: Vec<Module>,
        on_stack: BTreeSet<Module>,
        out: Vec<Vec<Module>>,
    }
    fn visit(s: &mut State<'_>, v: &Module) {
        let i = s.index.len();
        s.index.insert(v.clone(), i);
        s.low.insert(v.clone(), i);
        s.stack.push(v.clone());
        s.on_stack.insert(v.clone());
        let next: Vec<Module> = s.edges.get(v).into_iter().flatten().cloned().collect();
        for w in next {
            if !s.index.contains_key(&w) {
                visit(s, &w);
                let low = s.low[v].min(s.low[&w]);
                s.low.insert(v.clone(), low);
            } else if s.on_stack.contains(&w) {
                let low = s.low[v].min(s.index[&w]);
                s.low.insert(v.clone(), low);
            }
        }
        if s.low[v] == s.index[v] {
            let mut component = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack.remove(&w);
                let done = &w == v;
                component.push(w);
                if done {
                    break;
                }
            }
            if component.len() > 1 {
                component.sort();
                s.out.push(component);
            }
        }
    }
    let mut state = State {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        out: Vec::new(),
    };
    for n in nodes {
        if !state.index.contains_key(n) {
            visit(&mut state, n);
        }
    }
    state.out.sort();
    state.out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tree(tag: &str, files: &[(&str, &str)]) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("kda-cycles-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for (path, text) in files {
            let file = dir.join("src").join(path);
            std::fs::create_dir_all(file.parent().unwrap_or(&dir)).unwrap_or_default();
            std::fs::write(file, text).unwrap_or_default();
        }
        dir
    }

    fn names(circles: &[Vec<Module>]) -> Vec<Vec<String>> {
        circles.iter().map(|c| c.iter().map(|m| m.join("/")).collect()).collect()
    }

    #[test]
    fn a_circle_between_sibling_files_is_found_through_groups_and_super() {
        let dir = tree(
            "found",
            &[
                ("lib.rs", "pub mod a;\npub mod b;\npub mod c;\nuse crate::a::A;\n"),
                ("a/mod.rs", "pub mod inner;\nuse super::b::{\n    B,\n};\npub struct A;\n"),
                ("a/inner.rs", "use super::super::c::C; // crate::b in a comment\n"),
                ("b.rs", "use crate::{c::C, a::inner};\npub struct B;\n"),
                ("c.rs", "pub struct C;\n#[cfg(test)]\nmod tests {\n    use crate::a::A;\n}\n"),
            ],
        );
        let found = circles(&dir.join("src"));
        let _ = std::fs::remove_dir_all(&dir);
        // a -> b (group), b -> a/inner; a/inner -> c and c's test module are not circles.
        assert_eq!(names(&found), vec![vec!["a".to_string(), "b".to_string()]]);
    }

    #[test]
    fn a_parent_re_exporting_its_children_is_no_circle() {
        let dir = tree(
            "parent",
            &[
                ("lib.rs", "pub mod m;\n"),
                ("m/mod.rs", "mod x;\npub use self::x::X;\nuse crate::m::x::helper;\n"),
                ("m/x.rs", "use super::Shared;\npub struct X;\n"),
            ],
        );
        let found = circles(&dir.join("src"));
        let _ = std::fs::remove_dir_all(&dir);
        assert!(found.is_empty(), "{:?}", names(&found));
    }

    #[test]
    fn the_workspace_has_only_the_known_circles() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        assert_eq!(check(&root), Ok(()));
    }
}
