//! The backend as compiled without `acl` or `emulated`: the same names, a constructor that
//! returns [`AscendError::NotCompiledWithAscend`], and handle types that cannot exist (the
//! candle `dummy_cuda_backend` pattern).

use std::convert::Infallible;

use kda_core::hal::Allocation;
use kda_core::{
    Backend, BackendInfo, BufferHandle, BufferId, Device, EventHandle, EventId, InstanceId,
    Resources, Result, StreamHandle, StreamId, Validated,
};

use crate::error::AscendError;
use crate::options::AscendOptions;

/// The Ascend backend, not compiled in: no value of it exists.
#[derive(Clone, Debug)]
pub struct AscendBackend(Infallible);

/// Uninhabited handle types.
#[derive(Clone, Debug)]
pub struct AscendStream(Infallible);
#[derive(Clone, Debug)]
pub struct AscendEvent(Infallible);
#[derive(Clone, Debug)]
pub struct AscendBuffer(Infallible);

impl AscendBackend {
    pub fn new() -> std::result::Result<Device<Self>, AscendError> {
        Err(AscendError::NotCompiledWithAscend)
    }

    pub fn with_options(_options: AscendOptions) -> std::result::Result<Device<Self>, AscendError> {
        Err(AscendError::NotCompiledWithAscend)
    }
}

impl StreamHandle for AscendStream {
    fn id(&self) -> StreamId {
        match self.0 {}
    }
}

impl EventHandle for AscendEvent {
    fn id(&self) -> EventId {
        match self.0 {}
    }
}

impl BufferHandle for AscendBuffer {
    fn id(&self) -> BufferId {
        match self.0 {}
    }

    fn len_bytes(&self) -> usize {
        match self.0 {}
    }
}

impl Resources for AscendBackend {
    type Stream = AscendStream;
    type Event = AscendEvent;
    type Buffer = AscendBuffer;
}

impl Backend for AscendBackend {
    fn info(&self) -> BackendInfo {
        match self.0 {}
    }

    fn instance(&self) -> InstanceId {
        match self.0 {}
    }

    fn new_stream(&self) -> Result<AscendStream> {
        match self.0 {}
    }

    fn new_event(&self) -> Result<AscendEvent> {
        match self.0 {}
    }

    fn record(&self, _: &AscendEvent, _: &AscendStream) -> Result<()> {
        match self.0 {}
    }

    fn wait(&self, _: &AscendStream, _: &AscendEvent) -> Result<()> {
        match self.0 {}
    }

    fn synchronize(&self, _: &AscendStream) -> Result<()> {
        match self.0 {}
    }

    fn alloc(&self, _: usize) -> Result<Allocation<AscendBuffer>> {
        match self.0 {}
    }

    fn submit(&self, _: &AscendStream, _: &str, _: Validated<Self>) -> Result<()> {
        match self.0 {}
    }
}

#[cfg(test)]
#[allow(clippy::expect_used, reason = "tests")]
mod tests {
    use super::*;

    #[test]
    fn constructors_say_the_backend_is_not_compiled_in() {
        assert_eq!(AscendBackend::new().err(), Some(AscendError::NotCompiledWithAscend));
        let opts = AscendOptions::default();
        assert_eq!(
            AscendBackend::with_options(opts).err(),
            Some(AscendError::NotCompiledWithAscend)
        );
        let message = AscendError::NotCompiledWithAscend.to_string();
        assert!(message.contains("feature `acl`") && message.contains("`emulated`"), "{message}");
    }
}
