//! [`Runtime`]: one backend instance chosen by name at run time, with the stream kda uses when
//! the engine passes none.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};

use kda_core::{Backend, Device};

use crate::backends::{
    AscendBackend, BackendKind, CudaBackend, Family, KnownBackend, PerBackend, ReferenceBackend,
};
use crate::{for_kind, on_backend};

use crate::error::{EmbedError, Result};

/// The backends an engine can name.
pub const BACKENDS: &str = BackendKind::NAMES;

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

/// The sessions a [`Runtime`] can hold, one per backend ([`PerBackend`]).
pub(crate) struct Sessions;

impl Family for Sessions {
    type Of<B: Backend> = Session<B>;
}

/// One backend instance chosen by name, shared by the layers loaded on it and their caches.
/// Cheap to clone; clones are the same instance. `Send + Sync`.
#[derive(Clone)]
pub struct Runtime {
    pub(crate) inner: Arc<PerBackend<Sessions>>,
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
        let Some(kind) = BackendKind::parse(name) else {
            return Err(EmbedError::Argument {
                param: "backend",
                expected: BackendKind::NAMES,
                actual: name.to_string(),
            });
        };
        let any = for_kind!(kind, |B| B::wrap::<Sessions>(Session::new(B::open(device)?)?));
        Ok(Self { inner: Arc::new(any) })
    }

    /// The backend's name.
    pub fn name(&self) -> &'static str {
        on_backend!(&*self.inner, |B, s| s.device.info().name)
    }

    /// Block until the work kda queued on its own stream has finished.
    pub fn synchronize(&self) -> Result<()> {
        on_backend!(&*self.inner, |B, s| Ok(s.device.synchronize(&s.stream)?))
    }
}

fn device_index(device: i64) -> Result<usize> {
    usize::try_from(device).map_err(|_| EmbedError::Argument {
        param: "device",
        expected: "a device ordinal >= 0",
        actual: device.to_string(),
    })
}

/// How an engine opens each backend on device `device` (the reference ignores it).
pub(crate) trait OpenBackend: KnownBackend {
    fn open(device: i64) -> Result<Device<Self>>;
}

impl OpenBackend for ReferenceBackend {
    fn open(_device: i64) -> Result<Device<Self>> {
        Ok(ReferenceBackend::new())
    }
}

impl OpenBackend for CudaBackend {
    fn open(device: i64) -> Result<Device<Self>> {
        let options =
            kda_cuda::CudaOptions { ordinal: device_index(device)?, ..Default::default() };
        CudaBackend::with_options(options).map_err(|e| match e {
            kda_cuda::CudaError::NotCompiledWithCuda => not_compiled("cuda"),
            e => unavailable("cuda", e),
        })
    }
}

impl OpenBackend for AscendBackend {
    fn open(device: i64) -> Result<Device<Self>> {
        let ordinal = i32::try_from(device_index(device)?).map_err(|_| EmbedError::Argument {
            param: "device",
            expected: "a device ordinal that fits i32",
            actual: device.to_string(),
        })?;
        let options = kda_ascend::AscendOptions { device: ordinal, ..Default::default() };
        AscendBackend::with_options(options).map_err(|e| match e {
            kda_ascend::AscendError::NotCompiledWithAscend => not_compiled("ascend"),
            e => unavailable("ascend", e),
        })
    }
}

/// A backend this build does not carry (its crate is a twin here).
fn not_compiled(backend: &'static str) -> EmbedError {
    let feature = match backend {
        "cuda" => "this build (without `cuda`)",
        _ => "this build (without `ascend`)",
    };
    kda_core::Error::Unsupported { backend, feature: feature.into() }.into()
}

fn unavailable(backend: &'static str, e: impl fmt::Display) -> EmbedError {
    kda_core::Error::Backend { backend, message: e.to_string() }.into()
}
