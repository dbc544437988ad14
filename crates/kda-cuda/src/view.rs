//! How a tensor view reaches a kernel: [`KernelView`] is the `View` struct of
//! `kernels/common.cuh`, field for field, with the view's offset folded into the pointer.

use half::{bf16, f16};
use kda_core::{DType, Layout};

use crate::CudaError;

/// The largest rank the kernels index.
pub const MAX_RANK: usize = 6;

/// The size of a `View` kernel parameter.
pub const KERNEL_VIEW_BYTES: usize = std::mem::size_of::<KernelView>();

/// A strided view as the kernels take it (`View` in `kernels/common.cuh`): the device address
/// of the first element, the dtype code, and shape and strides in elements. A null pointer marks
/// an absent optional operand.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct KernelView {
    pub ptr: u64,
    pub dtype: i32,
    pub rank: i32,
    pub shape: [i64; MAX_RANK],
    pub strides: [i64; MAX_RANK],
}

/// The dtype codes of `kernels/common.cuh` (`DT_*`). Formats the kernels only move (u8, E4M3,
/// E8M0) share the byte code.
pub fn dtype_code(dtype: DType) -> i32 {
    match dtype {
        DType::F32 => 0,
        DType::BF16 => 1,
        DType::F16 => 2,
        DType::I32 => 3,
        DType::U8 | DType::E4M3 | DType::E8M0 => 4,
    }
}

impl KernelView {
    /// An absent optional operand (the kernels test `ptr == 0`).
    pub const ABSENT: KernelView =
        KernelView { ptr: 0, dtype: 0, rank: 0, shape: [0; MAX_RANK], strides: [0; MAX_RANK] };

    /// Describe `layout` over the buffer at device address `base`. `op` and `param` name the
    /// operand in the error for a rank beyond [`MAX_RANK`].
    pub fn new(
        op: &'static str,
        param: &'static str,
        layout: &Layout,
        base: u64,
    ) -> Result<Self, CudaError> {
        let rank = layout.rank();
        if rank > MAX_RANK {
            return Err(CudaError::Limit { op, param, actual: rank, limit: MAX_RANK });
        }
        let mut view = KernelView {
            ptr: base + (layout.offset() * layout.dtype().size_bytes()) as u64,
            dtype: dtype_code(layout.dtype()),
            rank: rank as i32,
            ..Self::ABSENT
        };
        for (d, (&n, &s)) in layout.shape().iter().zip(layout.strides()).enumerate() {
            view.shape[d] = n as i64;
            view.strides[d] = s as i64;
        }
        Ok(view)
    }

    /// The element offset of row-major index `linear`, as `offset_of` in the kernels computes
    /// it (the host-side twin the tests check the layout arithmetic with).
    pub fn offset_of(&self, mut linear: i64) -> i64 {
        let mut off = 0;
        for d in (0..self.rank as usize).rev() {
            let n = self.shape[d];
            off += (linear % n) * self.strides[d];
            linear /= n;
        }
        off
    }
}

/// The bit pattern a fill of `value` writes into elements of `dtype`, rounded as the reference
/// backend rounds it (`Op::validate` has checked the value is representable).
pub fn fill_bits(dtype: DType, value: f64) -> u32 {
    match dtype {
        DType::F32 => (value as f32).to_bits(),
        DType::BF16 => u32::from(bf16::from_f64(value).to_bits()),
        DType::F16 => u32::from(f16::from_f64(value).to_bits()),
        DType::I32 => (value as i32) as u32,
        DType::U8 | DType::E4M3 | DType::E8M0 => u32::from(value as u8),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `View` in common.cuh: u64, two ints, then two arrays of six i64.
    #[test]
    fn the_struct_has_the_c_layout() {
        assert_eq!(KERNEL_VIEW_BYTES, 8 + 4 + 4 + 2 * 8 * MAX_RANK);
        assert_eq!(std::mem::align_of::<KernelView>(), 8);
        assert_eq!(std::mem::offset_of!(KernelView, shape), 16);
        assert_eq!(std::mem::offset_of!(KernelView, strides), 16 + 8 * MAX_RANK);
    }

    #[test]
    fn offsets_fold_into_the_pointer_and_strides_address_every_element() {
        // A [3, 2] view of the columns 1..3 of a [3, 4] bf16 matrix starting at row 0.
        let layout = Layout::strided(DType::BF16, &[3, 2], &[4, 1], 1).unwrap();
        let view = KernelView::new("copy", "src", &layout, 0x1000).unwrap();
        assert_eq!(view.ptr, 0x1000 + 2);
        assert_eq!(view.dtype, 1);
        let offsets: Vec<i64> = (0..6).map(|i| view.offset_of(i)).collect();
        assert_eq!(offsets, vec![0, 1, 4, 5, 8, 9]);
        // A transposed view walks columns.
        let t = Layout::strided(DType::F32, &[2, 3], &[1, 2], 0).unwrap();
        let view = KernelView::new("copy", "src", &t, 0).unwrap();
        assert_eq!((0..6).map(|i| view.offset_of(i)).collect::<Vec<_>>(), vec![0, 2, 4, 1, 3, 5]);
    }

    #[test]
    fn ranks_beyond_the_kernels_are_a_named_error() {
        let layout = Layout::contiguous(DType::F32, &[1; 7]);
        let err = KernelView::new("gemm", "x", &layout, 0).unwrap_err();
        assert_eq!(err, CudaError::Limit { op: "gemm", param: "x", actual: 7, limit: MAX_RANK });
    }

    #[test]
    fn fill_bits_round_as_the_reference() {
        assert_eq!(fill_bits(DType::F32, 1.5), 1.5f32.to_bits());
        // Halfway between 1 and the next bf16 (1 + 2^-7): ties to even.
        assert_eq!(fill_bits(DType::BF16, 1.0 + 2f64.powi(-8)), 0x3F80);
        assert_eq!(fill_bits(DType::BF16, 1.0 + 2f64.powi(-7)), 0x3F81);
        // Halfway between 0x3F81 and 0x3F82: ties to the even 0x3F82.
        assert_eq!(fill_bits(DType::BF16, 1.0 + 3.0 * 2f64.powi(-8)), 0x3F82);
        assert_eq!(fill_bits(DType::F16, -2.0), 0xC000);
        assert_eq!(fill_bits(DType::I32, -3.0), (-3i32) as u32);
        assert_eq!(fill_bits(DType::E8M0, 127.0), 127);
        assert_eq!(fill_bits(DType::U8, 255.0), 255);
    }
}
