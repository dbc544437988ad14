//! The KDA recurrence token by token (decode and speculative decode), on the v-first state of
//! the cache: with `S^T` stored as `[V, K]`, every step is a pass over contiguous rows.

use kda_core::kda::{KdaRecurrent, RecurrenceDims};
use kda_core::{DType, Layout};

use super::super::Exec;
use super::io::{T, par_map, read_f32, read_i32, row, slot, write_f32};
use super::norm::l2norm_row;
use super::simd;
use crate::ReferenceBackend;

/// One token through one head's v-first state `s` (`[V, K]`, in place): decay, delta-rule
/// update, output `o` (`[V]`). `q` is already normalised and scaled, `k` normalised; `decay` is
/// scratch of `K` elements.
///
/// Row `r` of `s` is column `r` of the formulas' `S`, so `(S^T k)[r]` is a row dot product.
/// Each row is read twice (decay with `S^T k`, then the update with `S^T q`), its sums in
/// [`dot`](simd::dot)'s order.
#[allow(clippy::too_many_arguments)]
pub(crate) fn step(
    s: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: f32,
    decay: &mut [f32],
    o: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if simd::has_avx2_fma() {
        // SAFETY: the CPU has AVX2 and FMA (checked at run time), all this build assumes.
        unsafe { step_avx2(s, q, k, v, g, beta, decay, o) };
        return;
    }
    step_impl::<false>(s, q, k, v, g, beta, decay, o);
}

/// [`step_impl`] compiled for AVX2 (same bits: Rust never fuses a multiply and an add).
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn step_avx2(
    s: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: f32,
    decay: &mut [f32],
    o: &mut [f32],
) {
    step_impl::<true>(s, q, k, v, g, beta, decay, o);
}

/// `AVX2`: the rows' passes in AVX2 intrinsics (the caller has checked the CPU has them).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn step_impl<const AVX2: bool>(
    s: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: f32,
    decay: &mut [f32],
    o: &mut [f32],
) {
    let kd = k.len();
    if kd == 0 {
        o.fill(0.0);
        return;
    }
    for (d, &g) in decay.iter_mut().zip(g) {
        *d = g.exp();
    }
    let decay = &*decay;
    for ((row, &v), o) in s.chunks_exact_mut(kd).zip(v).zip(o) {
        #[cfg(target_arch = "x86_64")]
        if AVX2 {
            // SAFETY: `AVX2` is set only under `step_avx2`, whose caller checked the CPU.
            unsafe {
                let u = beta * (v - update_dot_avx2::<false>(row, decay, 0.0, k));
                *o = update_dot_avx2::<true>(row, k, u, q);
            }
            continue;
        }
        let u = beta * (v - update_dot::<false>(row, decay, 0.0, k));
        *o = update_dot::<true>(row, k, u, q);
    }
}

/// `row[i] = row[i]·a[i]` (`add` false) or `row[i] + a[i]·u` (`add` true) for every `i`, and
/// the dot product of the new row with `w`, summed exactly as [`dot`](simd::dot) sums it: one pass over the
/// row instead of two.
#[inline(always)]
fn update_dot<const ADD: bool>(row: &mut [f32], a: &[f32], u: f32, w: &[f32]) -> f32 {
    let n = row.len().min(w.len()).min(a.len());
    let (rows, row_tail) = row[..n].as_chunks_mut::<8>();
    let ((a8, a_tail), (w8, w_tail)) = (a[..n].as_chunks::<8>(), w[..n].as_chunks::<8>());
    let mut acc = [0.0f32; 8];
    for ((x, a), y) in rows.iter_mut().zip(a8).zip(w8) {
        for l in 0..8 {
            x[l] = if ADD { x[l] + a[l] * u } else { x[l] * a[l] };
            acc[l] += x[l] * y[l];
        }
    }
    let mut sum = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
    for ((x, &a), &y) in row_tail.iter_mut().zip(a_tail).zip(w_tail) {
        *x = if ADD { *x + a * u } else { *x * a };
        sum += *x * y;
    }
    sum
}

