//! Checkpoint loading end to end, on synthetic checkpoints: TP slicing (every rank's outputs
//! concatenate to the TP 1 outputs), sharded == single file == lazily generated, load order
//! independence (property test), and bad input (wrong shapes and dtypes, missing tensors,
//! truncated and corrupt files, configs whose heads do not divide) as clean errors.
//!
//! The corruption property tests stand in for a fuzz target (cargo-fuzz needs nightly): random
//! truncations and byte flips of a valid safetensors file, random edits of `config.json` and
//! random shard indexes must give `Ok` or a clean error, never a panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, reason = "test code")]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use kda_core::DType;
use kda_core::mx::{self, ScaleAlg};
use kda_model::config::{KdaConfig, QkvFormat, Tp};
use kda_model::weights::source::read_all;
use kda_model::weights::{
    BfgBlock, BfgMode, Checkpoint, HostTensor, LayerLoader, LayerWeights, LoadOptions, QkvWeights,
    Route, TensorSource, WeightError, layer_prefix, load_layer, route,
};
use kda_testkit::Gen;
use kda_testkit::checkpoint::{
    ALogShape, QkvStorage, SyntheticCheckpoint, SyntheticSpec, scaled_config, write_checkpoint,
};
use kda_testkit::oracle::gemm_f64;
use proptest::prelude::*;

/// K3-shaped but small: Hd 48 (a partial MXFP8 block), H 8, D 4, MXFP8 QKV stored quantized.
fn k3_small() -> KdaConfig {
    scaled_config(&KdaConfig::kimi_k3(), 48, 8, 4)
}

/// Kimi-Linear-shaped: softplus gate, low-rank output gate, dense QKV.
fn kl_small() -> KdaConfig {
    scaled_config(&KdaConfig::kimi_linear_48b(), 40, 8, 4)
}

fn synthetic(config: KdaConfig, seed: u64) -> SyntheticCheckpoint {
    SyntheticCheckpoint::new(SyntheticSpec::new(config, seed))
}

/// All tensors of `source`, in memory.
fn materialise(source: &dyn TensorSource) -> BTreeMap<String, HostTensor> {
    source
        .names()
        .into_iter()
        .map(|n| {
            let t = read_all(&*source.tensor(&n).unwrap()).unwrap();
            (n, t)
        })
        .collect()
}

fn load(source: &dyn TensorSource, config: &KdaConfig, tp: Tp) -> LayerWeights {
    load_layer(source, config, tp, 0, LoadOptions::default()).unwrap().weights
}

struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        static N: AtomicUsize = AtomicUsize::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("kda-ckpt-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        TempDir(dir)
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The fused QKV weight as exact f64 values `[3 lp, Hd]`.
fn qkv_values(w: &LayerWeights) -> Vec<f64> {
    match w.qkv.weights().unwrap() {
        QkvWeights::Dense(t) => t.to_f64_vec().unwrap(),
        QkvWeights::Mxfp8 { data, scale, .. } => {
            let [rows, k] = data.shape()[..] else { panic!("2-D") };
            mx::dequantize_f64(data.as_u8().unwrap(), scale.as_u8().unwrap(), rows, k).unwrap()
        }
    }
}

/// Columns `cols` of a row-major `[rows, width]` matrix.
fn columns(m: &[f64], width: usize, cols: std::ops::Range<usize>) -> Vec<f64> {
    m.chunks_exact(width).flat_map(|r| r[cols.clone()].to_vec()).collect()
}

/// Row-major concatenation of `[rows, w_i]` blocks along columns.
fn concat_columns(blocks: &[Vec<f64>], widths: &[usize]) -> Vec<f64> {
    let rows = blocks[0].len() / widths[0];
    let mut out = Vec::new();
    for r in 0..rows {
        for (b, &w) in blocks.iter().zip(widths) {
            out.extend_from_slice(&b[r * w..(r + 1) * w]);
        }
    }
    out
}

/// For tp in {1, 2, 4, 8}: every rank's local BFG and QKV outputs, put back in global order,
/// equal the TP 1 outputs exactly; the conv, A_log and dt_bias shards tile the TP 1 ones; the
/// row-parallel o_proj partial sums add up to the TP 1 output.
#[test]
fn tp_rank_outputs_concatenate_to_the_tp1_outputs() {
    for config in [k3_small(), kl_small()] {
        let source = synthetic(config.clone(), 11);
        let hd = config.hidden_size;
        let tokens = 5;
        let x: Vec<f64> = Gen::new(5)
            .uniform_bf16(tokens * hd, -2.0, 2.0)
            .iter()
            .map(|v| f64::from(v.to_f32()))
            .collect();
        let full = load(&source, &config, Tp::SINGLE);
        let d1 = full.dims;
        let bfg1 = gemm_f64(
            tokens,
            d1.bfg_width(),
            hd,
            &x,
            &full.bfg.weight().unwrap().to_f64_vec().unwrap(),
        );
        let qkv1 = gemm_f64(tokens, d1.qkv_width(), hd, &x, &qkv_values(&full));
        let z: Vec<f64> = Gen::new(6).uniform_f64(tokens * d1.proj, -1.0, 1.0);
        let out1 = gemm_f64(tokens, hd, d1.proj, &z, &full.o_proj.to_f64_vec().unwrap());
        for tp in [1, 2, 4, 8] {
            let ranks: Vec<LayerWeights> =
                (0..tp).map(|r| load(&source, &config, Tp::new(tp, r).unwrap())).collect();
            let (lh, lp) = (ranks[0].dims.local_heads, ranks[0].dims.local_proj);
            let mut bfg_blocks = [Vec::new(), Vec::new(), Vec::new()];
            let mut qkv_blocks = [Vec::new(), Vec::new(), Vec::new()];
            let mut partial_sum = vec![0.0f64; tokens * hd];
            for w in &ranks {
                assert_eq!(w.bfg.weight().unwrap().shape(), &[lh + 2 * lp, hd]);
                let y = gemm_f64(
                    tokens,
                    lh + 2 * lp,
                    hd,
                    &x,
                    &w.bfg.weight().unwrap().to_f64_vec().unwrap(),
                );
                for (i, block) in
                    [BfgBlock::Beta, BfgBlock::Forget, BfgBlock::Gate].into_iter().enumerate()
                {
                    bfg_blocks[i].push(columns(&y, lh + 2 * lp, w.bfg.block_rows(block).unwrap()));
                }
                let y = gemm_f64(tokens, 3 * lp, hd, &x, &qkv_values(w));
                for (i, block) in qkv_blocks.iter_mut().enumerate() {
                    block.push(columns(&y, 3 * lp, i * lp..(i + 1) * lp));
                }
                let z_local = columns(&z, d1.proj, w.dims.proj_range());
                let part = gemm_f64(tokens, hd, lp, &z_local, &w.o_proj.to_f64_vec().unwrap());
                for (s, p) in partial_sum.iter_mut().zip(part) {
                    *s += p;
                }
            }
            // Global order: every rank's beta, then every rank's F, then every rank's G.
            let mut bfg = Vec::new();
            let mut widths = Vec::new();
            for (i, blocks) in bfg_blocks.iter().enumerate() {
                bfg.extend(blocks.iter().cloned());
                widths.extend(std::iter::repeat_n(if i == 0 { lh } else { lp }, tp));
            }
            assert_eq!(concat_columns(&bfg, &widths), bfg1, "BFG, tp {tp}");
            let qkv: Vec<Vec<f64>> = qkv_blocks.into_iter().flatten().collect();
            assert_eq!(concat_columns(&qkv, &vec![lp; 3 * tp]), qkv1, "QKV, tp {tp}");
            for (a, b) in partial_sum.iter().zip(&out1) {
                assert!(
                    (a - b).abs() <= 1e-12 * (1.0 + b.abs()),
                    "o_proj all-reduce, tp {tp}: {a} vs {b}"
                );
            }
            let cat = |f: &dyn Fn(&LayerWeights) -> Vec<f32>| {
                ranks.iter().flat_map(f).collect::<Vec<f32>>()
            };
            assert_eq!(cat(&|w| w.a_log.to_f32_vec().unwrap()), full.a_log.to_f32_vec().unwrap());
            assert_eq!(
                cat(&|w| w.dt_bias.to_f32_vec().unwrap()),
                full.dt_bias.to_f32_vec().unwrap()
            );
            // Conv [W, 3 lp]: tap j, part p, channel c of rank r is TP 1's column p P + r lp + c.
            let w_conv = d1.conv_width;
            for (r, w) in ranks.iter().enumerate() {
                for j in 0..w_conv {
                    for p in 0..3 {
                        let local = &w.conv.data()[j * 3 * lp + p * lp..][..lp];
                        let global =
                            &full.conv.data()[j * 3 * d1.proj + p * d1.proj + r * lp..][..lp];
                        assert_eq!(local, global, "conv tp {tp} rank {r} tap {j} part {p}");
                    }
                }
            }
            assert!(ranks.iter().all(|w| w.o_norm == full.o_norm));
        }
    }
}

/// The same checkpoint written as one file, as 3 shards, and generated lazily loads the same
/// weights, for several TP positions, storage forms and A_log/conv shapes.
#[test]
fn sharded_checkpoint_loads_the_same_weights_as_single_file() {
    let mut specs = vec![SyntheticSpec::new(k3_small(), 21), SyntheticSpec::new(kl_small(), 22)];
    let mut dense_k3 = SyntheticSpec::new(k3_small(), 21);
    dense_k3.qkv = QkvStorage::Dense;
    dense_k3.a_log = ALogShape::Padded(5);
    dense_k3.conv_3d = false;
    dense_k3.extra_tensors = true;
    dense_k3.layers = vec![0, 3];
    specs.push(dense_k3);
    for spec in specs {
        let config = spec.config.clone();
        let source = SyntheticCheckpoint::new(spec.clone());
        let (single, sharded) = (TempDir::new("single"), TempDir::new("sharded"));
        let files = write_checkpoint(single.path(), &source, 1).unwrap();
        assert_eq!(files, vec!["config.json", "model.safetensors"]);
        let files = write_checkpoint(sharded.path(), &source, 3).unwrap();
        assert_eq!(files.len(), 5, "{files:?}");
        assert!(files.iter().any(|f| f == "model.safetensors.index.json"));
        let a = Checkpoint::open(single.path()).unwrap();
        let b = Checkpoint::open(sharded.path()).unwrap();
        assert_eq!(b.files().len(), 3);
        assert_eq!(KdaConfig::from_file(&single.path().join("config.json")).unwrap(), config);
        assert_eq!(a.names(), source.names());
        assert_eq!(b.names(), source.names());
        for &layer in &spec.layers {
            for tp in [Tp::SINGLE, Tp::new(2, 1).unwrap(), Tp::new(4, 3).unwrap()] {
                let opts = LoadOptions::default();
                let wa = load_layer(&a, &config, tp, layer, opts).unwrap();
                let wb = load_layer(&b, &config, tp, layer, opts).unwrap();
                let wl = load_layer(&source, &config, tp, layer, opts).unwrap();
                assert_eq!(wa.weights, wb.weights, "layer {layer} {tp:?}");
                assert_eq!(wa.weights, wl.weights, "layer {layer} {tp:?}");
                assert!(wa.unknown.is_empty(), "{:?}", wa.unknown);
            }
        }
    }
}

/// MXFP8 QKV stored quantized (E4M3 + scales) and stored bf16 then quantized at load with the
/// config's scale_alg give the same bytes.
#[test]
fn stored_mxfp8_qkv_equals_quantized_at_load() {
    for alg in ScaleAlg::ALL {
        let mut config = k3_small();
        config.qkv_quantization.as_mut().unwrap().scale_alg = alg.code();
        let mut stored = SyntheticSpec::new(config.clone(), 31);
        stored.qkv = QkvStorage::Mxfp8 { scale_alg: alg };
        let mut dense = stored.clone();
        dense.qkv = QkvStorage::Dense;
        for tp in [Tp::SINGLE, Tp::new(4, 1).unwrap()] {
            let a = load(&SyntheticCheckpoint::new(stored.clone()), &config, tp);
            let b = load(&SyntheticCheckpoint::new(dense.clone()), &config, tp);
            assert_eq!(a.qkv.format(), QkvFormat::Mxfp8 { scale_alg: alg });
            assert!(a.qkv.weights().is_some());
            assert_eq!(a.qkv.weights(), b.qkv.weights(), "{alg:?} {tp:?}");
        }
    }
}

/// What `kda run` needs: Kimi K3 TP8 rank 0 at full size, generated lazily (only the rank's
/// regions are materialised), with the shapes of `docs/design/kda.md#checkpoint-names`.
#[test]
fn kimi_k3_tp8_rank0_loads_lazily_at_full_size() {
    let config = KdaConfig::kimi_k3();
    let source = synthetic(config.clone(), 0);
    let w = load(&source, &config, Tp::new(8, 0).unwrap());
    assert_eq!(w.bfg.weight().unwrap().shape(), &[3084, 7168]);
    assert!(w.bfg.is_composed());
    let Some(QkvWeights::Mxfp8 { data, scale, scale_alg }) = w.qkv.weights() else {
        panic!("MXFP8")
    };
    assert_eq!(
        (data.shape(), scale.shape(), scale_alg),
        (&[4608usize, 7168][..], &[4608usize, 224][..], ScaleAlg::OcpFloor)
    );
    assert_eq!(w.conv.shape(), [4, 4608]);
    assert_eq!(w.o_proj.shape(), &[7168, 1536]);
    assert_eq!((w.a_log.shape(), w.dt_bias.shape()), (&[12usize][..], &[1536usize][..]));
}

// ---------------------------------------------------------------------------------------------
// Load order.

/// Every tensor of layer 0 of `config` under two seeds (canonical and alternative values).
fn two_versions(config: &KdaConfig) -> (Vec<String>, [BTreeMap<String, HostTensor>; 2]) {
    let a = materialise(&synthetic(config.clone(), 41));
    let b = materialise(&synthetic(config.clone(), 42));
    (a.keys().cloned().collect(), [a, b])
}

fn load_sequence(
    config: &KdaConfig,
    tp: Tp,
    mode: BfgMode,
    versions: &[BTreeMap<String, HostTensor>; 2],
    events: &[(String, usize)],
) -> LayerWeights {
    let opts = LoadOptions { bfg_mode: mode, ..LoadOptions::default() };
    let mut loader = LayerLoader::new(config, tp, 0, opts).unwrap();
    for (name, v) in events {
        let Route::Param { param, .. } = route(name) else { panic!("{name}") };
        loader.load(param, &versions[*v][name]).unwrap();
    }
    loader.finish().unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Random load orders with random repeated reloads (of other values, then of the final
    /// ones) give the same layer as loading each tensor once in canonical order.
    #[test]
    fn random_load_orders_with_reloads_match_the_canonical_order(
        low_rank in any::<bool>(),
        staged in any::<bool>(),
        rank in 0usize..4,
        keys in prop::collection::vec(any::<u32>(), 40),
        extra in prop::collection::vec((0usize..64, any::<bool>()), 0..24),
    ) {
        let config = if low_rank { kl_small() } else { k3_small() };
        let tp = Tp::new(4, rank).unwrap();
        let mode = if staged { BfgMode::Staged } else { BfgMode::Composed };
        let (names, versions) = two_versions(&config);
        let canonical: Vec<(String, usize)> = names.iter().map(|n| (n.clone(), 0)).collect();
        let want = load_sequence(&config, tp, mode, &versions, &canonical);

        // Each name once plus extra reloads, shuffled by the random keys.
        let mut events: Vec<(String, usize)> = canonical.clone();
        events.extend(extra.iter().map(|&(i, alt)| (names[i % names.len()].clone(), usize::from(alt))));
        let mut keyed: Vec<(u32, usize)> = (0..events.len()).map(|i| (keys[i % keys.len()] ^ (i as u32).wrapping_mul(2654435761), i)).collect();
        keyed.sort();
        let mut shuffled: Vec<(String, usize)> = keyed.into_iter().map(|(_, i)| events[i].clone()).collect();
        // The last load of every name carries the canonical values.
        let mut seen = std::collections::BTreeSet::new();
        for e in shuffled.iter_mut().rev() {
            if seen.insert(e.0.clone()) {
                e.1 = 0;
            }
        }
        let got = load_sequence(&config, tp, mode, &versions, &shuffled);
        prop_assert_eq!(got, want);
    }
}

/// Factors loaded while the packed weight has no storage, in every order of the four BFG
/// sources, are composed once storage exists: the result never depends on the order.
#[test]
fn deferred_bfg_every_source_order_composes() {
    let config = k3_small();
    let (_, versions) = two_versions(&config);
    let pre = layer_prefix(0);
    let bfg_names: Vec<String> =
        ["b_proj.weight", "f_a_proj.weight", "f_b_proj.weight", "g_proj.weight"]
            .iter()
            .map(|s| format!("{pre}{s}"))
            .collect();
    let others: Vec<(String, usize)> =
        versions[0].keys().filter(|n| !bfg_names.contains(n)).map(|n| (n.clone(), 0)).collect();
    let tp = Tp::new(2, 1).unwrap();
    let mut results = Vec::new();
    // All 24 permutations.
    let mut perm = [0usize, 1, 2, 3];
    loop {
        let mut events = others.clone();
        events.extend(perm.iter().map(|&i| (bfg_names[i].clone(), 0)));
        results.push(load_sequence(&config, tp, BfgMode::Composed, &versions, &events));
        // Next permutation (lexicographic).
        let Some(i) = (0..3).rev().find(|&i| perm[i] < perm[i + 1]) else { break };
        let j = (i + 1..4).rev().find(|&j| perm[j] > perm[i]).unwrap();
        perm.swap(i, j);
        perm[i + 1..].reverse();
    }
    assert_eq!(results.len(), 24);
    assert!(results.iter().all(|r| r == &results[0]));
    assert!(results[0].bfg.is_composed());
}

// ---------------------------------------------------------------------------------------------
// Bad input.

fn load_map(map: &BTreeMap<String, HostTensor>, config: &KdaConfig, tp: Tp) -> WeightError {
    load_layer(map, config, tp, 0, LoadOptions::default()).unwrap_err()
}

#[test]
fn wrong_shape_wrong_dtype_missing_tensor_are_one_clear_error_each() {
    let config = k3_small();
    let pre = layer_prefix(0);
    let good = materialise(&synthetic(config.clone(), 51));
    let tp = Tp::new(2, 0).unwrap();

    let mut m = good.clone();
    m.insert(format!("{pre}f_b_proj.weight"), HostTensor::zeros(DType::BF16, &[32, 5]).unwrap());
    assert_eq!(
        load_map(&m, &config, tp).to_string(),
        "model.layers.0.self_attn.f_b_proj.weight: shape [32, 5], expected [32, 4] (global) or \
         [16, 4] (this rank's slice)"
    );

    let mut m = good.clone();
    m.insert(format!("{pre}A_log"), HostTensor::from_bytes(DType::U8, &[8], vec![0; 8]).unwrap());
    assert_eq!(
        load_map(&m, &config, tp).to_string(),
        "model.layers.0.self_attn.A_log: dtype u8, expected bf16, f16 or f32"
    );

    let mut m = good.clone();
    m.insert(
        format!("{pre}q_proj.weight_scale"),
        HostTensor::zeros(DType::BF16, &[32, 2]).unwrap(),
    );
    assert_eq!(
        load_map(&m, &config, tp).to_string(),
        "model.layers.0.self_attn.q_proj.weight_scale: dtype bf16, expected u8 or F8_E8M0"
    );

    let mut m = good.clone();
    for s in ["o_proj.weight", "k_proj.weight_scale", "f_a_proj.weight"] {
        m.remove(&format!("{pre}{s}"));
    }
    let e = load_map(&m, &config, tp);
    assert_eq!(
        e.to_string(),
        "layer 0: 3 tensor(s) missing: model.layers.0.self_attn.f_a_proj.weight, \
         model.layers.0.self_attn.k_proj.weight_scale, model.layers.0.self_attn.o_proj.weight"
    );

    // Without b and g the packed weight never gets storage: still one clean error, no crash.
    let mut m = good.clone();
    m.remove(&format!("{pre}b_proj.weight"));
    m.remove(&format!("{pre}g_proj.weight"));
    let e = load_map(&m, &config, tp).to_string();
    assert!(
        e.contains("2 tensor(s) missing")
            && e.contains("b_proj.weight")
            && e.contains("g_proj.weight"),
        "{e}"
    );

    // A KL checkpoint under a K3 config: the low-rank gate names are refused by name.
    let kl = materialise(&synthetic(scaled_config(&KdaConfig::kimi_linear_48b(), 48, 8, 4), 52));
    let e = load_map(&kl, &config, tp).to_string();
    assert!(e.contains("g_a_proj.weight") && e.contains("full-rank output gate"), "{e}");
}

#[test]
fn unknown_layer_names_are_reported_and_strict_mode_refuses_them() {
    let config = kl_small();
    let mut m = materialise(&synthetic(config.clone(), 53));
    let unknown = format!("{}rotary_emb.inv_freq", layer_prefix(0));
    m.insert(unknown.clone(), HostTensor::zeros(DType::F32, &[2]).unwrap());
    m.insert(
        "model.layers.0.mlp.up_proj.weight".into(),
        HostTensor::zeros(DType::F32, &[2]).unwrap(),
    );
    m.insert(
        format!("{}rotary_emb.inv_freq", layer_prefix(1)),
        HostTensor::zeros(DType::F32, &[2]).unwrap(),
    );
    let loaded = load_layer(&m, &config, Tp::SINGLE, 0, LoadOptions::default()).unwrap();
    assert_eq!(loaded.unknown, vec![unknown.clone()]);
    let strict = LoadOptions { strict: true, ..LoadOptions::default() };
    let e = load_layer(&m, &config, Tp::SINGLE, 0, strict).unwrap_err();
    assert_eq!(e, WeightError::Unknown { layer: 0, names: vec![unknown] });
}

#[test]
fn heads_that_do_not_divide_and_bad_ranks_are_config_errors() {
    let config = k3_small();
    let source = synthetic(config.clone(), 54);
    let e = load_layer(&source, &config, Tp { size: 3, rank: 0 }, 0, LoadOptions::default())
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "linear_attn_config.num_heads = 8 is not divisible by tp_size = 3 (expected a tp_size that \
         divides the head count)"
    );
    let e = load_layer(&source, &config, Tp { size: 4, rank: 4 }, 0, LoadOptions::default())
        .unwrap_err();
    assert_eq!(e.to_string(), "tp_rank = 4, expected a rank below tp_size = 4");
    let mut zero = config.clone();
    zero.linear_attn_config.head_dim = 0;
    let e = load_layer(&source, &zero, Tp::SINGLE, 0, LoadOptions::default()).unwrap_err();
    assert_eq!(e.to_string(), "linear_attn_config.head_dim = 0, expected at least 1");
}

#[test]
fn truncated_corrupt_and_missing_files_name_the_file() {
    let config = kl_small();
    let source = synthetic(config.clone(), 55);
    let dir = TempDir::new("bad");
    write_checkpoint(dir.path(), &source, 1).unwrap();
    let file = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&file).unwrap();

    std::fs::write(&file, &bytes[..bytes.len() - 7]).unwrap();
    let e = Checkpoint::open(dir.path()).unwrap_err().to_string();
    assert!(e.starts_with(&format!("{}: not a valid safetensors file", file.display())), "{e}");

    let mut corrupt = bytes.clone();
    corrupt[8] = b'[';
    std::fs::write(&file, &corrupt).unwrap();
    assert!(matches!(Checkpoint::open(dir.path()), Err(WeightError::Safetensors { .. })));

    std::fs::write(&file, b"").unwrap();
    let e = Checkpoint::open(dir.path()).unwrap_err().to_string();
    assert!(e.starts_with(&file.display().to_string()), "{e}");

    std::fs::remove_file(&file).unwrap();
    let e = Checkpoint::open(dir.path()).unwrap_err().to_string();
    assert!(e.contains("neither model.safetensors.index.json nor model.safetensors exists"), "{e}");

    // A shard named by the index but absent.
    let sharded = TempDir::new("bad-sharded");
    let files = write_checkpoint(sharded.path(), &source, 2).unwrap();
    std::fs::remove_file(sharded.path().join(&files[1])).unwrap();
    let e = Checkpoint::open(sharded.path()).unwrap_err().to_string();
    assert!(e.contains(&files[1]) && e.contains("cannot open"), "{e}");

    let e = KdaConfig::from_file(&dir.path().join("nope.json")).unwrap_err().to_string();
    assert!(e.contains("nope.json: cannot read the config"), "{e}");
}

