//! The arguments of every kda AscendC kernel, as `aclrtLaunchKernelWithHostArgs` passes them:
//! the C layout the kernels in `crates/kda-ascend/kernels/` read (`kda_kernel_abi.h` declares
//! the same structs). One definition, used by the backend (which writes launches) and by the
//! emulated runtime (which reads them as the kernels do).
//!
//! A kernel with `n` tensors is `kernel(GM_ADDR t_0, …, GM_ADDR t_{n-1}, GM_ADDR meta)`. The
//! host argument block ([`HostArgs`]) is its parameter area followed by one data region:
//!
//! ```text
//! offset 0       u64 × n   the tensors' device addresses (buffer base; 0: absent operand)
//! offset 8n      u64       `meta`: a placeholder the runtime fills with a device address
//! offset 8(n+1)  Meta      ArgsHeader (with the tiling), n × GmTensor, scalars × f64
//! ```
//!
//! One `aclrtPlaceHolderInfo { addrOffset: 8n, dataOffset: 8(n+1) }` asks the runtime to copy
//! the meta region into device memory and write its address into the `meta` slot, so the
//! kernel receives its tiling, shapes, strides and scalars as a GM pointer — the way the
//! `add_custom_tiling` sample passes `GM_ADDR tiling` — and nothing by value.

/// Most dimensions a kernel tensor has.
pub const MAX_RANK: usize = 6;

/// Format version written into every header; a kernel binary of another version is rejected.
pub const ABI_VERSION: u32 = 2;

/// One global-memory tensor: device address of element 0 of the buffer, the view's offset,
/// shape and strides in elements, and its ACL dtype code. `addr == 0` marks an absent optional
/// operand. The kernels take the address from their pointer parameter (the copy here is
/// informational); the rest from the meta region.
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

/// Leads every meta region.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct ArgsHeader {
    pub version: u32,
    pub tensors: u32,
    pub scalars: u32,
    pub reserved: u32,
    pub tiling: KernelTiling,
}

/// Byte size of the meta region with `tensors` tensors and `scalars` scalars.
pub const fn meta_size(tensors: usize, scalars: usize) -> usize {
    size_of::<ArgsHeader>() + tensors * size_of::<GmTensor>() + scalars * size_of::<f64>()
}

/// Byte size of the whole host argument block.
pub const fn args_size(tensors: usize, scalars: usize) -> usize {
    params_size(tensors) + meta_size(tensors, scalars)
}

/// Byte size of a kernel's parameter area: one pointer per tensor, then `meta`.
pub const fn params_size(tensors: usize) -> usize {
    (tensors + 1) * size_of::<u64>()
}

/// Read one `T` at `offset` of `bytes` (unaligned), or `None` past the end.
fn read_at<T: Copy>(bytes: &[u8], offset: usize) -> Option<T> {
    let end = offset.checked_add(size_of::<T>())?;
    let raw = bytes.get(offset..end)?;
    // SAFETY: `raw` holds exactly `size_of::<T>()` bytes; every `T` read here is a plain
    // `repr(C)` struct of integers, a `u64` or an `f64`, valid for any bit pattern; the read is
    // unaligned.
    Some(unsafe { raw.as_ptr().cast::<T>().read_unaligned() })
}

fn write_at<T: Copy>(bytes: &mut Vec<u8>, value: &T) {
    // SAFETY: `value` is a live `T` of plain integers/floats without padding (checked by the
    // layout test); viewing its bytes is sound.
    let raw =
        unsafe { std::slice::from_raw_parts((value as *const T).cast::<u8>(), size_of::<T>()) };
    bytes.extend_from_slice(raw);
}

/// A launch's host argument block and the placeholder that turns its meta region into a GM
/// pointer.
#[derive(Clone, Debug, PartialEq)]
pub struct HostArgs {
    pub bytes: Vec<u8>,
    pub place_holder: crate::aclrtPlaceHolderInfo,
}

/// Build the host argument block of a launch.
pub fn encode(tiling: KernelTiling, tensors: &[GmTensor], scalars: &[f64]) -> HostArgs {
    let mut bytes = Vec::with_capacity(args_size(tensors.len(), scalars.len()));
    for t in tensors {
        write_at(&mut bytes, &t.addr);
    }
    // The `meta` slot; the runtime writes the device copy's address here.
    write_at(&mut bytes, &0u64);
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
    let place_holder = crate::aclrtPlaceHolderInfo {
        addr_offset: (tensors.len() * size_of::<u64>()) as u32,
        data_offset: params_size(tensors.len()) as u32,
    };
    HostArgs { bytes, place_holder }
}

/// A kernel's parameters as it reads them: the tensor pointers and `meta`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Params {
    pub tensors: Vec<u64>,
    pub meta: u64,
}

/// Read the parameter area of a kernel with `tensors` tensor parameters.
pub fn decode_params(area: &[u8], tensors: usize) -> Result<Params, String> {
    if area.len() < params_size(tensors) {
        return Err(format!(
            "parameter area of {} bytes, the kernel reads {} ({tensors} pointers and meta)",
            area.len(),
            params_size(tensors)
        ));
    }
    let word = |i: usize| read_at::<u64>(area, i * size_of::<u64>()).unwrap_or(0);
    Ok(Params { tensors: (0..tensors).map(word).collect(), meta: word(tensors) })
}

/// The header of a meta region (to learn its size before reading the rest).
pub fn decode_header(bytes: &[u8]) -> Result<ArgsHeader, String> {
    let header: ArgsHeader = read_at(bytes, 0).ok_or("meta region shorter than its header")?;
    if header.version != ABI_VERSION {
        return Err(format!("meta region version {} (expected {ABI_VERSION})", header.version));
    }
    Ok(header)
}

