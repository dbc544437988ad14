//! Test support that kda-py (`kda._testing`) and kda-capi's tests expose: synthetic checkpoints
//! written to disk, and the same layer run through the plain Rust API (kda's own buffers and
//! stream, no imported memory), which the embedded paths must equal bit for bit. Not a stable
//! API.

use std::path::Path;

use half::bf16;
use kda_core::DType;
use kda_model::config::{KdaConfig, Tp};
use kda_model::layer::{KdaLayer, LayerOptions};
use kda_model::schedule::ProjectionSchedule;
use kda_model::weights::{Checkpoint, WeightError};
use kda_reference::ReferenceBackend;
use kda_synth::checkpoint::{SyntheticCheckpoint, SyntheticSpec, scaled_config, write_checkpoint};

use crate::error::{EmbedError, Result};
use crate::layer::BatchArgs;

/// The presets [`write_synthetic_checkpoint`] knows.
pub const PRESETS: &str = "\"tiny\" (Kimi K3 forms: MXFP8 QKV, lower-bound gate; hidden 256, 4 \
                           heads of 32) or \"tiny-linear\" (Kimi Linear forms: bf16 QKV, softplus \
                           gate; hidden 128, 4 heads of 32)";

/// The config of a preset.
pub fn preset_config(preset: &str) -> Result<KdaConfig> {
    match preset {
        "tiny" => Ok(scaled_config(&KdaConfig::kimi_k3(), 256, 4, 32)),
        "tiny-linear" => Ok(scaled_config(&KdaConfig::kimi_linear_48b(), 128, 4, 32)),
        other => Err(EmbedError::Argument {
            param: "preset",
            expected: PRESETS,
            actual: other.to_string(),
        }),
    }
}

/// Write layer 0 of a deterministic synthetic checkpoint of `preset` (see [`PRESETS`]) to
/// `dir` (`config.json` and `model.safetensors`).
pub fn write_synthetic_checkpoint(dir: &Path, preset: &str, seed: u64) -> Result<()> {
    let checkpoint = SyntheticCheckpoint::new(SyntheticSpec::new(preset_config(preset)?, seed));
    write_checkpoint(dir, &checkpoint, 1)?;
    Ok(())
}

/// One forward of [`reference_run`]: `hidden` `[rows, hidden_size]` row-major (values exact in
/// `dtype`), and its batch.
#[derive(Clone, Debug)]
pub struct Step {
    pub hidden: Vec<f32>,
    pub dtype: DType,
    pub rows: usize,
    pub batch: BatchArgs,
}

/// The outputs of [`reference_run`]: each step's `[rows, hidden]` f32 output, and the final
/// recurrent states of every slot `[slots, lh, V, K]`.
#[derive(Clone, Debug, PartialEq)]
pub struct RunOutput {
    pub outputs: Vec<Vec<f32>>,
    pub states: Vec<f32>,
    /// `[slots, lh, V, K]`.
    pub states_shape: [usize; 4],
    pub hidden_size: usize,
}

/// Where a layer of a checkpoint comes from, and how it runs.
#[derive(Clone, Debug)]
pub struct LayerSpec<'a> {
    pub dir: &'a Path,
    pub layer: usize,
    pub tp_size: usize,
    pub tp_rank: usize,
    pub schedule: ProjectionSchedule,
}

/// `steps` through the plain Rust API on one cache of `slots` slots (room for `num_spec`
/// speculative tokens).
pub fn reference_run(
    spec: &LayerSpec<'_>,
    slots: usize,
    num_spec: usize,
    steps: &[Step],
) -> Result<RunOutput> {
    let config = KdaConfig::from_file(&spec.dir.join("config.json")).map_err(WeightError::from)?;
    let tp = Tp::new(spec.tp_size, spec.tp_rank).map_err(WeightError::from)?;
    let checkpoint = Checkpoint::open(spec.dir)?;
    let b = ReferenceBackend::new();
    let s = b.new_stream()?;
    let options = LayerOptions { schedule: Some(spec.schedule), ..LayerOptions::default() };
    let layer = KdaLayer::load(&b, &s, &checkpoint, &config, tp, spec.layer, options)?;
    let dims = *layer.dims();
    let hidden = dims.hidden;
    let mut cache = layer.new_cache(&s, slots, num_spec)?;
    let mut outputs = Vec::with_capacity(steps.len());
    for step in steps {
        let x = b.alloc(step.dtype, &[step.rows, hidden])?;
        match step.dtype {
            DType::BF16 => {
                let v: Vec<bf16> = step.hidden.iter().map(|&f| bf16::from_f32(f)).collect();
                b.upload(&s, &x, &v)?;
            }
            _ => b.upload(&s, &x, &step.hidden)?,
        }
        let mut out = b.alloc(DType::F32, &[step.rows, hidden])?;
        layer.forward(&s, &x, &step.batch.to_meta()?, &mut cache, &mut out)?;
        outputs.push(b.download::<f32>(&s, &out)?);
    }
    let states = b.download::<f32>(&s, cache.recurrent())?;
    let states_shape = [slots, dims.local_heads, dims.head_dim, dims.head_dim];
    Ok(RunOutput { outputs, states, states_shape, hidden_size: hidden })
}
