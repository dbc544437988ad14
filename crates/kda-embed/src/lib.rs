//! `kda-embed`: kda as an inference engine drives it, the one implementation behind the Python
//! package (`kda-py`) and the C ABI (`kda-capi`); `docs/embedding.md` is its guide.
//!
//! - [`Runtime`]: a backend chosen by name at run time (`"reference"`, and `"cuda"` /
//!   `"ascend"` where compiled in), shared by the layers loaded on it;
//! - [`Layer`] and [`Cache`]: one KDA layer of a checkpoint for one TP rank and its per-slot
//!   state, run on the engine's arrays ([`ForeignArray`]: read in place where the layout
//!   allows, the output written in place) and, on a device backend, on the engine's stream;
//! - [`cache_view`]: the engine's own state cache used in place (`Layer::wrap_cache`, vLLM's
//!   and transformers' layouts);
//! - [`ops`]: MXFP8 quantization and the KDA recurrence alone;
//! - [`EmbedError`] with its [`ErrorKind`] (what an exception class or C error code says), and
//!   [`guard`], which turns a panic into an error so none crosses a language boundary;
//! - [`testing`]: synthetic checkpoints and the plain-Rust run the bindings are checked
//!   against.

#![deny(unsafe_op_in_unsafe_fn)]

pub mod array;
pub mod backends;
pub mod cache_view;
pub mod error;
pub mod layer;
pub mod ops;
pub mod runtime;
pub mod testing;

pub use array::{ForeignArray, Import, Memory};
pub use cache_view::CacheLayout;
pub use error::{EmbedError, ErrorKind, Result};
pub use layer::{
    BatchArgs, Cache, ForwardReport, KeepArg, Layer, LayerInfo, SlotsArg, parse_schedule,
};
pub use runtime::Runtime;

/// Run `f`, turning a panic into [`EmbedError::Panic`]: no panic unwinds into Python or C.
pub fn guard<T>(f: impl FnOnce() -> Result<T>) -> Result<T> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(result) => result,
        Err(payload) => {
            let message = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic without a message".into());
            Err(EmbedError::Panic(message))
        }
    }
}

/// kda's version, `major.minor.patch`.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
