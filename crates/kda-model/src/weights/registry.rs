//! The parameter registry: every checkpoint name of a KDA layer maps to exactly one loader.
//!
//! Names are `model.layers.{i}.self_attn.<suffix>` ([`layer_prefix`]); [`route`] splits a name
//! into its layer and [`Param`] (or says it belongs to no KDA parameter, and passes it through
//! unchanged). [`LayerLoader`] holds one layer's partial state and accepts its tensors in any
//! order, any number of times; [`LayerLoader::finish`] fails with **one** error listing every
//! missing name, then packs the conv weights. [`load_layer`] drives it over a [`TensorSource`]
//! and reports the layer's names no loader claims.

use std::collections::BTreeSet;

use super::WeightError;
use super::bfg::{BfgBlock, BfgMode, BfgSource, FusedBfgLinear};
use super::conv::ConvWeights;
use super::host::HostTensor;
use super::params::{self, load_a_log, load_dt_bias, load_o_norm, load_o_proj};
use super::qkv::{FusedQkv, QkvPart};
use super::source::{TensorRead, TensorSource};
use crate::config::{KdaConfig, LayerDims, QkvFormat, Tp};
use kda_core::dtype::DType;
use kda_core::kda::GateForm;

/// The checkpoint prefix of layer `layer`: `model.layers.{layer}.self_attn.`.
pub fn layer_prefix(layer: usize) -> String {
    format!("model.layers.{layer}.self_attn.")
}

/// A parameter of a KDA layer, one per checkpoint suffix.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Param {
    Weight(QkvPart),
    Scale(QkvPart),
    Bfg(BfgSource),
    Conv(QkvPart),
    ALog,
    DtBias,
    ONorm,
    OProj,
}

/// Where a parameter's rows end up.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Target {
    /// A part of the fused QKV weight (`scale`: its MXFP8 scales).
    Qkv {
        part: QkvPart,
        scale: bool,
    },
    /// The fused BFG linear.
    Bfg(BfgTarget),
    /// A part of the fused conv weights.
    Conv(QkvPart),
    ALog,
    DtBias,
    ONorm,
    OProj,
}

/// Where a BFG source goes: straight into a block of the packed weight, or into staging to be
/// composed into one.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum BfgTarget {
    /// Rows of a full-rank block (`b_proj` → shard 0, `g_proj` → shard 2).
    Shard(BfgBlock),
    /// A low-rank factor (`f_a`, `f_b`, `g_a`, `g_b`), composed into `into`.
    Staging { source: BfgSource, into: BfgBlock },
}

impl Param {
    /// Every parameter.
    pub const ALL: [Param; 19] = [
        Param::Weight(QkvPart::Q),
        Param::Weight(QkvPart::K),
        Param::Weight(QkvPart::V),
        Param::Scale(QkvPart::Q),
        Param::Scale(QkvPart::K),
        Param::Scale(QkvPart::V),
        Param::Bfg(BfgSource::B),
        Param::Bfg(BfgSource::FA),
        Param::Bfg(BfgSource::FB),
        Param::Bfg(BfgSource::G),
        Param::Bfg(BfgSource::GA),
        Param::Bfg(BfgSource::GB),
        Param::Conv(QkvPart::Q),
        Param::Conv(QkvPart::K),
        Param::Conv(QkvPart::V),
        Param::ALog,
        Param::DtBias,
        Param::ONorm,
        Param::OProj,
    ];

    /// The checkpoint name after the layer prefix.
    pub const fn suffix(self) -> &'static str {
        match self {
            Param::Weight(p) => p.weight_suffix(),
            Param::Scale(p) => p.scale_suffix(),
            Param::Bfg(s) => s.suffix(),
            Param::Conv(p) => p.conv_suffix(),
            Param::ALog => params::A_LOG,
            Param::DtBias => params::DT_BIAS,
            Param::ONorm => params::O_NORM,
            Param::OProj => params::O_PROJ,
        }
    }

    /// The parameter with checkpoint suffix `suffix`.
    pub fn from_suffix(suffix: &str) -> Option<Param> {
        Param::ALL.into_iter().find(|p| p.suffix() == suffix)
    }

    /// Where its rows go.
    pub const fn target(self) -> Target {
        match self {
            Param::Weight(part) => Target::Qkv { part, scale: false },
            Param::Scale(part) => Target::Qkv { part, scale: true },
            Param::Bfg(BfgSource::B) => Target::Bfg(BfgTarget::Shard(BfgBlock::Beta)),
            Param::Bfg(BfgSource::G) => Target::Bfg(BfgTarget::Shard(BfgBlock::Gate)),
            Param::Bfg(source @ (BfgSource::FA | BfgSource::FB)) => {
                Target::Bfg(BfgTarget::Staging { source, into: BfgBlock::Forget })
            }
            Param::Bfg(source @ (BfgSource::GA | BfgSource::GB)) => {
                Target::Bfg(BfgTarget::Staging { source, into: BfgBlock::Gate })
            }
            Param::Conv(part) => Target::Conv(part),
            Param::ALog => Target::ALog,
            Param::DtBias => Target::DtBias,
            Param::ONorm => Target::ONorm,
            Param::OProj => Target::OProj,
        }
    }
}

