//! Launch rules that need no device: grid sizes, the kernels' register limits, and how a
//! dense GEMM's strided views map onto one column-major `cublasGemmEx` call.

use kda_core::DType;

use crate::CudaError;

/// Threads per block of the element-wise and row kernels.
pub const BLOCK: u32 = 256;
/// Warps (state rows) per block of the recurrence kernels (`ROWS_PER_BLOCK` in kda.cu).
pub const ROWS_PER_BLOCK: u32 = 4;
/// Key dimensions the recurrence holds in registers (32 lanes x `MAX_KEY_PER_LANE`).
pub const MAX_KEY_DIM: usize = 32 * 8;
/// `W - 1 + n` (conv history plus new tokens) the conv kernels hold (`MAX_CONV_WINDOW`).
pub const MAX_CONV_WINDOW: usize = 64;
/// Output tile of the MX GEMM kernel (`MX_TILE` in mx.cu).
pub const MX_TILE: u32 = 16;

/// The tensor-core chunked prefill (`kda_chunk_tc` in chunk.cu): chunk length, value columns per
/// thread block, key dims it holds, threads, and the smallest within-sub-block decay for which a
/// diagonal sub-block is factored (`e^-40`; below it the pairs are summed directly).
pub const TC_CHUNK: usize = 64;
pub const TC_BV: usize = 32;
pub const TC_MAX_KEY: usize = 128;
pub const TC_THREADS: u32 = 256;
pub const TC_MIN_LEFT: f32 = 4.248_354e-18;

/// Dynamic shared memory of `kda_chunk_tc`, in bytes: the sum of its arrays (`TC_SMEM_BYTES` in
/// chunk.cu, which checks it matches its layout).
pub const TC_SHARED_BYTES: u32 = tc_shared_bytes();

const fn tc_shared_bytes() -> u32 {
    let (c, kp, bv) = (TC_CHUNK, TC_MAX_KEY, TC_BV);
    let (ldb, ldc) = (kp + 8, c + 8);
    let bf16 = 2
        * (
            2 * c * ldb      // q_b, k_b
        + 32 * ldb       // opL
        + c * ldb        // opR, then W
        + 2 * c * ldc    // m_b, aqk_b
        + c * ldb        // qg_b
        + kp * ldc       // kdT
        + c * ldb        // wrhs_b
        + bv * ldc       // urhsT
        + bv * ldb       // sbT
        + bv * ldc
            // vnewT
        );
    let f32s = 4
        * (
            c * kp           // gc, then U
        + c * (c + 1)    // akk, then M
        + 3 * 256        // block-inverse temporaries
        + bv * (kp + 4)  // st
        + c + kp
            // beta, decay to the chunk end
        );
    (bf16 + f32s) as u32
}

/// Blocks for a grid-stride loop over `work` items at `per_block` items per block, capped at
/// `max_blocks` (the loops cover the rest). `None` when there is nothing to do.
pub fn grid_for(work: usize, per_block: u32, max_blocks: u32) -> Option<u32> {
    if work == 0 {
        return None;
    }
    let blocks = work.div_ceil(per_block as usize);
    Some(blocks.min(max_blocks as usize).max(1) as u32)
}

/// Check a size against a kernel limit, naming it.
pub fn within(
    op: &'static str,
    param: &'static str,
    actual: usize,
    limit: usize,
) -> Result<(), CudaError> {
    if actual > limit { Err(CudaError::Limit { op, param, actual, limit }) } else { Ok(()) }
}

/// A rank-2 operand as cuBLAS takes it: column-major with leading dimension `ld`, transposed
/// or not relative to its row-major `[rows, cols]` meaning.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct MatrixOperand {
    /// True when the row-major matrix is stored with unit row stride (a transposed view).
    pub transposed: bool,
    pub ld: usize,
}

/// How a row-major `[rows, cols]` view with `strides` can be handed to cuBLAS without a copy,
/// or `None` when neither dimension has unit stride (or the leading dimension is too small).
pub fn matrix_operand(shape: [usize; 2], strides: [usize; 2]) -> Option<MatrixOperand> {
    let [rows, cols] = shape;
    // A dimension of size one may have any stride; read it as unit.
    let unit = |d: usize| shape[d] <= 1 || strides[d] == 1;
    if unit(1) {
        let ld = if rows <= 1 { cols.max(1) } else { strides[0] };
        if ld >= cols.max(1) {
            return Some(MatrixOperand { transposed: false, ld });
        }
    }
    if unit(0) {
        let ld = if cols <= 1 { rows.max(1) } else { strides[1] };
        if ld >= rows.max(1) {
            return Some(MatrixOperand { transposed: true, ld });
        }
    }
    None
}

/// The dtypes one `cublasGemmEx` call (fp32 compute) runs with for inputs `x`, `w` and output
/// `y`: the common input dtype (inputs of different dtypes are widened to f32 first) and the
/// dtype cuBLAS writes (`y`'s when the pair is supported, else f32 then converted).
pub fn gemm_dtypes(x: DType, w: DType, y: DType) -> (DType, DType) {
    let input = if x == w { x } else { DType::F32 };
    let output = match (input, y) {
        (DType::F32, DType::F32) => DType::F32,
        (DType::BF16, DType::BF16 | DType::F32) | (DType::F16, DType::F16 | DType::F32) => y,
        _ => DType::F32,
    };
    (input, output)
}

/// How long a stream waits for a host function by default before it fails the stream
/// ([`crate::CudaOptions::host_wait_limit`]).
pub const HOST_WAIT_LIMIT: std::time::Duration = std::time::Duration::from_secs(60);

