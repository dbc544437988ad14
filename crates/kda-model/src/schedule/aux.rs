//! The auxiliary stream the overlapped schedule forks the BFG work onto.

use std::fmt;
use std::sync::{Arc, OnceLock};

use kda_core::device::Device;
use kda_core::error::Result;
use kda_core::hal::Backend;

/// The overlapped schedule's auxiliary stream, created on first use. It is schedule state, not
/// the device's: each [`QkvBfgProjection`](super::QkvBfgProjection) makes its own, and layers that
/// should share one (the original implementation keeps one BFG stream per process) are given
/// clones of one `AuxStream`, which share the stream.
pub struct AuxStream<B: Backend> {
    slot: Arc<OnceLock<B::Stream>>,
}

impl<B: Backend> AuxStream<B> {
    pub fn new() -> Self {
        Self { slot: Arc::new(OnceLock::new()) }
    }

    /// The stream, created on `device` by the first call.
    pub fn get(&self, device: &Device<B>) -> Result<B::Stream> {
        if let Some(stream) = self.slot.get() {
            return Ok(stream.clone());
        }
        let fresh = device.new_stream()?;
        // Two threads may race here; the stream that lost is dropped unused.
        Ok(self.slot.get_or_init(|| fresh).clone())
    }

    /// The stream if it has been created.
    pub fn created(&self) -> Option<B::Stream> {
        self.slot.get().cloned()
    }
}

impl<B: Backend> Default for AuxStream<B> {
    fn default() -> Self {
        Self::new()
    }
}

impl<B: Backend> Clone for AuxStream<B> {
    fn clone(&self) -> Self {
        Self { slot: Arc::clone(&self.slot) }
    }
}

impl<B: Backend> fmt::Debug for AuxStream<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("AuxStream").field(&self.slot.get()).finish()
    }
}
