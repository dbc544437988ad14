//! `kda layer`: one KDA layer of an HF-style checkpoint on a safetensors file of hidden states,
//! on the CPU reference (the numbers an engine's layer should reproduce) or the backend
//! `--backend` names.
//!
//! Input: `hidden_states` `[N, Hd]` (bf16 or f32) and `query_start_loc` i32 `[B + 1]`; every
//! request is a fresh prefill into its own state slot, rows past `query_start_loc[B]` are
//! padding. Output: `output` `[N, Hd]` f32, this rank's partial sum before the all-reduce, and
//! `final_state` `[B, lh, V, K]` f32 (v-first); with `--dump` also `beta` `[N, lh]`, `g1`,
//! `gate` (the activated log decay), `g2` and `core_attn_out` (before the norm) `[N, lh, D]`,
//! and `mixed_qkv` `[N, 3 lp]`, all f32 (padding rows zero).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use clap::Args;
use half::bf16;
use kda_core::{Backend, DType, Device, Tensor};
use kda_model::config::{KdaConfig, Tp};
use kda_model::layer::{BatchMeta, BatchShape, KdaLayer, LayerOptions, LayerTrace};
use kda_model::weights::{Checkpoint, LoadOptions, load_layer};

use super::backend::{BackendArg, Settings, on_backend};
use super::model::{CoreArg, ScheduleArg};
use super::tensor_file::{self, OutTensor, f32_tensor};
use crate::error::CliError;

#[derive(Debug, Args)]
pub struct LayerArgs {
    /// HF-style checkpoint directory (config.json and safetensors, single or sharded).
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// The layer index (`model.layers.{I}.self_attn.*`).
    #[arg(long, default_value_t = 0)]
    pub layer: usize,
    /// safetensors file with hidden_states [N, Hd] (bf16 or f32) and query_start_loc i32 [B+1].
    #[arg(long)]
    pub input: PathBuf,
    /// Where to write output [N, Hd] and final_state [B, lh, V, K] (f32).
    #[arg(long)]
    pub output: PathBuf,
    #[arg(long, default_value_t = 1)]
    pub tp_size: usize,
    #[arg(long, default_value_t = 0)]
    pub tp_rank: usize,
    /// The projection schedule.
    #[arg(long, value_enum, default_value_t = ScheduleArg::Overlapped)]
    pub schedule: ScheduleArg,
    /// Let the planner pick the schedule and the F form on this chip's figures (910b, 950,
    /// h200, host) for the input's live tokens, instead of --schedule; prints what it picked
    /// and the predicted times behind it in one line.
    #[arg(long, value_name = "CHIP")]
    pub auto: Option<String>,
    /// The KDA core's operand dtype; default: the backend's choice (bf16 on Ascend where CANN
    /// has aclnnChunkKdaFwd, f32 elsewhere).
    #[arg(long, value_enum)]
    pub core_operands: Option<CoreArg>,
    /// Also write the intermediates: beta, g1, gate, g2, mixed_qkv, core_attn_out.
    #[arg(long)]
    pub dump: bool,
    /// Threads per op: 1 runs on the stream's own thread, more use a shared pool (reference
    /// backend).
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
    #[command(flatten)]
    pub device: BackendArg,
}

/// The input file's batch.
struct LayerInput {
    dtype: DType,
    rows: usize,
    hidden: Vec<f32>,
    meta: BatchMeta,
}

pub fn run(args: &LayerArgs) -> Result<(), CliError> {
    let config = KdaConfig::from_file(&args.checkpoint.join("config.json"))
        .map_err(kda_model::weights::WeightError::from)?;
    let tp = Tp::new(args.tp_size, args.tp_rank).map_err(kda_model::weights::WeightError::from)?;
    let checkpoint = Checkpoint::open(&args.checkpoint)?;
    crate::signals::name_mapped_files(&checkpoint.mapped_files());
    let config_path = args.checkpoint.join("config.json");
    let mut inputs: Vec<&Path> = vec![&args.input, &config_path];
    inputs.extend(checkpoint.files().into_iter().chain(checkpoint.index_file()).map(Path::new));
    crate::fsio::check_outputs(&[("--output", &args.output)], &inputs)?;
    let input = read_input(args, config.hidden_size)?;
    let settings = Settings { threads: args.threads, ..Settings::default() };
    on_backend!(args.device.backend, &settings, |b| {
        run_on(args, &config, tp, &checkpoint, &input, b)
    })
}

