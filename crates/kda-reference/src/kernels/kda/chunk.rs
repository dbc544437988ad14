//! The chunked form of the KDA recurrence (prefill): chunks of 64 tokens, the WY/UT transform
//! inside a chunk, the state carried across chunks, and most of the work in small GEMMs.
//!
//! # The algorithm, per head and chunk
//!
//! With `L <= 64` tokens, the state `S` (`[K, V]`, K-first here) at the chunk start, `q` already
//! normalised and scaled, and `gc_t = g_0 + … + g_t` the within-chunk cumulative log decay (per
//! channel; non-increasing since `g <= 0`):
//!
//! ```text
//! A_kk[t, i] = beta_t Σ_c k_t[c] k_i[c] e^{gc_t[c] - gc_i[c]}     (i < t)
//! A_qk[t, i] =        Σ_c q_t[c] k_i[c] e^{gc_t[c] - gc_i[c]}     (i <= t)
//! [W | U]    = (I + A_kk)^{-1} [beta ⊙ e^{gc} ⊙ K | beta ⊙ V]
//! v_new      = U - W S
//! o          = (e^{gc} ⊙ Q) S + A_qk v_new
//! S'         = diag(e^{gc_last}) S + (e^{gc_last - gc_i} ⊙ K)^T v_new
//! ```
//!
//! Unrolling the four recurrence lines over a chunk gives exactly this: `v_new` are the
//! recurrence's `u_t`, which solve `(I + A_kk) u = beta ⊙ (V - e^{gc} K S)`. The triangular
//! solve is blocked: each 16-row block subtracts its products with the rows already solved (one
//! GEMM), then substitutes within the block (row axpys over contiguous rows).
//!
//! # Numerical safety: decay factors and sub-blocks of 16
//!
//! Every factor `e^{gc_t - gc_i}` (`t >= i`) is formed as a product of the per-token decays
//! `e^{g_s}`, `s = i+1 ..= t`, never as `e^{gc_t}` times `e^{-gc_i}`: with the K3 lower bound of
//! -5, `gc` spans up to 320 over a chunk, and `e^{320}` overflows f32 while `e^{-320}` is zero. A
//! product of factors `<= 1` cannot overflow; factors below `2^-60` are set to zero (they weigh a
//! term by less than 1e-18 against terms of its own size, far below f32 resolution), which keeps
//! every product of two factors a normal number: no subnormal operand ever slows a GEMM.
//!
//! `A_kk` and `A_qk` are built by sub-blocks of 16 tokens:
//!
//! - **Off-diagonal** pairs (all `i` in block `P` before all `t` in a later block) are factored
//!   around the reference `r` = last index of `P`:
//!   `e^{gc_t - gc_i} = e^{gc_t - gc_r} · e^{gc_r - gc_i}`, both factors `<= 1`. So block `P`
//!   against every later row is one GEMM `[(k_t | q_t) e^{gc_t - gc_r}] · [k_i e^{gc_r - gc_i}]^T`.
//! - **Diagonal** blocks are factored the same way around the row before the block (the chunk
//!   start for the first), where the right factors `e^{gc_r - gc_i}` are now `>= 1`, but only when
//!   every left factor of the block is at least `e^-40` (so no right factor exceeds `e^40`, and
//!   none was flushed); otherwise (fast decay, e.g. gates near the lower bound) each pair is
//!   summed directly, `Σ_c k_t k_i e^{gc_t - gc_i}`, with its factor a running product `<= 1`.
//!   (Summing every diagonal pair directly, 480 dot products per chunk, would cost about a third
//!   of the kernel; the guarded factoring makes them one small GEMM per block whenever it is
//!   safe, which for K3's gates is nearly always.)
//!
//! `g` is a log decay, `<= 0`; positive values go through the same formulas, but nothing then
//! bounds the factors.
//!
//! # NaN
//!
//! A NaN stays in its head: the triangular products multiply it by the zeros above the diagonal,
//! so it can reach the outputs of earlier tokens of its own chunk (the recurrence would keep
//! those finite), and from its token on everything that depends on it is NaN, the final state
//! included. Other heads and requests never see it.
//!
//! # The in-kernel gate
//!
//! With [`KdaChunk::gate`], `g` holds the raw logits: each head's row is activated as it is
//! staged ([`GateParams::activate`], the function the `KdaGate` kernel runs), so the chunk sees
//! the very bits `KdaGate` would have written, and the activated gate is never stored.
//!
//! The hot loop is compiled twice, for the baseline and for AVX2/FMA, chosen at run time; both
//! give the same bits (no fused multiply-adds outside the GEMMs).

use std::ops::Range;

use kda_core::kda::{CHUNK_SIZE, KdaChunk, L2NORM_EPS, RecurrenceDims, chunks_of};

use super::super::Exec;
use super::gate::GateParams;
use super::io::{
    Floats, par_map, read_f32, read_floats, read_i32, request_ranges, slot, with_f32_out,
};
use super::matmul::{Mat, MatMut, Update, matmul};
use super::recurrent::head_state;
use super::simd::{self, dot, dot3, exp, sub_terms};
use crate::ReferenceBackend;

/// Sub-block length for the factored `A` products.
const BLOCK: usize = 16;
/// Decay factors below this are zero (see the module docs): `2^-60`, so that the product of two
/// factors, or of a factor and a normalised key, stays a normal f32.
const TINY: f32 = 8.673_617e-19;
/// Smallest left factor for which a diagonal block is factored (`e^-40`).
const MIN_LEFT: f32 = 4.248_354e-18;
/// Right factors above this fall back to direct evaluation (absurdly large keys).
const MAX_FACTOR: f32 = 1e30;

