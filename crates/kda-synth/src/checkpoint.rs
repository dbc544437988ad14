//! Synthetic HF-style KDA checkpoints: deterministic, realistic in magnitude, any size.
//!
//! [`SyntheticCheckpoint`] describes every tensor of the chosen layers and generates values on
//! demand. Each element is a pure function of `(seed, tensor name, flat index)`: element `i`
//! of a tensor is drawn from that tensor's own ChaCha8 stream at word `4 i` (two `u64`s per
//! element). So any region (a TP rank's rows, `o_proj`'s columns) is generated without the
//! rest, in parallel, and always equals the same region of the whole tensor. That is how the
//! Kimi K3 TP8 rank-0 weights are made without materialising the full 12288-row layer: load
//! straight from a [`SyntheticCheckpoint`] (a [`TensorSource`]) and only the rank's regions are
//! generated. [`write_checkpoint`] writes the same values to a directory (`config.json` plus one
//! `model.safetensors` or shards with `model.safetensors.index.json`), one tensor in memory at a
//! time.
//!
//! Magnitudes: projection weights ~ N(0, 0.02) (bf16); conv weights ~ U(±1/sqrt(W)) (f32, the
//! default init of a depthwise conv); `A_log` = ln U(1, 16) (f32); `dt_bias` = inverse softplus of
//! U(0.001, 0.1) (f32); `o_norm.weight` ~ U(0.9, 1.1) (bf16). MXFP8 QKV are the bf16 weights
//! quantized with the config's `scale_alg` by [`kda_core::mx`].
//!
//! The normal draws use `ln`, `sqrt` and `cos` from the platform's libm (see
//! [`Gen::normal_f32`]); within one build the values are exactly reproducible.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::f64::consts::TAU;
use std::ops::Range;
use std::path::Path;

use half::bf16;
use kda_core::DType;
use kda_core::mx::{self, ScaleAlg};
use kda_model::config::{KdaConfig, QkvFormat};
use kda_model::weights::checkpoint::dtype_to_safetensors;
use kda_model::weights::source::read_all;
use kda_model::weights::{
    HostTensor, INDEX_FILE, SINGLE_FILE, TensorRead, TensorSource, WeightError, layer_prefix,
};

use crate::Gen;

/// How the QKV weights are stored.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum QkvStorage {
    /// bf16 `[P, Hd]` (with an MXFP8 config they are quantized at load).
    Dense,
    /// E4M3 `[P, Hd]` plus `weight_scale` u8 `[P, ceil(Hd/32)]`, quantized with `scale_alg`.
    Mxfp8 { scale_alg: ScaleAlg },
}

/// How `A_log` is stored.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum ALogShape {
    /// `[H]`.
    Flat,
    /// `[1, 1, H, 1]`.
    Broadcast,
    /// `[H + n]`, zeros beyond `H`.
    Padded(usize),
}

/// What to generate.
#[derive(Clone, Debug)]
pub struct SyntheticSpec {
    pub config: KdaConfig,
    /// KDA layer indices.
    pub layers: Vec<usize>,
    pub seed: u64,
    pub qkv: QkvStorage,
    pub a_log: ALogShape,
    /// Conv weights as `[P, 1, W]` (true) or `[P, W]`.
    pub conv_3d: bool,
    /// Add tensors no KDA loader claims (embeddings, an MLP weight), which must pass through.
    pub extra_tensors: bool,
}

impl SyntheticSpec {
    /// Layer 0 of `config`, QKV stored the way the config runs them (MXFP8 configs get E4M3
    /// weights with scales), `A_log` `[H]`, conv `[P, 1, W]`.
    pub fn new(config: KdaConfig, seed: u64) -> Self {
        let qkv = match config.qkv_format() {
            QkvFormat::Dense => QkvStorage::Dense,
            QkvFormat::Mxfp8 { scale_alg } => QkvStorage::Mxfp8 { scale_alg },
        };
        SyntheticSpec {
            config,
            layers: vec![0],
            seed,
            qkv,
            a_log: ALogShape::Flat,
            conv_3d: true,
            extra_tensors: false,
        }
    }
}

