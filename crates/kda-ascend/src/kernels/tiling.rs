//! Tiling of the vector kernels, computed on the host: how many vector cores a launch uses
//! (`blockDim`), how many work units each core takes (the last core takes the tail), and how
//! many units one unified-buffer (UB) tile holds with double buffering.
//!
//! A *unit* is the kernel's indivisible piece of work: an element for element-wise kernels, a
//! `(token, head)` row for the gate, a channel for the conv kernels, a `(sequence, head)` state
//! for the delta-rule kernels. Each kernel states the UB bytes one unit needs and the bytes it
//! allocates whatever the tile; the tiling keeps a tile's bytes within the UB share of one tile
//! copy: half the UB for kernels that prefetch the next tile into the other half, the whole UB
//! for the kernels that hold one tile (the conv, delta-rule and MX dequantization kernels, whose
//! budgets are the exact sums of the `InitBuffer` sizes in their sources).

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

impl Chip {
    /// Whether `aclnnMatmul` takes BFLOAT16 with FLOAT16 or FLOAT32: not on Atlas A2/A3
    /// (hicann/ops-nn `matmul/mat_mul_v3/docs/aclnnMatmul.md`, 约束说明), only on the 950.
    pub fn mixed_bf16_matmul(&self) -> bool {
        self.soc.starts_with("Ascend950")
    }
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
/// of `align` units (32-byte UB blocks for element-wise kernels). A tile of `n` units takes
/// [`Work::tile_bytes`]`(n)` = `fixed_bytes + n · unit_bytes` of UB, and the kernel holds
/// `copies` such tiles (2: it prefetches the next one).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Work {
    pub units: usize,
    pub unit_bytes: usize,
    pub align: usize,
    /// UB bytes the kernel allocates besides `unit_bytes` per unit (block rounding slack).
    pub fixed_bytes: usize,
    /// Tiles the kernel holds at once.
    pub copies: usize,
}

impl Work {
    /// Work of a kernel that prefetches: `units` of `unit_bytes`, two tiles in UB.
    const fn double_buffered(units: usize, unit_bytes: usize, align: usize) -> Work {
        Work { units, unit_bytes, align, fixed_bytes: 0, copies: 2 }
    }

    /// UB bytes one tile of `n` units takes.
    pub fn tile_bytes(&self, n: usize) -> usize {
        self.fixed_bytes + n * self.unit_bytes
    }
}

