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
