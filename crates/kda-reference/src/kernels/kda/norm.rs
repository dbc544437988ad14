//! The q/k L2 norm with its scale, and the gated RMSNorm of the output, in fp32.

use kda_core::kda::{GatedRmsNorm, L2NORM_EPS, L2Norm, RowDims};

use super::super::Exec;
use super::gate::sigmoid;
use super::io::{read_f32, write_f32};
use super::simd::dot;

/// One row in place: `x = x / sqrt(Σx² + 1e-6) · scale` (normalise, then scale:
/// `docs/design/kda.md#qk-norm`).
pub(crate) fn l2norm_row(x: &mut [f32], scale: f32) {
    let inv = 1.0 / (dot(x, x) + L2NORM_EPS).sqrt();
    for v in x {
        *v = *v * inv * scale;
    }
}

/// `y = x · rsqrt(mean(x²) + eps) · w · sigmoid(gate)` for one row.
pub(crate) fn gated_rms_norm_row(x: &[f32], gate: &[f32], weight: &[f32], eps: f32, y: &mut [f32]) {
    let mean_square = dot(x, x) / x.len().max(1) as f32;
    let inv = 1.0 / (mean_square + eps).sqrt();
    for (((y, &x), &w), &g) in y.iter_mut().zip(x).zip(weight).zip(gate) {
        *y = x * inv * w * sigmoid(g);
    }
}

pub(in crate::kernels) fn l2norm(
    op: &L2Norm<crate::ReferenceBackend>,
    dims: RowDims,
    exec: &Exec,
) -> Result<(), String> {
    let RowDims { rows, dim } = dims;
    let mut values = read_f32(&op.x).into_owned();
    if dim > 0 {
        let chunk = super::io::rows_per_thread(exec, rows, dim);
        let chunks: Vec<&mut [f32]> = values.chunks_mut(chunk).collect();
        super::io::par_for_each(exec, chunks, |rows| {
            for row in rows.chunks_exact_mut(dim) {
                l2norm_row(row, op.scale);
            }
        });
    }
    write_f32(&op.y, &values);
    Ok(())
}

pub(in crate::kernels) fn gated_rms_norm(
    op: &GatedRmsNorm<crate::ReferenceBackend>,
    dims: RowDims,
    exec: &Exec,
) -> Result<(), String> {
    let RowDims { rows, dim } = dims;
    let (x, gate, weight) = (read_f32(&op.x), read_f32(&op.gate), read_f32(&op.weight));
    let mut y = vec![0.0f32; rows * dim];
    if dim > 0 {
        let chunk = super::io::rows_per_thread(exec, rows, dim);
        let parts: Vec<(usize, &mut [f32])> =
            y.chunks_mut(chunk).enumerate().map(|(i, p)| (i * chunk, p)).collect();
        super::io::par_for_each(exec, parts, |(start, out)| {
            for (r, out_row) in out.chunks_exact_mut(dim).enumerate() {
                let at = start + r * dim;
                let row = at..at + dim;
                gated_rms_norm_row(&x[row.clone()], &gate[row], &weight, op.eps, out_row);
            }
        });
    }
    write_f32(&op.y, &y);
    Ok(())
}
