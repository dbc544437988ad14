//! The short convolution: depthwise causal conv1d + SiLU with conv state, for prefill (varlen
//! flat batch), decode and speculative decode. The state protocol is documented in
//! [`kda_core::kda::conv`].

use kda_core::DType;
use kda_core::kda::{CausalConv, CausalConvUpdate, ConvDims, ConvUpdateDims};
use kda_core::layout::Layout;

use super::super::Exec;
use super::io::{
    T, par_for_each, par_map, read_f32, read_i32, request_ranges, row, slot, with_f32_out,
    write_f32,
};
use crate::ReferenceBackend;

/// `x · sigmoid(x)`.
pub(crate) fn silu(x: f32) -> f32 {
    x * super::gate::sigmoid(x)
}

/// The weights `[C, W]` as `[W, C]`, so the inner loop runs over contiguous channels.
pub(crate) fn transpose_weight(weight: &[f32], channels: usize, width: usize) -> Vec<f32> {
    let mut t = vec![0.0; channels * width];
    for c in 0..channels {
        for j in 0..width {
            t[j * channels + c] = weight[c * width + j];
        }
    }
    t
}

/// One request: `inputs` are its `W - 1` history rows followed by its `n` new rows (`[W-1+n, C]`,
/// oldest first); writes `y` (`[n, C]`) with `y_t[c] = silu(Σ_j w[c, j] · inputs[t + j][c])`.
pub(crate) fn conv_silu(
    inputs: &[f32],
    weight_t: &[f32],
    channels: usize,
    width: usize,
    y: &mut [f32],
) {
    conv_silu_rows(|r| &inputs[r * channels..(r + 1) * channels], weight_t, (channels, width), y);
}

/// [`conv_silu`] with input row `r` (history first) given by `input`, so that a request's
/// history can be read where it lies.
fn conv_silu_rows<'a>(
    input: impl Fn(usize) -> &'a [f32],
    weight_t: &[f32],
    (channels, width): (usize, usize),
    y: &mut [f32],
) {
    let mut acc = vec![0.0f32; channels];
    for (t, out) in y.chunks_exact_mut(channels).enumerate() {
        acc.fill(0.0);
        for j in 0..width {
            let w = &weight_t[j * channels..(j + 1) * channels];
            for ((a, &x), &w) in acc.iter_mut().zip(input(t + j)).zip(w) {
                *a += w * x;
            }
        }
        for (o, &a) in out.iter_mut().zip(&acc) {
            *o = silu(a);
        }
    }
}

/// The weights `[C, W]` as `[W, C]`: the view itself when it is the transpose of a contiguous
/// `[W, C]` f32 tensor (as the layer stores it), else a transposed copy.
fn weight_by_tap(weight: &T, channels: usize, width: usize) -> std::borrow::Cow<'_, [f32]> {
    let layout = weight.layout();
    if weight.dtype() == DType::F32 && layout.strides() == [1, channels] {
        let by_tap =
            Layout::strided(DType::F32, &[width, channels], &[channels, 1], layout.offset());
        if let Ok(by_tap) = by_tap {
            // SAFETY: the same elements as the validated f32 weight view, which the stream
            // contract keeps writers off while the op runs.
            return std::borrow::Cow::Borrowed(unsafe { weight.buffer().slice::<f32>(&by_tap) });
        }
    }
    std::borrow::Cow::Owned(transpose_weight(&read_f32(weight), channels, width))
}

/// Rows `start .. start + len` of a state slot `[1, L, C]` view.
fn state_rows(state: &T, slot: usize, start: usize, len: usize) -> Result<T, String> {
    row(state, slot)?.narrow(1, start, len).map_err(|e| e.to_string())
}