/// A decoded meta region, tensor addresses taken from the kernel's pointer parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct Args {
    pub tiling: KernelTiling,
    pub tensors: Vec<GmTensor>,
    pub scalars: Vec<f64>,
}

/// Parse a meta region of a kernel whose pointer parameters are `params`.
pub fn decode_meta(bytes: &[u8], params: &Params) -> Result<Args, String> {
    let header = decode_header(bytes)?;
    let (nt, ns) = (header.tensors as usize, header.scalars as usize);
    if nt != params.tensors.len() {
        return Err(format!(
            "meta region describes {nt} tensors, the kernel takes {}",
            params.tensors.len()
        ));
    }
    if bytes.len() < meta_size(nt, ns) {
        return Err(format!(
            "meta region of {} bytes, expected {} for {nt} tensors and {ns} scalars",
            bytes.len(),
            meta_size(nt, ns)
        ));
    }
    let mut offset = size_of::<ArgsHeader>();
    let mut tensors = Vec::with_capacity(nt);
    for addr in &params.tensors {
        let mut t = read_at::<GmTensor>(bytes, offset).ok_or("truncated tensor")?;
        t.addr = *addr;
        tensors.push(t);
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
    /// `[q, k, v, g, beta, cu_seqlens, state_slots, has_initial_state, state, o,
    /// chunk_state_slots?]`, scalars `[scale, qk_l2norm]`.
    pub const CHUNK: &str = "kda_chunk_prefill";
    /// `[data, scale, y]`: MXFP8 to bf16/f32 (the A2/A3 MX GEMM emulation).
    pub const MX_DEQUANT: &str = "kda_mx_dequant";

    /// Each kernel's tensor-parameter count (its pointer parameters before `meta`).
    pub const fn tensors(name: &str) -> Option<usize> {
        Some(match name.as_bytes() {
            b"kda_sigmoid_f32" => 2,
            b"kda_gate" => 4,
            b"kda_zero_padding" => 2,
            b"kda_conv_update" => 6,
            b"kda_recurrent_step" => 9,
            b"kda_conv_prefill" => 7,
            b"kda_l2norm" => 2,
            b"kda_gated_rms_norm" => 4,
            b"kda_chunk_prefill" => 11,
            b"kda_mx_dequant" => 3,
            _ => return None,
        })
    }

    /// Every kernel the backend launches: each has its AscendC source in
    /// `crates/kda-ascend/kernels/` (the `kernel_sources` test of kda-ascend checks the set and
    /// the parameter counts). MXFP8 quantization has no kernel: where `aclnnDynamicMxQuantV3`
    /// does not exist (A2/A3) `DynamicQuant` is unsupported and the layer takes bf16 QKV.
    pub const ALL: [&str; 10] = [
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
    ];
}

#[cfg(test)]
#[allow(clippy::expect_used, reason = "tests")]
mod tests {
    use super::*;

    /// The sizes `kda_kernel_abi.h` declares (C layout, no padding surprises).
    #[test]
    fn layout_matches_the_c_header() {
        assert_eq!(size_of::<GmTensor>(), 8 + 8 + 6 * 8 + 6 * 8 + 4 + 4);
        assert_eq!(size_of::<KernelTiling>(), 6 * 4);
        assert_eq!(size_of::<ArgsHeader>(), 4 * 4 + 24);
        assert_eq!(meta_size(2, 1), 40 + 2 * 120 + 8);
        assert_eq!(args_size(2, 1), 3 * 8 + 40 + 2 * 120 + 8);
    }

    #[test]
    fn the_host_block_is_pointers_a_meta_slot_and_the_meta_region() {
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
        let host = encode(tiling, &[t, GmTensor::default()], &[0.5, -5.0]);
        assert_eq!(host.bytes.len(), args_size(2, 2));
        assert_eq!(
            host.place_holder,
            crate::aclrtPlaceHolderInfo { addr_offset: 16, data_offset: 24 }
        );
        // The parameter area: the two pointers, then the (unfilled) meta slot.
        let params = decode_params(&host.bytes, 2).expect("params");
        assert_eq!(params, Params { tensors: vec![0x1000, 0], meta: 0 });
        let meta = &host.bytes[24..];
        let back = decode_meta(meta, &params).expect("meta");
        assert_eq!(
            back,
            Args { tiling, tensors: vec![t, GmTensor::default()], scalars: vec![0.5, -5.0] }
        );
        // The kernel's pointer parameter wins over the descriptor's copy.
        let moved = Params { tensors: vec![0x2000, 0], meta: 0 };
        assert_eq!(decode_meta(meta, &moved).expect("meta").tensors[0].addr, 0x2000);
        assert!(
            decode_meta(&meta[..meta.len() - 1], &params).expect_err("short").contains("expected")
        );
        let three = Params { tensors: vec![1, 2, 3], meta: 0 };
        assert!(decode_meta(meta, &three).expect_err("arity").contains("takes 3"));
        let mut wrong = meta.to_vec();
        wrong[0] = 9;
        assert!(decode_meta(&wrong, &params).expect_err("version").contains("version 9"));
        assert!(decode_params(&host.bytes[..20], 2).is_err());
    }

    #[test]
    fn every_kernel_has_a_tensor_count() {
        for name in names::ALL {
            assert!(names::tensors(name).is_some(), "{name}");
        }
        assert_eq!(names::tensors(names::RECURRENT), Some(9));
        assert_eq!(names::tensors("nope"), None);
    }
}
