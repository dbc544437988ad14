//! [`ConvWeights`]: the q, k and v short-conv weights of one TP rank, packed once, in place, into
//! the kernel layout `[W, 3 * lp]` (`docs/design/kda.md#behaviour-13`).
//!
//! Checkpoints store each conv as `[P, 1, W]` or `[P, W]` (channel-major). Loading writes this
//! rank's channels into the fused channel-major buffer `[3 lp, W]` (`[q | k | v]`);
//! [`ConvWeights::pack`] then transposes that buffer to `[W, 3 lp]` in the same allocation, once:
//! a second call does nothing, and anything that kept the buffer's address (a device upload, a
//! captured graph) still sees the weights. A source reloaded after packing is written straight
//! into the packed layout, so reloads work in both states.

use super::host::{HostTensor, zeroed};
use super::qkv::QkvPart;
use super::source::TensorRead;
use super::{WeightError, fmt_shape};
use crate::config::LayerDims;

/// Where the fused conv weights are.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum ConvLayout {
    /// `[3 lp, W]`: as loaded.
    Channels,
    /// `[W, 3 lp]`: what the kernels read.
    Kernel,
}

/// The fused conv weights `[q | k | v]` of one rank, f32.
#[derive(Clone, Debug, PartialEq)]
pub struct ConvWeights {
    channels: usize,
    width: usize,
    local_proj: usize,
    layout: ConvLayout,
    /// Allocated on the first load.
    data: Vec<f32>,
    loaded: [bool; 3],
    dims: LayerDims,
}

impl ConvWeights {
    pub fn new(dims: LayerDims) -> Self {
        ConvWeights {
            channels: dims.qkv_width(),
            width: dims.conv_width,
            local_proj: dims.local_proj,
            layout: ConvLayout::Channels,
            data: Vec::new(),
            loaded: [false; 3],
            dims,
        }
    }

    pub fn layout(&self) -> ConvLayout {
        self.layout
    }

    /// The shape of [`ConvWeights::data`] in its current layout.
    pub fn shape(&self) -> [usize; 2] {
        match self.layout {
            ConvLayout::Channels => [self.channels, self.width],
            ConvLayout::Kernel => [self.width, self.channels],
        }
    }

    /// The weights in the current layout (empty before the first load).
    pub fn data(&self) -> &[f32] {
        &self.data
    }

    /// The weights as a host tensor in the current layout.
    pub fn to_tensor(&self) -> Result<HostTensor, WeightError> {
        HostTensor::from_f32(&self.shape(), self.data.clone())
    }

    /// Parts not loaded yet.
    pub fn missing(&self) -> Vec<QkvPart> {
        QkvPart::ALL.into_iter().filter(|p| !self.loaded[p.index()]).collect()
    }

    /// `q_conv1d.weight` (or k, v): `[P, 1, W]` or `[P, W]`, any float (f32 in checkpoints).
    pub fn load(&mut self, part: QkvPart, t: &dyn TensorRead) -> Result<(), WeightError> {
        let param = part.conv_suffix();
        let (p, w) = (self.dims.proj, self.width);
        if !t.dtype().is_float() {
            return Err(WeightError::dtype(param, "f32 (or bf16, f16)", t.dtype()));
        }
        let rows = self.dims.proj_range();
        let region = match t.shape() {
            s if s == [p, 1, w] => vec![rows, 0..1, 0..w],
            s if s == [p, w] => vec![rows, 0..w],
            other => {
                return Err(WeightError::shape(
                    param,
                    format!(
                        "{} or {} [num_heads * head_dim, (1,) conv width]",
                        fmt_shape(&[p, 1, w]),
                        fmt_shape(&[p, w])
                    ),
                    other,
                ));
            }
        };
        let values = t.read(&region)?.float_values(param)?;
        if self.data.is_empty() {
            self.data = zeroed(param, self.channels * w)?;
        }
        let base = part.index() * self.local_proj;
        for (c, row) in values.chunks_exact(w).enumerate() {
            for (j, &v) in row.iter().enumerate() {
                let at = match self.layout {
                    ConvLayout::Channels => (base + c) * w + j,
                    ConvLayout::Kernel => j * self.channels + base + c,
                };
                self.data[at] = v;
            }
        }
        self.loaded[part.index()] = true;
        Ok(())
    }

