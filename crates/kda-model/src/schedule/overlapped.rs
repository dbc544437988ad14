//! The seeds' two-stage overlapped schedule (`docs/design/schedule.md#overlapped`), written once
//! for every backend.
//!
//! ```text
//! main: record hidden_ready                        aux: wait hidden_ready
//!                                                       BFG GEMM
//!                                                       record bfg_projection_ready
//! main: DynamicQuant (overlaps the BFG GEMM)
//!       record quant_ready
//!       wait bfg_projection_ready   (stage-1 join; dropped under MatrixOverlap::Concurrent)
//!       QKV GEMM                                   aux: wait quant_ready
//!                                                       post-process (overlaps the QKV GEMM)
//!                                                       record bfg_ready
//! main: wait bfg_ready              (joins the aux tail: consumers, frees and capture need it)
//! ```
//!
//! Why each event: the aux stream reads `x`, so it forks after `x` is ready (`hidden_ready`).
//! Where both GEMMs need the same matrix units, the QKV GEMM waits for the BFG GEMM
//! (`bfg_projection_ready`) so vector work hides under matrix work instead of two GEMMs fighting
//! for one unit. The post-process waits for DynamicQuant (`quant_ready`) so the two vector
//! kernels never contend either, and it runs under the QKV GEMM. Main waits for the *last* aux
//! node (`bfg_ready`): consumers must not read unfinished gates, a free of `x` on main must come
//! after the aux GEMM read it, and device graph capture rejects a forked stream that is not
//! joined back after its last work.

use crate::schedule::MatrixOverlap;
use crate::schedule::events::{Mutation, ScheduleEvent, ScheduleEvents};
use crate::schedule::steps::Work;
use kda_core::error::Result;
use kda_core::hal::Backend;

use ScheduleEvent::{BfgProjectionReady, BfgReady, HiddenReady, QuantReady};

pub(crate) fn run_overlapped<B: Backend>(
    work: &Work<'_, B>,
    (main, aux): (&B::Stream, &B::Stream),
    events: &ScheduleEvents<B>,
    policy: MatrixOverlap,
    mutation: Mutation,
) -> Result<()> {
    let b = work.device;
    let record = |event: ScheduleEvent, stream: &B::Stream| {
        if mutation.keeps_record(event) { b.record(events.get(event), stream) } else { Ok(()) }
    };
    let wait = |stream: &B::Stream, event: ScheduleEvent| {
        if mutation.keeps_wait(event) { b.wait(stream, events.get(event)) } else { Ok(()) }
    };

    // Stage 1: fork; the BFG GEMM on aux overlaps DynamicQuant on main.
    record(HiddenReady, main)?;
    wait(aux, HiddenReady)?;
    work.project_bfg(aux)?;
    record(BfgProjectionReady, aux)?;
    work.quantize(main)?;
    record(QuantReady, main)?;
    if policy == MatrixOverlap::Serialized {
        wait(main, BfgProjectionReady)?;
    }
    work.qkv_matmul(main)?;

    // Stage 2: the post-process on aux overlaps the QKV GEMM; then main joins the aux tail.
    wait(aux, QuantReady)?;
    let early = mutation == Mutation::RecordBfgReadyBeforePostprocess;
    if early {
        record(BfgReady, aux)?;
    }
    work.postprocess(aux)?;
    if !early {
        record(BfgReady, aux)?;
    }
    wait(main, BfgReady)
}
