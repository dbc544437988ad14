//! `kda precision` end to end: it prints both paths and the oracle floor for every quantity,
//! writes the Markdown report, and rejects empty sizes.
#![allow(clippy::expect_used, clippy::unwrap_used, reason = "test setup")]

mod common;

use common::{TempDir, kda, stderr, stdout};

#[test]
fn precision_prints_the_table_and_writes_the_report() {
    let dir = TempDir::new("precision");
    let doc = dir.path("precision.md");
    let o = kda(&["precision", "--heads", "1", "--tokens", "4", "--write", doc.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    for needle in [
        "| g1 (forget-gate logits) | composed |",
        "| g1 (forget-gate logits) | staged |",
        "| g, lower-bound form (K3) | bf16(oracle) |",
        "| g, softplus form (Kimi Linear) | composed |",
        "| sigmoid(g2) | staged |",
    ] {
        assert!(out.contains(needle), "missing {needle:?} in:\n{out}");
    }
    let text = std::fs::read_to_string(&doc).unwrap();
    assert!(text.starts_with("# Precision of the composed forget gate"), "{text}");
    assert!(
        text.contains("## Method") && text.contains("## Results") && text.contains("## Reading")
    );
}

#[test]
fn precision_rejects_zero_sizes() {
    let o = kda(&["precision", "--heads", "0"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("must be at least 1"), "{}", stderr(&o));
}
