//! The MXFP8 GEMM's engine: exact block sums of E4M3 operands read as bytes, no widened copy
//! of either operand.
//!
//! [`kda_core::mx::gemm`] defines the result: per 32-wide K block the exact sum of the products,
//! scaled by the two block factors and rounded once to f32, the block terms added in f32 in
//! block order from `+0`. Every E4M3 value is exact in f64, so is every product and every sum of
//! up to 32 of them (41 bits, see the core module), in any order: a block sum accumulated with
//! f64 fused multiply-adds, however the lanes are arranged, is the exact sum. The factors are
//! powers of two (or NaN), so each value can carry its block's factor from the start: `qa · fa`
//! and `qw · fw` are exact, so is each product of them (at least `2^-272`, far above f64's
//! smallest normal), and a block's sum of them is its exact sum times `fa · fw`, the very number
//! the definition rounds once to f32. What is left is arranging the work
//! (`docs/design/mxfp8.md#the-reference-engine-and-what-exactness-costs`).
//!
//! The structure is a packed GEMM. The output is cut into panels of [`NC`] columns (tasks,
//! across the pool when there is one). With many rows ([`gemm_panel`]), the K blocks are taken
//! [`KCB`] at a time: the panel's weight rows are decoded into a packed panel, and the
//! activation rows, [`MC`] at a time, `[MR]` rows interleaved per K step, each take their
//! products from it. With at most [`MC`] rows (decode, [`gemm_panel_few_rows`]), the
//! activations are decoded once per call and each block of `[NR]` weight rows is decoded just
//! before every row group uses it, so the weights stream from memory once; on AVX-512 the
//! micro-kernel reads the weight bytes themselves, each value broadcast from the 256-entry table
//! (a byte load and a table load instead of decoding instructions on the vector units the
//! products need), and applies the block factors to the block sums. A micro-kernel
//! computes an `MR × NR` tile's block sums in registers, one block after the other, and folds
//! each block's rounded term into the tile's f32 accumulators (kept tile by tile, in block
//! order).
//!
//! Three micro-kernels compute the same sums: AVX-512 (24 accumulators of 8 rows), AVX2/FMA
//! (the tile as four `8 × 6` sub-tiles), and a portable one, the oracle the others are tested
//! against. [`Isa::detect`] picks the widest the CPU has; the bits do not depend on the choice.
//!
//! A partial last block is zero-padded on both sides (the padded products are `0 · 0`).

use rayon::prelude::*;

use kda_core::mx::{self, BLOCK_SIZE};

use super::Isa;

/// Activation rows per micro-kernel tile: one 512-bit vector of f64.
pub(super) const MR: usize = 8;
/// Weight rows (output columns) per micro-kernel tile.
pub(super) const NR: usize = 24;
/// Output columns per task: the weight panel decoded at once (each activation row decoded for
/// a panel serves this many columns).
const NC: usize = 16 * NR;
/// K blocks per packed weight panel: `KCB · 32` K elements (a 384-column panel is 384 KB of f64,
/// in the second-level cache with [`MC`] rows of activations, 128 KB).
const KCB: usize = 4;
/// Activation rows packed at once; with at most this many rows, they are packed once per call.
const MC: usize = 16 * MR;
/// Columns of the AVX2 kernel's sub-tiles (`MR × 6`: twelve 4-lane accumulators).
const NR_AVX2: usize = 6;

/// The operands as plain-layout bytes: `a` `[m, k]`, `a_scale` `[m, blocks]`, `w` `[n, k]`,
/// `w_scale` `[n, blocks]`.
#[derive(Copy, Clone, Debug)]
pub(super) struct Operands<'a> {
    pub a: &'a [u8],
    pub a_scale: &'a [u8],
    pub w: &'a [u8],
    pub w_scale: &'a [u8],
    pub m: usize,
    pub n: usize,
    pub k: usize,
}

impl Operands<'_> {
    fn blocks(&self) -> usize {
        mx::num_blocks(self.k)
    }
}

/// Every E4M3 byte's value in f64 (exact).
fn decode_table() -> [f64; 256] {
    std::array::from_fn(|b| f64::from(mx::decode_e4m3(b as u8)))
}

/// The GEMM, `[m, n]` f32 row-major, on the widest kernel this CPU runs (see [`gemm_on`]).
pub(super) fn gemm(
    ops: &Operands<'_>,
    threads: usize,
    progress: impl Fn(usize, usize),
) -> Vec<f32> {
    gemm_on(Isa::detect(), ops, threads, progress)
}

/// The GEMM on the micro-kernel `isa`: `threads > 1` splits the column panels across the
/// current rayon pool; `progress` is told of each finished panel when it runs serially. The
/// result does not depend on the split or the kernel: every entry is the same exact block sums,
/// rounded and added in the same order.
fn gemm_on(
    isa: Isa,
    ops: &Operands<'_>,
    threads: usize,
    progress: impl Fn(usize, usize),
) -> Vec<f32> {
    let Operands { m, n, .. } = *ops;
    let mut out = vec![0.0f32; m * n];
    if m == 0 || n == 0 || ops.k == 0 {
        return out;
    }
    let decode = decode_table();
    // A few rows (decode): decoded once, for every panel.
    let whole_a = (m <= MC).then(|| {
        let blocks = ops.blocks();
        let mut packed = Packed::new::<MR>(m.div_ceil(MR), blocks);
        packed.pack::<MR>(&decode, isa, ops.a, ops.a_scale, ops.k, 0..m, 0..blocks);
        packed
    });
    let panels = n.div_ceil(NC);
    let panel = |p: usize| {
        let cols = p * NC..(p * NC + NC).min(n);
        let part = match &whole_a {
            Some(a) => gemm_panel_few_rows(isa, ops, &decode, a, cols.clone()),
            None => gemm_panel(isa, ops, &decode, cols.clone()),
        };
        (cols, part)
    };
    let copy = |out: &mut [f32], (cols, part): (std::ops::Range<usize>, Vec<f32>)| {
        let width = cols.len();
        for (dst, src) in out.chunks_exact_mut(n).zip(part.chunks_exact(width)) {
            dst[cols.clone()].copy_from_slice(src);
        }
    };
    if threads <= 1 {
        for p in 0..panels {
            copy(&mut out, panel(p));
            progress(p + 1, panels);
        }
    } else {
        let parts: Vec<_> = (0..panels).into_par_iter().map(panel).collect();
        for part in parts {
            copy(&mut out, part);
        }
    }
    out
}

