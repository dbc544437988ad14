//! The forget gate's log decay in fp32, both forms (KDA.md "Inside KDA", step 3).

use kda_core::kda::{GateDims, GateForm, KdaGate, SOFTPLUS_THRESHOLD};

use super::super::Exec;
use super::io::{T, read_f32, with_f32_out, write_f32};

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

/// The log decay of one channel from its logit `a = g1 + dt_bias` and its head's `A_log`.
///
/// The lower-bound form promises `g ∈ (lower_bound, 0]`, but once `sigmoid` rounds to 1 (for
/// arguments above about 17) f32 has nothing strictly between `lower_bound · 1` and
/// `lower_bound`; such results are moved one ulp towards zero, an error of at most one ulp that
/// keeps the interval open as the formula has it.
pub(crate) fn gate(form: GateForm, a_log: f32, a: f32) -> f32 {
    match form {
        GateForm::Softplus => -a_log.exp() * softplus(a),
        GateForm::LowerBound { lower_bound } => {
            let g = lower_bound * sigmoid(a_log.exp() * a);
            if g <= lower_bound {
                // One step towards zero: for a negative float, the next smaller bit pattern.
                f32::from_bits(lower_bound.to_bits() - 1)
            } else {
                g
            }
        }
    }
}

pub(in crate::kernels) fn kda_gate(
    op: &KdaGate<crate::ReferenceBackend>,
    _exec: &Exec,
) -> Result<(), String> {
    let GateDims { tokens, heads, dim } = op.validate().map_err(|e| e.to_string())?;
    let (g1, a_log, dt_bias) = (read_f32(&op.g1), read_f32(&op.a_log), read_f32(&op.dt_bias));
    let mut g = vec![0.0f32; tokens * heads * dim];
    if g.is_empty() {
        return Ok(());
    }
    for (t_row, g1_row) in g.chunks_exact_mut(heads * dim).zip(g1.chunks_exact(heads * dim)) {
        for h in 0..heads {
            let cols = h * dim..(h + 1) * dim;
            for ((out, &x), &bias) in
                t_row[cols.clone()].iter_mut().zip(&g1_row[cols.clone()]).zip(&dt_bias[cols])
            {
                *out = gate(op.form, a_log[h], x + bias);
            }
        }
    }
    write_f32(&op.g, &g);
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
