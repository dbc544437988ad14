//! [`FusedBfgLinear`]: beta, the forget gate and the output gate of one TP rank in one weight, so
//! one GEMM produces all three (`docs/design/kda.md#fused-bfg-linear`).
//!
//! Local rows `[lh | lp | lp]` = `[b shard | f_b_local @ f_a | g shard]`. The forget gate is
//! low rank in the checkpoint (`f_a_proj` `[D, Hd]`, replicated; `f_b_proj` `[P, D]`, column
//! parallel); its product is composed here, at load time, in fp32 and rounded **once** to the
//! weight dtype. The composition is a function of the two factors only, so it is redone whenever
//! either factor is (re)loaded and the weight has storage: sources may arrive in any order and
//! any number of times, and the packed weight always reflects the latest factors.
//!
//! # The meta-device case
//!
//! A layer may be built before its packed weight has storage ([`FusedBfgLinear::deferred`], what
//! vLLM's meta-device initialisation does). The factors are always storable (host copies), so
//! loading them never fails for lack of storage; composition waits until storage exists, which
//! happens on the first `b_proj`/`g_proj` load (the packed weight's own loader materialises it,
//! as in the seeds' fix, `docs/design/README.md#the-seeds`) or on [`FusedBfgLinear::materialize`].
//! Materialising composes every block whose factors are present, so no order of loads crashes or
//! silently skips a composition.
//!
//! # Staged mode
//!
//! [`BfgMode::Staged`] keeps the factors separate (the two-GEMM form, for comparisons and as a
//! fallback): the packed weight then holds only the full-rank blocks, `[b | g]` (K3) or `[b]`
//! (Kimi Linear), and [`FusedBfgLinear::block_rows`] says where each block is.
//!
//! # The low-rank output gate (Kimi Linear)
//!
//! `g_a_proj` `[D, Hd]` and `g_b_proj` `[P, D]` are composed exactly like the forget gate, into
//! the same third block, so the fused layout `[lh | lp | lp]` and the one-GEMM schedule are the
//! same for both models. The rounding argument is the forget gate's (see `docs/precision.md`),
//! and milder: the output gate only goes through a sigmoid (slope at most 1/4) where the forget
//! gate's logits are scaled by `exp(A_log)` (up to 16) before theirs. In staged mode its factors
//! stay separate like F's.

use std::collections::BTreeSet;
use std::ops::Range;

use super::host::HostTensor;
use super::source::{TensorRead, read_all};
use super::{WeightError, expect_float, expect_shape, fmt_shape, read_rows};
use crate::config::LayerDims;
use kda_core::dtype::DType;

/// A checkpoint source of the fused BFG weight.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum BfgSource {
    /// `b_proj.weight` `[H, Hd]` → block 0.
    B,
    /// `f_a_proj.weight` `[D, Hd]` (replicated) → staging, composed into block 1.
    FA,
    /// `f_b_proj.weight` `[P, D]` or this rank's `[lp, D]` → staging, composed into block 1.
    FB,
    /// `g_proj.weight` `[P, Hd]` (full-rank output gate) → block 2.
    G,
    /// `g_a_proj.weight` `[D, Hd]` (low-rank output gate) → staging, composed into block 2.
    GA,
    /// `g_b_proj.weight` `[P, D]` or `[lp, D]` → staging, composed into block 2.
    GB,
}

impl BfgSource {
    pub const ALL: [BfgSource; 6] =
        [BfgSource::B, BfgSource::FA, BfgSource::FB, BfgSource::G, BfgSource::GA, BfgSource::GB];

    /// The name after the layer prefix in a checkpoint.
    pub const fn suffix(self) -> &'static str {
        match self {
            BfgSource::B => "b_proj.weight",
            BfgSource::FA => "f_a_proj.weight",
            BfgSource::FB => "f_b_proj.weight",
            BfgSource::G => "g_proj.weight",
            BfgSource::GA => "g_a_proj.weight",
            BfgSource::GB => "g_b_proj.weight",
        }
    }
}

