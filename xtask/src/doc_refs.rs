//! The `doc-refs` step of `cargo xtask test`: every reference to a design document resolves
//! inside the repository (the citation form is `docs/design/README.md#citations`).
//!
//! Scanned: `*.rs`, `*.md`, `*.toml` and kernel sources (`*.cu`, `*.cuh`, `*.cpp`, `*.h`), except
//! under `target/`, hidden directories (`.git`, …) and a top-level `shared/`. Rules:
//!
//! - a path from the repository root starting with `docs/` (optionally `#anchor`), anywhere in a
//!   scanned file, names a file or directory that exists; with an anchor, the file is Markdown
//!   and has a heading whose GitHub slug is the anchor;
//! - a relative Markdown link or image in a `.md` file (outside code) resolves the same way from
//!   the file's directory; `#anchor` alone names a heading of the file itself;
//! - the names of the design documents that live outside the repository (the upper-case
//!   `*.md` names below) and the `shared` directory above the repository are never cited;
//! - a file that speaks of a numbered behaviour cites its home, a `behaviour…` section of
//!   [`BEHAVIOURS`] (`docs/design/kda.md#behaviours`).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::{Path, PathBuf};

/// Where the numbered behaviours are described.
const BEHAVIOURS: &str = "docs/design/kda.md";

/// Stems of design documents that were never part of the repository; `<STEM>.md` is rejected.
const OUTSIDE_STEMS: [&str; 7] =
    ["MISSION", "ARCHITECTURE", "KDA", "SCHEDULE", "MXFP8", "ASCEND", "STYLE"];

/// File name endings the step reads.
const SCANNED: [&str; 7] = [".rs", ".md", ".toml", ".cu", ".cuh", ".cpp", ".h"];

/// One dangling or forbidden reference.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Problem {
    /// Path from the repository root, `/`-separated.
    pub file: String,
    /// 1-based.
    pub line: usize,
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}: {}", self.file, self.line, self.message)
    }
}

/// Check the repository at `root`; `Err` names the step and every problem is printed.
pub fn check(root: &Path) -> Result<(), String> {
    eprintln!("==> doc-refs: design references in {}", root.display());
    let mut files = BTreeMap::new();
    collect(root, root, &mut files).map_err(|e| format!("doc-refs: {e}"))?;
    let problems = check_files(&files);
    for p in &problems {
        eprintln!("    {p}");
    }
    if problems.is_empty() {
        eprintln!("    doc-refs: {} files, every reference resolves", files.len());
        Ok(())
    } else {
        Err(format!("doc-refs ({} dangling or forbidden references)", problems.len()))
    }
}

/// The repository root: the parent of this crate's directory.
pub fn repo_root() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().unwrap_or(manifest).to_path_buf()
}

/// Read every scanned file under `dir` into `files`, keyed by its path from `root`.
fn collect(root: &Path, dir: &Path, files: &mut BTreeMap<String, String>) -> Result<(), String> {
    let entries = std::fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut paths: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
    paths.sort();
    for path in paths {
        let Some(name) = path.file_name().and_then(|n| n.to_str()) else { continue };
        let meta =
            std::fs::symlink_metadata(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        if meta.is_dir() {
            let top_shared = dir == root && name == "shared";
            if name == "target" || name.starts_with('.') || top_shared {
                continue;
            }
            collect(root, &path, files)?;
        } else if meta.is_file() {
            // Files the step does not read (images, data) are kept as names, for links to them.
            let text = if scanned(name) {
                let bytes = std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?;
                String::from_utf8_lossy(&bytes).into_owned()
            } else {
                String::new()
            };
            let rel = path.strip_prefix(root).unwrap_or(&path);
            let key: Vec<_> = rel.components().map(|c| c.as_os_str().to_string_lossy()).collect();
            files.insert(key.join("/"), text);
        }
    }
    Ok(())
}

fn scanned(name: &str) -> bool {
    SCANNED.iter().any(|ext| name.ends_with(ext))
}

/// Every problem in a set of files (path from the root → contents; empty for a file that is
/// not scanned). Directories are the parents of the files.
pub fn check_files(files: &BTreeMap<String, String>) -> Vec<Problem> {
    let dirs: BTreeSet<String> = files
        .keys()
        .flat_map(|f| {
            let parts: Vec<&str> = f.split('/').collect();
            (1..parts.len()).map(move |n| parts[..n].join("/"))
        })
        .collect();
    let mut anchors: BTreeMap<&str, BTreeSet<String>> = BTreeMap::new();
    for (path, text) in files {
        if path.ends_with(".md") {
            anchors.insert(path, markdown_anchors(text));
        }
    }
    let repo = Repo { files, dirs, anchors };
    let mut problems = Vec::new();
    for (path, text) in files.iter().filter(|(path, _)| scanned(path)) {
        repo.check_file(path, text, &mut problems);
    }
    problems.sort();
    problems
}

struct Repo<'a> {
    files: &'a BTreeMap<String, String>,
    dirs: BTreeSet<String>,
    anchors: BTreeMap<&'a str, BTreeSet<String>>,
}

