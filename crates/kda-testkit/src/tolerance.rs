//! Comparing a computed tensor with a reference under a relative + absolute tolerance.
//!
//! Backends are checked against the reference (or an f64 oracle), never against hard-coded numbers,
//! so the tolerance is the one place that says how much disagreement a dtype's rounding explains.

use std::fmt;

use half::{bf16, f16};
use kda_core::DType;

/// How many mismatches a [`Mismatches`] report spells out; the count covers the rest.
const MAX_REPORTED: usize = 8;

/// How far an element may stray from its reference: finite `actual` matches finite `expected` when
/// `|actual - expected| <= abs + rel * |expected|`.
///
/// Non-finite values must agree in kind: NaN matches only NaN, and an infinity only the infinity of
/// the same sign, whatever `rel` and `abs` are. Signed zeros count as equal.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct Tolerance {
    /// Allowed error as a fraction of `|expected|`.
    pub rel: f64,
    /// Allowed error independent of magnitude; covers results that cancel to near zero, where any
    /// relative bound is meaningless.
    pub abs: f64,
}

impl Tolerance {
    /// A tolerance of `rel * |expected| + abs`.
    pub const fn new(rel: f64, abs: f64) -> Self {
        Self { rel, abs }
    }

    /// Bit-for-bit agreement of values (NaN still matches NaN, and `-0.0` matches `0.0`).
    pub const fn exact() -> Self {
        Self::new(0.0, 0.0)
    }

    /// A default for results that were rounded to `dtype` at the end, compared with an unrounded
    /// (f64 or f32-accumulated) reference.
    pub const fn for_dtype(dtype: DType) -> Self {
        match dtype {
            // f32 carries 24 bits (ulp 2^-23 ≈ 1.2e-7): 1e-5 leaves ~80 ulps for reassociated
            // accumulation, which kernels do freely.
            DType::F32 => Self::new(1e-5, 1e-6),
            // bf16 keeps 8 significant bits, so the final rounding alone costs up to 2^-8 relative;
            // 2^-7 also absorbs a flip across a rounding boundary when the backend's f32
            // accumulator lands on the other side of a midpoint from the reference.
            DType::BF16 => Self::new(1.0 / 128.0, 1e-3),
            // Same reasoning as bf16 with 11 significant bits.
            DType::F16 => Self::new(1.0 / 512.0, 1e-4),
            // Integers, raw bytes and the MX codec's encodings have one right answer.
            DType::I32 | DType::U8 | DType::E4M3 | DType::E8M0 => Self::exact(),
        }
    }

    /// The whole KDA layer against its f64 oracle (`LayerOracle`), for outputs whose largest
    /// magnitude is `max_abs`. After the projections everything is f32 (observed errors ~3e-7
    /// of the largest magnitude); the projection outputs are bf16, and one of them may round to
    /// the other side of a midpoint than the oracle's (f32 against f64 accumulation), which
    /// moves that value, and at most its share of any later result, by 2^-8 relative (observed:
    /// 2e-4 of the largest magnitude). So: 2^-8 relative, plus 2^-8 of the largest magnitude
    /// for results that cancel.
    pub fn layer(max_abs: f64) -> Self {
        Self::new(1.0 / 256.0, max_abs / 256.0)
    }

    /// [`layer`](Self::layer) for a layer whose KDA core runs a vendor operator that keeps its
    /// intermediates in bf16: CANN's `aclnnChunkKdaFwd` (and the decodes after it, which carry
    /// its state). On a value's path the chunk kernel rounds to bf16 eight times where the f64
    /// oracle does not (the β-scaled w and u seeds, w, u, the triangular inverse, the state
    /// snapshot the GEMMs read, `v_new`, `kg`), each by up to 2^-9 relative, and `v_new = u −
    /// w·h` cancels: 2^-6 relative, plus 2^-6 of the largest magnitude. Measured on the emulated
    /// operator at its kernels' precision (`docs/ascend.md`, "Vendor operators"): 1.40–1.95 ×
    /// [`layer`](Self::layer) over seven seeds (largest error 1.1e-2 of the largest magnitude),
    /// where the same layer on f32 intermediates uses 0.03–0.40 of it; so `layer` is too tight
    /// for that route and this leaves it a factor of two.
    pub fn layer_bf16_intermediates(max_abs: f64) -> Self {
        Self::new(1.0 / 64.0, max_abs / 64.0)
    }

