//! An installation older than the runtime calls kda requires (the emulator's table without the
//! calls CANN 8.3 and 8.5 brought, in a test binary of its own: the table is installed once per
//! process) is refused with one error naming every missing symbol and the release that brings
//! it — the check backend creation runs (`kda_ascend_sys::install`, reached from
//! `AscendBackend::new` in both builds; docs/ascend.md, "CANN releases").
#![cfg(feature = "emulated")]
#![allow(clippy::expect_used, clippy::unwrap_used, reason = "tests")]

use kda_ascend_sys::{LoadError, Release};

#[test]
fn a_table_without_the_85_calls_is_refused_naming_each_and_its_release() {
    let mut api = kda_acl_emu::table();
    api.aclrtLaunchKernelWithHostArgs = None;
    api.aclrtBinaryLoadFromFile = None;
    api.aclrtLaunchHostFunc = None;
    let err = kda_ascend_sys::install(api).expect_err("an 8.2-era table is refused");
    let LoadError::MissingSymbols { missing } = &err else { panic!("{err}") };
    let named: Vec<(&str, Release)> = missing.iter().map(|m| (m.symbol, m.since)).collect();
    assert_eq!(
        named,
        [
            ("aclrtLaunchHostFunc", Release::new(8, 3)),
            ("aclrtBinaryLoadFromFile", Release::new(8, 3)),
            ("aclrtLaunchKernelWithHostArgs", Release::new(8, 5)),
        ]
    );
    let text = kda_ascend::AscendError::from(err).to_string();
    assert!(
        text.contains("this CANN lacks 3 symbol(s) kda requires: `aclrtLaunchHostFunc`"),
        "{text}"
    );
    let host_args = "`aclrtLaunchKernelWithHostArgs` (in libascendcl.so or libacl_rt.so; \
                     CANN 8.5 and later)";
    assert!(text.contains(host_args), "{text}");
    assert!(text.ends_with("install CANN 8.5 or later"), "{text}");
    assert!(kda_ascend_sys::installed().is_none(), "nothing was installed");
    // The complete table is accepted: what backend creation installs.
    assert!(kda_ascend_sys::install(kda_acl_emu::table()).is_ok());
}