pub(in crate::kernels) fn prefill(
    op: &CausalConv<ReferenceBackend>,
    dims: ConvDims,
    exec: &Exec,
) -> Result<(), String> {
    let ConvDims { tokens, channels, width, slots, .. } = dims;
    if channels == 0 {
        return Ok(());
    }
    let ranges = request_ranges("query_start_loc", &read_i32(&op.query_start_loc), tokens)?;
    let slot_of = read_i32(&op.state_slots);
    let fresh: Vec<bool> = read_i32(&op.has_initial_state).iter().map(|&h| h == 0).collect();
    let request_slots = slot_of
        .iter()
        .enumerate()
        .map(|(b, &s)| slot("state_slots", format!("[{b}]"), s, slots))
        .collect::<Result<Vec<_>, _>>()?;
    let hist = width - 1;
    // Histories are read before any state is written, so two requests sharing a slot still
    // each see the old one.
    let histories = request_slots
        .iter()
        .zip(&fresh)
        .map(|(&s, &fresh)| match s {
            Some(s) if !fresh => Ok(read_f32(&state_rows(&op.state, s, 0, hist)?).into_owned()),
            _ => Ok(vec![0.0; hist * channels]),
        })
        .collect::<Result<Vec<_>, String>>()?;
    let x = read_f32(&op.x);
    let weight_t = weight_by_tap(&op.weight, channels, width);
    let results = par_map(exec, ranges.len(), |b| {
        let rows = ranges[b].clone();
        let mut inputs = histories[b].clone();
        inputs.extend_from_slice(&x[rows.start * channels..rows.end * channels]);
        let mut y = vec![0.0f32; rows.len() * channels];
        if request_slots[b].is_some() {
            conv_silu(&inputs, &weight_t, channels, width, &mut y);
        }
        // The last W - 1 inputs, history included.
        let tail = inputs[inputs.len() - hist * channels..].to_vec();
        (y, tail)
    });
    for (b, (y, tail)) in results.into_iter().enumerate() {
        let rows = ranges[b].clone();
        write_f32(&op.y.narrow(0, rows.start, rows.len()).map_err(|e| e.to_string())?, &y);
        if let Some(s) = request_slots[b] {
            write_f32(&state_rows(&op.state, s, 0, hist)?, &tail);
        }
    }
    Ok(())
}

pub(in crate::kernels) fn update(
    op: &CausalConvUpdate<ReferenceBackend>,
    dims: ConvUpdateDims,
    exec: &Exec,
) -> Result<(), String> {
    let ConvUpdateDims { batch, tokens: n, channels, width, slots, state_len } = dims;
    if channels == 0 {
        return Ok(());
    }
    let request_slots = read_i32(&op.state_slots)
        .iter()
        .enumerate()
        .map(|(b, &s)| slot("state_slots", format!("[{b}]"), s, slots))
        .collect::<Result<Vec<_>, _>>()?;
    let accepted = match &op.num_accepted_tokens {
        Some(a) => read_i32(a),
        None => vec![1; batch],
    };
    let hist = width - 1;
    // Each live request's first history row: `num_accepted_tokens - 1`.
    let mut starts = Vec::with_capacity(batch);
    for (b, (&s, &a)) in request_slots.iter().zip(&accepted).enumerate() {
        let max = state_len + 1 - hist;
        if s.is_some() && (a < 1 || a as usize > max) {
            return Err(format!(
                "num_accepted_tokens[{b}] = {a} is not within 1..={max} (state rows L = {state_len}, W = {width})"
            ));
        }
        starts.push(a.max(1) as usize - 1);
    }
    let x = read_f32(&op.x);
    let weight_t = weight_by_tap(&op.weight, channels, width);
    let request = Request { x: &x, weight_t: &weight_t, dims };
    if update_in_place(op, exec, &request_slots, &starts, &request)? {
        return Ok(());
    }
    // The copying path: every live slot's rows are read before any is written (two requests
    // may share a slot, and each sees the old one), each request runs on its own copy, and the
    // rows the next step reads are written back.
    let mut copies = Vec::with_capacity(batch);
    for s in &request_slots {
        copies.push(match *s {
            Some(s) => Some(read_f32(&state_rows(&op.state, s, 0, state_len)?).into_owned()),
            None => None,
        });
    }
    let per_request = n * channels;
    let mut y_all = vec![0.0f32; batch * per_request];
    if n > 0 {
        let tasks: Vec<_> =
            y_all.chunks_mut(per_request).zip(copies.iter_mut()).zip(&starts).enumerate().collect();
        par_for_each(exec, tasks, |(b, ((y, rows), &start))| {
            if let Some(rows) = rows {
                request.run_in_place(b, rows, start, y);
            }
        });
        let kept = hist + n - 1;
        for (s, rows) in request_slots.iter().zip(&copies) {
            if let (Some(s), Some(rows), true) = (*s, rows, kept > 0) {
                write_f32(&state_rows(&op.state, s, 0, kept)?, &rows[..kept * channels]);
            }
        }
    }
    write_f32(&op.y, &y_all);
    Ok(())
}

