//! The model configuration a KDA layer is built from: [`KdaConfig`], read from an HF-style
//! `config.json`, the tensor-parallel position [`Tp`], and the per-rank sizes [`LayerDims`] that
//! every loader checks shapes against.
//!
//! `config.json` carries many keys a KDA layer does not need (vocabulary, MoE, full-attention
//! layers); they are ignored. The keys read here:
//!
//! ```json
//! {
//!   "hidden_size": 7168,
//!   "rms_norm_eps": 1e-5,
//!   "use_full_rank_gate": true,
//!   "linear_attn_config": {
//!     "num_heads": 96, "head_dim": 128, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0
//!   },
//!   "qkv_quantization": { "method": "w8a8_mxfp8", "group_size": 32, "scale_alg": 0 }
//! }
//! ```
//!
//! `gate_lower_bound` absent means the softplus gate (Kimi Linear); `use_full_rank_gate` false
//! (the default) means the low-rank output gate `g_a_proj`/`g_b_proj`; `qkv_quantization` absent
//! (or `"method": "none"`) means bf16 QKV weights.
//!
//! Every check lives in [`KdaConfig::validate`] and [`KdaConfig::dims`]: a config that passes
//! them cannot make a loader overflow or divide unevenly.

use std::ops::Range;
use std::path::Path;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use kda_core::kda::{GateForm, MAX_HEAD_DIM};
use kda_core::mx::{self, ScaleAlg};

/// The largest `rms_norm_eps` a config may give (see [`KdaConfig::validate`]).
pub const MAX_RMS_NORM_EPS: f64 = 1.0;

/// What a configuration or a tensor-parallel position can be rejected for. Every message names
/// the key, the expected and the actual value.
#[derive(Clone, Debug, Error, PartialEq)]
pub enum ConfigError {
    #[error("{path}: cannot read the config: {message}")]
    Io { path: String, message: String },
    #[error("{path}: not a valid KDA config.json: {message}")]
    Json { path: String, message: String },
    #[error("{key} = 0, expected at least 1")]
    Zero { key: &'static str },
    #[error("{key} = {actual}, expected {expected}")]
    Invalid { key: &'static str, expected: String, actual: String },
    #[error(
        "linear_attn_config.num_heads = {heads} is not divisible by tp_size = {tp_size} \
         (expected a tp_size that divides the head count)"
    )]
    HeadsNotDivisible { heads: usize, tp_size: usize },
    #[error("tp_rank = {rank}, expected a rank below tp_size = {size}")]
    RankOutOfRange { rank: usize, size: usize },
    #[error("{what} overflows: {detail}")]
    Overflow { what: &'static str, detail: String },
}

/// `linear_attn_config` of `config.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LinearAttnConfig {
    /// Heads `H`.
    pub num_heads: usize,
    /// Head dimension `D` (= dk = dv).
    pub head_dim: usize,
    /// Short-conv width `W`.
    pub short_conv_kernel_size: usize,
    /// The lower bound of the K3 gate form; absent for Kimi Linear's softplus form.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gate_lower_bound: Option<f64>,
}

/// How the QKV weights are quantized.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum QuantMethod {
    /// Dense weights (bf16 in real checkpoints).
    #[default]
    None,
    /// W8A8 MXFP8: E4M3 weights with E8M0 scales per 32 inputs, activations quantized by
    /// DynamicQuant before the GEMM.
    W8a8Mxfp8,
}

/// `qkv_quantization` of `config.json`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct QkvQuantization {
    pub method: QuantMethod,
    /// Elements per scale; MXFP8 defines it as 32 ([`mx::BLOCK_SIZE`]).
    #[serde(default = "default_group_size")]
    pub group_size: usize,
    /// Ascend's `scale_alg` for DynamicQuant and for quantizing bf16 weights at load
    /// (0 = OCP floor, 1 = round up).
    #[serde(default)]
    pub scale_alg: u8,
}

fn default_group_size() -> usize {
    mx::BLOCK_SIZE
}

/// The validated QKV weight format.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum QkvFormat {
    /// Dense weights in the layer's weight dtype.
    Dense,
    /// MXFP8 E4M3 data with E8M0 scales (groups of 32 along the hidden size).
    Mxfp8 { scale_alg: ScaleAlg },
}

