//! The forget gate's log decay in fp32, both forms (`docs/design/kda.md#gate`).

use std::borrow::Cow;

use kda_core::kda::{GateDims, GateForm, KdaGate, SOFTPLUS_THRESHOLD};

use super::super::Exec;
use super::io::{T, par_for_each, read_f32, with_f32_out};

/// `ln(1 + e^a)`, or `a` above the threshold 20 (where the two agree to f32 precision).
pub(crate) fn softplus(a: f32) -> f32 {
    if a > SOFTPLUS_THRESHOLD { a } else { a.exp().ln_1p() }
}

/// `1 / (1 + e^-z)`, written so that neither branch overflows.
pub(crate) fn sigmoid(z: f32) -> f32 {
    if z >= 0.0 {
        1.0 / (1.0 + (-z).exp())
    } else {
        let e = z.exp();
        e / (1.0 + e)
    }
}

/// The log decay of one channel from its logit `a = g1 + dt_bias` and its head's `exp(A_log)`
/// (taken once per head).
///
/// The lower-bound form promises `g ∈ (lower_bound, 0]`, but once `sigmoid` rounds to 1 (for
/// arguments above about 17) f32 has nothing strictly between `lower_bound · 1` and
/// `lower_bound`; such results are moved one ulp towards zero, an error of at most one ulp that
/// keeps the interval open as the formula has it.
#[inline(always)]
fn gate_of(form: GateForm, exp_a_log: f32, a: f32) -> f32 {
    match form {
        GateForm::Softplus => -exp_a_log * softplus(a),
        GateForm::LowerBound { lower_bound } => {
            let g = lower_bound * sigmoid(exp_a_log * a);
            if g <= lower_bound {
                // One step towards zero: for a negative float, the next smaller bit pattern.
                f32::from_bits(lower_bound.to_bits() - 1)
            } else {
                g
            }
        }
    }
}

/// The gate's parameters widened to f32: `A_log` `[H]`, `dt_bias` `[H, D]`.
#[derive(Debug)]
pub(crate) struct GateParams<'a> {
    pub form: GateForm,
    pub a_log: Cow<'a, [f32]>,
    pub dt_bias: Cow<'a, [f32]>,
    pub dim: usize,
}

impl<'a> GateParams<'a> {
    pub(super) fn read(form: GateForm, a_log: &'a T, dt_bias: &'a T, dim: usize) -> Self {
        Self { form, a_log: read_f32(a_log), dt_bias: read_f32(dt_bias), dim }
    }

    /// Head `h`'s logits `row` (`[D]`, widened) replaced by their log decay, in place: the one
    /// place the gate is applied, for [`KdaGate`] and for the chunk kernel's in-kernel gate.
    #[inline(always)]
    pub(crate) fn activate(&self, h: usize, row: &mut [f32]) {
        let exp_a_log = self.a_log[h].exp();
        for (x, &bias) in row.iter_mut().zip(&self.dt_bias[h * self.dim..(h + 1) * self.dim]) {
            *x = gate_of(self.form, exp_a_log, *x + bias);
        }
    }
}

pub(in crate::kernels) fn kda_gate(
    op: &KdaGate<crate::ReferenceBackend>,
    dims: GateDims,
    exec: &Exec,
) -> Result<(), String> {
    let GateDims { heads, dim, .. } = dims;
    let params = GateParams::read(op.form, &op.a_log, &op.dt_bias, dim);
    let g1 = read_f32(&op.g1);
    if g1.is_empty() || dim == 0 {
        return Ok(());
    }
    with_f32_out(&op.g, |g| {
        g.copy_from_slice(&g1);
        // Rows of `D`: the heads of token 0, then of token 1, …; whole tokens per task.
        let tokens = g.len() / (heads * dim);
        let chunk = super::io::rows_per_thread(exec, tokens, heads * dim);
        let parts: Vec<&mut [f32]> = g.chunks_mut(chunk).collect();
        par_for_each(exec, parts, |part| {
            for (i, row) in part.chunks_exact_mut(dim).enumerate() {
                params.activate(i % heads, row);
            }
        });
    });
    Ok(())
}

/// `y = sigmoid(x)` in f32 (the projection's preprocessed beta, and dispatch's sigmoid of raw
/// beta): `x` widened exactly, one rounding in the sigmoid itself.
pub(in crate::kernels) fn sigmoid_op(x: &T, y: &T) -> Result<(), String> {
    let values = read_f32(x);
    with_f32_out(y, |out| {
        for (o, &v) in out.iter_mut().zip(values.iter()) {
            *o = sigmoid(v);
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use kda_testkit::oracle_kda::{gate_lower_bound, gate_softplus};

    /// The gate from `A_log` itself.
    fn gate(form: GateForm, a_log: f32, a: f32) -> f32 {
        gate_of(form, a_log.exp(), a)
    }

    #[test]
    fn both_forms_follow_their_formulas_and_stay_in_range() {
        let form = GateForm::LowerBound { lower_bound: -5.0 };
        for a_log in [-2.0f32, 0.0, 1.5] {
            for a in [-30.0f32, -20.0, -1.0, 0.0, 1.0, 20.0, 20.5, 30.0] {
                let (al, x) = (f64::from(a_log), f64::from(a));
                let soft = gate(GateForm::Softplus, a_log, a);
                let want = gate_softplus(al, x);
                assert!((f64::from(soft) - want).abs() <= 1e-6 * want.abs() + 1e-12, "{a_log} {a}");
                assert!(soft <= 0.0);
                let lb = gate(form, a_log, a);
                let want = gate_lower_bound(-5.0, al, x);
                assert!((f64::from(lb) - want).abs() <= 1e-6 * want.abs() + 1e-12, "{a_log} {a}");
                assert!(lb <= 0.0 && lb > -5.0, "{a_log} {a}: {lb}");
            }
        }
        // sigmoid(exp(1.5) · 30) is 1 in f32: the result is the float just above the bound.
        assert_eq!(gate(form, 1.5, 30.0), f32::from_bits((-5.0f32).to_bits() - 1));
        assert!(
            gate(form, 0.0, f32::NAN).is_nan() && gate(GateForm::Softplus, 0.0, f32::NAN).is_nan()
        );
    }
}