/// The operands, all heads: row `t` of `q`, `k`, `g` is `[H, K]` at `t·H·K`, of `v` `[H, V]`, of
/// `beta` `[H]`; f32 or bf16, widened as the rows are staged. With `gate`, `g` holds raw
/// logits, activated as they are staged.
#[derive(Copy, Clone, Debug)]
pub(crate) struct Problem<'a> {
    pub q: &'a Floats<'a>,
    pub k: &'a Floats<'a>,
    pub v: &'a Floats<'a>,
    pub g: &'a Floats<'a>,
    pub gate: Option<&'a GateParams<'a>>,
    pub beta: &'a Floats<'a>,
    pub heads: usize,
    pub kd: usize,
    pub vd: usize,
    pub scale: f32,
    pub qk_l2norm: bool,
}

/// Run tokens `tokens` of heads `heads` through their states (`states[i]`: `[K, V]` K-first, in
/// place), writing their outputs to `out` (`[tokens.len(), G, V]` for the `G` heads: the
/// output tensor's own rows when the group is all heads). `direct_diagonal` forces the direct
/// evaluation of every diagonal sub-block (tests of the fallback).
///
/// The heads advance together chunk by chunk: a chunk's rows are first copied for all of them at
/// once, which reads whole `[H, K]` rows front to back (a single head's rows lie `H·K` floats
/// apart, a page or more, where the hardware prefetchers do not follow), then each head
/// computes from that copy in cache.
pub(crate) fn chunked_heads(
    p: &Problem<'_>,
    heads: Range<usize>,
    tokens: Range<usize>,
    states: &mut [Vec<f32>],
    out: &mut [f32],
    direct_diagonal: bool,
) {
    #[cfg(target_arch = "x86_64")]
    if simd::has_avx2_fma() {
        // SAFETY: the CPU has AVX2 and FMA (checked at run time), all this build assumes.
        unsafe { chunked_heads_avx2(p, heads, tokens, states, out, direct_diagonal) };
        return;
    }
    chunked_heads_impl(p, heads, tokens, states, out, direct_diagonal);
}

/// [`chunked_heads_impl`] compiled for AVX2/FMA.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn chunked_heads_avx2(
    p: &Problem<'_>,
    heads: Range<usize>,
    tokens: Range<usize>,
    states: &mut [Vec<f32>],
    out: &mut [f32],
    direct_diagonal: bool,
) {
    chunked_heads_impl(p, heads, tokens, states, out, direct_diagonal);
}

#[inline(always)]
fn chunked_heads_impl(
    p: &Problem<'_>,
    heads: Range<usize>,
    tokens: Range<usize>,
    states: &mut [Vec<f32>],
    out: &mut [f32],
    direct_diagonal: bool,
) {
    if p.kd == 0 || p.vd == 0 {
        out.fill(0.0);
        return;
    }
    let mut stage = Stage::new(heads.len(), p.kd, p.vd);
    let mut w = Work::new(p.kd, p.vd);
    let row = heads.len() * p.vd;
    let mut start = tokens.start;
    while start < tokens.end {
        let len = CHUNK_SIZE.min(tokens.end - start);
        let rows = &mut out[(start - tokens.start) * row..];
        stage.fill(p, heads.clone(), start, len);
        for (i, s) in states.iter_mut().enumerate() {
            w.load(&stage, i, len, p.scale, p.qk_l2norm);
            w.decay_products(len, direct_diagonal);
            w.solve(len);
            w.apply(len, s, &mut rows[i * p.vd..], row);
        }
        start += len;
    }
}

/// One chunk's raw rows for a group of `G` heads, `[C, G, K]` (`[C, G, V]`, `[C, G]`).
struct Stage {
    heads: usize,
    q: Vec<f32>,
    k: Vec<f32>,
    g: Vec<f32>,
    v: Vec<f32>,
    beta: Vec<f32>,
}

impl Stage {
    fn new(heads: usize, kd: usize, vd: usize) -> Self {
        let c = CHUNK_SIZE * heads;
        let z = |n: usize| vec![0.0f32; n];
        Self { heads, q: z(c * kd), k: z(c * kd), g: z(c * kd), v: z(c * vd), beta: z(c) }
    }

    /// Copy rows `start .. start + len` of heads `heads`: contiguous runs of `G·K` floats (and
    /// activate the gate's logits when the problem has a gate).
    #[inline(always)]
    fn fill(&mut self, p: &Problem<'_>, heads: Range<usize>, start: usize, len: usize) {
        let g = self.heads;
        for t in 0..len {
            let at = (start + t) * p.heads;
            let from = at + heads.start;
            let arrays = [
                (&mut self.q, p.q, p.kd),
                (&mut self.k, p.k, p.kd),
                (&mut self.g, p.g, p.kd),
                (&mut self.v, p.v, p.vd),
            ];
            for (dst, src, d) in arrays {
                src.copy_to(from * d, &mut dst[t * g * d..(t + 1) * g * d]);
            }
            p.beta.copy_to(from, &mut self.beta[t * g..(t + 1) * g]);
            if let Some(gate) = p.gate {
                let rows = self.g[t * g * p.kd..(t + 1) * g * p.kd].chunks_exact_mut(p.kd);
                for (h, row) in heads.clone().zip(rows) {
                    gate.activate(h, row);
                }
            }
        }
    }
}

/// Scratch for one head's chunks (a few hundred KB, reused chunk after chunk).
struct Work {
    kd: usize,
    vd: usize,
    /// `[C, K]`: normalised, scaled q; normalised k; `e^{g}`; `e^{gc}`; left factors.
    q: Vec<f32>,
    k: Vec<f32>,
    e1: Vec<f32>,
    eg: Vec<f32>,
    fac: Vec<f32>,
    beta: Vec<f32>,
    /// `[C, 2C]`: row `t` is `A_kk[t, ..]` then `A_qk[t, ..]`. Interleaving makes the rows of
    /// both an evenly strided matrix, so one GEMM fills a column block of each.
    aa: Vec<f32>,
    /// `[2C, K+V]`: rows `0..L` are `W | U`, rows `L..2L` hold `e^{gc} ⊙ Q` in the first `K`.
    z: Vec<f32>,
    /// `[2C, V]`: `[W; e^{gc} ⊙ Q] · S`.
    y: Vec<f32>,
    /// `[C, V]`.
    v_new: Vec<f32>,
    /// `[2C, K]`: left operands, rows `k_t ⊙ f_t`, `q_t ⊙ f_t` interleaved; later the key
    /// factors of the state update.
    left: Vec<f32>,
    /// `[BLOCK, K]`: right operands of one sub-block.
    right: Vec<f32>,
    /// `[K]`: a running product.
    run: Vec<f32>,
}

