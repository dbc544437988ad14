//! kda's own kernels launched directly under the twin with tilings the backend would pick only
//! at much larger shapes: several channel tiles in one block, so each tile's first instruction
//! follows the previous tile's last on every pipe (the twin's pipe model checks the order).
#![allow(clippy::expect_used, clippy::unwrap_used, reason = "tests")]

use kda_acl_emu::twin::{GmRange, Kernel, Profile};
use kda_ascend_sys::abi::{self, GmTensor, KernelTiling};
use kda_ascend_sys::{ACL_FLOAT, ACL_INT32};

/// A row-major GM descriptor of `shape` at `addr`, or with explicit `strides`.
fn gm(addr: u64, shape: &[i64], strides: Option<&[i64]>, dtype: i32) -> GmTensor {
    let mut t = GmTensor { addr, rank: shape.len() as u32, dtype, ..GmTensor::default() };
    t.shape[..shape.len()].copy_from_slice(shape);
    let mut row_major = vec![1i64; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        row_major[d] = row_major[d + 1] * shape[d + 1];
    }
    t.strides[..shape.len()].copy_from_slice(strides.unwrap_or(&row_major));
    t
}

/// Launch `kernel` on one block of an A2 with `tiling`, the pointer parameters of `tensors` and
/// their host buffers as the GM it may touch.
fn launch_one_block(
    kernel: &str,
    tiling: KernelTiling,
    tensors: &[GmTensor],
    buffers: &[(u64, usize)],
) -> Result<(), kda_acl_emu::twin::TwinError> {
    launch_one_block_on("Ascend910B3", kernel, tiling, tensors, buffers)
}

/// [`launch_one_block`] on the SoC `soc`.
fn launch_one_block_on(
    soc: &str,
    kernel: &str,
    tiling: KernelTiling,
    tensors: &[GmTensor],
    buffers: &[(u64, usize)],
) -> Result<(), kda_acl_emu::twin::TwinError> {
    let args = abi::encode(tiling, tensors, &[]);
    let meta = &args.bytes[args.place_holder.data_offset as usize..];
    let mut words = vec![0u64; meta.len().div_ceil(8)];
    for (w, chunk) in words.iter_mut().zip(meta.chunks(8)) {
        let mut b = [0u8; 8];
        b[..chunk.len()].copy_from_slice(chunk);
        *w = u64::from_ne_bytes(b);
    }
    let mut params: Vec<u64> = tensors.iter().map(|t| t.addr).collect();
    params.push(words.as_ptr() as u64);
    let ranges: Vec<GmRange> =
        buffers.iter().map(|&(base, len)| GmRange { base, len: len as u64 }).collect();
    let k = Kernel::builtin(kernel).expect("built-in kernel");
    // SAFETY: every range is a live host buffer of the caller's that nothing else touches during
    // the launch; the parameters point into them, the last one to the meta words.
    unsafe { k.launch(Profile::of_soc(soc), 1, &params, &ranges) }
}

/// `kda_mx_dequant` on one block of `soc`: `m` rows of `k` E4M3 codes `data` under their E8M0
/// `scale` (`[m, ceil(k / 32)]`) into `y` (`dtype`), all rows on that block, the UB the tiling
/// reports being `ub_bytes`.
fn launch_mx_dequant<T>(
    soc: &str,
    (data, scale): (&[u8], &[u8]),
    (m, k): (usize, usize),
    (y, dtype): (&mut [T], i32),
    ub_bytes: u32,
) -> Result<(), kda_acl_emu::twin::TwinError> {
    use kda_ascend_sys::{ACL_FLOAT8_E4M3FN, ACL_FLOAT8_E8M0};
    let blocks = k.div_ceil(32);
    let tensors = [
        gm(data.as_ptr() as u64, &[m as i64, k as i64], None, ACL_FLOAT8_E4M3FN),
        gm(scale.as_ptr() as u64, &[m as i64, blocks as i64], None, ACL_FLOAT8_E8M0),
        gm(y.as_mut_ptr() as u64, &[m as i64, k as i64], None, dtype),
    ];
    let buffers = [
        (data.as_ptr() as u64, data.len()),
        (scale.as_ptr() as u64, scale.len()),
        (y.as_mut_ptr() as u64, std::mem::size_of_val(y)),
    ];
    let rows = m as u32;
    let tiling = KernelTiling {
        block_dim: 1,
        per_core: rows,
        last_core: rows,
        tile: 1,
        ub_bytes,
        reserved: 0,
    };
    launch_one_block_on(soc, "kda_mx_dequant", tiling, &tensors, &buffers)
}