// ---------------------------------------------------------------------------------------------
// Corruption properties (the fuzz targets).

/// A small valid single-file checkpoint, and its config.
fn small_file() -> (KdaConfig, Vec<u8>) {
    let config = scaled_config(&KdaConfig::kimi_k3(), 32, 2, 2);
    let map = materialise(&synthetic(config.clone(), 61));
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = map
        .iter()
        .map(|(n, t)| {
            let dtype = kda_model::weights::checkpoint::dtype_to_safetensors(t.dtype());
            (
                n.clone(),
                safetensors::tensor::TensorView::new(dtype, t.shape().to_vec(), t.as_bytes())
                    .unwrap(),
            )
        })
        .collect();
    (config, safetensors::serialize(views, None).unwrap())
}

/// Open and load, reporting only whether it succeeded: the property is that it returns.
fn try_load(config: &KdaConfig, bytes: Vec<u8>) -> bool {
    match Checkpoint::from_bytes("fuzz.safetensors", bytes) {
        Ok(c) => load_layer(&c, config, Tp::SINGLE, 0, LoadOptions::default()).is_ok(),
        Err(e) => {
            assert!(matches!(e, WeightError::Safetensors { .. }), "{e}");
            false
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn truncated_safetensors_never_panic(cut in 0usize..100_000) {
        let (config, bytes) = small_file();
        let cut = cut % bytes.len();
        prop_assert!(!try_load(&config, bytes[..cut].to_vec()));
    }

    #[test]
    fn flipped_bytes_never_panic(flips in prop::collection::vec((any::<usize>(), any::<u8>()), 1..6), header_only in any::<bool>()) {
        let (config, mut bytes) = small_file();
        let header = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        for (at, v) in flips {
            let at = if header_only { at % header } else { at % bytes.len() };
            bytes[at] ^= v | 1;
        }
        try_load(&config, bytes);
    }

    #[test]
    fn edited_config_json_never_panics(
        flips in prop::collection::vec((any::<usize>(), any::<u8>()), 1..4),
        tp in 1usize..9,
        rank in 0usize..9,
    ) {
        let mut text = k3_small().to_json().into_bytes();
        for (at, v) in flips {
            let at = at % text.len();
            // Mostly digits, so numbers change rather than the JSON breaking every time.
            text[at] = if v % 3 == 0 { v } else { b'0' + v % 10 };
        }
        let text = String::from_utf8_lossy(&text);
        if let Ok(config) = KdaConfig::from_json_str(&text, "fuzz.json")
            && let Ok(dims) = config.dims(Tp { size: tp, rank }) {
                prop_assert!(dims.local_heads * tp == dims.heads);
                let _ = LayerLoader::new(&config, Tp { size: tp, rank }, 0, LoadOptions::default());
            }
    }

    #[test]
    fn random_shard_indexes_never_panic(
        entries in prop::collection::vec(("[a-z._]{0,12}", "[a-z0-9./\\\\]{0,12}"), 0..6),
        raw in "\\PC{0,40}",
    ) {
        let (_, bytes) = small_file();
        let files = BTreeMap::from([("a.safetensors".to_string(), bytes)]);
        let map: BTreeMap<String, String> = entries.into_iter().collect();
        let index = serde_json::json!({ "weight_map": map }).to_string();
        let _ = Checkpoint::from_index_bytes("fuzz-index", &index, &files);
        let _ = Checkpoint::from_index_bytes("fuzz-index", &raw, &files);
    }
}

/// The unflipped file loads, so the properties above exercise real loading, not only header
/// rejection.
#[test]
fn the_fuzz_seed_file_is_valid() {
    let (config, bytes) = small_file();
    assert!(try_load(&config, bytes));
}

// ---------------------------------------------------------------------------------------------
// Hostile checkpoints (issue #21).

/// `map` with element `index` of tensor `suffix` (layer 0) replaced by `value` (floats) or the
/// byte `value as u8` (one-byte dtypes).
fn poisoned(
    map: &BTreeMap<String, HostTensor>,
    suffix: &str,
    index: usize,
    value: f32,
) -> BTreeMap<String, HostTensor> {
    let name = format!("{}{suffix}", layer_prefix(0));
    let t = &map[&name];
    let bad = match t.to_f32_vec() {
        Some(mut v) => {
            v[index] = value;
            HostTensor::from_f32_as(t.dtype(), t.shape(), &v).unwrap()
        }
        None => {
            let mut bytes = t.as_u8().unwrap().to_vec();
            bytes[index] = value as u8;
            HostTensor::from_bytes(t.dtype(), t.shape(), bytes).unwrap()
        }
    };
    let mut m = map.clone();
    m.insert(name, bad);
    m
}

/// Item 6: NaN or infinite weights, a NaN E4M3 weight byte or a NaN E8M0 scale (0xFF) are
/// refused at load, naming the tensor and the first bad element's flat index in the whole
/// tensor (not in this rank's slice); before, they loaded and gave NaN outputs with exit 0.
#[test]
fn non_finite_weights_are_refused_naming_the_tensor_and_index() {
    let config = k3_small();
    let good = materialise(&synthetic(config.clone(), 71));
    let tp = Tp::new(2, 1).unwrap();
    assert!(load_layer(&good, &config, tp, 0, LoadOptions::default()).is_ok());
    let pre = layer_prefix(0);
    // q_proj is [32, 48] E4M3 bytes with [32, 2] scales; rank 1 of 2 reads rows 16..32.
    for (suffix, index, value, what) in [
        ("o_proj.weight", 48 * 2 + 30, f32::NAN, "NaN"),
        ("f_a_proj.weight", 5, f32::INFINITY, "inf"),
        ("b_proj.weight", 7 * 48 + 1, f32::NEG_INFINITY, "-inf"),
        ("A_log", 6, f32::NAN, "NaN"),
        ("q_proj.weight", 20 * 48 + 3, 255.0, "NaN (E4M3 byte 0xff)"),
        ("k_proj.weight_scale", 17 * 2 + 1, 255.0, "NaN (E8M0 scale byte 0xff)"),
    ] {
        let e = load_layer(
            &poisoned(&good, suffix, index, value),
            &config,
            tp,
            0,
            LoadOptions::default(),
        )
        .unwrap_err();
        assert_eq!(
            e,
            WeightError::NonFinite { param: format!("{pre}{suffix}"), index, value: what.into() },
            "{suffix}"
        );
        assert!(e.to_string().contains("a weight must be finite"), "{e}");
    }
    // Rows another rank owns are not this rank's to judge: rank 1 never reads q_proj row 3.
    let other_rank = poisoned(&good, "q_proj.weight", 3 * 48, 255.0);
    assert!(load_layer(&other_rank, &config, tp, 0, LoadOptions::default()).is_ok());
}

/// A source that counts the tensors read from it.
struct CountingSource<'a> {
    inner: &'a dyn TensorSource,
    reads: std::cell::Cell<usize>,
}

#[derive(Debug)]
struct CountingTensor<'a> {
    inner: Box<dyn kda_model::weights::TensorRead + 'a>,
    reads: &'a std::cell::Cell<usize>,
}