/// `x`, or zero when it is below [`TINY`] (NaN stays NaN).
#[inline(always)]
fn flush(x: f32) -> f32 {
    if x < TINY { 0.0 } else { x }
}

/// `out = src / sqrt(Σ src² + eps) · scale`: [`super::norm::l2norm_row`]'s arithmetic, into
/// another row (and inlined, so that it runs in the AVX2 build).
#[inline(always)]
fn l2norm_into(src: &[f32], scale: f32, out: &mut [f32]) {
    let inv = 1.0 / (dot(src, src) + L2NORM_EPS).sqrt();
    for (o, &x) in out.iter_mut().zip(src) {
        *o = x * inv * scale;
    }
}

/// Rows `k_i ⊙ r_i` into `out`, for the rows `k_i` of `keys`, last to first, with `r_i` the
/// running product of decays `e^{g}` after row `i` (`r_last = 1`, `r_i = flush(r_{i+1} ⊙
/// decays_i)` where `decays` holds the rows `1 ..` of the keys' own decay rows), kept in `run`.
#[inline(always)]
fn backward_factors(keys: &[f32], decays: &[f32], run: &mut [f32], out: &mut [f32]) {
    let kd = run.len();
    let rows = keys.len() / kd;
    run.fill(1.0);
    for i in (0..rows).rev() {
        let (k, o) = (&keys[i * kd..(i + 1) * kd], &mut out[i * kd..(i + 1) * kd]);
        if i + 1 == rows {
            mul_into(k, run, o);
        } else {
            let (run, e) = (&mut run[..kd], &decays[i * kd..(i + 1) * kd]);
            for c in 0..kd {
                run[c] = flush(run[c] * e[c]);
                o[c] = k[c] * run[c];
            }
        }
    }
}

/// `out = a ⊙ b`.
#[inline(always)]
fn mul_into(a: &[f32], b: &[f32], out: &mut [f32]) {
    for ((o, &a), &b) in out.iter_mut().zip(a).zip(b) {
        *o = a * b;
    }
}

impl Work {
    fn new(kd: usize, vd: usize) -> Self {
        let c = CHUNK_SIZE;
        let z = |n: usize| vec![0.0f32; n];
        Self {
            kd,
            vd,
            q: z(c * kd),
            k: z(c * kd),
            e1: z(c * kd),
            eg: z(c * kd),
            fac: z(c * kd),
            beta: z(c),
            aa: z(c * 2 * c),
            z: z(2 * c * (kd + vd)),
            y: z(2 * c * vd),
            v_new: z(c * vd),
            left: z(2 * c * kd),
            right: z(BLOCK * kd),
            run: z(kd),
        }
    }

    fn row(x: &[f32], t: usize, d: usize) -> &[f32] {
        &x[t * d..(t + 1) * d]
    }

    /// Take head `i`'s rows from the stage, normalise and scale q and k, form the decays
    /// `e^{g_t}` and `e^{gc_t}` (a running product), and the right-hand sides of the solve in
    /// `z`: each row in one visit, while the stage's rows are in cache.
    #[inline(always)]
    fn load(&mut self, stage: &Stage, i: usize, len: usize, scale: f32, qk_l2norm: bool) {
        let (kd, vd, heads) = (self.kd, self.vd, stage.heads);
        let width = kd + vd;
        for t in 0..len {
            let at = t * heads + i;
            let (q, k) = (&mut self.q[t * kd..(t + 1) * kd], &mut self.k[t * kd..(t + 1) * kd]);
            let (sq, sk) = (Self::row(&stage.q, at, kd), Self::row(&stage.k, at, kd));
            if qk_l2norm {
                l2norm_into(sq, scale, q);
                l2norm_into(sk, 1.0, k);
            } else {
                for (x, &s) in q.iter_mut().zip(sq) {
                    *x = s * scale;
                }
                k.copy_from_slice(sk);
            }
            let beta = stage.beta[at];
            self.beta[t] = beta;
            let (before, eg) = self.eg.split_at_mut(t * kd);
            let eg = &mut eg[..kd];
            let e1 = &mut self.e1[t * kd..(t + 1) * kd];
            let g = Self::row(&stage.g, at, kd);
            if t == 0 {
                for ((e, x), &g) in e1.iter_mut().zip(eg.iter_mut()).zip(g) {
                    *e = flush(exp(g));
                    *x = *e;
                }
            } else {
                let prev = &before[(t - 1) * kd..];
                for (((e, x), &g), &p) in e1.iter_mut().zip(eg.iter_mut()).zip(g).zip(prev) {
                    *e = flush(exp(g));
                    *x = flush(p * *e);
                }
            }
            // [beta ⊙ e^{gc} ⊙ K | beta ⊙ V] in row t of `z`, e^{gc} ⊙ Q in row len + t.
            let (top, bottom) = self.z.split_at_mut(len * width);
            let (rk, rv) = top[t * width..(t + 1) * width].split_at_mut(kd);
            for ((x, &k), &e) in rk.iter_mut().zip(&*k).zip(&*eg) {
                *x = beta * (k * e);
            }
            for (x, &v) in rv.iter_mut().zip(Self::row(&stage.v, at, vd)) {
                *x = beta * v;
            }
            mul_into(q, eg, &mut bottom[t * width..t * width + kd]);
        }
    }

