//! [`HostTensor`]: a weight on the host, dtype + shape + typed data, before it is uploaded.

use std::ops::Range;

use half::{bf16, f16};

use super::WeightError;
use kda_core::dtype::DType;

/// A dense row-major tensor in host memory.
///
/// The elements are kept typed (bf16, f16, f32, i32; u8, E4M3 and E8M0 as bytes), so every
/// accessor is a plain slice with no alignment question; [`HostTensor::as_bytes`] gives the
/// little-endian bytes a device upload or a safetensors file wants.
#[derive(Clone, Debug, PartialEq)]
pub struct HostTensor {
    dtype: DType,
    shape: Vec<usize>,
    data: HostData,
}

#[derive(Clone, Debug, PartialEq)]
enum HostData {
    BF16(Vec<bf16>),
    F16(Vec<f16>),
    F32(Vec<f32>),
    I32(Vec<i32>),
    /// U8, E4M3 and E8M0.
    Bytes(Vec<u8>),
}

/// Elements of `shape`, or an error naming `param`.
pub(crate) fn numel(param: &str, shape: &[usize]) -> Result<usize, WeightError> {
    kda_core::layout::checked_numel(shape).ok_or_else(|| {
        WeightError::shape(param, "a shape whose element count fits in memory", shape)
    })
}

/// A zero-filled vector of `n` elements, or an allocation error instead of an abort.
pub(crate) fn zeroed<T: Copy + Default>(param: &str, n: usize) -> Result<Vec<T>, WeightError> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| WeightError::Alloc {
        param: param.to_string(),
        bytes: n as u128 * std::mem::size_of::<T>() as u128,
    })?;
    v.resize(n, T::default());
    Ok(v)
}

fn check_len(shape: &[usize], len: usize) -> Result<(), WeightError> {
    let n = numel("host tensor", shape)?;
    if n == len {
        Ok(())
    } else {
        Err(WeightError::shape("host tensor", format!("a shape of {len} elements"), shape))
    }
}

impl HostTensor {
    /// An f32 tensor.
    pub fn from_f32(shape: &[usize], values: Vec<f32>) -> Result<Self, WeightError> {
        check_len(shape, values.len())?;
        Ok(HostTensor { dtype: DType::F32, shape: shape.to_vec(), data: HostData::F32(values) })
    }

    /// A bf16 tensor.
    pub fn from_bf16(shape: &[usize], values: Vec<bf16>) -> Result<Self, WeightError> {
        check_len(shape, values.len())?;
        Ok(HostTensor { dtype: DType::BF16, shape: shape.to_vec(), data: HostData::BF16(values) })
    }

    /// A tensor of one-byte elements: `dtype` is U8, E4M3 or E8M0.
    pub fn from_bytes(dtype: DType, shape: &[usize], bytes: Vec<u8>) -> Result<Self, WeightError> {
        if dtype.size_bytes() != 1 {
            return Err(WeightError::dtype("host tensor", "u8, e4m3 or e8m0", dtype));
        }
        check_len(shape, bytes.len())?;
        Ok(HostTensor { dtype, shape: shape.to_vec(), data: HostData::Bytes(bytes) })
    }

