//! The host's peak multiply-add rates: the compute floor the reference's kernels are measured
//! against (`kda bench layer`). The MXFP8 GEMM's exact block sums run as f64 fused
//! multiply-adds (`docs/design/mxfp8.md#the-reference-engine-and-what-exactness-costs`), the
//! dense GEMMs as f32 ones; each rate is what one core sustains on twelve independent chains of
//! the widest vectors this CPU has (enough to cover the latency of its fused multiply-add
//! units), so no kernel of that precision can beat it. The vectors are those the kernels run on
//! (`Isa`).

use std::hint::black_box;
use std::time::{Duration, Instant};

use crate::kernels::Isa;

/// Fused multiply-adds per second of one core, per precision.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct FmaRates {
    pub f64_per_s: f64,
    pub f32_per_s: f64,
}

/// Independent accumulator chains per measurement.
const CHAINS: usize = 12;

/// Measures both rates on the calling thread, each for about `budget` (best of three runs).
pub fn fma_rates(budget: Duration) -> FmaRates {
    let _span = tracing::debug_span!("peak.fma_rates").entered();
    FmaRates {
        f64_per_s: best_rate(budget, chains::<true>),
        f32_per_s: best_rate(budget, chains::<false>),
    }
}

/// The best of three runs of `run` (which returns the multiply-adds it did in `rounds` rounds),
/// its round count grown until one run takes a third of `budget`.
fn best_rate(budget: Duration, run: fn(u64) -> u64) -> f64 {
    let mut rounds = 1024u64;
    loop {
        let start = Instant::now();
        black_box(run(rounds));
        if start.elapsed() * 3 >= budget || rounds >= 1 << 40 {
            break;
        }
        rounds *= 2;
    }
    (0..3)
        .map(|_| {
            let start = Instant::now();
            let done = run(black_box(rounds));
            done as f64 / start.elapsed().as_secs_f64().max(1e-9)
        })
        .fold(0.0, f64::max)
}

/// Defines `$name(rounds) -> multiply-adds done`: [`CHAINS`] chains `acc = acc · x + y` of the
/// vector type of `$set1`/`$fma`, each `$lanes` wide, in a function compiled for `$feature`.
macro_rules! chains_on {
    ($name:ident, $feature:literal, $set1:ident, $fma:ident, $lanes:literal, $scalar:ty) => {
        /// # Safety
        /// The CPU must support the function's target features.
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $feature)]
        unsafe fn $name(rounds: u64) -> u64 {
            use std::arch::x86_64::*;
            let (x, y) = ($set1(0.999_999 as $scalar), $set1(1e-7 as $scalar));
            let mut acc = [$set1(1.0 as $scalar); CHAINS];
            for _ in 0..rounds {
                for a in acc.iter_mut() {
                    *a = $fma(*a, x, y);
                }
            }
            black_box(acc);
            rounds * (CHAINS * $lanes) as u64
        }
    };
}

chains_on!(f64_avx512, "avx512f", _mm512_set1_pd, _mm512_fmadd_pd, 8, f64);
chains_on!(f32_avx512, "avx512f", _mm512_set1_ps, _mm512_fmadd_ps, 16, f32);
chains_on!(f64_avx2, "avx2,fma", _mm256_set1_pd, _mm256_fmadd_pd, 4, f64);
chains_on!(f32_avx2, "avx2,fma", _mm256_set1_ps, _mm256_fmadd_ps, 8, f32);

/// Plain `mul_add` chains: the rate on CPUs without a vector extension the kernels use.
fn scalar_chains<T: Copy + From<f32>>(rounds: u64, fma: fn(T, T, T) -> T) -> u64 {
    let (x, y) = (T::from(0.999_999), T::from(1e-7));
    let mut acc = [T::from(1.0); CHAINS];
    for _ in 0..rounds {
        for a in acc.iter_mut() {
            *a = fma(*a, x, y);
        }
    }
    black_box(acc);
    rounds * CHAINS as u64
}

/// [`CHAINS`] chains on the vectors the kernels run on ([`Isa::detect`]), in f64 when `F64`,
/// else f32: the multiply-adds done in `rounds` rounds.
fn chains<const F64: bool>(rounds: u64) -> u64 {
    match (Isa::detect(), F64) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::Avx512` means the CPU has AVX-512F.
        (Isa::Avx512, true) => unsafe { f64_avx512(rounds) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        (Isa::Avx512, false) => unsafe { f32_avx512(rounds) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::Avx2` means the CPU has AVX2 and FMA.
        (Isa::Avx2, true) => unsafe { f64_avx2(rounds) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        (Isa::Avx2, false) => unsafe { f32_avx2(rounds) },
        (_, true) => scalar_chains::<f64>(rounds, f64::mul_add),
        (_, false) => scalar_chains::<f32>(rounds, f32::mul_add),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each run counts the multiply-adds it did (the lanes of its vectors), and the rates are
    /// measured (no assertion on their size: tests never assert on time).
    #[test]
    fn chains_count_their_lanes() {
        let (f64_lanes, f32_lanes) = match Isa::detect() {
            Isa::Avx512 => (8, 16),
            Isa::Avx2 => (4, 8),
            Isa::Portable => (1, 1),
        };
        assert_eq!(chains::<true>(3), 3 * (CHAINS * f64_lanes) as u64);
        assert_eq!(chains::<false>(3), 3 * (CHAINS * f32_lanes) as u64);
        let r = fma_rates(Duration::from_millis(3));
        assert!(r.f64_per_s.is_finite() && r.f64_per_s > 0.0, "{r:?}");
        assert!(r.f32_per_s.is_finite() && r.f32_per_s > 0.0, "{r:?}");
    }
}