/// A reference found in a file: its target (from the root) and anchor.
struct Reference {
    line: usize,
    shown: String,
    target: String,
    anchor: Option<String>,
}

impl Repo<'_> {
    fn check_file(&self, path: &str, text: &str, problems: &mut Vec<Problem>) {
        let mut refs = Vec::new();
        let mut fenced = false;
        let is_md = path.ends_with(".md");
        let mut behaviour_line = None;
        for (i, line) in text.lines().enumerate() {
            let n = i + 1;
            for name in outside_names(line) {
                problems.push(Problem {
                    file: path.into(),
                    line: n,
                    message: format!(
                        "`{name}` names a design document outside the repository; cite a section \
                         of docs/design/ instead"
                    ),
                });
            }
            if behaviour_line.is_none() && mentions_behaviour(line) {
                behaviour_line = Some(n);
            }
            refs.extend(root_paths(line).into_iter().map(|(shown, target, anchor)| Reference {
                line: n,
                shown,
                target,
                anchor,
            }));
            if is_md {
                if is_fence(line) {
                    fenced = !fenced;
                    continue;
                }
                if !fenced {
                    for link in markdown_links(line) {
                        match resolve_link(path, &link) {
                            Some((target, anchor)) => {
                                refs.push(Reference { line: n, shown: link, target, anchor })
                            }
                            None => problems.push(Problem {
                                file: path.into(),
                                line: n,
                                message: format!("link `{link}` leaves the repository"),
                            }),
                        }
                    }
                }
            }
        }
        for r in &refs {
            if let Some(message) = self.dangling(r) {
                problems.push(Problem { file: path.into(), line: r.line, message });
            }
        }
        if let Some(line) = behaviour_line {
            let cites = refs.iter().any(|r| {
                r.target == BEHAVIOURS
                    && r.anchor.as_deref().is_some_and(|a| a.starts_with("behaviour"))
            });
            if path != BEHAVIOURS && !cites {
                problems.push(Problem {
                    file: path.into(),
                    line,
                    message: format!(
                        "speaks of a numbered behaviour but cites none: add \
                         `{BEHAVIOURS}#behaviour-N` (or `#behaviours`)"
                    ),
                });
            }
        }
    }

    /// Why `r` does not resolve, if it does not.
    fn dangling(&self, r: &Reference) -> Option<String> {
        let target = r.target.trim_end_matches('/');
        if !self.files.contains_key(target) && !self.dirs.contains(target) {
            return Some(format!("`{}`: no file or directory `{target}`", r.shown));
        }
        let anchor = r.anchor.as_deref()?;
        match self.anchors.get(target) {
            Some(found) if found.contains(anchor) => None,
            Some(_) => Some(format!("`{}`: `{target}` has no section `#{anchor}`", r.shown)),
            None => Some(format!("`{}`: `{target}` is not a Markdown file with sections", r.shown)),
        }
    }
}

/// The briefing folder beside the repository, as a relative path (built, not written out, so
/// this file does not cite it).
fn outside_dir() -> String {
    ["..", "shared"].join("/")
}

/// `<STEM>.md` for the stems of [`OUTSIDE_STEMS`], and the `shared` directory above the root.
fn outside_names(line: &str) -> Vec<String> {
    let mut found = Vec::new();
    for stem in OUTSIDE_STEMS {
        let name = format!("{stem}.md");
        for (at, _) in line.match_indices(&name) {
            let before = line[..at].chars().next_back();
            let after = line[at + name.len()..].chars().next();
            let word = |c: Option<char>| c.is_some_and(|c| c.is_alphanumeric() || c == '_');
            if !word(before) && !word(after) {
                found.push(name.clone());
            }
        }
    }
    let shared = outside_dir();
    if line.contains(&shared) {
        found.push(shared);
    }
    found
}

/// "behaviour 3", "Behaviours 4 and 8".
fn mentions_behaviour(line: &str) -> bool {
    let lower = line.to_lowercase();
    lower.match_indices("behaviour").any(|(at, _)| {
        let rest = lower[at + "behaviour".len()..].trim_start_matches('s');
        rest.strip_prefix(' ').is_some_and(|r| r.starts_with(|c: char| c.is_ascii_digit()))
    })
}