    /// A tensor decoded from little-endian bytes (the safetensors encoding).
    pub fn from_le_bytes(dtype: DType, shape: &[usize], bytes: &[u8]) -> Result<Self, WeightError> {
        let n = numel("host tensor", shape)?;
        let expected = n.checked_mul(dtype.size_bytes());
        if expected != Some(bytes.len()) {
            return Err(WeightError::shape(
                "host tensor",
                format!("a shape of {} {dtype} bytes", bytes.len()),
                shape,
            ));
        }
        let data = match dtype {
            DType::BF16 => HostData::BF16(
                bytes
                    .chunks_exact(2)
                    .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])))
                    .collect(),
            ),
            DType::F16 => HostData::F16(
                bytes
                    .chunks_exact(2)
                    .map(|c| f16::from_bits(u16::from_le_bytes([c[0], c[1]])))
                    .collect(),
            ),
            DType::F32 => HostData::F32(
                bytes
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
            ),
            DType::I32 => HostData::I32(
                bytes
                    .chunks_exact(4)
                    .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
            ),
            DType::U8 | DType::E4M3 | DType::E8M0 => HostData::Bytes(bytes.to_vec()),
        };
        Ok(HostTensor { dtype, shape: shape.to_vec(), data })
    }

    /// A zero-filled tensor (an allocation error, not an abort, when it does not fit).
    pub fn zeros(dtype: DType, shape: &[usize]) -> Result<Self, WeightError> {
        let n = numel("host tensor", shape)?;
        let param = "host tensor";
        let data = match dtype {
            DType::BF16 => HostData::BF16(zeroed(param, n)?),
            DType::F16 => HostData::F16(zeroed(param, n)?),
            DType::F32 => HostData::F32(zeroed(param, n)?),
            DType::I32 => HostData::I32(zeroed(param, n)?),
            DType::U8 | DType::E4M3 | DType::E8M0 => HostData::Bytes(zeroed(param, n)?),
        };
        Ok(HostTensor { dtype, shape: shape.to_vec(), data })
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    pub fn numel(&self) -> usize {
        match &self.data {
            HostData::BF16(v) => v.len(),
            HostData::F16(v) => v.len(),
            HostData::F32(v) => v.len(),
            HostData::I32(v) => v.len(),
            HostData::Bytes(v) => v.len(),
        }
    }

    /// The little-endian bytes of the elements (what a device upload or a file holds).
    pub fn as_bytes(&self) -> &[u8] {
        match &self.data {
            HostData::BF16(v) => bytemuck::cast_slice(v),
            HostData::F16(v) => bytemuck::cast_slice(v),
            HostData::F32(v) => bytemuck::cast_slice(v),
            HostData::I32(v) => bytemuck::cast_slice(v),
            HostData::Bytes(v) => v,
        }
    }

    /// The elements of an f32 tensor.
    pub fn as_f32(&self) -> Option<&[f32]> {
        match &self.data {
            HostData::F32(v) => Some(v),
            _ => None,
        }
    }

    /// The elements of a bf16 tensor.
    pub fn as_bf16(&self) -> Option<&[bf16]> {
        match &self.data {
            HostData::BF16(v) => Some(v),
            _ => None,
        }
    }

    /// The bytes of a u8, E4M3 or E8M0 tensor.
    pub fn as_u8(&self) -> Option<&[u8]> {
        match &self.data {
            HostData::Bytes(v) => Some(v),
            _ => None,
        }
    }

    /// The values of a float tensor, widened exactly to f32; `None` for other dtypes.
    pub fn to_f32_vec(&self) -> Option<Vec<f32>> {
        match &self.data {
            HostData::BF16(v) => Some(v.iter().map(|x| x.to_f32()).collect()),
            HostData::F16(v) => Some(v.iter().map(|x| x.to_f32()).collect()),
            HostData::F32(v) => Some(v.clone()),
            _ => None,
        }
    }

    /// The values of a float tensor, exactly, as f64; `None` for other dtypes.
    pub fn to_f64_vec(&self) -> Option<Vec<f64>> {
        Some(self.to_f32_vec()?.into_iter().map(f64::from).collect())
    }

    /// The first element no weight can hold, read as `meaning` (this tensor's dtype, or for
    /// u8 bytes the E4M3 or E8M0 they stand for): a NaN or infinite float, a NaN E4M3 byte
    /// (`0x7F`, `0xFF`), the NaN E8M0 scale `0xFF`. Returns its flat index and a description.
    pub fn first_non_finite(&self, meaning: DType) -> Option<(usize, String)> {
        fn find<T: Copy>(v: &[T], bad: impl Fn(T) -> bool) -> Option<(usize, T)> {
            v.iter().copied().enumerate().find(|&(_, x)| bad(x))
        }
        match &self.data {
            HostData::BF16(v) => find(v, |x| !x.is_finite()).map(|(i, x)| (i, x.to_string())),
            HostData::F16(v) => find(v, |x| !x.is_finite()).map(|(i, x)| (i, x.to_string())),
            HostData::F32(v) => find(v, |x| !x.is_finite()).map(|(i, x)| (i, x.to_string())),
            HostData::I32(_) => None,
            HostData::Bytes(v) => match meaning {
                DType::E4M3 => find(v, kda_core::mx::is_nan_e4m3)
                    .map(|(i, b)| (i, format!("NaN (E4M3 byte {b:#04x})"))),
                DType::E8M0 => find(v, |b| b == kda_core::mx::E8M0_NAN)
                    .map(|(i, b)| (i, format!("NaN (E8M0 scale byte {b:#04x})"))),
                _ => None,
            },
        }
    }

    /// The values of a float tensor as f32, or a dtype error naming `param`.
    pub(crate) fn float_values(&self, param: &str) -> Result<Vec<f32>, WeightError> {
        self.to_f32_vec().ok_or_else(|| WeightError::dtype(param, "bf16, f16 or f32", self.dtype))
    }

    /// The same shape with every value rounded (to nearest even) to the float `dtype`.
    pub fn cast(&self, dtype: DType) -> Result<HostTensor, WeightError> {
        if self.dtype == dtype {
            return Ok(self.clone());
        }
        let values = self.float_values("cast input")?;
        HostTensor::from_f32_as(dtype, &self.shape, &values)
    }

    /// `values` rounded once to the float `dtype`.
    pub fn from_f32_as(dtype: DType, shape: &[usize], values: &[f32]) -> Result<Self, WeightError> {
        check_len(shape, values.len())?;
        let data = match dtype {
            DType::F32 => HostData::F32(values.to_vec()),
            DType::BF16 => HostData::BF16(values.iter().map(|&x| bf16::from_f32(x)).collect()),
            DType::F16 => HostData::F16(values.iter().map(|&x| f16::from_f32(x)).collect()),
            other => return Err(WeightError::dtype("cast output", "bf16, f16 or f32", other)),
        };
        Ok(HostTensor { dtype, shape: shape.to_vec(), data })
    }

    /// Overwrite rows `row0..` of this 2-D tensor with the rows of `src`, rounding each value
    /// once to this tensor's dtype (a same-dtype copy is exact).
    pub fn write_rows(&mut self, row0: usize, src: &HostTensor) -> Result<(), WeightError> {
        const PARAM: &str = "write_rows";
        let [rows, cols] = self.shape[..] else {
            return Err(WeightError::shape(PARAM, "a 2-D destination", &self.shape));
        };
        let (src_rows, src_cols) = match src.shape[..] {
            [r, c] => (r, c),
            _ => return Err(WeightError::shape(PARAM, "a 2-D source", &src.shape)),
        };
        if src_cols != cols || row0.checked_add(src_rows).is_none_or(|end| end > rows) {
            return Err(WeightError::shape(
                PARAM,
                format!(
                    "[<= {}, {cols}] to write at row {row0} of [{rows}, {cols}]",
                    rows - row0.min(rows)
                ),
                &src.shape,
            ));
        }
        let range = row0 * cols..(row0 + src_rows) * cols;
        match (&mut self.data, &src.data) {
            (HostData::BF16(d), HostData::BF16(s)) => d[range].copy_from_slice(s),
            (HostData::F16(d), HostData::F16(s)) => d[range].copy_from_slice(s),
            (HostData::F32(d), HostData::F32(s)) => d[range].copy_from_slice(s),
            (HostData::I32(d), HostData::I32(s)) => d[range].copy_from_slice(s),
            (HostData::Bytes(d), HostData::Bytes(s)) if self.dtype == src.dtype => {
                d[range].copy_from_slice(s)
            }
            (HostData::BF16(d), _) => {
                let s = src.float_values(PARAM)?;
                for (o, v) in d[range].iter_mut().zip(s) {
                    *o = bf16::from_f32(v);
                }
            }
            (HostData::F16(d), _) => {
                let s = src.float_values(PARAM)?;
                for (o, v) in d[range].iter_mut().zip(s) {
                    *o = f16::from_f32(v);
                }
            }
            (HostData::F32(d), _) => {
                let s = src.float_values(PARAM)?;
                d[range].copy_from_slice(&s);
            }
            _ => return Err(WeightError::dtype(PARAM, self.dtype.name(), src.dtype)),
        }
        Ok(())
    }

    /// Overwrite rows `row0..` of this 2-D float tensor with f32 values (whole rows), rounding
    /// each once to this tensor's dtype.
    pub(crate) fn write_rows_f32(
        &mut self,
        row0: usize,
        values: &[f32],
    ) -> Result<(), WeightError> {
        const PARAM: &str = "write_rows";
        let [rows, cols] = self.shape[..] else {
            return Err(WeightError::shape(PARAM, "a 2-D destination", &self.shape));
        };
        let start = row0.saturating_mul(cols);
        let end = start.checked_add(values.len());
        if row0 > rows
            || end.is_none_or(|e| e > rows * cols)
            || !values.len().is_multiple_of(cols.max(1))
        {
            return Err(WeightError::shape(
                PARAM,
                format!("whole rows fitting [{rows}, {cols}] from row {row0}"),
                &[values.len()],
            ));
        }
        let range = start..start + values.len();
        match &mut self.data {
            HostData::BF16(d) => {
                for (o, &v) in d[range].iter_mut().zip(values) {
                    *o = bf16::from_f32(v);
                }
            }
            HostData::F16(d) => {
                for (o, &v) in d[range].iter_mut().zip(values) {
                    *o = f16::from_f32(v);
                }
            }
            HostData::F32(d) => d[range].copy_from_slice(values),
            _ => return Err(WeightError::dtype(PARAM, "bf16, f16 or f32", self.dtype)),
        }
        Ok(())
    }

    /// The same elements under another shape with the same element count.
    pub fn reshape(mut self, shape: &[usize]) -> Result<HostTensor, WeightError> {
        check_len(shape, self.numel())?;
        self.shape = shape.to_vec();
        Ok(self)
    }
}