/// A block of the fused output, in order.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum BfgBlock {
    /// Beta logits, `lh` columns.
    Beta,
    /// Forget-gate logits `g1`, `lp` columns.
    Forget,
    /// Output-gate logits `g2`, `lp` columns.
    Gate,
}

impl BfgBlock {
    /// The shard id of the merged linear (0, 1, 2).
    pub const fn shard_id(self) -> usize {
        match self {
            BfgBlock::Beta => 0,
            BfgBlock::Forget => 1,
            BfgBlock::Gate => 2,
        }
    }
}

/// Whether low-rank blocks are composed into the packed weight or kept as factors.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash)]
pub enum BfgMode {
    /// One weight `[lh + 2 lp, Hd]`, low-rank blocks composed at load.
    #[default]
    Composed,
    /// Full-rank blocks packed, low-rank factors kept separate (two GEMMs each).
    Staged,
}

/// The two factors of a low-rank block and whether the packed weight holds their product.
#[derive(Clone, Debug, Default, PartialEq)]
struct LowRank {
    /// `[D, Hd]` f32 (exact copies of the checkpoint's values).
    a: Option<HostTensor>,
    /// `[lp, D]` f32.
    b: Option<HostTensor>,
    composed: bool,
}

/// `out[i, j] = Σ_k b[i, k] · a[k, j]` in f32, summed over `k` in increasing order (a fixed
/// order, so the result does not depend on how rows are split across threads). `b` is
/// `[rows, rank]`, `a` is `[rank, cols]`, all row-major.
///
/// # Panics
///
/// When the slices are shorter than the sizes say (callers pass checked tensors).
pub fn compose_low_rank(b: &[f32], a: &[f32], rows: usize, rank: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; rows * cols];
    if rows == 0 || cols == 0 {
        return out;
    }
    let row = |i: usize, o: &mut [f32]| {
        for k in 0..rank {
            let s = b[i * rank + k];
            // An axpy over a contiguous row of `a`: this is what vectorises.
            for (o, &x) in o.iter_mut().zip(&a[k * cols..(k + 1) * cols]) {
                *o += s * x;
            }
        }
    };
    let work = rows.saturating_mul(rank).saturating_mul(cols);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(rows);
    if threads <= 1 || work < 1 << 22 {
        for (i, o) in out.chunks_exact_mut(cols).enumerate() {
            row(i, o);
        }
        return out;
    }
    let per = rows.div_ceil(threads);
    std::thread::scope(|scope| {
        for (c, chunk) in out.chunks_mut(per * cols).enumerate() {
            let row = &row;
            scope.spawn(move || {
                for (i, o) in chunk.chunks_exact_mut(cols).enumerate() {
                    row(c * per + i, o);
                }
            });
        }
    });
    out
}

/// Beta, the composed forget gate and the output gate of one TP rank, packed (see the module
/// docs for the layout, the load order rules and the staged mode).
#[derive(Clone, Debug, PartialEq)]
pub struct FusedBfgLinear {
    dims: LayerDims,
    dtype: DType,
    mode: BfgMode,
    weight: Option<HostTensor>,
    f: LowRank,
    /// Only for the low-rank output gate.
    g: LowRank,
    loaded: BTreeSet<BfgSource>,
}

impl FusedBfgLinear {
    /// A layer whose packed weight has storage (zeros) from the start.
    pub fn new(dims: LayerDims, dtype: DType, mode: BfgMode) -> Result<Self, WeightError> {
        let mut layer = FusedBfgLinear::deferred(dims, dtype, mode)?;
        layer.materialize()?;
        Ok(layer)
    }

