//! The serial schedule (`docs/design/schedule.md#serial`): everything on the main stream, in the
//! order `DynamicQuant(x) → QKV GEMM → BFG GEMM → post-process(BFG)`. The baseline, the fallback
//! for a backend with one stream, and the oracle the overlapped schedule must equal bit for bit.

use crate::schedule::steps::Work;
use kda_core::error::Result;
use kda_core::hal::Backend;

pub(crate) fn run_serial<B: Backend>(work: &Work<'_, B>, main: &B::Stream) -> Result<()> {
    work.quantize(main)?;
    work.qkv_matmul(main)?;
    work.project_bfg(main)?;
    work.postprocess(main)
}