    /// Transpose `[3 lp, W]` to `[W, 3 lp]` in place (the same allocation). Returns whether it
    /// packed: `false` when already packed or nothing is loaded.
    pub fn pack(&mut self) -> bool {
        if self.layout == ConvLayout::Kernel || self.data.is_empty() {
            return false;
        }
        let (c, w) = (self.channels, self.width);
        // The buffer is small (3 lp x W floats); a scratch copy keeps the transpose obvious,
        // and writing back keeps the allocation.
        let scratch = self.data.clone();
        for ch in 0..c {
            for j in 0..w {
                self.data[j * c + ch] = scratch[ch * w + j];
            }
        }
        self.layout = ConvLayout::Kernel;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Tp, tiny_config};
    use kda_core::dtype::DType;

    fn dims() -> LayerDims {
        tiny_config(8).dims(Tp::new(2, 1).unwrap()).unwrap()
    }

    /// Conv part `p`, channel `c` (global), tap `j` has value `100 p + 10 c + j`.
    fn source(p: usize, three_d: bool) -> HostTensor {
        let v: Vec<f32> = (0..8 * 3).map(|i| (100 * p + 10 * (i / 3) + i % 3) as f32).collect();
        let shape: &[usize] = if three_d { &[8, 1, 3] } else { &[8, 3] };
        HostTensor::from_f32(shape, v).unwrap()
    }

    /// Behaviour 13 (`docs/design/kda.md#behaviour-13`): packed once into `[W, 3 lp]`, in place.
    #[test]
    fn behaviour_13_conv_packed_once_in_place() {
        let mut conv = ConvWeights::new(dims());
        assert!(!conv.pack(), "nothing to pack before loading");
        for part in QkvPart::ALL {
            conv.load(part, &source(part.index(), part != QkvPart::K)).unwrap();
        }
        assert!(conv.missing().is_empty());
        assert_eq!((conv.layout(), conv.shape()), (ConvLayout::Channels, [12, 3]));
        let before = conv.data().as_ptr();
        assert!(conv.pack());
        assert_eq!((conv.layout(), conv.shape()), (ConvLayout::Kernel, [3, 12]));
        assert_eq!(conv.data().as_ptr(), before, "packed in the same allocation");
        // Rank 1 of 2 owns global channels 4..8; local channel c of part p is fused column 4p + c.
        for j in 0..3 {
            for p in 0..3 {
                for c in 0..4 {
                    let want = (100 * p + 10 * (4 + c) + j) as f32;
                    assert_eq!(
                        conv.data()[j * 12 + 4 * p + c],
                        want,
                        "tap {j} part {p} channel {c}"
                    );
                }
            }
        }
        let packed = conv.data().to_vec();
        assert!(!conv.pack(), "packing twice is a no-op");
        assert_eq!(conv.data(), &packed[..]);
        // A reload after packing lands in the packed layout.
        conv.load(QkvPart::K, &source(1, true)).unwrap();
        assert_eq!(conv.data(), &packed[..]);
    }

    #[test]
    fn bad_conv_sources_are_named() {
        let mut conv = ConvWeights::new(dims());
        let e = conv
            .load(QkvPart::V, &HostTensor::from_f32(&[8, 4], vec![0.0; 32]).unwrap())
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "v_conv1d.weight: shape [8, 4], expected [8, 1, 3] or [8, 3] [num_heads * head_dim, (1,) conv width]"
        );
        let bytes = HostTensor::from_bytes(DType::U8, &[8, 3], vec![0; 24]).unwrap();
        assert!(conv.load(QkvPart::Q, &bytes).unwrap_err().to_string().contains("dtype u8"));
        assert_eq!(conv.missing().len(), 3);
    }
}
