//! The short convolution: depthwise causal conv1d + SiLU with conv state, for prefill (varlen
//! flat batch), decode and speculative decode. The state protocol is documented in
//! [`kda_core::kda::conv`].

use kda_core::kda::{CausalConv, CausalConvUpdate, ConvDims, ConvUpdateDims};

use super::super::Exec;
use super::io::{T, par_map, read_f32, read_i32, request_ranges, row, slot, write_f32};
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
    let mut acc = vec![0.0f32; channels];
    for (t, out) in y.chunks_exact_mut(channels).enumerate() {
        acc.fill(0.0);
        for j in 0..width {
            let x = &inputs[(t + j) * channels..(t + j + 1) * channels];
            let w = &weight_t[j * channels..(j + 1) * channels];
            for ((a, &x), &w) in acc.iter_mut().zip(x).zip(w) {
                *a += w * x;
            }
        }
        for (o, &a) in out.iter_mut().zip(&acc) {
            *o = silu(a);
        }
    }
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
    let weight_t = transpose_weight(&read_f32(&op.weight), channels, width);
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
    let mut histories = Vec::with_capacity(batch);
    for (b, (&s, &a)) in request_slots.iter().zip(&accepted).enumerate() {
        let Some(s) = s else {
            histories.push(Vec::new());
            continue;
        };
        let max = state_len + 1 - hist;
        if a < 1 || a as usize > max {
            return Err(format!(
                "num_accepted_tokens[{b}] = {a} is not within 1..={max} (state rows L = {state_len}, W = {width})"
            ));
        }
        histories.push(read_f32(&state_rows(&op.state, s, a as usize - 1, hist)?).into_owned());
    }
    let x = read_f32(&op.x);
    let weight_t = transpose_weight(&read_f32(&op.weight), channels, width);
    let per_request = n * channels;
    let results = par_map(exec, batch, |b| {
        let mut y = vec![0.0f32; per_request];
        if request_slots[b].is_none() || n == 0 {
            return (y, Vec::new());
        }
        let mut inputs = histories[b].clone();
        inputs.extend_from_slice(&x[b * per_request..(b + 1) * per_request]);
        conv_silu(&inputs, &weight_t, channels, width, &mut y);
        // Drop the oldest row: the next step reads its history at row (accepted - 1).
        let kept = inputs[channels..].to_vec();
        (y, kept)
    });
    let mut y_all = Vec::with_capacity(batch * per_request);
    for (b, (y, kept)) in results.into_iter().enumerate() {
        y_all.extend_from_slice(&y);
        if let (Some(s), false) = (request_slots[b], kept.is_empty()) {
            write_f32(&state_rows(&op.state, s, 0, kept.len() / channels)?, &kept);
        }
    }
    write_f32(&op.y, &y_all);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use kda_testkit::Gen;
    use kda_testkit::oracle_kda::causal_conv;

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
        kda_testkit::Tolerance::for_dtype(kda_core::DType::F32).assert_close(&[n, c], &y, &want);
    }
}
