//! The KDA math's descriptors: the ops of the layer's core (`docs/design/kda.md#inside-kda`) as
//! values that [`crate::Op`] carries, the gate forms, and the constants the math fixes.
//!
//! | op | formula | file |
//! |---|---|---|
//! | [`CausalConv`], [`CausalConvUpdate`] | depthwise causal conv1d + SiLU, prefill / decode / speculative | [`conv`] |
//! | [`L2Norm`] | `x / sqrt(Σx² + 1e-6) · scale` | [`norm`] |
//! | [`KdaGate`] | softplus or lower-bound log decay ([`ChunkGate`]: its parameters, for [`KdaChunk`] to apply in-kernel) | [`gate`] |
//! | [`KdaRecurrent`], [`KdaChunk`] | the delta-rule recurrence, per token and chunked | [`recurrence`] |
//! | [`GatedRmsNorm`] | `x · rsqrt(mean(x²) + eps) · w · sigmoid(g)` | [`norm`] |
//! | [`ZeroPadding`] | zero the rows past the live tokens | [`mask`] |
//!
//! Each descriptor checks its own shapes and dtypes (`validate`, called by
//! [`crate::Op::validate`]); per-request metadata (offsets, slots, counts) is device data and is
//! checked by the kernels when they run. The reference kernels live in `kda-reference`
//! (`kernels/kda/`), the f64 oracles in `kda-testkit` (`oracle_kda`); the gate formulas
//! themselves in f64 are here ([`gate::exact`]), the one definition both use.

mod check;
pub mod conv;
pub mod gate;
pub mod mask;
pub mod norm;
pub mod recurrence;

pub use conv::{CausalConv, CausalConvUpdate, ConvDims, ConvUpdateDims, require_f32_conv_state};
pub use gate::{ChunkGate, GateDims, GateForm, KdaGate, SOFTPLUS_THRESHOLD};
pub use mask::{PaddingDims, ZeroPadding};
pub use norm::{GatedRmsNorm, L2NORM_EPS, L2Norm, RowDims};
pub use recurrence::{
    CHUNK_SIZE, ChunkHostMeta, KdaChunk, KdaRecurrent, RecurrenceDims, chunks_of,
};

/// The largest head dimension (`K`, `V`, a config's `head_dim`) kda accepts from a file: four
/// times the 128 of every released KDA model. One head's recurrent state is `K · V` f32 (1 MiB
/// at 512), and it is the one size a file names without holding it (a state cache, a zero
/// initial state), so it is bounded (`docs/design/reliability.md`).
pub const MAX_HEAD_DIM: usize = 512;