/// What a checkpoint name is to the KDA loader.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Route<'a> {
    /// A parameter of a KDA layer.
    Param { layer: usize, param: Param },
    /// Under a layer's `self_attn.` prefix, but no KDA parameter (reported, not loaded).
    Unknown { layer: usize, suffix: &'a str },
    /// Anything else (embeddings, MLPs, other modules), unchanged.
    PassThrough(&'a str),
}

/// Route one checkpoint name.
pub fn route(name: &str) -> Route<'_> {
    let parsed = name.strip_prefix("model.layers.").and_then(|rest| {
        let (index, rest) = rest.split_once('.')?;
        // Only canonical decimal indices: "03" or "+3" would alias another layer's name.
        if index.is_empty()
            || !index.bytes().all(|b| b.is_ascii_digit())
            || (index.len() > 1 && index.starts_with('0'))
        {
            return None;
        }
        let layer: usize = index.parse().ok()?;
        Some((layer, rest.strip_prefix("self_attn.")?))
    });
    match parsed {
        Some((layer, suffix)) => match Param::from_suffix(suffix) {
            Some(param) => Route::Param { layer, param },
            None => Route::Unknown { layer, suffix },
        },
        None => Route::PassThrough(name),
    }
}

/// Choices a loader makes that the checkpoint does not.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct LoadOptions {
    /// Dtype of the dense weights (fused BFG, dense QKV, `o_proj`): bf16, f16 or f32.
    pub weight_dtype: DType,
    pub bfg_mode: BfgMode,
    /// Unknown names under the layer's prefix are an error instead of a report.
    pub strict: bool,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions { weight_dtype: DType::BF16, bfg_mode: BfgMode::Composed, strict: false }
    }
}

/// One rank's weights of one KDA layer, complete and checked.
///
/// The components keep their loaders: a source reloaded later (say
/// `weights.bfg.load_f_a(&new_f_a)`) is checked the same way and recomposes the fused weight in
/// place.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerWeights {
    pub layer: usize,
    pub dims: LayerDims,
    pub gate: GateForm,
    /// The output norm's epsilon, from the config (`docs/design/kda.md#behaviour-3`).
    pub rms_norm_eps: f64,
    pub qkv: FusedQkv,
    pub bfg: FusedBfgLinear,
    /// Packed into the kernel layout `[W, 3 lp]`.
    pub conv: ConvWeights,
    /// `[lh]` f32.
    pub a_log: HostTensor,
    /// `[lp]` f32.
    pub dt_bias: HostTensor,
    /// `[D]` f32.
    pub o_norm: HostTensor,
    /// `[Hd, lp]` in the weight dtype.
    pub o_proj: HostTensor,
}

/// One layer's loading state: feed it tensors in any order, then [`LayerLoader::finish`].
#[derive(Clone, Debug)]
pub struct LayerLoader {
    layer: usize,
    prefix: String,
    dims: LayerDims,
    gate: GateForm,
    rms_norm_eps: f64,
    options: LoadOptions,
    qkv: FusedQkv,
    bfg: FusedBfgLinear,
    conv: ConvWeights,
    a_log: Option<HostTensor>,
    dt_bias: Option<HostTensor>,
    o_norm: Option<HostTensor>,
    o_proj: Option<HostTensor>,
}

impl LayerLoader {
    /// A loader for layer `layer` at TP position `tp`. The fused BFG weight starts without
    /// storage (the meta-device path; see [`FusedBfgLinear::deferred`]), so nothing large is
    /// allocated before a checkpoint tensor of the matching shape has been seen.
    pub fn new(
        config: &KdaConfig,
        tp: Tp,
        layer: usize,
        options: LoadOptions,
    ) -> Result<LayerLoader, WeightError> {
        let dims = config.dims(tp)?;
        let (gate, eps) = (config.gate_form(), config.rms_norm_eps);
        LayerLoader::fresh(layer, dims, gate, eps, config.qkv_format(), options)
    }

