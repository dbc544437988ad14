//! Small dense products on f32 slices through the `gemm` crate (its f32 kernels pick AVX2/FMA or
//! AVX-512 at run time and do well down to 16×16 blocks), behind a safe, bounds-checked wrapper.
//!
//! Where `gemm` computes each element as one in-order chain of fused multiply-adds (the chunk
//! kernel's block products), a CPU with AVX2 and FMA takes a hand-written kernel in the same
//! order instead: the same bits, without `gemm`'s per-call dispatch and packing, which cost
//! 5–15 % at these sizes. Everything else, and every other CPU, keeps calling `gemm`.

use gemm::Parallelism;

#[cfg(target_arch = "x86_64")]
mod avx2;

/// A read-only matrix in a slice: element `(i, j)` at `i·row_stride + j·col_stride`.
#[derive(Copy, Clone, Debug)]
pub(super) struct Mat<'a> {
    data: &'a [f32],
    rows: usize,
    cols: usize,
    row_stride: usize,
    col_stride: usize,
}

impl<'a> Mat<'a> {
    /// Row-major `rows × cols` with rows `row_stride` apart.
    pub(super) fn new(data: &'a [f32], rows: usize, cols: usize, row_stride: usize) -> Self {
        Self { data, rows, cols, row_stride, col_stride: 1 }
    }

    /// The transpose (a view).
    pub(super) fn t(self) -> Self {
        Self {
            rows: self.cols,
            cols: self.rows,
            row_stride: self.col_stride,
            col_stride: self.row_stride,
            ..self
        }
    }

    fn fits(&self) -> bool {
        self.rows == 0
            || self.cols == 0
            || (self.rows - 1) * self.row_stride + (self.cols - 1) * self.col_stride
                < self.data.len()
    }
}

/// A writable row-major matrix in a slice.
#[derive(Debug)]
pub(super) struct MatMut<'a> {
    data: &'a mut [f32],
    rows: usize,
    cols: usize,
    row_stride: usize,
}

impl<'a> MatMut<'a> {
    pub(super) fn new(data: &'a mut [f32], rows: usize, cols: usize, row_stride: usize) -> Self {
        Self { data, rows, cols, row_stride }
    }
}

/// What a product does with the destination.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(super) enum Update {
    /// `dst = a · b`
    Set,
    /// `dst += a · b`
    Add,
    /// `dst -= a · b`
    Sub,
}

/// Whether `gemm` 0.19 computes this product in the sequential order (per element, fused
/// multiply-adds over `k` in order from zero, then one rounding into the destination).
///
/// That is its packed micro-kernel path, taken unless one of the early exits of
/// `gemm_basic_generic` (gemm-common 0.19.0, `src/gemm.rs`) applies: the horizontal dot-product
/// kernels for `a` with unit column stride, `b` with unit row stride and at most 16 × 16
/// outputs; `gevv` for `k <= 2`; the `gemv` kernels for a single row or column. Depths above 512
/// are split into blocks by the cache parameters; this stops well below that, at the depths the
/// order was checked for.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code, reason = "only the tests use it there"))]
fn gemm_order_is_sequential(m: usize, n: usize, k: usize, a: &Mat<'_>, b: &Mat<'_>) -> bool {
    let horizontal = a.col_stride == 1 && b.row_stride == 1 && m * n <= 16 * 16;
    m >= 2 && n >= 2 && (3..=MAX_DEPTH).contains(&k) && !horizontal
}

/// The deepest product the sequential-order kernels take.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code, reason = "only the tests use it there"))]
const MAX_DEPTH: usize = 256;

/// `dst = a · b` (or `+=`, `-=`, as `into` says), in f32, on the calling thread.
///
/// # Panics
/// When the shapes disagree or a matrix reaches past its slice: both are bugs of the kernel
/// that builds the views, never of the op's input.
pub(super) fn matmul(dst: MatMut<'_>, a: Mat<'_>, b: Mat<'_>, into: Update) {
    product(dst, a, b, into, true);
}

