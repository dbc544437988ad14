//! The backend conformance suite: test bodies generic over [`Backend`], instantiated for each
//! backend crate by [`conformance_tests!`](crate::conformance_tests).
//!
//! Every body checks real values against an independent computation (f64 oracles, or values
//! that only the right event order can produce). Bodies that could hang on a broken backend run
//! under a watchdog, so a wrong implementation fails instead of stalling CI.

pub mod gemm;
pub mod kda;
pub mod kda_props;
pub mod layer;
pub mod mx;
pub mod sanitize;
pub mod schedule;
pub mod streams;
pub mod views;

use std::sync::mpsc;
use std::time::Duration;

use kda_core::resource::NativeOps;
use kda_core::{Backend, Device, Error};

/// Instantiate the whole suite as `#[test]` functions in the calling module.
///
/// `$plain` builds a fresh backend instance; `$jittered` builds one that injects random delays
/// before queued work (or a plain one, for a backend without such a hook); `$checked` builds one
/// in checked mode (the sanitizer's own tests).
#[macro_export]
macro_rules! conformance_tests {
    (plain: $plain:expr, jittered: $jittered:expr, checked: $checked:expr $(,)?) => {
        $crate::conformance_streams!($plain, $jittered, $checked);
        $crate::conformance_gemm!($plain, $jittered, $checked);
        $crate::conformance_views!($plain, $jittered, $checked);
        $crate::conformance_sanitize!($plain, $jittered, $checked);
        $crate::conformance_kda!($plain, $jittered, $checked);
        $crate::conformance_kda_props!($plain, $jittered, $checked);
        $crate::conformance_mx!($plain, $jittered, $checked);
        $crate::conformance_schedule!($plain, $jittered, $checked);
        $crate::conformance_layer!($plain, $jittered, $checked);
    };
    (@tests $($name:ident => $module:ident :: $body:ident ( $($arg:tt)* )),* $(,)?) => {
        $(
            #[test]
            fn $name() {
                $crate::conformance::$module::$body($($arg)*);
            }
        )*
    };
    // Bodies that fault the device on purpose, each in processes of its own, one per fault case
    // (`conformance::isolated`).
    (@isolated $($name:ident => $cases:literal cases: $module:ident :: $body:ident ( $($arg:tt)* )),* $(,)?) => {
        $(
            #[test]
            fn $name() {
                $crate::conformance::isolated(module_path!(), stringify!($name), $cases, || {
                    $crate::conformance::$module::$body($($arg)*)
                });
            }
        )*
    };
}

/// Which body a process started by [`isolated`] runs (its test name), and which fault case.
const ISOLATED: &str = "KDA_CONFORMANCE_ISOLATED";
const CASE: &str = "KDA_CONFORMANCE_CASE";