/// A config shaped like `preset` (same gate forms and quantization) with other sizes, for tests.
pub fn scaled_config(
    preset: &KdaConfig,
    hidden: usize,
    heads: usize,
    head_dim: usize,
) -> KdaConfig {
    let mut c = preset.clone();
    c.hidden_size = hidden;
    c.linear_attn_config.num_heads = heads;
    c.linear_attn_config.head_dim = head_dim;
    c
}

/// How the values of one tensor are made.
#[derive(Clone, Debug, PartialEq)]
enum Values {
    Normal {
        std: f64,
    },
    Uniform {
        lo: f64,
        hi: f64,
    },
    /// ln U(1, 16) for the first `heads` elements, zero beyond.
    ALog {
        heads: usize,
    },
    /// Inverse softplus of U(0.001, 0.1).
    DtBias,
    /// The E4M3 bytes of the MXFP8 quantization of the named dense tensor's rows.
    MxData {
        dense: String,
        alg: ScaleAlg,
    },
    /// The scale bytes of the same.
    MxScale {
        dense: String,
        alg: ScaleAlg,
    },
}

#[derive(Clone, Debug)]
struct Recipe {
    dtype: DType,
    shape: Vec<usize>,
    values: Values,
    seed: u64,
}

/// A synthetic checkpoint: every tensor described, values generated on demand (see the module
/// docs).
#[derive(Clone, Debug)]
pub struct SyntheticCheckpoint {
    spec: SyntheticSpec,
    recipes: BTreeMap<String, Recipe>,
}

