//! The engine's state cache, used in place: [`Layer::wrap_cache`] makes a [`Cache`] whose
//! recurrent and conv states are views of the engine's own tensors, in the engine's layout
//! ([`CacheLayout`]), so kda reads and writes them where they lie and copies nothing; and
//! [`Cache::conv_state`], a slot's conv history on any cache.
//!
//! kda's own cache (`kda_model::layer::StateCache`) is token-major f32 conv `[N, W - 1 +
//! num_spec, 3 lp]` and v-first f32 recurrent `[N, lh, V, K]`. The layouts below are the same
//! elements with other strides, so a wrapped cache is a strided view of the engine's tensors,
//! never a second copy of them:
//!
//! - `"vllm"`: vLLM's KDA state per block (`vllm/model_executor/layers/mamba/mamba_utils.py`,
//!   `MambaStateShapeCalculator.kda_state_shape`): the conv state is one tensor of the
//!   layer's `conv_dim = 3 lp` channels, q | k | v (`vllm/model_executor/layers/kda.py` splits
//!   it by `local_projection_size` along the channel dimension), oriented by
//!   `_orient_conv_shape`: `(state_len, dim)` for the default `"SD"` layout, `(dim,
//!   state_len)` for `VLLM_SSM_CONV_STATE_LAYOUT=DS`, with `state_len = W - 1 (+ num_spec)`,
//!   in the model dtype; the recurrent state `[lh, V, K]` f32. Both orientations are told
//!   apart by the tensor's shape (should `W - 1 + num_spec` equal `3 lp`, `"SD"` is taken).
//! - `"transformers"`: transformers' `DynamicCache` for Kimi Linear
//!   (`transformers/cache_utils.py`, `LinearAttentionLayer`; `models/kimi_linear`): conv
//!   `[B, 3 lp, W]` (channels first, the last `W` inputs, of which the last `W - 1` are the
//!   history a step reads) in the model dtype, recurrent `[B, H, K, V]` f32, K first.
//!
//! Every backend takes such views' strides; only the reference backend takes bf16 / f16 conv
//! states (a device backend's conv kernels refuse them with `Unsupported`,
//! `kda_core::kda::require_f32_conv_state`).

use std::sync::{Mutex, PoisonError};

use kda_core::{Backend, DType, Layout, Op, Tensor};
use kda_model::layer::{CacheDims, KdaLayer, StateCache};

use crate::array::{ForeignArray, Import};
use crate::backends::KnownBackend;
use crate::error::{EmbedError, Result};
use crate::layer::{Cache, Caches, Layer, mismatch};
use crate::on_backend;
use crate::runtime::Session;

/// The engine's cache layout (see the module docs).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum CacheLayout {
    /// vLLM's KDA state: conv `[N, W - 1 + num_spec, 3 lp]` (or `[N, 3 lp, W - 1 + num_spec]`),
    /// recurrent `[N, lh, V, K]`.
    Vllm,
    /// transformers' `DynamicCache`: conv `[N, 3 lp, W']` with `W' >= W - 1`, recurrent
    /// `[N, lh, K, V]`.
    Transformers,
}

impl CacheLayout {
    /// `"vllm"` or `"transformers"`.
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "vllm" => Ok(CacheLayout::Vllm),
            "transformers" => Ok(CacheLayout::Transformers),
            other => Err(EmbedError::Argument {
                param: "layout",
                expected: "\"vllm\" or \"transformers\"",
                actual: other.to_string(),
            }),
        }
    }
}

fn shape_error(param: &'static str, actual: &[usize], expected: String) -> EmbedError {
    EmbedError::Array { param, message: format!("shape {actual:?}, expected {expected}") }
}

