//! Benchmark data on the device: seeded tensors, the K3 TP8 projection weights and layer, and
//! the chunked prefill's operands.

use half::bf16;
use kda_core::kda::KdaChunk;
use kda_core::{DType, Device, Op, Result, Tensor};
use kda_cuda::{CudaBackend, CudaStream};
use kda_model::config::{KdaConfig, Tp};
use kda_model::layer::{KdaLayer, LayerOptions};
use kda_model::schedule::{
    BfgWeight, ProjectionDims, ProjectionSchedule, ProjectionWeights, QkvWeight,
};
use kda_model::weights::{LoadOptions, load_layer};
use kda_testkit::checkpoint::{SyntheticCheckpoint, SyntheticSpec};

pub type B = CudaBackend;

/// A cheap deterministic generator (xorshift) for benchmark data.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 40) as f32 / (1u64 << 24) as f32
    }

    pub fn uniform(&mut self, n: usize, lo: f32, hi: f32) -> Vec<f32> {
        (0..n).map(|_| lo + (hi - lo) * self.next()).collect()
    }
}

pub fn bf16_tensor(
    b: &Device<B>,
    s: &CudaStream,
    rng: &mut Rng,
    shape: &[usize],
    lo: f32,
    hi: f32,
) -> Result<Tensor<B>> {
    let n = shape.iter().product();
    let data: Vec<bf16> = rng.uniform(n, lo, hi).into_iter().map(bf16::from_f32).collect();
    let t = b.alloc(DType::BF16, shape)?;
    b.upload(s, &t, &data)?;
    Ok(t)
}

pub fn f32_tensor(
    b: &Device<B>,
    s: &CudaStream,
    data: &[f32],
    shape: &[usize],
) -> Result<Tensor<B>> {
    let t = b.alloc(DType::F32, shape)?;
    b.upload(s, &t, data)?;
    Ok(t)
}

pub fn i32_tensor(b: &Device<B>, s: &CudaStream, data: &[i32]) -> Result<Tensor<B>> {
    let t = b.alloc(DType::I32, &[data.len()])?;
    b.upload(s, &t, data)?;
    Ok(t)
}

/// `x` quantized to MXFP8 on the device (OCP scale).
pub fn quantized(b: &Device<B>, s: &CudaStream, x: Tensor<B>) -> Result<(Tensor<B>, Tensor<B>)> {
    let (rows, k) = (x.shape()[0], x.shape()[1]);
    let data = b.alloc(DType::E4M3, &[rows, k])?;
    let scale = b.alloc(DType::E8M0, &[rows, kda_core::mx::num_blocks(k)])?;
    let alg = kda_core::mx::ScaleAlg::OcpFloor;
    b.launch(s, Op::DynamicQuant { x, data: data.clone(), scale: scale.clone(), alg })?;
    Ok((data, scale))
}

/// The projection weights at K3 TP8 shapes: composed BFG, QKV bf16 or MXFP8.
pub fn projection_weights(
    b: &Device<B>,
    s: &CudaStream,
    rng: &mut Rng,
    mxfp8: bool,
) -> Result<ProjectionWeights<B>> {
    let dims = ProjectionDims::K3_TP8;
    let dense = bf16_tensor(b, s, rng, &[dims.qkv_width(), dims.hidden], -0.05, 0.05)?;
    let qkv = if mxfp8 {
        let (data, scale) = quantized(b, s, dense)?;
        QkvWeight::Mxfp8 { data, scale, alg: kda_core::mx::ScaleAlg::OcpFloor }
    } else {
        QkvWeight::Bf16 { w: dense }
    };
    let w = bf16_tensor(b, s, rng, &[dims.bfg_width(), dims.hidden], -0.05, 0.05)?;
    b.synchronize(s)?;
    ProjectionWeights::new(dims, qkv, BfgWeight::Composed { w })
}

/// Layer 0 of the synthetic Kimi K3 checkpoint, TP 8 rank 0 (MXFP8 QKV, lower-bound gate),
/// uploaded, with `schedule`.
pub fn k3_tp8_layer(
    b: &Device<B>,
    s: &CudaStream,
    schedule: ProjectionSchedule,
) -> Result<KdaLayer<B>> {
    let config = KdaConfig::kimi_k3();
    let source = SyntheticCheckpoint::new(SyntheticSpec::new(config.clone(), 0));
    let tp = hal(Tp::new(8, 0))?;
    let loaded = hal(load_layer(&source, &config, tp, 0, LoadOptions::default()))?;
    let options = LayerOptions { schedule: Some(schedule), ..LayerOptions::default() };
    let layer = hal(KdaLayer::new(b, s, &loaded.weights, options))?;
    b.synchronize(s)?;
    Ok(layer)
}

/// One request of `t` tokens, `h` heads of `d`, for KdaChunk: bf16 q, k, v and output, f32
/// log decay in [-0.5, 0] and beta in (0, 1), a fresh state (flash-linear-attention's
/// `chunk_kda` gets the same in the comparison).
pub fn chunk_problem(
    b: &Device<B>,
    s: &CudaStream,
    t: usize,
    h: usize,
    d: usize,
) -> Result<KdaChunk<B>> {
    let mut rng = Rng(13);
    Ok(KdaChunk {
        chunk_state_slots: None,
        host_meta: None,
        q: bf16_tensor(b, s, &mut rng, &[t, h, d], -1.0, 1.0)?,
        k: bf16_tensor(b, s, &mut rng, &[t, h, d], -1.0, 1.0)?,
        v: bf16_tensor(b, s, &mut rng, &[t, h, d], -1.0, 1.0)?,
        g: f32_tensor(b, s, &rng.uniform(t * h * d, -0.5, 0.0), &[t, h, d])?,
        gate: None,
        beta: f32_tensor(b, s, &rng.uniform(t * h, 0.0, 1.0), &[t, h])?,
        cu_seqlens: i32_tensor(b, s, &[0, t as i32])?,
        state_slots: i32_tensor(b, s, &[0])?,
        has_initial_state: i32_tensor(b, s, &[0])?,
        state: b.alloc(DType::F32, &[1, h, d, d])?,
        o: b.alloc(DType::BF16, &[t, h, d])?,
        scale: (d as f32).powf(-0.5),
        qk_l2norm: true,
    })
}

/// A layer or checkpoint error as the HAL error this benchmark reports, its message kept.
pub fn hal<T>(r: std::result::Result<T, impl std::fmt::Display>) -> Result<T> {
    r.map_err(|e| kda_core::Error::Backend { backend: "gpu_bench", message: e.to_string() })
}