    /// Fill `A_kk` (scaled by beta) and `A_qk` by sub-blocks (see the module docs).
    #[inline(always)]
    fn decay_products(&mut self, len: usize, direct_diagonal: bool) {
        let (kd, c, c2) = (self.kd, CHUNK_SIZE, 2 * CHUNK_SIZE);
        self.aa[..len * c2].fill(0.0);
        for r0 in (0..len).step_by(BLOCK) {
            let r1 = (r0 + BLOCK).min(len);
            // Left factors e^{gc_t - gc_{r0-1}} of every row from this block on (only the
            // block's own rows for the first, whose reference is the chunk start).
            let rows = if r0 == 0 { r0..r1 } else { r0..len };
            for t in rows.clone() {
                let (before, fac) = self.fac.split_at_mut(t * kd);
                let fac = &mut fac[..kd];
                let j = 2 * (t - r0);
                let (lk, lq) = self.left[j * kd..(j + 2) * kd].split_at_mut(kd);
                let (k, q, e1) = (
                    Self::row(&self.k, t, kd),
                    Self::row(&self.q, t, kd),
                    Self::row(&self.e1, t, kd),
                );
                // One visit per row: the factor, then both left operands from it.
                if r0 == 0 || t == r0 {
                    let from = if r0 == 0 { Self::row(&self.eg, t, kd) } else { e1 };
                    for c in 0..kd {
                        fac[c] = from[c];
                        lk[c] = k[c] * fac[c];
                        lq[c] = q[c] * fac[c];
                    }
                } else {
                    let prev = &before[(t - 1) * kd..t * kd];
                    for c in 0..kd {
                        fac[c] = flush(prev[c] * e1[c]);
                        lk[c] = k[c] * fac[c];
                        lq[c] = q[c] * fac[c];
                    }
                }
            }
            if r0 > 0 {
                // The previous block against every later row: right factors
                // e^{gc_{r0-1} - gc_i} <= 1, a running product backwards from r0 - 1.
                let p0 = r0 - BLOCK;
                backward_factors(
                    &self.k[p0 * kd..r0 * kd],
                    &self.e1[(p0 + 1) * kd..r0 * kd],
                    &mut self.run,
                    &mut self.right[..BLOCK * kd],
                );
                let n_rows = 2 * (len - r0);
                matmul(
                    MatMut::new(&mut self.aa[r0 * c2 + p0..], n_rows, BLOCK, c),
                    Mat::new(&self.left, n_rows, kd, kd),
                    Mat::new(&self.right, BLOCK, kd, kd).t(),
                    Update::Set,
                );
            }
            if !direct_diagonal && self.diagonal_factors(r0..r1) {
                let n = r1 - r0;
                matmul(
                    MatMut::new(&mut self.aa[r0 * c2 + r0..], 2 * n, n, c),
                    Mat::new(&self.left, 2 * n, kd, kd),
                    Mat::new(&self.right, n, kd, kd).t(),
                    Update::Set,
                );
                // Keep i < t of A_kk and i <= t of A_qk.
                for t in r0..r1 {
                    self.aa[t * c2 + t..t * c2 + r1].fill(0.0);
                    self.aa[t * c2 + c + t + 1..t * c2 + c + r1].fill(0.0);
                }
            } else {
                self.diagonal_direct(r0..r1);
            }
        }
        for t in 0..len {
            let beta = self.beta[t];
            self.aa[t * c2..t * c2 + t].iter_mut().for_each(|a| *a *= beta);
        }
    }

    /// Right operands `k_i / f_i` (factors `e^{gc_{r0-1} - gc_i} >= 1`) of a diagonal block, if
    /// factoring is safe: every left factor at least [`MIN_LEFT`], every operand finite and
    /// below [`MAX_FACTOR`].
    #[inline(always)]
    fn diagonal_factors(&mut self, rows: Range<usize>) -> bool {
        let kd = self.kd;
        // NaN fails the comparisons and takes the direct path.
        // (A flag per lane rather than a running minimum, so the loops vectorise.)
        let mut ok = true;
        for &f in &self.fac[rows.start * kd..rows.end * kd] {
            ok &= f >= MIN_LEFT;
        }
        if !ok {
            return false;
        }
        for (n, i) in rows.enumerate() {
            let out = &mut self.right[n * kd..(n + 1) * kd];
            for ((o, &k), &f) in
                out.iter_mut().zip(Self::row(&self.k, i, kd)).zip(Self::row(&self.fac, i, kd))
            {
                *o = k / f;
                ok &= o.abs() <= MAX_FACTOR;
            }
        }
        ok
    }

    /// Every pair of a diagonal block directly, its factor `e^{gc_t - gc_i} <= 1` a running
    /// product over `t`.
    #[inline(always)]
    fn diagonal_direct(&mut self, rows: Range<usize>) {
        let (kd, c, c2) = (self.kd, CHUNK_SIZE, 2 * CHUNK_SIZE);
        for i in rows.clone() {
            let ki = Self::row(&self.k, i, kd);
            self.aa[i * c2 + c + i] = dot(Self::row(&self.q, i, kd), ki);
            self.run.fill(1.0);
            for t in i + 1..rows.end {
                for (x, &e) in self.run.iter_mut().zip(Self::row(&self.e1, t, kd)) {
                    *x = flush(*x * e);
                }
                self.aa[t * c2 + i] = dot3(Self::row(&self.k, t, kd), ki, &self.run);
                self.aa[t * c2 + c + i] = dot3(Self::row(&self.q, t, kd), ki, &self.run);
            }
        }
    }