    /// The largest share of this tolerance an element of `actual` uses against `expected`:
    /// `max |a − e| / (abs + rel·|e|)` over finite pairs (at most 1 when they match). What a
    /// measurement reports next to its pass or fail.
    pub fn usage(&self, actual: &[f64], expected: &[f64]) -> f64 {
        actual
            .iter()
            .zip(expected)
            .filter(|(a, e)| a.is_finite() && e.is_finite())
            .map(|(a, e)| (a - e).abs() / (self.abs + self.rel * e.abs()))
            .fold(0.0, f64::max)
    }

    /// The same tolerance with `abs` replaced.
    #[must_use]
    pub const fn with_abs(self, abs: f64) -> Self {
        Self { abs, ..self }
    }

    /// The same tolerance with `rel` replaced.
    #[must_use]
    pub const fn with_rel(self, rel: f64) -> Self {
        Self { rel, ..self }
    }

    /// Whether one element matches its reference.
    pub fn matches(&self, actual: f64, expected: f64) -> bool {
        if actual.is_nan() || expected.is_nan() {
            return actual.is_nan() && expected.is_nan();
        }
        if actual.is_infinite() || expected.is_infinite() {
            // Compared by value, so +inf == +inf but +inf != -inf and inf != any finite number:
            // an overflow is a bug no tolerance should hide.
            return actual == expected;
        }
        (actual - expected).abs() <= self.abs + self.rel * expected.abs()
    }

    /// Compares `actual` with `expected`, both laid out row-major in `shape`.
    ///
    /// Slices whose lengths disagree with each other or with the product of `shape` are reported
    /// through [`Mismatches::lengths`] rather than by panicking, so a backend that returns a
    /// wrongly sized buffer fails its test with a readable message.
    pub fn compare(
        &self,
        shape: &[usize],
        actual: &[f64],
        expected: &[f64],
    ) -> Result<(), Mismatches> {
        // Saturating: an overflowing shape then disagrees with every slice length and is reported.
        let total = shape.iter().fold(1usize, |acc, &d| acc.saturating_mul(d));
        if actual.len() != total || expected.len() != total {
            return Err(Mismatches {
                tolerance: *self,
                total,
                count: 0,
                worst_abs_diff: 0.0,
                worst_index: Vec::new(),
                first: Vec::new(),
                lengths: Some(LengthMismatch { actual: actual.len(), expected: expected.len() }),
            });
        }

        let mut count = 0;
        let mut first = Vec::new();
        let mut worst: Option<(usize, f64)> = None;
        for (offset, (&a, &e)) in actual.iter().zip(expected).enumerate() {
            if self.matches(a, e) {
                continue;
            }
            count += 1;
            let abs_diff = (a - e).abs();
            if first.len() < MAX_REPORTED {
                first.push(Mismatch {
                    index: unravel(shape, offset),
                    offset,
                    actual: a,
                    expected: e,
                    abs_diff,
                });
            }
            if worst.is_none_or(|(_, w)| is_worse(abs_diff, w)) {
                worst = Some((offset, abs_diff));
            }
        }

        match worst {
            None => Ok(()),
            Some((offset, worst_abs_diff)) => Err(Mismatches {
                tolerance: *self,
                total,
                count,
                worst_abs_diff,
                worst_index: unravel(shape, offset),
                first,
                lengths: None,
            }),
        }
    }

    /// [`compare`](Self::compare) for any element types, e.g. a backend's bf16 output against an
    /// f64 oracle.
    pub fn compare_as<A: AsF64, E: AsF64>(
        &self,
        shape: &[usize],
        actual: &[A],
        expected: &[E],
    ) -> Result<(), Mismatches> {
        let actual: Vec<f64> = actual.iter().map(|&x| x.as_f64()).collect();
        let expected: Vec<f64> = expected.iter().map(|&x| x.as_f64()).collect();
        self.compare(shape, &actual, &expected)
    }

    /// Panics with the [`Mismatches`] report when [`compare_as`](Self::compare_as) fails; for tests.
    ///
    /// # Panics
    ///
    /// When any element mismatches or the lengths disagree with `shape`.
    #[track_caller]
    pub fn assert_close<A: AsF64, E: AsF64>(&self, shape: &[usize], actual: &[A], expected: &[E]) {
        if let Err(mismatches) = self.compare_as(shape, actual, expected) {
            panic!("{mismatches}");
        }
    }
}