/// One tile's f32 accumulators, `[NR][MR]` (by column: a column's rows side by side, as the
/// vector kernels hold them).
type Tile = [f32; MR * NR];

/// Columns `cols` of the output, `[m, cols.len()]` row-major, for many rows: per [`KCB`] K
/// blocks the panel's weights are decoded once into a packed panel (in the second-level cache),
/// and every [`MC`] rows of activations, packed in turn, take their products from it.
fn gemm_panel(
    isa: Isa,
    ops: &Operands<'_>,
    decode: &[f64; 256],
    cols: std::ops::Range<usize>,
) -> Vec<f32> {
    let (m, k, blocks) = (ops.m, ops.k, ops.blocks());
    let width = cols.len();
    let col_groups = width.div_ceil(NR);
    // The accumulators tile by tile: row group `g`, column group `h` at `g · col_groups + h`.
    let mut tiles = vec![[0.0f32; MR * NR]; m.div_ceil(MR) * col_groups];
    let mut wp = Packed::new::<NR>(col_groups, KCB);
    let mut ap = Packed::new::<MR>(MC / MR, KCB);
    for b0 in (0..blocks).step_by(KCB) {
        let nb = KCB.min(blocks - b0);
        // The panel's next blocks stream in while these are used.
        prefetch_rows(ops.w, k, cols.clone(), (b0 + nb) * BLOCK_SIZE..(b0 + 2 * nb) * BLOCK_SIZE);
        wp.pack_rows::<NR>(decode, isa, ops.w, ops.w_scale, k, cols.clone(), b0..b0 + nb);
        for r0 in (0..m).step_by(MC) {
            let rows = r0..(r0 + MC).min(m);
            ap.pack::<MR>(decode, isa, ops.a, ops.a_scale, k, rows.clone(), b0..b0 + nb);
            for g in 0..rows.len().div_ceil(MR) {
                let a = ap.group::<MR>(g, 0, nb);
                let row_tiles = &mut tiles[(r0 / MR + g) * col_groups..][..col_groups];
                for (h, tile) in row_tiles.iter_mut().enumerate() {
                    micro_kernel(isa, nb, a, wp.group::<NR>(h, 0, nb), tile);
                }
            }
        }
    }
    tiles_to_rows(&tiles, m, width)
}

/// K blocks per step of [`gemm_panel_few_rows`]: the step's activations (`16 · 32 · 8` bytes
/// per row) stay in the second-level cache while the panel's weights stream through.
const KCB_FEW: usize = 16;

/// Columns `cols` of the output, `[m, cols.len()]` row-major, for at most [`MC`] rows `a`
/// (decoded once for the whole call): the weights are read once, each block of `[NR]` weight
/// rows decoded into a buffer that stays in the first-level cache and used there by every row
/// group, so that no decoded panel travels through the caches.
fn gemm_panel_few_rows(
    isa: Isa,
    ops: &Operands<'_>,
    decode: &[f64; 256],
    a: &Packed,
    cols: std::ops::Range<usize>,
) -> Vec<f32> {
    let (m, k, blocks) = (ops.m, ops.k, ops.blocks());
    let width = cols.len();
    let (row_groups, col_groups) = (m.div_ceil(MR), width.div_ceil(NR));
    let mut tiles = vec![[0.0f32; MR * NR]; row_groups * col_groups];
    let mut wp = Packed::new::<NR>(1, 1);
    #[cfg(target_arch = "x86_64")]
    let mut pad = [[0u8; BLOCK_SIZE]; NR];
    let group_rows = |h: usize| cols.start + h * NR..(cols.start + (h + 1) * NR).min(cols.end);
    for b0 in (0..blocks).step_by(KCB_FEW) {
        let step = b0..(b0 + KCB_FEW).min(blocks);
        for h in 0..col_groups {
            // The next column group's weights of this step (or the first group's of the next)
            // stream in while these are used.
            let (next_rows, next_step) = if h + 1 < col_groups {
                (group_rows(h + 1), step.clone())
            } else {
                (group_rows(0), step.end..(step.end + KCB_FEW).min(blocks))
            };
            let next_k = next_step.start * BLOCK_SIZE..next_step.end * BLOCK_SIZE;
            prefetch_rows(ops.w, k, next_rows, next_k);
            for b in step.clone() {
                #[cfg(target_arch = "x86_64")]
                if isa == Isa::Avx512 {
                    let column = ColumnGroup { rows: group_rows(h), h, col_groups };
                    // SAFETY: `Isa::Avx512` is only chosen where the CPU has AVX-512F.
                    unsafe { block_avx512(ops, decode, a, (&column, b), &mut pad, &mut tiles) };
                    continue;
                }
                wp.pack_rows::<NR>(decode, isa, ops.w, ops.w_scale, k, group_rows(h), b..b + 1);
                let w = wp.group::<NR>(0, 0, 1);
                for g in 0..row_groups {
                    micro_kernel(isa, 1, a.group::<MR>(g, b, 1), w, &mut tiles[g * col_groups + h]);
                }
            }
        }
    }
    tiles_to_rows(&tiles, m, width)
}