/// Plan `work` for `kernel` on `chip`. `Ok(None)` when there is no work (the launch is skipped).
pub fn tile(
    kernel: &'static str,
    chip: &Chip,
    work: Work,
) -> Result<Option<KernelTiling>, AscendError> {
    let err = |message: String| AscendError::Tiling { kernel, message };
    if work.units == 0 {
        return Ok(None);
    }
    if chip.vector_cores == 0 || work.align == 0 || work.copies == 0 {
        return Err(err(format!(
            "{} vector cores, alignment {}, {} tile copies",
            chip.vector_cores, work.align, work.copies
        )));
    }
    let budget = chip.ub_bytes as usize / work.copies;
    let fit = budget.saturating_sub(work.fixed_bytes) / work.unit_bytes.max(1);
    let tile_cap = fit / work.align * work.align;
    if tile_cap == 0 {
        return Err(err(format!(
            "{} aligned units of {} bytes (+{} bytes per tile) do not fit 1/{} of the {}-byte \
             unified buffer",
            work.align, work.unit_bytes, work.fixed_bytes, work.copies, chip.ub_bytes
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
    Work::double_buffered(numel, in_bytes + 2 * F32, block_elems(in_bytes))
}

/// KDA gate: one unit per `(token, head)` row of `dim` values (raw gate in, `dt_bias` row,
/// f32 out, f32 temporary).
pub fn gate(tokens: usize, heads: usize, dim: usize, in_bytes: usize) -> Work {
    Work::double_buffered(tokens * heads, dim * (in_bytes + 3 * F32), 1)
}

/// Zero-padding mask: one unit per row of `row_len` values (a row is zeroed in UB and copied
/// out when it lies past the live count the kernel reads on device).
pub fn zero_padding(rows: usize, row_len: usize, elem_bytes: usize) -> Work {
    Work::double_buffered(rows, row_len * elem_bytes, 1)
}

/// The channel tiles of the conv kernels: `f32_rows` f32 rows of the tile's channels (a tile is
/// a multiple of 8 channels, so each row fills whole 32-byte blocks) and one 16-bit stage row,
/// rounded up to 16 values: up to one half block (16 bytes) over `2 · tile`.
fn conv_tiles(channels: usize, f32_rows: usize) -> Work {
    Work {
        units: channels,
        unit_bytes: f32_rows * F32 + 2,
        align: block_elems(F32),
        fixed_bytes: 16,
        copies: 1,
    }
}

/// Causal conv update (`kda_conv_update.cpp`): one unit per channel; a tile holds the `width`
/// taps, the window of `width - 1` history rows and `tokens_per_request` new rows, the
/// accumulator and a temporary (f32), and a 16-bit stage row.
pub fn conv_update(channels: usize, width: usize, tokens_per_request: usize) -> Work {
    conv_tiles(channels, width + (width - 1 + tokens_per_request) + 2)
}

/// Causal conv prefill (`kda_conv_prefill.cpp`): one unit per channel; a tile holds the
/// `width` taps, a ring of `width` input rows, the accumulator and a temporary (f32), and a
/// 16-bit stage row, whatever the request lengths (tokens stream through the ring).
pub fn conv_prefill(channels: usize, width: usize) -> Work {
    conv_tiles(channels, 2 * width + 2)
}

/// UB bytes of the delta rule's buffers for one `(sequence, head)` (`kda_delta_rule.h`,
/// `kda_delta_init`): the v-first state, `v` rows of `k` f32 padded to 32 bytes; q, k, g and a
/// temporary (`k` each, padded), v and o (`v` each, padded) and three one-block f32 scratch
/// tensors; a 16-bit stage row of `max(k, v)` values, padded.
pub fn delta_rule_bytes(k: usize, v: usize) -> usize {
    let pad = |n: usize, bytes: usize| n.div_ceil(block_elems(bytes)) * block_elems(bytes);
    let (kp, vp) = (pad(k, F32), pad(v, F32));
    v * kp * F32 + (4 * kp + 2 * vp + 3 * block_elems(F32)) * F32 + pad(k.max(v), 2) * 2
}

/// The delta-rule kernels (`kda_recurrent_step`, `kda_chunk_prefill`): one unit per `(sequence,
/// head)`, each computed whole in UB ([`delta_rule_bytes`]); the kernels hold one unit at a
/// time (they do not use the tile), so the tiling only checks that one fits.
fn delta_rule(units: usize, k: usize, v: usize) -> Work {
    Work { units, unit_bytes: delta_rule_bytes(k, v), align: 1, fixed_bytes: 0, copies: 1 }
}

/// Recurrent KDA step: one unit per `(sequence, head)` ([`delta_rule_bytes`]).
pub fn recurrent(batch: usize, heads: usize, k: usize, v: usize) -> Work {
    delta_rule(batch * heads, k, v)
}

/// KDA chunked prefill, token by token: one unit per `(request, head)` ([`delta_rule_bytes`]).
pub fn chunk(requests: usize, heads: usize, k: usize, v: usize) -> Work {
    delta_rule(requests * heads, k, v)
}

/// Row-wise L2 norm: one unit per row of `dim` values (input, f32 output and temporary).
pub fn l2norm(rows: usize, dim: usize, in_bytes: usize) -> Work {
    Work::double_buffered(rows, dim * (in_bytes + 2 * F32), 1)
}

/// Gated RMSNorm: one unit per row of `dim` values (input and gate, f32 weight, output and
/// temporary).
pub fn gated_rms_norm(rows: usize, dim: usize, in_bytes: usize) -> Work {
    Work::double_buffered(rows, dim * (2 * in_bytes + 3 * F32), 1)
}

/// UB bytes of `kda_mx_dequant.cpp`'s buffers for rows of `k` values to `out_bytes`-wide outputs
/// (its `InitBuffer` calls, each whole 32-byte blocks): the 256-entry f32 decode table; the row's
/// E4M3 bytes and its `ceil(k / 32)` E8M0 scale bytes; the int32 gather offsets and the f32 row
/// (where the codes also widen to half), `k` each, padded; a `k`-value output stage for 16-bit
/// outputs (an f32 row is stored from the f32 buffer: one block).
pub fn mx_dequant_bytes(k: usize, out_bytes: usize) -> usize {
    let pad = |n: usize, bytes: usize| n.div_ceil(block_elems(bytes)) * block_elems(bytes);
    let stage = if out_bytes == F32 { 32 } else { pad(k, out_bytes) * out_bytes };
    256 * F32 + pad(k, 1) + pad(k.div_ceil(32), 1) + 2 * pad(k, F32) * F32 + stage
}

/// MXFP8 dequantization: one unit per row of `k` E4M3 bytes ([`mx_dequant_bytes`]); the kernel
/// holds one row at a time (it does not use the tile), so the tiling only checks that one fits.
pub fn mx_dequant(rows: usize, k: usize, out_bytes: usize) -> Work {
    Work {
        units: rows,
        unit_bytes: mx_dequant_bytes(k, out_bytes),
        align: 1,
        fixed_bytes: 0,
        copies: 1,
    }
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

    /// The invariants every tiling keeps, checked independently of how `tile` computes it.
    fn check(chip: &Chip, work: Work, t: KernelTiling) {
        let (b, p, l, tile) =
            (t.block_dim as usize, t.per_core as usize, t.last_core as usize, t.tile as usize);
        assert!(b >= 1 && b <= chip.vector_cores as usize, "{t:?}");
        assert_eq!(p * (b - 1) + l, work.units, "shares add up to the work: {t:?}");
        assert!(l >= 1 && l <= p, "the last core has a non-empty tail: {t:?}");
        assert_eq!(p % work.align, 0, "{t:?}");
        assert!(tile >= 1 && tile <= p && tile % work.align == 0, "{t:?}");
        assert!(
            work.tile_bytes(tile) <= chip.ub_bytes as usize / work.copies,
            "a tile fits its share of the UB: {t:?}"
        );
    }

    fn tiled(chip: &Chip, work: Work) -> KernelTiling {
        let t = tile("test", chip, work).expect("tiling").expect("work");
        check(chip, work, t);
        t
    }

    #[test]
    fn sigmoid_beta_at_k3_tp8_and_tp1_with_tails() {
        // TP8: lh = 12 heads; a decode batch of 3 tokens is 36 bf16 values: 3 blocks of 16
        // elements, the last core takes the 4-element tail.
        let t = tiled(&a2(), sigmoid(3 * 12, 2));
        assert_eq!((t.block_dim, t.per_core, t.last_core), (3, 16, 4));
        // TP1: 96 heads × 4096 tokens = 393216 values over 48 cores: 8192 each, no tail.
        let t = tiled(&a2(), sigmoid(4096 * HEADS, 2));
        assert_eq!((t.block_dim, t.per_core, t.last_core), (48, 8192, 8192));
        // 10 bytes per bf16 value: 98304 / 10 = 9830, aligned down to 16 → 9824 ≥ 8192.
        assert_eq!(t.tile, 8192);
        // An odd count: 1001 tokens × 12 heads = 12012 values.
        let t = tiled(&a2(), sigmoid(1001 * 12, 2));
        assert_eq!(t.per_core, 256);
        assert_eq!(t.last_core as usize, 12012 - 256 * (t.block_dim as usize - 1));
    }

    #[test]
    fn gate_at_k3_tp8_and_tp1() {
        for (heads, tokens) in [(12, 1), (12, 4096), (HEADS, 1), (HEADS, 4097)] {
            let work = gate(tokens, heads, D, 2);
            let t = tiled(&a2(), work);
            assert_eq!(work.unit_bytes, 128 * 14);
            if tokens * heads < 48 {
                assert_eq!((t.block_dim as usize, t.per_core), (tokens * heads, 1));
            }
        }
        // TP1 prefill, 4097 tokens: 393312 rows over 48 cores, 8194 each (it divides evenly).
        let t = tiled(&a2(), gate(4097, HEADS, D, 2));
        assert_eq!((t.block_dim, t.per_core), (48, 8194));
        assert_eq!(t.last_core, 393_312 - 8194 * 47);
        // One tile holds 98304 / 1792 = 54 rows.
        assert_eq!(t.tile, 54);
    }

    #[test]
    fn zero_padding_at_k3_shapes() {
        // The core output of TP8: rows of lp = 1536 bf16; 4 padded decode rows.
        let t = tiled(&a2(), zero_padding(4, 12 * D, 2));
        assert_eq!((t.block_dim, t.per_core, t.last_core, t.tile), (4, 1, 1, 1));
        // Hidden-sized rows (7168 f32) on a 72-core 950: 126976 / 28672 = 4 rows per tile;
        // 1000 rows at ceil(1000 / 72) = 14 per core need 72 cores, the last taking 6.
        let t = tiled(&a5(), zero_padding(1000, 7168, 4));
        assert_eq!((t.block_dim, t.per_core, t.last_core, t.tile), (72, 14, 6, 4));
        // The same on A2: 98304 / 28672 = 3 rows per tile, 21 per core on 48 cores.
        let t = tiled(&a2(), zero_padding(1000, 7168, 4));
        assert_eq!((t.block_dim, t.per_core, t.last_core, t.tile), (48, 21, 13, 3));
    }

    #[test]
    fn conv_update_at_k3_tp8_and_tp1() {
        // Channels = 3·lp: 4608 at TP8, 36864 at TP1; one decode token, state of W-1.
        let t = tiled(&a2(), conv_update(3 * 12 * D, W, 1));
        assert_eq!((t.block_dim, t.per_core, t.last_core), (48, 96, 96));
        let t = tiled(&a2(), conv_update(3 * HEADS * D, W, 1));
        assert_eq!((t.block_dim, t.per_core, t.last_core), (48, 768, 768));
        // A speculative step of 4 tokens on an odd channel count leaves a tail.
        let t = tiled(&a2(), conv_update(4610, W, 4));
        assert_eq!(t.per_core, 104);
        assert_eq!(t.last_core as usize, 4610 - 104 * (t.block_dim as usize - 1));
    }

    #[test]
    fn recurrent_at_k3_tp8_and_tp1() {
        // One (sequence, head) state of 128×128 fp32 = 64 KiB, q/k/g/tmp/v/o rows and three
        // scratch blocks (3168 bytes) and a bf16 stage row (256 bytes) per unit.
        let work = recurrent(1, 12, D, D);
        assert_eq!(work.unit_bytes, 128 * 128 * 4 + (6 * 128 + 24) * 4 + 128 * 2);
        let t = tiled(&a2(), work);
        assert_eq!((t.block_dim, t.per_core, t.last_core, t.tile), (12, 1, 1, 1));
        let t = tiled(&a2(), recurrent(5, HEADS, D, D));
        assert_eq!((t.block_dim, t.per_core, t.last_core), (48, 10, 10));
        let t = tiled(&a2(), recurrent(7, HEADS, D, D));
        assert_eq!((t.block_dim, t.per_core), (48, 14));
        assert_eq!(t.last_core, 672 - 14 * 47);
    }

    #[test]
    fn row_kernels_at_k3_tp8_and_tp1_with_tails() {
        // q/k L2 norm: (token, head) rows of D = 128 bf16; TP8 decode of 3 tokens is 36 rows,
        // one per core; a TP1 prefill of 1001 tokens is 96096 rows, 2002 per core, no tail.
        let t = tiled(&a2(), l2norm(3 * 12, D, 2));
        assert_eq!((t.block_dim, t.per_core, t.last_core), (36, 1, 1));
        let t = tiled(&a2(), l2norm(1001 * HEADS, D, 2));
        assert_eq!((t.block_dim, t.per_core, t.last_core), (48, 2002, 2002));
        // 128 × 10 bytes per row: 98304 / 1280 = 76 rows per tile.
        assert_eq!(t.tile, 76);
        // Gated RMSNorm on f32 rows: 4097 tokens × 12 heads = 49164 rows, 1025 per core, the
        // last core takes 49164 − 1025 · 47 = 989.
        let t = tiled(&a2(), gated_rms_norm(4097 * 12, D, 4));
        assert_eq!((t.block_dim, t.per_core, t.last_core), (48, 1025, 989));
        assert_eq!(t.tile, 98_304 / (128 * 20));
        // MX dequant of the activation, K = hidden 7168, to bf16: 80096 bytes per row, two in
        // A2's UB; 130 rows → 3 per core on 44 cores, the last 1.
        let t = tiled(&a2(), mx_dequant(130, 7168, 2));
        assert_eq!((t.block_dim, t.per_core, t.last_core, t.tile), (44, 3, 1, 2));
    }

    /// An `InitBuffer` of `bytes`: the pipe hands out whole 32-byte blocks.
    fn init(bytes: usize) -> usize {
        bytes.div_ceil(32) * 32
    }

    /// `kda_pitch`: `n` values of `bytes` each padded to whole 32-byte blocks.
    fn pitch(n: usize, bytes: usize) -> usize {
        n.div_ceil(32 / bytes) * (32 / bytes)
    }

    /// The `InitBuffer` calls of `kda_conv_update.cpp` for a tile of `tile` channels.
    fn conv_update_source(tile: usize, width: usize, n: usize) -> usize {
        let tp = pitch(tile, 4);
        init(width * tp * 4)
            + init((width - 1 + n) * tp * 4)
            + 2 * init(tp * 4)
            + init(pitch(tile, 2) * 2)
    }

    /// The `InitBuffer` calls of `kda_conv_prefill.cpp`.
    fn conv_prefill_source(tile: usize, width: usize) -> usize {
        let tp = pitch(tile, 4);
        2 * init(width * tp * 4) + 2 * init(tp * 4) + init(pitch(tile, 2) * 2)
    }

    /// The `InitBuffer` calls of `kda_delta_init` (`kda_delta_rule.h`).
    fn delta_rule_source(k: usize, v: usize) -> usize {
        let (kp, vp) = (pitch(k, 4), pitch(v, 4));
        init(v * kp * 4) + init((4 * kp + 2 * vp + 24) * 4 + pitch(k.max(v), 2) * 2)
    }

    /// The `InitBuffer` calls of `kda_mx_dequant.cpp` (table, data, scale, offsets, f32 row,
    /// output stage).
    fn mx_dequant_source(k: usize, out_bytes: usize) -> usize {
        let stage = if out_bytes == 4 { init(32) } else { init(pitch(k, out_bytes) * out_bytes) };
        init(256 * 4)
            + init(pitch(k, 1))
            + init(pitch(k.div_ceil(32), 1))
            + init(pitch(k, 4) * 4)
            + init(pitch(k, 4) * 4)
            + stage
    }

    /// MX dequantization: the budget is exactly the source's allocation — at K3's hidden 7168,
    /// at odd K and at the largest K (a multiple of 32) each chip's UB holds, one block more
    /// being refused.
    #[test]
    fn mx_dequant_budget_is_the_sources_allocation() {
        for k in [1, 31, 33, 1001, 4097, 7168, 7169, 16_384 + 40] {
            for out in [4, 2] {
                assert_eq!(mx_dequant_bytes(k, out), mx_dequant_source(k, out), "{k} {out}");
                assert_eq!(mx_dequant(3, k, out).unit_bytes, mx_dequant_source(k, out));
            }
        }
        // K = 7168: table 1024, data 7168, scales 224, offsets and f32 row 28672 each, a bf16
        // stage of 14336 (one block for f32).
        assert_eq!(mx_dequant_source(7168, 2), 1024 + 7168 + 224 + 2 * 28_672 + 14_336);
        assert_eq!(mx_dequant_source(7168, 4), 1024 + 7168 + 224 + 2 * 28_672 + 32);
        // K = 1001: 1024 data bytes, 32 scale bytes (32 blocks), 1008-value rows.
        assert_eq!(mx_dequant_source(1001, 2), 1024 + 1024 + 32 + 2 * 4032 + 2016);
        for (chip, f32_k, bf16_k) in [(a2(), 21_632, 17_728), (a5(), 28_000, 22_912)] {
            let ub = chip.ub_bytes as usize;
            for (k, out) in [(f32_k, 4), (bf16_k, 2)] {
                assert!(mx_dequant_source(k, out) <= ub, "{k} {out}");
                assert!(mx_dequant_source(k + 32, out) > ub, "{k} {out}");
                tiled(&chip, mx_dequant(5, k, out));
                assert!(matches!(
                    tile("kda_mx_dequant", &chip, mx_dequant(5, k + 32, out)),
                    Err(AscendError::Tiling { kernel: "kda_mx_dequant", .. })
                ));
            }
        }
    }

    /// The conv kernels: the planned tile's budget covers what the source allocates (exact up
    /// to the stage row's half-block rounding) and that fits the chip's UB.
    #[test]
    fn conv_budgets_are_the_sources_allocations() {
        for chip in [a2(), a5(), Chip::from_soc("Ascend910B3").expect("A2")] {
            // Decode and speculative steps, K3 TP8/TP1 channel counts, odd counts, and counts
            // large enough that the UB bounds the tile.
            for channels in [8, 24, 4610, 3 * 12 * D, 3 * HEADS * D, 48 * 9000, 72 * 20_000] {
                for (width, n) in [(W, 1), (W, 4), (2, 1), (7, 3)] {
                    let work = conv_update(channels, width, n);
                    let t = tiled(&chip, work).tile as usize;
                    let source = conv_update_source(t, width, n);
                    assert!(source <= work.tile_bytes(t), "{channels} {width} {n}: undercount");
                    assert!(work.tile_bytes(t) <= source + 16, "{channels} {width} {n}");
                    assert!(source <= chip.ub_bytes as usize, "{channels} {width} {n}: {t}");
                }
                for width in [2, W, 7] {
                    let work = conv_prefill(channels, width);
                    let t = tiled(&chip, work).tile as usize;
                    let source = conv_prefill_source(t, width);
                    assert!(source <= work.tile_bytes(t), "{channels} {width}: undercount");
                    assert!(work.tile_bytes(t) <= source + 16, "{channels} {width}");
                    assert!(source <= chip.ub_bytes as usize, "{channels} {width}: {t}");
                }
            }
        }
        // Where the UB bounds the tile, the tile uses it: 9000 channels per core of width 4
        // take 4680 per tile on A2 (42 bytes each + 16), 196 576 of 196 608 bytes.
        let t = tiled(&a2(), conv_update(48 * 9000, W, 1));
        assert_eq!(t.tile, 4680);
        assert_eq!(conv_update_source(4680, W, 1), 196_576);
    }

    /// The delta-rule kernels: the budget is exactly the source's allocation, it fits the chip's
    /// UB up to the largest head dim the tiling accepts, and one more block of head dim is refused.
    #[test]
    fn delta_rule_budgets_are_the_sources_allocations() {
        for (k, v) in [(1, 1), (8, 8), (17, 33), (64, 128), (128, 128), (128, 64), (200, 72)] {
            assert_eq!(delta_rule_bytes(k, v), delta_rule_source(k, v), "{k} {v}");
            assert_eq!(recurrent(2, 3, k, v).unit_bytes, delta_rule_source(k, v));
            assert_eq!(chunk(2, 3, k, v).unit_bytes, delta_rule_source(k, v));
        }
        // The largest square head dim (a multiple of 8) each chip's UB holds.
        for (chip, largest) in [(a2(), 216), (a5(), 248)] {
            let ub = chip.ub_bytes as usize;
            assert!(delta_rule_source(largest, largest) <= ub);
            assert!(delta_rule_source(largest + 8, largest + 8) > ub);
            for work in [recurrent(1, 4, largest, largest), chunk(3, 4, largest, largest)] {
                tiled(&chip, work);
                let bigger = recurrent(1, 4, largest + 8, largest + 8);
                assert!(matches!(
                    tile("kda_recurrent_step", &chip, bigger),
                    Err(AscendError::Tiling { kernel: "kda_recurrent_step", .. })
                ));
            }
        }
    }

    #[test]
    fn empty_work_is_no_launch_and_oversized_rows_are_errors() {
        assert_eq!(tile("k", &a2(), sigmoid(0, 2)).expect("tiling"), None);
        // A 256×256 fp32 state (256 KiB) cannot fit half of A2's UB.
        match tile("kda_recurrent_step", &a2(), recurrent(1, 1, 256, 256)) {
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
        assert_eq!(tiled(&of("Ascend910B3"), work).block_dim, 40);
        assert_eq!(tiled(&a2(), work).block_dim, 48);
    }
}