/// FNV-1a of the name, mixed with the seed: each tensor has its own stream.
fn tensor_seed(seed: u64, name: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    // splitmix64 finaliser over seed and name hash.
    let mut z = h ^ seed.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl SyntheticCheckpoint {
    pub fn new(spec: SyntheticSpec) -> Self {
        let c = &spec.config;
        let attn = &c.linear_attn_config;
        let (hd, h, d, w) =
            (c.hidden_size, attn.num_heads, attn.head_dim, attn.short_conv_kernel_size);
        let p = h * d;
        let weight = Values::Normal { std: 0.02 };
        let mut recipes = BTreeMap::new();
        let mut add = |name: String, dtype: DType, shape: Vec<usize>, values: Values| {
            let seed = tensor_seed(spec.seed, &name);
            recipes.insert(name, Recipe { dtype, shape, values, seed });
        };
        for &layer in &spec.layers {
            let pre = layer_prefix(layer);
            for part in ["q", "k", "v"] {
                let name = format!("{pre}{part}_proj.weight");
                match spec.qkv {
                    QkvStorage::Dense => add(name, DType::BF16, vec![p, hd], weight.clone()),
                    QkvStorage::Mxfp8 { scale_alg } => {
                        // The dense values come from the dense tensor's own name, so a stored
                        // MXFP8 checkpoint and a dense one quantized at load hold the same
                        // numbers.
                        add(
                            name.clone(),
                            DType::E4M3,
                            vec![p, hd],
                            Values::MxData { dense: name.clone(), alg: scale_alg },
                        );
                        add(
                            format!("{name}_scale"),
                            DType::U8,
                            vec![p, mx::num_blocks(hd)],
                            Values::MxScale { dense: name, alg: scale_alg },
                        );
                    }
                }
                let conv_shape = if spec.conv_3d { vec![p, 1, w] } else { vec![p, w] };
                let bound = 1.0 / (w as f64).sqrt();
                add(
                    format!("{pre}{part}_conv1d.weight"),
                    DType::F32,
                    conv_shape,
                    Values::Uniform { lo: -bound, hi: bound },
                );
            }
            add(format!("{pre}b_proj.weight"), DType::BF16, vec![h, hd], weight.clone());
            add(format!("{pre}f_a_proj.weight"), DType::BF16, vec![d, hd], weight.clone());
            add(format!("{pre}f_b_proj.weight"), DType::BF16, vec![p, d], weight.clone());
            if c.use_full_rank_gate {
                add(format!("{pre}g_proj.weight"), DType::BF16, vec![p, hd], weight.clone());
            } else {
                add(format!("{pre}g_a_proj.weight"), DType::BF16, vec![d, hd], weight.clone());
                add(format!("{pre}g_b_proj.weight"), DType::BF16, vec![p, d], weight.clone());
            }
            let a_log_shape = match spec.a_log {
                ALogShape::Flat => vec![h],
                ALogShape::Broadcast => vec![1, 1, h, 1],
                ALogShape::Padded(n) => vec![h + n],
            };
            add(format!("{pre}A_log"), DType::F32, a_log_shape, Values::ALog { heads: h });
            add(format!("{pre}dt_bias"), DType::F32, vec![p], Values::DtBias);
            add(
                format!("{pre}o_norm.weight"),
                DType::BF16,
                vec![d],
                Values::Uniform { lo: 0.9, hi: 1.1 },
            );
            add(format!("{pre}o_proj.weight"), DType::BF16, vec![hd, p], weight.clone());
            if spec.extra_tensors {
                add(
                    format!("model.layers.{layer}.mlp.down_proj.weight"),
                    DType::BF16,
                    vec![hd, 8],
                    weight.clone(),
                );
            }
        }
        if spec.extra_tensors {
            add("model.embed_tokens.weight".into(), DType::BF16, vec![16, hd], weight);
        }
        SyntheticCheckpoint { spec, recipes }
    }

    pub fn spec(&self) -> &SyntheticSpec {
        &self.spec
    }

    /// The whole tensor `name`.
    pub fn full(&self, name: &str) -> Result<HostTensor, WeightError> {
        read_all(&*self.tensor(name)?)
    }

    fn recipe(&self, name: &str) -> Result<&Recipe, WeightError> {
        self.recipes
            .get(name)
            .ok_or_else(|| WeightError::NotFound { origin: self.origin(), name: name.into() })
    }
}

/// One element's uniform draw in [0, 1) and its normal draw, from words `4 i .. 4 i + 4`.
fn draw(g: &mut Gen) -> (f64, f64) {
    let u1 = g.unit_f64();
    let u2 = g.unit_f64();
    // 1 - u1 lies in (0, 1], so ln is finite.
    let normal = (-2.0 * (1.0 - u1).ln()).sqrt() * (TAU * u2).cos();
    (u1, normal)
}

/// One element of `recipe` at flat index `i`, from the generator positioned at word `4 i`.
fn value(recipe: &Recipe, i: usize, g: &mut Gen) -> f32 {
    let (u, normal) = draw(g);
    match recipe.values {
        Values::Normal { std } => (normal * std) as f32,
        Values::Uniform { lo, hi } => (lo + (hi - lo) * u) as f32,
        Values::ALog { heads } => {
            if i < heads {
                (1.0 + 15.0 * u).ln() as f32
            } else {
                0.0
            }
        }
        // softplus^-1(y) = ln(e^y - 1).
        Values::DtBias => (0.001 + 0.099 * u).exp_m1().ln() as f32,
        Values::MxData { .. } | Values::MxScale { .. } => 0.0,
    }
}

/// The row-major `region` of a `shape` tensor as runs `(flat start, length)` of consecutive
/// elements (whole trailing dimensions merged into one run).
fn region_runs(shape: &[usize], region: &[Range<usize>]) -> Vec<(usize, usize)> {
    if region.iter().any(|r| r.is_empty()) {
        return Vec::new();
    }
    let mut k = shape.len();
    while k > 0 && region[k - 1] == (0..shape[k - 1]) {
        k -= 1;
    }
    let total: usize = shape.iter().product();
    if k == 0 {
        return vec![(0, total)];
    }
    let mut strides = vec![1usize; shape.len()];
    for d in (0..shape.len() - 1).rev() {
        strides[d] = strides[d + 1] * shape[d + 1];
    }
    let run = region[k - 1].len() * strides[k - 1];
    let offset = region[k - 1].start * strides[k - 1];
    let outer = &region[..k - 1];
    let mut index: Vec<usize> = outer.iter().map(|r| r.start).collect();
    let mut runs = Vec::new();
    loop {
        let base: usize = index.iter().zip(&strides).map(|(i, s)| i * s).sum();
        runs.push((base + offset, run));
        let mut d = outer.len();
        loop {
            if d == 0 {
                return runs;
            }
            d -= 1;
            index[d] += 1;
            if index[d] < outer[d].end {
                break;
            }
            index[d] = outer[d].start;
        }
    }
}

/// The f32 values of `region` of `recipe`, generated in parallel pieces; each piece seeks its
/// generator to its first element, so the split does not change a single bit.
fn generate(recipe: &Recipe, shape: &[usize], region: &[Range<usize>]) -> Vec<f32> {
    const PIECE: usize = 1 << 16;
    // (flat start, output offset, length), no piece longer than PIECE.
    let mut pieces = Vec::new();
    let mut out_len = 0;
    for (start, len) in region_runs(shape, region) {
        let mut done = 0;
        while done < len {
            let n = (len - done).min(PIECE);
            pieces.push((start + done, out_len + done, n));
            done += n;
        }
        out_len += len;
    }
    let mut out = vec![0.0f32; out_len];
    let fill = |pieces: &[(usize, usize, usize)], out: &mut [f32], base: usize| {
        let mut g = Gen::new(recipe.seed);
        for &(start, at, n) in pieces {
            g.rng().set_word_pos(4 * start as u128);
            for (j, o) in out[at - base..at - base + n].iter_mut().enumerate() {
                *o = value(recipe, start + j, &mut g);
            }
        }
    };
    let threads = std::thread::available_parallelism().map_or(1, |t| t.get()).min(pieces.len());
    if threads <= 1 || out_len < 1 << 18 {
        fill(&pieces, &mut out, 0);
        return out;
    }
    // Contiguous groups of pieces, each writing its own contiguous stretch of the output.
    let per = pieces.len().div_ceil(threads);
    std::thread::scope(|s| {
        let mut rest: &mut [f32] = &mut out;
        let mut consumed = 0;
        for group in pieces.chunks(per) {
            let len: usize = group.iter().map(|p| p.2).sum();
            let (mine, tail) = std::mem::take(&mut rest).split_at_mut(len);
            rest = tail;
            let base = consumed;
            consumed += len;
            let fill = &fill;
            s.spawn(move || fill(group, mine, base));
        }
    });
    out
}

/// A tensor of a [`SyntheticCheckpoint`], generated region by region.
#[derive(Debug)]
pub struct SyntheticTensor<'a> {
    checkpoint: &'a SyntheticCheckpoint,
    name: String,
    recipe: &'a Recipe,
}