/// The row-major `region` (one range per dimension) of a `shape` tensor of `elem`-byte elements
/// stored in `bytes`, as bytes. Contiguous trailing dimensions are copied as one run.
pub(crate) fn gather_bytes(
    param: &str,
    bytes: &[u8],
    elem: usize,
    shape: &[usize],
    region: &[Range<usize>],
) -> Result<Vec<u8>, WeightError> {
    let bad =
        || WeightError::shape(param, format!("a tensor containing the region {region:?}"), shape);
    if region.len() != shape.len()
        || region.iter().zip(shape).any(|(r, &d)| r.start > r.end || r.end > d)
    {
        return Err(bad());
    }
    let total = numel(param, shape)?.checked_mul(elem).ok_or_else(bad)?;
    if bytes.len() != total {
        return Err(bad());
    }
    let out_len = region.iter().try_fold(elem, |n, r| n.checked_mul(r.len())).ok_or_else(bad)?;
    if out_len == 0 {
        return Ok(Vec::new());
    }
    // Dimensions k.. are covered whole; dimension k-1 is the innermost partial one.
    let mut k = shape.len();
    while k > 0 && region[k - 1] == (0..shape[k - 1]) {
        k -= 1;
    }
    if k == 0 {
        return Ok(bytes.to_vec());
    }
    // Row-major strides in bytes (bounded by `total`, so no overflow).
    let mut strides = vec![elem; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        strides[d] = strides[d + 1] * shape[d + 1];
    }
    let run = region[k - 1].len() * strides[k - 1];
    let run_offset = region[k - 1].start * strides[k - 1];
    let outer = &region[..k - 1];
    let mut out = Vec::with_capacity(out_len);
    let mut index: Vec<usize> = outer.iter().map(|r| r.start).collect();
    loop {
        let base: usize =
            index.iter().zip(&strides).map(|(i, s)| i * s).sum::<usize>() + run_offset;
        out.extend_from_slice(bytes.get(base..base + run).ok_or_else(bad)?);
        // Odometer over the outer dimensions.
        let mut d = outer.len();
        loop {
            if d == 0 {
                return Ok(out);
            }
            d -= 1;
            index[d] += 1;
            if index[d] < outer[d].end {
                break;
            }
            index[d] = outer[d].start;
        }
    }
}