impl fmt::Display for Tolerance {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rel {:e} + abs {:e}", self.rel, self.abs)
    }
}

/// A NaN difference (NaN against a number) outranks every number, so the worst entry points at it.
fn is_worse(diff: f64, than: f64) -> bool {
    if than.is_nan() { false } else { diff.is_nan() || diff > than }
}

/// The row-major multi-dimensional index of element `offset` in `shape`.
fn unravel(shape: &[usize], mut offset: usize) -> Vec<usize> {
    let mut index = vec![0; shape.len()];
    for (slot, &dim) in index.iter_mut().zip(shape).rev() {
        // dim is nonzero here: a zero-sized shape has no elements, so no offset to unravel.
        *slot = offset % dim;
        offset /= dim;
    }
    index
}

/// One element outside the tolerance.
#[derive(Clone, Debug, PartialEq)]
pub struct Mismatch {
    /// Row-major multi-dimensional index into the compared shape.
    pub index: Vec<usize>,
    /// Flat offset into the compared slices.
    pub offset: usize,
    /// The value under test.
    pub actual: f64,
    /// The reference value.
    pub expected: f64,
    /// `|actual - expected|`; NaN or infinite when the two disagree in kind.
    pub abs_diff: f64,
}

/// Slice lengths that disagree with the compared shape (see [`Mismatches::lengths`]).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct LengthMismatch {
    /// Length of the slice under test.
    pub actual: usize,
    /// Length of the reference slice.
    pub expected: usize,
}

/// Why a comparison failed: which elements, how badly, under which tolerance.
#[derive(Clone, Debug, PartialEq)]
pub struct Mismatches {
    /// The tolerance that was applied.
    pub tolerance: Tolerance,
    /// Elements in the compared shape (its product, saturating at `usize::MAX`).
    pub total: usize,
    /// Elements outside the tolerance.
    pub count: usize,
    /// Largest `|actual - expected|` among the mismatches; NaN outranks every number.
    pub worst_abs_diff: f64,
    /// Multi-dimensional index of the worst mismatch.
    pub worst_index: Vec<usize>,
    /// The first (up to 8) mismatches in row-major order.
    pub first: Vec<Mismatch>,
    /// `Some` when the slices' lengths disagree with the shape; then no element was compared and
    /// `count` is 0.
    pub lengths: Option<LengthMismatch>,
}

impl fmt::Display for Mismatches {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(lengths) = self.lengths {
            return write!(
                f,
                "length mismatch: shape holds {} elements, actual has {}, expected has {} \
                 (tolerance {})",
                self.total, lengths.actual, lengths.expected, self.tolerance
            );
        }
        write!(
            f,
            "{} of {} elements differ beyond {} (worst |diff| {:e} at {:?}):",
            self.count, self.total, self.tolerance, self.worst_abs_diff, self.worst_index
        )?;
        for m in &self.first {
            write!(
                f,
                "\n  {:?}: actual {}, expected {}, |diff| {}",
                m.index,
                Num(m.actual),
                Num(m.expected),
                Num(m.abs_diff)
            )?;
        }
        let unlisted = self.count - self.first.len();
        if unlisted > 0 {
            write!(f, "\n  ... and {unlisted} more")?;
        }
        Ok(())
    }
}

impl std::error::Error for Mismatches {}

/// Prints plain decimals for everyday magnitudes and switches to exponent form where `{}` would
/// print hundreds of digits (f64's `Display` never does on its own).
struct Num(f64);

impl fmt::Display for Num {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let magnitude = self.0.abs();
        if magnitude == 0.0 || !magnitude.is_finite() || (1e-4..1e6).contains(&magnitude) {
            write!(f, "{}", self.0)
        } else {
            write!(f, "{:e}", self.0)
        }
    }
}

/// Lossless widening to f64 of every element type the backends produce, so one comparison serves
/// them all.
pub trait AsF64: Copy {
    /// The value as an f64 (exact for every implementor).
    fn as_f64(self) -> f64;
}

impl AsF64 for f64 {
    fn as_f64(self) -> f64 {
        self
    }
}

impl AsF64 for f32 {
    fn as_f64(self) -> f64 {
        f64::from(self)
    }
}

