//! Tiling of the vector kernels, computed on the host: how many vector cores a launch uses
//! (`blockDim`), how many work units each core takes (the last core takes the tail), and how
//! many units one unified-buffer (UB) tile holds with double buffering.
//!
//! A *unit* is the kernel's indivisible piece of work: an element for element-wise kernels, a
//! `(token, head)` row for the gate, a channel for the conv update, a `(sequence, head)` state
//! for the recurrent step. Each kernel states the UB bytes one unit needs; the plan keeps a
//! tile's bytes within half the UB (the other half is the next tile's prefetch).

use crate::error::AscendError;
use crate::kernels::abi::KernelTiling;

/// What the tiling needs to know about the chip.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chip {
    /// `aclrtGetSocName`.
    pub soc: String,
    /// AI Vector cores (vector-only kernels size `blockDim` by these on decoupled A2/A3).
    pub vector_cores: u32,
    /// Unified buffer bytes per vector core.
    pub ub_bytes: u32,
    /// MXFP8 GEMMs exist (`aclnnQuantMatmulV5` with E4M3/E8M0): Ascend 950 only.
    pub mx_gemm: bool,
}

/// Vector cores and unified-buffer bytes per vector core of each SoC, from CANN's platform
/// configuration (`[SoCInfo] vector_core_cnt`, `[AICoreSpec] ub_size` of
/// `src/platform/platform_config/cann/<soc>.ini` and `cann-dev/<soc>.ini` in `hicann/runtime`;
/// installed as `<arch>-linux/data/platform_config/<soc>.ini`). A2 is `Ascend910B*`, A3
/// `Ascend910_93*`, the 950 parts `Ascend950PR_*` / `Ascend950DT_*`.
pub const PLATFORMS: &[(&str, u32, u32)] = &[
    ("Ascend910B1", 48, 196_608),
    ("Ascend910B2", 48, 196_608),
    ("Ascend910B2C", 48, 196_608),
    ("Ascend910B3", 40, 196_608),
    ("Ascend910B4", 40, 196_608),
    ("Ascend910B4-1", 40, 196_608),
    ("Ascend910_9362", 40, 196_608),
    ("Ascend910_9363", 40, 196_608),
    ("Ascend910_9372", 40, 196_608),
    ("Ascend910_9381", 48, 196_608),
    ("Ascend910_9382", 48, 196_608),
    ("Ascend910_9391", 48, 196_608),
    ("Ascend910_9392", 48, 196_608),
    ("Ascend950PR_950z", 8, 253_952),
    ("Ascend950PR_9579", 56, 253_952),
    ("Ascend950PR_957b", 56, 253_952),
    ("Ascend950PR_957bx", 56, 253_952),
    ("Ascend950PR_957c", 56, 253_952),
    ("Ascend950PR_957d", 56, 253_952),
    ("Ascend950PR_9589", 64, 253_952),
    ("Ascend950PR_958b", 64, 253_952),
    ("Ascend950PR_9599", 72, 253_952),
    ("Ascend950DT_950x", 16, 253_952),
    ("Ascend950DT_950y", 16, 253_952),
    ("Ascend950DT_9571", 56, 253_952),
    ("Ascend950DT_9572", 56, 253_952),
    ("Ascend950DT_9573", 56, 253_952),
    ("Ascend950DT_9574", 56, 253_952),
    ("Ascend950DT_9575", 56, 253_952),
    ("Ascend950DT_9576", 56, 253_952),
    ("Ascend950DT_9577", 56, 253_952),
    ("Ascend950DT_9578", 56, 253_952),
    ("Ascend950DT_9581", 64, 253_952),
    ("Ascend950DT_9581x", 64, 253_952),
    ("Ascend950DT_9582", 64, 253_952),
    ("Ascend950DT_9582x", 64, 253_952),
    ("Ascend950DT_9583", 64, 253_952),
    ("Ascend950DT_9584", 64, 253_952),
    ("Ascend950DT_9585", 64, 253_952),
    ("Ascend950DT_9586", 64, 253_952),
    ("Ascend950DT_9587", 64, 253_952),
    ("Ascend950DT_9588", 64, 253_952),
    ("Ascend950DT_9591", 72, 253_952),
    ("Ascend950DT_9592", 72, 253_952),
    ("Ascend950DT_9595", 72, 253_952),
    ("Ascend950DT_9596", 72, 253_952),
    ("Ascend950DT_95A1", 72, 253_952),
    ("Ascend950DT_95A2", 72, 253_952),
];

