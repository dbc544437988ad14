//! The reference kernels: one function per op, run on a stream's worker thread.
//!
//! Kernels receive ops that the [`kda_core::Device`] façade validated, with the sizes validation
//! computed ([`Validated`]), so shapes and dtypes agree and outputs overlap neither themselves nor
//! their inputs; what remains is the stream contract (see [`crate::buffer`]).

mod gemm;
mod gemm_small;
mod kda;
mod memory;
mod mx;
mod mx_gemm;

use std::sync::{Arc, Mutex, PoisonError};

use kda_core::{Launch, Validated};
use rayon::ThreadPool;

use crate::ReferenceBackend;
use crate::exclusion::Exclusion;

/// What kernels run with: the shared pool, if any, and reusable scratch memory.
#[derive(Clone, Debug, Default)]
pub(crate) struct Exec {
    pool: Option<Arc<ThreadPool>>,
    scratch: Arc<ScratchPool>,
    /// The operand spans of the ops running on this instance's streams.
    exclusion: Arc<Exclusion>,
}

impl Exec {
    /// Each op alone on its stream's thread.
    pub(crate) fn serial() -> Self {
        Self::default()
    }

    /// Ops parallelise across `pool`.
    pub(crate) fn pooled(pool: ThreadPool) -> Self {
        Self { pool: Some(Arc::new(pool)), ..Self::default() }
    }

    /// Threads one kernel may use.
    pub(crate) fn threads(&self) -> usize {
        self.pool.as_ref().map_or(1, |pool| pool.current_num_threads())
    }

    /// Run `f` where rayon's parallel iterators use this context's threads.
    pub(crate) fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        match &self.pool {
            None => f(),
            Some(pool) => pool.install(f),
        }
    }

    /// A scratch vector, returned to the pool when dropped.
    pub(crate) fn scratch(&self) -> Scratch<'_> {
        let buf = self.scratch.0.lock().unwrap_or_else(PoisonError::into_inner).pop();
        Scratch { buf: buf.unwrap_or_default(), pool: &self.scratch }
    }
}

/// Scratch vectors kept between ops. Large temporaries freshly allocated per op come from new
/// pages, and the page faults alone cost more than widening a bf16 weight; reusing them keeps the
/// pages mapped. (A thread-local would not do: in the shared pool a waiting thread may start
/// another op's kernel on the same thread.)
#[derive(Debug, Default)]
pub(crate) struct ScratchPool(Mutex<Vec<Vec<f32>>>);

/// Scratch vectors kept at most; more are freed when returned.
const MAX_SCRATCH: usize = 8;

/// A borrowed scratch vector (contents unspecified).
pub(crate) struct Scratch<'a> {
    buf: Vec<f32>,
    pool: &'a ScratchPool,
}

impl Scratch<'_> {
    /// The first `len` elements, growing the vector if needed (contents unspecified).
    pub(crate) fn take(&mut self, len: usize) -> &mut [f32] {
        if self.buf.len() < len {
            self.buf.resize(len, 0.0);
        }
        &mut self.buf[..len]
    }
}

impl Drop for Scratch<'_> {
    fn drop(&mut self) {
        let mut kept = self.pool.0.lock().unwrap_or_else(PoisonError::into_inner);
        if kept.len() < MAX_SCRATCH {
            kept.push(std::mem::take(&mut self.buf));
        }
    }
}

