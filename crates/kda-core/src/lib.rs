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
//! - [`config`] and [`weights`]: `KdaConfig` from `config.json`, TP positions, and one rank's
//!   layer weights loaded from a safetensors checkpoint (the fused BFG with its load-time
//!   composed forget gate, fused QKV dense or MXFP8, packed conv weights).
//! - [`schedule`]: the serial and overlapped QKV/BFG projection schedules, generic over the HAL,
//!   and the beta contract at the dispatch boundary;
//! - [`plan`]: the planner's cost model: op times per chip from FLOPs and bytes, and a
//!   simulation of a recorded log's streams and events;
//! - [`timeline`]: when each op ran, on which stream (overlap measurements, traces).
//! - [`layer`]: the KDA layer, [`KdaLayer`]: projections, dispatch over a continuous batch with
//!   a caller-owned [`StateCache`], gated norm and `o_proj`, generic over the HAL.

pub mod config;
pub mod device;
pub mod dtype;
pub mod error;
pub mod file;
pub mod graph;
pub mod hal;
pub mod kda;
pub mod layer;
pub mod layout;
pub mod mx;
pub mod op;
pub mod plan;
pub mod resource;
pub mod sanitize;
pub mod schedule;
pub mod tensor;
pub mod timeline;
pub mod weights;

pub use device::Device;
pub use dtype::{DType, E8M0, Element, F8E4M3};
pub use error::{CaptureError, Error, Result, ViewError};
pub use graph::Graph;
pub use hal::{Backend, Validated};
pub use layer::{BatchMeta, KdaLayer, StateCache};
pub use layout::Layout;
pub use mx::{MxError, MxFloat, ScaleAlg, ScaleLayout};
pub use op::{ComputeUnit, DownloadSlot, GemmDims, HostFn, Op, OpDims};
pub use resource::{
    BackendInfo, BufferHandle, BufferId, Capabilities, EventHandle, EventId, InstanceId, NativeOps,
    Resources, StreamHandle, StreamId,
};
pub use tensor::Tensor;
