//! Small dense products on f32 slices through the `gemm` crate (its f32 kernels pick AVX2/FMA or
//! AVX-512 at run time and do well down to 16×16 blocks), behind a safe, bounds-checked wrapper.

use gemm::Parallelism;

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

/// `dst = a · b` (or `+=`, `-=`, as `into` says), in f32, on the calling thread.
///
/// # Panics
/// When the shapes disagree or a matrix reaches past its slice: both are bugs of the kernel
/// that builds the views, never of the op's input.
pub(super) fn matmul(dst: MatMut<'_>, a: Mat<'_>, b: Mat<'_>, into: Update) {
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
