//! `--backend`: the one place a command's device is chosen and built, and the dispatch of its
//! body — written once over `B: Backend` — to that device.
//!
//! Every backend kda knows is compiled into `kda` in some form: without their features,
//! kda-ascend and kda-cuda compile to twins whose constructors say so (the candle
//! `dummy_cuda_backend` pattern). So dispatching needs no `cfg`, and a backend that is not
//! built in is an error that names the feature enabling it, not an unknown `--backend` value.
//!
//! What only the reference backend has degrades on the others: the op timeline
//! ([`CliBackend::timeline`] is `None`; commands say what they leave out, and `kda trace` and
//! `kda bench schedule`, which are made of it, refuse with [`CliError::NeedsTimeline`]), and
//! `--threads` (ignored, with a warning).

use clap::Args;
use kda_ascend::{AscendBackend, AscendError, AscendOptions};
use kda_core::sanitize::checked_from_env;
use kda_core::timeline::Timeline;
use kda_core::{Backend, Device};
use kda_cuda::{CudaBackend, CudaError, CudaOptions};
use kda_model::layer::CoreOperands;
use kda_reference::{ExecutionMode, ReferenceBackend, ReferenceOptions, WaitStrategy};

use crate::error::{CliError, Unavailable};

/// The backends kda knows: kda-embed's selector, which the bindings use too.
pub use kda_embed::backends::BackendKind;

/// `--backend`'s value: a backend by name.
fn parse_kind(name: &str) -> Result<BackendKind, String> {
    BackendKind::parse(name).ok_or_else(|| format!("expected {}", BackendKind::NAMES))
}

/// `--backend`, flattened into every command that runs on a device.
#[derive(Debug, Args)]
pub struct BackendArg {
    /// The backend to run on: reference, cuda or ascend (`kda info` lists each one, or why it
    /// cannot start).
    #[arg(long, value_parser = parse_kind, default_value = "reference")]
    pub backend: BackendKind,
}

/// What a command asks of its device.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Settings {
    /// Checked mode (every call recorded, racing ops rejected): on or off, or as `KDA_SANITIZE`
    /// says (`None`).
    pub checked: Option<bool>,
    /// Time every op (the reference backend's timeline; the others record none).
    pub timeline: bool,
    /// Threads per op (the reference backend's execution mode: 1 runs each op on its stream's
    /// own thread, more share a pool); the other backends ignore it.
    pub threads: usize,
}

impl Default for Settings {
    /// Checked mode as `KDA_SANITIZE` says, no timeline, one thread per op.
    fn default() -> Self {
        Self { checked: None, timeline: false, threads: 1 }
    }
}

impl Settings {
    /// Checked mode as asked, or as `KDA_SANITIZE` says (off when unset).
    fn checked(&self) -> bool {
        self.checked.unwrap_or_else(|| checked_from_env(false))
    }

    /// `--threads` is at least 1 whatever the backend.
    fn check(&self) -> Result<(), CliError> {
        if self.threads == 0 {
            return Err(CliError::Argument {
                arg: "--threads",
                reason: "must be at least 1".into(),
            });
        }
        Ok(())
    }

    /// Warn that `--threads` means nothing to `backend`.
    fn warn_reference_only(&self, backend: BackendKind) {
        if self.threads != 1 {
            tracing::warn!(
                "--threads {} applies to the reference backend only; the {} backend ignores it",
                self.threads,
                backend.name()
            );
        }
    }
}

/// A backend a `kda` command can run on: how to build it from [`Settings`], and its extras.
pub trait CliBackend: Backend {
    const KIND: BackendKind;

    /// The device `settings` asks for ([`CliError::BackendUnavailable`] when it cannot start).
    fn open(settings: &Settings) -> Result<Device<Self>, CliError>;

    /// The ops timed since the last [`CliBackend::clear_timeline`], on a backend that records
    /// them and was opened with [`Settings::timeline`].
    fn timeline(_device: &Device<Self>) -> Option<Timeline> {
        None
    }

    /// Forget the ops timed so far.
    fn clear_timeline(_device: &Device<Self>) {}
}

/// The reference backend's options for `settings`. A stream waiting on another starts within
/// microseconds of the completion ([`WaitStrategy::Forecast`]): `kda`'s commands time what they
/// run (one core per stream only; a shared pool always blocks).
pub fn reference_options(settings: &Settings) -> ReferenceOptions {
    let mode = match settings.threads {
        0 | 1 => ExecutionMode::PerStream,
        threads => ExecutionMode::SharedPool { threads },
    };
    ReferenceOptions {
        mode,
        checked: settings.checked(),
        timeline: settings.timeline,
        wait: WaitStrategy::Forecast,
        ..ReferenceOptions::default()
    }
}

