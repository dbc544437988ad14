//! Reading and writing the tensors of a KDA op as f32 (or i32 metadata), and running independent
//! tasks on the pool.

use std::borrow::Cow;

use half::{bf16, f16};
use kda_core::{DType, Tensor};
use rayon::prelude::*;

use super::super::Exec;
use crate::ReferenceBackend;

pub(super) type T = Tensor<ReferenceBackend>;

/// The elements of a float view, row-major, as f32: borrowed in place when the view is f32 and
/// contiguous, widened (exactly) otherwise.
pub(in crate::kernels) fn read_f32(t: &T) -> Cow<'_, [f32]> {
    let layout = t.layout();
    match t.dtype() {
        DType::F32 if layout.is_contiguous() => {
            // SAFETY: a validated, contiguous f32 input view; the stream contract keeps writers
            // off it while the op runs, which outlives the borrow.
            Cow::Borrowed(unsafe { t.buffer().slice::<f32>(layout) })
        }
        DType::F32 => {
            // SAFETY: a validated input view; stream contract.
            Cow::Owned(unsafe { t.buffer().gather::<f32>(layout) })
        }
        DType::BF16 => {
            // SAFETY: a validated input view; stream contract.
            let v = unsafe { t.buffer().gather::<bf16>(layout) };
            // bf16 is the top half of an f32: widening is a shift.
            Cow::Owned(v.iter().map(|x| f32::from_bits(u32::from(x.to_bits()) << 16)).collect())
        }
        DType::F16 => {
            // SAFETY: a validated input view; stream contract.
            let v = unsafe { t.buffer().gather::<f16>(layout) };
            Cow::Owned(v.iter().map(|x| x.to_f32()).collect())
        }
        // The descriptors admit only floats here.
        _ => Cow::Owned(vec![f32::NAN; t.numel()]),
    }
}

/// A float input view's elements, row-major, in their own dtype (borrowed in place when the view
/// is contiguous), for kernels that widen rows as they copy them instead of the whole tensor.
#[derive(Debug)]
pub(crate) enum Floats<'a> {
    F32(Cow<'a, [f32]>),
    BF16(Cow<'a, [bf16]>),
}

impl Floats<'_> {
    /// Elements `at .. at + dst.len()`, widened into `dst` (exactly).
    #[inline(always)]
    pub(super) fn copy_to(&self, at: usize, dst: &mut [f32]) {
        match self {
            Floats::F32(v) => dst.copy_from_slice(&v[at..at + dst.len()]),
            Floats::BF16(v) => {
                let n = dst.len();
                for (d, s) in dst.iter_mut().zip(&v[at..at + n]) {
                    *d = f32::from_bits(u32::from(s.to_bits()) << 16);
                }
            }
        }
    }
}

/// The elements of a float view as [`Floats`]: f32 and bf16 as they are, f16 widened.
pub(super) fn read_floats(t: &T) -> Floats<'_> {
    let layout = t.layout();
    match t.dtype() {
        DType::BF16 if layout.is_contiguous() => {
            // SAFETY: a validated, contiguous bf16 input view; stream contract (see `read_f32`).
            Floats::BF16(Cow::Borrowed(unsafe { t.buffer().slice::<bf16>(layout) }))
        }
        DType::BF16 => {
            // SAFETY: a validated input view; stream contract.
            Floats::BF16(Cow::Owned(unsafe { t.buffer().gather::<bf16>(layout) }))
        }
        _ => Floats::F32(read_f32(t)),
    }
}

/// Write row-major f32 `values` into a float view, rounding once (to nearest even) to its dtype.
pub(in crate::kernels) fn write_f32(t: &T, values: &[f32]) {
    debug_assert_eq!(values.len(), t.numel());
    let layout = t.layout();
    match t.dtype() {
        DType::F32 => {
            // SAFETY: a validated, non-overlapping output view that overlaps no input; stream
            // contract.
            unsafe { t.buffer().scatter::<f32>(layout, values) }
        }
        DType::BF16 => {
            let v: Vec<bf16> = values.iter().map(|&x| bf16::from_f32(x)).collect();
            // SAFETY: as above.
            unsafe { t.buffer().scatter::<bf16>(layout, &v) }
        }
        DType::F16 => {
            let v: Vec<f16> = values.iter().map(|&x| f16::from_f32(x)).collect();
            // SAFETY: as above.
            unsafe { t.buffer().scatter::<f16>(layout, &v) }
        }
        _ => {}
    }
}

