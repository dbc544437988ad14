//! [`FusedQkv`]: the q, k and v projections of one TP rank in one weight, local rows
//! `[q shard | k shard | v shard]` (`3 * lp` rows of `Hd`), so one GEMM produces `mixed_qkv`.
//!
//! Dense configs keep the weight in the layer's weight dtype. MXFP8 configs keep E4M3 bytes
//! `[3 lp, Hd]` and E8M0 scale bytes `[3 lp, ceil(Hd / 32)]` (the plain layout of
//! [`kda_core::mx`]), from either source a checkpoint may have:
//!
//! - stored quantized: `q_proj.weight` (F8_E4M3 or u8 bytes, `[P, Hd]`) with
//!   `q_proj.weight_scale` (u8 or F8_E8M0, `[P, ceil(Hd / 32)]`), copied as they are;
//! - stored dense (bf16/f16/f32): quantized here with the config's `scale_alg`, by the
//!   codec in [`kda_core::mx`] (the same bytes `kda quant` and DynamicQuant produce). Scales are
//!   per row and per 32 consecutive inputs, so quantizing this rank's rows gives exactly the
//!   rows of the quantized global weight.

use std::ops::Range;

use half::bf16;

use super::host::HostTensor;
use super::source::TensorRead;
use super::{WeightError, expect_shape, fmt_shape, read_rows};
use crate::config::{LayerDims, QkvFormat};
use kda_core::dtype::DType;
use kda_core::mx::{self, ScaleAlg};

/// One of the three projections.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum QkvPart {
    Q,
    K,
    V,
}

impl QkvPart {
    pub const ALL: [QkvPart; 3] = [QkvPart::Q, QkvPart::K, QkvPart::V];

    /// Position in the fused layout (0, 1, 2).
    pub const fn index(self) -> usize {
        match self {
            QkvPart::Q => 0,
            QkvPart::K => 1,
            QkvPart::V => 2,
        }
    }

    /// `q_proj.weight`, ...
    pub const fn weight_suffix(self) -> &'static str {
        match self {
            QkvPart::Q => "q_proj.weight",
            QkvPart::K => "k_proj.weight",
            QkvPart::V => "v_proj.weight",
        }
    }

    /// `q_proj.weight_scale`, ...
    pub const fn scale_suffix(self) -> &'static str {
        match self {
            QkvPart::Q => "q_proj.weight_scale",
            QkvPart::K => "k_proj.weight_scale",
            QkvPart::V => "v_proj.weight_scale",
        }
    }

    /// `q_conv1d.weight`, ...
    pub const fn conv_suffix(self) -> &'static str {
        match self {
            QkvPart::Q => "q_conv1d.weight",
            QkvPart::K => "k_conv1d.weight",
            QkvPart::V => "v_conv1d.weight",
        }
    }
}

/// Where a part's weight came from.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Origin {
    Dense,
    /// E4M3 bytes from the checkpoint; needs its scale.
    Stored,
    /// Dense in the checkpoint, quantized here; brings its own scale.
    QuantizedAtLoad,
}

/// The fused weight, borrowed.
#[derive(Copy, Clone, Debug, PartialEq)]
pub enum QkvWeights<'a> {
    /// `[3 lp, Hd]` in the weight dtype.
    Dense(&'a HostTensor),
    /// `data` E4M3 `[3 lp, Hd]`, `scale` E8M0 `[3 lp, ceil(Hd/32)]`, plain layout.
    Mxfp8 { data: &'a HostTensor, scale: &'a HostTensor, scale_alg: ScaleAlg },
}

/// The fused `[q | k | v]` weight of one TP rank (see the module docs).
#[derive(Clone, Debug, PartialEq)]
pub struct FusedQkv {
    dims: LayerDims,
    format: QkvFormat,
    dtype: DType,
    /// Dense weight or E4M3 bytes; allocated on the first load.
    data: Option<HostTensor>,
    /// E8M0 bytes (MXFP8 only).
    scale: Option<HostTensor>,
    origin: [Option<Origin>; 3],
    scale_loaded: [bool; 3],
}

