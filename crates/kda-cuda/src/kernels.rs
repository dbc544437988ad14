//! The kernel sources (`kernels/*.cu`, compiled into the crate) and what NVRTC is told.
//!
//! Each program is `kernels/common.cuh` followed by one source file, so NVRTC needs no include
//! path. The same programs are compiled by the backend at start-up and by the `nvrtc` test
//! target, which fails on any compile error wherever libnvrtc can be loaded.

/// Types and helpers every source uses (views, the stream status, dtype conversion).
pub const COMMON: &str = include_str!("../kernels/common.cuh");

/// One kernel source file and the `extern "C"` kernels it defines.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct KernelSource {
    /// The file name under `kernels/`.
    pub name: &'static str,
    pub body: &'static str,
    pub functions: &'static [&'static str],
}

/// Every kernel source of the backend.
pub const SOURCES: [KernelSource; 4] = [
    KernelSource {
        name: "memory.cu",
        body: include_str!("../kernels/memory.cu"),
        functions: &[
            "kda_copy",
            "kda_convert",
            "kda_fill",
            "kda_status_snapshot",
            "kda_status_inherit",
            "kda_status_reset",
            "kda_status_publish",
            "kda_status_absorb",
            "kda_host_wait",
        ],
    },
    KernelSource {
        name: "mx.cu",
        body: include_str!("../kernels/mx.cu"),
        functions: &[
            "kda_dynamic_quant",
            "kda_dynamic_quant_rows",
            "kda_mx_dequant",
            "kda_mx_dequant_bf16",
            "kda_mx_gemm",
        ],
    },
    KernelSource {
        name: "kda.cu",
        body: include_str!("../kernels/kda.cu"),
        functions: &[
            "kda_sigmoid",
            "kda_gate",
            "kda_l2norm",
            "kda_gated_rms_norm",
            "kda_zero_padding",
            "kda_validate_varlen",
            "kda_validate_conv_update",
            "kda_validate_recurrent",
            "kda_conv_prefill",
            "kda_conv_prefill_state",
            "kda_conv_update",
            "kda_recurrent",
            "kda_chunk",
        ],
    },
    KernelSource {
        name: "chunk.cu",
        body: include_str!("../kernels/chunk.cu"),
        functions: &["kda_chunk_tc"],
    },
];

impl KernelSource {
    /// The whole program NVRTC compiles: the common header, then this file.
    pub fn program(&self) -> String {
        format!("{COMMON}\n// ---- {} ----\n{}", self.name, self.body)
    }
}

/// NVRTC options besides the architecture. Contraction into FMA is off so every kernel rounds
/// in the order the reference backend does (the MX codec bit for bit, the rest closely); IEEE
/// division and square root and denormals (E8M0's 2^-127 is an f32 subnormal) are NVRTC's
/// defaults and must stay so.
pub const COMPILE_OPTIONS: [&str; 4] =
    ["--fmad=false", "--ftz=false", "--prec-div=true", "--prec-sqrt=true"];

/// The real architecture to compile CUBIN for on a device of compute capability
/// `major.minor`: its own, when NVRTC 12 knows it; otherwise the newest known one of the same
/// major version not above it (SASS runs on later minor versions of its major), or `None`.
pub fn arch_for(major: i32, minor: i32) -> Option<&'static str> {
    const KNOWN: [(i32, i32, &str); 10] = [
        (8, 0, "sm_80"),
        (8, 6, "sm_86"),
        (8, 7, "sm_87"),
        (8, 9, "sm_89"),
        (9, 0, "sm_90"),
        (10, 0, "sm_100"),
        (10, 1, "sm_101"),
        (10, 3, "sm_103"),
        (12, 0, "sm_120"),
        (12, 1, "sm_121"),
    ];
    KNOWN.iter().rev().find(|&&(ma, mi, _)| ma == major && mi <= minor).map(|&(_, _, arch)| arch)
}

/// The byte sizes of kernel `name`'s parameters as `body` declares them, or `None` when the
/// kernel is missing or a parameter has a type the launch path does not pass (the backend checks
/// every launch's argument sizes against this, so a mismatch is an error, not a wrong read).
pub fn parameter_sizes(body: &str, name: &str) -> Option<Vec<usize>> {
    let head = format!("extern \"C\" __global__ void {name}(");
    let start = body.find(&head)? + head.len();
    let list = &body[start..start + body[start..].find(')')?];
    list.split(',')
        .map(|param| {
            let words: Vec<&str> = param.split_whitespace().collect();
            let (_, ty) = words.split_last()?;
            match ty.join(" ").as_str() {
                t if t.ends_with('*') => Some(8),
                "View" | "const View" => Some(crate::view::KERNEL_VIEW_BYTES),
                "i64" => Some(8),
                "int" | "u32" | "float" => Some(4),
                _ => None,
            }
        })
        .collect()
}