impl AsF64 for bf16 {
    fn as_f64(self) -> f64 {
        self.to_f64()
    }
}

impl AsF64 for f16 {
    fn as_f64(self) -> f64 {
        self.to_f64()
    }
}

impl AsF64 for i32 {
    fn as_f64(self) -> f64 {
        f64::from(self)
    }
}

impl AsF64 for u8 {
    fn as_f64(self) -> f64 {
        f64::from(self)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn matches_at_the_boundary_and_not_past_it() {
        // Binary fractions, so the boundary is exact: allowed error at e = 2 is 0.25 + 0.5 * 2.
        let tol = Tolerance::new(0.5, 0.25);
        assert!(tol.matches(3.25, 2.0));
        assert!(tol.matches(0.75, 2.0));
        assert!(!tol.matches(3.5, 2.0));
        assert!(!tol.matches(0.5, 2.0));
        // The relative part scales with expected, not actual.
        assert!(!tol.matches(2.0, 0.5));
    }

    #[test]
    fn abs_alone_covers_values_near_zero() {
        let tol = Tolerance::new(1e-3, 1e-6);
        assert!(tol.matches(5e-7, 0.0));
        assert!(!tol.matches(2e-6, 0.0));
    }

    #[test]
    fn non_finite_values_must_agree_in_kind() {
        let loose = Tolerance::new(f64::INFINITY, f64::INFINITY);
        for tol in [Tolerance::exact(), loose] {
            assert!(tol.matches(f64::NAN, f64::NAN));
            assert!(!tol.matches(f64::NAN, 1.0));
            assert!(!tol.matches(1.0, f64::NAN));
            assert!(!tol.matches(f64::NAN, f64::INFINITY));
            assert!(tol.matches(f64::INFINITY, f64::INFINITY));
            assert!(tol.matches(f64::NEG_INFINITY, f64::NEG_INFINITY));
            assert!(!tol.matches(f64::INFINITY, f64::NEG_INFINITY));
            assert!(!tol.matches(f64::INFINITY, f64::MAX));
            assert!(!tol.matches(f64::MAX, f64::INFINITY));
        }
        // The loose tolerance really is loose for finite values, so the checks above test kind.
        assert!(loose.matches(-f64::MAX, f64::MAX));
    }

    #[test]
    fn exact_accepts_only_equal_values() {
        let tol = Tolerance::exact();
        assert!(tol.matches(1.5, 1.5));
        assert!(tol.matches(-0.0, 0.0));
        assert!(!tol.matches(1.0, 1.0 + f64::EPSILON));
    }

    #[test]
    fn builders_replace_one_field() {
        let tol = Tolerance::new(1.0, 2.0);
        assert_eq!(tol.with_abs(3.0), Tolerance::new(1.0, 3.0));
        assert_eq!(tol.with_rel(4.0), Tolerance::new(4.0, 2.0));
    }

    #[test]
    fn dtype_defaults_track_the_format_precision() {
        let one = 1.0_f32;
        let bf = Tolerance::for_dtype(DType::BF16);
        let next_bf16 = bf16::from_bits(bf16::ONE.to_bits() + 1).to_f64();
        let third_bf16 = bf16::from_bits(bf16::ONE.to_bits() + 2).to_f64();
        assert!(bf.matches(next_bf16, 1.0), "one bf16 ulp must pass");
        assert!(!bf.matches(third_bf16, 1.0), "two bf16 ulps at 1.0 must fail");

        let half = Tolerance::for_dtype(DType::F16);
        let next_f16 = f16::from_bits(f16::ONE.to_bits() + 1).to_f64();
        let far_f16 = f16::from_bits(f16::ONE.to_bits() + 3).to_f64();
        assert!(half.matches(next_f16, 1.0));
        assert!(!half.matches(far_f16, 1.0));

        let single = Tolerance::for_dtype(DType::F32);
        let next_f32 = f64::from(f32::from_bits(one.to_bits() + 1));
        assert!(single.matches(next_f32, 1.0));
        assert!(!single.matches(1.0 + 1e-4, 1.0));
        // Tighter than bf16: a bf16-sized error must not pass an f32 comparison.
        assert!(!single.matches(next_bf16, 1.0));

        for dtype in [DType::I32, DType::U8, DType::E4M3, DType::E8M0] {
            assert_eq!(Tolerance::for_dtype(dtype), Tolerance::exact(), "{dtype:?}");
        }
    }

    #[test]
    fn compare_passes_matching_tensors() {
        let values = [1.0, f64::NAN, f64::NEG_INFINITY, -0.0, 3.5, 1e300];
        assert_eq!(Tolerance::exact().compare(&[2, 3], &values, &values), Ok(()));
        let nudged: Vec<f64> = values.iter().map(|v| v * (1.0 + 1e-7)).collect();
        assert_eq!(Tolerance::for_dtype(DType::F32).compare(&[6], &nudged, &values), Ok(()));
    }

    #[test]
    fn compare_reports_indices_values_and_worst() {
        let expected = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0];
        let actual = [0.0, 1.5, 2.0, 3.0, 4.0, 9.0];
        let err = Tolerance::exact().compare(&[2, 3], &actual, &expected).unwrap_err();
        assert_eq!(err.count, 2);
        assert_eq!(err.total, 6);
        assert_eq!(err.lengths, None);
        assert_eq!(err.worst_abs_diff, 4.0);
        assert_eq!(err.worst_index, vec![1, 2]);
        assert_eq!(
            err.first,
            vec![
                Mismatch {
                    index: vec![0, 1],
                    offset: 1,
                    actual: 1.5,
                    expected: 1.0,
                    abs_diff: 0.5
                },
                Mismatch {
                    index: vec![1, 2],
                    offset: 5,
                    actual: 9.0,
                    expected: 5.0,
                    abs_diff: 4.0
                },
            ]
        );
    }