/// Characters a cited path or anchor may contain.
fn path_char(c: char) -> bool {
    c.is_alphanumeric() || matches!(c, '_' | '-' | '.' | '/' | '#' | '%')
}

/// Paths from the root that start with `docs/`: (as written, path, anchor).
fn root_paths(line: &str) -> Vec<(String, String, Option<String>)> {
    let mut found = Vec::new();
    for (at, _) in line.match_indices("docs/") {
        if line[..at].chars().next_back().is_some_and(path_char) {
            continue;
        }
        let len: usize = line[at..].chars().take_while(|&c| path_char(c)).map(char::len_utf8).sum();
        let shown = line[at..at + len].trim_end_matches(['.', '-', '#']);
        let (target, anchor) = split_anchor(shown);
        found.push((shown.to_string(), target, anchor));
    }
    found
}

/// `path#anchor` → (path, anchor), both percent-decoded.
fn split_anchor(s: &str) -> (String, Option<String>) {
    match s.split_once('#') {
        Some((path, anchor)) => (percent_decode(path), Some(percent_decode(anchor))),
        None => (percent_decode(s), None),
    }
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        let escaped = (bytes[i] == b'%' && i + 2 < bytes.len())
            .then(|| hex(bytes[i + 1]).zip(hex(bytes[i + 2])))
            .flatten();
        if let Some((h, l)) = escaped {
            out.push((h * 16 + l) as u8);
            i += 3;
            continue;
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A line that opens or closes a fenced code block.
fn is_fence(line: &str) -> bool {
    let t = line.trim_start();
    t.starts_with("```") || t.starts_with("~~~")
}

/// `line` without its inline code spans.
fn without_code_spans(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut rest = line;
    while let Some(open) = rest.find('`') {
        out.push_str(&rest[..open]);
        let ticks = rest[open..].chars().take_while(|&c| c == '`').count();
        let after = &rest[open + ticks..];
        match after.find(&"`".repeat(ticks)) {
            Some(close) => rest = &after[close + ticks..],
            None => {
                out.push_str(&rest[open..]);
                rest = "";
            }
        }
    }
    out.push_str(rest);
    out
}

/// Relative targets of the inline links, images and link definitions on one Markdown line
/// (external URLs left out).
fn markdown_links(line: &str) -> Vec<String> {
    let text = without_code_spans(line);
    let mut targets = Vec::new();
    let mut rest = text.as_str();
    while let Some(at) = rest.find("](") {
        let after = &rest[at + 2..];
        let end = after.find(')').unwrap_or(after.len());
        targets.push(after[..end].to_string());
        rest = &after[end..];
    }
    // Reference-style definitions: `[name]: target`.
    let trimmed = text.trim_start();
    if let Some(close) = trimmed.strip_prefix('[').and_then(|t| t.find("]:")) {
        targets.push(trimmed[close + 3..].to_string());
    }
    targets
        .into_iter()
        .filter_map(|t| {
            let t = t.trim();
            let t = match t.strip_prefix('<') {
                Some(inner) => inner.split('>').next().unwrap_or(""),
                None => t.split_whitespace().next().unwrap_or(""),
            };
            let external = t.contains("://") || t.starts_with("mailto:") || t.is_empty();
            (!external).then(|| t.to_string())
        })
        .collect()
}

/// The target (from the root) and anchor of a relative link in file `from`; `None` when it
/// climbs above the root.
fn resolve_link(from: &str, link: &str) -> Option<(String, Option<String>)> {
    let (path, anchor) = split_anchor(link);
    if path.is_empty() {
        return Some((from.to_string(), anchor));
    }
    let mut parts: Vec<&str> =
        if path.starts_with('/') { Vec::new() } else { from.split('/').collect() };
    if !path.starts_with('/') {
        parts.pop();
    }
    for part in path.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                parts.pop()?;
            }
            p => parts.push(p),
        }
    }
    Some((parts.join("/"), anchor))
}