/// The KDA part of an HF-style `config.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KdaConfig {
    /// Hidden size `Hd`.
    pub hidden_size: usize,
    /// Epsilon of the gated output norm (the checkpoint's, never a default:
    /// `docs/design/kda.md#behaviour-3`).
    pub rms_norm_eps: f64,
    pub linear_attn_config: LinearAttnConfig,
    /// Full-rank output gate `g_proj` (K3) instead of the low-rank `g_a_proj`/`g_b_proj`.
    #[serde(default)]
    pub use_full_rank_gate: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub qkv_quantization: Option<QkvQuantization>,
}

/// A tensor-parallel position: `rank` of `size`.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct Tp {
    pub size: usize,
    pub rank: usize,
}

impl Tp {
    /// No tensor parallelism.
    pub const SINGLE: Tp = Tp { size: 1, rank: 0 };

    /// `rank` of `size`, checked.
    pub fn new(size: usize, rank: usize) -> Result<Tp, ConfigError> {
        if size == 0 {
            return Err(ConfigError::Zero { key: "tp_size" });
        }
        if rank >= size {
            return Err(ConfigError::RankOutOfRange { rank, size });
        }
        Ok(Tp { size, rank })
    }
}

/// The sizes of one TP rank's share of a KDA layer (`docs/design/kda.md#notation`).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct LayerDims {
    /// `Hd`.
    pub hidden: usize,
    /// `H` (all ranks).
    pub heads: usize,
    /// `D`.
    pub head_dim: usize,
    /// `P = H * D` (all ranks).
    pub proj: usize,
    /// `W`.
    pub conv_width: usize,
    pub tp: Tp,
    /// `lh = H / tp`.
    pub local_heads: usize,
    /// `lp = P / tp`.
    pub local_proj: usize,
    /// Whether the output gate is the full-rank `g_proj`.
    pub full_rank_gate: bool,
}

impl LayerDims {
    /// Rows of the fused BFG weight: `lh + 2 * lp`.
    pub fn bfg_width(&self) -> usize {
        self.local_heads + 2 * self.local_proj
    }

    /// Rows of the fused QKV weight: `3 * lp`.
    pub fn qkv_width(&self) -> usize {
        3 * self.local_proj
    }

    /// MXFP8 scale blocks per row of a `[*, Hd]` weight: `ceil(Hd / 32)`.
    pub fn scale_blocks(&self) -> usize {
        mx::num_blocks(self.hidden)
    }

    /// This rank's heads among all `H`.
    pub fn head_range(&self) -> Range<usize> {
        let start = self.tp.rank * self.local_heads;
        start..start + self.local_heads
    }

    /// This rank's channels among all `P`.
    pub fn proj_range(&self) -> Range<usize> {
        let start = self.tp.rank * self.local_proj;
        start..start + self.local_proj
    }
}

impl KdaConfig {
    /// Kimi-Linear-48B-A3B: Hd 2304, 32 heads of 128, W 4, softplus gate, low-rank output gate,
    /// bf16 QKV.
    pub fn kimi_linear_48b() -> KdaConfig {
        KdaConfig {
            hidden_size: 2304,
            rms_norm_eps: 1e-5,
            linear_attn_config: LinearAttnConfig {
                num_heads: 32,
                head_dim: 128,
                short_conv_kernel_size: 4,
                gate_lower_bound: None,
            },
            use_full_rank_gate: false,
            qkv_quantization: None,
        }
    }

    /// Kimi K3: Hd 7168, 96 heads of 128, W 4, lower-bound gate (-5), full-rank output gate,
    /// W8A8 MXFP8 QKV with `scale_alg` 0 (what K3 runs with on Ascend).
    pub fn kimi_k3() -> KdaConfig {
        KdaConfig {
            hidden_size: 7168,
            rms_norm_eps: 1e-5,
            linear_attn_config: LinearAttnConfig {
                num_heads: 96,
                head_dim: 128,
                short_conv_kernel_size: 4,
                gate_lower_bound: Some(-5.0),
            },
            use_full_rank_gate: true,
            qkv_quantization: Some(QkvQuantization {
                method: QuantMethod::W8a8Mxfp8,
                group_size: mx::BLOCK_SIZE,
                scale_alg: ScaleAlg::OcpFloor.code(),
            }),
        }
    }

    /// Parse and validate `config.json` text; `origin` names it in errors.
    pub fn from_json_str(text: &str, origin: &str) -> Result<KdaConfig, ConfigError> {
        let config: KdaConfig = serde_json::from_str(text)
            .map_err(|e| ConfigError::Json { path: origin.to_string(), message: e.to_string() })?;
        config.validate()?;
        Ok(config)
    }