/// Column group `h` of a panel: its weight rows, and the panel's count of column groups (a
/// tile's index is `g · col_groups + h` for row group `g`).
#[cfg(target_arch = "x86_64")]
struct ColumnGroup {
    rows: std::ops::Range<usize>,
    h: usize,
    col_groups: usize,
}

/// K block `b` of one column group for every row group of `a`, on AVX-512, without decoding the
/// weights into a buffer: the micro-kernel ([`micro_kernel_avx512_bytes`]) reads each weight
/// byte where it lies and broadcasts its value from the 256-entry table, so the vector units do
/// only the products, and applies each column's block factor to the block sum (exact: a power
/// of two, or NaN). A block of fewer than [`NR`] weight rows or [`BLOCK_SIZE`] elements is first
/// copied, zero-padded, into `pad`.
///
/// # Safety
/// The CPU must support AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn block_avx512(
    ops: &Operands<'_>,
    decode: &[f64; 256],
    a: &Packed,
    (column, b): (&ColumnGroup, usize),
    pad: &mut [[u8; BLOCK_SIZE]; NR],
    tiles: &mut [Tile],
) {
    let (k, blocks, rows) = (ops.k, ops.blocks(), column.rows.clone());
    let (k0, kb) = (b * BLOCK_SIZE, BLOCK_SIZE.min(k - b * BLOCK_SIZE));
    let factors: [f64; NR] = std::array::from_fn(|j| {
        let r = rows.start + j;
        if r < rows.end { mx::decode_e8m0_f64(ops.w_scale[r * blocks + b]) } else { 0.0 }
    });
    let (bytes, stride): (&[u8], usize) = if rows.len() == NR && kb == BLOCK_SIZE {
        (&ops.w[rows.start * k + k0..], k)
    } else {
        for (j, p) in pad.iter_mut().enumerate() {
            p.fill(0);
            let r = rows.start + j;
            if r < rows.end {
                p[..kb].copy_from_slice(&ops.w[r * k + k0..][..kb]);
            }
        }
        (pad.as_flattened(), BLOCK_SIZE)
    };
    let w = WeightBlock { bytes, stride, factors: &factors, decode };
    let (row_groups, cg, h) = (tiles.len() / column.col_groups, column.col_groups, column.h);
    // Four row groups at a time (each weight value loaded once for 32 rows), then two, then one.
    let mut g = 0;
    while g < row_groups {
        let tiles = &mut tiles[g * cg + h..];
        let group = |i: usize| a.group::<MR>(g + i, b, 1);
        g += match row_groups - g {
            4.. => {
                micro_kernel_avx512_bytes::<4, 6>(std::array::from_fn(group), &w, (tiles, cg));
                4
            }
            2 | 3 => {
                micro_kernel_avx512_bytes::<2, 12>(std::array::from_fn(group), &w, (tiles, cg));
                2
            }
            _ => {
                micro_kernel_avx512_bytes::<1, 12>([group(0)], &w, (tiles, cg));
                1
            }
        };
    }
}

/// One K block of [`NR`] weight rows as stored: row `j`'s 32 E4M3 bytes at `j · stride`, its
/// block factor, and the table of every byte's value.
#[cfg(target_arch = "x86_64")]
struct WeightBlock<'a> {
    bytes: &'a [u8],
    stride: usize,
    factors: &'a [f64; NR],
    decode: &'a [f64; 256],
}

/// One block of `G` row groups `a` against the weight block `w`, group `g`'s tile at
/// `tiles[g · stride]`, the columns `C` at a time: their block sums in registers (`G` rows of
/// eight by `C` columns), each weight value read as its byte and broadcast from the table once
/// for all `8 G` rows, each sum multiplied by its column's factor (exact) and rounded once to
/// f32 into the tile. The same exact sums as [`micro_kernel_portable`] takes, so the same bits.
///
/// # Safety
/// The CPU must support AVX-512F (`Isa::Avx512`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn micro_kernel_avx512_bytes<const G: usize, const C: usize>(
    a: [&[f64]; G],
    w: &WeightBlock<'_>,
    (tiles, stride): (&mut [Tile], usize),
) {
    use std::arch::x86_64::*;
    const { assert!(MR == 8 && NR.is_multiple_of(C) && G >= 1) };
    assert!(a.iter().all(|a| a.len() >= BLOCK_SIZE * MR));
    assert!(w.bytes.len() >= (NR - 1) * w.stride + BLOCK_SIZE);
    assert!(tiles.len() > (G - 1) * stride);
    let table = w.decode.as_ptr();
    for c0 in (0..NR).step_by(C) {
        let rows: [*const u8; C] = std::array::from_fn(|j| w.bytes[(c0 + j) * w.stride..].as_ptr());
        let mut s = [[_mm512_setzero_pd(); C]; G];
        for kk in 0..BLOCK_SIZE {
            // SAFETY: `kk < 32`: the 8 activation values at `kk·8` of each group and byte `kk`
            // of each weight row lie within their slices (asserted above); a byte indexes the
            // 256-entry table.
            unsafe {
                let x: [__m512d; G] =
                    std::array::from_fn(|g| _mm512_loadu_pd(a[g].as_ptr().add(kk * MR)));
                for (j, row) in rows.iter().enumerate() {
                    let y = _mm512_set1_pd(*table.add(usize::from(*row.add(kk))));
                    for (sg, &xg) in s.iter_mut().zip(&x) {
                        sg[j] = _mm512_fmadd_pd(xg, y, sg[j]);
                    }
                }
            }
        }
        for (g, sums) in s.iter().enumerate() {
            let tp = tiles[g * stride].as_mut_ptr();
            for (j, &sj) in sums.iter().enumerate() {
                let scaled = _mm512_mul_pd(sj, _mm512_set1_pd(w.factors[c0 + j]));
                // SAFETY: `c0 + j < 24`: column `c0 + j`'s 8 f32 lie within the tile.
                unsafe {
                    let at = tp.add((c0 + j) * MR);
                    _mm256_storeu_ps(
                        at,
                        _mm256_add_ps(_mm256_loadu_ps(at), _mm512_cvtpd_ps(scaled)),
                    );
                }
            }
        }
    }
}