/// The view of `t`'s elements with `shape` and `strides` (elements), `skip` elements after
/// `t`'s own offset.
fn view<B: Backend>(
    t: &Tensor<B>,
    param: &'static str,
    shape: &[usize],
    strides: &[usize],
    skip: usize,
) -> Result<Tensor<B>> {
    let layout = Layout::strided(t.dtype(), shape, strides, t.layout().offset() + skip)
        .map_err(|e| EmbedError::Array { param, message: e.to_string() })?;
    Ok(Tensor::new(t.buffer().clone(), layout)?)
}

/// The engine's conv state as kda's `[N, W - 1 + num_spec, 3 lp]` view.
fn conv_view<B: Backend>(t: &Tensor<B>, layout: CacheLayout, dims: CacheDims) -> Result<Tensor<B>> {
    const P: &str = "conv_state";
    let [n, rows, channels] = dims.conv_shape();
    let shape = t.shape();
    let e = t.layout().strides();
    let (s0, s1, s2) = (e[0], e[1], e[2]);
    match layout {
        CacheLayout::Vllm if shape == [n, rows, channels] => view(t, P, &[n, rows, channels], e, 0),
        CacheLayout::Vllm if shape == [n, channels, rows] => {
            view(t, P, &[n, rows, channels], &[s0, s2, s1], 0)
        }
        CacheLayout::Vllm => Err(shape_error(
            P,
            shape,
            format!(
                "[{n}, {rows}, {channels}] (\"SD\": slots, W - 1 + num_spec, 3 lp) or \
                 [{n}, {channels}, {rows}] (\"DS\")"
            ),
        )),
        CacheLayout::Transformers => {
            if dims.num_spec != 0 {
                return Err(EmbedError::Argument {
                    param: "num_spec",
                    expected: "0 for the \"transformers\" layout (it has no speculative rows)",
                    actual: dims.num_spec.to_string(),
                });
            }
            if shape.len() != 3 || shape[0] != n || shape[1] != channels || shape[2] < rows {
                return Err(shape_error(
                    P,
                    shape,
                    format!("[{n}, {channels}, W'] with W' >= {rows} (batch, 3 lp, inputs kept)"),
                ));
            }
            // The history is the last W - 1 of the W' inputs kept.
            view(t, P, &[n, rows, channels], &[s0, s2, s1], (shape[2] - rows) * s2)
        }
    }
}

/// The engine's recurrent state as kda's v-first `[N, lh, V, K]` view.
fn recurrent_view<B: Backend>(
    t: &Tensor<B>,
    layout: CacheLayout,
    dims: CacheDims,
) -> Result<Tensor<B>> {
    const P: &str = "recurrent_state";
    let want = dims.recurrent_shape();
    if t.shape() != want {
        let what = match layout {
            CacheLayout::Vllm => "(slots, lh, V, K)",
            CacheLayout::Transformers => "(batch, lh, K, V)",
        };
        return Err(shape_error(P, t.shape(), format!("{want:?} {what}")));
    }
    let e = t.layout().strides();
    match layout {
        CacheLayout::Vllm => view(t, P, &want, e, 0),
        CacheLayout::Transformers => view(t, P, &want, &[e[0], e[1], e[3], e[2]], 0),
    }
}

/// `a` as a tensor of `s`'s device over the engine's memory itself (never a copy).
fn in_place<B: Backend>(s: &Session<B>, a: ForeignArray, param: &'static str) -> Result<Tensor<B>> {
    match a.to_tensor(&s.device, &s.stream, param, false)? {
        (t, Import::InPlace) => Ok(t),
        (_, Import::Copied) => Err(EmbedError::Array {
            param,
            message: format!(
                "must be memory the {} backend uses in place (aligned to 4 bytes, non-negative \
                 strides): kda updates the engine's cache where it lies",
                s.device.info().name
            ),
        }),
    }
}

