//! The kernels' argument layout, defined once in `kda-ascend-sys` (shared with the emulated
//! runtime, as `kda_kernel_abi.h` is shared with the kernels).

pub use kda_ascend_sys::abi::*;