    /// A layer whose packed weight has no storage yet (the meta-device case): sources can be
    /// loaded in any order; see the module docs.
    pub fn deferred(dims: LayerDims, dtype: DType, mode: BfgMode) -> Result<Self, WeightError> {
        if !dtype.is_float() {
            return Err(WeightError::dtype("fused BFG weight", "bf16, f16 or f32", dtype));
        }
        Ok(FusedBfgLinear {
            dims,
            dtype,
            mode,
            weight: None,
            f: LowRank::default(),
            g: LowRank::default(),
            loaded: BTreeSet::new(),
        })
    }

    pub fn dims(&self) -> &LayerDims {
        &self.dims
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn mode(&self) -> BfgMode {
        self.mode
    }

    /// The packed weight `[rows, Hd]`, once it has storage.
    pub fn weight(&self) -> Option<&HostTensor> {
        self.weight.as_ref()
    }

    pub fn has_storage(&self) -> bool {
        self.weight.is_some()
    }

    /// Whether `source` has been loaded at least once (never reset).
    pub fn is_loaded(&self, source: BfgSource) -> bool {
        self.loaded.contains(&source)
    }

    /// Forget-gate factors as loaded: `f_a` `[D, Hd]` and this rank's `f_b` `[lp, D]`, f32.
    pub fn f_factors(&self) -> (Option<&HostTensor>, Option<&HostTensor>) {
        (self.f.a.as_ref(), self.f.b.as_ref())
    }

    /// Low-rank output-gate factors (`g_a` `[D, Hd]`, `g_b` `[lp, D]`, f32), Kimi Linear only.
    pub fn g_factors(&self) -> (Option<&HostTensor>, Option<&HostTensor>) {
        (self.g.a.as_ref(), self.g.b.as_ref())
    }

    /// The sources this layer needs: b, f_a, f_b and either g or g_a + g_b.
    pub fn required(&self) -> Vec<BfgSource> {
        let mut r = vec![BfgSource::B, BfgSource::FA, BfgSource::FB];
        if self.dims.full_rank_gate {
            r.push(BfgSource::G);
        } else {
            r.extend([BfgSource::GA, BfgSource::GB]);
        }
        r
    }

    /// Required sources not loaded yet.
    pub fn missing(&self) -> Vec<BfgSource> {
        self.required().into_iter().filter(|s| !self.loaded.contains(s)).collect()
    }

    /// Rows of the packed weight.
    pub fn packed_rows(&self) -> usize {
        let d = &self.dims;
        match self.mode {
            BfgMode::Composed => d.bfg_width(),
            BfgMode::Staged => d.local_heads + if d.full_rank_gate { d.local_proj } else { 0 },
        }
    }

    /// Where `block` sits in the packed weight (and in the fused GEMM's output columns), or
    /// `None` when this mode keeps it as separate factors.
    pub fn block_rows(&self, block: BfgBlock) -> Option<Range<usize>> {
        let (lh, lp) = (self.dims.local_heads, self.dims.local_proj);
        match (self.mode, block) {
            (_, BfgBlock::Beta) => Some(0..lh),
            (BfgMode::Composed, BfgBlock::Forget) => Some(lh..lh + lp),
            (BfgMode::Composed, BfgBlock::Gate) => Some(lh + lp..lh + 2 * lp),
            (BfgMode::Staged, BfgBlock::Forget) => None,
            (BfgMode::Staged, BfgBlock::Gate) => self.dims.full_rank_gate.then_some(lh..lh + lp),
        }
    }

    /// Whether every block this mode composes holds the product of the current factors.
    pub fn is_composed(&self) -> bool {
        match self.mode {
            BfgMode::Staged => true,
            BfgMode::Composed => self.f.composed && (self.dims.full_rank_gate || self.g.composed),
        }
    }

    /// Give the packed weight storage (zeros) if it has none, then compose every block whose
    /// factors are both present. Idempotent.
    pub fn materialize(&mut self) -> Result<(), WeightError> {
        if self.weight.is_none() {
            let shape = [self.packed_rows(), self.dims.hidden];
            self.weight = Some(HostTensor::zeros(self.dtype, &shape).map_err(|e| match e {
                WeightError::Alloc { bytes, .. } => {
                    WeightError::Alloc { param: "fused BFG weight".into(), bytes }
                }
                other => other,
            })?);
        }
        self.compose(BfgBlock::Forget)?;
        if !self.dims.full_rank_gate {
            self.compose(BfgBlock::Gate)?;
        }
        Ok(())
    }

    /// Load one source (dispatches to the `load_*` method).
    pub fn load(&mut self, source: BfgSource, t: &dyn TensorRead) -> Result<(), WeightError> {
        match source {
            BfgSource::B => self.load_b(t),
            BfgSource::FA => self.load_f_a(t),
            BfgSource::FB => self.load_f_b(t),
            BfgSource::G => self.load_g(t),
            BfgSource::GA => self.load_g_a(t),
            BfgSource::GB => self.load_g_b(t),
        }
    }

    /// `b_proj.weight` `[H, Hd]`: this rank's heads into block 0.
    pub fn load_b(&mut self, t: &dyn TensorRead) -> Result<(), WeightError> {
        let param = BfgSource::B.suffix();
        let d = self.dims;
        expect_float(param, t)?;
        expect_shape(param, t, &[d.heads, d.hidden], "[num_heads, hidden_size]")?;
        let rows = read_rows(t, d.head_range())?;
        self.write_block(BfgBlock::Beta, &rows)?;
        self.loaded.insert(BfgSource::B);
        Ok(())
    }

    /// `g_proj.weight` `[P, Hd]` (full-rank output gate): this rank's rows into block 2.
    pub fn load_g(&mut self, t: &dyn TensorRead) -> Result<(), WeightError> {
        let param = BfgSource::G.suffix();
        let d = self.dims;
        if !d.full_rank_gate {
            return Err(WeightError::value(
                param,
                "the config has a low-rank output gate (use_full_rank_gate = false), which \
                 reads g_a_proj.weight and g_b_proj.weight",
            ));
        }
        expect_float(param, t)?;
        expect_shape(param, t, &[d.proj, d.hidden], "[num_heads * head_dim, hidden_size]")?;
        let rows = read_rows(t, d.proj_range())?;
        self.write_block(BfgBlock::Gate, &rows)?;
        self.loaded.insert(BfgSource::G);
        Ok(())
    }

    /// `f_a_proj.weight` `[D, Hd]` (replicated, exact shape only).
    pub fn load_f_a(&mut self, t: &dyn TensorRead) -> Result<(), WeightError> {
        self.f.a = Some(self.read_factor_a(BfgSource::FA.suffix(), t)?);
        self.loaded.insert(BfgSource::FA);
        self.factor_changed(BfgBlock::Forget)
    }

    /// `f_b_proj.weight`: global `[P, D]` (this rank's rows are taken) or local `[lp, D]`.
    pub fn load_f_b(&mut self, t: &dyn TensorRead) -> Result<(), WeightError> {
        self.f.b = Some(self.read_factor_b(BfgSource::FB.suffix(), t)?);
        self.loaded.insert(BfgSource::FB);
        self.factor_changed(BfgBlock::Forget)
    }

    /// `g_a_proj.weight` `[D, Hd]` (low-rank output gate).
    pub fn load_g_a(&mut self, t: &dyn TensorRead) -> Result<(), WeightError> {
        self.expect_low_rank_gate(BfgSource::GA.suffix())?;
        self.g.a = Some(self.read_factor_a(BfgSource::GA.suffix(), t)?);
        self.loaded.insert(BfgSource::GA);
        self.factor_changed(BfgBlock::Gate)
    }

    /// `g_b_proj.weight`: global `[P, D]` or local `[lp, D]` (low-rank output gate).
    pub fn load_g_b(&mut self, t: &dyn TensorRead) -> Result<(), WeightError> {
        self.expect_low_rank_gate(BfgSource::GB.suffix())?;
        self.g.b = Some(self.read_factor_b(BfgSource::GB.suffix(), t)?);
        self.loaded.insert(BfgSource::GB);
        self.factor_changed(BfgBlock::Gate)
    }

    fn expect_low_rank_gate(&self, param: &str) -> Result<(), WeightError> {
        if self.dims.full_rank_gate {
            Err(WeightError::value(
                param,
                "the config has a full-rank output gate (use_full_rank_gate = true), which \
                 reads g_proj.weight",
            ))
        } else {
            Ok(())
        }
    }

    fn read_factor_a(&self, param: &str, t: &dyn TensorRead) -> Result<HostTensor, WeightError> {
        let d = self.dims;
        expect_float(param, t)?;
        expect_shape(param, t, &[d.head_dim, d.hidden], "[head_dim, hidden_size]")?;
        read_all(t)?.cast(DType::F32)
    }

    fn read_factor_b(&self, param: &str, t: &dyn TensorRead) -> Result<HostTensor, WeightError> {
        let d = self.dims;
        expect_float(param, t)?;
        let (global, local) = ([d.proj, d.head_dim], [d.local_proj, d.head_dim]);
        let rows = if t.shape() == global {
            read_rows(t, d.proj_range())?
        } else if t.shape() == local {
            read_all(t)?
        } else {
            return Err(WeightError::shape(
                param,
                format!(
                    "{} (global) or {} (this rank's slice)",
                    fmt_shape(&global),
                    fmt_shape(&local)
                ),
                t.shape(),
            ));
        };
        rows.cast(DType::F32)
    }

    /// A factor of `block` was (re)loaded: its product is stale until composed again.
    fn factor_changed(&mut self, block: BfgBlock) -> Result<(), WeightError> {
        match block {
            BfgBlock::Forget => self.f.composed = false,
            _ => self.g.composed = false,
        }
        self.compose(block)
    }

    /// Compose `block` if this mode packs it, both factors are present and there is storage.
    fn compose(&mut self, block: BfgBlock) -> Result<(), WeightError> {
        if self.mode != BfgMode::Composed {
            return Ok(());
        }
        let Some(rows) = self.block_rows(block) else { return Ok(()) };
        let pair = if block == BfgBlock::Forget { &self.f } else { &self.g };
        let (Some(a), Some(b), Some(weight)) = (&pair.a, &pair.b, &mut self.weight) else {
            return Ok(());
        };
        let (Some(a), Some(b)) = (a.as_f32(), b.as_f32()) else {
            return Err(WeightError::dtype("low-rank factor", "f32", "another dtype"));
        };
        let d = self.dims;
        let product = compose_low_rank(b, a, d.local_proj, d.head_dim, d.hidden);
        weight.write_rows_f32(rows.start, &product)?;
        match block {
            BfgBlock::Forget => self.f.composed = true,
            _ => self.g.composed = true,
        }
        Ok(())
    }

    /// Write this rank's rows of a full-rank block, materialising storage first.
    fn write_block(&mut self, block: BfgBlock, rows: &HostTensor) -> Result<(), WeightError> {
        self.materialize()?;
        let Some(range) = self.block_rows(block) else { return Ok(()) };
        match &mut self.weight {
            Some(w) => w.write_rows(range.start, rows),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use half::bf16;

    use super::*;
    use crate::config::{KdaConfig, LinearAttnConfig, Tp};

    /// The configuration of behaviour 5 (`docs/design/kda.md#behaviour-5`): Hd 6, H 8, D 3.
    pub(crate) fn tiny(full_rank_gate: bool) -> KdaConfig {
        KdaConfig {
            hidden_size: 6,
            rms_norm_eps: 1e-5,
            linear_attn_config: LinearAttnConfig {
                num_heads: 8,
                head_dim: 3,
                short_conv_kernel_size: 4,
                gate_lower_bound: Some(-5.0),
            },
            use_full_rank_gate: full_rank_gate,
            qkv_quantization: None,
        }
    }

    /// Distinct, non-trivially rounding values, rounded to bf16 like checkpoint weights.
    fn weights(rows: usize, cols: usize, salt: f32) -> HostTensor {
        let v: Vec<bf16> = (0..rows * cols)
            .map(|i| bf16::from_f32(((i as f32 + salt) * 0.737).sin() * (1.0 + salt * 0.01)))
            .collect();
        HostTensor::from_bf16(&[rows, cols], v).unwrap()
    }

    fn f32s(t: &HostTensor) -> Vec<f32> {
        t.to_f32_vec().unwrap()
    }

    /// The f32 product of behaviour 5 (`docs/design/kda.md#behaviour-5`), written out: row i,
    /// column j, k ascending, then one rounding to bf16.
    fn expected_f(f_b: &HostTensor, rows: Range<usize>, f_a: &HostTensor) -> Vec<f32> {
        let (b, a) = (f32s(f_b), f32s(f_a));
        let (d, hd) = (f_a.shape()[0], f_a.shape()[1]);
        let mut out = Vec::new();
        for i in rows {
            for j in 0..hd {
                let mut acc = 0.0f32;
                for k in 0..d {
                    acc += b[i * d + k] * a[k * hd + j];
                }
                out.push(bf16::from_f32(acc).to_f32());
            }
        }
        out
    }

    fn rows_of(w: &HostTensor, rows: Range<usize>) -> Vec<f32> {
        let cols = w.shape()[1];
        f32s(w)[rows.start * cols..rows.end * cols].to_vec()
    }

    /// Behaviour 5 (`docs/design/kda.md#behaviour-5`): TP 4, rank 2, Hd 6, H 8, D 3; `f_b` given
    /// globally or as the local slice.
    #[test]
    fn behaviour_5_fused_bfg_composition_tp4_rank2() {
        let dims = tiny(true).dims(Tp::new(4, 2).unwrap()).unwrap();
        let (b, f_a, f_b, g) =
            (weights(8, 6, 1.0), weights(3, 6, 2.0), weights(24, 3, 3.0), weights(24, 6, 4.0));
        let f_b_local = f_b.read(&[12..18, 0..3]).unwrap();
        for f_b_given in [&f_b, &f_b_local] {
            let mut bfg = FusedBfgLinear::new(dims, DType::BF16, BfgMode::Composed).unwrap();
            bfg.load_b(&b).unwrap();
            bfg.load_f_a(&f_a).unwrap();
            bfg.load_f_b(f_b_given).unwrap();
            bfg.load_g(&g).unwrap();
            let w = bfg.weight().unwrap();
            assert_eq!((w.dtype(), w.shape()), (DType::BF16, &[14usize, 6][..]));
            assert_eq!(rows_of(w, 0..2), rows_of(&b, 4..6));
            assert_eq!(rows_of(w, 2..8), expected_f(&f_b, 12..18, &f_a));
            assert_eq!(rows_of(w, 8..14), rows_of(&g, 12..18));
            assert!(bfg.is_composed());
            assert_eq!(bfg.block_rows(BfgBlock::Forget), Some(2..8));
            assert_eq!(bfg.f_factors().1.unwrap().shape(), &[6, 3]);
        }
    }

    /// Behaviour 6 (`docs/design/kda.md#behaviour-6`): F rows stay zero with only `f_a`, equal
    /// `f_b @ f_a` once `f_b` arrives, and the new product after both are reloaded.
    #[test]
    fn behaviour_6_reload_recomposes() {
        let dims = tiny(true).dims(Tp::new(4, 2).unwrap()).unwrap();
        let mut bfg = FusedBfgLinear::new(dims, DType::BF16, BfgMode::Composed).unwrap();
        let (f_a, f_b) = (weights(3, 6, 2.0), weights(24, 3, 3.0));
        bfg.load_f_a(&f_a).unwrap();
        assert!(rows_of(bfg.weight().unwrap(), 2..8).iter().all(|&x| x == 0.0));
        assert!(!bfg.is_composed());
        bfg.load_f_b(&f_b).unwrap();
        assert_eq!(rows_of(bfg.weight().unwrap(), 2..8), expected_f(&f_b, 12..18, &f_a));
        let (f_a2, f_b2) = (weights(3, 6, 7.0), weights(24, 3, 8.0));
        bfg.load_f_a(&f_a2).unwrap();
        assert_eq!(rows_of(bfg.weight().unwrap(), 2..8), expected_f(&f_b, 12..18, &f_a2));
        bfg.load_f_b(&f_b2).unwrap();
        assert_eq!(rows_of(bfg.weight().unwrap(), 2..8), expected_f(&f_b2, 12..18, &f_a2));
        assert!(bfg.is_loaded(BfgSource::FA) && bfg.is_loaded(BfgSource::FB));
    }

    /// The meta-device case: factors before storage are kept, composed when `b` materialises the
    /// weight, and the result equals the eager layer's.
    #[test]
    fn deferred_storage_composes_once_storage_exists() {
        let dims = tiny(true).dims(Tp::new(4, 1).unwrap()).unwrap();
        let (b, f_a, f_b, g) =
            (weights(8, 6, 1.0), weights(3, 6, 2.0), weights(24, 3, 3.0), weights(24, 6, 4.0));
        let mut eager = FusedBfgLinear::new(dims, DType::BF16, BfgMode::Composed).unwrap();
        for (s, t) in
            [(BfgSource::B, &b), (BfgSource::FA, &f_a), (BfgSource::FB, &f_b), (BfgSource::G, &g)]
        {
            eager.load(s, t).unwrap();
        }
        let mut meta = FusedBfgLinear::deferred(dims, DType::BF16, BfgMode::Composed).unwrap();
        meta.load_f_b(&f_b).unwrap();
        meta.load_f_a(&f_a).unwrap();
        assert!(!meta.has_storage() && !meta.is_composed());
        meta.load_g(&g).unwrap();
        assert!(meta.has_storage() && meta.is_composed());
        meta.load_b(&b).unwrap();
        assert_eq!(meta.weight(), eager.weight());

        // Explicit materialisation after both factors.
        let mut meta = FusedBfgLinear::deferred(dims, DType::BF16, BfgMode::Composed).unwrap();
        meta.load_f_a(&f_a).unwrap();
        meta.load_f_b(&f_b).unwrap();
        meta.materialize().unwrap();
        assert_eq!(rows_of(meta.weight().unwrap(), 2..8), rows_of(eager.weight().unwrap(), 2..8));
        meta.materialize().unwrap();
        assert!(meta.is_composed());
    }

    #[test]
    fn staged_mode_keeps_factors_and_packs_full_rank_blocks() {
        let dims = tiny(true).dims(Tp::new(2, 1).unwrap()).unwrap();
        let mut staged = FusedBfgLinear::deferred(dims, DType::BF16, BfgMode::Staged).unwrap();
        let (b, f_a, f_b, g) =
            (weights(8, 6, 1.0), weights(3, 6, 2.0), weights(24, 3, 3.0), weights(24, 6, 4.0));
        staged.load_f_a(&f_a).unwrap();
        staged.load_f_b(&f_b).unwrap();
        staged.load_b(&b).unwrap();
        staged.load_g(&g).unwrap();
        let w = staged.weight().unwrap();
        assert_eq!(w.shape(), &[4 + 12, 6]);
        assert_eq!(rows_of(w, 0..4), rows_of(&b, 4..8));
        assert_eq!(rows_of(w, 4..16), rows_of(&g, 12..24));
        assert_eq!(staged.block_rows(BfgBlock::Forget), None);
        assert_eq!(staged.block_rows(BfgBlock::Gate), Some(4..16));
        let (a, fb) = staged.f_factors();
        assert_eq!(a.unwrap().to_f32_vec(), f_a.to_f32_vec());
        assert_eq!(fb.unwrap().to_f32_vec().unwrap(), f32s(&f_b)[12 * 3..24 * 3].to_vec());
    }

    #[test]
    fn low_rank_output_gate_is_composed_like_f() {
        let dims = tiny(false).dims(Tp::new(2, 0).unwrap()).unwrap();
        let mut bfg = FusedBfgLinear::deferred(dims, DType::F32, BfgMode::Composed).unwrap();
        let (g_a, g_b) = (weights(3, 6, 5.0), weights(12, 3, 6.0));
        bfg.load_g_b(&g_b).unwrap();
        bfg.load_g_a(&g_a).unwrap();
        bfg.load_b(&weights(8, 6, 1.0)).unwrap();
        assert!(!bfg.is_composed(), "F is still missing");
        assert_eq!(bfg.missing(), vec![BfgSource::FA, BfgSource::FB]);
        let w = bfg.weight().unwrap();
        let (a, b) = (f32s(&g_a), f32s(&g_b));
        let (a, b) = (&a, &b);
        // f32 weight: the product itself, no rounding after the f32 sum.
        let want: Vec<f32> = (0..12)
            .flat_map(|i| {
                (0..6).map(move |j| (0..3).fold(0.0f32, |s, k| s + b[i * 3 + k] * a[k * 6 + j]))
            })
            .collect();
        assert_eq!(rows_of(w, 4 + 12..4 + 24), want);
        let e = bfg.load_g(&weights(12, 6, 0.0)).unwrap_err().to_string();
        assert!(e.contains("low-rank output gate"), "{e}");
    }

    #[test]
    fn wrong_shapes_and_dtypes_name_the_parameter() {
        let dims = tiny(true).dims(Tp::new(4, 2).unwrap()).unwrap();
        let mut bfg = FusedBfgLinear::new(dims, DType::BF16, BfgMode::Composed).unwrap();
        let e = bfg.load_f_b(&weights(12, 3, 0.0)).unwrap_err().to_string();
        assert_eq!(
            e,
            "f_b_proj.weight: shape [12, 3], expected [24, 3] (global) or [6, 3] (this rank's slice)"
        );
        let e = bfg.load_f_a(&weights(3, 7, 0.0)).unwrap_err().to_string();
        assert_eq!(e, "f_a_proj.weight: shape [3, 7], expected [3, 6] [head_dim, hidden_size]");
        // f_a must be exact: the transpose is not accepted.
        assert!(bfg.load_f_a(&weights(6, 3, 0.0)).is_err());
        let e = bfg.load_b(&weights(4, 6, 0.0)).unwrap_err().to_string();
        assert!(e.starts_with("b_proj.weight: shape [4, 6], expected [8, 6]"), "{e}");
        let bytes = HostTensor::from_bytes(DType::U8, &[8, 6], vec![0; 48]).unwrap();
        let e = bfg.load_b(&bytes).unwrap_err().to_string();
        assert_eq!(e, "b_proj.weight: dtype u8, expected bf16, f16 or f32");
        let e = bfg.load_g_a(&weights(3, 6, 0.0)).unwrap_err().to_string();
        assert!(e.contains("full-rank output gate"), "{e}");
        assert!(bfg.loaded.is_empty(), "failed loads leave no trace");
        assert!(FusedBfgLinear::new(dims, DType::U8, BfgMode::Composed).is_err());
    }

    #[test]
    fn compose_is_thread_count_independent() {
        // Large enough to take the threaded path.
        let (rows, rank, cols) = (64, 16, 4096);
        let b: Vec<f32> = (0..rows * rank).map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.1).collect();
        let a: Vec<f32> = (0..rank * cols).map(|i| ((i * 5 % 11) as f32 - 5.0) * 0.03).collect();
        let got = compose_low_rank(&b, &a, rows, rank, cols);
        for (i, j) in [(0, 0), (17, 4095), (63, 1234)] {
            let want = (0..rank).fold(0.0f32, |s, k| s + b[i * rank + k] * a[k * cols + j]);
            assert_eq!(got[i * cols + j].to_bits(), want.to_bits());
        }
    }
}
