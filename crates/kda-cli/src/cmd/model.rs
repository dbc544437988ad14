//! What `kda run`, `kda trace` and `kda check` load: one layer of a real checkpoint directory,
//! or of a deterministic synthetic checkpoint of a preset's shapes (generated in memory, only
//! the rank's shard, nothing written to disk).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use kda_model::config::{KdaConfig, Tp};
use kda_model::layer::CoreOperands;
use kda_model::schedule::ProjectionSchedule;
use kda_model::weights::{Checkpoint, LayerWeights, LoadOptions, TensorSource, WeightError};
use kda_synth::checkpoint::{SyntheticCheckpoint, SyntheticSpec, scaled_config};
use kda_synth::workload::Workload;

use crate::error::CliError;

/// Model shapes of the synthetic checkpoint.
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum Preset {
    /// Kimi K3's gate forms and MXFP8 QKV at toy sizes (hidden 256, 4 heads of 32), TP 1.
    Tiny,
    /// Kimi Linear 48B (hidden 2304, 32 heads of 128, bf16 QKV, softplus gate), TP 1.
    KimiLinear,
    /// Kimi K3 (hidden 7168, 96 heads of 128, MXFP8 QKV, lower-bound gate), TP 8 rank 0.
    KimiK3Tp8,
    /// Kimi K3 on one device, TP 1.
    KimiK3,
}

impl Preset {
    pub fn config(self) -> KdaConfig {
        match self {
            Preset::Tiny => scaled_config(&KdaConfig::kimi_k3(), 256, 4, 32),
            Preset::KimiLinear => KdaConfig::kimi_linear_48b(),
            Preset::KimiK3Tp8 | Preset::KimiK3 => KdaConfig::kimi_k3(),
        }
    }

    pub fn tp_size(self) -> usize {
        if self == Preset::KimiK3Tp8 { 8 } else { 1 }
    }

    pub fn name(self) -> &'static str {
        match self {
            Preset::Tiny => "tiny (Kimi K3 forms at toy sizes)",
            Preset::KimiLinear => "Kimi Linear 48B",
            Preset::KimiK3Tp8 => "Kimi K3, TP 8",
            Preset::KimiK3 => "Kimi K3",
        }
    }
}

/// `--schedule`.
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum ScheduleArg {
    Serial,
    Overlapped,
}

impl From<ScheduleArg> for ProjectionSchedule {
    fn from(s: ScheduleArg) -> Self {
        match s {
            ScheduleArg::Serial => ProjectionSchedule::Serial,
            ScheduleArg::Overlapped => ProjectionSchedule::Overlapped,
        }
    }
}

/// `--core-operands`: the dtype of the KDA core's operands (`docs/design/kda.md#core-operand-dtype`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum CoreArg {
    F32,
    Bf16,
}

impl From<CoreArg> for CoreOperands {
    fn from(c: CoreArg) -> Self {
        match c {
            CoreArg::F32 => CoreOperands::F32,
            CoreArg::Bf16 => CoreOperands::Bf16,
        }
    }
}

/// Where the layer comes from.
#[derive(Debug, Args)]
pub struct ModelArgs {
    /// An HF-style checkpoint directory (config.json and safetensors, single or sharded)
    /// instead of a synthetic one.
    #[arg(long, value_name = "DIR")]
    pub checkpoint: Option<PathBuf>,
    /// The layer index (`model.layers.{I}.self_attn.*`).
    #[arg(long, default_value_t = 0)]
    pub layer: usize,
    /// Shapes of the synthetic checkpoint (ignored with --checkpoint).
    #[arg(long, value_enum, default_value_t = Preset::KimiK3Tp8)]
    pub preset: Preset,
    /// Tensor-parallel size (default: the preset's, or 1 with --checkpoint).
    #[arg(long)]
    pub tp_size: Option<usize>,
    /// This rank's position in the tensor-parallel group.
    #[arg(long, default_value_t = 0)]
    pub tp_rank: usize,
    /// Seed of the synthetic checkpoint and of the inputs.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// One rank's loaded layer (host side: forget gate composed, QKV quantized as configured).
#[derive(Debug)]
pub struct Loaded {
    pub config: KdaConfig,
    pub tp: Tp,
    pub weights: LayerWeights,
    /// Where the weights came from, for reports.
    pub origin: String,
    /// The files read (config and checkpoint files; none for a synthetic checkpoint): what no
    /// output may overwrite.
    pub files: Vec<PathBuf>,
    /// Reading (or generating) the checkpoint and composing the fused weights.
    pub load_time: Duration,
}

/// The prefill-then-decode workload of `--requests` × `--tokens` (each at least 1), then
/// `decode_steps` decode steps, with the model's seed.
pub fn workload(
    model: &ModelArgs,
    requests: usize,
    tokens: usize,
    decode_steps: usize,
) -> Result<Workload, CliError> {
    for (arg, value) in [("--requests", requests), ("--tokens", tokens)] {
        if value == 0 {
            return Err(CliError::Argument { arg, reason: "must be at least 1".into() });
        }
    }
    Ok(Workload { requests, prompt_tokens: tokens, decode_steps, seed: model.seed })
}

/// Load the layer `args` names.
pub fn load(args: &ModelArgs) -> Result<Loaded, CliError> {
    let start = Instant::now();
    let mut files = Vec::new();
    let (config, source, origin): (KdaConfig, Box<dyn TensorSource>, String) =
        match &args.checkpoint {
            Some(dir) => {
                let config_path = dir.join("config.json");
                let config = KdaConfig::from_file(&config_path).map_err(WeightError::from)?;
                let origin = format!("checkpoint {}", dir.display());
                let checkpoint = Checkpoint::open(dir)?;
                crate::signals::name_mapped_files(&checkpoint.mapped_files());
                files.push(config_path);
                let read = checkpoint.files().into_iter().chain(checkpoint.index_file());
                files.extend(read.map(PathBuf::from));
                (config, Box::new(checkpoint), origin)
            }
            None => {
                let config = args.preset.config();
                let spec = SyntheticSpec::new(config.clone(), args.seed);
                let origin = format!(
                    "synthetic {} checkpoint (seed {}, generated in memory)",
                    args.preset.name(),
                    args.seed
                );
                (config, Box::new(SyntheticCheckpoint::new(spec)), origin)
            }
        };
    let default_tp = if args.checkpoint.is_some() { 1 } else { args.preset.tp_size() };
    let tp =
        Tp::new(args.tp_size.unwrap_or(default_tp), args.tp_rank).map_err(WeightError::from)?;
    let loaded = kda_model::weights::load_layer(
        source.as_ref(),
        &config,
        tp,
        args.layer,
        LoadOptions::default(),
    )?;
    Ok(Loaded { config, tp, weights: loaded.weights, origin, files, load_time: start.elapsed() })
}