    fn fresh(
        layer: usize,
        dims: LayerDims,
        gate: GateForm,
        rms_norm_eps: f64,
        qkv_format: QkvFormat,
        options: LoadOptions,
    ) -> Result<LayerLoader, WeightError> {
        Ok(LayerLoader {
            layer,
            prefix: layer_prefix(layer),
            dims,
            gate,
            rms_norm_eps,
            options,
            qkv: FusedQkv::new(dims, qkv_format, options.weight_dtype)?,
            bfg: FusedBfgLinear::deferred(dims, options.weight_dtype, options.bfg_mode)?,
            conv: ConvWeights::new(dims),
            a_log: None,
            dt_bias: None,
            o_norm: None,
            o_proj: None,
        })
    }

    /// A loader of the same layer with nothing loaded (and so no storage).
    fn empty(&self) -> Result<LayerLoader, WeightError> {
        let (gate, eps, format) = (self.gate, self.rms_norm_eps, self.qkv.format());
        LayerLoader::fresh(self.layer, self.dims, gate, eps, format, self.options)
    }

    /// Check `t`'s dtype and shape for `param` exactly as [`LayerLoader::load`] would, without
    /// reading a byte of it or allocating anything: every loader checks before it reads, so
    /// running one on a fresh loader over a tensor that refuses to be read stops right there.
    pub fn check(&self, param: Param, t: &dyn TensorRead) -> Result<(), WeightError> {
        let read = std::cell::Cell::new(false);
        let probe = Guarded { inner: t, guard: Guard::ShapeOnly(read) };
        let result = self.empty()?.load_unprefixed(param, &probe);
        match (result, probe.guard) {
            (Err(_), Guard::ShapeOnly(read)) if read.get() => Ok(()),
            (result, _) => result.map_err(|e| e.with_prefix(&self.prefix)),
        }
    }

    pub fn dims(&self) -> &LayerDims {
        &self.dims
    }

    /// The fused BFG linear as loaded so far.
    pub fn bfg(&self) -> &FusedBfgLinear {
        &self.bfg
    }

    /// Load `param` from `t`; errors carry the parameter's full checkpoint name. Every value
    /// read is checked: a NaN or infinity (or a NaN E4M3 or E8M0 byte) is an error naming the
    /// tensor and the first bad element's flat index, not a NaN output later.
    pub fn load(&mut self, param: Param, t: &dyn TensorRead) -> Result<(), WeightError> {
        let finite = Guarded { inner: t, guard: Guard::Finite(param) };
        self.load_unprefixed(param, &finite).map_err(|e| e.with_prefix(&self.prefix))
    }

    fn load_unprefixed(&mut self, param: Param, t: &dyn TensorRead) -> Result<(), WeightError> {
        let d = self.dims;
        match param {
            Param::Weight(part) => self.qkv.load_weight(part, t),
            Param::Scale(part) => self.qkv.load_scale(part, t),
            Param::Bfg(source) => self.bfg.load(source, t),
            Param::Conv(part) => self.conv.load(part, t),
            Param::ALog => {
                self.a_log = Some(load_a_log(&d, t)?);
                Ok(())
            }
            Param::DtBias => {
                self.dt_bias = Some(load_dt_bias(&d, t)?);
                Ok(())
            }
            Param::ONorm => {
                self.o_norm = Some(load_o_norm(&d, t)?);
                Ok(())
            }
            Param::OProj => {
                self.o_proj = Some(load_o_proj(&d, self.options.weight_dtype, t)?);
                Ok(())
            }
        }
    }

    /// Every name this layer still needs, in full, sorted.
    pub fn missing(&self) -> Vec<String> {
        let mut m: BTreeSet<&'static str> = BTreeSet::new();
        m.extend(self.qkv.missing());
        m.extend(self.bfg.missing().into_iter().map(BfgSource::suffix));
        m.extend(self.conv.missing().into_iter().map(QkvPart::conv_suffix));
        for (slot, name) in [
            (&self.a_log, params::A_LOG),
            (&self.dt_bias, params::DT_BIAS),
            (&self.o_norm, params::O_NORM),
            (&self.o_proj, params::O_PROJ),
        ] {
            if slot.is_none() {
                m.insert(name);
            }
        }
        m.into_iter().map(|s| format!("{}{s}", self.prefix)).collect()
    }