impl HostTensor {
    /// The row-major sub-tensor `region` (one range per dimension), in this tensor's dtype.
    pub fn region(&self, region: &[Range<usize>]) -> Result<HostTensor, WeightError> {
        if region.len() == self.shape.len()
            && region.iter().zip(&self.shape).all(|(r, &d)| *r == (0..d))
        {
            return Ok(self.clone());
        }
        let bytes = gather_bytes(
            "host tensor",
            self.as_bytes(),
            self.dtype.size_bytes(),
            &self.shape,
            region,
        )?;
        let shape: Vec<usize> = region.iter().map(|r| r.len()).collect();
        HostTensor::from_le_bytes(self.dtype, &shape, &bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn iota(shape: &[usize]) -> HostTensor {
        let n = shape.iter().product::<usize>();
        HostTensor::from_f32(shape, (0..n).map(|i| i as f32).collect()).unwrap()
    }

    #[test]
    fn regions_match_index_arithmetic() {
        let t = iota(&[3, 4, 5]);
        let r = t.region(&[1..3, 0..4, 2..4]).unwrap();
        assert_eq!(r.shape(), &[2, 4, 2]);
        let mut want = Vec::new();
        for i in 1..3 {
            for j in 0..4 {
                for k in 2..4 {
                    want.push((i * 20 + j * 5 + k) as f32);
                }
            }
        }
        assert_eq!(r.as_f32().unwrap(), &want[..]);
        // Whole trailing dimensions make one run; rows of a matrix; columns of a matrix.
        let m = iota(&[4, 3]);
        assert_eq!(m.region(&[1..3, 0..3]).unwrap().as_f32().unwrap(), &[3., 4., 5., 6., 7., 8.]);
        assert_eq!(m.region(&[0..4, 1..2]).unwrap().as_f32().unwrap(), &[1., 4., 7., 10.]);
        assert_eq!(m.region(&[0..0, 0..3]).unwrap().numel(), 0);
        assert!(m.region(&[0..5, 0..3]).is_err());
        assert!(m.region(std::slice::from_ref(&(0..1))).is_err());
        // Rank 0.
        let s = HostTensor::from_f32(&[], vec![7.0]).unwrap();
        assert_eq!(s.region(&[]).unwrap().as_f32().unwrap(), &[7.0]);
    }

    #[test]
    fn bytes_round_trip_and_casts_round_once() {
        let t = HostTensor::from_f32(&[2], vec![1.0 + 1.0 / 512.0, -3.5]).unwrap();
        let b = t.cast(DType::BF16).unwrap();
        // 1 + 2^-9 is halfway between two bf16 values; ties go to the even one (1.0).
        assert_eq!(b.to_f32_vec().unwrap(), vec![1.0, -3.5]);
        let again = HostTensor::from_le_bytes(DType::BF16, &[2], b.as_bytes()).unwrap();
        assert_eq!(again, b);
        assert!(HostTensor::from_le_bytes(DType::F32, &[3], &[0; 8]).is_err());
        assert!(HostTensor::from_bytes(DType::F32, &[1], vec![0]).is_err());
        assert!(HostTensor::from_f32(&[2, 2], vec![0.0; 3]).is_err());
        let e = HostTensor::from_bytes(DType::E4M3, &[2], vec![1, 2]).unwrap();
        assert!(e.cast(DType::BF16).is_err());
    }

    #[test]
    fn write_rows_checks_bounds_and_dtype() {
        let mut w = HostTensor::zeros(DType::BF16, &[4, 2]).unwrap();
        w.write_rows(1, &iota(&[2, 2])).unwrap();
        assert_eq!(w.to_f32_vec().unwrap(), vec![0., 0., 0., 1., 2., 3., 0., 0.]);
        assert!(w.write_rows(3, &iota(&[2, 2])).is_err());
        assert!(w.write_rows(usize::MAX, &iota(&[2, 2])).is_err());
        assert!(w.write_rows(0, &iota(&[1, 3])).is_err());
        let bytes = HostTensor::from_bytes(DType::U8, &[1, 2], vec![1, 2]).unwrap();
        assert!(w.write_rows(0, &bytes).is_err());
    }

    #[test]
    fn absurd_sizes_are_errors_not_aborts() {
        assert!(matches!(
            HostTensor::zeros(DType::F32, &[usize::MAX / 2, 4]),
            Err(WeightError::Shape { .. })
        ));
        assert!(matches!(
            HostTensor::zeros(DType::F32, &[1 << 40, 1 << 20]),
            Err(WeightError::Alloc { .. })
        ));
    }
}
