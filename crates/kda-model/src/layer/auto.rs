//! [`LayerOptions::auto`]: the schedule and the F form the planner predicts fastest for a chip
//! and a batch shape (docs/design/planner.md#layeroptionsauto).
//!
//! A [`LayerPlan`] holds the whole layer's checked-mode op log (projections, conv, gate,
//! chunked or recurrent KDA, gated norm, `o_proj`) for each of the six configurations, recorded
//! at 1 and 2 tokens (one prefill request, or one and two single-token decode requests). Every
//! op's bytes and FLOPs are affine in the token count, so [`crate::plan::extrapolate`] gives
//! them at any T, and [`crate::plan::predict_with`] simulates the streams on a chip's figures.

use half::bf16;

use super::{BatchMeta, ForgetProjection, KdaLayer, LayerOptions, RequestSlots};
use crate::layer::error::Result;
use crate::plan::{self, ChipFigures, Simulation};
use crate::schedule::{MatrixOverlap, ProjectionSchedule};
use crate::weights::LayerWeights;
use kda_core::device::Device;
use kda_core::dtype::DType;
use kda_core::error::Error;
use kda_core::hal::Backend;
use kda_core::sanitize::Entry;

/// One of the configurations the planner compares.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct PlanConfig {
    pub name: &'static str,
    pub schedule: ProjectionSchedule,
    pub matrix_overlap: MatrixOverlap,
    pub forget: ForgetProjection,
}

impl PlanConfig {
    /// The layer options of this configuration.
    pub fn options(&self) -> LayerOptions {
        LayerOptions {
            schedule: Some(self.schedule),
            matrix_overlap: Some(self.matrix_overlap),
            forget: self.forget,
            ..LayerOptions::default()
        }
    }
}

const fn config(
    name: &'static str,
    forget: ForgetProjection,
    schedule: ProjectionSchedule,
    matrix_overlap: MatrixOverlap,
) -> PlanConfig {
    PlanConfig { name, schedule, matrix_overlap, forget }
}

/// Serial, overlapped with the GEMMs serialised, overlapped with the GEMMs concurrent; each
/// with F composed or staged (`docs/design/schedule.md#composed-or-staged-f`).
pub const PLAN_CONFIGS: [PlanConfig; 6] = {
    use ForgetProjection::{Composed, Staged};
    use MatrixOverlap::{Concurrent, Serialized};
    use ProjectionSchedule::{Overlapped, Serial};
    [
        config("serial", Composed, Serial, Serialized),
        config("overlapped, GEMMs serialized", Composed, Overlapped, Serialized),
        config("overlapped, GEMMs concurrent", Composed, Overlapped, Concurrent),
        config("staged F: serial", Staged, Serial, Serialized),
        config("staged F: overlapped, serialized", Staged, Overlapped, Serialized),
        config("staged F: overlapped, concurrent", Staged, Overlapped, Concurrent),
    ]
};

/// The shape of a batch of T tokens.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum BatchShape {
    /// One fresh request of T tokens (chunked prefill).
    Prefill,
    /// T requests of one token each (recurrent decode).
    Decode,
}

impl BatchShape {
    pub const ALL: [BatchShape; 2] = [BatchShape::Prefill, BatchShape::Decode];

    pub fn name(self) -> &'static str {
        match self {
            BatchShape::Prefill => "prefill",
            BatchShape::Decode => "decode",
        }
    }

    /// The batch of `tokens` tokens of this shape.
    pub fn meta(self, tokens: usize) -> BatchMeta {
        match self {
            BatchShape::Prefill => BatchMeta::prefills(&[tokens], &[0]),
            BatchShape::Decode => {
                let mut meta = BatchMeta::empty();
                for slot in 0..tokens {
                    // One token of a request that has already seen 16.
                    meta.push(1, 16, RequestSlots::Single(slot));
                }
                meta
            }
        }
    }
}

/// The token counts a [`LayerPlan`] records each forward at.
pub const RECORDED_TOKENS: [usize; 2] = [1, 2];

/// One configuration's recorded forwards of one batch shape.
#[derive(Clone, Debug)]
pub struct RecordedForward {
    pub config: PlanConfig,
    pub shape: BatchShape,
    /// The log at each of [`RECORDED_TOKENS`].
    pub logs: [Vec<Entry>; 2],
}

/// The layer's recorded forwards, for every configuration and batch shape.
#[derive(Clone, Debug, Default)]
pub struct LayerPlan {
    pub forwards: Vec<RecordedForward>,
}

/// One configuration's predicted forward.
#[derive(Clone, Debug)]
pub struct Prediction {
    pub config: PlanConfig,
    pub simulation: Simulation,
}

/// What [`LayerOptions::auto`] chose and the predictions behind it.
#[derive(Clone, Debug)]
pub struct Choice {
    pub chip: &'static str,
    pub shape: BatchShape,
    pub tokens: usize,
    /// Every configuration's prediction, in [`PLAN_CONFIGS`] order.
    pub predictions: Vec<Prediction>,
    /// The index of the chosen (fastest) configuration in `predictions`.
    pub chosen: usize,
}

impl Choice {
    pub fn config(&self) -> PlanConfig {
        self.predictions[self.chosen].config
    }

