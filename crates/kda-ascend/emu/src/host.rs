//! Device tensors read into and written from host vectors, for the ops the emulator computes in
//! its own code on the stream's thread (device addresses are host addresses here).
//!
//! Values are widened exactly (bf16, f16 and i32 into f32 or i64) and narrowed with IEEE
//! round-to-nearest-even, which is what AscendC's `Cast(…, CAST_RINT)` does
//! (`mirror-cann/asc-devkit/docs/zh/api/SIMD-API/基础API/Memory矢量计算/类型转换/Cast.md`,
//! `CAST_RINT`).

use half::{bf16, f16};
use kda_core::DType;

use crate::T;

/// A float dtype an op stores in: the rounding of a value to it.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Store {
    F32,
    Bf16,
    F16,
}

impl Store {
    /// The store of a float dtype (`None` for the others).
    pub(crate) fn of(dtype: DType) -> Option<Self> {
        match dtype {
            DType::F32 => Some(Self::F32),
            DType::BF16 => Some(Self::Bf16),
            DType::F16 => Some(Self::F16),
            _ => None,
        }
    }

    /// `x` rounded to this dtype (round to nearest, ties to even), as f32.
    pub(crate) fn round(self, x: f32) -> f32 {
        match self {
            Self::F32 => x,
            Self::Bf16 => bf16::from_f32(x).to_f32(),
            Self::F16 => f16::from_f32(x).to_f32(),
        }
    }
}

/// Every element of `t` in row-major order of its shape, widened to f32.
///
/// # Safety
/// `t`'s memory is alive and no other thread writes it meanwhile (the stream contract).
pub(crate) unsafe fn read_f32(t: &T) -> Vec<f32> {
    let base = t.buffer().element_ptr::<u8>(0);
    let size = t.dtype().size_bytes();
    let dtype = t.dtype();
    t.layout()
        .offsets()
        .map(|o| {
            // SAFETY: `o` is an element of the view, inside its live buffer (caller's contract).
            let p = unsafe { base.add(o * size) };
            // SAFETY: as above; unaligned reads because nothing promises alignment here.
            unsafe {
                match dtype {
                    DType::F32 => p.cast::<f32>().read_unaligned(),
                    DType::BF16 => bf16::from_bits(p.cast::<u16>().read_unaligned()).to_f32(),
                    DType::F16 => f16::from_bits(p.cast::<u16>().read_unaligned()).to_f32(),
                    DType::I32 => p.cast::<i32>().read_unaligned() as f32,
                    DType::U8 | DType::E4M3 | DType::E8M0 => f32::from(p.read()),
                }
            }
        })
        .collect()
}

/// Every element of an integer tensor (`I32`) in row-major order.
///
/// # Safety
/// As [`read_f32`].
pub(crate) unsafe fn read_i64(t: &T) -> Vec<i64> {
    let base = t.buffer().element_ptr::<u8>(0);
    let size = t.dtype().size_bytes();
    t.layout()
        .offsets()
        // SAFETY: an element of the view inside its live buffer (caller's contract).
        .map(|o| i64::from(unsafe { base.add(o * size).cast::<i32>().read_unaligned() }))
        .collect()
}

/// Store `values` (row-major in `t`'s shape) into `t`, rounded to its dtype.
///
/// # Safety
/// `t`'s memory is alive and nothing else reads or writes it meanwhile (the stream contract).
pub(crate) unsafe fn write_f32(t: &T, values: &[f32]) {
    let base = t.buffer().element_ptr::<u8>(0);
    let size = t.dtype().size_bytes();
    let dtype = t.dtype();
    for (o, &v) in t.layout().offsets().zip(values) {
        // SAFETY: an element of the view inside its live buffer (caller's contract).
        let p = unsafe { base.add(o * size) };
        // SAFETY: as above.
        unsafe {
            match dtype {
                DType::F32 => p.cast::<f32>().write_unaligned(v),
                DType::BF16 => p.cast::<u16>().write_unaligned(bf16::from_f32(v).to_bits()),
                DType::F16 => p.cast::<u16>().write_unaligned(f16::from_f32(v).to_bits()),
                DType::I32 => p.cast::<i32>().write_unaligned(v as i32),
                DType::U8 | DType::E4M3 | DType::E8M0 => p.write(v as u8),
            }
        }
    }
}

/// Copy `src`'s elements into `dst` (same dtype and element count) bit for bit.
///
/// # Safety
/// Both tensors' memory is alive; nothing else writes `src` or touches `dst` meanwhile.
pub(crate) unsafe fn copy_raw(src: &T, dst: &T) {
    let size = src.dtype().size_bytes();
    let (s, d) = (src.buffer().element_ptr::<u8>(0), dst.buffer().element_ptr::<u8>(0));
    // Gathered first: the views may overlap (a device-to-device copy within one allocation).
    let bytes: Vec<u8> = src
        .layout()
        .offsets()
        // SAFETY: elements of the source view inside its live buffer (caller's contract).
        .flat_map(|o| unsafe { std::slice::from_raw_parts(s.add(o * size), size) }.to_vec())
        .collect();
    for (o, b) in dst.layout().offsets().zip(bytes.chunks(size)) {
        // SAFETY: an element of the destination view inside its live buffer.
        unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), d.add(o * size), size) };
    }
}

/// Every element of a one-byte tensor (`U8`, `E4M3`, `E8M0`) in row-major order.
///
/// # Safety
/// As [`read_f32`].
pub(crate) unsafe fn read_bytes(t: &T) -> Vec<u8> {
    let base = t.buffer().element_ptr::<u8>(0);
    // SAFETY: an element of the view inside its live buffer (caller's contract).
    t.layout().offsets().map(|o| unsafe { base.add(o).read() }).collect()
}

/// Store one-byte elements into a one-byte tensor, row-major.
///
/// # Safety
/// As [`write_f32`].
pub(crate) unsafe fn write_bytes(t: &T, bytes: &[u8]) {
    let base = t.buffer().element_ptr::<u8>(0);
    for (o, &b) in t.layout().offsets().zip(bytes) {
        // SAFETY: an element of the view inside its live buffer (caller's contract).
        unsafe { base.add(o).write(b) };
    }
}

/// Set every element of `dst` to `value`, converted to its dtype (one rounding from f64:
/// `aclnnInplaceFillScalar` casts the scalar to `selfRef`'s dtype).
///
/// # Safety
/// As [`write_f32`].
pub(crate) unsafe fn fill(dst: &T, value: f64) {
    let base = dst.buffer().element_ptr::<u8>(0);
    let size = dst.dtype().size_bytes();
    let bytes: Vec<u8> = match dst.dtype() {
        DType::F32 => (value as f32).to_ne_bytes().to_vec(),
        DType::BF16 => bf16::from_f64(value).to_bits().to_ne_bytes().to_vec(),
        DType::F16 => f16::from_f64(value).to_bits().to_ne_bytes().to_vec(),
        DType::I32 => (value as i32).to_ne_bytes().to_vec(),
        DType::U8 | DType::E4M3 | DType::E8M0 => vec![value as u8],
    };
    for o in dst.layout().offsets() {
        // SAFETY: an element of the view inside its live buffer (caller's contract).
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), base.add(o * size), size) };
    }
}