/// The anchors of a Markdown file: GitHub's slug of every heading outside code blocks
/// (repeats numbered `-1`, `-2`, …), and explicit `id="…"` / `name="…"` anchors.
fn markdown_anchors(text: &str) -> BTreeSet<String> {
    let mut anchors = BTreeSet::new();
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut fenced = false;
    for line in text.lines() {
        if is_fence(line) {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        for attr in ["id=\"", "name=\""] {
            for (at, _) in line.match_indices(attr) {
                let value = &line[at + attr.len()..];
                if let Some(end) = value.find('"') {
                    anchors.insert(value[..end].to_string());
                }
            }
        }
        let Some(heading) = heading_text(line) else { continue };
        let base = slug(heading);
        let count = seen.entry(base.clone()).or_insert(0);
        let anchor = if *count == 0 { base.clone() } else { format!("{base}-{count}") };
        *count += 1;
        anchors.insert(anchor);
    }
    anchors
}

/// The text of an ATX heading (`## Text ##`), if `line` is one.
fn heading_text(line: &str) -> Option<&str> {
    let indent = line.len() - line.trim_start_matches(' ').len();
    let t = &line[indent..];
    let level = t.chars().take_while(|&c| c == '#').count();
    if indent > 3 || !(1..=6).contains(&level) {
        return None;
    }
    let rest = &t[level..];
    if !(rest.is_empty() || rest.starts_with([' ', '\t'])) {
        return None;
    }
    let rest = rest.trim();
    let closed = rest.trim_end_matches('#');
    Some(if closed.len() < rest.len() && closed.ends_with(' ') { closed.trim_end() } else { rest })
}

/// GitHub's anchor for a heading: link text kept, code marks and punctuation dropped, lower
/// case, spaces as hyphens (letters of any script, digits, `_` and `-` kept).
pub fn slug(heading: &str) -> String {
    let mut text = String::new();
    let mut rest = heading;
    // `[text](url)` → text.
    while let Some(open) = rest.find('[') {
        let Some(mid) = rest[open..].find("](").map(|m| open + m) else { break };
        let Some(close) = rest[mid..].find(')').map(|c| mid + c) else { break };
        text.push_str(&rest[..open]);
        text.push_str(&rest[open + 1..mid]);
        rest = &rest[close + 1..];
    }
    text.push_str(rest);
    text.to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '_' || c == '-' => Some(c),
            _ => None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `docs/<rest>`, spelled so that this file does not cite what it tests.
    fn docs(rest: &str) -> String {
        format!("{}/{rest}", "docs")
    }

    fn messages(files: &[(String, String)]) -> Vec<String> {
        let map: BTreeMap<String, String> = files.iter().cloned().collect();
        check_files(&map).into_iter().map(|p| p.to_string()).collect()
    }

    /// A design page with a repeated heading and a heading-like line in a code block.
    fn design() -> (String, String) {
        let text = "# Schedules\n\n## Events\n\n### hidden_ready\n\n## The HAL: raw trait and \
                    façade\n\n```text\n## Not a heading\n```\n\n## Events\n";
        (docs("design/schedule.md"), text.to_string())
    }

    fn file(path: &str, text: impl Into<String>) -> (String, String) {
        (path.to_string(), text.into())
    }

    #[test]
    fn slugs_follow_github() {
        assert_eq!(slug("The HAL: raw trait and façade"), "the-hal-raw-trait-and-façade");
        assert_eq!(slug("`hidden_ready`"), "hidden_ready");
        assert_eq!(slug("q/k norm"), "qk-norm");
        assert_eq!(slug("Behaviour 11"), "behaviour-11");
        assert_eq!(slug("See [the seeds](README.md#the-seeds) (2)"), "see-the-seeds-2");
        assert_eq!(heading_text("## Closed ##"), Some("Closed"));
        assert_eq!(heading_text("#hashtag"), None);
        assert_eq!(heading_text("    # indented code"), None);
        let want =
            ["schedules", "events", "hidden_ready", "the-hal-raw-trait-and-façade", "events-1"];
        let want: BTreeSet<String> = want.iter().map(|s| s.to_string()).collect();
        assert_eq!(markdown_anchors(&design().1), want);
        assert!(markdown_anchors("<a id=\"here\"></a>\n").contains("here"));
    }

    #[test]
    fn a_good_reference_passes() {
        let code = format!(
            "//! The order (`{}`), the fork ({}), the folder {}.\n",
            docs("design/schedule.md#events"),
            docs("design/schedule.md#hidden_ready"),
            docs("design/"),
        );
        let md = "See [events](schedule.md#events), [again](schedule.md#events-1), \
                  [façade](schedule.md#the-hal-raw-trait-and-fa%C3%A7ade), \
                  [a picture](../t.svg) and [elsewhere](https://example.com/X.md).\n";
        let files = [
            design(),
            file("crates/a/src/lib.rs", code),
            (docs("design/README.md"), md.to_string()),
            (docs("t.svg"), String::new()),
        ];
        assert_eq!(messages(&files), Vec::<String>::new());
    }

    #[test]
    fn a_missing_file_fails() {
        let code = format!("// see {}\n", docs("design/nope.md#events"));
        let files = [
            design(),
            file("crates/a/src/lib.rs", code),
            (docs("design/README.md"), "[gone](../gone.md)\n".to_string()),
        ];
        let m = messages(&files);
        assert_eq!(m.len(), 2, "{m:?}");
        assert!(m[0].starts_with("crates/a/src/lib.rs:1: ") && m[0].contains("no file"), "{m:?}");
        assert!(m[1].contains(&format!("no file or directory `{}`", docs("gone.md"))), "{m:?}");
    }

    #[test]
    fn a_missing_section_fails() {
        let code = format!("/// ({})\n", docs("design/schedule.md#not-a-heading"));
        let md = "Intro.\n\n[x](schedule.md#Events) [y](#nowhere)\n";
        let files = [
            design(),
            file("crates/a/src/lib.rs", code),
            (docs("design/README.md"), md.to_string()),
        ];
        let m = messages(&files);
        assert_eq!(m.len(), 3, "{m:?}");
        let has = |s: &str| m.iter().any(|p| p.contains(s));
        assert!(has("has no section `#not-a-heading`"), "{m:?}");
        assert!(has("has no section `#Events`"), "anchors are case-sensitive: {m:?}");
        assert!(has("README.md` has no section `#nowhere`"), "{m:?}");
        assert!(m.iter().all(|p| !p.contains(":1: ") || p.starts_with("crates/")), "{m:?}");
    }

    #[test]
    fn upper_case_outside_names_fail() {
        let stem = OUTSIDE_STEMS[3];
        let code = format!("//! The schedules ({stem}.md), written once.\n");
        let md = format!("Design documents: `{}/docs/`.\n", outside_dir());
        let fine = format!("// README.md, x_{stem}.md and {}.md are not those names\n", "schedule");
        let files = [file("a.rs", code), file("README.md", md), file("b.rs", fine), design()];
        let m = messages(&files);
        assert_eq!(m.len(), 2, "{m:?}");
        assert!(m[0].starts_with("README.md:1: ") && m[0].contains("outside the repository"));
        assert!(m[1].starts_with("a.rs:1: ") && m[1].contains(&format!("`{stem}.md`")), "{m:?}");
    }

    #[test]
    fn numbered_behaviours_must_cite_their_home() {
        let home = (BEHAVIOURS.to_string(), "# KDA\n\n## Behaviours\n\n### Behaviour 3\n".into());
        let bare = "/// The norm's epsilon (behaviour 3).\n";
        let cited = format!("/// The norm's epsilon ({}).\n", docs("design/kda.md#behaviour-3"));
        let m = messages(&[home, file("a.rs", bare), file("b.rs", cited)]);
        assert_eq!(m.len(), 1, "{m:?}");
        assert!(m[0].starts_with("a.rs:1: speaks of a numbered behaviour"), "{m:?}");
        assert!(mentions_behaviour("Behaviours 4 and 8"));
        assert!(!mentions_behaviour("fn behaviour_14_checkpoint_routing()"));
        assert!(!mentions_behaviour("the behaviour of a stream"));
    }

    #[test]
    fn code_blocks_and_spans_are_not_links() {
        let md = "```text\n[x](nowhere.md)\n```\n`[y](nowhere.md)` and ~~~\n";
        assert_eq!(messages(&[(docs("a.md"), md.to_string())]), Vec::<String>::new());
        let links = markdown_links("[a](b.md \"title\") ![i](<c d.svg>) `[z](no.md)`");
        assert_eq!(links, ["b.md", "c d.svg"]);
        assert_eq!(markdown_links("[e]: f.md#g"), ["f.md#g"]);
    }

    #[test]
    fn references_resolve_from_the_right_place() {
        let (precision, timeline) = (docs("precision.md"), docs("timeline.svg"));
        assert_eq!(
            resolve_link(&docs("design/kda.md"), "../precision.md#method"),
            Some((precision, Some("method".into())))
        );
        assert_eq!(resolve_link("README.md", &timeline), Some((timeline, None)));
        assert_eq!(resolve_link("README.md", "../outside.md"), None);
        assert_eq!(resolve_link("x/a.md", "#y"), Some(("x/a.md".into(), Some("y".into()))));
        let line =
            format!("see `{}`. And x/{} and ../{} are not.", docs("a.md#b"), docs("c"), docs("d"));
        assert_eq!(root_paths(&line), [(docs("a.md#b"), docs("a.md"), Some("b".into()))]);
    }
}