/// [`update_dot`] in AVX2 registers, with its bits: lane `l` of the accumulator is `acc[l]`,
/// every operation the same IEEE one (no fused multiply-add).
///
/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn update_dot_avx2<const ADD: bool>(row: &mut [f32], a: &[f32], u: f32, w: &[f32]) -> f32 {
    use std::arch::x86_64::{
        _mm256_add_ps, _mm256_loadu_ps, _mm256_mul_ps, _mm256_set1_ps, _mm256_setzero_ps,
        _mm256_storeu_ps,
    };
    let n = row.len().min(w.len()).min(a.len());
    let (rows, row_tail) = row[..n].as_chunks_mut::<8>();
    let ((a8, a_tail), (w8, w_tail)) = (a[..n].as_chunks::<8>(), w[..n].as_chunks::<8>());
    let uv = _mm256_set1_ps(u);
    let mut acc = _mm256_setzero_ps();
    for ((x, a), y) in rows.iter_mut().zip(a8).zip(w8) {
        // SAFETY: each pointer is to eight f32 (an `[f32; 8]`); loads and stores are unaligned.
        unsafe {
            let (xv, av) = (_mm256_loadu_ps(x.as_ptr()), _mm256_loadu_ps(a.as_ptr()));
            let nx =
                if ADD { _mm256_add_ps(xv, _mm256_mul_ps(av, uv)) } else { _mm256_mul_ps(xv, av) };
            _mm256_storeu_ps(x.as_mut_ptr(), nx);
            acc = _mm256_add_ps(acc, _mm256_mul_ps(nx, _mm256_loadu_ps(y.as_ptr())));
        }
    }
    let mut lanes = [0.0f32; 8];
    // SAFETY: eight f32.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc) };
    let l = lanes;
    let mut sum = ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
    for ((x, &a), &y) in row_tail.iter_mut().zip(a_tail).zip(w_tail) {
        *x = if ADD { *x + a * u } else { *x * a };
        sum += *x * y;
    }
    sum
}

/// [`step`] on a K-first head state `s` (`[K, V]`, flash-linear-attention's layout, which
/// `kda core`, `kda.core` and an engine's transformers-layout cache hand over as a transposed
/// view), in place, **with [`step`]'s bits**: the element-wise lines are the same, and each
/// column's `S^T k` and `S^T q` is summed in [`dot`](simd::dot)'s order ([`strip`]), so a
/// K-first cache and kda's own v-first one give the same results. `u` and `decay` are scratch
/// of `V` and `K` elements.
#[allow(clippy::too_many_arguments)]
pub(crate) fn step_kfirst(
    s: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: f32,
    (u, decay): (&mut [f32], &mut [f32]),
    o: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if simd::has_avx2_fma() {
        // SAFETY: the CPU has AVX2 and FMA (checked at run time), all this build assumes.
        unsafe { step_kfirst_avx2(s, q, k, v, g, beta, (u, decay), o) };
        return;
    }
    step_kfirst_impl(s, q, k, v, g, beta, (u, decay), o);
}

