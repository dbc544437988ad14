//! The layer's other parameters: `A_log`, `dt_bias`, `o_norm.weight` (f32 on the host) and the
//! row-parallel `o_proj.weight` (this rank's columns, in the weight dtype).

use super::host::HostTensor;
use super::source::{TensorRead, read_all};
use super::{WeightError, expect_float, expect_shape, fmt_shape};
use crate::config::LayerDims;
use kda_core::dtype::DType;

pub const A_LOG: &str = "A_log";
pub const DT_BIAS: &str = "dt_bias";
pub const O_NORM: &str = "o_norm.weight";
pub const O_PROJ: &str = "o_proj.weight";

/// `A_log`: `[H]`, `[1, 1, H, 1]`, or 1-D longer than `H` whose tail is zero (padding). Returns
/// this rank's `[lh]`, f32.
pub fn load_a_log(dims: &LayerDims, t: &dyn TensorRead) -> Result<HostTensor, WeightError> {
    let h = dims.heads;
    expect_float(A_LOG, t)?;
    let heads = dims.head_range();
    let values = match t.shape() {
        [n] if *n == h => t.read(&[heads])?,
        [1, 1, n, 1] if *n == h => t.read(&[0..1, 0..1, heads, 0..1])?,
        [n] if *n > h => {
            let all = read_all(t)?.float_values(A_LOG)?;
            if let Some((i, v)) = all.iter().enumerate().skip(h).find(|(_, v)| **v != 0.0) {
                return Err(WeightError::value(
                    A_LOG,
                    format!(
                        "1-D of length {n} > num_heads = {h} is padding only if entries {h}.. are \
                         zero, but entry {i} is {v}"
                    ),
                ));
            }
            HostTensor::from_f32(&[dims.local_heads], all[heads].to_vec())?
        }
        other => {
            return Err(WeightError::shape(
                A_LOG,
                format!(
                    "{} or {} [num_heads] (or 1-D zero-padded beyond num_heads)",
                    fmt_shape(&[h]),
                    fmt_shape(&[1, 1, h, 1])
                ),
                other,
            ));
        }
    };
    values.cast(DType::F32)?.reshape(&[dims.local_heads])
}

/// `dt_bias`: `[P]` or `[H, D]`. Returns this rank's `[lp]`, f32.
pub fn load_dt_bias(dims: &LayerDims, t: &dyn TensorRead) -> Result<HostTensor, WeightError> {
    expect_float(DT_BIAS, t)?;
    let (h, d, p) = (dims.heads, dims.head_dim, dims.proj);
    let values = match t.shape() {
        [n] if *n == p => t.read(&[dims.proj_range()])?,
        [a, b] if *a == h && *b == d => t.read(&[dims.head_range(), 0..d])?,
        other => {
            return Err(WeightError::shape(
                DT_BIAS,
                format!("{} or {} [num_heads * head_dim]", fmt_shape(&[p]), fmt_shape(&[h, d])),
                other,
            ));
        }
    };
    values.cast(DType::F32)?.reshape(&[dims.local_proj])
}

/// `o_norm.weight`: `[D]`, replicated. f32.
pub fn load_o_norm(dims: &LayerDims, t: &dyn TensorRead) -> Result<HostTensor, WeightError> {
    expect_float(O_NORM, t)?;
    expect_shape(O_NORM, t, &[dims.head_dim], "[head_dim]")?;
    read_all(t)?.cast(DType::F32)
}

/// `o_proj.weight`: `[Hd, P]`, row parallel: this rank's columns `[Hd, lp]`, in `dtype`. Each
/// rank's output is a partial sum; the engine all-reduces.
pub fn load_o_proj(
    dims: &LayerDims,
    dtype: DType,
    t: &dyn TensorRead,
) -> Result<HostTensor, WeightError> {
    expect_float(O_PROJ, t)?;
    expect_shape(O_PROJ, t, &[dims.hidden, dims.proj], "[hidden_size, num_heads * head_dim]")?;
    t.read(&[0..dims.hidden, dims.proj_range()])?.cast(dtype)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Tp, tiny_config};

    fn dims() -> LayerDims {
        tiny_config(5).dims(Tp::new(2, 1).unwrap()).unwrap()
    }

    fn iota(shape: &[usize]) -> HostTensor {
        let n = shape.iter().product::<usize>();
        HostTensor::from_f32(shape, (0..n).map(|i| i as f32 + 1.0).collect()).unwrap()
    }

    #[test]
    fn a_log_accepts_its_three_shapes() {
        let d = dims();
        for t in [iota(&[4]), iota(&[1, 1, 4, 1])] {
            assert_eq!(load_a_log(&d, &t).unwrap().as_f32().unwrap(), &[3.0, 4.0]);
        }
        let padded = HostTensor::from_f32(&[6], vec![1.0, 2.0, 3.0, 4.0, 0.0, -0.0]).unwrap();
        assert_eq!(load_a_log(&d, &padded).unwrap().as_f32().unwrap(), &[3.0, 4.0]);
        let dirty = HostTensor::from_f32(&[6], vec![1.0, 2.0, 3.0, 4.0, 0.0, 0.5]).unwrap();
        let e = load_a_log(&d, &dirty).unwrap_err().to_string();
        assert_eq!(
            e,
            "A_log: 1-D of length 6 > num_heads = 4 is padding only if entries 4.. are zero, but entry 5 is 0.5"
        );
        let e = load_a_log(&d, &iota(&[3])).unwrap_err().to_string();
        assert!(e.starts_with("A_log: shape [3], expected [4] or [1, 1, 4, 1]"), "{e}");
    }

    #[test]
    fn dt_bias_o_norm_o_proj() {
        let d = dims();
        for t in [iota(&[8]), iota(&[4, 2])] {
            assert_eq!(load_dt_bias(&d, &t).unwrap().as_f32().unwrap(), &[5.0, 6.0, 7.0, 8.0]);
        }
        assert!(load_dt_bias(&d, &iota(&[2, 4])).is_err());
        assert_eq!(load_o_norm(&d, &iota(&[2])).unwrap().as_f32().unwrap(), &[1.0, 2.0]);
        assert!(
            load_o_norm(&d, &iota(&[4]))
                .unwrap_err()
                .to_string()
                .contains("expected [2] [head_dim]")
        );
        // [Hd 5, P 8]: rank 1 takes columns 4..8 of every row.
        let o = load_o_proj(&d, DType::BF16, &iota(&[5, 8])).unwrap();
        assert_eq!((o.dtype(), o.shape()), (DType::BF16, &[5usize, 4][..]));
        assert_eq!(&o.to_f32_vec().unwrap()[..8], &[5., 6., 7., 8., 13., 14., 15., 16.]);
        let e = load_o_proj(&d, DType::BF16, &iota(&[8, 5])).unwrap_err().to_string();
        assert!(e.starts_with("o_proj.weight: shape [8, 5], expected [5, 8]"), "{e}");
    }
}
