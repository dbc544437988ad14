//! The KDA core ops on the CPU (`docs/design/kda.md#inside-kda`; descriptors in [`kda_core::kda`]).
//!
//! Each file holds one concept: pure kernels on f32 slices (unit-tested against the f64 oracles
//! of `kda-testkit`) and a thin layer that reads the op's tensors, checks the per-request
//! metadata (device data the descriptor could not check), runs the kernels and writes the
//! results. Work is split over requests and heads across the shared pool when there is one.

pub(super) mod chunk;
pub(super) mod conv;
pub(super) mod gate;
pub(super) mod io;
pub(super) mod mask;
mod matmul;
pub(super) mod norm;
pub(super) mod recurrent;
mod simd;