impl FusedQkv {
    /// An empty fused weight; `dtype` is the dense weight dtype (ignored for MXFP8 data).
    pub fn new(dims: LayerDims, format: QkvFormat, dtype: DType) -> Result<Self, WeightError> {
        if !dtype.is_float() {
            return Err(WeightError::dtype("fused QKV weight", "bf16, f16 or f32", dtype));
        }
        Ok(FusedQkv {
            dims,
            format,
            dtype,
            data: None,
            scale: None,
            origin: [None; 3],
            scale_loaded: [false; 3],
        })
    }

    pub fn format(&self) -> QkvFormat {
        self.format
    }

    /// Rows of `part` in the fused weight.
    pub fn part_rows(&self, part: QkvPart) -> Range<usize> {
        let lp = self.dims.local_proj;
        part.index() * lp..(part.index() + 1) * lp
    }

    /// The fused weight, once every part is loaded.
    pub fn weights(&self) -> Option<QkvWeights<'_>> {
        if !self.missing().is_empty() {
            return None;
        }
        match (self.format, &self.data, &self.scale) {
            (QkvFormat::Dense, Some(d), _) => Some(QkvWeights::Dense(d)),
            (QkvFormat::Mxfp8 { scale_alg }, Some(data), Some(scale)) => {
                Some(QkvWeights::Mxfp8 { data, scale, scale_alg })
            }
            _ => None,
        }
    }

    /// Checkpoint suffixes still needed: every part's weight, and the scale of every part whose
    /// weight was stored quantized.
    pub fn missing(&self) -> Vec<&'static str> {
        let mut m = Vec::new();
        for part in QkvPart::ALL {
            let i = part.index();
            match self.origin[i] {
                None => m.push(part.weight_suffix()),
                Some(Origin::Stored) if !self.scale_loaded[i] => m.push(part.scale_suffix()),
                _ => {}
            }
        }
        m
    }

    /// Whether a weight stored as `dtype` is MXFP8 bytes under this format, and so needs its
    /// `weight_scale`.
    pub fn is_stored_quantized(&self, dtype: DType) -> bool {
        matches!(self.format, QkvFormat::Mxfp8 { .. }) && matches!(dtype, DType::E4M3 | DType::U8)
    }

    /// `q_proj.weight` (or k, v): `[P, Hd]`, dense or E4M3 bytes.
    pub fn load_weight(&mut self, part: QkvPart, t: &dyn TensorRead) -> Result<(), WeightError> {
        let param = part.weight_suffix();
        let d = self.dims;
        let i = part.index();
        let quantized = matches!(t.dtype(), DType::E4M3 | DType::U8);
        let origin = match (self.format, quantized, t.dtype().is_float()) {
            (QkvFormat::Dense, false, true) => Origin::Dense,
            (QkvFormat::Mxfp8 { .. }, false, true) => Origin::QuantizedAtLoad,
            (QkvFormat::Mxfp8 { .. }, true, _) => Origin::Stored,
            (QkvFormat::Dense, true, _) => {
                return Err(WeightError::dtype(
                    param,
                    "bf16, f16 or f32 (the config has no qkv_quantization; an E4M3 weight needs \
                     \"method\": \"w8a8_mxfp8\")",
                    t.dtype(),
                ));
            }
            _ => {
                let expected = match self.format {
                    QkvFormat::Dense => "bf16, f16 or f32",
                    QkvFormat::Mxfp8 { .. } => {
                        "F8_E4M3 or u8 (with weight_scale), or bf16, f16 or f32"
                    }
                };
                return Err(WeightError::dtype(param, expected, t.dtype()));
            }
        };
        expect_shape(param, t, &[d.proj, d.hidden], "[num_heads * head_dim, hidden_size]")?;
        if origin == Origin::QuantizedAtLoad && self.scale_loaded[i] {
            return Err(self.conflict(part));
        }
        let rows = read_rows(t, d.proj_range())?;
        let row0 = self.part_rows(part).start;
        match (origin, self.format) {
            (Origin::Dense, _) => self.data_mut(self.dtype)?.write_rows(row0, &rows)?,
            (Origin::Stored, _) => {
                // The bytes are E4M3 whether the file calls them F8_E4M3 or u8.
                let bytes = rows.as_u8().map(<[u8]>::to_vec).unwrap_or_default();
                let e4m3 = HostTensor::from_bytes(DType::E4M3, rows.shape(), bytes)?;
                self.data_mut(DType::E4M3)?.write_rows(row0, &e4m3)?;
            }
            (Origin::QuantizedAtLoad, QkvFormat::Mxfp8 { scale_alg }) => {
                let q = quantize_rows(param, &rows, scale_alg)?;
                let (n, k, blocks) = (q.rows, q.k, q.blocks());
                let data = HostTensor::from_bytes(DType::E4M3, &[n, k], q.data)?;
                let scale = HostTensor::from_bytes(DType::E8M0, &[n, blocks], q.scale)?;
                self.data_mut(DType::E4M3)?.write_rows(row0, &data)?;
                self.scale_mut()?.write_rows(row0, &scale)?;
            }
            (Origin::QuantizedAtLoad, QkvFormat::Dense) => {}
        }
        self.origin[i] = Some(origin);
        Ok(())
    }

    /// `q_proj.weight_scale` (or k, v): u8 or F8_E8M0 `[P, ceil(Hd / 32)]`.
    pub fn load_scale(&mut self, part: QkvPart, t: &dyn TensorRead) -> Result<(), WeightError> {
        let param = part.scale_suffix();
        let d = self.dims;
        if self.format == QkvFormat::Dense {
            return Err(WeightError::value(
                param,
                "the config has no qkv_quantization, so QKV weights carry no scales",
            ));
        }
        if !matches!(t.dtype(), DType::U8 | DType::E8M0) {
            return Err(WeightError::dtype(param, "u8 or F8_E8M0", t.dtype()));
        }
        expect_shape(
            param,
            t,
            &[d.proj, d.scale_blocks()],
            "[num_heads * head_dim, ceil(hidden_size / 32)]",
        )?;
        if self.origin[part.index()] == Some(Origin::QuantizedAtLoad) {
            return Err(self.conflict(part));
        }
        let rows = read_rows(t, d.proj_range())?;
        let bytes = rows.as_u8().map(<[u8]>::to_vec).unwrap_or_default();
        let e8m0 = HostTensor::from_bytes(DType::E8M0, rows.shape(), bytes)?;
        let row0 = self.part_rows(part).start;
        self.scale_mut()?.write_rows(row0, &e8m0)?;
        self.scale_loaded[part.index()] = true;
        Ok(())
    }

    fn conflict(&self, part: QkvPart) -> WeightError {
        WeightError::value(
            part.scale_suffix(),
            format!(
                "given together with a dense {} (which is quantized at load); a checkpoint stores \
                 either E4M3 bytes with their scale or a dense weight",
                part.weight_suffix()
            ),
        )
    }

    fn data_mut(&mut self, dtype: DType) -> Result<&mut HostTensor, WeightError> {
        let shape = [self.dims.qkv_width(), self.dims.hidden];
        if self.data.is_none() {
            self.data = Some(HostTensor::zeros(dtype, &shape)?);
        }
        let current = self.data.as_ref().map(HostTensor::dtype);
        if current != Some(dtype) {
            // A dense part after an E4M3 one (or the reverse) cannot share one buffer.
            let actual = current.map_or("none".to_string(), |d| d.name().to_string());
            return Err(WeightError::dtype("fused QKV weight", dtype.name(), actual));
        }
        self.data
            .as_mut()
            .ok_or_else(|| WeightError::shape("fused QKV weight", fmt_shape(&shape), &[]))
    }

    fn scale_mut(&mut self) -> Result<&mut HostTensor, WeightError> {
        let shape = [self.dims.qkv_width(), self.dims.scale_blocks()];
        if self.scale.is_none() {
            self.scale = Some(HostTensor::zeros(DType::E8M0, &shape)?);
        }
        self.scale
            .as_mut()
            .ok_or_else(|| WeightError::shape("fused QKV scale", fmt_shape(&shape), &[]))
    }
}