impl TensorRead for SyntheticTensor<'_> {
    fn dtype(&self) -> DType {
        self.recipe.dtype
    }

    fn shape(&self) -> &[usize] {
        &self.recipe.shape
    }

    fn read(&self, region: &[Range<usize>]) -> Result<HostTensor, WeightError> {
        let shape = &self.recipe.shape;
        let bad = || WeightError::Shape {
            param: self.name.clone(),
            expected: format!("a region of {shape:?}"),
            actual: region.iter().map(|r| r.len()).collect(),
        };
        if region.len() != shape.len()
            || region.iter().zip(shape).any(|(r, &d)| r.start > r.end || r.end > d)
        {
            return Err(bad());
        }
        let out_shape: Vec<usize> = region.iter().map(|r| r.len()).collect();
        match &self.recipe.values {
            Values::MxData { dense, alg } | Values::MxScale { dense, alg } => {
                // Quantization works on whole rows of the dense [P, Hd] weight.
                let dense = self.checkpoint.recipe(dense)?;
                let mut plain = dense.clone();
                plain.values = Values::Normal { std: 0.02 };
                let (Some(rows), &[_, k]) = (region.first().cloned(), &dense.shape[..]) else {
                    return Err(bad());
                };
                let whole_rows = [rows.clone(), 0..k];
                let values: Vec<bf16> = generate(&plain, &dense.shape, &whole_rows)
                    .into_iter()
                    .map(bf16::from_f32)
                    .collect();
                let q = mx::quantize(&values, rows.len(), k, *alg)
                    .map_err(|source| WeightError::Mx { param: self.name.clone(), source })?;
                let (bytes, w) = match self.recipe.values {
                    Values::MxData { .. } => (q.data, k),
                    _ => (q.scale, mx::num_blocks(k)),
                };
                let full = HostTensor::from_bytes(self.recipe.dtype, &[rows.len(), w], bytes)?;
                let mut sub = region.to_vec();
                sub[0] = 0..rows.len();
                full.read(&sub)?.reshape(&out_shape)
            }
            _ => {
                let values = generate(self.recipe, shape, region);
                HostTensor::from_f32_as(self.recipe.dtype, &out_shape, &values)
            }
        }
    }
}

