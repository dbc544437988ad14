//! The committed `include/kda.h` is what cbindgen generates from `src/lib.rs` now (CI fails on
//! a stale header). `KDA_BLESS=1 cargo test -p kda-capi --test header` rewrites it.
#![allow(clippy::expect_used, reason = "test")]

use std::path::Path;

#[test]
fn committed_header_is_current() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(root.join("cbindgen.toml")).expect("cbindgen.toml");
    let bindings = cbindgen::Builder::new()
        .with_config(config)
        .with_src(root.join("src/lib.rs"))
        .generate()
        .expect("cbindgen generates the header");
    let mut generated = Vec::new();
    bindings.write(&mut generated);
    let generated = String::from_utf8(generated).expect("UTF-8 header");
    let path = root.join("include/kda.h");
    if std::env::var_os("KDA_BLESS").is_some() {
        std::fs::write(&path, &generated).expect("write include/kda.h");
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "crates/kda-capi/include/kda.h is stale: regenerate it with \
         `KDA_BLESS=1 cargo test -p kda-capi --test header` and commit it"
    );
}