/// `kda_conv_prefill` with a `[C, W]` row-major f32 weight (the taps gathered through the
/// scalar unit) over two channel tiles in one block: the second tile's scalar writes of the taps
/// follow the first tile's vector reads of them only through a V→S flag. Values against the
/// conv + SiLU computed here in f64.
#[test]
fn conv_prefill_gathers_strided_taps_after_the_previous_tiles_vector_reads() {
    let (t, c, w, tile) = (5usize, 16usize, 4usize, 8u32);
    let x: Vec<f32> = (0..t * c).map(|i| ((i * 7 % 11) as f32 - 5.0) / 8.0).collect();
    let weight: Vec<f32> = (0..c * w).map(|i| ((i * 5 % 9) as f32 - 4.0) / 4.0).collect();
    let starts = [0i32, t as i32];
    let (slots, initial) = ([0i32], [0i32]);
    let mut state = vec![0f32; (w - 1) * c];
    let mut y = vec![0f32; t * c];
    let tensors = [
        gm(x.as_ptr() as u64, &[t as i64, c as i64], None, ACL_FLOAT),
        gm(weight.as_ptr() as u64, &[c as i64, w as i64], None, ACL_FLOAT),
        gm(starts.as_ptr() as u64, &[2], None, ACL_INT32),
        gm(slots.as_ptr() as u64, &[1], None, ACL_INT32),
        gm(initial.as_ptr() as u64, &[1], None, ACL_INT32),
        gm(state.as_mut_ptr() as u64, &[1, (w - 1) as i64, c as i64], None, ACL_FLOAT),
        gm(y.as_mut_ptr() as u64, &[t as i64, c as i64], None, ACL_FLOAT),
    ];
    let buffers = [
        (x.as_ptr() as u64, x.len() * 4),
        (weight.as_ptr() as u64, weight.len() * 4),
        (starts.as_ptr() as u64, 8),
        (slots.as_ptr() as u64, 4),
        (initial.as_ptr() as u64, 4),
        (state.as_mut_ptr() as u64, state.len() * 4),
        (y.as_mut_ptr() as u64, y.len() * 4),
    ];
    let tiling = KernelTiling {
        block_dim: 1,
        per_core: c as u32,
        last_core: c as u32,
        tile,
        ub_bytes: 1 << 16,
        reserved: 0,
    };
    launch_one_block("kda_conv_prefill", tiling, &tensors, &buffers).expect("conv prefill");
    for tok in 0..t {
        for ch in 0..c {
            // Input row tok + k - (W-1); rows before the request are the fresh (zero) history.
            let mut sum = 0.0f64;
            for k in (0..w).filter(|k| tok + k >= w - 1) {
                let row = tok + k - (w - 1);
                sum += f64::from(weight[ch * w + k]) * f64::from(x[row * c + ch]);
            }
            let want = sum / (1.0 + (-sum).exp());
            let got = f64::from(y[tok * c + ch]);
            assert!(
                (got - want).abs() <= 1e-5 * want.abs().max(1.0),
                "y[{tok}, {ch}] = {got}, want {want}"
            );
        }
    }
}