/// The families kda runs on, by SoC-name prefix (for parts the table does not list).
const FAMILIES: [&str; 3] = ["Ascend910B", "Ascend910_93", "Ascend950"];

impl Chip {
    /// The chip a SoC name (`aclrtGetSocName`) reports, from [`PLATFORMS`]. A part the table
    /// does not list takes the smallest figures of its family (fewer cores and a smaller UB
    /// are always safe for the tiling); a SoC of no known family is an error.
    pub fn from_soc(soc: &str) -> Result<Chip, AscendError> {
        let mx_gemm = soc.starts_with("Ascend950");
        let chip = |(_, vector_cores, ub_bytes): (&str, u32, u32)| Chip {
            soc: soc.to_string(),
            vector_cores,
            ub_bytes,
            mx_gemm,
        };
        if let Some(&part) = PLATFORMS.iter().find(|(name, ..)| *name == soc) {
            return Ok(chip(part));
        }
        let family = FAMILIES.iter().find(|f| soc.starts_with(*f)).ok_or_else(|| {
            AscendError::Unsupported {
                op: "aclrtGetSocName",
                message: format!(
                    "SoC `{soc}` is none of the families kda runs on ({})",
                    FAMILIES.join(", ")
                ),
            }
        })?;
        let parts = PLATFORMS.iter().filter(|(name, ..)| name.starts_with(*family));
        let cores = parts.clone().map(|p| p.1).min().unwrap_or(1);
        let ub = parts.map(|p| p.2).min().unwrap_or(0);
        Ok(chip((soc, cores, ub)))
    }
}

/// A kernel's work: `units` units of `unit_bytes` UB bytes each; per-core shares are multiples
/// of `align` units (32-byte UB blocks for element-wise kernels).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Work {
    pub units: usize,
    pub unit_bytes: usize,
    pub align: usize,
}

/// Plan `work` for `kernel` on `chip`. `Ok(None)` when there is no work (the launch is skipped).
pub fn plan(
    kernel: &'static str,
    chip: &Chip,
    work: Work,
) -> Result<Option<KernelTiling>, AscendError> {
    let err = |message: String| AscendError::Tiling { kernel, message };
    if work.units == 0 {
        return Ok(None);
    }
    if chip.vector_cores == 0 || work.align == 0 {
        return Err(err(format!("{} vector cores, alignment {}", chip.vector_cores, work.align)));
    }
    let budget = chip.ub_bytes as usize / 2;
    let fit = budget / work.unit_bytes.max(1);
    let tile_cap = fit / work.align * work.align;
    if tile_cap == 0 {
        return Err(err(format!(
            "{} aligned units of {} bytes do not fit half the {}-byte unified buffer",
            work.align, work.unit_bytes, chip.ub_bytes
        )));
    }
    let chunks = work.units.div_ceil(work.align);
    let cores = chunks.min(chip.vector_cores as usize);
    let per_core = chunks.div_ceil(cores) * work.align;
    // Re-derive the core count so that no core is left without work.
    let block_dim = work.units.div_ceil(per_core);
    let last_core = work.units - per_core * (block_dim - 1);
    let tile = tile_cap.min(per_core);
    let to_u32 = |v: usize, what: &str| {
        u32::try_from(v).map_err(|_| err(format!("{what} {v} does not fit the kernel's u32")))
    };
    Ok(Some(KernelTiling {
        block_dim: to_u32(block_dim, "block count")?,
        per_core: to_u32(per_core, "units per core")?,
        last_core: to_u32(last_core, "units of the last core")?,
        tile: to_u32(tile, "units per tile")?,
        ub_bytes: chip.ub_bytes,
        reserved: 0,
    }))
}

/// fp32 bytes.
const F32: usize = 4;
/// Elements of `bytes`-wide values in one 32-byte UB block.
fn block_elems(bytes: usize) -> usize {
    (32 / bytes.max(1)).max(1)
}

/// BFG post-process beta: element-wise fp32 sigmoid of `numel` values of `in_bytes` each
/// (input, f32 output, f32 temporary in UB).
pub fn sigmoid(numel: usize, in_bytes: usize) -> Work {
    Work { units: numel, unit_bytes: in_bytes + 2 * F32, align: block_elems(in_bytes) }
}

