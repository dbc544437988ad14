//! The argument block of every kda AscendC kernel, as `aclrtLaunchKernel` passes it
//! (`argsData`, `argsSize`): the C layout the kernels in `crates/kda-ascend/kernels/` read
//! (`kda_kernel_abi.h` declares the same structs).
//!
//! This file is the one definition, compiled into the backend (which writes blocks) and into the
//! emulated runtime (which reads them), as a C header is shared by host and device code.
//!
//! Layout: an [`ArgsHeader`], then `tensors` × [`GmTensor`], then `scalars` × `f64`.

/// Most dimensions a kernel tensor has.
pub const MAX_RANK: usize = 6;

/// Format version written into every header; a kernel binary of another version is rejected.
pub const ABI_VERSION: u32 = 1;

/// One global-memory tensor: device address of element 0 of the buffer, the view's offset,
/// shape and strides in elements, and its ACL dtype code. `addr == 0` marks an absent optional
/// operand.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct GmTensor {
    pub addr: u64,
    pub offset: i64,
    pub shape: [i64; MAX_RANK],
    pub strides: [i64; MAX_RANK],
    pub rank: u32,
    pub dtype: i32,
}

/// The host-computed tiling every vector kernel receives (see `tiling.rs`).
#[repr(C)]
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct KernelTiling {
    /// Vector cores the launch uses (`blockDim`).
    pub block_dim: u32,
    /// Rows (or elements) each core handles, the last core's share excepted.
    pub per_core: u32,
    /// Rows (or elements) the last core handles.
    pub last_core: u32,
    /// Rows (or elements) one unified-buffer tile holds.
    pub tile: u32,
    /// Bytes of unified buffer the kernel may use.
    pub ub_bytes: u32,
    pub reserved: u32,
}

/// Leads every argument block.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct ArgsHeader {
    pub version: u32,
    pub tensors: u32,
    pub scalars: u32,
    pub reserved: u32,
    pub tiling: KernelTiling,
}

/// Byte size of a block with `tensors` tensors and `scalars` scalars.
pub const fn args_size(tensors: usize, scalars: usize) -> usize {
    size_of::<ArgsHeader>() + tensors * size_of::<GmTensor>() + scalars * size_of::<f64>()
}

/// Read one `T` at `offset` of `bytes` (unaligned), or `None` past the end.
fn read_at<T: Copy>(bytes: &[u8], offset: usize) -> Option<T> {
    let end = offset.checked_add(size_of::<T>())?;
    let raw = bytes.get(offset..end)?;
    // SAFETY: `raw` holds exactly `size_of::<T>()` bytes; every `T` read here is a plain
    // `repr(C)` struct of integers or an `f64`, valid for any bit pattern; the read is unaligned.
    Some(unsafe { raw.as_ptr().cast::<T>().read_unaligned() })
}

fn write_at<T: Copy>(bytes: &mut Vec<u8>, value: &T) {
    // SAFETY: `value` is a live `T` of plain integers/floats without padding-dependent meaning;
    // viewing its bytes is sound.
    let raw =
        unsafe { std::slice::from_raw_parts((value as *const T).cast::<u8>(), size_of::<T>()) };
    bytes.extend_from_slice(raw);
}

/// Serialise a block.
pub fn encode(tiling: KernelTiling, tensors: &[GmTensor], scalars: &[f64]) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(args_size(tensors.len(), scalars.len()));
    let header = ArgsHeader {
        version: ABI_VERSION,
        tensors: tensors.len() as u32,
        scalars: scalars.len() as u32,
        reserved: 0,
        tiling,
    };
    write_at(&mut bytes, &header);
    for t in tensors {
        write_at(&mut bytes, t);
    }
    for s in scalars {
        write_at(&mut bytes, s);
    }
    bytes
}

/// A decoded block.
#[derive(Clone, Debug, PartialEq)]
pub struct Args {
    pub tiling: KernelTiling,
    pub tensors: Vec<GmTensor>,
    pub scalars: Vec<f64>,
}

/// Parse a block; `Err` says what is wrong with it.
pub fn decode(bytes: &[u8]) -> Result<Args, String> {
    let header: ArgsHeader = read_at(bytes, 0).ok_or("argument block shorter than its header")?;
    if header.version != ABI_VERSION {
        return Err(format!("argument block version {} (expected {ABI_VERSION})", header.version));
    }
    let (nt, ns) = (header.tensors as usize, header.scalars as usize);
    if bytes.len() != args_size(nt, ns) {
        return Err(format!(
            "argument block of {} bytes, expected {} for {nt} tensors and {ns} scalars",
            bytes.len(),
            args_size(nt, ns)
        ));
    }
    let mut offset = size_of::<ArgsHeader>();
    let mut tensors = Vec::with_capacity(nt);
    for _ in 0..nt {
        tensors.push(read_at::<GmTensor>(bytes, offset).ok_or("truncated tensor")?);
        offset += size_of::<GmTensor>();
    }
    let mut scalars = Vec::with_capacity(ns);
    for _ in 0..ns {
        scalars.push(read_at::<f64>(bytes, offset).ok_or("truncated scalar")?);
        offset += size_of::<f64>();
    }
    Ok(Args { tiling: header.tiling, tensors, scalars })
}