/// `kda_mx_dequant` against the codec's `decode_e4m3(q) · 2^(s − 127)` rounded once to f32
/// (`kda_core::mx::dequantize_value`, the reference's dequantization), and once more to bf16,
/// bit for bit: every E4M3 code under every E8M0 scale byte — the subnormal results of the
/// smallest scales (2^-127, an f32 subnormal, and the scales whose products fall below f32's
/// normal range), the overflowing products of the largest, NaN codes and the NaN scale — in rows
/// whose last block is partial, on A2 and on the 950 (the decode's casts and Gather are checked
/// against each SoC's dtype tables).
#[test]
fn mx_dequant_equals_the_codec_bit_for_bit_for_every_code_and_scale() {
    use kda_ascend_sys::ACL_BF16;
    let (m, k) = (256usize, 256usize + 17);
    let blocks = k.div_ceil(32);
    // Row r: every code, then 17 more, all under scale byte r.
    let data: Vec<u8> = (0..m).flat_map(|r| (0..k).map(move |c| ((c + r) % 256) as u8)).collect();
    let scale: Vec<u8> = (0..m).flat_map(|r| std::iter::repeat_n(r as u8, blocks)).collect();
    for (soc, dtype, bytes) in [
        ("Ascend910B3", ACL_FLOAT, 4usize),
        ("Ascend910B3", ACL_BF16, 2),
        ("Ascend950PR_9599", ACL_FLOAT, 4),
        ("Ascend950PR_9599", ACL_BF16, 2),
    ] {
        let mut y = vec![0u8; m * k * bytes];
        launch_mx_dequant(soc, (&data, &scale), (m, k), (&mut y, dtype), 1 << 16)
            .expect("mx dequant");
        for (i, (&q, got)) in data.iter().zip(y.chunks(bytes)).enumerate() {
            let s = scale[(i / k) * blocks + (i % k) / 32];
            let want = kda_core::mx::dequantize_value(q, s);
            let (got_bits, want_bits, nan) = if bytes == 4 {
                let g = f32::from_ne_bytes(got.try_into().unwrap());
                (g.to_bits(), want.to_bits(), g.is_nan() && want.is_nan())
            } else {
                let g = half::bf16::from_bits(u16::from_ne_bytes(got.try_into().unwrap()));
                let w = half::bf16::from_f32(want);
                (u32::from(g.to_bits()), u32::from(w.to_bits()), g.is_nan() && w.is_nan())
            };
            assert!(
                nan || got_bits == want_bits,
                "{soc} dtype {dtype}: code {q:#04x} scale {s}: got bits {got_bits:#x}, want {want_bits:#x}"
            );
        }
    }
}

/// A row longer than one A2 Gather takes (255 repeats of 64 f32, 16320 values): the kernel
/// gathers it in pieces, each within the twin's repeat-count rule, and every value is the
/// codec's, across the piece boundary and in the partial last block.
#[test]
fn mx_dequant_gathers_a_long_row_in_pieces() {
    let (m, k) = (2usize, 16_384usize + 40);
    let blocks = k.div_ceil(32);
    let data: Vec<u8> = (0..m * k).map(|i| (i * 7 % 256) as u8).collect();
    let scale: Vec<u8> = (0..m * blocks).map(|j| (120 + j % 16) as u8).collect();
    let mut y = vec![0f32; m * k];
    launch_mx_dequant("Ascend910B3", (&data, &scale), (m, k), (&mut y, ACL_FLOAT), 196_608)
        .expect("mx dequant");
    for (i, (&q, got)) in data.iter().zip(&y).enumerate() {
        let s = scale[(i / k) * blocks + (i % k) / 32];
        let want = kda_core::mx::dequantize_value(q, s);
        assert!(
            (got.is_nan() && want.is_nan()) || got.to_bits() == want.to_bits(),
            "value {i}: code {q:#04x} scale {s}: got {got}, want {want}"
        );
    }
}

/// The largest rows `kda_ascend::kernels::tiling::mx_dequant` accepts (multiples of 32; its
/// `mx_dequant_budget_is_the_sources_allocation` test) run on each SoC, and one block more
/// overflows the unified buffer: the tiling's budget is what the kernel allocates.
#[test]
fn mx_dequant_at_the_tilings_largest_rows_fills_the_ub() {
    use kda_ascend_sys::ACL_BF16;
    let cases = [
        ("Ascend910B3", ACL_FLOAT, 4usize, 21_632usize),
        ("Ascend910B3", ACL_BF16, 2, 17_728),
        ("Ascend950PR_9599", ACL_FLOAT, 4, 28_000),
        ("Ascend950PR_9599", ACL_BF16, 2, 22_912),
    ];
    for (soc, dtype, bytes, largest) in cases {
        for (k, fits) in [(largest, true), (largest + 32, false)] {
            let blocks = k.div_ceil(32);
            let data: Vec<u8> = (0..k).map(|c| (c % 256) as u8).collect();
            let scale = vec![127u8; blocks];
            let mut y = vec![0u8; k * bytes];
            let r = launch_mx_dequant(soc, (&data, &scale), (1, k), (&mut y, dtype), 0);
            match (fits, r) {
                (true, r) => r.unwrap_or_else(|e| panic!("{soc} K {k}: {e:?}")),
                (false, Err(kda_acl_emu::twin::TwinError::Violation { rule, .. })) => {
                    assert!(rule.contains("UB overflow"), "{soc} K {k}: {rule}");
                }
                (false, other) => panic!("{soc} K {k}: expected a UB overflow, got {other:?}"),
            }
        }
    }
}