/// The shortest limit `kda_host_wait` is given: a zero limit would fail every host function.
pub const MIN_HOST_WAIT: std::time::Duration = std::time::Duration::from_millis(1);

/// `kda_host_wait`'s arguments after the stream's record and flag addresses: the ticket the
/// stream waits for, the host function's failure id (written with code 5 when the wait gives
/// up) and the limit in nanoseconds, as the kernel reads `%globaltimer`.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct HostWait {
    pub ticket: u32,
    pub fid: u32,
    pub limit_ns: i64,
}

impl HostWait {
    /// The byte sizes of the kernel's arguments as the launch passes them: the status record
    /// and flag addresses (u64), then `ticket`, `fid`, `limit_ns`.
    pub const SIZES: [usize; 5] =
        [size_of::<u64>(), size_of::<u64>(), size_of::<u32>(), size_of::<u32>(), size_of::<i64>()];

    /// The wait for `ticket` of a host function failing as `fid`, given up after `limit`
    /// (at least [`MIN_HOST_WAIT`], at most `i64::MAX` ns, about 292 years).
    pub fn new(ticket: u32, fid: u32, limit: std::time::Duration) -> Self {
        let ns = limit.max(MIN_HOST_WAIT).as_nanos();
        Self { ticket, fid, limit_ns: i64::try_from(ns).unwrap_or(i64::MAX) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `kda_host_wait`'s time limit reaches the kernel as the `i64` its source declares, after
    /// the ticket and the failure id: the launch's argument sizes are the kernel's.
    #[test]
    fn the_host_waits_limit_is_a_kernel_parameter() {
        let memory = crate::kernels::SOURCES.iter().find(|s| s.name == "memory.cu");
        let sizes = memory.and_then(|s| crate::kernels::parameter_sizes(s.body, "kda_host_wait"));
        assert_eq!(sizes, Some(HostWait::SIZES.to_vec()));
        let body = memory.map_or("", |s| s.body);
        assert!(body.contains("u32 ticket, u32 fid,") && body.contains("i64 limit_ns)"), "{body}");
        let code = format!("#define CODE_HOST_TIMEOUT {}", crate::status::CODE_HOST_TIMEOUT);
        assert!(body.contains(&code), "the kernel writes the code the host decodes");
        let wait = HostWait::new(7, 0x8000_0003, std::time::Duration::from_secs(60));
        assert_eq!(wait, HostWait { ticket: 7, fid: 0x8000_0003, limit_ns: 60_000_000_000 });
        let zero = HostWait::new(1, 1, std::time::Duration::ZERO);
        assert_eq!(zero.limit_ns, 1_000_000, "never zero: every host function would fail");
        assert_eq!(HostWait::new(1, 1, std::time::Duration::MAX).limit_ns, i64::MAX);
    }

    #[test]
    fn grids_cover_the_work_and_respect_the_cap() {
        assert_eq!(grid_for(0, 256, 100), None);
        assert_eq!(grid_for(1, 256, 100), Some(1));
        assert_eq!(grid_for(256, 256, 100), Some(1));
        assert_eq!(grid_for(257, 256, 100), Some(2));
        assert_eq!(grid_for(1 << 30, 256, 100), Some(100));
    }

    #[test]
    fn limits_name_the_parameter() {
        assert!(within("kda_chunk", "K", 256, MAX_KEY_DIM).is_ok());
        assert_eq!(
            within("kda_chunk", "K", 257, MAX_KEY_DIM),
            Err(CudaError::Limit { op: "kda_chunk", param: "K", actual: 257, limit: 256 })
        );
    }

    #[test]
    fn strided_matrices_map_onto_leading_dimensions() {
        // Dense [4, 8]: ld 8.
        assert_eq!(
            matrix_operand([4, 8], [8, 1]),
            Some(MatrixOperand { transposed: false, ld: 8 })
        );
        // Columns 2..6 of a [4, 16] matrix: ld 16.
        assert_eq!(
            matrix_operand([4, 4], [16, 1]),
            Some(MatrixOperand { transposed: false, ld: 16 })
        );
        // The transpose of a dense [8, 4]: viewed as [4, 8] with strides [1, 4].
        assert_eq!(matrix_operand([4, 8], [1, 4]), Some(MatrixOperand { transposed: true, ld: 4 }));
        // One row: any row stride.
        assert_eq!(
            matrix_operand([1, 8], [0, 1]),
            Some(MatrixOperand { transposed: false, ld: 8 })
        );
        // Every other column: no unit stride, needs a copy.
        assert_eq!(matrix_operand([4, 4], [8, 2]), None);
        // Overlapping rows (ld below the row length) are not a matrix cuBLAS can take.
        assert_eq!(matrix_operand([4, 8], [4, 1]), None);
    }

    #[test]
    fn gemm_dtypes_pick_a_supported_cublas_pair() {
        use DType::*;
        assert_eq!(gemm_dtypes(BF16, BF16, BF16), (BF16, BF16));
        assert_eq!(gemm_dtypes(BF16, BF16, F32), (BF16, F32));
        assert_eq!(gemm_dtypes(BF16, BF16, F16), (BF16, F32));
        assert_eq!(gemm_dtypes(F16, F16, F16), (F16, F16));
        assert_eq!(gemm_dtypes(F32, F32, BF16), (F32, F32));
        assert_eq!(gemm_dtypes(BF16, F32, BF16), (F32, F32));
        assert_eq!(gemm_dtypes(F16, BF16, F32), (F32, F32));
    }
}
