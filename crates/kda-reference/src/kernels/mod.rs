//! The reference kernels: one function per op, run on a stream's worker thread.
//!
//! Kernels receive ops that [`kda_core::Op::validate`] accepted, so shapes and dtypes agree and
//! outputs overlap neither themselves nor their inputs; what remains is the stream contract
//! (see [`crate::buffer`]).

mod gemm;
mod memory;

use std::sync::Arc;

use kda_core::Op;
use rayon::ThreadPool;

use crate::ReferenceBackend;

/// How a kernel may parallelise: alone on its stream's thread, or across a shared pool.
#[derive(Clone, Debug)]
pub(crate) enum Exec {
    Serial,
    Pool(Arc<ThreadPool>),
}

impl Exec {
    /// Threads one kernel may use.
    pub(crate) fn threads(&self) -> usize {
        match self {
            Exec::Serial => 1,
            Exec::Pool(pool) => pool.current_num_threads(),
        }
    }

    /// Run `f` where rayon's parallel iterators use this context's threads.
    pub(crate) fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        match self {
            Exec::Serial => f(),
            Exec::Pool(pool) => pool.install(f),
        }
    }
}

/// Execute `op`; an `Err` is the message of an execution failure.
pub(crate) fn execute(op: &Op<ReferenceBackend>, exec: &Exec) -> Result<(), String> {
    match op {
        Op::Gemm { x, w, y } => exec.install(|| gemm::gemm(x, w, y, exec)),
        Op::Copy { src, dst } => memory::copy(src, dst),
        Op::Fill { dst, value } => memory::fill(dst, *value),
        Op::Upload { dst, data } => memory::upload(dst, data),
        Op::Download { src, slot } => memory::download(src, slot),
        Op::Host { f, .. } => f.call(),
    }
}