    /// Read and validate a `config.json` file.
    pub fn from_file(path: &Path) -> Result<KdaConfig, ConfigError> {
        let origin = path.display().to_string();
        let text = kda_core::file::read_regular_text(path, kda_core::file::MAX_CONFIG_BYTES)
            .map_err(|e| ConfigError::Io { path: origin.clone(), message: e.to_string() })?;
        KdaConfig::from_json_str(&text, &origin)
    }

    /// The `config.json` text of this config (pretty-printed).
    pub fn to_json(&self) -> String {
        // Serializing plain structs of numbers and strings cannot fail; fall back to the
        // compact form rather than panic if serde_json ever disagreed.
        serde_json::to_string_pretty(self).unwrap_or_default()
    }

    /// Check every value a layer depends on (independent of TP; see [`KdaConfig::dims`]).
    pub fn validate(&self) -> Result<(), ConfigError> {
        let attn = &self.linear_attn_config;
        for (key, value) in [
            ("hidden_size", self.hidden_size),
            ("linear_attn_config.num_heads", attn.num_heads),
            ("linear_attn_config.head_dim", attn.head_dim),
            ("linear_attn_config.short_conv_kernel_size", attn.short_conv_kernel_size),
        ] {
            if value == 0 {
                return Err(ConfigError::Zero { key });
            }
        }
        // eps is added to a mean of squares of activations: above 1 it would swamp the norm of
        // any ordinary input (checkpoints use 1e-6 to 1e-5), and the kernels take it as f32.
        if !(self.rms_norm_eps > 0.0 && self.rms_norm_eps <= MAX_RMS_NORM_EPS) {
            return Err(ConfigError::Invalid {
                key: "rms_norm_eps",
                expected: format!("a positive number at most {MAX_RMS_NORM_EPS}"),
                actual: format!("{:?}", self.rms_norm_eps),
            });
        }
        if attn.head_dim > MAX_HEAD_DIM {
            return Err(ConfigError::Invalid {
                key: "linear_attn_config.head_dim",
                expected: format!("at most {MAX_HEAD_DIM} (kda's bound on a head's state)"),
                actual: attn.head_dim.to_string(),
            });
        }
        if let Some(lb) = attn.gate_lower_bound
            && !(lb.is_finite() && lb < 0.0 && lb >= f64::from(f32::MIN))
        {
            return Err(ConfigError::Invalid {
                key: "linear_attn_config.gate_lower_bound",
                expected: "a finite negative number".into(),
                actual: lb.to_string(),
            });
        }
        if let Some(q) = self.qkv_quantization.as_ref().filter(|q| q.method != QuantMethod::None) {
            if q.group_size != mx::BLOCK_SIZE {
                return Err(ConfigError::Invalid {
                    key: "qkv_quantization.group_size",
                    expected: format!("{} (the MXFP8 block)", mx::BLOCK_SIZE),
                    actual: q.group_size.to_string(),
                });
            }
            ScaleAlg::try_from(q.scale_alg).map_err(|_| ConfigError::Invalid {
                key: "qkv_quantization.scale_alg",
                expected: "0 (OCP floor) or 1 (round up)".into(),
                actual: q.scale_alg.to_string(),
            })?;
        }
        // The largest per-layer weights are [P, Hd] and [Hd, P]; with these products in range,
        // no size a loader computes can overflow.
        let proj =
            checked("num_heads * head_dim", attn.num_heads.checked_mul(attn.head_dim), || {
                format!("{} * {}", attn.num_heads, attn.head_dim)
            })?;
        let rows =
            checked("3 * num_heads * head_dim", proj.checked_mul(3), || format!("3 * {proj}"))?;
        let elements = checked("3 * P * hidden_size", rows.checked_mul(self.hidden_size), || {
            format!("{rows} * {}", self.hidden_size)
        })?;
        // Four bytes an element (f32 composition) must stay addressable, with headroom for the
        // conv width and the fused BFG's extra head rows.
        checked("the layer's weight bytes", elements.checked_mul(8), || {
            format!("{elements} elements")
        })?;
        checked(
            "P * short_conv_kernel_size",
            rows.checked_mul(attn.short_conv_kernel_size),
            || format!("{rows} * {}", attn.short_conv_kernel_size),
        )?;
        Ok(())
    }