/// Execute a validated op with the sizes its validation computed; an `Err` is the message of an
/// execution failure.
pub(crate) fn execute(valid: &Validated<ReferenceBackend>, exec: &Exec) -> Result<(), String> {
    // Held until the kernel returns: memory safety whatever order the caller gave (see
    // `crate::exclusion`).
    let _held = exec.exclusion.acquire(valid.op());
    let launch = valid.launch().map_err(|e| e.to_string())?;
    match launch {
        Launch::Gemm { x, w, y, dims: _ } => exec.install(|| gemm::gemm(x, w, y, exec)),
        Launch::Copy { src, dst, dims: () } => memory::copy(src, dst),
        Launch::Fill { dst, value, dims: () } => memory::fill(dst, *value),
        Launch::Upload { dst, data, dims: () } => memory::upload(dst, data),
        Launch::Download { src, slot, dims: () } => memory::download(src, slot),
        Launch::Host { f, name: _, dims: () } => f.call(),
        Launch::DynamicQuant { x, data, scale, alg, dims: _ } => {
            mx::dynamic_quant(x, data, scale, *alg, exec)
        }
        Launch::MxDequant { data, scale, y, dims: _ } => mx::dequant(data, scale, y, exec),
        Launch::MxGemm { a, a_scale, w, w_scale, y, dims: _ } => {
            mx::gemm(a, a_scale, w, w_scale, y, exec)
        }
        Launch::CausalConv(op, d) => kda::conv::prefill(op, d, exec),
        Launch::CausalConvUpdate(op, d) => kda::conv::update(op, d, exec),
        Launch::L2Norm(op, d) => kda::norm::l2norm(op, d, exec),
        Launch::KdaGate(op, d) => kda::gate::kda_gate(op, d, exec),
        Launch::KdaRecurrent(op, d) => kda::recurrent::recurrent(op, d, exec),
        Launch::KdaChunk(op, d) => kda::chunk::chunk(op, d, exec),
        Launch::GatedRmsNorm(op, d) => kda::norm::gated_rms_norm(op, d, exec),
        Launch::ZeroPadding(op, d) => kda::mask::zero_padding(op, d),
        Launch::Sigmoid { x, y, dims: () } => kda::gate::sigmoid_op(x, y),
    }
}

/// Whether this CPU runs the AVX2/FMA builds of the hot loops.
pub(crate) fn has_avx2_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| {
            std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// The vector instructions the MXFP8 GEMM's micro-kernels run on (and the widest with fused
/// multiply-adds this CPU has, for [`crate::peak`]). Every choice computes the same exact block
/// sums, so no result depends on it.
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Isa {
    /// Plain Rust: the oracle of the vector kernels.
    Portable,
    /// AVX2 with fused multiply-adds (and F16C to decode): the tile as four `8 × 6` sub-tiles.
    Avx2,
    /// AVX-512 (F and BW): the tile's 24 columns in 24 registers of 8 rows.
    Avx512,
}

impl Isa {
    /// The widest kernel this CPU runs.
    pub(crate) fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            use std::sync::OnceLock;
            static ISA: OnceLock<Isa> = OnceLock::new();
            *ISA.get_or_init(|| {
                let has = |avx512| {
                    if avx512 {
                        std::arch::is_x86_feature_detected!("avx512f")
                            && std::arch::is_x86_feature_detected!("avx512bw")
                    } else {
                        has_avx2_fma() && std::arch::is_x86_feature_detected!("f16c")
                    }
                };
                if has(true) {
                    Isa::Avx512
                } else if has(false) {
                    Isa::Avx2
                } else {
                    Isa::Portable
                }
            })
        }
        #[cfg(not(target_arch = "x86_64"))]
        Isa::Portable
    }

    /// Every kernel this CPU runs, the portable one first.
    #[cfg(test)]
    pub(crate) fn available() -> Vec<Self> {
        [Isa::Portable, Isa::Avx2, Isa::Avx512]
            .into_iter()
            .filter(|&isa| isa == Isa::Portable || isa <= Isa::detect())
            .collect()
    }
}

/// Ask for the cache lines of `bytes` to be brought in ahead of their use (a hint: no effect on
/// results). Weight streams read a few hundred bytes from each of many rows, a pattern the
/// hardware prefetchers do not follow.
#[inline(always)]
pub(crate) fn prefetch<E>(bytes: &[E]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        let (start, len) = (bytes.as_ptr().cast::<i8>(), std::mem::size_of_val(bytes));
        for offset in (0..len).step_by(64) {
            // SAFETY: a prefetch never faults and has no architectural effect; the address lies
            // within `bytes`. SSE is part of the x86_64 baseline.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(start.add(offset)) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = bytes;
}
