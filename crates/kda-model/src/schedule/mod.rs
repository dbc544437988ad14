//! The QKV/BFG projection schedules (`docs/design/schedule.md`), written once over the HAL.
//!
//! [`QkvBfgProjection`] takes `x [T, Hd]` and one rank's device weights
//! ([`ProjectionWeights`]) and returns what dispatch consumes ([`Projected`]): `mixed_qkv`, beta
//! (fp32, preprocessed), g1 and g2, as the layer forward (`docs/design/kda.md#the-layer-forward`)
//! has them. It runs either [`ProjectionSchedule::Serial`] (everything on the main stream) or
//! [`ProjectionSchedule::Overlapped`] (the BFG GEMM and its post-process on the backend's
//! [auxiliary stream](AuxStream), in two stages with the main stream's DynamicQuant and
//! QKV GEMM, four events, the aux tail joined back); both give the same bits.
//!
//! [`MatrixOverlap`] says whether the two GEMMs may run together: the seeds serialise them
//! because on Ascend both need the Cube units; where matrix work does not share one unit (CPU
//! cores, a GPU a low-M GEMM leaves mostly idle), `Concurrent` drops only the stage-1 join and
//! keeps every other event, so it stays hazard-free and capture-valid
//! (`docs/design/schedule.md#matrix-overlap`).
//!
//! - [`weights`]: the device weights (dense or MXFP8 QKV; composed or staged F);
//! - [`qkv_path`]: the precision the QKV projection runs in (MXFP8 or bf16), from the capabilities;
//! - [`qkv_route`]: whether DynamicQuant is split out of the QKV linear
//!   (`docs/design/kda.md#behaviour-10`);
//! - [`buffers`]: outputs and workspace, and the views handed to dispatch;
//! - [`steps`]: the ops both schedules queue, under the seeds' labels;
//! - `serial` and `overlapped`: the two orders;
//! - [`beta`]: [`prepare_beta`], the beta contract at the dispatch boundary
//!   (`docs/design/schedule.md#the-beta-contract`);
//! - [`events`]: the four events by name, and the test-only [`Mutation`]s.

mod aux;
pub mod beta;
pub mod buffers;
pub mod events;
mod overlapped;
pub mod qkv_path;
pub mod qkv_route;
mod serial;
pub mod steps;
pub mod weights;

pub use aux::AuxStream;
pub use beta::prepare_beta;
pub use buffers::{Projected, ProjectionBuffers};
pub use events::{Mutation, ScheduleEvent, ScheduleEvents};
pub use qkv_path::QkvPath;
pub use qkv_route::QkvRoute;
pub use steps::labels;
pub use weights::{BfgWeight, ProjectionDims, ProjectionWeights, QkvWeight};

use kda_core::device::Device;
use kda_core::dtype::DType;
use kda_core::error::{Error, Result};
use kda_core::hal::Backend;
use kda_core::resource::Capabilities;
use kda_core::tensor::Tensor;

use steps::Work;

/// Which order the projections run in.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum ProjectionSchedule {
    /// Everything on the main stream.
    Serial,
    /// The BFG side on the auxiliary stream, overlapped in two stages
    /// (`docs/design/schedule.md#overlapped`).
    Overlapped,
}

impl ProjectionSchedule {
    /// Overlapped where streams really run concurrently, serial otherwise.
    pub fn for_capabilities(caps: &Capabilities) -> Self {
        if caps.concurrent_streams { Self::Overlapped } else { Self::Serial }
    }
}

/// Whether the overlapped schedule lets its two GEMMs run at the same time.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum MatrixOverlap {
    /// The seeds' order: main waits on `bfg_projection_ready` before the QKV GEMM.
    Serialized,
    /// Without that stage-1 join; every other event stays.
    Concurrent,
}

impl MatrixOverlap {
    /// Serialized where the backend's streams share matrix units, concurrent otherwise.
    pub fn for_capabilities(caps: &Capabilities) -> Self {
        if caps.shared_matrix_units { Self::Serialized } else { Self::Concurrent }
    }
}

