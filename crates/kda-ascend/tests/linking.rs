//! Feature `acl` on a machine without CANN: the crate builds (nothing is linked at build time)
//! and backend creation fails with a typed error naming the library it could not open.
//! Run with `cargo test -p kda-ascend --features acl --test linking`.

#![cfg(all(feature = "acl", not(feature = "emulated")))]

use kda_ascend::{AscendBackend, AscendError};

#[test]
fn backend_creation_without_cann_names_the_missing_library() {
    let toolkit_present =
        ["ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH"].iter().any(|v| std::env::var_os(v).is_some())
            || std::path::Path::new("/usr/local/Ascend/ascend-toolkit/latest/lib64/libascendcl.so")
                .exists();
    match AscendBackend::new() {
        Err(AscendError::Load(kda_ascend_sys::LoadError::MissingLibrary { library, tried })) => {
            assert!(!toolkit_present, "a toolkit is installed, yet {library} was not found");
            assert_eq!(library, "libascendcl.so or libacl_rt.so");
            assert!(tried.contains("libascendcl.so") && tried.contains("lib64"), "{tried}");
            let text = AscendError::Load(kda_ascend_sys::LoadError::MissingLibrary {
                library: library.clone(),
                tried,
            })
            .to_string();
            assert!(text.contains("libascendcl.so"), "{text}");
        }
        Err(other) => panic!("expected a missing CANN library, got {other}"),
        Ok(_) => assert!(toolkit_present, "a backend without CANN installed"),
    }
}