/// Give `f` the elements of a float output view as a row-major f32 slice to fill: the view
/// itself when it is f32 and contiguous, else a buffer that is then rounded into it.
pub(super) fn with_f32_out(t: &T, f: impl FnOnce(&mut [f32])) {
    let layout = t.layout();
    if t.dtype() == DType::F32 && layout.is_contiguous() {
        // SAFETY: a validated, contiguous f32 output view that overlaps no input; the stream
        // contract keeps every other thread off it while the op runs.
        f(unsafe { t.buffer().slice_mut::<f32>(layout) });
    } else {
        let mut values = vec![0.0f32; t.numel()];
        f(&mut values);
        write_f32(t, &values);
    }
}

/// The elements of an i32 metadata view.
pub(super) fn read_i32(t: &T) -> Vec<i32> {
    // SAFETY: a validated i32 input view; stream contract.
    unsafe { t.buffer().gather::<i32>(t.layout()) }
}

/// Element `index` of dimension 0 (`[1, ...]` view).
pub(super) fn row(t: &T, index: usize) -> Result<T, String> {
    t.narrow(0, index, 1).map_err(|e| e.to_string())
}

/// `f(0), …, f(n-1)`, across the pool when there is one, in order.
pub(super) fn par_map<R: Send>(exec: &Exec, n: usize, f: impl Fn(usize) -> R + Sync) -> Vec<R> {
    if exec.threads() == 1 || n <= 1 {
        (0..n).map(f).collect()
    } else {
        exec.install(|| (0..n).into_par_iter().map(&f).collect())
    }
}

/// Elements per task when `rows` rows of `row_len` elements are split, whole rows, across the
/// op's threads.
pub(super) fn rows_per_thread(exec: &Exec, rows: usize, row_len: usize) -> usize {
    row_len * rows.div_ceil(exec.threads()).max(1)
}

/// Run `f` on every item, across the pool when there is one.
pub(super) fn par_for_each<I: Send>(exec: &Exec, items: Vec<I>, f: impl Fn(I) + Sync + Send) {
    if exec.threads() == 1 || items.len() <= 1 {
        items.into_iter().for_each(f);
    } else {
        exec.install(|| items.into_par_iter().for_each(f));
    }
}

/// Check request offsets `starts` (`[B + 1]`, non-decreasing, within `0 ..= tokens`) and return
/// each request's token range.
pub(super) fn request_ranges(
    param: &str,
    starts: &[i32],
    tokens: usize,
) -> Result<Vec<std::ops::Range<usize>>, String> {
    let mut ranges = Vec::with_capacity(starts.len().saturating_sub(1));
    for (b, pair) in starts.windows(2).enumerate() {
        let (lo, hi) = (pair[0], pair[1]);
        if lo < 0 || hi < lo || hi as usize > tokens {
            return Err(format!(
                "{param}[{b}..={}] = {lo}..{hi} is not a range within 0..={tokens} \
                 (offsets must be non-decreasing)",
                b + 1
            ));
        }
        ranges.push(lo as usize..hi as usize);
    }
    Ok(ranges)
}

/// A request's state slot: `None` for padding (negative), an error past the `slots` slots.
pub(super) fn slot(
    param: &str,
    index: String,
    value: i32,
    slots: usize,
) -> Result<Option<usize>, String> {
    match value {
        v if v < 0 => Ok(None),
        v if (v as usize) < slots => Ok(Some(v as usize)),
        v => Err(format!("{param}{index} = {v} is out of range for {slots} state slots")),
    }
}