    /// The forget-gate form.
    pub fn gate_form(&self) -> GateForm {
        match self.linear_attn_config.gate_lower_bound {
            // Validated to lie in f32's range.
            Some(lb) => GateForm::LowerBound { lower_bound: lb as f32 },
            None => GateForm::Softplus,
        }
    }

    /// The QKV weight format.
    pub fn qkv_format(&self) -> QkvFormat {
        match &self.qkv_quantization {
            Some(q) if q.method == QuantMethod::W8a8Mxfp8 => {
                QkvFormat::Mxfp8 { scale_alg: ScaleAlg::try_from(q.scale_alg).unwrap_or_default() }
            }
            _ => QkvFormat::Dense,
        }
    }

    /// The same config with the given number of heads (for layer slices: scaled-down tests and
    /// the precision report keep Hd and D and cut H).
    pub fn with_heads(&self, num_heads: usize) -> KdaConfig {
        let mut c = self.clone();
        c.linear_attn_config.num_heads = num_heads;
        c
    }

    /// The sizes of rank `tp.rank` of `tp.size`: validates the config, the position, and that
    /// the heads divide evenly.
    pub fn dims(&self, tp: Tp) -> Result<LayerDims, ConfigError> {
        self.validate()?;
        let tp = Tp::new(tp.size, tp.rank)?;
        let attn = &self.linear_attn_config;
        if !attn.num_heads.is_multiple_of(tp.size) {
            return Err(ConfigError::HeadsNotDivisible { heads: attn.num_heads, tp_size: tp.size });
        }
        let local_heads = attn.num_heads / tp.size;
        // validate() bounded 3 * H * D.
        let proj = attn.num_heads * attn.head_dim;
        Ok(LayerDims {
            hidden: self.hidden_size,
            heads: attn.num_heads,
            head_dim: attn.head_dim,
            proj,
            conv_width: attn.short_conv_kernel_size,
            tp,
            local_heads,
            local_proj: local_heads * attn.head_dim,
            full_rank_gate: self.use_full_rank_gate,
        })
    }
}

fn checked(
    what: &'static str,
    value: Option<usize>,
    detail: impl FnOnce() -> String,
) -> Result<usize, ConfigError> {
    value.ok_or_else(|| ConfigError::Overflow { what, detail: detail() })
}