/// Ask for elements `range` (clamped to `k`) of every row `rows` of `[_, k]` bytes `data`.
fn prefetch_rows(
    data: &[u8],
    k: usize,
    rows: std::ops::Range<usize>,
    range: std::ops::Range<usize>,
) {
    let range = range.start.min(k)..range.end.min(k);
    if range.is_empty() {
        return;
    }
    for row in rows {
        super::prefetch(&data[row * k..][range.clone()]);
    }
}

/// The tiles of a panel (row group `g`, column group `h` at `g · col_groups + h`) as its
/// `[m, width]` row-major output.
fn tiles_to_rows(tiles: &[Tile], m: usize, width: usize) -> Vec<f32> {
    let col_groups = width.div_ceil(NR);
    let mut out = vec![0.0f32; m * width];
    for (t, tile) in tiles.iter().enumerate() {
        let (i0, j0) = (t / col_groups * MR, t % col_groups * NR);
        for (j, column) in tile.chunks_exact(MR).enumerate().take(width - j0) {
            for (i, &v) in column.iter().enumerate().take(m - i0) {
                out[(i0 + i) * width + j0 + j] = v;
            }
        }
    }
    out
}

/// Rows decoded into f64 for the micro-kernel, each value times its block's factor (exact: a
/// power of two, or NaN), per group of `R` rows and per block: the activations interleaved,
/// `[32][R]` (`R` rows' elements of one K step side by side; [`Packed::pack`]), the weights row
/// by row, `[R][32]` ([`Packed::pack_rows`]).
struct Packed {
    values: Vec<f64>,
    /// Blocks held per group.
    nb: usize,
}

impl Packed {
    fn new<const R: usize>(groups: usize, nb: usize) -> Self {
        Self { values: vec![0.0; groups * nb * BLOCK_SIZE * R], nb }
    }

    /// Decode rows `rows` (of `[_, k]` bytes `data` with scales `scale`, `[_, blocks]`), blocks
    /// `blks`; rows past the range and K past `k` are zeros.
    #[allow(clippy::too_many_arguments)]
    fn pack<const R: usize>(
        &mut self,
        decode: &[f64; 256],
        isa: Isa,
        data: &[u8],
        scale: &[u8],
        k: usize,
        rows: std::ops::Range<usize>,
        blks: std::ops::Range<usize>,
    ) {
        let (blocks, nb) = (mx::num_blocks(k), blks.len());
        self.nb = nb;
        for (g, r0) in rows.clone().step_by(R).enumerate() {
            let values = &mut self.values[g * nb * BLOCK_SIZE * R..][..nb * BLOCK_SIZE * R];
            for r in 0..R {
                let row = r0 + r;
                // The row's next blocks stream in while these are used.
                if row < rows.end {
                    prefetch_rows(
                        data,
                        k,
                        row..row + 1,
                        blks.end * BLOCK_SIZE..(blks.end + nb) * BLOCK_SIZE,
                    );
                }
                for (bb, b) in blks.clone().enumerate() {
                    let dst = values[bb * BLOCK_SIZE * R..][..BLOCK_SIZE * R].chunks_exact_mut(R);
                    if row >= rows.end {
                        dst.for_each(|d| d[r] = 0.0);
                        continue;
                    }
                    let factor = mx::decode_e8m0_f64(scale[row * blocks + b]);
                    let k0 = b * BLOCK_SIZE;
                    let mut block = [0.0f64; BLOCK_SIZE];
                    let src = &data[row * k + k0..][..BLOCK_SIZE.min(k - k0)];
                    decode_block(decode, isa, src, factor, &mut block);
                    for (d, v) in dst.zip(block) {
                        d[r] = v;
                    }
                }
            }
        }
    }

    /// Decode rows `rows` each block contiguous (`[R][32]`); full blocks without NaN with the
    /// vector instructions of `isa`.
    #[allow(clippy::too_many_arguments)]
    fn pack_rows<const R: usize>(
        &mut self,
        decode: &[f64; 256],
        isa: Isa,
        data: &[u8],
        scale: &[u8],
        k: usize,
        rows: std::ops::Range<usize>,
        blks: std::ops::Range<usize>,
    ) {
        let decode_with = |isa| {
            move |src: &[u8], factor, dst: &mut [f64]| decode_block(decode, isa, src, factor, dst)
        };
        match isa {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `Isa::Avx512` is only chosen where the CPU has AVX-512F and BW.
            Isa::Avx512 => unsafe {
                self.pack_rows_avx512::<R>(data, scale, k, rows, blks, decode_with(isa))
            },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `Isa::Avx2` is only chosen where the CPU has AVX2, FMA and F16C.
            Isa::Avx2 => unsafe {
                self.pack_rows_avx2::<R>(data, scale, k, rows, blks, decode_with(isa))
            },
            _ => self.pack_rows_with::<R>(data, scale, k, rows, blks, decode_with(isa)),
        }
    }