/// The environment variable naming a directory of prebuilt CUBINs, which the backend loads
/// instead of compiling (a GPU machine without NVRTC; see `cargo xtask gpu-check --bundle`).
pub const CUBIN_DIR_VAR: &str = "KDA_CUDA_CUBIN_DIR";

/// The file name of `source`'s CUBIN for `arch` in that directory.
pub fn cubin_file(source: &KernelSource, arch: &str) -> String {
    format!("{}.{arch}.cubin", source.name.trim_end_matches(".cu"))
}

/// The architecture the compile check targets: the H200's.
pub const CHECK_ARCH: &str = "sm_90";
/// Its virtual architecture, whose PTX lists the kernel entries.
pub const CHECK_PTX_ARCH: &str = "compute_90";

#[cfg(test)]
mod tests {
    use super::*;

    /// The names of `extern "C" __global__ void NAME(` definitions in `text`.
    fn defined_kernels(text: &str) -> Vec<String> {
        let marker = "extern \"C\" __global__ void ";
        text.match_indices(marker)
            .map(|(at, _)| {
                let rest = &text[at + marker.len()..];
                rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect()
            })
            .collect()
    }

    /// The backend loads kernels by the names in `functions`: each must be defined in its file,
    /// and every defined kernel must be listed (so none is compiled but unreachable).
    #[test]
    fn every_listed_kernel_is_defined_and_every_defined_kernel_listed() {
        for source in SOURCES {
            let mut defined = defined_kernels(source.body);
            let mut listed: Vec<String> = source.functions.iter().map(|s| s.to_string()).collect();
            defined.sort();
            listed.sort();
            assert_eq!(defined, listed, "{}", source.name);
        }
        assert!(defined_kernels(COMMON).is_empty(), "the header defines no kernels");
    }

    #[test]
    fn programs_start_with_the_common_header() {
        for source in SOURCES {
            let program = source.program();
            assert!(program.starts_with(COMMON));
            assert!(program.ends_with(source.body));
        }
    }

    /// Every kernel's parameters have types the launch path passes, so each launch is checked.
    #[test]
    fn every_kernel_signature_is_known() {
        for source in SOURCES {
            for f in source.functions {
                let sizes = parameter_sizes(source.body, f);
                assert!(sizes.as_ref().is_some_and(|s| !s.is_empty()), "{f}: {sizes:?}");
            }
        }
        let copy = parameter_sizes(SOURCES[0].body, "kda_copy");
        assert_eq!(copy, Some(vec![8, 112, 112, 8, 4]));
        assert_eq!(parameter_sizes("extern \"C\" __global__ void k(double x)", "k"), None);
        assert_eq!(parameter_sizes(SOURCES[0].body, "no_such_kernel"), None);
    }

    /// The tensor-core chunk kernel's shared memory, as the launch sizes it and as its source
    /// lays it out (chunk.cu asserts its layout adds up to its `TC_SMEM_BYTES`).
    #[test]
    fn the_chunk_kernels_shared_memory_is_the_launchs() {
        let body = SOURCES.iter().find(|s| s.name == "chunk.cu").map(|s| s.body).unwrap_or("");
        let line = body.lines().find(|l| l.starts_with("#define TC_SMEM_BYTES "));
        let bytes = line.and_then(|l| l.split_whitespace().nth(2)).and_then(|n| n.parse().ok());
        assert_eq!(bytes, Some(crate::launch::TC_SHARED_BYTES));
        const { assert!(crate::launch::TC_SHARED_BYTES <= 232_448, "fits an H100/H200 block") };
    }

    #[test]
    fn cubin_files_are_named_by_source_and_architecture() {
        assert_eq!(cubin_file(&SOURCES[1], "sm_90"), "mx.sm_90.cubin");
    }

    #[test]
    fn architectures_never_exceed_the_device() {
        assert_eq!(arch_for(9, 0), Some("sm_90"));
        assert_eq!(arch_for(8, 0), Some("sm_80"));
        assert_eq!(arch_for(8, 6), Some("sm_86"));
        assert_eq!(arch_for(8, 8), Some("sm_87"), "same major, the newest not above it");
        assert_eq!(arch_for(10, 2), Some("sm_101"));
        assert_eq!(arch_for(7, 5), None, "before bf16 conversions");
        assert_eq!(arch_for(11, 0), None);
    }
}