    /// `[W | U] = (I + A_kk)^{-1} [beta ⊙ e^{gc} ⊙ K | beta ⊙ V]`, solved in place in `z` (where
    /// [`Work::load`] put the right-hand sides) by blocks of 16 rows.
    #[inline(always)]
    fn solve(&mut self, len: usize) {
        let (kd, vd, c2) = (self.kd, self.vd, 2 * CHUNK_SIZE);
        let width = kd + vd;
        for r0 in (0..len).step_by(BLOCK) {
            let r1 = (r0 + BLOCK).min(len);
            let (done, rest) = self.z.split_at_mut(r0 * width);
            if r0 > 0 {
                matmul(
                    MatMut::new(rest, r1 - r0, width, width),
                    Mat::new(&self.aa[r0 * c2..], r1 - r0, r0, c2),
                    Mat::new(done, r0, width, width),
                    Update::Sub,
                );
            }
            for t in r0..r1 {
                let (solved, row) = rest.split_at_mut((t - r0) * width);
                sub_terms(&mut row[..width], &self.aa[t * c2 + r0..t * c2 + t], solved, width);
            }
        }
    }

    /// The state-dependent part: `v_new`, the outputs (rows `o_stride` apart in `o`), and the
    /// state at the chunk end.
    #[inline(always)]
    fn apply(&mut self, len: usize, s: &mut [f32], o: &mut [f32], o_stride: usize) {
        let (kd, vd, c, c2) = (self.kd, self.vd, CHUNK_SIZE, 2 * CHUNK_SIZE);
        let width = kd + vd;
        matmul(
            MatMut::new(&mut self.y, 2 * len, vd, vd),
            Mat::new(&self.z, 2 * len, kd, width),
            Mat::new(s, kd, vd, vd),
            Update::Set,
        );
        for t in 0..len {
            let u = &self.z[t * width + kd..(t + 1) * width];
            for ((x, &u), &ws) in
                self.v_new[t * vd..(t + 1) * vd].iter_mut().zip(u).zip(Self::row(&self.y, t, vd))
            {
                *x = u - ws;
            }
        }
        for t in 0..len {
            o[t * o_stride..t * o_stride + vd].copy_from_slice(Self::row(&self.y, len + t, vd));
        }
        // A_qk is lower triangular: the first half of the rows needs only the first half of
        // the columns.
        let half = len.div_ceil(2);
        let (top, bottom) = o.split_at_mut((half * o_stride).min(o.len()));
        matmul(
            MatMut::new(top, half, vd, o_stride),
            Mat::new(&self.aa[c..], half, half, c2),
            Mat::new(&self.v_new, half, vd, vd),
            Update::Add,
        );
        matmul(
            MatMut::new(bottom, len - half, vd, o_stride),
            Mat::new(&self.aa[half * c2 + c..], len - half, len, c2),
            Mat::new(&self.v_new, len, vd, vd),
            Update::Add,
        );
        // Key factors e^{gc_last - gc_i} <= 1, a running product backwards, into `left`.
        backward_factors(
            &self.k[..len * kd],
            &self.e1[kd..len * kd],
            &mut self.run,
            &mut self.left[..len * kd],
        );
        for (row, &d) in s.chunks_exact_mut(vd).zip(Self::row(&self.eg, len - 1, kd)) {
            row.iter_mut().for_each(|x| *x *= d);
        }
        matmul(
            MatMut::new(s, kd, vd, vd),
            Mat::new(&self.left, len, kd, kd).t(),
            Mat::new(&self.v_new, len, vd, vd),
            Update::Add,
        );
    }
}