    /// [`Packed::pack_rows_with`] compiled for AVX-512, the vector decoding inlined.
    ///
    /// # Safety
    /// The CPU must support AVX-512F and AVX-512BW.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn pack_rows_avx512<const R: usize>(
        &mut self,
        data: &[u8],
        scale: &[u8],
        k: usize,
        rows: std::ops::Range<usize>,
        blks: std::ops::Range<usize>,
        decode_block: impl Fn(&[u8], f64, &mut [f64]),
    ) {
        self.pack_rows_with::<R>(data, scale, k, rows, blks, decode_block);
    }

    /// [`Packed::pack_rows_with`] compiled for AVX2 and F16C, the vector decoding inlined.
    ///
    /// # Safety
    /// The CPU must support AVX2 and F16C.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn pack_rows_avx2<const R: usize>(
        &mut self,
        data: &[u8],
        scale: &[u8],
        k: usize,
        rows: std::ops::Range<usize>,
        blks: std::ops::Range<usize>,
        decode_block: impl Fn(&[u8], f64, &mut [f64]),
    ) {
        self.pack_rows_with::<R>(data, scale, k, rows, blks, decode_block);
    }

    /// The loop of [`Packed::pack_rows`], each block of each row decoded by `decode_block`
    /// (bytes, factor, 32 values out).
    #[inline(always)]
    fn pack_rows_with<const R: usize>(
        &mut self,
        data: &[u8],
        scale: &[u8],
        k: usize,
        rows: std::ops::Range<usize>,
        blks: std::ops::Range<usize>,
        decode_block: impl Fn(&[u8], f64, &mut [f64]),
    ) {
        let (blocks, nb) = (mx::num_blocks(k), blks.len());
        self.nb = nb;
        for (g, r0) in rows.clone().step_by(R).enumerate() {
            let values = &mut self.values[g * nb * BLOCK_SIZE * R..][..nb * BLOCK_SIZE * R];
            for r in 0..R {
                let row = r0 + r;
                for (bb, b) in blks.clone().enumerate() {
                    let dst = &mut values[(bb * R + r) * BLOCK_SIZE..][..BLOCK_SIZE];
                    if row >= rows.end {
                        dst.fill(0.0);
                        continue;
                    }
                    let factor = mx::decode_e8m0_f64(scale[row * blocks + b]);
                    let k0 = b * BLOCK_SIZE;
                    decode_block(&data[row * k + k0..][..BLOCK_SIZE.min(k - k0)], factor, dst);
                }
            }
        }
    }

    /// Group `g`'s blocks `from .. from + nb` (of those packed).
    fn group<const R: usize>(&self, g: usize, from: usize, nb: usize) -> &[f64] {
        let first = g * self.nb + from;
        &self.values[first * BLOCK_SIZE * R..][..nb * BLOCK_SIZE * R]
    }
}

/// One block row of E4M3 bytes (at most 32) into 32 f64 values times `factor`, zero-padded; a
/// full block without NaN with the vector instructions of `isa`.
#[inline(always)]
fn decode_block(decode: &[f64; 256], isa: Isa, src: &[u8], factor: f64, dst: &mut [f64]) {
    #[cfg(target_arch = "x86_64")]
    if let (Ok(bytes), Ok(out)) =
        (<&[u8; 32]>::try_from(src), <&mut [f64; 32]>::try_from(&mut *dst))
    {
        let done = match isa {
            // SAFETY: `Isa::Avx512` is only chosen where the CPU has AVX-512F and BW.
            Isa::Avx512 => unsafe { decode_block_avx512(bytes, factor, out) },
            // SAFETY: `Isa::Avx2` is only chosen where the CPU has AVX2, FMA and F16C.
            Isa::Avx2 => unsafe { decode_block_f16c(bytes, factor, out) },
            Isa::Portable => false,
        };
        if done {
            return;
        }
    }
    let _ = isa;
    for (d, q) in dst.iter_mut().zip(src.iter().map(Some).chain(std::iter::repeat(None))) {
        *d = q.map_or(0.0, |&q| decode[usize::from(q)] * factor);
    }
}

/// A full block of E4M3 bytes into f64 times `factor`, 16 at a time: each byte's sign, exponent
/// and mantissa moved into the fields of an f16 (same mantissa width, exponent bias 15 instead
/// of 7, so the f16 is the value times `2^-8`, subnormals included), converted by the hardware,
/// widened, and multiplied by `2^8 · factor` (a power of two or NaN: exact). Returns false,
/// having written nothing, when the block holds a NaN byte (the f16 fields would make it a
/// number), for the table to decode.
///
/// # Safety
/// The CPU must support AVX2 and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn decode_block_f16c(src: &[u8; 32], factor: f64, dst: &mut [f64; 32]) -> bool {
    use std::arch::x86_64::*;
    // SAFETY: `src` is 32 bytes, one unaligned 256-bit load.
    let bytes = unsafe { _mm256_loadu_si256(src.as_ptr().cast()) };
    let low7 = _mm256_and_si256(bytes, _mm256_set1_epi8(0x7F));
    if _mm256_movemask_epi8(_mm256_cmpeq_epi8(low7, _mm256_set1_epi8(0x7F))) != 0 {
        return false;
    }
    let scale_back = _mm256_set1_pd(256.0 * factor);
    for half in 0..2 {
        let part = if half == 0 {
            _mm256_castsi256_si128(bytes)
        } else {
            _mm256_extracti128_si256::<1>(bytes)
        };
        let x = _mm256_cvtepu8_epi16(part);
        let sign = _mm256_and_si256(_mm256_slli_epi16::<8>(x), _mm256_set1_epi16(0x8000u16 as i16));
        let rest = _mm256_and_si256(_mm256_slli_epi16::<7>(x), _mm256_set1_epi16(0x3F80));
        let h = _mm256_or_si256(sign, rest);
        for (q, lanes) in
            [_mm256_castsi256_si128(h), _mm256_extracti128_si256::<1>(h)].into_iter().enumerate()
        {
            let f = _mm256_cvtph_ps(lanes);
            let lo = _mm256_mul_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(f)), scale_back);
            let hi = _mm256_mul_pd(_mm256_cvtps_pd(_mm256_extractf128_ps::<1>(f)), scale_back);
            let at = half * 16 + q * 8;
            // SAFETY: `at + 8 <= 32`: two unaligned stores of 4 f64 within `dst`.
            unsafe {
                _mm256_storeu_pd(dst.as_mut_ptr().add(at), lo);
                _mm256_storeu_pd(dst.as_mut_ptr().add(at + 4), hi);
            }
        }
    }
    true
}