/// KDA gate: one unit per `(token, head)` row of `dim` values (raw gate in, `dt_bias` row,
/// f32 out, f32 temporary).
pub fn gate(tokens: usize, heads: usize, dim: usize, in_bytes: usize) -> Work {
    Work { units: tokens * heads, unit_bytes: dim * (in_bytes + 3 * F32), align: 1 }
}

/// Zero-padding mask: one unit per row of `row_len` values (a row is zeroed in UB and copied
/// out when it lies past the live count the kernel reads on device).
pub fn zero_padding(rows: usize, row_len: usize, elem_bytes: usize) -> Work {
    Work { units: rows, unit_bytes: row_len * elem_bytes, align: 1 }
}

/// Causal conv update: one unit per channel, holding its `width` taps, `state_len` state
/// values, and `tokens_per_request` inputs and outputs for each of `batch` requests, in fp32.
pub fn conv_update(
    channels: usize,
    width: usize,
    state_len: usize,
    tokens_per_request: usize,
) -> Work {
    Work {
        units: channels,
        unit_bytes: (width + state_len + 2 * tokens_per_request) * F32,
        align: block_elems(F32),
    }
}

/// Recurrent KDA step: one unit per `(sequence, head)`, holding the `[k, v]` fp32 state and one
/// token's q, k, g (`k` each) and v, o (`v` each) in fp32.
pub fn recurrent(batch: usize, heads: usize, k: usize, v: usize) -> Work {
    Work { units: batch * heads, unit_bytes: (k * v + 3 * k + 2 * v) * F32, align: 1 }
}

/// Row-wise L2 norm: one unit per row of `dim` values (input, f32 output and temporary).
pub fn l2norm(rows: usize, dim: usize, in_bytes: usize) -> Work {
    Work { units: rows, unit_bytes: dim * (in_bytes + 2 * F32), align: 1 }
}

/// Gated RMSNorm: one unit per row of `dim` values (input and gate, f32 weight, output and
/// temporary).
pub fn gated_rms_norm(rows: usize, dim: usize, in_bytes: usize) -> Work {
    Work { units: rows, unit_bytes: dim * (2 * in_bytes + 3 * F32), align: 1 }
}

/// MXFP8 dequantization: one unit per row of `k` E4M3 bytes, its E8M0 scales (one per 32,
/// counted per element as an upper bound), f32 temporary and `out_bytes` outputs.
pub fn mx_dequant(rows: usize, k: usize, out_bytes: usize) -> Work {
    Work { units: rows, unit_bytes: k * (1 + F32 + out_bytes), align: 1 }
}