/// One layer's QKV and BFG projections on one rank, with a schedule.
#[derive(Debug)]
pub struct QkvBfgProjection<B: Backend> {
    device: Device<B>,
    weights: ProjectionWeights<B>,
    schedule: ProjectionSchedule,
    matrix_overlap: MatrixOverlap,
    events: ScheduleEvents<B>,
    aux: AuxStream<B>,
    /// [`Mutation::None`] except in tests and `kda check`'s self-test.
    mutation: Mutation,
}

impl<B: Backend> QkvBfgProjection<B> {
    /// `schedule` with the matrix-overlap policy the backend's capabilities choose.
    ///
    /// MXFP8 QKV weights need the backend's native MX ops (`capabilities.native` `mx_quant` and
    /// `mx_gemm`, as [`QkvPath::resolve`] requires): on a backend without them (Ascend A2/A3) the
    /// projection is refused here, with an [`Error::Param`] naming what is missing, instead of
    /// failing at its first quantization with half a schedule queued.
    pub fn new(
        device: &Device<B>,
        weights: ProjectionWeights<B>,
        schedule: ProjectionSchedule,
    ) -> Result<Self> {
        let info = device.info();
        let native = info.capabilities.native;
        if matches!(weights.qkv(), QkvWeight::Mxfp8 { .. }) && !native.mxfp8() {
            return Err(Error::Param {
                op: "qkv_bfg_projection",
                param: "ProjectionWeights::qkv",
                expected: "QkvWeight::Bf16: QkvWeight::Mxfp8 needs capabilities.native mx_quant \
                           and mx_gemm"
                    .into(),
                actual: format!(
                    "QkvWeight::Mxfp8 on the {} backend, whose capabilities.native has {}",
                    info.name,
                    native.describe()
                ),
            });
        }
        let matrix_overlap = MatrixOverlap::for_capabilities(&info.capabilities);
        Ok(Self {
            device: device.clone(),
            weights,
            schedule,
            matrix_overlap,
            events: ScheduleEvents::new(device)?,
            aux: AuxStream::new(),
            mutation: Mutation::None,
        })
    }

    /// Override the matrix-overlap policy.
    pub fn with_matrix_overlap(mut self, policy: MatrixOverlap) -> Self {
        self.matrix_overlap = policy;
        self
    }

    /// Apply `mutation` to every overlapped call from now on (tests, and `kda check`'s
    /// self-test). Not for production use.
    #[doc(hidden)]
    pub fn with_mutation(mut self, mutation: Mutation) -> Self {
        self.mutation = mutation;
        self
    }

    /// Fork onto `aux` (shared with other projections) instead of a stream of this one's own.
    pub fn with_aux_stream(mut self, aux: AuxStream<B>) -> Self {
        self.aux = aux;
        self
    }

    /// The auxiliary stream the overlapped schedule forks onto.
    pub fn aux_stream(&self) -> &AuxStream<B> {
        &self.aux
    }

    /// Change the schedule (the weights and events stay).
    pub fn with_schedule(mut self, schedule: ProjectionSchedule) -> Self {
        self.schedule = schedule;
        self
    }

    pub fn schedule(&self) -> ProjectionSchedule {
        self.schedule
    }

    pub fn matrix_overlap(&self) -> MatrixOverlap {
        self.matrix_overlap
    }

    pub fn weights(&self) -> &ProjectionWeights<B> {
        &self.weights
    }

    /// The overlapped schedule's events (to read a recorded log by event name).
    pub fn events(&self) -> &ScheduleEvents<B> {
        &self.events
    }

