//! [`StateCache`]: the per-request state a KDA layer carries between steps, owned by the caller
//! (the engine), indexed by slot.
//!
//! Per slot: the recurrent state, v-first fp32 `[lh, V, K]` (`docs/design/kda.md#state-layout`),
//! and the conv state, fp32 `[W - 1 + num_spec, 3 lp]`: the last inputs of q, k and v,
//! with `num_spec` spare rows so a speculative step can keep the history of whichever token the
//! next step accepts (see [`kda_core::kda::conv`]).

use kda_core::device::Device;
use kda_core::dtype::DType;
use kda_core::error::{Error, Result};
use kda_core::hal::Backend;
use kda_core::op::Op;
use kda_core::tensor::Tensor;

use super::batch::CacheLimits;

/// The sizes of one layer's cache on one rank.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct CacheDims {
    /// State slots `N`.
    pub slots: usize,
    /// Local heads `lh`.
    pub heads: usize,
    /// Head dim `D` (= K = V).
    pub head_dim: usize,
    /// Conv width `W`.
    pub conv_width: usize,
    /// Speculative tokens per step the conv state has room for (0 without speculative decoding).
    pub num_spec: usize,
}

impl CacheDims {
    /// `[N, lh, V, K]`.
    pub fn recurrent_shape(&self) -> [usize; 4] {
        [self.slots, self.heads, self.head_dim, self.head_dim]
    }

    /// `[N, W - 1 + num_spec, 3 lp]`.
    pub fn conv_shape(&self) -> [usize; 3] {
        let rows = self.conv_width.saturating_sub(1) + self.num_spec;
        [self.slots, rows, 3 * self.heads * self.head_dim]
    }
}

/// One layer's state cache: slots of recurrent and conv state (see the module docs).
#[derive(Clone, Debug)]
pub struct StateCache<B: Backend> {
    dims: CacheDims,
    recurrent: Tensor<B>,
    conv: Tensor<B>,
}

impl<B: Backend> StateCache<B> {
    /// A zeroed cache of `dims`, filled on `stream`.
    pub fn new(device: &Device<B>, stream: &B::Stream, dims: CacheDims) -> Result<Self> {
        if dims.slots == 0 || dims.heads == 0 || dims.head_dim == 0 || dims.conv_width == 0 {
            return Err(Error::Param {
                op: "state cache",
                param: "dims",
                expected: "slots, heads, head_dim and conv_width all at least 1".into(),
                actual: format!("{dims:?}"),
            });
        }
        // The conv state's rows, `W - 1 + num_spec`, must not wrap: a wrapped count would make
        // a cache too small for the `num_spec` it reports.
        if dims.num_spec.checked_add(dims.conv_width - 1).is_none() {
            return Err(Error::Param {
                op: "state cache",
                param: "num_spec",
                expected: format!(
                    "at most {} (the conv state's W - 1 + num_spec rows must fit a usize)",
                    usize::MAX - (dims.conv_width - 1)
                ),
                actual: dims.num_spec.to_string(),
            });
        }
        let recurrent = device.alloc(DType::F32, &dims.recurrent_shape())?;
        let conv = device.alloc(DType::F32, &dims.conv_shape())?;
        for t in [&recurrent, &conv] {
            device.launch(stream, Op::Fill { dst: t.clone(), value: 0.0 })?;
        }
        Ok(Self { dims, recurrent, conv })
    }