/// A tiny full-rank, unquantised config for the weight loaders' unit tests: 4 heads of
/// dim 2, conv width 3, hidden size `hidden`.
#[cfg(test)]
pub(crate) fn tiny_config(hidden: usize) -> KdaConfig {
    KdaConfig {
        hidden_size: hidden,
        rms_norm_eps: 1e-5,
        linear_attn_config: LinearAttnConfig {
            num_heads: 4,
            head_dim: 2,
            short_conv_kernel_size: 3,
            gate_lower_bound: None,
        },
        use_full_rank_gate: true,
        qkv_quantization: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_match_kda_md() {
        let k3 = KdaConfig::kimi_k3();
        let d = k3.dims(Tp::new(8, 0).unwrap()).unwrap();
        assert_eq!(
            (d.hidden, d.heads, d.head_dim, d.proj, d.conv_width),
            (7168, 96, 128, 12288, 4)
        );
        assert_eq!((d.local_heads, d.local_proj), (12, 1536));
        assert_eq!(d.bfg_width(), 3084);
        assert_eq!(d.qkv_width(), 4608);
        assert_eq!(k3.gate_form(), GateForm::LowerBound { lower_bound: -5.0 });
        assert_eq!(k3.qkv_format(), QkvFormat::Mxfp8 { scale_alg: ScaleAlg::OcpFloor });
        assert!(d.full_rank_gate);

        let kl = KdaConfig::kimi_linear_48b();
        let d = kl.dims(Tp::SINGLE).unwrap();
        assert_eq!((d.hidden, d.heads, d.head_dim, d.proj), (2304, 32, 128, 4096));
        assert_eq!(kl.gate_form(), GateForm::Softplus);
        assert_eq!(kl.qkv_format(), QkvFormat::Dense);
        assert!(!d.full_rank_gate);
        assert_eq!(kl.rms_norm_eps, 1e-5);
    }

    #[test]
    fn json_round_trip_and_unknown_keys_ignored() {
        for c in [KdaConfig::kimi_k3(), KdaConfig::kimi_linear_48b()] {
            assert_eq!(KdaConfig::from_json_str(&c.to_json(), "test").unwrap(), c);
        }
        let text = r#"{
            "architectures": ["KimiLinearForCausalLM"], "vocab_size": 163840,
            "hidden_size": 2304, "rms_norm_eps": 1e-5, "num_hidden_layers": 27,
            "linear_attn_config": {"num_heads": 32, "head_dim": 128, "short_conv_kernel_size": 4,
                                   "kda_layers": [1, 2, 3], "full_attn_layers": [4]}
        }"#;
        assert_eq!(KdaConfig::from_json_str(text, "test").unwrap(), KdaConfig::kimi_linear_48b());
        let q = r#"{"hidden_size": 64, "rms_norm_eps": 1e-6, "use_full_rank_gate": true,
            "linear_attn_config": {"num_heads": 4, "head_dim": 8, "short_conv_kernel_size": 4},
            "qkv_quantization": {"method": "w8a8_mxfp8", "scale_alg": 1}}"#;
        let c = KdaConfig::from_json_str(q, "test").unwrap();
        assert_eq!(c.qkv_format(), QkvFormat::Mxfp8 { scale_alg: ScaleAlg::RoundUp });
        assert_eq!(c.rms_norm_eps, 1e-6);
    }

    #[test]
    fn bad_configs_name_the_key_expected_and_actual() {
        let base = KdaConfig::kimi_k3();
        let err = |f: &dyn Fn(&mut KdaConfig)| {
            let mut c = base.clone();
            f(&mut c);
            c.validate().unwrap_err().to_string()
        };
        assert_eq!(
            err(&|c| c.linear_attn_config.head_dim = 0),
            "linear_attn_config.head_dim = 0, expected at least 1"
        );
        assert!(err(&|c| c.hidden_size = 0).contains("hidden_size = 0"));
        assert!(err(&|c| c.rms_norm_eps = -1.0).contains("rms_norm_eps = -1"));
        // Issue #21, item 6: 1e300 is not an epsilon (nor an f32); item 2: a head dim that would
        // make one state 4 TiB.
        assert_eq!(
            err(&|c| c.rms_norm_eps = 1e300),
            "rms_norm_eps = 1e300, expected a positive number at most 1"
        );
        assert!(err(&|c| c.rms_norm_eps = f64::NAN).contains("rms_norm_eps = NaN"));
        assert_eq!(
            err(&|c| c.linear_attn_config.head_dim = 1 << 20),
            "linear_attn_config.head_dim = 1048576, expected at most 512 (kda's bound on a \
             head's state)"
        );
        assert!(err(&|c| c.linear_attn_config.gate_lower_bound = Some(2.0)).contains("= 2"));
        let m = err(&|c| c.qkv_quantization.as_mut().unwrap().group_size = 16);
        assert!(m.contains("group_size = 16, expected 32"), "{m}");
        let m = err(&|c| c.qkv_quantization.as_mut().unwrap().scale_alg = 7);
        assert!(m.contains("scale_alg = 7"), "{m}");
        let m = err(&|c| c.linear_attn_config.num_heads = usize::MAX / 2);
        assert!(m.contains("overflows"), "{m}");

        let m = base.dims(Tp { size: 5, rank: 0 }).unwrap_err().to_string();
        assert!(m.contains("num_heads = 96") && m.contains("tp_size = 5"), "{m}");
        let m = base.dims(Tp { size: 8, rank: 8 }).unwrap_err().to_string();
        assert_eq!(m, "tp_rank = 8, expected a rank below tp_size = 8");
        assert_eq!(Tp::new(0, 0).unwrap_err(), ConfigError::Zero { key: "tp_size" });

        let m = KdaConfig::from_json_str("{\"hidden_size\": -3}", "c.json").unwrap_err();
        assert!(matches!(m, ConfigError::Json { .. }), "{m}");
        assert!(m.to_string().starts_with("c.json: not a valid KDA config.json"), "{m}");
    }

    #[test]
    fn rank_ranges_tile_the_layer() {
        let c = KdaConfig::kimi_k3();
        let mut next = (0, 0);
        for rank in 0..4 {
            let d = c.dims(Tp::new(4, rank).unwrap()).unwrap();
            assert_eq!(d.head_range().start, next.0);
            assert_eq!(d.proj_range().start, next.1);
            next = (d.head_range().end, d.proj_range().end);
        }
        assert_eq!(next, (96, 12288));
    }
}
