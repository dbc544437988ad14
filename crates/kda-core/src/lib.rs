//! `kda-core`: what every kda backend and tool shares.
//!
//! - [`hal`]: the [`Backend`] trait (streams, events, buffers, one `launch` entry point) and its
//!   stream/event and error-reporting semantics;
//! - [`dtype`]: element types (bf16, f16, f32, i32, u8, E4M3, E8M0);
//! - [`file`](mod@file): opening the files kda reads: regular files only, with size bounds;
//! - [`layout`] and [`tensor`]: strided device tensors and their copy-free views;
//! - [`op`]: device ops described as data;
//! - [`mx`]: the MXFP8 codec (E4M3, E8M0, both scale algorithms, layouts), the bit-exact spec;
//! - [`sanitize`]: checked mode (recording, happens-before analysis, hazards) and graph capture;
//! - [`kda`]: the KDA core ops' descriptors (conv, norms, gate, recurrence, chunked prefill,
//!   padding mask) and the gate forms.
//! - [`timeline`]: when each op ran, on which stream (overlap measurements, traces).
//! - [`device`]: [`Device`], the validating façade every caller goes through.
//!
//! The model (config, weights, schedules, the layer, the planner) is `kda-model`'s; no backend
//! depends on it.

pub mod device;
pub mod dtype;
pub mod error;
pub mod file;
pub mod graph;
pub mod hal;
pub mod kda;
pub mod layout;
pub mod mx;
pub mod op;
pub mod resource;
pub mod sanitize;
pub mod tensor;
pub mod timeline;

pub use device::Device;
pub use dtype::{DType, E8M0, Element, F8E4M3};
pub use error::{CaptureError, Error, Result, ViewError};
pub use graph::Graph;
pub use hal::{Backend, Validated};
pub use layout::Layout;
pub use mx::{MxError, MxFloat, ScaleAlg, ScaleLayout};
pub use op::{ComputeUnit, DownloadSlot, GemmDims, HostFn, Launch, Op, OpDims};
pub use resource::{
    BackendInfo, BufferHandle, BufferId, Capabilities, EventHandle, EventId, InstanceId, NativeOps,
    Resources, StreamHandle, StreamId,
};
pub use tensor::Tensor;
