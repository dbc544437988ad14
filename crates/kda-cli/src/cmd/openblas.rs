//! OpenBLAS's `cblas_sgemm`, loaded at run time when the system has the library: the baseline of
//! the f32 GEMM figure in the benchmarks, never needed to build or test (without it the figure
//! falls back to the machine's measured FMA peak).

use std::ffi::{CStr, c_int, c_void};

/// `cblas_sgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)`.
type Sgemm = unsafe extern "C" fn(
    c_int,
    c_int,
    c_int,
    c_int,
    c_int,
    c_int,
    f32,
    *const f32,
    c_int,
    *const f32,
    c_int,
    f32,
    *mut f32,
    c_int,
) -> ();

/// A loaded OpenBLAS, single-threaded.
#[derive(Debug)]
pub struct OpenBlas {
    sgemm: Sgemm,
    /// The `dlopen` handle, kept open (never closed: the functions stay valid).
    _handle: *mut c_void,
}

const ROW_MAJOR: c_int = 101;
const NO_TRANS: c_int = 111;
const TRANS: c_int = 112;

impl OpenBlas {
    /// The system's `libopenblas.so.0`, set to one thread; `None` when it is not installed.
    pub fn load() -> Option<Self> {
        const NAMES: [&CStr; 2] = [c"libopenblas.so.0", c"libopenblas.so"];
        // SAFETY: dlopen with a NUL-terminated name; a null return is handled.
        let handle = NAMES
            .iter()
            .map(|name| unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) })
            .find(|h| !h.is_null())?;
        // SAFETY: a live handle and NUL-terminated symbol names; null returns are handled.
        let (sgemm, threads) = unsafe {
            (libc::dlsym(handle, c"cblas_sgemm".as_ptr()), {
                libc::dlsym(handle, c"openblas_set_num_threads".as_ptr())
            })
        };
        if sgemm.is_null() {
            return None;
        }
        if !threads.is_null() {
            // SAFETY: OpenBLAS exports `void openblas_set_num_threads(int)`.
            unsafe {
                let set: unsafe extern "C" fn(c_int) = std::mem::transmute(threads);
                set(1);
            }
        }
        // SAFETY: `cblas_sgemm` has the CBLAS signature `Sgemm` describes.
        let sgemm: Sgemm = unsafe { std::mem::transmute::<*mut c_void, Sgemm>(sgemm) };
        Some(Self { sgemm, _handle: handle })
    }

    /// `y[m, n] = x[m, k] · w[n, k]^T`, all row-major f32; `None` (nothing computed) when a
    /// slice is shorter than its shape or a dimension exceeds `c_int`.
    pub fn sgemm_nt(
        &self,
        (m, n, k): (usize, usize, usize),
        x: &[f32],
        w: &[f32],
        y: &mut [f32],
    ) -> Option<()> {
        if x.len() < m * k || w.len() < n * k || y.len() < m * n {
            return None;
        }
        let dim = |v: usize| c_int::try_from(v).ok();
        let (mi, ni, ki) = (dim(m)?, dim(n)?, dim(k)?);
        // SAFETY: row-major x [m, k] (lda k), w [n, k] read transposed (ldb k), y [m, n] (ldc n),
        // all within their slices (checked); y is a unique borrow.
        unsafe {
            (self.sgemm)(
                ROW_MAJOR,
                NO_TRANS,
                TRANS,
                mi,
                ni,
                ki,
                1.0,
                x.as_ptr(),
                ki,
                w.as_ptr(),
                ki,
                0.0,
                y.as_mut_ptr(),
                ni,
            );
        }
        Some(())
    }
}
