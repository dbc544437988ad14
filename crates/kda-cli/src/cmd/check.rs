//! `kda check`: capture one layer forward as a graph in checked mode and report what the
//! validation found: whether every forked stream was joined back before the capture ended,
//! and the stream hazards the sanitizer saw. The captured graph is then replayed and compared
//! with an eager run. Exit code 0 only when the capture is valid, there are no hazards and the
//! replay matches.

use clap::Args;
use kda_core::{Backend, DType, Device};
use kda_model::layer::LayerError;
use kda_model::layer::{CoreOperands, KdaLayer, LayerOptions};
use kda_model::schedule::{Mutation, ScheduleEvent};
use kda_synth::workload::Workload;

use super::backend::{BackendArg, Settings, on_backend};
use super::model::{self, ModelArgs, ScheduleArg};
use crate::error::CliError;

#[derive(Debug, Args)]
pub struct CheckArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub device: BackendArg,
    #[arg(long, value_enum, default_value_t = ScheduleArg::Overlapped)]
    pub schedule: ScheduleArg,
    /// Requests in the captured prefill batch.
    #[arg(long, default_value_t = 2)]
    pub requests: usize,
    /// Prompt tokens per request.
    #[arg(long, default_value_t = 64)]
    pub tokens: usize,
    /// Test only: leave out the main stream's final join of the aux stream (`bfg_ready`), so
    /// the check must fail.
    #[arg(long, hide = true)]
    pub break_join: bool,
}

pub fn run(args: &CheckArgs) -> Result<(), CliError> {
    let w = model::workload(&args.model, args.requests, args.tokens, 0)?;
    let settings = Settings { checked: Some(true), ..Settings::default() };
    on_backend!(args.device.backend, &settings, |b| check_on(args, w, b))
}

fn check_on<B: Backend>(args: &CheckArgs, w: Workload, b: Device<B>) -> Result<(), CliError> {
    let main = b.new_stream()?;
    let loaded = model::load(&args.model)?;
    let mutation =
        if args.break_join { Mutation::DropWait(ScheduleEvent::BfgReady) } else { Mutation::None };
    // f32 core operands: the replay must equal an eager run bit for bit, and with bf16 ones a
    // backend may run a prefill on another implementation eagerly than under capture (Ascend:
    // CANN's aclnnChunkKdaFwd, which a graph cannot replay with new offsets, against kda's
    // chunk kernel; docs/ascend.md).
    let options = LayerOptions {
        schedule: Some(args.schedule.into()),
        mutation,
        core_operands: Some(CoreOperands::F32),
        ..LayerOptions::default()
    };
    let layer = KdaLayer::new(&b, &main, &loaded.weights, options)?;
    let hidden = layer.dims().hidden;
    let n = w.prefill_tokens();
    let x = b.alloc(DType::BF16, &[n, hidden])?;
    b.upload(&main, &x, &w.prefill_hidden(hidden))?;
    let mut cache = layer.new_cache(&main, w.requests, 0)?;
    let mut out = b.alloc(DType::F32, &[n, hidden])?;
    b.synchronize(&main)?;

    println!(
        "kda check: layer {} of the {}, TP {}/{}, prefill {} requests x {} tokens, {} schedule",
        args.model.layer,
        loaded.origin,
        loaded.tp.rank,
        loaded.tp.size,
        w.requests,
        w.prompt_tokens,
        format!("{:?}", layer.schedule()).to_lowercase()
    );
    b.begin_capture(&main)?;
    let queued = layer.forward(&main, &x, &w.prefill_meta(), &mut cache, &mut out);
    let captured = b.end_capture(&main).map_err(LayerError::from);
    let graph = match (queued, captured) {
        (Ok(()), Ok(graph)) => {
            println!(
                "  capture: valid ({} streams joined, {} ops)",
                graph.streams(),
                graph.ops().len()
            );
            Some(graph)
        }
        (Err(e), _) | (Ok(()), Err(e)) => {
            println!("  capture: INVALID: {e}");
            None
        }
    };
    let hazards = b.instrumentation().hazards();
    if hazards.is_empty() {
        println!("  hazards: none ({} calls checked)", b.instrumentation().log().len());
    } else {
        println!("  hazards: {}", hazards.len());
        for h in &hazards {
            println!("    {h}");
        }
    }
    let Some(graph) = graph else {
        return Err(CliError::CheckFailed { reason: "the capture is not valid".into() });
    };
    if !hazards.is_empty() {
        return Err(CliError::Hazards { count: hazards.len(), first: hazards[0].to_string() });
    }
    // Replay against an eager run of the same batch (a fresh prefill: the cache is rewritten).
    b.launch_graph(&graph, &main)?;
    let replayed: Vec<f32> = b.download(&main, &out)?;
    let mut eager_out = b.alloc(DType::F32, &[n, hidden])?;
    layer.forward(&main, &x, &w.prefill_meta(), &mut cache, &mut eager_out)?;
    let eager: Vec<f32> = b.download(&main, &eager_out)?;
    if replayed.iter().map(|v| v.to_bits()).ne(eager.iter().map(|v| v.to_bits())) {
        return Err(CliError::Mismatch { what: "layer output".into(), a: "replay", b: "eager" });
    }
    println!("  replay: equals eager execution bit for bit");
    println!("  valid");
    Ok(())
}