    #[test]
    fn display_is_readable() {
        let expected = [1.0, 1.5, 2.0, 2.5];
        let actual = [1.0, 1.25, 2.0, 7.5];
        let err = Tolerance::new(1e-5, 1e-6).compare(&[2, 2], &actual, &expected).unwrap_err();
        assert_eq!(
            err.to_string(),
            "2 of 4 elements differ beyond rel 1e-5 + abs 1e-6 (worst |diff| 5e0 at [1, 1]):\n  \
             [0, 1]: actual 1.25, expected 1.5, |diff| 0.25\n  \
             [1, 1]: actual 7.5, expected 2.5, |diff| 5"
        );
    }

    #[test]
    fn display_uses_exponents_for_extreme_magnitudes() {
        let err = Tolerance::exact().compare(&[1], &[1e300], &[2e-300]).unwrap_err();
        let text = err.to_string();
        assert!(text.contains("actual 1e300, expected 2e-300"), "{text}");
    }

    #[test]
    fn report_lists_at_most_eight_and_counts_the_rest() {
        let expected = vec![0.0; 40];
        let mut actual = vec![1.0; 40];
        actual[30] = 100.0;
        let err = Tolerance::exact().compare(&[4, 10], &actual, &expected).unwrap_err();
        assert_eq!(err.count, 40);
        assert_eq!(err.first.len(), 8);
        assert_eq!(err.first[7].index, vec![0, 7]);
        assert_eq!(err.worst_index, vec![3, 0]);
        assert_eq!(err.worst_abs_diff, 100.0);
        assert!(err.to_string().ends_with("\n  ... and 32 more"), "{err}");
    }

    #[test]
    fn nan_against_a_number_is_the_worst_mismatch() {
        let expected = [1.0, 2.0, 3.0];
        let actual = [1e6, f64::NAN, 1e9];
        let err = Tolerance::exact().compare(&[3], &actual, &expected).unwrap_err();
        assert_eq!(err.worst_index, vec![1]);
        assert!(err.worst_abs_diff.is_nan());
        assert!(err.to_string().contains("worst |diff| NaN at [1]"), "{err}");
    }

    #[test]
    fn length_disagreements_are_errors_not_panics() {
        let tol = Tolerance::exact();
        let err = tol.compare(&[2, 3], &[0.0; 5], &[0.0; 6]).unwrap_err();
        assert_eq!(err.lengths, Some(LengthMismatch { actual: 5, expected: 6 }));
        assert_eq!(err.total, 6);
        assert_eq!(
            err.to_string(),
            "length mismatch: shape holds 6 elements, actual has 5, expected has 6 \
             (tolerance rel 0e0 + abs 0e0)"
        );

        // Slices agree with each other but not with the shape.
        let err = tol.compare(&[4], &[0.0; 3], &[0.0; 3]).unwrap_err();
        assert_eq!(err.lengths, Some(LengthMismatch { actual: 3, expected: 3 }));

        // A shape whose product overflows cannot describe any slice.
        let err = tol.compare(&[usize::MAX, 2], &[0.0], &[0.0]).unwrap_err();
        assert_eq!(err.total, usize::MAX);
        assert!(err.lengths.is_some());
    }