    /// The finished layer, or one error listing every missing name. Composes anything still
    /// pending (a no-op when every source arrived through the loaders) and packs the conv
    /// weights into the kernel layout.
    pub fn finish(mut self) -> Result<LayerWeights, WeightError> {
        let missing = self.missing();
        if !missing.is_empty() {
            return Err(WeightError::Missing { layer: self.layer, names: missing });
        }
        self.bfg.materialize().map_err(|e| e.with_prefix(&self.prefix))?;
        if !self.bfg.is_composed() {
            return Err(WeightError::value(
                &format!("{}f_b_proj.weight", self.prefix),
                "the fused BFG weight was not composed from the loaded factors",
            ));
        }
        self.conv.pack();
        let missing = || WeightError::Missing { layer: self.layer, names: Vec::new() };
        Ok(LayerWeights {
            layer: self.layer,
            dims: self.dims,
            gate: self.gate,
            rms_norm_eps: self.rms_norm_eps,
            a_log: self.a_log.ok_or_else(missing)?,
            dt_bias: self.dt_bias.ok_or_else(missing)?,
            o_norm: self.o_norm.ok_or_else(missing)?,
            o_proj: self.o_proj.ok_or_else(missing)?,
            qkv: self.qkv,
            bfg: self.bfg,
            conv: self.conv,
        })
    }
}

/// A loaded layer and the names under its prefix that no loader claimed.
#[derive(Clone, Debug)]
pub struct LoadedLayer {
    pub weights: LayerWeights,
    pub unknown: Vec<String>,
}

/// Load layer `layer` for TP position `tp` from `source`: every name of the layer goes to its
/// loader (in the source's order), then [`LayerLoader::finish`].
pub fn load_layer(
    source: &dyn TensorSource,
    config: &KdaConfig,
    tp: Tp,
    layer: usize,
    options: LoadOptions,
) -> Result<LoadedLayer, WeightError> {
    let mut loader = LayerLoader::new(config, tp, layer, options)?;
    let mut unknown = Vec::new();
    let mut params = Vec::new();
    for name in source.names() {
        match route(&name) {
            Route::Param { layer: l, param } if l == layer => params.push((name, param)),
            Route::Unknown { layer: l, .. } if l == layer => unknown.push(name.clone()),
            _ => {}
        }
    }
    // Everything that can be checked without reading, before anything is read or allocated:
    // the fused weights' storage is sized by the config, so a config the checkpoint does not
    // back (a wrong head_dim, tensors missing) must fail before it is allocated. First every
    // tensor's dtype and shape, then the names the layer needs (a weight stored as E4M3 bytes
    // needs its scale).
    let mut needed = loader.missing();
    for (name, param) in &params {
        let tensor = source.tensor(name)?;
        loader.check(*param, &*tensor)?;
        if let Param::Weight(part) = param
            && loader.qkv.is_stored_quantized(tensor.dtype())
        {
            needed.push(format!("{}{}", loader.prefix, part.scale_suffix()));
        }
    }
    let mut absent: Vec<String> =
        needed.into_iter().filter(|n| !params.iter().any(|(p, _)| p == n)).collect();
    absent.sort();
    absent.dedup();
    if !absent.is_empty() {
        return Err(WeightError::Missing { layer, names: absent });
    }
    for (name, param) in params {
        let tensor = source.tensor(&name)?;
        loader.load(param, &*tensor)?;
    }
    if !unknown.is_empty() {
        if options.strict {
            return Err(WeightError::Unknown { layer, names: unknown });
        }
        tracing::warn!(layer, names = ?unknown, "checkpoint names no KDA loader claims");
    }
    Ok(LoadedLayer { weights: loader.finish()?, unknown })
}

/// A checkpoint tensor as a loader sees it: dtype and shape as stored, reads guarded.
#[derive(Debug)]
struct Guarded<'a> {
    inner: &'a dyn TensorRead,
    guard: Guard,
}

#[derive(Debug)]
enum Guard {
    /// Refuse every read, and remember being asked ([`LayerLoader::check`]).
    ShapeOnly(std::cell::Cell<bool>),
    /// Check every region read for values no weight of `Param` can hold
    /// ([`HostTensor::first_non_finite`]).
    Finite(Param),
}