/// Quantize dense rows `[rows, Hd]` to MXFP8 with `alg` (bf16 and f32 directly; f16 widened
/// exactly to f32 first).
fn quantize_rows(
    param: &str,
    rows: &HostTensor,
    alg: ScaleAlg,
) -> Result<mx::Quantized, WeightError> {
    let (n, k) = match rows.shape() {
        [n, k] => (*n, *k),
        other => return Err(WeightError::shape(param, "a 2-D weight", other)),
    };
    let mx_err = |source| WeightError::Mx { param: param.to_string(), source };
    if let Some(v) = rows.as_bf16() {
        return mx::quantize::<bf16>(v, n, k, alg).map_err(mx_err);
    }
    let v = rows.float_values(param)?;
    mx::quantize::<f32>(&v, n, k, alg).map_err(mx_err)
}

/// The MXFP8 fused QKV (`data` E4M3 `[3 lp, Hd]`, `scale` E8M0 `[3 lp, ceil(Hd / 32)]`, plain
/// layout) dequantized to a bf16 `[3 lp, Hd]` weight, for the bf16 QKV path of a backend without
/// the MXFP8 ops (`docs/design/kda.md#qkv-precision`).
///
/// Every value must come out exact, so the bf16 GEMM multiplies by the very weight the MX GEMM
/// would: an E4M3 value has at most four significant bits and the scale is a power of two, so
/// the product fits bf16's eight bits whenever it lies in bf16's range: at most bf16's largest
/// finite value and, below its smallest normal `2^-126`, with no bit under its smallest subnormal
/// `2^-133`. A value outside that (a huge scale, a tiny one, a NaN byte) is
/// [`WeightError::Value`] naming the checkpoint weight (`layer`'s `q_proj.weight`, `k_proj` or
/// `v_proj` by its row), the element and both bytes.
pub fn dequantize_bf16(
    data: &HostTensor,
    scale: &HostTensor,
    layer: usize,
) -> Result<HostTensor, WeightError> {
    const PARAM: &str = "fused QKV (MXFP8)";
    let (rows, k) = match data.shape() {
        [rows, k] if rows % 3 == 0 => (*rows, *k),
        other => return Err(WeightError::shape(PARAM, "[3 lp, Hd]", other)),
    };
    let blocks = mx::num_blocks(k);
    if scale.shape() != [rows, blocks] {
        return Err(WeightError::shape(
            &format!("{PARAM} scale"),
            fmt_shape(&[rows, blocks]),
            scale.shape(),
        ));
    }
    let (Some(bytes), Some(scales)) = (data.as_u8(), scale.as_u8()) else {
        return Err(WeightError::dtype(PARAM, "E4M3 data and E8M0 scale bytes", data.dtype()));
    };
    let lp = rows / 3;
    let mut out = Vec::with_capacity(bytes.len());
    for (index, &q) in bytes.iter().enumerate() {
        let (row, col) = (index / k.max(1), index % k.max(1));
        let s = scales[row * blocks + col / mx::BLOCK_SIZE];
        let exact = mx::dequantize_value_f64(q, s);
        // The f32 product is exact (E4M3 × 2^e stays above f32's smallest subnormal); the bf16
        // rounding of it is the only step that can lose anything.
        let value = bf16::from_f32(mx::dequantize_value(q, s));
        if value.to_f64() != exact {
            let part = QkvPart::ALL[(row / lp.max(1)).min(2)];
            return Err(WeightError::value(
                &format!("{}{}", super::layer_prefix(layer), part.weight_suffix()),
                format!(
                    "element [{}, {col}] = {exact:e} (E4M3 byte {q:#04x}, E8M0 scale byte {s:#04x}) is not exactly representable in bf16 (rounds to {value}), so the bf16 QKV path cannot carry this weight; run the MXFP8 QKV path",
                    row % lp.max(1)
                ),
            ));
        }
        out.push(value);
    }
    HostTensor::from_bf16(&[rows, k], out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Tp, tiny_config};

    fn dims(tp: Tp) -> LayerDims {
        tiny_config(40).dims(tp).unwrap()
    }

    fn dense(salt: f32) -> HostTensor {
        let v =
            (0..8 * 40).map(|i| bf16::from_f32(((i as f32) * 0.31 + salt).sin() * 0.05)).collect();
        HostTensor::from_bf16(&[8, 40], v).unwrap()
    }

    const MX: QkvFormat = QkvFormat::Mxfp8 { scale_alg: ScaleAlg::OcpFloor };

    #[test]
    fn dense_parts_are_packed_in_order() {
        let d = dims(Tp::new(2, 1).unwrap());
        let mut qkv = FusedQkv::new(d, QkvFormat::Dense, DType::BF16).unwrap();
        let w: Vec<HostTensor> = (0..3).map(|i| dense(i as f32)).collect();
        for part in [QkvPart::V, QkvPart::Q, QkvPart::K] {
            assert!(qkv.weights().is_none());
            qkv.load_weight(part, &w[part.index()]).unwrap();
        }
        let Some(QkvWeights::Dense(t)) = qkv.weights() else { panic!("dense weights") };
        assert_eq!(t.shape(), &[12, 40]);
        for part in QkvPart::ALL {
            let want = w[part.index()].read(&[4..8, 0..40]).unwrap();
            let got = t.read(&[qkv.part_rows(part), 0..40]).unwrap();
            assert_eq!(got, want);
        }
    }

    #[test]
    fn quantized_at_load_equals_stored_quantized() {
        let d = dims(Tp::new(2, 0).unwrap());
        let w: Vec<HostTensor> = (0..3).map(|i| dense(i as f32)).collect();
        let mut at_load = FusedQkv::new(d, MX, DType::BF16).unwrap();
        let mut stored = FusedQkv::new(d, MX, DType::BF16).unwrap();
        for part in QkvPart::ALL {
            let full = &w[part.index()];
            at_load.load_weight(part, full).unwrap();
            let q = mx::quantize(full.as_bf16().unwrap(), 8, 40, ScaleAlg::OcpFloor).unwrap();
            let data = HostTensor::from_bytes(DType::E4M3, &[8, 40], q.data).unwrap();
            let scale = HostTensor::from_bytes(DType::U8, &[8, 2], q.scale).unwrap();
            stored.load_scale(part, &scale).unwrap();
            assert_eq!(
                stored.missing(),
                vec![part.weight_suffix()]
                    .into_iter()
                    .chain(QkvPart::ALL[part.index() + 1..].iter().map(|p| p.weight_suffix()))
                    .collect::<Vec<_>>()
            );
            stored.load_weight(part, &data).unwrap();
        }
        let (
            Some(QkvWeights::Mxfp8 { data: a, scale: sa, .. }),
            Some(QkvWeights::Mxfp8 { data: b, scale: sb, .. }),
        ) = (at_load.weights(), stored.weights())
        else {
            panic!("both complete")
        };
        assert_eq!((a, sa), (b, sb));
        assert_eq!(
            (a.dtype(), sa.dtype(), sa.shape()),
            (DType::E4M3, DType::E8M0, &[12usize, 2][..])
        );
    }

    #[test]
    fn bad_qkv_sources_are_named() {
        let d = dims(Tp::SINGLE);
        let mut qkv = FusedQkv::new(d, MX, DType::BF16).unwrap();
        let data = HostTensor::from_bytes(DType::E4M3, &[8, 40], vec![0; 320]).unwrap();
        qkv.load_weight(QkvPart::K, &data).unwrap();
        assert_eq!(qkv.missing(), vec!["q_proj.weight", "k_proj.weight_scale", "v_proj.weight"]);
        let bad_scale = HostTensor::from_bytes(DType::U8, &[8, 1], vec![0; 8]).unwrap();
        let e = qkv.load_scale(QkvPart::K, &bad_scale).unwrap_err().to_string();
        assert_eq!(
            e,
            "k_proj.weight_scale: shape [8, 1], expected [8, 2] [num_heads * head_dim, ceil(hidden_size / 32)]"
        );
        qkv.load_weight(QkvPart::Q, &dense(0.0)).unwrap();
        let scale = HostTensor::from_bytes(DType::U8, &[8, 2], vec![127; 16]).unwrap();
        let e = qkv.load_scale(QkvPart::Q, &scale).unwrap_err().to_string();
        assert!(
            e.starts_with("q_proj.weight_scale: given together with a dense q_proj.weight"),
            "{e}"
        );
        let i32s = HostTensor::from_le_bytes(DType::I32, &[8, 40], &[0; 8 * 40 * 4]).unwrap();
        let e = qkv.load_weight(QkvPart::V, &i32s).unwrap_err().to_string();
        assert!(e.starts_with("v_proj.weight: dtype i32, expected F8_E4M3 or u8"), "{e}");

        let mut plain = FusedQkv::new(d, QkvFormat::Dense, DType::BF16).unwrap();
        let e = plain.load_weight(QkvPart::Q, &data).unwrap_err().to_string();
        assert!(e.contains("no qkv_quantization"), "{e}");
        assert!(plain.load_scale(QkvPart::Q, &scale).is_err());
        let e =
            plain.load_weight(QkvPart::Q, &dense(0.0).read(&[0..4, 0..40]).unwrap()).unwrap_err();
        assert_eq!(
            e.to_string(),
            "q_proj.weight: shape [4, 40], expected [8, 40] [num_heads * head_dim, hidden_size]"
        );
    }

    /// Whether `v` is a bf16 value, decided from its binary expansion rather than by rounding:
    /// finite, at most bf16's largest value, and (E4M3 values having at most four significant
    /// bits, which bf16's normals always hold) no set bit below bf16's smallest subnormal 2^-133.
    fn bf16_holds(v: f64) -> bool {
        if !v.is_finite() || v.abs() > bf16::MAX.to_f64() {
            return false;
        }
        v == 0.0 || (v.abs() * 2f64.powi(133)).fract() == 0.0
    }

    #[test]
    fn dequantize_bf16_is_exact_or_names_the_weight_for_every_byte_pair() {
        let mut exact = 0;
        for s in 0..=255u8 {
            for q in 0..=255u8 {
                // One element in each of q, k and v; the k row carries the pair.
                let data = HostTensor::from_bytes(DType::E4M3, &[3, 1], vec![0, q, 0]).unwrap();
                let scale =
                    HostTensor::from_bytes(DType::E8M0, &[3, 1], vec![127, s, 127]).unwrap();
                let want = mx::dequantize_value_f64(q, s);
                match dequantize_bf16(&data, &scale, 7) {
                    Ok(t) => {
                        assert!(bf16_holds(want), "{q:#04x} x {s:#04x} = {want:e} accepted");
                        assert_eq!(t.as_bf16().unwrap()[1].to_f64(), want, "{q:#04x} x {s:#04x}");
                        exact += 1;
                    }
                    Err(WeightError::Value { param, reason }) => {
                        assert!(!bf16_holds(want), "{q:#04x} x {s:#04x} = {want:e} refused");
                        assert_eq!(param, "model.layers.7.self_attn.k_proj.weight");
                        assert!(reason.starts_with("element [0, 0] = "), "{reason}");
                        assert!(reason.contains(&format!("{q:#04x}")), "{reason}");
                    }
                    Err(other) => panic!("{other}"),
                }
            }
        }
        // Not a vacuous pass: most pairs are exact (everything in bf16's range), some are not
        // (the scale 2^127 times 448, 2^-127 times an E4M3 subnormal, the NaN bytes).
        assert!(exact > 55_000 && exact < 65_536, "{exact}");
    }

    #[test]
    fn dequantize_bf16_of_a_loaded_weight_equals_the_codec_decode() {
        let d = dims(Tp::SINGLE);
        let mut qkv = FusedQkv::new(d, MX, DType::BF16).unwrap();
        for (i, part) in QkvPart::ALL.into_iter().enumerate() {
            qkv.load_weight(part, &dense(i as f32)).unwrap();
        }
        let Some(QkvWeights::Mxfp8 { data, scale, .. }) = qkv.weights() else { panic!("mx") };
        let w = dequantize_bf16(data, scale, 0).unwrap();
        assert_eq!((w.dtype(), w.shape()), (DType::BF16, &[24, 40][..]));
        let want =
            mx::dequantize_f64(data.as_u8().unwrap(), scale.as_u8().unwrap(), 24, 40).unwrap();
        let got: Vec<f64> = w.as_bf16().unwrap().iter().map(|v| v.to_f64()).collect();
        assert_eq!(got, want);
        assert!(got.iter().any(|&v| v != 0.0));
    }
}