impl TensorSource for SyntheticCheckpoint {
    fn origin(&self) -> String {
        format!("synthetic checkpoint (seed {})", self.spec.seed)
    }

    fn names(&self) -> Vec<String> {
        self.recipes.keys().cloned().collect()
    }

    fn tensor(&self, name: &str) -> Result<Box<dyn TensorRead + '_>, WeightError> {
        let recipe = self.recipe(name)?;
        Ok(Box::new(SyntheticTensor { checkpoint: self, name: name.to_string(), recipe }))
    }
}

/// A tensor generated only when the safetensors writer asks for its bytes.
struct LazyView<'a> {
    tensor: SyntheticTensor<'a>,
    len: usize,
}

impl safetensors::View for LazyView<'_> {
    fn dtype(&self) -> safetensors::Dtype {
        dtype_to_safetensors(self.tensor.recipe.dtype)
    }

    fn shape(&self) -> &[usize] {
        &self.tensor.recipe.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        // The View trait cannot fail; a generation error (none is possible for a checkpoint
        // built by SyntheticCheckpoint::new) would write zeros, which the length check of the
        // reader would not catch, so it is checked up front in write_checkpoint.
        match read_all(&self.tensor) {
            Ok(t) => Cow::Owned(t.as_bytes().to_vec()),
            Err(_) => Cow::Owned(vec![0; self.len]),
        }
    }

    fn data_len(&self) -> usize {
        self.len
    }
}