impl kda_model::weights::TensorRead for CountingTensor<'_> {
    fn dtype(&self) -> DType {
        self.inner.dtype()
    }
    fn shape(&self) -> &[usize] {
        self.inner.shape()
    }
    fn read(&self, region: &[std::ops::Range<usize>]) -> Result<HostTensor, WeightError> {
        self.reads.set(self.reads.get() + 1);
        self.inner.read(region)
    }
}

impl TensorSource for CountingSource<'_> {
    fn origin(&self) -> String {
        self.inner.origin()
    }
    fn names(&self) -> Vec<String> {
        self.inner.names()
    }
    fn tensor(
        &self,
        name: &str,
    ) -> Result<Box<dyn kda_model::weights::TensorRead + '_>, WeightError> {
        Ok(Box::new(CountingTensor { inner: self.inner.tensor(name)?, reads: &self.reads }))
    }
}

/// Item 2: a config the checkpoint does not back (a head dim of 512 against tensors of 4, or
/// a tensor missing) fails before a single tensor is read, so before the fused weights'
/// storage (sized by the config) is allocated. Before, `A_log` and `b_proj` were read and the
/// packed BFG weight allocated at the config's size first.
#[test]
fn a_config_the_checkpoint_does_not_back_fails_before_anything_is_read() {
    let config = k3_small();
    let good = materialise(&synthetic(config.clone(), 72));
    let mut wide = config.clone();
    wide.linear_attn_config.head_dim = 512;
    let source = CountingSource { inner: &good, reads: std::cell::Cell::new(0) };
    let e = load_layer(&source, &wide, Tp::SINGLE, 0, LoadOptions::default()).unwrap_err();
    assert!(matches!(e, WeightError::Shape { .. }), "{e}");
    assert_eq!(source.reads.get(), 0, "{e}");

    let mut m = good.clone();
    m.remove(&format!("{}g_proj.weight", layer_prefix(0)));
    let source = CountingSource { inner: &m, reads: std::cell::Cell::new(0) };
    let e = load_layer(&source, &config, Tp::SINGLE, 0, LoadOptions::default()).unwrap_err();
    assert_eq!(
        e.to_string(),
        "layer 0: 1 tensor(s) missing: model.layers.0.self_attn.g_proj.weight"
    );
    assert_eq!(source.reads.get(), 0);
}
