//! The backend's options, the same with or without Ascend support compiled in.

use std::path::PathBuf;

use kda_core::sanitize::checked_from_env;

/// How the MXFP8 GEMM (and DynamicQuant) run.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub enum MxGemmPath {
    /// As the chip reports: native on Ascend 950, emulated on A2/A3.
    #[default]
    Auto,
    /// `aclnnDynamicMxQuantV3` + `aclnnQuantMatmulV5` (fails where MX dtypes do not exist).
    Native,
    /// The kda quant kernel, then dequantize both operands to bf16 and `aclnnMatmul`.
    Emulated,
}

/// Options of `AscendBackend::with_options`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AscendOptions {
    /// Device ordinal.
    pub device: i32,
    /// Checked mode: record every call and reject ops that race (see [`kda_core::sanitize`]).
    pub checked: bool,
    pub mx_gemm: MxGemmPath,
    /// The kernel binary (`cargo xtask kernels` builds it): this path, else
    /// `KDA_ASCEND_KERNELS`, else `ascend-kernels/kda_kernels.o` in a directory above the
    /// executable (`target/`); made absolute, as `aclrtBinaryLoadFromFile` requires.
    pub kernels: Option<PathBuf>,
}

impl Default for AscendOptions {
    /// Device 0, checked mode as `KDA_SANITIZE` says, the chip's MX path.
    fn default() -> Self {
        Self {
            device: 0,
            checked: checked_from_env(false),
            mx_gemm: MxGemmPath::Auto,
            kernels: None,
        }
    }
}