/// Write `checkpoint` to `dir`: `config.json`, and either [`SINGLE_FILE`] (`shards` = 1) or
/// `shards` files `model-0000i-of-0000n.safetensors` with an [`INDEX_FILE`]. Names are split
/// into contiguous runs of the sorted list. Returns the files written.
pub fn write_checkpoint(
    dir: &Path,
    checkpoint: &SyntheticCheckpoint,
    shards: usize,
) -> Result<Vec<String>, WeightError> {
    let io = |action: &'static str, path: &Path, e: std::io::Error| WeightError::Io {
        path: path.display().to_string(),
        action,
        message: e.to_string(),
    };
    std::fs::create_dir_all(dir).map_err(|e| io("create", dir, e))?;
    let config_path = dir.join("config.json");
    std::fs::write(&config_path, checkpoint.spec.config.to_json())
        .map_err(|e| io("write", &config_path, e))?;
    let names = checkpoint.names();
    let shards = shards.clamp(1, names.len().max(1));
    let per = names.len().div_ceil(shards);
    let mut written = vec!["config.json".to_string()];
    let mut weight_map = BTreeMap::new();
    let mut total = 0usize;
    for (i, chunk) in names.chunks(per.max(1)).enumerate() {
        let file = if shards == 1 {
            SINGLE_FILE.to_string()
        } else {
            format!("model-{:05}-of-{:05}.safetensors", i + 1, shards)
        };
        let mut views = Vec::with_capacity(chunk.len());
        for name in chunk {
            let recipe = checkpoint.recipe(name)?;
            let len = recipe.shape.iter().product::<usize>() * recipe.dtype.size_bytes();
            total += len;
            // Generate a 1-element region now so a recipe error surfaces here, not as zeros.
            let tensor = SyntheticTensor { checkpoint, name: name.clone(), recipe };
            if recipe.shape.iter().all(|&d| d > 0) {
                tensor.read(&recipe.shape.iter().map(|_| 0..1).collect::<Vec<_>>())?;
            }
            views.push((name.clone(), LazyView { tensor, len }));
            weight_map.insert(name.clone(), file.clone());
        }
        let path = dir.join(&file);
        let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
        safetensors::serialize_to_file(views, Some(metadata), &path).map_err(|e| {
            WeightError::Io {
                path: path.display().to_string(),
                action: "write",
                message: e.to_string(),
            }
        })?;
        written.push(file);
    }
    if shards > 1 {
        let index = serde_json::json!({
            "metadata": { "total_size": total },
            "weight_map": weight_map,
        });
        let path = dir.join(INDEX_FILE);
        std::fs::write(&path, serde_json::to_string_pretty(&index).unwrap_or_default())
            .map_err(|e| io("write", &path, e))?;
        written.push(INDEX_FILE.to_string());
    }
    Ok(written)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn tiny() -> SyntheticCheckpoint {
        SyntheticCheckpoint::new(SyntheticSpec::new(
            scaled_config(&KdaConfig::kimi_k3(), 64, 4, 8),
            3,
        ))
    }

    #[test]
    fn regions_equal_the_same_region_of_the_whole() {
        let c = tiny();
        for name in c.names() {
            let t = c.tensor(&name).unwrap();
            let full = read_all(&*t).unwrap();
            let shape = t.shape().to_vec();
            let mut region: Vec<Range<usize>> = shape.iter().map(|&d| 0..d).collect();
            region[0] = shape[0] / 3..shape[0] - shape[0] / 4;
            if shape.len() == 2 {
                region[1] = 1..shape[1] - 1;
            }
            assert_eq!(t.read(&region).unwrap(), full.read(&region).unwrap(), "{name}");
        }
    }

    #[test]
    fn magnitudes_are_realistic() {
        let c = tiny();
        let pre = layer_prefix(0);
        let g = c.full(&format!("{pre}g_proj.weight")).unwrap().to_f64_vec().unwrap();
        let std = (g.iter().map(|x| x * x).sum::<f64>() / g.len() as f64).sqrt();
        assert!((std - 0.02).abs() < 0.002, "std {std}");
        let a = c.full(&format!("{pre}A_log")).unwrap().to_f64_vec().unwrap();
        assert!(a.iter().all(|&x| (0.0..16f64.ln()).contains(&x)), "{a:?}");
        let dt = c.full(&format!("{pre}dt_bias")).unwrap().to_f64_vec().unwrap();
        let softplus = |x: f64| x.exp().ln_1p();
        assert!(dt.iter().all(|&x| (0.00099..0.1001).contains(&softplus(x))));
        let q = c.full(&format!("{pre}q_proj.weight")).unwrap();
        assert_eq!((q.dtype(), q.shape()), (DType::E4M3, &[32usize, 64][..]));
        let s = c.full(&format!("{pre}q_proj.weight_scale")).unwrap();
        assert_eq!((s.dtype(), s.shape()), (DType::U8, &[32usize, 2][..]));
    }

    #[test]
    fn a_log_padding_and_broadcast_shapes() {
        let mut spec = SyntheticSpec::new(scaled_config(&KdaConfig::kimi_k3(), 64, 4, 8), 3);
        spec.a_log = ALogShape::Padded(3);
        let padded =
            SyntheticCheckpoint::new(spec.clone()).full("model.layers.0.self_attn.A_log").unwrap();
        spec.a_log = ALogShape::Broadcast;
        let broadcast =
            SyntheticCheckpoint::new(spec).full("model.layers.0.self_attn.A_log").unwrap();
        let p = padded.to_f32_vec().unwrap();
        assert_eq!(p.len(), 7);
        assert_eq!(&p[4..], &[0.0; 3]);
        assert_eq!(broadcast.shape(), &[1, 1, 4, 1]);
        assert_eq!(&p[..4], &broadcast.to_f32_vec().unwrap()[..]);
    }
}