/// What every request of a conv update shares: the new rows `x` (`[B, n, C]`), the weights by
/// tap (`[W, C]`) and the op's dimensions.
struct Request<'a> {
    x: &'a [f32],
    weight_t: &'a [f32],
    dims: ConvUpdateDims,
}

impl Request<'_> {
    /// Request `b` against its slot's rows `state` (`[L, C]`, history from row `start`), in
    /// place: its outputs into `y` (`[n, C]`), then the rows the next step reads (its history
    /// without the oldest row, then its new rows) into the slot from row 0.
    fn run_in_place(&self, b: usize, state: &mut [f32], start: usize, y: &mut [f32]) {
        let ConvUpdateDims { tokens: n, channels: c, width, .. } = self.dims;
        let hist = width - 1;
        let new = &self.x[b * n * c..(b + 1) * n * c];
        {
            let state = &*state;
            let input = |r: usize| {
                if r < hist { &state[(start + r) * c..][..c] } else { &new[(r - hist) * c..][..c] }
            };
            conv_silu_rows(input, self.weight_t, (c, width), y);
        }
        // Row `i` takes input row `i + 1`; a history row moves towards row 0, never onto a row
        // still to be read.
        for i in 0..hist + n - 1 {
            let r = i + 1;
            if r < hist {
                state.copy_within((start + r) * c..(start + r + 1) * c, i * c);
            } else {
                state[i * c..(i + 1) * c].copy_from_slice(&new[(r - hist) * c..][..c]);
            }
        }
    }
}