    #[test]
    fn scalar_and_empty_shapes() {
        let tol = Tolerance::exact();
        assert_eq!(tol.compare(&[], &[2.0], &[2.0]), Ok(()));
        let err = tol.compare(&[], &[2.0], &[3.0]).unwrap_err();
        assert_eq!(err.worst_index, Vec::<usize>::new());
        assert_eq!(tol.compare(&[3, 0], &[], &[]), Ok(()));
    }

    #[test]
    fn compare_as_widens_every_element_type() {
        let tol = Tolerance::exact();
        let bf = [bf16::from_f32(1.5), bf16::from_f32(-2.0)];
        assert_eq!(tol.compare_as(&[2], &bf, &[1.5_f64, -2.0]), Ok(()));
        let hf = [f16::from_f32(0.25)];
        assert_eq!(tol.compare_as(&[1], &hf, &[0.25_f32]), Ok(()));
        assert_eq!(tol.compare_as(&[2], &[7_i32, -3], &[7.0_f64, -3.0]), Ok(()));
        assert_eq!(tol.compare_as(&[1], &[255_u8], &[255_i32]), Ok(()));
        // bf16 rounding of 1.1 is visible to an exact comparison but within the bf16 default.
        let rounded = [bf16::from_f64(1.1)];
        assert!(tol.compare_as(&[1], &rounded, &[1.1_f64]).is_err());
        assert_eq!(
            Tolerance::for_dtype(DType::BF16).compare_as(&[1], &rounded, &[1.1_f64]),
            Ok(())
        );
    }

    #[test]
    fn assert_close_passes_quietly() {
        Tolerance::for_dtype(DType::F32).assert_close(&[2], &[1.0_f32, 2.0], &[1.0_f64, 2.0]);
    }

    #[test]
    #[should_panic(expected = "1 of 2 elements differ beyond rel 0e0 + abs 0e0")]
    fn assert_close_panics_with_the_report() {
        Tolerance::exact().assert_close(&[2], &[1.0_f32, 2.5], &[1.0_f64, 2.0]);
    }

    #[test]
    fn mismatches_is_an_error() {
        let err = Tolerance::exact().compare(&[1], &[1.0], &[2.0]).unwrap_err();
        let boxed: Box<dyn std::error::Error> = Box::new(err);
        assert!(boxed.to_string().starts_with("1 of 1 elements"));
    }

    fn ravel(shape: &[usize], index: &[usize]) -> usize {
        shape.iter().zip(index).fold(0, |acc, (&dim, &i)| acc * dim + i)
    }

    proptest! {
        #[test]
        fn any_value_matches_itself_exactly(bits in any::<u64>()) {
            let x = f64::from_bits(bits);
            prop_assert!(Tolerance::exact().matches(x, x));
        }

        #[test]
        fn unravel_inverts_row_major_offsets(
            shape in proptest::collection::vec(1usize..6, 0..5),
            pick in any::<proptest::sample::Index>(),
        ) {
            let total: usize = shape.iter().product();
            let offset = pick.index(total);
            let index = unravel(&shape, offset);
            prop_assert!(index.iter().zip(&shape).all(|(&i, &d)| i < d));
            prop_assert_eq!(ravel(&shape, &index), offset);
        }

        #[test]
        fn a_single_perturbation_is_found_where_it_was_made(
            shape in proptest::collection::vec(1usize..6, 1..4),
            pick in any::<proptest::sample::Index>(),
        ) {
            let total: usize = shape.iter().product();
            let offset = pick.index(total);
            let expected: Vec<f64> = (0..total).map(|i| i as f64).collect();
            let mut actual = expected.clone();
            actual[offset] += 0.5;
            let err = Tolerance::new(0.0, 0.25).compare(&shape, &actual, &expected).unwrap_err();
            prop_assert_eq!(err.count, 1);
            prop_assert_eq!(err.first[0].offset, offset);
            prop_assert_eq!(ravel(&shape, &err.worst_index), offset);
        }
    }
}