    /// One line: what was picked, its predicted time, and the runner-up's.
    pub fn explain(&self) -> String {
        let chosen = &self.predictions[self.chosen];
        let mut others: Vec<&Prediction> = self
            .predictions
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != self.chosen)
            .map(|(_, p)| p)
            .collect();
        others.sort_by(|a, b| a.simulation.makespan.total_cmp(&b.simulation.makespan));
        let us = |p: &Prediction| p.simulation.makespan * 1e6;
        let mut line = format!(
            "plan: {} on {} for a {} of {} tokens: predicted {:.1} µs",
            chosen.config.name,
            self.chip,
            self.shape.name(),
            self.tokens,
            us(chosen)
        );
        if let (Some(next), Some(worst)) = (others.first(), others.last()) {
            line.push_str(&format!(
                "; next best {} {:.1} µs, slowest {} {:.1} µs",
                next.config.name,
                us(next),
                worst.config.name,
                us(worst)
            ));
        }
        line
    }
}

impl LayerPlan {
    /// Records the layer of `weights` in every configuration and batch shape, at
    /// [`RECORDED_TOKENS`], on `device`, which must be in checked mode (its op log is the
    /// record). The forwards run for real, on one and two tokens.
    pub fn record<B: Backend>(
        device: &Device<B>,
        stream: &B::Stream,
        weights: &LayerWeights,
    ) -> Result<LayerPlan> {
        let _span = tracing::debug_span!("layer_plan.record", layer = weights.layer).entered();
        require_checked(device)?;
        let mut forwards = Vec::new();
        for config in PLAN_CONFIGS {
            let layer = KdaLayer::new(device, stream, weights, config.options())?;
            for shape in BatchShape::ALL {
                let mut logs: [Vec<Entry>; 2] = Default::default();
                for (log, &tokens) in logs.iter_mut().zip(&RECORDED_TOKENS) {
                    *log =
                        Self::record_forward(device, stream, &layer, &shape.meta(tokens), tokens)?;
                }
                forwards.push(RecordedForward { config, shape, logs });
            }
        }
        Ok(LayerPlan { forwards })
    }

    /// The op log of one forward of `layer` over `meta` (`tokens` rows of a fixed input, a fresh
    /// cache of `tokens` slots) on `device`, which must be in checked mode: every launch, in
    /// order, with its FLOPs and accesses ([`plan::work`]).
    pub fn record_forward<B: Backend>(
        device: &Device<B>,
        stream: &B::Stream,
        layer: &KdaLayer<B>,
        meta: &BatchMeta,
        tokens: usize,
    ) -> Result<Vec<Entry>> {
        require_checked(device)?;
        let hidden = layer.dims().hidden;
        let x = device.alloc(DType::BF16, &[tokens, hidden])?;
        let data: Vec<bf16> =
            (0..tokens * hidden).map(|i| bf16::from_f32(((i % 17) as f32 - 8.0) * 0.01)).collect();
        device.upload(stream, &x, &data)?;
        let mut out = device.alloc(DType::F32, &[tokens, hidden])?;
        let mut cache = layer.new_cache(stream, tokens, 0)?;
        device.synchronize(stream)?;
        let start = device.instrumentation().log().len();
        layer.forward(stream, &x, meta, &mut cache, &mut out)?;
        device.synchronize(stream)?;
        Ok(device.instrumentation().log().split_off(start))
    }

    /// Every configuration's predicted forward for a batch of `tokens` tokens of `shape`.
    pub fn predict(
        &self,
        chip: &ChipFigures,
        shape: BatchShape,
        tokens: usize,
    ) -> Result<Vec<Prediction>, plan::PlanError> {
        self.forwards
            .iter()
            .filter(|f| f.shape == shape)
            .map(|f| {
                let [a, b] = &f.logs;
                let works =
                    plan::extrapolate((RECORDED_TOKENS[0], a), (RECORDED_TOKENS[1], b), tokens)?;
                let simulation = plan::predict_with(a, &works, chip)?;
                Ok(Prediction { config: f.config, simulation })
            })
            .collect()
    }

    /// The fastest configuration for `tokens` tokens of `shape` on `chip`, with every
    /// configuration's prediction.
    pub fn choose(
        &self,
        chip: &ChipFigures,
        shape: BatchShape,
        tokens: usize,
    ) -> Result<Choice, plan::PlanError> {
        let predictions = self.predict(chip, shape, tokens)?;
        let chosen = (0..predictions.len())
            .min_by(|&a, &b| {
                predictions[a].simulation.makespan.total_cmp(&predictions[b].simulation.makespan)
            })
            .ok_or(plan::PlanError::NothingRecorded)?;
        Ok(Choice { chip: chip.name, shape, tokens, predictions, chosen })
    }
}

/// An error unless `device` records its op log (checked mode): the log is what a plan records.
fn require_checked<B: Backend>(device: &Device<B>) -> Result<()> {
    if device.instrumentation().is_checked() {
        return Ok(());
    }
    Err(Error::Param {
        op: "layer_plan",
        param: "device",
        expected: "a device in checked mode (its op log is what the plan records)".into(),
        actual: "a device with checked mode off".into(),
    }
    .into())
}

impl LayerOptions {
    /// The options the planner predicts fastest on `chip` for batches of `tokens` tokens of
    /// `shape`, and the choice with the predictions behind it ([`Choice::explain`]). A plan
    /// that cannot be predicted (no forward of `shape`, logs that do not line up) is an
    /// [`Error::Param`] on `plan`.
    pub fn auto(
        plan: &LayerPlan,
        chip: &ChipFigures,
        shape: BatchShape,
        tokens: usize,
    ) -> Result<(LayerOptions, Choice)> {
        let choice = plan.choose(chip, shape, tokens.max(1)).map_err(|e| Error::Param {
            op: "layer_options_auto",
            param: "plan",
            expected: format!("recorded forwards of every configuration for a {}", shape.name()),
            actual: e.to_string(),
        })?;
        Ok((choice.config().options(), choice))
    }
}