/// [`decode_block_f16c`] on AVX-512: the 32 bytes as 32 f16 in one register, converted 16 and
/// widened 8 at a time.
///
/// # Safety
/// The CPU must support AVX-512F and AVX-512BW.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn decode_block_avx512(src: &[u8; 32], factor: f64, dst: &mut [f64; 32]) -> bool {
    use std::arch::x86_64::*;
    // SAFETY: `src` is 32 bytes, one unaligned 256-bit load.
    let bytes = unsafe { _mm256_loadu_si256(src.as_ptr().cast()) };
    let low7 = _mm256_and_si256(bytes, _mm256_set1_epi8(0x7F));
    if _mm256_movemask_epi8(_mm256_cmpeq_epi8(low7, _mm256_set1_epi8(0x7F))) != 0 {
        return false;
    }
    let x = _mm512_cvtepu8_epi16(bytes);
    let sign = _mm512_and_si512(_mm512_slli_epi16::<8>(x), _mm512_set1_epi16(0x8000u16 as i16));
    let rest = _mm512_and_si512(_mm512_slli_epi16::<7>(x), _mm512_set1_epi16(0x3F80));
    let h = _mm512_or_si512(sign, rest);
    let scale_back = _mm512_set1_pd(256.0 * factor);
    for (q, lanes) in
        [_mm512_castsi512_si256(h), _mm512_extracti64x4_epi64::<1>(h)].into_iter().enumerate()
    {
        let f = _mm512_castps_pd(_mm512_cvtph_ps(lanes));
        let lo = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_castpd512_pd256(f)));
        let hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(f)));
        // SAFETY: `q < 2`: two unaligned stores of 8 f64 at `16q` and `16q + 8` within `dst`.
        unsafe {
            _mm512_storeu_pd(dst.as_mut_ptr().add(16 * q), _mm512_mul_pd(lo, scale_back));
            _mm512_storeu_pd(dst.as_mut_ptr().add(16 * q + 8), _mm512_mul_pd(hi, scale_back));
        }
    }
    true
}

/// `nb` blocks of an `MR × NR` tile: each block's exact sums, scaled and rounded, added to
/// `tile` in block order, on the kernel `isa`.
fn micro_kernel(isa: Isa, nb: usize, a: &[f64], w: &[f64], tile: &mut Tile) {
    assert!(a.len() >= nb * BLOCK_SIZE * MR && w.len() >= nb * BLOCK_SIZE * NR);
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::Avx512` is only chosen where the CPU has AVX-512F (`Isa::detect`); the
        // slices hold `nb` blocks (asserted above).
        Isa::Avx512 => unsafe { micro_kernel_avx512(nb, a, w, tile) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::Avx2` is only chosen where the CPU has AVX2 and FMA; sizes as above.
        Isa::Avx2 => unsafe { micro_kernel_avx2(nb, a, w, tile) },
        _ => micro_kernel_portable(nb, a, w, tile),
    }
}

/// The definition, lane by lane: the oracle the vector kernels are tested against, and the
/// kernel on CPUs without AVX2/FMA.
fn micro_kernel_portable(nb: usize, a: &[f64], w: &[f64], tile: &mut Tile) {
    for b in 0..nb {
        let mut sums = [[0.0f64; MR]; NR];
        for (j, col) in sums.iter_mut().enumerate() {
            let wv = &w[(b * NR + j) * BLOCK_SIZE..][..BLOCK_SIZE];
            for (kk, &y) in wv.iter().enumerate() {
                let av = &a[(b * BLOCK_SIZE + kk) * MR..][..MR];
                for (s, &x) in col.iter_mut().zip(av) {
                    *s += x * y;
                }
            }
        }
        for (j, col) in sums.iter().enumerate() {
            for (i, &s) in col.iter().enumerate() {
                // The scaled block sum, exact: one rounding to f32.
                tile[j * MR + i] += s as f32;
            }
        }
    }
}

/// [`micro_kernel_portable`] with a column's 8 rows of block sums in one 512-bit register (24
/// of them) and fused multiply-adds, exact like the plain sums.
///
/// # Safety
/// The CPU must support AVX-512F; `a` and `w` hold `nb` blocks ([`micro_kernel`] asserts it).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn micro_kernel_avx512(nb: usize, a: &[f64], w: &[f64], tile: &mut Tile) {
    use std::arch::x86_64::*;
    const { assert!(MR == 8) };
    let (ap, wp, tp) = (a.as_ptr(), w.as_ptr(), tile.as_mut_ptr());
    for b in 0..nb {
        let mut s = [_mm512_setzero_pd(); NR];
        for kk in 0..BLOCK_SIZE {
            // SAFETY: `b < nb` and `kk < 32`: the 8 activation values at `(b·32 + kk)·8` and
            // the weight values at `(b·24 + j)·32 + kk` lie within their slices.
            unsafe {
                let x = _mm512_loadu_pd(ap.add((b * BLOCK_SIZE + kk) * MR));
                let wk = wp.add(b * NR * BLOCK_SIZE + kk);
                for (j, sj) in s.iter_mut().enumerate() {
                    *sj = _mm512_fmadd_pd(x, _mm512_set1_pd(*wk.add(j * BLOCK_SIZE)), *sj);
                }
            }
        }
        for (j, &sj) in s.iter().enumerate() {
            // SAFETY: `j < 24`: column `j`'s 8 f32 at `j · 8` lie within the tile.
            unsafe {
                let at = tp.add(j * MR);
                _mm256_storeu_ps(at, _mm256_add_ps(_mm256_loadu_ps(at), _mm512_cvtpd_ps(sj)));
            }
        }
    }
}

