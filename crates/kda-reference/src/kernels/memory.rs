//! Copies, fills and host transfers. They move elements by size, not by meaning, so one
//! instantiation per element width serves every dtype; a copy between two float dtypes converts
//! through f32 (exact widening, one round-to-nearest-even narrowing).

use bytemuck::Pod;
use half::{bf16, f16};
use kda_core::{DType, DownloadSlot, Tensor};

use crate::ReferenceBackend;

type T = Tensor<ReferenceBackend>;

/// Call `$body` with `$E` bound to the unsigned integer type as wide as `$dtype`'s elements.
macro_rules! by_width {
    ($dtype:expr, $E:ident => $body:expr) => {
        match $dtype.size_bytes() {
            1 => {
                type $E = u8;
                $body
            }
            2 => {
                type $E = u16;
                $body
            }
            _ => {
                type $E = u32;
                $body
            }
        }
    };
}

pub(super) fn copy(src: &T, dst: &T) -> Result<(), String> {
    if src.dtype() != dst.dtype() {
        // Validation admits only float pairs here.
        super::kda::io::write_f32(dst, &super::kda::io::read_f32(src));
        return Ok(());
    }
    by_width!(src.dtype(), E => {
        // SAFETY: validated views of these buffers; stream contract.
        let values = unsafe { src.buffer().gather::<E>(src.layout()) };
        // SAFETY: `dst` is non-overlapping and does not overlap `src` (validated).
        unsafe { dst.buffer().scatter::<E>(dst.layout(), &values) };
    });
    Ok(())
}

pub(super) fn fill(dst: &T, value: f64) -> Result<(), String> {
    // `Op::validate` checked that the value is representable in the dtype.
    match dst.dtype() {
        DType::F32 => fill_with(dst, value as f32),
        DType::BF16 => fill_with(dst, bf16::from_f64(value)),
        DType::F16 => fill_with(dst, f16::from_f64(value)),
        DType::I32 => fill_with(dst, value as i32),
        DType::U8 | DType::E4M3 | DType::E8M0 => fill_with(dst, value as u8),
    }
    Ok(())
}

fn fill_with<E: Pod>(dst: &T, value: E) {
    let layout = dst.layout();
    if layout.is_contiguous() {
        // SAFETY: validated, exclusive output view.
        unsafe { dst.buffer().slice_mut::<E>(layout) }.fill(value);
    } else {
        // SAFETY: as above; non-overlapping (validated).
        unsafe { dst.buffer().scatter::<E>(layout, &vec![value; layout.numel()]) };
    }
}

pub(super) fn upload(dst: &T, data: &[u8]) -> Result<(), String> {
    by_width!(dst.dtype(), E => {
        let values: Vec<E> = bytemuck::pod_collect_to_vec(data);
        // SAFETY: validated, non-overlapping output view; `values` has `numel` elements.
        unsafe { dst.buffer().scatter::<E>(dst.layout(), &values) };
    });
    Ok(())
}

pub(super) fn download(src: &T, slot: &DownloadSlot) -> Result<(), String> {
    by_width!(src.dtype(), E => {
        // SAFETY: validated input view; stream contract.
        let values = unsafe { src.buffer().gather::<E>(src.layout()) };
        slot.put(bytemuck::cast_slice(&values).to_vec());
    });
    Ok(())
}
