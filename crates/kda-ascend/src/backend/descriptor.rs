//! ACL descriptors built from HAL views: `aclTensor` (shape, strides, offset, format, dtype
//! code over the buffer's storage), `aclScalar`, and the kernels' [`GmTensor`].

use std::ffi::c_void;

use kda_core::{BufferHandle, DType, Result, Tensor};

use super::AscendBackend;
use super::acl::check;
use crate::error::AscendError;
use crate::kernels::abi::{GmTensor, MAX_RANK};
use crate::sys;

type T = Tensor<AscendBackend>;

/// The ACL code of a kda dtype.
pub(crate) fn acl_dtype(dtype: DType) -> sys::aclDataType {
    match dtype {
        DType::BF16 => sys::ACL_BF16,
        DType::F16 => sys::ACL_FLOAT16,
        DType::F32 => sys::ACL_FLOAT,
        DType::I32 => sys::ACL_INT32,
        DType::U8 => sys::ACL_UINT8,
        DType::E4M3 => sys::ACL_FLOAT8_E4M3FN,
        DType::E8M0 => sys::ACL_FLOAT8_E8M0,
    }
}

fn to_i64(op: &'static str, v: usize) -> std::result::Result<i64, AscendError> {
    i64::try_from(v)
        .map_err(|_| AscendError::Unsupported { op, message: format!("{v} exceeds i64") })
}

/// An owned `aclTensor`.
#[derive(Debug)]
pub(crate) struct AclTensor(usize);

impl AclTensor {
    /// The descriptor of `t` as it is.
    pub(crate) fn of(op: &'static str, t: &T) -> Result<Self> {
        let l = t.layout();
        Self::view(op, t, l.shape(), l.strides())
    }

    /// `t`'s memory seen with another shape and strides (same dtype and offset): transposes and
    /// Ascend's `[M, ceil(K/64), 2]` scale layout.
    pub(crate) fn view(
        op: &'static str,
        t: &T,
        shape: &[usize],
        strides: &[usize],
    ) -> Result<Self> {
        let l = t.layout();
        let dims: Vec<i64> =
            shape.iter().map(|&d| to_i64(op, d)).collect::<std::result::Result<_, _>>()?;
        let steps: Vec<i64> =
            strides.iter().map(|&s| to_i64(op, s)).collect::<std::result::Result<_, _>>()?;
        let storage = [to_i64(op, t.buffer().len_bytes() / l.dtype().size_bytes())?];
        let offset = to_i64(op, l.offset())?;
        // SAFETY: the arrays hold `dims.len()` and 1 values and outlive the call; the address is
        // the start of a live device allocation that `storage` elements fit in.
        let raw = unsafe {
            sys::aclCreateTensor(
                dims.as_ptr(),
                dims.len() as u64,
                acl_dtype(l.dtype()),
                steps.as_ptr(),
                offset,
                sys::ACL_FORMAT_ND,
                storage.as_ptr(),
                1,
                t.buffer().addr() as *mut c_void,
            )
        };
        if raw.is_null() {
            let message = sys::recent_error();
            return Err(AscendError::Acl {
                func: "aclCreateTensor",
                code: sys::ACL_ERROR_INVALID_PARAM,
                message,
            }
            .into());
        }
        Ok(AclTensor(raw as usize))
    }

    /// `t[R, C]` seen as `[C, R]` (aclnnMatmul's `mat2` is `[K, N]`; the HAL's weight is `[N, K]`).
    pub(crate) fn transposed(op: &'static str, t: &T) -> Result<Self> {
        let l = t.layout();
        match (l.shape(), l.strides()) {
            ([r, c], [sr, sc]) => Self::view(op, t, &[*c, *r], &[*sc, *sr]),
            _ => Err(AscendError::Unsupported {
                op,
                message: format!("transpose of shape {:?}", l.shape()),
            }
            .into()),
        }
    }

    pub(crate) fn ptr(&self) -> *mut sys::aclTensor {
        self.0 as *mut sys::aclTensor
    }
}

impl Drop for AclTensor {
    fn drop(&mut self) {
        // SAFETY: created by `aclCreateTensor`, destroyed once.
        let _ = unsafe { sys::aclDestroyTensor(self.ptr()) };
    }
}

/// An owned `aclScalar` holding a double.
#[derive(Debug)]
pub(crate) struct AclScalar(usize);

impl AclScalar {
    pub(crate) fn double(value: f64) -> Result<Self> {
        let mut v = value;
        // SAFETY: `v` is a live f64 for the call, which copies it.
        let raw = unsafe { sys::aclCreateScalar((&raw mut v).cast(), sys::ACL_DOUBLE) };
        if raw.is_null() {
            check("aclCreateScalar", sys::ACL_ERROR_INVALID_PARAM)?;
        }
        Ok(AclScalar(raw as usize))
    }

    pub(crate) fn ptr(&self) -> *const sys::aclScalar {
        self.0 as *const sys::aclScalar
    }
}

impl Drop for AclScalar {
    fn drop(&mut self) {
        // SAFETY: created by `aclCreateScalar`, destroyed once.
        let _ = unsafe { sys::aclDestroyScalar(self.ptr()) };
    }
}

/// The kernel ABI's description of `t` (`None`: an absent optional operand).
pub(crate) fn gm(op: &'static str, t: Option<&T>) -> Result<GmTensor> {
    let Some(t) = t else { return Ok(GmTensor::default()) };
    let l = t.layout();
    if l.rank() > MAX_RANK {
        return Err(AscendError::Unsupported {
            op,
            message: format!("rank {} > {MAX_RANK}", l.rank()),
        }
        .into());
    }
    let mut g = GmTensor {
        addr: t.buffer().addr() as u64,
        offset: to_i64(op, l.offset())?,
        rank: l.rank() as u32,
        dtype: acl_dtype(l.dtype()),
        ..GmTensor::default()
    };
    for (i, (&d, &s)) in l.shape().iter().zip(l.strides()).enumerate() {
        g.shape[i] = to_i64(op, d)?;
        g.strides[i] = to_i64(op, s)?;
    }
    Ok(g)
}