impl CliBackend for ReferenceBackend {
    const KIND: BackendKind = BackendKind::Reference;

    fn open(settings: &Settings) -> Result<Device<Self>, CliError> {
        settings.check()?;
        Ok(ReferenceBackend::with_options(reference_options(settings))?)
    }

    fn timeline(device: &Device<Self>) -> Option<Timeline> {
        device.raw().options().timeline.then(|| device.raw().timeline())
    }

    fn clear_timeline(device: &Device<Self>) {
        device.raw().clear_timeline();
    }
}

impl CliBackend for AscendBackend {
    const KIND: BackendKind = BackendKind::Ascend;

    fn open(settings: &Settings) -> Result<Device<Self>, CliError> {
        settings.check()?;
        let options = AscendOptions { checked: settings.checked(), ..AscendOptions::default() };
        opened(settings, AscendBackend::with_options(options), |e| {
            matches!(e, AscendError::NotCompiledWithAscend).then_some(
                "feature `ascend` (CANN) or `ascend-emulated` (the emulated ACL runtime)",
            )
        })
    }
}

impl CliBackend for CudaBackend {
    const KIND: BackendKind = BackendKind::Cuda;

    fn open(settings: &Settings) -> Result<Device<Self>, CliError> {
        settings.check()?;
        let options = CudaOptions { checked: settings.checked(), ..CudaOptions::default() };
        opened(settings, CudaBackend::with_options(options), |e| {
            matches!(e, CudaError::NotCompiledWithCuda).then_some("feature `cuda` (on by default)")
        })
    }
}

/// A device backend's constructor's answer as the CLI's: the device (with a warning for the
/// reference-only settings it ignores), or [`CliError::BackendUnavailable`] — not compiled in
/// when `not_compiled` names the feature that builds it in, else the backend's own message.
fn opened<B: CliBackend, E: std::fmt::Display>(
    settings: &Settings,
    constructed: Result<Device<B>, E>,
    not_compiled: impl FnOnce(&E) -> Option<&'static str>,
) -> Result<Device<B>, CliError> {
    let device = constructed.map_err(|e| {
        let reason = match not_compiled(&e) {
            Some(enable) => Unavailable::NotCompiledIn { enable },
            None => Unavailable::CannotStart { message: e.to_string() },
        };
        CliError::BackendUnavailable { backend: B::KIND.name(), reason }
    })?;
    settings.warn_reference_only(B::KIND);
    Ok(device)
}

/// Evaluate `$body` with `$device` bound to the [`Device`] of `$kind` opened with `$settings`
/// (through [`CliBackend::open`]; its error returns from the enclosing function). The body is
/// compiled once per backend (kda-embed's `for_kind!`), so it calls functions generic over
/// `B: CliBackend`.
macro_rules! on_backend {
    ($kind:expr, $settings:expr, |$device:ident| $body:expr) => {{
        let settings: &$crate::cmd::backend::Settings = $settings;
        kda_embed::for_kind!($kind, |B| {
            let $device = <B as $crate::cmd::backend::CliBackend>::open(settings)?;
            $body
        })
    }};
}
pub(crate) use on_backend;

/// Fail with [`CliError::NeedsTimeline`] unless `device` records an op timeline.
pub fn require_timeline<B: CliBackend>(
    device: &Device<B>,
    command: &'static str,
) -> Result<(), CliError> {
    match B::timeline(device) {
        Some(_) => Ok(()),
        None => Err(CliError::NeedsTimeline { command, backend: B::KIND.name() }),
    }
}

/// One line for `kda info`: the capabilities of `B` opened with default settings, or why it
/// cannot start.
pub fn describe<B: CliBackend>() -> String {
    match B::open(&Settings::default()) {
        Ok(device) => capabilities(&device),
        Err(CliError::BackendUnavailable { backend, reason }) => {
            format!("{backend:<10} unavailable: {reason}")
        }
        Err(other) => format!("{:<10} unavailable: {other}", B::KIND.name()),
    }
}

/// A device's name and capabilities on one line.
pub fn capabilities<B: Backend>(device: &Device<B>) -> String {
    let info = device.info();
    let caps = &info.capabilities;
    let dtypes: Vec<_> = caps.gemm_inputs.iter().map(|d| d.name()).collect();
    format!(
        "{:<10} execution: {:<20} threads/op: {:<3} concurrent streams: {}  shared matrix units: \
         {}  gemm inputs: {}  native ops: {}  core operands: {}",
        info.name,
        caps.execution,
        caps.threads,
        yes_no(caps.concurrent_streams),
        yes_no(caps.shared_matrix_units),
        dtypes.join(", "),
        caps.native.describe(),
        CoreOperands::for_capabilities(caps).dtype().name(),
    )
}

fn yes_no(b: bool) -> &'static str {
    if b { "yes" } else { "no" }
}