/// The kernels' symbol names and, in the comments, their tensor (and scalar) order. Optional
/// operands are passed with `addr == 0`.
pub mod names {
    /// `[x, y]`: fp32 sigmoid (BFG post-process beta).
    pub const SIGMOID: &str = "kda_sigmoid_f32";
    /// `[g1, a_log, dt_bias, g]`, scalars `[form (0 softplus, 1 lower bound), lower_bound]`.
    pub const GATE: &str = "kda_gate";
    /// `[x, num_actual_tokens]`.
    pub const ZERO_PADDING: &str = "kda_zero_padding";
    /// `[x, weight, state_slots, num_accepted_tokens?, state, y]`.
    pub const CONV_UPDATE: &str = "kda_conv_update";
    /// `[q, k, v, g, beta, state_slots, num_accepted_tokens?, state, o]`, scalars
    /// `[scale, qk_l2norm (0 or 1)]`.
    pub const RECURRENT: &str = "kda_recurrent_step";
    /// `[x, weight, query_start_loc, state_slots, has_initial_state, state, y]`.
    pub const CONV_PREFILL: &str = "kda_conv_prefill";
    /// `[x, y]`, scalars `[scale]`.
    pub const L2NORM: &str = "kda_l2norm";
    /// `[x, gate, weight, y]`, scalars `[eps]`.
    pub const GATED_RMS_NORM: &str = "kda_gated_rms_norm";
    /// `[q, k, v, g, beta, cu_seqlens, state_slots, has_initial_state, state, o]`, scalars
    /// `[scale, qk_l2norm]`.
    pub const CHUNK: &str = "kda_chunk_prefill";
    /// `[data, scale, y]`: MXFP8 to bf16/f32 (the A2/A3 MX GEMM emulation).
    pub const MX_DEQUANT: &str = "kda_mx_dequant";
    /// `[flag]` (one i32 in host-mapped memory): fails the launch when the flag is non-zero, so
    /// a failed host function stops its stream (see the backend's `host` module).
    pub const HOST_GUARD: &str = "kda_host_guard";

    /// `[x, data, scale]`, scalars `[scale_alg]`: MXFP8 quantization where aclnnDynamicMxQuantV3
    /// does not exist (A2/A3), the plain `[M, ceil(K/32)]` scale layout.
    pub const MX_QUANT: &str = "kda_mx_quant";

    pub const ALL: [&str; 12] = [
        SIGMOID,
        GATE,
        ZERO_PADDING,
        CONV_UPDATE,
        RECURRENT,
        CONV_PREFILL,
        L2NORM,
        GATED_RMS_NORM,
        CHUNK,
        MX_DEQUANT,
        MX_QUANT,
        HOST_GUARD,
    ];
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The sizes `kda_kernel_abi.h` declares (C layout, no padding surprises).
    #[test]
    fn layout_matches_the_c_header() {
        assert_eq!(size_of::<GmTensor>(), 8 + 8 + 6 * 8 + 6 * 8 + 4 + 4);
        assert_eq!(size_of::<KernelTiling>(), 6 * 4);
        assert_eq!(size_of::<ArgsHeader>(), 4 * 4 + 24);
        assert_eq!(args_size(2, 1), 40 + 2 * 120 + 8);
    }

    #[test]
    fn blocks_round_trip_and_bad_blocks_are_rejected() {
        let tiling = KernelTiling {
            block_dim: 3,
            per_core: 16,
            last_core: 4,
            tile: 16,
            ub_bytes: 1 << 17,
            reserved: 0,
        };
        let t = GmTensor {
            addr: 0x1000,
            offset: 7,
            shape: [2, 3, 0, 0, 0, 0],
            strides: [3, 1, 0, 0, 0, 0],
            rank: 2,
            dtype: 27,
        };
        let bytes = encode(tiling, &[t, GmTensor::default()], &[0.5, -5.0]);
        assert_eq!(bytes.len(), args_size(2, 2));
        let back = decode(&bytes).expect("decode");
        assert_eq!(
            back,
            Args { tiling, tensors: vec![t, GmTensor::default()], scalars: vec![0.5, -5.0] }
        );
        assert!(decode(&bytes[..bytes.len() - 1]).expect_err("short").contains("expected"));
        let mut wrong = bytes.clone();
        wrong[0] = 9;
        assert!(decode(&wrong).expect_err("version").contains("version 9"));
        assert!(decode(&[0; 3]).is_err());
    }
}