/// Run the body of test `name` (of this test binary, declared in `module_path`) in processes of
/// its own, one per fault case
/// `0..cases`, each of which must pass. A body that faults the device on purpose cannot share a
/// process with other bodies where a device fault is fatal
/// ([`Capabilities::device_faults_are_fatal`](kda_core::resource::Capabilities): on Ascend one
/// fault stops every stream of the context, so every later test of the binary would fail), and
/// there each fault case needs a process of its own ([`runs_fault_case`]). Inside such a process
/// (the test's path in `KDA_CONFORMANCE_ISOLATED`) the body runs here.
pub fn isolated(module_path: &str, name: &str, cases: usize, body: impl FnOnce()) {
    // The test's path below the crate: libtest's name for it, and a part of any harness's.
    let name = &match module_path.split_once("::") {
        Some((_, module)) => format!("{module}::{name}"),
        None => name.to_string(),
    };
    if std::env::var(ISOLATED).is_ok_and(|v| v == *name) {
        body();
        return;
    }
    let exe = std::env::current_exe().expect("the test binary's path");
    for case in 0..cases {
        let out = std::process::Command::new(&exe)
            .args([name, "--test-threads=1"])
            .env(ISOLATED, name)
            .env(CASE, case.to_string())
            .output()
            .expect("start the test binary again");
        let (stdout, stderr) =
            (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(
            out.status.success() && stdout.contains(" 1 passed;"),
            "{name}, fault case {case}, in a process of its own ({}):\n{stdout}\n{stderr}",
            out.status
        );
    }
}

/// Whether this process runs fault case `case` of an [`isolated`] body on `b`: only its own case
/// where device faults are fatal, all of them in the first process where they are not (and
/// outside `isolated`).
pub fn runs_fault_case<B: Backend>(b: &Device<B>, case: usize) -> bool {
    let own: Option<usize> = std::env::var(CASE).ok().and_then(|c| c.parse().ok());
    match own {
        None => true,
        Some(own) if b.info().capabilities.device_faults_are_fatal => own == case,
        Some(own) => own == 0,
    }
}

/// Run `f` on its own thread and fail if it does not finish within `limit` (a hang in a broken
/// backend becomes a test failure). Panics inside `f` are re-raised.
pub fn with_watchdog<R: Send + 'static>(
    what: &str,
    limit: Duration,
    f: impl FnOnce() -> R + Send + 'static,
) -> R {
    let (tx, rx) = mpsc::channel();
    let handle = std::thread::spawn(move || {
        let r = f();
        let _ = tx.send(());
        r
    });
    match rx.recv_timeout(limit) {
        Ok(()) | Err(mpsc::RecvTimeoutError::Disconnected) => match handle.join() {
            Ok(r) => r,
            Err(panic) => std::panic::resume_unwind(panic),
        },
        Err(mpsc::RecvTimeoutError::Timeout) => {
            panic!("{what}: did not finish within {limit:?} (hang or serialised streams)")
        }
    }
}

/// The op families `b` runs natively (`Capabilities::native`). A body whose subject the backend
/// lacks by design (the MX ops on Ascend A2/A3) expects its typed refusal instead
/// ([`expect_refused`]); a route that exists but is not bit-exact by design (A2's MX GEMM:
/// dequantize, then the bf16 GEMM) is held to the tolerance its body states.
pub fn native<B: Backend>(b: &Device<B>) -> NativeOps {
    b.info().capabilities.native
}

/// `r` is the backend's typed refusal of an op family it lacks: [`Error::Unsupported`] naming
/// `feature`.
#[track_caller]
pub fn expect_refused<T: std::fmt::Debug>(r: kda_core::Result<T>, feature: &str) {
    match r {
        Err(Error::Unsupported { feature: f, .. }) if f.contains(feature) => {}
        other => {
            panic!("expected the typed refusal of {feature} (Error::Unsupported), got {other:?}")
        }
    }
}

/// Build a fresh backend from a factory expression.
pub trait Factory<B: Backend>: Fn() -> Device<B> + Send + Sync + Clone + 'static {}
impl<B: Backend, F: Fn() -> Device<B> + Send + Sync + Clone + 'static> Factory<B> for F {}

#[cfg(test)]
mod tests {
    /// Every public body of a conformance module (a `pub fn` taking the backend factory) is
    /// listed in that module's registration macro, so it runs on every backend.
    #[test]
    fn every_body_is_registered() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/conformance");
        let mut bodies = 0;
        let mut missing = Vec::new();
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let path = entry.path();
            let module = path.file_stem().map(|s| s.to_string_lossy().into_owned());
            let (Some(module), Ok(text)) = (module, std::fs::read_to_string(&path)) else {
                continue;
            };
            if module == "mod" {
                continue;
            }
            let registry = text.split(&format!("macro_rules! conformance_{module}")).nth(1);
            for decl in text.split("\npub fn ").skip(1) {
                let name: String =
                    decl.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
                let signature = decl.split('{').next().unwrap_or("");
                if !signature.contains("&impl Factory<B>") {
                    continue;
                }
                bodies += 1;
                let call = format!("{module}::{name}(");
                if !registry.is_some_and(|r| r.contains(&call)) {
                    missing.push(call);
                }
            }
        }
        assert!(bodies > 70, "found only {bodies} bodies: is the scan broken?");
        assert!(missing.is_empty(), "bodies registered nowhere: {missing:?}");
    }
}