/// The decode update with every live request's history read, and its new state written, where
/// they lie in the cache: taken when the state is f32, each live slot's `[L, C]` rows are one
/// contiguous run, no two live requests share a slot and there are new rows. Otherwise this
/// returns `Ok(false)` before anything is read or written, and the caller takes the copying
/// path, which reads and writes any view.
fn update_in_place(
    op: &CausalConvUpdate<ReferenceBackend>,
    exec: &Exec,
    request_slots: &[Option<usize>],
    starts: &[usize],
    request: &Request<'_>,
) -> Result<bool, String> {
    let ConvUpdateDims { tokens: n, channels, state_len, .. } = request.dims;
    let mut seen = std::collections::HashSet::new();
    if n == 0
        || op.state.dtype() != DType::F32
        || !request_slots.iter().flatten().all(|&s| seen.insert(s))
    {
        return Ok(false);
    }
    // Every view is checked before the first slice is made, so a refusal leaves nothing behind.
    let mut views = Vec::with_capacity(request_slots.len());
    for s in request_slots {
        let Some(s) = *s else {
            views.push(None);
            continue;
        };
        let view = state_rows(&op.state, s, 0, state_len)?;
        if !view.layout().is_contiguous() {
            return Ok(false);
        }
        views.push(Some(view.layout().clone()));
    }
    with_f32_out(&op.y, |y| {
        let tasks: Vec<_> = y
            .chunks_mut(n * channels)
            .zip(views)
            .zip(starts)
            .enumerate()
            .map(|(b, ((y, view), &start))| {
                // SAFETY: the elements of a validated f32 view of one slot's rows as the
                // contiguous run they form; the live requests' slots are distinct (checked
                // above) and `state`, an output, was validated not to overlap itself or any
                // other operand, so these slices are disjoint from each other and from `y`;
                // the stream contract keeps every other thread off the cache while the op runs.
                let state = view.map(|v| unsafe { op.state.buffer().slice_mut::<f32>(&v) });
                (b, y, state, start)
            })
            .collect();
        par_for_each(exec, tasks, |(b, y, state, start)| match state {
            Some(state) => request.run_in_place(b, state, start, y),
            None => y.fill(0.0),
        });
    });
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kda_testkit::Gen;
    use kda_testkit::oracle_kda::causal_conv;

    /// The layer's cache (f32, contiguous slots) takes the in-place path; the same values seen
    /// through a strided view, and two requests in one slot, are left to the copying one.
    #[test]
    fn the_in_place_path_is_taken_where_it_can_be() {
        let b = crate::ReferenceBackend::new();
        let s = b.new_stream().unwrap();
        let (c, w, n) = (8, 4, 1);
        let dims = ConvUpdateDims {
            batch: 2,
            tokens: n,
            channels: c,
            width: w,
            slots: 3,
            state_len: w - 1,
        };
        let tensor = |dtype: DType, shape: &[usize]| {
            let t = b.alloc(dtype, shape).unwrap();
            let value = if dtype == DType::I32 { 0.0 } else { 0.5 };
            b.launch(&s, kda_core::Op::Fill { dst: t.clone(), value }).unwrap();
            t
        };
        let op = |state: T| CausalConvUpdate {
            x: tensor(DType::F32, &[2, n, c]),
            weight: tensor(DType::F32, &[c, w]),
            state_slots: tensor(DType::I32, &[2]),
            num_accepted_tokens: None,
            state,
            y: tensor(DType::F32, &[2, n, c]),
        };
        let dense = op(tensor(DType::F32, &[3, w - 1, c]));
        let strided = op(tensor(DType::F32, &[3, w - 1, 2 * c]).narrow(2, 0, c).unwrap());
        b.synchronize(&s).unwrap();
        let (x, weight_t) = (vec![0.25f32; 2 * n * c], vec![0.1f32; w * c]);
        let request = Request { x: &x, weight_t: &weight_t, dims };
        let run = |op: &CausalConvUpdate<ReferenceBackend>, slots: &[Option<usize>]| {
            update_in_place(op, &Exec::serial(), slots, &[0, 0], &request).unwrap()
        };
        assert!(run(&dense, &[Some(2), Some(0)]), "the layer's cache");
        assert!(run(&dense, &[None, Some(0)]), "with a padding request");
        assert!(!run(&strided, &[Some(2), Some(0)]), "slots that are not contiguous");
        assert!(!run(&dense, &[Some(1), Some(1)]), "two requests in one slot");
    }

    #[test]
    fn one_request_matches_the_f64_conv() {
        let (c, w, n) = (5, 4, 9);
        let mut rng = Gen::new(1);
        let inputs = rng.uniform_f32((w - 1 + n) * c, -2.0, 2.0);
        let weight = rng.uniform_f32(c * w, -1.0, 1.0);
        let mut y = vec![0.0f32; n * c];
        conv_silu(&inputs, &transpose_weight(&weight, c, w), c, w, &mut y);
        let f = |x: &[f32]| x.iter().map(|&v| f64::from(v)).collect::<Vec<_>>();
        let split = (w - 1) * c;
        let want = causal_conv(&f(&inputs[..split]), &f(&inputs[split..]), &f(&weight), c, w);
        kda_testkit::Tolerance::for_dtype(DType::F32).assert_close(&[n, c], &y, &want);
    }
}
