//! Shape, dtype and parameter checks shared by the KDA op descriptors. Every error names the op,
//! the parameter, what was expected (with the sizes it was derived from) and what was given.

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::resource::Resources;
use crate::tensor::Tensor;

/// Require a float dtype (bf16, f16 or f32).
pub(crate) fn float<B: Resources>(
    op: &'static str,
    param: &'static str,
    t: &Tensor<B>,
) -> Result<()> {
    if t.dtype().is_float() {
        Ok(())
    } else {
        Err(Error::DType { op, param, expected: "bf16, f16 or f32".into(), actual: t.dtype() })
    }
}

/// Require exactly `dtype`.
pub(crate) fn dtype<B: Resources>(
    op: &'static str,
    param: &'static str,
    t: &Tensor<B>,
    dtype: DType,
) -> Result<()> {
    if t.dtype() == dtype {
        Ok(())
    } else {
        Err(Error::DType { op, param, expected: dtype.name().into(), actual: t.dtype() })
    }
}

/// Require rank `N` and return the sizes; `names` spells the expected shape (e.g. `"[T, H, K]"`).
pub(crate) fn dims<B: Resources, const N: usize>(
    op: &'static str,
    param: &'static str,
    t: &Tensor<B>,
    names: &str,
) -> Result<[usize; N]> {
    <[usize; N]>::try_from(t.shape()).map_err(|_| Error::Shape {
        op,
        param,
        expected: names.into(),
        actual: t.shape().to_vec(),
    })
}

/// Require `t`'s shape to be `want`; `why` says where the sizes come from (e.g. `"T, H, K of q"`).
pub(crate) fn shape<B: Resources>(
    op: &'static str,
    param: &'static str,
    t: &Tensor<B>,
    want: &[usize],
    why: &str,
) -> Result<()> {
    if t.shape() == want {
        Ok(())
    } else {
        Err(Error::Shape {
            op,
            param,
            expected: format!("{want:?} ({why})"),
            actual: t.shape().to_vec(),
        })
    }
}

/// Require an i32 tensor of shape `want` (per-request metadata).
pub(crate) fn meta<B: Resources>(
    op: &'static str,
    param: &'static str,
    t: &Tensor<B>,
    want: &[usize],
    why: &str,
) -> Result<()> {
    dtype(op, param, t, DType::I32)?;
    shape(op, param, t, want, why)
}

/// Require a finite float parameter, optionally within a condition spelled in `expected`.
pub(crate) fn param(
    op: &'static str,
    param: &'static str,
    value: f32,
    ok: bool,
    expected: &str,
) -> Result<()> {
    if value.is_finite() && ok {
        Ok(())
    } else {
        Err(Error::Param { op, param, expected: expected.into(), actual: value.to_string() })
    }
}