    /// How the QKV linear runs on `x`, after checking that `x` is `[T, Hd]` of a dtype it takes.
    pub fn route(&self, x: &Tensor<B>) -> Result<QkvRoute> {
        const OP: &str = "projection";
        let hidden = self.weights.dims().hidden;
        if x.shape().len() != 2 || x.shape()[1] != hidden {
            return Err(Error::Shape {
                op: OP,
                param: "x",
                expected: format!("[T, {hidden}]"),
                actual: x.shape().to_vec(),
            });
        }
        let route = QkvRoute::decide(self.weights.qkv(), x.dtype(), x.shape().len());
        let ok = match route {
            QkvRoute::Dense => x.dtype().is_float(),
            QkvRoute::SplitQuant { .. } | QkvRoute::QuantInLinear { .. } => {
                matches!(x.dtype(), DType::BF16 | DType::F32)
            }
        };
        if !ok {
            let expected = if route == QkvRoute::Dense { "a float" } else { "bf16 or f32" };
            return Err(Error::DType {
                op: OP,
                param: "x",
                expected: expected.into(),
                actual: x.dtype(),
            });
        }
        Ok(route)
    }

    /// Allocate the outputs and workspace of a call on `x`.
    pub fn alloc_buffers(&self, x: &Tensor<B>) -> Result<ProjectionBuffers<B>> {
        let route = self.route(x)?;
        ProjectionBuffers::alloc(&self.device, &self.weights, route, x.shape()[0])
    }

    /// Project `x` (`[T, Hd]`, ready in the order of `main`) into fresh buffers. Returns once
    /// the work is queued; everything returned is ready in the order of `main`.
    pub fn forward(&self, main: &B::Stream, x: &Tensor<B>) -> Result<Projected<B>> {
        let bufs = self.alloc_buffers(x)?;
        self.forward_into(main, x, &bufs)
    }

    /// [`Self::forward`] into caller-provided buffers (from [`Self::alloc_buffers`]), as a
    /// captured graph needs.
    pub fn forward_into(
        &self,
        main: &B::Stream,
        x: &Tensor<B>,
        bufs: &ProjectionBuffers<B>,
    ) -> Result<Projected<B>> {
        self.run(main, x, bufs, self.mutation)
    }

    /// [`Self::forward`] with one edit to the overlapped order, for the tests that show every
    /// event is needed.
    #[doc(hidden)]
    pub fn forward_mutated(
        &self,
        main: &B::Stream,
        x: &Tensor<B>,
        mutation: Mutation,
    ) -> Result<Projected<B>> {
        let bufs = self.alloc_buffers(x)?;
        self.run(main, x, &bufs, mutation)
    }

    fn run(
        &self,
        main: &B::Stream,
        x: &Tensor<B>,
        bufs: &ProjectionBuffers<B>,
        mutation: Mutation,
    ) -> Result<Projected<B>> {
        let route = self.route(x)?;
        if bufs.tokens() != x.shape()[0] {
            return Err(Error::Shape {
                op: "projection",
                param: "buffers",
                expected: format!("buffers for {} tokens (the rows of x)", x.shape()[0]),
                actual: vec![bufs.tokens()],
            });
        }
        // Checked before anything is queued, so a bad call leaves no half-queued schedule.
        let fits = bufs.quant.is_some() == (route != QkvRoute::Dense)
            && bufs.f_a.is_some() == matches!(self.weights.bfg(), BfgWeight::Staged { .. });
        if !fits {
            return Err(Error::Param {
                op: "projection",
                param: "buffers",
                expected: format!("buffers for {route:?} with this BFG form (`alloc_buffers`)"),
                actual: "buffers allocated for another route or BFG form".into(),
            });
        }
        let work = Work { device: &self.device, weights: &self.weights, x, bufs, route };
        match self.schedule {
            ProjectionSchedule::Serial => serial::run_serial(&work, main)?,
            ProjectionSchedule::Overlapped => {
                let aux = self.aux.get(&self.device)?;
                overlapped::run_overlapped(
                    &work,
                    (main, &aux),
                    &self.events,
                    self.matrix_overlap,
                    mutation,
                )?
            }
        }
        bufs.projected()
    }
}