    /// A cache over state tensors someone else allocated (an engine's cache, used in place):
    /// `recurrent` viewed as `[N, lh, V, K]` f32 and `conv` as `[N, W - 1 + num_spec, 3 lp]`
    /// (f32, bf16 or f16), each with any non-overlapping strides (the engine's layout, described
    /// by the view). Nothing is filled: the states are the engine's.
    pub fn wrap(dims: CacheDims, recurrent: Tensor<B>, conv: Tensor<B>) -> Result<Self> {
        const OP: &str = "state cache";
        if dims.slots == 0 || dims.heads == 0 || dims.head_dim == 0 || dims.conv_width == 0 {
            return Err(Error::Param {
                op: OP,
                param: "dims",
                expected: "slots, heads, head_dim and conv_width all at least 1".into(),
                actual: format!("{dims:?}"),
            });
        }
        for (param, t, shape, dtypes) in [
            ("recurrent", &recurrent, &dims.recurrent_shape()[..], &[DType::F32][..]),
            ("conv", &conv, &dims.conv_shape()[..], &[DType::F32, DType::BF16, DType::F16][..]),
        ] {
            if t.shape() != shape {
                return Err(Error::Shape {
                    op: OP,
                    param,
                    expected: format!("{shape:?}"),
                    actual: t.shape().to_vec(),
                });
            }
            if !dtypes.contains(&t.dtype()) {
                let names: Vec<&str> = dtypes.iter().map(|d| d.name()).collect();
                return Err(Error::DType {
                    op: OP,
                    param,
                    expected: names.join(" or "),
                    actual: t.dtype(),
                });
            }
            if !t.layout().is_non_overlapping() {
                return Err(Error::Param {
                    op: OP,
                    param,
                    expected: "a view whose elements do not overlap".into(),
                    actual: format!("strides {:?}", t.layout().strides()),
                });
            }
        }
        if recurrent.overlaps(&conv) {
            return Err(Error::Param {
                op: OP,
                param: "conv",
                expected: "memory apart from the recurrent state".into(),
                actual: "the two states overlap".into(),
            });
        }
        Ok(Self { dims, recurrent, conv })
    }

    pub fn dims(&self) -> CacheDims {
        self.dims
    }

    /// The recurrent states `[N, lh, V, K]` f32, v-first.
    pub fn recurrent(&self) -> &Tensor<B> {
        &self.recurrent
    }

    /// The conv states `[N, W - 1 + num_spec, 3 lp]` (f32; f32, bf16 or f16 in a wrapped cache).
    pub fn conv(&self) -> &Tensor<B> {
        &self.conv
    }

    /// Slot `slot`'s recurrent state `[lh, V, K]` (a view).
    pub fn recurrent_slot(&self, slot: usize) -> Result<Tensor<B>> {
        self.recurrent.narrow(0, slot, 1)?.reshape(&self.recurrent.shape()[1..])
    }

    /// Slot `slot`'s conv state `[W - 1 + num_spec, 3 lp]` (a view).
    pub fn conv_slot(&self, slot: usize) -> Result<Tensor<B>> {
        self.conv.narrow(0, slot, 1)?.reshape(&self.conv.shape()[1..])
    }

    pub(crate) fn limits(&self) -> CacheLimits {
        CacheLimits { slots: self.dims.slots, num_spec: self.dims.num_spec }
    }

    /// Whether `t` shares bytes with either state tensor.
    pub(crate) fn overlaps(&self, t: &Tensor<B>) -> bool {
        [&self.recurrent, &self.conv].into_iter().any(|s| s.overlaps(t))
    }

    pub(crate) fn buffers(&self) -> [&B::Buffer; 2] {
        [self.recurrent.buffer(), self.conv.buffer()]
    }

    /// The cache must have been made for a layer of these sizes.
    pub(crate) fn check(&self, heads: usize, head_dim: usize, conv_width: usize) -> Result<()> {
        let d = self.dims;
        if (d.heads, d.head_dim, d.conv_width) != (heads, head_dim, conv_width) {
            return Err(Error::Param {
                op: "kda_layer",
                param: "cache",
                expected: format!(
                    "a cache for {heads} local heads of dim {head_dim}, conv width {conv_width}"
                ),
                actual: format!(
                    "{} heads of dim {}, conv width {}",
                    d.heads, d.head_dim, d.conv_width
                ),
            });
        }
        Ok(())
    }
}