/// [`matmul`], through `gemm` alone unless `own_kernel` (the tests compare both).
fn product(dst: MatMut<'_>, a: Mat<'_>, b: Mat<'_>, into: Update, own_kernel: bool) {
    let (m, n, k) = (dst.rows, dst.cols, a.cols);
    assert!(a.rows == m && b.rows == k && b.cols == n, "matmul: shapes disagree");
    let dst_fits = m == 0 || n == 0 || (m - 1) * dst.row_stride + n - 1 < dst.data.len();
    assert!(a.fits() && b.fits() && dst_fits, "matmul: a view reaches past its slice");
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if into == Update::Set {
            for i in 0..m {
                dst.data[i * dst.row_stride..i * dst.row_stride + n].fill(0.0);
            }
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if own_kernel && crate::kernels::has_avx2_fma() && gemm_order_is_sequential(m, n, k, &a, &b) {
        let parts = avx2::Parts {
            m,
            n,
            k,
            dst: dst.data.as_mut_ptr(),
            dst_rs: dst.row_stride,
            a: a.data.as_ptr(),
            a_rs: a.row_stride,
            a_cs: a.col_stride,
            b: b.data.as_ptr(),
            b_rs: b.row_stride,
            b_cs: b.col_stride,
            into,
        };
        // SAFETY: the CPU has AVX2 and FMA (just detected); `3 <= k <= MAX_DEPTH` (the order
        // check); every element lies inside its slice (checked above); `dst` is a unique
        // borrow, so it overlaps neither operand.
        unsafe { avx2::product(parts) };
        return;
    }
    // SAFETY: every element the kernel touches lies inside its slice (checked above, with the
    // strides given); `dst` is a unique borrow, so it overlaps neither operand.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.data.as_mut_ptr(),
            1,
            dst.row_stride as isize,
            into != Update::Set,
            a.data.as_ptr(),
            a.col_stride as isize,
            a.row_stride as isize,
            b.data.as_ptr(),
            b.col_stride as isize,
            b.row_stride as isize,
            1.0,
            if into == Update::Sub { -1.0 } else { 1.0 },
            false,
            false,
            false,
            Parallelism::None,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn products_with_strides_transposes_and_accumulation() {
        // a = [[1, 2, 3], [4, 5, 6]] stored in rows of 4; b^T stored as [[1, 0, 2], [0, 1, 1]].
        let a = [1.0, 2.0, 3.0, -9.0, 4.0, 5.0, 6.0, -9.0];
        let bt = [1.0, 0.0, 2.0, 0.0, 1.0, 1.0];
        let mut y = [7.0f32; 6];
        let (am, bm) = (Mat::new(&a, 2, 3, 4), Mat::new(&bt, 2, 3, 3).t());
        matmul(MatMut::new(&mut y, 2, 2, 3), am, bm, Update::Set);
        assert_eq!(y, [7.0, 5.0, 7.0, 16.0, 11.0, 7.0]);
        matmul(MatMut::new(&mut y, 2, 2, 3), am, bm, Update::Add);
        assert_eq!(y, [14.0, 10.0, 7.0, 32.0, 22.0, 7.0]);
        matmul(MatMut::new(&mut y, 2, 2, 3), am, bm, Update::Sub);
        assert_eq!(y, [7.0, 5.0, 7.0, 16.0, 11.0, 7.0]);
        matmul(
            MatMut::new(&mut y, 2, 2, 3),
            Mat::new(&a, 2, 0, 4),
            Mat::new(&[], 0, 2, 2),
            Update::Set,
        );
        assert_eq!(y, [0.0, 0.0, 7.0, 0.0, 0.0, 7.0]);
    }

    /// One product as a call site of `chunk.rs` lays it out: `a` and `b` each stored row-major
    /// (`*_t` false) or as the row-major transpose (`*_t` true), rows `*_ld` apart.
    #[derive(Copy, Clone, Debug)]
    struct Case {
        m: usize,
        n: usize,
        k: usize,
        a_t: bool,
        a_ld: usize,
        b_t: bool,
        b_ld: usize,
        dst_ld: usize,
        into: Update,
    }

    /// Every product `chunk.rs` makes for a chunk of `len` tokens, keys of `kd`, values of `vd`.
    fn chunk_cases(kd: usize, vd: usize, len: usize, o_stride: usize) -> Vec<Case> {
        let (c, c2, width, block) = (64, 128, kd + vd, 16);
        let row = |m, n, k, a_ld, b_ld, dst_ld, into| Case {
            m,
            n,
            k,
            a_t: false,
            a_ld,
            b_t: false,
            b_ld,
            dst_ld,
            into,
        };
        let mut cases = Vec::new();
        for r0 in (0..len).step_by(block) {
            let n = block.min(len - r0);
            // The decay products: a block of earlier keys against every later row, and the
            // diagonal block; the right operand is the transpose of rows of `kd`.
            let dense = Case { b_t: true, ..row(2 * n, n, kd, kd, kd, c, Update::Set) };
            cases.push(dense);
            if r0 > 0 {
                cases.push(Case { m: 2 * (len - r0), n: block, ..dense });
                // The block solve against the rows already solved.
                cases.push(row(n, width, r0, c2, width, width, Update::Sub));
            }
        }
        let half = len.div_ceil(2);
        cases.push(row(2 * len, vd, kd, width, vd, vd, Update::Set));
        cases.push(row(half, vd, half, c2, vd, o_stride, Update::Add));
        cases.push(row(len - half, vd, len, c2, vd, o_stride, Update::Add));
        cases.push(Case { a_t: true, ..row(kd, vd, len, kd, vd, vd, Update::Add) });
        cases
    }

    /// The order the product must keep: per element, one fused multiply-add after another over
    /// `k` from zero, then one rounding into the destination.
    fn sequential(case: &Case, a: &[f32], b: &[f32], dst: &mut [f32]) {
        for i in 0..case.m {
            for j in 0..case.n {
                let mut acc = 0.0f32;
                for p in 0..case.k {
                    let x = if case.a_t { a[p * case.a_ld + i] } else { a[i * case.a_ld + p] };
                    let y = if case.b_t { b[j * case.b_ld + p] } else { b[p * case.b_ld + j] };
                    acc = x.mul_add(y, acc);
                }
                let d = &mut dst[i * case.dst_ld + j];
                *d = match case.into {
                    Update::Set => acc,
                    Update::Add => *d + acc,
                    Update::Sub => *d - acc,
                };
            }
        }
    }

    impl Case {
        /// The views of `a` and `b` over their storage.
        fn views<'a>(&self, a: &'a [f32], b: &'a [f32]) -> (Mat<'a>, Mat<'a>) {
            let a = if self.a_t {
                Mat::new(a, self.k, self.m, self.a_ld).t()
            } else {
                Mat::new(a, self.m, self.k, self.a_ld)
            };
            let b = if self.b_t {
                Mat::new(b, self.n, self.k, self.b_ld).t()
            } else {
                Mat::new(b, self.k, self.n, self.b_ld)
            };
            (a, b)
        }
    }

    /// `gemm` and `matmul` against [`sequential`] on one case, bit for bit, the destination's
    /// padding included: the number of elements that differ, or `None` where `gemm`'s order is
    /// another.
    fn mismatches(g: &mut kda_testkit::Gen, case: &Case) -> Option<usize> {
        let (a_rows, b_rows) =
            (if case.a_t { case.k } else { case.m }, if case.b_t { case.n } else { case.k });
        // Operands of mixed magnitude, so a different order of the sums shows in the bits.
        let mut a = g.uniform_f32(a_rows * case.a_ld, -1.0, 1.0);
        a.iter_mut().step_by(7).for_each(|x| *x *= 1024.0);
        let b = g.uniform_f32(b_rows * case.b_ld, -1.0, 1.0);
        let start = g.uniform_f32(case.m * case.dst_ld, -4.0, 4.0);
        let (a_view, b_view) = case.views(&a, &b);
        if !gemm_order_is_sequential(case.m, case.n, case.k, &a_view, &b_view) {
            return None;
        }
        let mut want = start.clone();
        sequential(case, &a, &b, &mut want);
        // `gemm` itself keeps the order (so the shapes the own kernel takes are chosen right),
        // and so does `matmul` with the own kernel.
        let mut differ = 0;
        for own_kernel in [false, true] {
            let mut got = start.clone();
            let dst = MatMut::new(&mut got, case.m, case.n, case.dst_ld);
            product(dst, a_view, b_view, case.into, own_kernel);
            differ += got.iter().zip(&want).filter(|(x, y)| x.to_bits() != y.to_bits()).count();
        }
        Some(differ)
    }

    #[test]
    fn products_keep_the_sequential_fma_order_bit_for_bit() {
        let mut g = kda_testkit::Gen::new(23);
        let mut bad = Vec::new();
        let (mut checked, mut flops, mut flops_checked) = (0, 0, 0);
        for (kd, vd) in [(128, 128), (64, 32), (24, 40), (20, 36)] {
            for len in [1, 2, 3, 5, 8, 15, 16, 17, 20, 31, 32, 33, 40, 47, 48, 49, 63, 64] {
                for case in chunk_cases(kd, vd, len, 3 * vd) {
                    for into in [Update::Set, Update::Add, Update::Sub] {
                        let case = Case { into, ..case };
                        let work = case.m * case.n * case.k;
                        flops += work;
                        match mismatches(&mut g, &case) {
                            None => {}
                            Some(0) => {
                                (checked, flops_checked) = (checked + 1, flops_checked + work)
                            }
                            Some(n) => bad.push((n, case)),
                        }
                    }
                }
            }
        }
        assert!(
            bad.is_empty(),
            "{} products differ, e.g. {:?}",
            bad.len(),
            &bad[..bad.len().min(8)]
        );
        // The order is pinned for nearly all the work, not just for a few corner shapes.
        assert!(checked > 1000, "only {checked} products checked");
        let share = flops_checked as f64 / flops as f64;
        assert!(share > 0.97, "only {share} of the multiply-adds are in checked products");
    }

    #[test]
    #[should_panic(expected = "reaches past")]
    fn views_past_the_slice_are_caught() {
        let mut y = [0.0f32; 4];
        matmul(
            MatMut::new(&mut y, 2, 2, 2),
            Mat::new(&[1.0; 3], 2, 2, 2),
            Mat::new(&[1.0; 4], 2, 2, 2),
            Update::Set,
        );
    }
}