pub(in crate::kernels) fn chunk(
    op: &KdaChunk<ReferenceBackend>,
    dims: RecurrenceDims,
    exec: &Exec,
) -> Result<(), String> {
    let RecurrenceDims { tokens, heads, k: kd, v: vd, slots, .. } = dims;
    let ranges = request_ranges("cu_seqlens", &read_i32(&op.cu_seqlens), tokens)?;
    let request_slots = read_i32(&op.state_slots)
        .iter()
        .enumerate()
        .map(|(b, &s)| slot("state_slots", format!("[{b}]"), s, slots))
        .collect::<Result<Vec<_>, _>>()?;
    let boundary = boundary_slots(op, &ranges, &request_slots, slots)?;
    let has_initial = read_i32(&op.has_initial_state);
    if let Some(m) = &op.host_meta {
        for (param, host, device) in [
            ("cu_seqlens", &m.cu_seqlens, read_i32(&op.cu_seqlens)),
            ("state_slots", &m.state_slots, read_i32(&op.state_slots)),
            ("has_initial_state", &m.has_initial_state, has_initial.clone()),
        ] {
            if **host != *device {
                return Err(format!(
                    "host_meta.{param} = {host:?} differs from {param} = {device:?} on the device"
                ));
            }
        }
    }
    // Initial states (K-first), all read before any state is written.
    let mut initial = Vec::with_capacity(ranges.len() * heads);
    for (b, s) in request_slots.iter().enumerate() {
        for h in 0..heads {
            initial.push(match s {
                Some(s) if has_initial[b] != 0 => {
                    transpose(&read_f32(&head_state(&op.state, *s, h)?), vd, kd)
                }
                _ => vec![0.0; kd * vd],
            });
        }
    }
    let (q, k, v, g, beta) = (
        read_floats(&op.q),
        read_floats(&op.k),
        read_floats(&op.v),
        read_floats(&op.g),
        read_floats(&op.beta),
    );
    let gate = op.gate.as_ref().map(|p| GateParams::read(p.form, &p.a_log, &p.dt_bias, kd));
    let problem = Problem {
        q: &q,
        k: &k,
        v: &v,
        g: &g,
        gate: gate.as_ref(),
        beta: &beta,
        heads,
        kd,
        vd,
        scale: op.scale,
        qk_l2norm: op.qk_l2norm,
    };
    // Final states (K-first) of the group's heads, and the kept chunk-boundary states: `(slot,
    // the group's states)`.
    let run = |b: usize, group: Range<usize>, out: &mut [f32]| -> Run {
        if request_slots[b].is_none() {
            out.fill(0.0);
            return Run::default();
        }
        let mut states: Vec<Vec<f32>> =
            group.clone().map(|h| initial[b * heads + h].clone()).collect();
        let range = ranges[b].clone();
        let keep = &boundary[b];
        if keep.iter().all(Option::is_none) {
            chunked_heads(&problem, group, range, &mut states, out, false);
            return Run { finals: states, kept: Vec::new() };
        }
        // Chunk by chunk: the chunks are the ones one call would form (each call starts its
        // first chunk at its first token), so the results are the same bits.
        let row = group.len() * vd;
        let mut kept = Vec::new();
        for (c, keep) in keep.iter().enumerate() {
            let start = range.start + c * CHUNK_SIZE;
            let end = (start + CHUNK_SIZE).min(range.end);
            let rows = &mut out[(start - range.start) * row..(end - range.start) * row];
            chunked_heads(&problem, group.clone(), start..end, &mut states, rows, false);
            if let Some(s) = keep {
                kept.push((*s, states.clone()));
            }
        }
        Run { finals: states, kept }
    };
    // Per request, head by head (all heads).
    let mut results: Vec<Run> = Vec::with_capacity(ranges.len());
    if exec.threads() == 1 {
        // One task per request, all heads at once, straight into the output rows.
        for (b, range) in ranges.iter().enumerate() {
            let view = op.o.narrow(0, range.start, range.len()).map_err(|e| e.to_string())?;
            let mut result = Run::default();
            with_f32_out(&view, |out| result = run(b, 0..heads, out));
            results.push(result);
        }
    } else {
        // Tasks (request, group of heads), about one group per thread, each into its own
        // `[len, G, V]`, then copied into the output rows.
        let groups = exec.threads().clamp(1, heads.max(1));
        let group_of = |i: usize| i * heads / groups..(i + 1) * heads / groups;
        let parts = par_map(exec, ranges.len() * groups, |task| {
            let (b, group) = (task / groups, group_of(task % groups));
            let mut out = vec![0.0f32; ranges[b].len() * group.len() * vd];
            let result = run(b, group, &mut out);
            (out, result)
        });
        let mut parts = parts.into_iter();
        for range in &ranges {
            let view = op.o.narrow(0, range.start, range.len()).map_err(|e| e.to_string())?;
            let parts: Vec<(Vec<f32>, Run)> = parts.by_ref().take(groups).collect();
            with_f32_out(&view, |out| {
                for (i, (part, _)) in parts.iter().enumerate() {
                    let group = group_of(i);
                    let width = group.len() * vd;
                    for t in 0..range.len() {
                        let at = (t * heads + group.start) * vd;
                        out[at..at + width].copy_from_slice(&part[t * width..(t + 1) * width]);
                    }
                }
            });
            results.push(Run::join(parts.into_iter().map(|(_, r)| r)));
        }
    }
    for (b, result) in results.iter().enumerate() {
        let finals = request_slots[b].map(|s| (s, &result.finals));
        for (s, states) in result.kept.iter().map(|(s, st)| (*s, st)).chain(finals) {
            for (h, state) in states.iter().enumerate() {
                super::io::write_f32(&head_state(&op.state, s, h)?, &transpose(state, kd, vd));
            }
        }
    }
    Ok(())
}

/// What one task of [`chunk`] leaves: the final states of its heads (K-first) and the
/// chunk-boundary states it keeps, `(slot, states of its heads)` in chunk order.
#[derive(Default)]
struct Run {
    finals: Vec<Vec<f32>>,
    kept: Vec<(usize, Vec<Vec<f32>>)>,
}

impl Run {
    /// The runs of consecutive head groups of one request, as one run over all its heads.
    fn join(parts: impl Iterator<Item = Run>) -> Run {
        let mut all = Run::default();
        for part in parts {
            all.finals.extend(part.finals);
            if all.kept.is_empty() {
                all.kept = part.kept;
            } else {
                for ((_, into), (_, states)) in all.kept.iter_mut().zip(part.kept) {
                    into.extend(states);
                }
            }
        }
        all
    }
}

/// The slots of [`KdaChunk::chunk_state_slots`] per request and chunk (`None`: keep nothing),
/// checked: one entry per chunk of every request, in range, distinct from each other and from
/// every request's own slot (which the op reads and writes).
fn boundary_slots(
    op: &KdaChunk<ReferenceBackend>,
    ranges: &[Range<usize>],
    request_slots: &[Option<usize>],
    slots: usize,
) -> Result<Vec<Vec<Option<usize>>>, String> {
    let counts: Vec<usize> = ranges.iter().map(|r| chunks_of(r.len())).collect();
    let Some(t) = &op.chunk_state_slots else {
        return Ok(counts.iter().map(|&n| vec![None; n]).collect());
    };
    let raw = read_i32(t);
    let want: usize = counts.iter().sum();
    if raw.len() != want {
        return Err(format!(
            "chunk_state_slots has {} entries; the requests of cu_seqlens have {want} chunks \
             (Σ_b ceil(len_b / {CHUNK_SIZE}))",
            raw.len()
        ));
    }
    let mut taken: Vec<Option<String>> = vec![None; slots];
    for (b, s) in request_slots.iter().enumerate() {
        if let Some(s) = *s {
            taken[s] = Some(format!("state_slots[{b}]"));
        }
    }
    let mut kept = Vec::with_capacity(raw.len());
    for (i, &value) in raw.iter().enumerate() {
        let s = slot("chunk_state_slots", format!("[{i}]"), value, slots)?;
        if let Some(s) = s {
            if let Some(other) = &taken[s] {
                return Err(format!(
                    "chunk_state_slots[{i}] = {s} is also {other}: every kept state needs a \
                     slot of its own"
                ));
            }
            taken[s] = Some(format!("chunk_state_slots[{i}]"));
        }
        kept.push(s);
    }
    let mut rest = kept.as_slice();
    let mut out = Vec::with_capacity(counts.len());
    for n in counts {
        let (mine, after) = rest.split_at(n);
        out.push(mine.to_vec());
        rest = after;
    }
    Ok(out)
}