fn run_on<B: Backend>(
    args: &LayerArgs,
    config: &KdaConfig,
    tp: Tp,
    checkpoint: &Checkpoint,
    input: &LayerInput,
    device: Device<B>,
) -> Result<(), CliError> {
    let stream = device.new_stream()?;
    let weights = load_layer(checkpoint, config, tp, args.layer, LoadOptions::default())?.weights;
    let options = match &args.auto {
        Some(chip) => {
            let tokens = input.meta.num_actual_tokens;
            let (options, choice) =
                super::plan::auto_options(chip, &weights, BatchShape::Prefill, tokens)?;
            println!("{}", choice.explain());
            options
        }
        None => LayerOptions { schedule: Some(args.schedule.into()), ..LayerOptions::default() },
    };
    let options = LayerOptions { core_operands: args.core_operands.map(Into::into), ..options };
    let layer = KdaLayer::new(&device, &stream, &weights, options)?;
    let d = *layer.dims();
    let requests = input.meta.num_requests();
    let mut cache = layer.new_cache(&stream, requests.max(1), 0)?;
    let x = device.alloc(input.dtype, &[input.rows, d.hidden])?;
    match input.dtype {
        DType::BF16 => {
            let v: Vec<bf16> = input.hidden.iter().map(|&x| bf16::from_f32(x)).collect();
            device.upload(&stream, &x, &v)?;
        }
        _ => device.upload(&stream, &x, &input.hidden)?,
    }
    let mut out = device.alloc(DType::F32, &[input.rows, d.hidden])?;
    let trace = layer.forward_traced(&stream, &x, &input.meta, &mut cache, &mut out)?;

    let (n, lh, hd) = (input.rows, d.local_heads, d.head_dim);
    let state_shape = [requests, lh, hd, hd];
    let state = cache.recurrent().narrow(0, 0, requests)?;
    let mut tensors = vec![
        f32_tensor("output", &[n, d.hidden], &device.download::<f32>(&stream, &out)?),
        f32_tensor("final_state", &state_shape, &device.download::<f32>(&stream, &state)?),
    ];
    if args.dump {
        tensors.extend(dump(&device, &stream, trace.as_ref(), n, lh, hd)?);
    }
    let metadata = HashMap::from([
        ("layer".to_string(), args.layer.to_string()),
        ("tp".to_string(), format!("{}/{}", tp.rank, tp.size)),
        ("schedule".to_string(), format!("{:?}", layer.schedule()).to_lowercase()),
        ("state_layout".to_string(), "[B, lh, V, K]".to_string()),
    ]);
    tensor_file::write(&args.output, &tensors, metadata)?;
    println!(
        "kda layer {} (tp {}/{}, {} schedule): {} requests, {} live of {n} tokens, lh={lh} D={hd}; \
         wrote output [{n}, {}] and final_state {state_shape:?}{} (f32) to {}",
        args.layer,
        tp.rank,
        tp.size,
        format!("{:?}", layer.schedule()).to_lowercase(),
        requests,
        input.meta.num_actual_tokens,
        d.hidden,
        if args.dump { " and the intermediates" } else { "" },
        args.output.display(),
    );
    Ok(())
}

/// Read and check `hidden_states` and `query_start_loc`.
fn read_input(args: &LayerArgs, hidden_size: usize) -> Result<LayerInput, CliError> {
    let path = &args.input;
    let file = tensor_file::read(path)?;
    let tensors = tensor_file::parse(path, &file)?;
    let needed = "hidden_states [N, Hd] and query_start_loc i32 [B + 1]";
    let get = |name: &'static str| {
        tensors.tensor(name).map_err(|_| CliError::MissingTensor {
            path: path.display().to_string(),
            name,
            needed,
        })
    };
    let view = get("hidden_states")?;
    let (dtype, hidden) = tensor_file::floats("hidden_states", &view)?;
    tensor_file::warn_non_finite(path, "hidden_states", hidden.iter().copied());
    let shape_error = |name: &str, dtype: String, shape: &[usize], reason: String| {
        CliError::Tensor { name: name.into(), dtype, shape: shape.to_vec(), reason }
    };
    let rows = match view.shape() {
        [rows, h] if *h == hidden_size => *rows,
        other => {
            let why = format!("expected [N, {hidden_size}] (hidden_size of the checkpoint)");
            return Err(shape_error("hidden_states", dtype.name().into(), other, why));
        }
    };
    let qsl_view = get("query_start_loc")?;
    let qsl = tensor_file::i32s("query_start_loc", &qsl_view)?;
    if qsl_view.shape().len() != 1 {
        let why = "expected [B + 1]".to_string();
        return Err(shape_error("query_start_loc", "i32".into(), qsl_view.shape(), why));
    }
    // Checked against the rows before anything (the state cache) is sized by it.
    let meta = BatchMeta::fresh_prefills(&qsl, rows).map_err(kda_model::layer::LayerError::from)?;
    Ok(LayerInput { dtype, rows, hidden, meta })
}

/// The intermediates as f32 `[N, ..]`, padding rows zero.
fn dump<B: Backend>(
    b: &Device<B>,
    s: &B::Stream,
    trace: Option<&LayerTrace<B>>,
    n: usize,
    lh: usize,
    hd: usize,
) -> Result<Vec<OutTensor>, CliError> {
    let full = |name: &str, t: Option<&Tensor<B>>, row: &[usize]| -> Result<OutTensor, CliError> {
        let width: usize = row.iter().product();
        let mut values = match t {
            Some(t) => download_f32(b, s, t)?,
            None => Vec::new(),
        };
        values.resize(n * width, 0.0);
        Ok(f32_tensor(name, &[&[n], row].concat(), &values))
    };
    let heads = [lh, hd];
    Ok(vec![
        full("beta", trace.map(|t| &t.beta), &[lh])?,
        full("g1", trace.map(|t| &t.g1), &heads)?,
        full("gate", trace.map(|t| &t.gate), &heads)?,
        full("g2", trace.map(|t| &t.g2), &heads)?,
        full("mixed_qkv", trace.map(|t| &t.mixed_qkv), &[3 * lh * hd])?,
        full("core_attn_out", trace.map(|t| &t.core_attn_out), &heads)?,
    ])
}

/// A float tensor's values as f32.
fn download_f32<B: Backend>(
    b: &Device<B>,
    s: &B::Stream,
    t: &Tensor<B>,
) -> Result<Vec<f32>, CliError> {
    Ok(match t.dtype() {
        DType::BF16 => b.download::<bf16>(s, t)?.into_iter().map(f32::from).collect(),
        _ => b.download::<f32>(s, t)?,
    })
}
