//! `kda-ascend`: the Ascend NPU backend of kda.
//!
//! - `sys`: the CANN declarations of `kda-ascend-sys`: one list of prototypes as a table of
//!   function pointers, filled at run time from CANN's libraries (feature `acl`; the build needs
//!   no toolkit) or from the emulated runtime `kda-acl-emu` (feature `emulated`).
//! - [`AscendBackend`]: the kda-core HAL over them. Streams and `ACL_EVENT_SYNC` events, a
//!   caching allocator with stream-ordered reuse, host↔device copies, capture through
//!   `aclmdlRICapture*`; aclnn two-phase ops for the GEMMs, MXFP8 quantization and copies; the
//!   AscendC kernels of `kernels/` for the vector work, tiled by [`kernels::tiling`].
//! - Without either feature the crate compiles to a twin whose constructor returns
//!   [`AscendError::NotCompiledWithAscend`], so code naming the backend builds everywhere.
//!
//! `docs/ascend.md` says how to build and run it with CANN, and what is verified where.

#![deny(unsafe_op_in_unsafe_fn)]

pub mod error;
pub mod kernels;
mod options;

pub use error::AscendError;
pub use options::{AscendOptions, MxGemmPath};

#[cfg(any(feature = "acl", feature = "emulated"))]
mod backend;
#[cfg(any(feature = "acl", feature = "emulated"))]
pub mod sys;
#[cfg(any(feature = "acl", feature = "emulated"))]
pub use backend::{AclGraph, AscendBackend, AscendBuffer, AscendEvent, AscendStream};

#[cfg(not(any(feature = "acl", feature = "emulated")))]
mod twin;
#[cfg(not(any(feature = "acl", feature = "emulated")))]
pub use twin::{AscendBackend, AscendBuffer, AscendEvent, AscendStream};
