//! The AscendC kernels' host side: their argument ABI ([`abi`]) and tiling ([`tiling`]). The
//! kernel sources are in `crates/kda-ascend/kernels/`; `cargo xtask kernels` compiles them.

pub mod abi;
pub mod tiling;
