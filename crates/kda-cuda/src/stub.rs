//! The backend without the `cuda` feature: the same types, none of which can be made, so
//! downstream code compiles everywhere and [`CudaBackend::new`] says what to do (the candle
//! `dummy_cuda_backend` pattern).

use std::convert::Infallible;

use kda_core::graph::Graph;
use kda_core::hal::Allocation;
use kda_core::{
    Backend, BackendInfo, BufferHandle, BufferId, Device, EventHandle, EventId, InstanceId,
    Resources, Result, StreamHandle, StreamId, Validated,
};

use crate::{CudaError, CudaOptions, FastPaths, GraphRoute};

/// The CUDA backend; built without the `cuda` feature, it cannot be constructed.
#[derive(Clone, Debug)]
pub struct CudaBackend {
    never: Infallible,
}

/// A CUDA stream (uninhabited without the `cuda` feature).
#[derive(Clone, Debug)]
pub struct CudaStream {
    never: Infallible,
}

/// A CUDA event (uninhabited without the `cuda` feature).
#[derive(Clone, Debug)]
pub struct CudaEvent {
    never: Infallible,
}

/// Device memory (uninhabited without the `cuda` feature).
#[derive(Clone, Debug)]
pub struct CudaBuffer {
    never: Infallible,
}

impl CudaBackend {
    /// Always [`CudaError::NotCompiledWithCuda`].
    pub fn new() -> std::result::Result<Device<Self>, CudaError> {
        Self::with_options(CudaOptions::default())
    }

    /// Always [`CudaError::NotCompiledWithCuda`].
    pub fn with_options(_options: CudaOptions) -> std::result::Result<Device<Self>, CudaError> {
        Err(CudaError::NotCompiledWithCuda)
    }

    /// Unreachable: no instance exists.
    pub fn device_name(&self) -> &str {
        match self.never {}
    }

    /// Unreachable: no instance exists.
    pub fn fast_paths(&self) -> FastPaths {
        match self.never {}
    }

    /// Unreachable: no instance exists.
    pub fn cublas_library(&self) -> &'static str {
        match self.never {}
    }

    /// Unreachable: no instance exists.
    pub fn uses_memory_pool(&self) -> bool {
        match self.never {}
    }

    /// Unreachable: no instance exists.
    pub fn instantiate_graph(
        &self,
        _graph: &Graph<Self>,
        _stream: &CudaStream,
    ) -> Result<GraphRoute> {
        match self.never {}
    }

    /// Unreachable: no instance exists.
    pub fn forget_graph(&self, _graph: &Graph<Self>) {
        match self.never {}
    }

    /// Unreachable: no instance exists.
    pub fn elapsed_ms(
        &self,
        _stream: &CudaStream,
        _work: impl FnOnce() -> Result<()>,
    ) -> Result<f32> {
        match self.never {}
    }
}

impl StreamHandle for CudaStream {
    fn id(&self) -> StreamId {
        match self.never {}
    }
}

impl EventHandle for CudaEvent {
    fn id(&self) -> EventId {
        match self.never {}
    }
}

impl BufferHandle for CudaBuffer {
    fn id(&self) -> BufferId {
        match self.never {}
    }

    fn len_bytes(&self) -> usize {
        match self.never {}
    }
}

impl Resources for CudaBackend {
    type Stream = CudaStream;
    type Event = CudaEvent;
    type Buffer = CudaBuffer;
}

impl Backend for CudaBackend {
    fn info(&self) -> BackendInfo {
        match self.never {}
    }

    fn instance(&self) -> InstanceId {
        match self.never {}
    }

    fn new_stream(&self) -> Result<CudaStream> {
        match self.never {}
    }

    fn new_event(&self) -> Result<CudaEvent> {
        match self.never {}
    }

    fn record(&self, _event: &CudaEvent, _stream: &CudaStream) -> Result<()> {
        match self.never {}
    }

    fn wait(&self, _stream: &CudaStream, _event: &CudaEvent) -> Result<()> {
        match self.never {}
    }

    fn synchronize(&self, _stream: &CudaStream) -> Result<()> {
        match self.never {}
    }

    fn alloc(&self, _bytes: usize) -> Result<Allocation<CudaBuffer>> {
        match self.never {}
    }

    fn submit(&self, _stream: &CudaStream, _label: &str, _op: Validated<Self>) -> Result<()> {
        match self.never {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn construction_says_the_feature_is_missing() {
        assert_eq!(CudaBackend::new().unwrap_err(), CudaError::NotCompiledWithCuda);
    }
}