/// Kernels without a designed tiling yet (the fallbacks: conv prefill, chunked prefill, MX
/// quant on chips without MX GEMMs): `units` independent rows of `unit_bytes` each.
pub fn rows(units: usize, unit_bytes: usize) -> Work {
    Work { units, unit_bytes, align: 1 }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Kimi K3: 96 heads of 128, hidden 7168, conv width 4.
    const HEADS: usize = 96;
    const D: usize = 128;
    const W: usize = 4;

    fn a2() -> Chip {
        Chip::from_soc("Ascend910B2").expect("A2")
    }

    fn a5() -> Chip {
        Chip::from_soc("Ascend950PR_9599").expect("950")
    }

    /// The invariants every plan keeps, checked independently of how `plan` computes it.
    fn check(chip: &Chip, work: Work, t: KernelTiling) {
        let (b, p, l, tile) =
            (t.block_dim as usize, t.per_core as usize, t.last_core as usize, t.tile as usize);
        assert!(b >= 1 && b <= chip.vector_cores as usize, "{t:?}");
        assert_eq!(p * (b - 1) + l, work.units, "shares add up to the work: {t:?}");
        assert!(l >= 1 && l <= p, "the last core has a non-empty tail: {t:?}");
        assert_eq!(p % work.align, 0, "{t:?}");
        assert!(tile >= 1 && tile <= p && tile % work.align == 0, "{t:?}");
        assert!(tile * work.unit_bytes <= chip.ub_bytes as usize / 2, "tile fits half the UB");
    }

    fn planned(chip: &Chip, work: Work) -> KernelTiling {
        let t = plan("test", chip, work).expect("plan").expect("work");
        check(chip, work, t);
        t
    }

    #[test]
    fn sigmoid_beta_at_k3_tp8_and_tp1_with_tails() {
        // TP8: lh = 12 heads; a decode batch of 3 tokens is 36 bf16 values: 3 blocks of 16
        // elements, the last core takes the 4-element tail.
        let t = planned(&a2(), sigmoid(3 * 12, 2));
        assert_eq!((t.block_dim, t.per_core, t.last_core), (3, 16, 4));
        // TP1: 96 heads × 4096 tokens = 393216 values over 48 cores: 8192 each, no tail.
        let t = planned(&a2(), sigmoid(4096 * HEADS, 2));
        assert_eq!((t.block_dim, t.per_core, t.last_core), (48, 8192, 8192));
        // 10 bytes per bf16 value: 98304 / 10 = 9830, aligned down to 16 → 9824 ≥ 8192.
        assert_eq!(t.tile, 8192);
        // An odd count: 1001 tokens × 12 heads = 12012 values.
        let t = planned(&a2(), sigmoid(1001 * 12, 2));
        assert_eq!(t.per_core, 256);
        assert_eq!(t.last_core as usize, 12012 - 256 * (t.block_dim as usize - 1));
    }

    #[test]
    fn gate_at_k3_tp8_and_tp1() {
        for (heads, tokens) in [(12, 1), (12, 4096), (HEADS, 1), (HEADS, 4097)] {
            let work = gate(tokens, heads, D, 2);
            let t = planned(&a2(), work);
            assert_eq!(work.unit_bytes, 128 * 14);
            if tokens * heads < 48 {
                assert_eq!((t.block_dim as usize, t.per_core), (tokens * heads, 1));
            }
        }
        // TP1 prefill, 4097 tokens: 393312 rows over 48 cores, 8194 each (it divides evenly).
        let t = planned(&a2(), gate(4097, HEADS, D, 2));
        assert_eq!((t.block_dim, t.per_core), (48, 8194));
        assert_eq!(t.last_core, 393_312 - 8194 * 47);
        // One tile holds 98304 / 1792 = 54 rows.
        assert_eq!(t.tile, 54);
    }

    #[test]
    fn zero_padding_at_k3_shapes() {
        // The core output of TP8: rows of lp = 1536 bf16; 4 padded decode rows.
        let t = planned(&a2(), zero_padding(4, 12 * D, 2));
        assert_eq!((t.block_dim, t.per_core, t.last_core, t.tile), (4, 1, 1, 1));
        // Hidden-sized rows (7168 f32) on a 72-core 950: 126976 / 28672 = 4 rows per tile;
        // 1000 rows at ceil(1000 / 72) = 14 per core need 72 cores, the last taking 6.
        let t = planned(&a5(), zero_padding(1000, 7168, 4));
        assert_eq!((t.block_dim, t.per_core, t.last_core, t.tile), (72, 14, 6, 4));
        // The same on A2: 98304 / 28672 = 3 rows per tile, 21 per core on 48 cores.
        let t = planned(&a2(), zero_padding(1000, 7168, 4));
        assert_eq!((t.block_dim, t.per_core, t.last_core, t.tile), (48, 21, 13, 3));
    }

    #[test]
    fn conv_update_at_k3_tp8_and_tp1() {
        // Channels = 3·lp: 4608 at TP8, 36864 at TP1; one decode token, state of W-1.
        let t = planned(&a2(), conv_update(3 * 12 * D, W, W - 1, 1));
        assert_eq!((t.block_dim, t.per_core, t.last_core), (48, 96, 96));
        let t = planned(&a2(), conv_update(3 * HEADS * D, W, W - 1, 1));
        assert_eq!((t.block_dim, t.per_core, t.last_core), (48, 768, 768));
        // A speculative step of 4 tokens on an odd channel count leaves a tail.
        let t = planned(&a2(), conv_update(4610, W, W - 1 + 3, 4));
        assert_eq!(t.per_core, 104);
        assert_eq!(t.last_core as usize, 4610 - 104 * (t.block_dim as usize - 1));
    }

    #[test]
    fn recurrent_at_k3_tp8_and_tp1() {
        // One (sequence, head) state of 128×128 fp32 = 64 KiB (+2.5 KiB of vectors) per unit:
        // one unit per tile on A2 (96 KiB half-UB).
        let work = recurrent(1, 12, D, D);
        assert_eq!(work.unit_bytes, (128 * 128 + 5 * 128) * 4);
        let t = planned(&a2(), work);
        assert_eq!((t.block_dim, t.per_core, t.last_core, t.tile), (12, 1, 1, 1));
        let t = planned(&a2(), recurrent(5, HEADS, D, D));
        assert_eq!((t.block_dim, t.per_core, t.last_core), (48, 10, 10));
        let t = planned(&a2(), recurrent(7, HEADS, D, D));
        assert_eq!((t.block_dim, t.per_core), (48, 14));
        assert_eq!(t.last_core, 672 - 14 * 47);
    }

    #[test]
    fn row_kernels_at_k3_tp8_and_tp1_with_tails() {
        // q/k L2 norm: (token, head) rows of D = 128 bf16; TP8 decode of 3 tokens is 36 rows,
        // one per core; a TP1 prefill of 1001 tokens is 96096 rows, 2002 per core, no tail.
        let t = planned(&a2(), l2norm(3 * 12, D, 2));
        assert_eq!((t.block_dim, t.per_core, t.last_core), (36, 1, 1));
        let t = planned(&a2(), l2norm(1001 * HEADS, D, 2));
        assert_eq!((t.block_dim, t.per_core, t.last_core), (48, 2002, 2002));
        // 128 × 10 bytes per row: 98304 / 1280 = 76 rows per tile.
        assert_eq!(t.tile, 76);
        // Gated RMSNorm on f32 rows: 4097 tokens × 12 heads = 49164 rows, 1025 per core, the
        // last core takes 49164 − 1025 · 47 = 989.
        let t = planned(&a2(), gated_rms_norm(4097 * 12, D, 4));
        assert_eq!((t.block_dim, t.per_core, t.last_core), (48, 1025, 989));
        assert_eq!(t.tile, 98_304 / (128 * 20));
        // MX dequant of the activation, K = hidden 7168, to bf16: 7 bytes per element, 50176
        // per row, one row per tile on A2; 130 rows → 3 per core on 44 cores, the last 1.
        let t = planned(&a2(), mx_dequant(130, 7168, 2));
        assert_eq!((t.block_dim, t.per_core, t.last_core, t.tile), (44, 3, 1, 1));
        // A row of K = 16384 to f32 (147456 bytes) exceeds half of A2's UB: a named error.
        assert!(matches!(
            plan("kda_mx_dequant", &a2(), mx_dequant(1, 16384, 4)),
            Err(AscendError::Tiling { kernel: "kda_mx_dequant", .. })
        ));
    }

    #[test]
    fn empty_work_is_no_launch_and_oversized_rows_are_errors() {
        assert_eq!(plan("k", &a2(), sigmoid(0, 2)).expect("plan"), None);
        // A 256×256 fp32 state (256 KiB) cannot fit half of A2's UB.
        match plan("kda_recurrent_step", &a2(), recurrent(1, 1, 256, 256)) {
            Err(AscendError::Tiling { kernel, message }) => {
                assert_eq!(kernel, "kda_recurrent_step");
                assert!(message.contains("do not fit"), "{message}");
            }
            other => panic!("expected a tiling error, got {other:?}"),
        }
    }

    /// The figures of CANN's platform files, per part; unlisted parts take their family's
    /// smallest; an unknown family is an error.
    #[test]
    fn chips_from_soc_names() {
        let of = |soc: &str| Chip::from_soc(soc).expect(soc);
        assert!(a5().mx_gemm && !a2().mx_gemm);
        assert!(!of("Ascend910_9391").mx_gemm);
        assert_eq!((a2().vector_cores, a2().ub_bytes), (48, 196_608));
        assert_eq!((of("Ascend910B3").vector_cores, of("Ascend910B4").vector_cores), (40, 40));
        assert_eq!(of("Ascend910_9362").vector_cores, 40);
        assert_eq!((a5().vector_cores, a5().ub_bytes), (72, 253_952));
        assert_eq!(of("Ascend950DT_9581").vector_cores, 64);
        let unlisted = of("Ascend950PR_99zz");
        assert_eq!(
            (unlisted.vector_cores, unlisted.ub_bytes, unlisted.mx_gemm),
            (8, 253_952, true)
        );
        assert!(Chip::from_soc("Ascend310P3").is_err());
        // The tiling follows the part: 3840 f32 are 480 blocks of 8, 10 per core on 48 cores,
        // 12 per core on a 40-core A2.
        let work = sigmoid(3840, 4);
        assert_eq!(planned(&of("Ascend910B3"), work).block_dim, 40);
        assert_eq!(planned(&a2(), work).block_dim, 48);
    }
}
