//! `kda-model`: the KDA layer on top of kda-core's HAL, for any backend.
//!
//! - [`config`] and [`weights`]: `KdaConfig` from `config.json`, TP positions, and one rank's
//!   layer weights loaded from a safetensors checkpoint (the fused BFG with its load-time
//!   composed forget gate, fused QKV dense or MXFP8, packed conv weights).
//! - [`schedule`]: the serial and overlapped QKV/BFG projection schedules, generic over the HAL,
//!   and the beta contract at the dispatch boundary;
//! - [`layer`]: the KDA layer, [`KdaLayer`]: projections, dispatch over a continuous batch with
//!   a caller-owned [`StateCache`], gated norm and `o_proj`, generic over the HAL.
//! - [`plan`]: the planner's cost model: op times per chip from FLOPs and bytes, and a
//!   simulation of a recorded log's streams and events;
//!
//! No backend depends on this crate: backends implement kda-core's HAL, and the model runs on
//! any of them through `kda_core::Device`.

pub mod config;
pub mod layer;
pub mod plan;
pub mod schedule;
pub mod weights;

pub use layer::{BatchMeta, KdaLayer, StateCache};