/// [`micro_kernel_portable`] on AVX2: the tile as four `8 × 6` sub-tiles, each with its 48
/// block sums in twelve 4-lane registers (two per column) and fused multiply-adds.
///
/// # Safety
/// The CPU must support AVX2 and FMA; `a` and `w` hold `nb` blocks ([`micro_kernel`] asserts
/// it).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn micro_kernel_avx2(nb: usize, a: &[f64], w: &[f64], tile: &mut Tile) {
    use std::arch::x86_64::*;
    const { assert!(MR == 8 && NR.is_multiple_of(NR_AVX2)) };
    let (ap, wp, tp) = (a.as_ptr(), w.as_ptr(), tile.as_mut_ptr());
    for b in 0..nb {
        for c0 in (0..NR).step_by(NR_AVX2) {
            let mut s = [[_mm256_setzero_pd(); 2]; NR_AVX2];
            for kk in 0..BLOCK_SIZE {
                // SAFETY: `b < nb`, `kk < 32`, `c0 + j < 24`: the 8 activation values at
                // `(b·32 + kk)·8` and the weight value at `(b·24 + c0 + j)·32 + kk` lie within
                // their slices.
                unsafe {
                    let arow = ap.add((b * BLOCK_SIZE + kk) * MR);
                    let (a0, a1) = (_mm256_loadu_pd(arow), _mm256_loadu_pd(arow.add(4)));
                    let wk = wp.add((b * NR + c0) * BLOCK_SIZE + kk);
                    for (j, sj) in s.iter_mut().enumerate() {
                        let y = _mm256_broadcast_sd(&*wk.add(j * BLOCK_SIZE));
                        sj[0] = _mm256_fmadd_pd(a0, y, sj[0]);
                        sj[1] = _mm256_fmadd_pd(a1, y, sj[1]);
                    }
                }
            }
            for (j, sj) in s.iter().enumerate() {
                for (q, &sij) in sj.iter().enumerate() {
                    // SAFETY: `c0 + j < 24`, `q < 2`: 4 f32 at `(c0 + j)·8 + 4q` in the tile.
                    unsafe {
                        let at = tp.add((c0 + j) * MR + 4 * q);
                        _mm_storeu_ps(at, _mm_add_ps(_mm_loadu_ps(at), _mm256_cvtpd_ps(sij)));
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kda_testkit::Gen;

    fn random_bytes(rng: &mut Gen, len: usize, nan: bool) -> Vec<u8> {
        (0..len)
            .map(|_| {
                let b = rng.uniform_usize(0, 256) as u8;
                if !nan && mx::is_nan_e4m3(b) { b & 0xF0 } else { b }
            })
            .collect()
    }

    fn scales(rng: &mut Gen, len: usize, nan: bool) -> Vec<u8> {
        (0..len)
            .map(|_| {
                if nan && rng.uniform_usize(0, 50) == 0 {
                    0xFF
                } else {
                    rng.uniform_usize(100, 150) as u8
                }
            })
            .collect()
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| if x.is_nan() { u32::MAX } else { x.to_bits() }).collect()
    }

    /// Every code (extreme ranges inside blocks, NaN), shapes with partial tiles, panels and
    /// blocks, every kernel this CPU runs, serial and split: bit for bit with the core's
    /// definition.
    #[test]
    fn equals_the_definition_bit_for_bit() {
        let mut rng = Gen::new(0x3141);
        let shapes = [
            (1, 1, 1),
            (3, 13, 33),
            (5, 97, 64),
            (9, 25, 300),
            (70, 400, 290),
            (150, 20, 200),
            (8, 24, 256),
            (40, 7, 1000),
            (17, 401, 64),
        ];
        for (i, &(m, n, k)) in shapes.iter().enumerate() {
            let nan = i % 2 == 1;
            let blocks = mx::num_blocks(k);
            let (a, w) = (random_bytes(&mut rng, m * k, nan), random_bytes(&mut rng, n * k, nan));
            let (sa, sw) = (scales(&mut rng, m * blocks, nan), scales(&mut rng, n * blocks, nan));
            let want = mx::gemm::gemm(&a, &sa, &w, &sw, (m, n, k)).unwrap();
            let ops = Operands { a: &a, a_scale: &sa, w: &w, w_scale: &sw, m, n, k };
            for isa in Isa::available() {
                for threads in [1, 2] {
                    let got = gemm_on(isa, &ops, threads, |_, _| {});
                    assert_eq!(
                        bits(&got),
                        bits(&want),
                        "[{m}, {n}, {k}] {isa:?} threads {threads}"
                    );
                }
            }
        }
    }

    /// The extreme scale pairs: block terms that overflow to infinity, that round to f32
    /// subnormals or to zero, and NaN scales, on every kernel.
    #[test]
    fn extreme_scales_equal_the_definition() {
        let mut rng = Gen::new(0x2718);
        let (m, n, k) = (9, 30, 96);
        let blocks = mx::num_blocks(k);
        let (a, w) = (random_bytes(&mut rng, m * k, false), random_bytes(&mut rng, n * k, false));
        let pick = [0u8, 1, 2, 20, 100, 127, 200, 253, 254, 0xFF];
        let mut pick_scales = |len: usize| -> Vec<u8> {
            (0..len).map(|_| pick[rng.uniform_usize(0, pick.len())]).collect()
        };
        let (sa, sw) = (pick_scales(m * blocks), pick_scales(n * blocks));
        let want = mx::gemm::gemm(&a, &sa, &w, &sw, (m, n, k)).unwrap();
        assert!(want.iter().any(|v| v.is_infinite()) && want.iter().any(|v| v.is_nan()));
        assert!(want.iter().any(|v| v.is_subnormal()));
        let ops = Operands { a: &a, a_scale: &sa, w: &w, w_scale: &sw, m, n, k };
        for isa in Isa::available() {
            assert_eq!(bits(&gemm_on(isa, &ops, 1, |_, _| {})), bits(&want), "{isa:?}");
        }
    }

    /// The vector decoding of weight blocks against the table, on every byte value and on
    /// factors from the smallest to the largest scale, and NaN.
    #[test]
    fn vector_decode_equals_the_table() {
        let decode = decode_table();
        for scale in [0u8, 1, 100, 127, 200, 254, 0xFF] {
            let factor = mx::decode_e8m0_f64(scale);
            for first in (0..=255u8).step_by(32) {
                let mut block: [u8; 32] = std::array::from_fn(|i| first.wrapping_add(i as u8));
                for nan in [false, true] {
                    if !nan {
                        block.iter_mut().for_each(|b| {
                            if mx::is_nan_e4m3(*b) {
                                *b = 0x80
                            }
                        });
                    }
                    let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    let want: Vec<f64> =
                        block.iter().map(|&q| f64::from(mx::decode_e4m3(q)) * factor).collect();
                    for isa in Isa::available() {
                        let mut got = [1.0f64; 32];
                        decode_block(&decode, isa, &block, factor, &mut got);
                        assert_eq!(
                            bits(&got),
                            bits(&want),
                            "{first:#04x}.., scale {scale}, {isa:?}"
                        );
                    }
                }
            }
        }
    }

    /// Each vector micro-kernel against the plain one on one packed tile.
    #[test]
    fn vector_kernels_equal_the_plain_one() {
        let mut rng = Gen::new(7);
        let nb = 3;
        let decode = decode_table();
        let k = nb * BLOCK_SIZE - 5;
        let (a, w) = (random_bytes(&mut rng, MR * k, true), random_bytes(&mut rng, NR * k, true));
        let (sa, sw) = (scales(&mut rng, MR * nb, true), scales(&mut rng, NR * nb, true));
        let (mut ap, mut wp) = (Packed::new::<MR>(1, nb), Packed::new::<NR>(1, nb));
        ap.pack::<MR>(&decode, Isa::Portable, &a, &sa, k, 0..MR, 0..nb);
        wp.pack_rows::<NR>(&decode, Isa::Portable, &w, &sw, k, 0..NR, 0..nb);
        let (ag, wg) = (ap.group::<MR>(0, 0, nb), wp.group::<NR>(0, 0, nb));
        let mut plain = [0.5f32; MR * NR];
        micro_kernel_portable(nb, ag, wg, &mut plain);
        for isa in Isa::available() {
            let mut fast = [0.5f32; MR * NR];
            micro_kernel(isa, nb, ag, wg, &mut fast);
            assert_eq!(bits(&plain), bits(&fast), "{isa:?}");
        }
        // The few-row kernel, which reads the weight bytes where they lie (here with a row
        // stride past the block) and applies the factors to the sums: one group and two, each
        // group's tile as the plain kernel's, block by block.
        #[cfg(target_arch = "x86_64")]
        if Isa::detect() == Isa::Avx512 {
            let a2 = random_bytes(&mut rng, MR * k, true);
            let sa2 = scales(&mut rng, MR * nb, true);
            let mut ap2 = Packed::new::<MR>(1, nb);
            ap2.pack::<MR>(&decode, Isa::Portable, &a2, &sa2, k, 0..MR, 0..nb);
            let ag2 = ap2.group::<MR>(0, 0, nb);
            let mut plain2 = [0.25f32; MR * NR];
            micro_kernel_portable(nb, ag2, wg, &mut plain2);
            // Tiles side by side (stride 1): one group, two, and four (the two groups twice).
            let mut one = [[0.5f32; MR * NR]];
            let mut two = [[0.5f32; MR * NR], [0.25f32; MR * NR]];
            let mut four =
                [[0.5f32; MR * NR], [0.25f32; MR * NR], [0.5f32; MR * NR], [0.25f32; MR * NR]];
            // The weight bytes zero-padded to whole blocks, as the panel pads a partial one.
            let stride = nb * BLOCK_SIZE + 7;
            let mut padded = vec![0u8; NR * stride];
            for (dst, src) in padded.chunks_exact_mut(stride).zip(w.chunks_exact(k)) {
                dst[..k].copy_from_slice(src);
            }
            for b in 0..nb {
                let factors: [f64; NR] =
                    std::array::from_fn(|j| mx::decode_e8m0_f64(sw[j * nb + b]));
                let block = WeightBlock {
                    bytes: &padded[b * BLOCK_SIZE..],
                    stride,
                    factors: &factors,
                    decode: &decode,
                };
                let (a0, a1) = (ap.group::<MR>(0, b, 1), ap2.group::<MR>(0, b, 1));
                // SAFETY: the CPU has AVX-512F (checked above).
                unsafe {
                    micro_kernel_avx512_bytes::<1, 12>([a0], &block, (&mut one, 1));
                    micro_kernel_avx512_bytes::<2, 12>([a0, a1], &block, (&mut two, 1));
                    micro_kernel_avx512_bytes::<4, 6>([a0, a1, a0, a1], &block, (&mut four, 1));
                }
            }
            assert_eq!(bits(&plain), bits(&one[0]), "bytes, one group");
            for (g, tile) in two.iter().chain(&four).enumerate() {
                let want = if g % 2 == 0 { &plain } else { &plain2 };
                assert_eq!(bits(want), bits(tile), "bytes, group {g} of two then four");
            }
        }
    }
}