/// `[rows, cols]` row-major to `[cols, rows]`.
pub(crate) fn transpose(x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut t = vec![0.0; rows * cols];
    for r in 0..rows {
        for c in 0..cols {
            t[c * rows + r] = x[r * cols + c];
        }
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;
    use kda_testkit::Gen;
    use kda_testkit::oracle_kda::{KdaSequence, kda_recurrence, max_abs, recurrence_tolerance};

    struct Case {
        tokens: usize,
        heads: usize,
        dim: usize,
        g: (f32, f32),
        beta: (f32, f32),
        initial: bool,
    }

    fn floats(x: &[f32]) -> Floats<'_> {
        Floats::F32(std::borrow::Cow::Borrowed(x))
    }

    fn f64s(x: &[f32]) -> Vec<f64> {
        x.iter().map(|&v| f64::from(v)).collect()
    }

    /// Run the chunked kernel on seeded inputs and check outputs and final states against the
    /// f64 recurrence.
    fn check(case: &Case, g_override: Option<Vec<f32>>, direct: bool, seed: u64) {
        let Case { tokens, heads, dim, .. } = *case;
        let mut rng = Gen::new(seed);
        let n = tokens * heads * dim;
        let q = rng.uniform_f32(n, -1.0, 1.0);
        let k = rng.uniform_f32(n, -1.0, 1.0);
        let v = rng.uniform_f32(n, -1.0, 1.0);
        let g = g_override.unwrap_or_else(|| rng.uniform_f32(n, case.g.0, case.g.1));
        let beta = rng.uniform_f32(tokens * heads, case.beta.0, case.beta.1);
        let s0 = if case.initial {
            rng.uniform_f32(heads * dim * dim, -1.0, 1.0)
        } else {
            vec![0.0; heads * dim * dim]
        };
        let scale = 1.0 / (dim as f32).sqrt();
        let (fq, fk, fv, fg, fb) = (floats(&q), floats(&k), floats(&v), floats(&g), floats(&beta));
        let p = Problem {
            q: &fq,
            k: &fk,
            v: &fv,
            g: &fg,
            gate: None,
            beta: &fb,
            heads,
            kd: dim,
            vd: dim,
            scale,
            qk_l2norm: true,
        };
        let mut states: Vec<Vec<f32>> = s0.chunks(dim * dim).map(<[f32]>::to_vec).collect();
        let mut o = vec![0.0f32; n];
        chunked_heads(&p, 0..heads, 0..tokens, &mut states, &mut o, direct);
        let (q64, k64, v64, g64, b64, s64) =
            (f64s(&q), f64s(&k), f64s(&v), f64s(&g), f64s(&beta), f64s(&s0));
        let seq =
            KdaSequence { q: &q64, k: &k64, v: &v64, g: &g64, beta: &b64, heads, kd: dim, vd: dim };
        let (o_ref, s_ref) = kda_recurrence(seq, Some(&s64), f64::from(scale), true);
        let what = format!("T={tokens} H={heads} D={dim} g={:?} direct={direct}", case.g);
        let tol = recurrence_tolerance(tokens, dim, CHUNK_SIZE, max_abs(&o_ref));
        if let Err(e) = tol.compare_as(&[tokens, heads, dim], &o, &o_ref) {
            panic!("{what}: outputs: {e}");
        }
        let tol = recurrence_tolerance(tokens, dim, CHUNK_SIZE, max_abs(&s_ref));
        if let Err(e) = tol.compare_as(&[heads, dim, dim], &states.concat(), &s_ref) {
            panic!("{what}: final state: {e}");
        }
    }

    #[test]
    fn matches_the_f64_recurrence_with_either_diagonal_path() {
        let cases = [
            Case {
                tokens: 130,
                heads: 2,
                dim: 32,
                g: (-0.05, 0.0),
                beta: (0.9, 1.0),
                initial: true,
            },
            Case {
                tokens: 200,
                heads: 1,
                dim: 128,
                g: (-3.0, 0.0),
                beta: (0.0, 1.0),
                initial: true,
            },
            Case {
                tokens: 100,
                heads: 3,
                dim: 16,
                g: (-5.0, -4.5),
                beta: (0.0, 1.0),
                initial: false,
            },
            Case { tokens: 7, heads: 1, dim: 20, g: (-1.0, 0.0), beta: (0.5, 1.0), initial: true },
        ];
        for (seed, case) in cases.iter().enumerate() {
            for direct in [false, true] {
                check(case, None, direct, seed as u64);
            }
        }
    }

    /// Decays from none (g = 0) to total (g = -1000, e^g = 0 in f32) side by side, and a jump of
    /// -80 inside a sub-block: the factored path must step aside and nothing may overflow.
    #[test]
    fn extreme_decays_stay_finite_and_correct() {
        let (tokens, heads, dim) = (96, 1, 16);
        let mut g = vec![0.0f32; tokens * dim];
        for t in 0..tokens {
            for c in 0..dim {
                g[t * dim + c] = match c % 4 {
                    0 => 0.0,
                    1 => -1000.0,
                    2 if t % 16 == 7 => -80.0,
                    _ => -0.01,
                };
            }
        }
        let case = Case { tokens, heads, dim, g: (0.0, 1.0), beta: (0.0, 1.0), initial: true };
        check(&case, Some(g), false, 7);
    }

    /// One run of the kernel for [`bits_of`]: `T` tokens of `H` heads of `D`, of which heads
    /// `group` run over tokens `tokens`.
    struct Pin {
        t: usize,
        h: usize,
        d: usize,
        group: Range<usize>,
        tokens: Range<usize>,
        g: (f32, f32),
        bf16: bool,
        gate: bool,
        l2norm: bool,
        nan: bool,
        direct: bool,
    }

    /// FNV-1a over the bits of the outputs and final states of one [`Pin`] run, with the
    /// kernel `run` (the dispatching entry point or one of its builds).
    fn bits_of(pin: &Pin, seed: u64, run: KernelFn) -> u64 {
        let Pin { t, h, d, .. } = *pin;
        let mut rng = Gen::new(seed);
        let n = t * h * d;
        let q = rng.uniform_f32(n, -1.0, 1.0);
        let mut k = rng.uniform_f32(n, -1.0, 1.0);
        let v = rng.uniform_f32(n, -1.0, 1.0);
        let g = rng.uniform_f32(n, pin.g.0, pin.g.1);
        let beta = rng.uniform_f32(t * h, 0.0, 1.0);
        if pin.nan {
            k[(t / 2 * h + pin.group.start) * d + d / 3] = f32::NAN;
        }
        let wide = |x: &[f32]| {
            if pin.bf16 {
                Floats::BF16(std::borrow::Cow::Owned(
                    x.iter().map(|&v| half::bf16::from_f32(v)).collect(),
                ))
            } else {
                Floats::F32(std::borrow::Cow::Owned(x.to_vec()))
            }
        };
        let (fq, fk, fv, fg, fb) = (wide(&q), wide(&k), wide(&v), floats(&g), floats(&beta));
        let a_log = rng.uniform_f32(h, -1.0, 1.0);
        let dt_bias = rng.uniform_f32(h * d, -2.0, 1.0);
        let gate = GateParams {
            form: kda_core::kda::GateForm::LowerBound { lower_bound: -5.0 },
            a_log: std::borrow::Cow::Owned(a_log),
            dt_bias: std::borrow::Cow::Owned(dt_bias),
            dim: d,
        };
        let p = Problem {
            q: &fq,
            k: &fk,
            v: &fv,
            g: &fg,
            gate: pin.gate.then_some(&gate),
            beta: &fb,
            heads: h,
            kd: d,
            vd: d,
            scale: 1.0 / (d as f32).sqrt(),
            qk_l2norm: pin.l2norm,
        };
        let mut states: Vec<Vec<f32>> =
            pin.group.clone().map(|_| rng.uniform_f32(d * d, -1.0, 1.0)).collect();
        let mut o = vec![0.0f32; pin.tokens.len() * pin.group.len() * d];
        run(&p, pin.group.clone(), pin.tokens.clone(), &mut states, &mut o, pin.direct);
        let mut hash = 0xcbf2_9ce4_8422_2325u64;
        for x in o.iter().chain(states.iter().flatten()) {
            for byte in x.to_bits().to_le_bytes() {
                hash = (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
            }
        }
        hash
    }

    type KernelFn = fn(&Problem<'_>, Range<usize>, Range<usize>, &mut [Vec<f32>], &mut [f32], bool);

    /// The runs [`bits_of`] pins: tails of every length class, a group of heads inside more,
    /// bf16 operands, the in-kernel gate, no L2 norm, a NaN, fast decays that take the direct
    /// diagonal path, and the forced direct path.
    fn pins() -> Vec<Pin> {
        let base = || Pin {
            t: 150,
            h: 2,
            d: 128,
            group: 0..2,
            tokens: 0..150,
            g: (-0.3, 0.0),
            bf16: false,
            gate: false,
            l2norm: true,
            nan: false,
            direct: false,
        };
        vec![
            Pin { t: 1, tokens: 0..1, ..base() },
            Pin { t: 7, tokens: 0..7, d: 20, ..base() },
            Pin { t: 64, tokens: 0..64, ..base() },
            Pin { t: 150, h: 4, group: 1..3, tokens: 5..150, d: 32, ..base() },
            Pin { bf16: true, gate: true, g: (-3.0, 3.0), ..base() },
            Pin { l2norm: false, g: (-3.0, 0.0), ..base() },
            Pin { nan: true, ..base() },
            Pin { g: (-5.0, -4.5), d: 48, ..base() },
            Pin { direct: true, t: 97, tokens: 0..97, ..base() },
        ]
    }

    /// The bits `main`'s kernel gave for [`pins`] on x86-64 with AVX2 and FMA (the reference
    /// is the numerical oracle: its results may not drift with its speed).
    const PINNED: [u64; 9] = [
        0x67de_37b0_2315_4a53,
        0x1f43_d940_3f26_1df4,
        0x0590_541b_de3c_4ba2,
        0xa7c8_b86d_0140_698d,
        0xb406_345c_53ba_be0a,
        0x2ff6_8b33_ea36_1101,
        0x37cc_a82c_a416_e345,
        0x1a3a_d807_705c_6495,
        0xd5e9_a7c5_1f6d_5c61,
    ];

    /// The pinned bits on the CPUs they were taken on; everywhere, the baseline build and the
    /// AVX2/FMA build of the element-wise work agree bit for bit.
    #[test]
    fn results_keep_their_bits_in_either_build() {
        let pins = pins();
        let seeds = 40..;
        let got: Vec<u64> =
            pins.iter().zip(seeds.clone()).map(|(pin, s)| bits_of(pin, s, chunked_heads)).collect();
        #[cfg(target_arch = "x86_64")]
        if simd::has_avx2_fma() {
            assert_eq!(got, PINNED, "the kernel's output bits changed");
        }
        let baseline: Vec<u64> =
            pins.iter().zip(seeds).map(|(pin, s)| bits_of(pin, s, chunked_heads_impl)).collect();
        assert_eq!(baseline, got, "the baseline build differs from the dispatched one");
    }

    #[test]
    fn zero_sized_heads_give_zero_outputs() {
        let (none, beta) = (floats(&[]), floats(&[0.5; 3]));
        let p = Problem {
            q: &none,
            k: &none,
            v: &none,
            g: &none,
            gate: None,
            beta: &beta,
            heads: 1,
            kd: 0,
            vd: 4,
            scale: 1.0,
            qk_l2norm: true,
        };
        let mut out = vec![f32::NAN; 12];
        chunked_heads(&p, 0..1, 0..3, &mut [vec![]], &mut out, false);
        assert_eq!(out, vec![0.0; 12]);
    }
}
