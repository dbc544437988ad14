//! [`Runtime`]: one backend instance chosen by name at run time, with the stream kda uses when
//! the engine passes none.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};

use kda_core::{Backend, Device};
use kda_reference::ReferenceBackend;

use crate::error::{EmbedError, Result};

/// The backends an engine can name.
pub const BACKENDS: &str = "\"reference\", \"cuda\" or \"ascend\"";

/// A backend instance, its own stream, and the engines' streams imported into it.
pub(crate) struct Session<B: Backend> {
    pub device: Device<B>,
    pub stream: B::Stream,
    /// Each engine stream imported once and kept for the session's life: a device backend keeps
    /// what work queued (or captured) on it uses with the stream handle
    /// (`docs/embedding.md#streams-the-engines-on-a-device`), so the handle must outlive every
    /// call, and every replay of an engine's graph that captured one.
    engine_streams: Mutex<HashMap<usize, B::Stream>>,
}

impl<B: Backend> Session<B> {
    fn new(device: Device<B>) -> Result<Self> {
        let stream = device.new_stream()?;
        Ok(Self { device, stream, engine_streams: Mutex::new(HashMap::new()) })
    }

    /// The engine's stream `handle` as a stream of this session, imported at its first use.
    ///
    /// # Safety
    /// As `kda_core::Device::import_stream`, for the life of this session: `handle` is a live
    /// stream of this device and outlives the session.
    pub unsafe fn engine_stream(&self, handle: usize) -> Result<B::Stream> {
        let mut streams = self.engine_streams.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(s) = streams.get(&handle) {
            return Ok(s.clone());
        }
        // SAFETY: the caller's contract.
        let stream = unsafe { self.device.import_stream(handle) }?;
        streams.insert(handle, stream.clone());
        Ok(stream)
    }
}

/// The backend behind a [`Runtime`], one variant per backend compiled in.
pub(crate) enum AnyRuntime {
    Reference(Session<ReferenceBackend>),
    #[cfg(feature = "cuda")]
    Cuda(Session<kda_cuda::CudaBackend>),
    #[cfg(feature = "ascend")]
    Ascend(Session<kda_ascend::AscendBackend>),
}

/// Run `$body` with `$s` bound to the session of whichever backend `$value` holds.
macro_rules! each_backend {
    ($value:expr, $s:ident => $body:expr) => {
        match $value {
            $crate::runtime::AnyRuntime::Reference($s) => $body,
            #[cfg(feature = "cuda")]
            $crate::runtime::AnyRuntime::Cuda($s) => $body,
            #[cfg(feature = "ascend")]
            $crate::runtime::AnyRuntime::Ascend($s) => $body,
        }
    };
}

/// One backend instance chosen by name, shared by the layers loaded on it and their caches.
/// Cheap to clone; clones are the same instance. `Send + Sync`.
#[derive(Clone)]
pub struct Runtime {
    pub(crate) inner: Arc<AnyRuntime>,
}

impl fmt::Debug for Runtime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Runtime({})", self.name())
    }
}

impl Runtime {
    /// The backend `name` (`"reference"`, `"cuda"`, `"ascend"`) on device `device` (ignored by
    /// the reference). A backend not compiled into this build is an
    /// [`ErrorKind::Unsupported`](crate::ErrorKind::Unsupported) error.
    pub fn new(name: &str, device: i64) -> Result<Self> {
        let any = match name {
            "reference" => AnyRuntime::Reference(Session::new(ReferenceBackend::new())?),
            "cuda" => cuda(device)?,
            "ascend" => ascend(device)?,
            other => {
                return Err(EmbedError::Argument {
                    param: "backend",
                    expected: BACKENDS,
                    actual: other.to_string(),
                });
            }
        };
        Ok(Self { inner: Arc::new(any) })
    }

    /// The backend's name.
    pub fn name(&self) -> &'static str {
        each_backend!(&*self.inner, s => s.device.info().name)
    }

    /// Block until the work kda queued on its own stream has finished.
    pub fn synchronize(&self) -> Result<()> {
        each_backend!(&*self.inner, s => Ok(s.device.synchronize(&s.stream)?))
    }
}

fn device_index(device: i64) -> Result<usize> {
    usize::try_from(device).map_err(|_| EmbedError::Argument {
        param: "device",
        expected: "a device ordinal >= 0",
        actual: device.to_string(),
    })
}

#[cfg(feature = "cuda")]
fn cuda(device: i64) -> Result<AnyRuntime> {
    let options = kda_cuda::CudaOptions { ordinal: device_index(device)?, ..Default::default() };
    let device =
        kda_cuda::CudaBackend::with_options(options).map_err(|e| unavailable("cuda", e))?;
    Ok(AnyRuntime::Cuda(Session::new(device)?))
}

#[cfg(not(feature = "cuda"))]
fn cuda(device: i64) -> Result<AnyRuntime> {
    device_index(device)?;
    Err(kda_core::Error::Unsupported { backend: "cuda", feature: "this build (without `cuda`)" }
        .into())
}

#[cfg(feature = "ascend")]
fn ascend(device: i64) -> Result<AnyRuntime> {
    let ordinal = i32::try_from(device_index(device)?).map_err(|_| EmbedError::Argument {
        param: "device",
        expected: "a device ordinal that fits i32",
        actual: device.to_string(),
    })?;
    let options = kda_ascend::AscendOptions { device: ordinal, ..Default::default() };
    let device =
        kda_ascend::AscendBackend::with_options(options).map_err(|e| unavailable("ascend", e))?;
    Ok(AnyRuntime::Ascend(Session::new(device)?))
}

#[cfg(not(feature = "ascend"))]
fn ascend(device: i64) -> Result<AnyRuntime> {
    device_index(device)?;
    Err(kda_core::Error::Unsupported {
        backend: "ascend",
        feature: "this build (without `ascend`)",
    }
    .into())
}

#[cfg(any(feature = "cuda", feature = "ascend"))]
fn unavailable(backend: &'static str, e: impl fmt::Display) -> EmbedError {
    kda_core::Error::Backend { backend, message: e.to_string() }.into()
}