/// [`step_kfirst_impl`] compiled for AVX2 (same bits).
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn step_kfirst_avx2(
    s: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: f32,
    scratch: (&mut [f32], &mut [f32]),
    o: &mut [f32],
) {
    step_kfirst_impl(s, q, k, v, g, beta, scratch, o);
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn step_kfirst_impl(
    s: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: f32,
    (u, decay): (&mut [f32], &mut [f32]),
    o: &mut [f32],
) {
    let vd = v.len();
    if k.is_empty() || vd == 0 {
        o.fill(0.0);
        return;
    }
    for (d, &gc) in decay.iter_mut().zip(g) {
        *d = gc.exp();
    }
    let decay = &*decay;
    // Column j's update needs only column j's `S^T k`: the whole step runs a strip of columns
    // at a time, the strip read from memory once and its second pass served from cache.
    let full = k.len() - k.len() % 8;
    let mut j0 = 0;
    while j0 < vd {
        let width = if j0 + STRIP <= vd { STRIP } else { 1 };
        let cols = j0..j0 + width;
        let at = (j0, vd, full);
        if width == STRIP {
            strip::<STRIP, false>(s, decay, &[], k, &mut u[cols.clone()], at);
        } else {
            strip::<1, false>(s, decay, &[], k, &mut u[cols.clone()], at);
        }
        for (acc, &vj) in u[cols.clone()].iter_mut().zip(&v[cols.clone()]) {
            *acc = beta * (vj - *acc);
        }
        if width == STRIP {
            strip::<STRIP, true>(s, k, u, q, &mut o[cols], at);
        } else {
            strip::<1, true>(s, k, u, q, &mut o[cols], at);
        }
        j0 += width;
    }
}

/// Columns of the K-first strip kernel: one vector of eight.
const STRIP: usize = 8;

/// `s[i][j] = s[i][j]·a[i]` (`ADD` false) or `s[i][j] + a[i]·u[j]` (`ADD` true) for every
/// row `i` of the `[K, V]` block `s` and the `W` columns `j0 .. j0 + W`, and `out[l] =
/// dot(column j0 + l of the new s, w)`, each summed exactly as [`dot`](simd::dot) sums a row:
/// eight lanes (`i mod 8`) over the whole groups of eight (`full` rows), in order, the lanes
/// added as `dot` adds them, then the remaining terms one by one; the strip's eight lanes stay
/// in registers.
#[inline(always)]
fn strip<const W: usize, const ADD: bool>(
    s: &mut [f32],
    a: &[f32],
    u: &[f32],
    w: &[f32],
    out: &mut [f32],
    (j0, vd, full): (usize, usize, usize),
) {
    let kd = w.len();
    let mut us = [0.0f32; W];
    if ADD {
        us.copy_from_slice(&u[j0..j0 + W]);
    }
    let update = |row: &mut [f32], i: usize| {
        let row = &mut row[..W];
        let ai = a[i];
        for l in 0..W {
            row[l] = if ADD { row[l] + ai * us[l] } else { row[l] * ai };
        }
    };
    let mut acc = [[0.0f32; W]; 8];
    for i0 in (0..full).step_by(8) {
        for (lane, acc) in acc.iter_mut().enumerate() {
            let i = i0 + lane;
            let at = i * vd + j0;
            let row = &mut s[at..at + W];
            update(row, i);
            let wi = w[i];
            for l in 0..W {
                acc[l] += row[l] * wi;
            }
        }
    }
    let mut sum = [0.0f32; W];
    for (l, x) in sum.iter_mut().enumerate() {
        let c = |n: usize| acc[n][l];
        *x = ((c(0) + c(4)) + (c(2) + c(6))) + ((c(1) + c(5)) + (c(3) + c(7)));
    }
    for (i, &wi) in w.iter().enumerate().take(kd).skip(full) {
        let at = i * vd + j0;
        let row = &mut s[at..at + W];
        update(row, i);
        for l in 0..W {
            sum[l] += row[l] * wi;
        }
    }
    out.copy_from_slice(&sum);
}

/// One head's state where it lies in the cache, in one of the two layouts the decode step
/// updates in place.
pub(super) enum HeadState<'a> {
    /// `S^T`, `[V, K]` contiguous: the cache's own layout.
    VFirst(&'a mut [f32]),
    /// `S`, `[K, V]` contiguous: a K-first buffer seen through a transposed view.
    KFirst(&'a mut [f32]),
}

/// The `[1, 1, V, K]` view of head `h` in slot `s` of a `[N, H, V, K]` cache.
pub(super) fn head_state(state: &T, s: usize, h: usize) -> Result<T, String> {
    row(state, s)?.narrow(1, h, 1).map_err(|e| e.to_string())
}

pub(in crate::kernels) fn recurrent(
    op: &KdaRecurrent<ReferenceBackend>,
    dims: RecurrenceDims,
    exec: &Exec,
) -> Result<(), String> {
    let RecurrenceDims { batch, tokens: n, heads, k: kd, v: vd, slots } = dims;
    let slot_ids = read_i32(&op.state_slots);
    let accepted = match &op.num_accepted_tokens {
        Some(a) => read_i32(a),
        None => vec![1; batch],
    };
    // Per request: the initial slot (None: padding) and the slot after each token.
    let mut initial = Vec::with_capacity(batch);
    let mut writes = Vec::with_capacity(batch);
    for b in 0..batch {
        let a = accepted[b];
        if n > 0 && (a < 1 || a as usize > n) {
            return Err(format!("num_accepted_tokens[{b}] = {a} is not within 1..={n}"));
        }
        let row = &slot_ids[b * n..(b + 1) * n];
        let first = if n == 0 {
            None
        } else {
            slot("state_slots", format!("[{b}, {}]", a - 1), row[a as usize - 1], slots)?
        };
        let after = row
            .iter()
            .enumerate()
            .map(|(t, &v)| slot("state_slots", format!("[{b}, {t}]"), v, slots))
            .collect::<Result<Vec<_>, _>>()?;
        initial.push(first);
        writes.push(after);
    }
    let (q, k, v, g, beta) =
        (read_f32(&op.q), read_f32(&op.k), read_f32(&op.v), read_f32(&op.g), read_f32(&op.beta));
    let (scale, l2) = (op.scale, op.qk_l2norm);
    // Normalised, scaled q and k of token `at` (a `[.., H]` row index) into `qt`, `kt`.
    let load = |at: usize, qt: &mut [f32], kt: &mut [f32]| {
        qt.copy_from_slice(&q[at * kd..(at + 1) * kd]);
        kt.copy_from_slice(&k[at * kd..(at + 1) * kd]);
        if l2 {
            l2norm_row(qt, scale);
            l2norm_row(kt, 1.0);
        } else {
            qt.iter_mut().for_each(|x| *x *= scale);
        }
    };
    if n == 1 && in_place(&initial, &writes) {
        let taken = decode_in_place(op, exec, &initial, (heads, kd, vd), |at, s, o, scratch| {
            let [qt, kt, decay, u] = scratch;
            load(at, qt, kt);
            let (vt, gt) = (&v[at * vd..(at + 1) * vd], &g[at * kd..(at + 1) * kd]);
            match s {
                HeadState::VFirst(s) => step(s, qt, kt, vt, gt, beta[at], decay, o),
                HeadState::KFirst(s) => step_kfirst(s, qt, kt, vt, gt, beta[at], (u, decay), o),
            }
        })?;
        if taken {
            return Ok(());
        }
    }
    // Every initial state is read before anything is written.
    let mut states = Vec::with_capacity(batch * heads);
    for &first in &initial {
        for h in 0..heads {
            states.push(match first {
                Some(s) => read_f32(&head_state(&op.state, s, h)?).into_owned(),
                None => Vec::new(),
            });
        }
    }
    let results = par_map(exec, batch * heads, |task| {
        let (b, h) = (task / heads, task % heads);
        let mut o = vec![0.0f32; n * vd];
        let mut kept = Vec::new();
        if initial[b].is_none() {
            return (o, kept);
        }
        let mut s = states[task].clone();
        let (mut qt, mut kt, mut decay) = (vec![0.0; kd], vec![0.0; kd], vec![0.0; kd]);
        for t in 0..n {
            let at = (b * n + t) * heads + h;
            load(at, &mut qt, &mut kt);
            let (vt, gt) = (&v[at * vd..(at + 1) * vd], &g[at * kd..(at + 1) * kd]);
            step(&mut s, &qt, &kt, vt, gt, beta[at], &mut decay, &mut o[t * vd..(t + 1) * vd]);
            if let Some(slot) = writes[b][t] {
                kept.push((slot, s.clone()));
            }
        }
        (o, kept)
    });
    // Outputs are [B, n, H, V]; tasks hold [n, V] per (request, head).
    let mut o_all = vec![0.0f32; batch * n * heads * vd];
    for (task, (o, kept)) in results.into_iter().enumerate() {
        let (b, h) = (task / heads, task % heads);
        for t in 0..n {
            let at = ((b * n + t) * heads + h) * vd;
            o_all[at..at + vd].copy_from_slice(&o[t * vd..(t + 1) * vd]);
        }
        for (slot, s) in kept {
            write_f32(&head_state(&op.state, slot, h)?, &s);
        }
    }
    write_f32(&op.o, &o_all);
    Ok(())
}

/// Whether one decode token per request can update the states where they lie: every live
/// request writes back to the slot it reads and to no other, and no two requests share a slot
/// (so no request reads a state another one writes).
fn in_place(initial: &[Option<usize>], writes: &[Vec<Option<usize>>]) -> bool {
    let mut seen = std::collections::HashSet::new();
    initial.iter().zip(writes).all(|(&first, after)| match first {
        None => after.iter().all(Option::is_none),
        Some(s) => after == &[Some(s)] && seen.insert(s),
    })
}

/// One token per request, each head's state updated in place in the cache (no copy of the
/// states, which at decode are most of the bytes the op moves): `run(at, state, o, scratch)`
/// advances one head's state by token row `at`.
///
/// A head state is updated where it lies when it is one contiguous `[V, K]` run (the cache's
/// layout) or one contiguous `[K, V]` run seen transposed (the K-first state of `kda core` and
/// `kda.core`); for any other view this returns `Ok(false)` before anything is read or written,
/// and the caller takes the copying path, which reads and writes any view.
fn decode_in_place(
    op: &KdaRecurrent<ReferenceBackend>,
    exec: &Exec,
    initial: &[Option<usize>],
    (heads, kd, vd): (usize, usize, usize),
    run: impl Fn(usize, HeadState<'_>, &mut [f32], [&mut [f32]; 4]) + Sync,
) -> Result<bool, String> {
    let batch = initial.len();
    let mut o_all = vec![0.0f32; batch * heads * vd];
    if heads == 0 || vd == 0 {
        write_f32(&op.o, &o_all);
        return Ok(true);
    }
    // Every view is checked before the first slice is made, so a refusal leaves nothing behind.
    let mut views = Vec::with_capacity(batch * heads);
    for first in initial {
        let Some(s) = *first else { continue };
        for h in 0..heads {
            let view = head_state(&op.state, s, h)?;
            let layout = view.layout();
            let kfirst = layout.strides()[2..] == [1, vd];
            let whole = if layout.is_contiguous() {
                (false, layout.clone())
            } else if kfirst {
                // The same elements, as the contiguous `[K, V]` block they are.
                let block = Layout::strided(DType::F32, &[kd, vd], &[vd, 1], layout.offset())
                    .map_err(|e| e.to_string())?;
                (true, block)
            } else {
                return Ok(false);
            };
            views.push(whole);
        }
    }
    let mut views = views.into_iter();
    let mut tasks = Vec::with_capacity(batch * heads);
    for (b, (o_req, first)) in o_all.chunks_mut(heads * vd).zip(initial).enumerate() {
        if first.is_none() {
            continue;
        }
        for (h, (o, (kfirst, layout))) in o_req.chunks_mut(vd).zip(views.by_ref()).enumerate() {
            // SAFETY: the elements of a validated f32 view (the state is checked f32) of one
            // (slot, head) of the state buffer, as the contiguous run they form: the slots of
            // the live requests are distinct (`in_place`), so these slices are disjoint; the
            // stream contract keeps every other thread off the cache while the op runs.
            let state = unsafe { op.state.buffer().slice_mut::<f32>(&layout) };
            let state = if kfirst { HeadState::KFirst(state) } else { HeadState::VFirst(state) };
            tasks.push((b * heads + h, state, o));
        }
    }
    super::io::par_for_each(exec, tasks, |(at, state, o)| {
        let (mut qt, mut kt, mut decay, mut u) =
            (vec![0.0; kd], vec![0.0; kd], vec![0.0; kd], vec![0.0; vd]);
        run(at, state, o, [&mut qt, &mut kt, &mut decay, &mut u]);
    });
    write_f32(&op.o, &o_all);
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kda_testkit::Gen;
    use kda_testkit::oracle_kda::{KdaSequence, kda_recurrence};

    /// The step as first written, one pass per line of the formulas: the spec of [`step`]'s
    /// bits.
    #[allow(clippy::too_many_arguments)]
    fn plain_step(
        s: &mut [f32],
        q: &[f32],
        k: &[f32],
        v: &[f32],
        g: &[f32],
        beta: f32,
        o: &mut [f32],
    ) {
        let kd = k.len();
        let decay: Vec<f32> = g.iter().map(|g| g.exp()).collect();
        for ((row, &v), o) in s.chunks_exact_mut(kd).zip(v).zip(o) {
            for (x, &d) in row.iter_mut().zip(&decay) {
                *x *= d;
            }
            let u = beta * (v - simd::dot(row, k));
            for (x, &k) in row.iter_mut().zip(k) {
                *x += k * u;
            }
            *o = simd::dot(row, q);
        }
    }

    /// [`plain_step`] on the K-first state, its column sums through eight lanes held in memory.
    #[allow(clippy::too_many_arguments)]
    fn plain_step_kfirst(
        s: &mut [f32],
        q: &[f32],
        k: &[f32],
        v: &[f32],
        g: &[f32],
        beta: f32,
        o: &mut [f32],
    ) {
        let vd = v.len();
        let column_dots = |s: &[f32], w: &[f32], out: &mut [f32]| {
            let full = w.len() - w.len() % 8;
            let mut lanes = vec![0.0f32; 8 * vd];
            for (i, (row, &wi)) in s.chunks_exact(vd).zip(w).take(full).enumerate() {
                for (a, &x) in lanes[(i % 8) * vd..(i % 8 + 1) * vd].iter_mut().zip(row) {
                    *a += x * wi;
                }
            }
            for (j, o) in out.iter_mut().enumerate() {
                let l = |n: usize| lanes[n * vd + j];
                *o = ((l(0) + l(4)) + (l(2) + l(6))) + ((l(1) + l(5)) + (l(3) + l(7)));
            }
            for (row, &wi) in s.chunks_exact(vd).zip(w).skip(full) {
                for (o, &x) in out.iter_mut().zip(row) {
                    *o += x * wi;
                }
            }
        };
        for (row, &gc) in s.chunks_exact_mut(vd).zip(g) {
            let d = gc.exp();
            row.iter_mut().for_each(|x| *x *= d);
        }
        let mut u = vec![0.0f32; vd];
        column_dots(s, k, &mut u);
        for (acc, &vj) in u.iter_mut().zip(v) {
            *acc = beta * (vj - *acc);
        }
        for (row, &kc) in s.chunks_exact_mut(vd).zip(k) {
            for (x, &uj) in row.iter_mut().zip(&u) {
                *x += kc * uj;
            }
        }
        column_dots(s, q, o);
    }

    /// The fused steps (a pass or two over the state, strips of columns in registers, AVX2
    /// where the CPU has it) give the bits of the steps as first written, for head dims below,
    /// at and across the groups of eight and the strips.
    #[test]
    fn fused_steps_keep_the_plain_steps_bits() {
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        for (kd, vd) in [(1, 1), (7, 5), (8, 8), (16, 9), (21, 23), (128, 128), (64, 100)] {
            let mut rng = Gen::new(kd as u64 * 1000 + vd as u64);
            let t = 3;
            let q = rng.uniform_f32(t * kd, -1.0, 1.0);
            let k = rng.uniform_f32(t * kd, -0.3, 0.3);
            let v = rng.uniform_f32(t * vd, -1.0, 1.0);
            let g = rng.uniform_f32(t * kd, -1.0, 0.0);
            let beta = rng.uniform_f32(t, 0.0, 1.0);
            let s0 = rng.uniform_f32(kd * vd, -1.0, 1.0);
            let (mut s_plain, mut s_fused) = (s0.clone(), s0.clone());
            let (mut s_kplain, mut s_kfused) = (s0.clone(), s0);
            let mut decay = vec![0.0; kd];
            let mut u = vec![0.0; vd];
            for i in 0..t {
                let (qi, ki, gi) =
                    (&q[i * kd..(i + 1) * kd], &k[i * kd..(i + 1) * kd], &g[i * kd..(i + 1) * kd]);
                let vi = &v[i * vd..(i + 1) * vd];
                let (mut want, mut got) = (vec![0.0; vd], vec![0.0; vd]);
                plain_step(&mut s_plain, qi, ki, vi, gi, beta[i], &mut want);
                step(&mut s_fused, qi, ki, vi, gi, beta[i], &mut decay, &mut got);
                assert_eq!(bits(&got), bits(&want), "v-first o, K {kd} V {vd} token {i}");
                assert_eq!(bits(&s_fused), bits(&s_plain), "v-first state, K {kd} V {vd}");
                plain_step_kfirst(&mut s_kplain, qi, ki, vi, gi, beta[i], &mut want);
                let scratch = (&mut u[..], &mut decay[..]);
                step_kfirst(&mut s_kfused, qi, ki, vi, gi, beta[i], scratch, &mut got);
                assert_eq!(bits(&got), bits(&want), "K-first o, K {kd} V {vd} token {i}");
                assert_eq!(bits(&s_kfused), bits(&s_kplain), "K-first state, K {kd} V {vd}");
            }
        }
    }

    /// Steps on the v-first state agree with the f64 recurrence on the K-first one.
    #[test]
    fn steps_match_the_f64_recurrence() {
        // K below one group of eight (the remainder alone) and across two groups and a remainder.
        for (t, kd, vd) in [(20, 6, 5), (12, 21, 7)] {
            let mut rng = Gen::new(2);
            let mut q = rng.uniform_f32(t * kd, -1.0, 1.0);
            let mut k = rng.uniform_f32(t * kd, -1.0, 1.0);
            let v = rng.uniform_f32(t * vd, -1.0, 1.0);
            let g = rng.uniform_f32(t * kd, -1.0, 0.0);
            let beta = rng.uniform_f32(t, 0.0, 1.0);
            let f = |x: &[f32]| x.iter().map(|&v| f64::from(v)).collect::<Vec<_>>();
            let seq = KdaSequence {
                q: &f(&q),
                k: &f(&k),
                v: &f(&v),
                g: &f(&g),
                beta: &f(&beta),
                heads: 1,
                kd,
                vd,
            };
            let (o_ref, s_ref) = kda_recurrence(seq, None, 0.5, true);
            let (mut s, mut decay, mut o) =
                (vec![0.0f32; vd * kd], vec![0.0; kd], vec![0.0f32; t * vd]);
            for i in 0..t {
                let (qi, ki) = (&mut q[i * kd..(i + 1) * kd], &mut k[i * kd..(i + 1) * kd]);
                l2norm_row(qi, 0.5);
                l2norm_row(ki, 1.0);
                let (vi, gi) = (&v[i * vd..(i + 1) * vd], &g[i * kd..(i + 1) * kd]);
                step(&mut s, qi, ki, vi, gi, beta[i], &mut decay, &mut o[i * vd..(i + 1) * vd]);
            }
            let tol = kda_testkit::Tolerance::new(1e-5, 1e-6);
            tol.assert_close(&[t, vd], &o, &o_ref);
            // The cache is v-first: s is the transpose of the oracle's [K, V].
            let s_kfirst: Vec<f32> = (0..kd * vd).map(|i| s[(i % vd) * kd + i / vd]).collect();
            tol.assert_close(&[kd, vd], &s_kfirst, &s_ref);

            // The same steps on the K-first state, as a transposed view hands it over: the v-first
            // step's bits (a K-first cache and kda's own give the same results).
            let (o_vfirst, s_vfirst) = (o, s_kfirst);
            let (mut s, mut u, mut decay, mut o) =
                (vec![0.0f32; kd * vd], vec![0.0; vd], vec![0.0; kd], vec![0.0f32; t * vd]);
            for i in 0..t {
                let (qi, ki) = (&q[i * kd..(i + 1) * kd], &k[i * kd..(i + 1) * kd]);
                let (vi, gi) = (&v[i * vd..(i + 1) * vd], &g[i * kd..(i + 1) * kd]);
                let (scratch, oi) = ((&mut u[..], &mut decay[..]), &mut o[i * vd..(i + 1) * vd]);
                step_kfirst(&mut s, qi, ki, vi, gi, beta[i], scratch, oi);
            }
            kda_testkit::Tolerance::exact().assert_close(&[t, vd], &o, &o_vfirst);
            kda_testkit::Tolerance::exact().assert_close(&[kd, vd], &s, &s_vfirst);
        }
    }
}