fn wrap_on<B: Backend>(
    s: &Session<B>,
    layer: &KdaLayer<B>,
    conv: ForeignArray,
    recurrent: ForeignArray,
    layout: CacheLayout,
    num_spec: usize,
) -> Result<StateCache<B>> {
    conv.expect_rank("conv_state", 3, "a rank-3 conv state (see the layout)")?;
    conv.expect_dtype("conv_state", &[DType::F32, DType::BF16, DType::F16])?;
    recurrent.expect_rank("recurrent_state", 4, "a rank-4 recurrent state (see the layout)")?;
    recurrent.expect_dtype("recurrent_state", &[DType::F32])?;
    let slots = conv.shape()[0];
    if recurrent.shape()[0] != slots {
        return Err(shape_error(
            "recurrent_state",
            recurrent.shape(),
            format!("{slots} slots first, as conv_state"),
        ));
    }
    let dims = layer.cache_dims(slots, num_spec);
    let conv = in_place(s, conv, "conv_state")?;
    let recurrent = in_place(s, recurrent, "recurrent_state")?;
    let conv = conv_view(&conv, layout, dims)?;
    let recurrent = recurrent_view(&recurrent, layout, dims)?;
    Ok(StateCache::wrap(dims, recurrent, conv)?)
}

impl Layer {
    /// A cache over the engine's own state tensors, used in place (kda reads and writes them,
    /// never copies them): `conv_state` (f32, bf16 or f16) and `recurrent_state` (f32) in
    /// `layout` (see [`CacheLayout`]), with room for `num_spec` speculative tokens (`"vllm"`
    /// only). The slots are the tensors' first dimension. The engine keeps the tensors alive
    /// and ordered with kda's work, as for any array (`docs/embedding.md`).
    pub fn wrap_cache(
        &self,
        conv_state: ForeignArray,
        recurrent_state: ForeignArray,
        layout: CacheLayout,
        num_spec: usize,
    ) -> Result<Cache> {
        let (c, r, spec) = (conv_state, recurrent_state, num_spec);
        let cache = on_backend!(&*self.runtime.inner, |B, s| {
            let l = B::get(&self.layer)
                .ok_or_else(|| EmbedError::Panic("a layer outside its runtime".into()))?;
            B::wrap::<Caches>(wrap_on(s, l, c, r, layout, spec)?)
        });
        let slots = on_backend!(&cache, |B, c| c.dims().slots);
        Ok(Cache { cache: Mutex::new(cache), slots })
    }
}

fn conv_rows<B: Backend>(
    s: &Session<B>,
    c: &StateCache<B>,
    slot: usize,
) -> Result<(Vec<f32>, [usize; 2])> {
    let d = c.dims();
    let rows = d.conv_width.saturating_sub(1);
    let src = c.conv_slot(slot)?.narrow(0, 0, rows)?;
    let shape = [rows, src.shape()[1]];
    // A converting copy: the engine's state may be bf16, f16 or strided.
    let dst = s.device.alloc(DType::F32, &shape)?;
    s.device.launch(&s.stream, Op::Copy { src, dst: dst.clone() })?;
    Ok((s.device.download::<f32>(&s.stream, &dst)?, shape))
}

impl Cache {
    /// Slot `slot`'s conv history, `[W - 1, 3 lp]` f32 (q | k | v channels, oldest input
    /// first), once kda's own stream has finished (as [`Cache::recurrent_state`]).
    pub fn conv_state(&self, layer: &Layer, slot: usize) -> Result<(Vec<f32>, [usize; 2])> {
        if slot >= self.slots {
            return Err(EmbedError::MetadataValue {
                param: "slot",
                index: 0,
                value: i64::try_from(slot).unwrap_or(i64::MAX),
                expected: format!("< {} (the cache's slots)", self.slots),
            });
        }
        let guard = self.cache.lock().unwrap_or_else(PoisonError::into_inner);
        on_backend!(&*layer.runtime.inner, |B, s| match B::get(&*guard) {
            Some(c) => conv_rows(s, c, slot),
            None => Err(mismatch(&layer.runtime, &guard)),
        })
    }
}