impl TensorRead for Guarded<'_> {
    fn dtype(&self) -> DType {
        self.inner.dtype()
    }

    fn shape(&self) -> &[usize] {
        self.inner.shape()
    }

    fn read(&self, region: &[std::ops::Range<usize>]) -> Result<HostTensor, WeightError> {
        let param = match &self.guard {
            Guard::ShapeOnly(read) => {
                read.set(true);
                return Err(WeightError::value("shape check", "not read"));
            }
            Guard::Finite(param) => *param,
        };
        let values = self.inner.read(region)?;
        // Checkpoints store MXFP8 bytes as u8 as often as under their own dtypes.
        let meaning = match (param, values.dtype()) {
            (Param::Weight(_), DType::U8) => DType::E4M3,
            (Param::Scale(_), DType::U8) => DType::E8M0,
            (_, dtype) => dtype,
        };
        match values.first_non_finite(meaning) {
            None => Ok(values),
            Some((local, value)) => Err(WeightError::NonFinite {
                param: param.suffix().to_string(),
                index: flat_index(self.inner.shape(), region, local),
                value,
            }),
        }
    }
}

/// The flat row-major index in a tensor of `shape` of element `local` of its sub-tensor
/// `region`.
fn flat_index(shape: &[usize], region: &[std::ops::Range<usize>], mut local: usize) -> usize {
    let mut index = 0;
    let mut stride = 1;
    for (r, &size) in region.iter().zip(shape).rev() {
        let len = r.len().max(1);
        index += (r.start + local % len) * stride;
        local /= len;
        stride *= size;
    }
    index
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flat_indices_of_region_elements() {
        // Element 4 of rows 2..4, columns 1..4 of a [5, 6] tensor is [3, 2]: 3 * 6 + 2.
        assert_eq!(flat_index(&[5, 6], &[2..4, 1..4], 4), 20);
        assert_eq!(flat_index(&[7, 2], &[0..7, 1..2], 5), 11);
        assert_eq!(flat_index(&[2, 3, 4], &[1..2, 0..3, 2..4], 3), 12 + 4 + 3);
    }

    /// Behaviour 14 (`docs/design/kda.md#behaviour-14`): checkpoint remap.
    #[test]
    fn behaviour_14_checkpoint_routing() {
        let p = |suffix: &str| format!("model.layers.3.self_attn.{suffix}");
        let target = |suffix: &str| match route(&p(suffix)) {
            Route::Param { layer: 3, param } => param.target(),
            other => panic!("{suffix}: {other:?}"),
        };
        assert_eq!(target("b_proj.weight"), Target::Bfg(BfgTarget::Shard(BfgBlock::Beta)));
        assert_eq!(BfgBlock::Beta.shard_id(), 0);
        assert_eq!(
            target("f_a_proj.weight"),
            Target::Bfg(BfgTarget::Staging { source: BfgSource::FA, into: BfgBlock::Forget })
        );
        assert_eq!(
            target("f_b_proj.weight"),
            Target::Bfg(BfgTarget::Staging { source: BfgSource::FB, into: BfgBlock::Forget })
        );
        assert_eq!(target("g_proj.weight"), Target::Bfg(BfgTarget::Shard(BfgBlock::Gate)));
        assert_eq!(BfgBlock::Gate.shard_id(), 2);
        assert_eq!(target("q_proj.weight_scale"), Target::Qkv { part: QkvPart::Q, scale: true });
        assert_eq!(target("v_conv1d.weight"), Target::Conv(QkvPart::V));
        for unrelated in [
            "model.embed_tokens.weight",
            "model.layers.3.mlp.gate_proj.weight",
            "model.layers.03.self_attn.b_proj.weight",
            "model.layers.x.self_attn.b_proj.weight",
            "lm_head.weight",
            "model.layers.99999999999999999999999.self_attn.A_log",
        ] {
            assert_eq!(route(unrelated), Route::PassThrough(unrelated));
        }
        assert_eq!(
            route("model.layers.12.self_attn.rotary.inv_freq"),
            Route::Unknown { layer: 12, suffix: "rotary.inv_freq" }
        );
    }

    #[test]
    fn every_suffix_routes_to_its_own_param() {
        let suffixes: BTreeSet<&str> = Param::ALL.iter().map(|p| p.suffix()).collect();
        assert_eq!(suffixes.len(), Param::ALL.len());
        for p in Param::ALL {
            assert_eq!(
                route(&format!("{}{}", layer_prefix(7), p.suffix())),
                Route::Param { layer: 7, param: p }
            );
        }
    }
}
