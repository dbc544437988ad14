//! Fuzz targets for everything kda parses from a file, as property tests (cargo-fuzz needs a
//! nightly toolchain): the safetensors header and data, `config.json`, the shard index, and
//! batch metadata (`BatchMeta`). See `docs/design/reliability.md`.
//!
//! Each target starts from a committed seed corpus (`tests/corpus/<target>/`, valid files that
//! reach deep into the code) and feeds mutations of it (byte flips, inserts, deletes, chunk
//! copies, truncations, "interesting" numbers spliced over digit runs or words) and wholly
//! random inputs through the real entry points: the result must be `Ok` or a typed error,
//! never a panic, and a success must keep the target's invariants. A target runs for at most
//! `KDA_FUZZ_SECONDS` (default 30) or `KDA_FUZZ_CASES` cases (default 1 000 000), in rounds of
//! fixed seeds (`KDA_FUZZ_SEED` moves them), so a CI run is bounded and reproducible.
//!
//! A crash found is shrunk by proptest, written to the temp dir and printed; committed into the
//! target's corpus directory it becomes a test: `every_corpus_file_is_handled_cleanly` replays
//! every corpus file on every run.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, reason = "test code")]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kda_core::kda::MAX_HEAD_DIM;
use kda_model::config::{KdaConfig, MAX_RMS_NORM_EPS, Tp};
use kda_model::layer::batch::CacheLimits;
use kda_model::layer::{BatchMeta, DispatchGroups, GroupKind, RequestSlots};
use kda_model::weights::source::read_all;
use kda_model::weights::{
    Checkpoint, LayerLoader, LoadOptions, TensorSource, WeightError, load_layer,
};
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestError, TestRng, TestRunner};

// ---------------------------------------------------------------------------------------------
// The corpus and the mutator.

fn corpus_dir(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/corpus").join(target)
}

/// The files of a target's corpus, by name, sorted.
fn corpus(target: &str) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(corpus_dir(target))
        .expect("the corpus directory")
        .map(|e| {
            let e = e.unwrap();
            (e.file_name().to_string_lossy().into_owned(), std::fs::read(e.path()).unwrap())
        })
        .collect()
}

/// Numbers that sit on the edges kda checks: zero, one, the i32/u32/usize limits, the head-dim
/// bound, a huge float, NaN spelled out.
const INTERESTING: [&str; 12] = [
    "0",
    "1",
    "-1",
    "512",
    "513",
    "2147483647",
    "4294967296",
    "18446744073709551615",
    "99999999999999999999999",
    "1e300",
    "NaN",
    "1.5",
];
const INTERESTING_WORDS: [u16; 6] = [0, 1, 2, 0x7FFF, 0x8000, 0xFFFF];

/// The digit runs of `b` (where a number can be replaced).
fn digit_runs(b: &[u8]) -> Vec<std::ops::Range<usize>> {
    let mut runs = Vec::new();
    let mut i = 0;
    while i < b.len() {
        if b[i].is_ascii_digit() {
            let start = i;
            while i < b.len() && b[i].is_ascii_digit() {
                i += 1;
            }
            runs.push(start..i);
        } else {
            i += 1;
        }
    }
    runs
}

/// One edit: `(position, op, byte, interesting value)`.
type Edit = (usize, u8, u8, usize);

fn apply(mut b: Vec<u8>, edits: &[Edit], cut: Option<usize>) -> Vec<u8> {
    for &(at, op, byte, k) in edits {
        let len = b.len();
        match op {
            0 if len > 0 => b[at % len] ^= byte | 1,
            1 => b.insert(at % (len + 1), byte),
            2 if len > 0 => {
                b.remove(at % len);
            }
            3 => {
                let runs = digit_runs(&b);
                if runs.is_empty() {
                    if len >= 2 {
                        let word = INTERESTING_WORDS[k % INTERESTING_WORDS.len()].to_le_bytes();
                        let i = (at % (len - 1)) & !1;
                        b[i..i + 2].copy_from_slice(&word);
                    }
                } else {
                    let run = runs[at % runs.len()].clone();
                    b.splice(run, INTERESTING[k % INTERESTING.len()].bytes());
                }
            }
            4 if len > 0 => {
                let start = at % len;
                let end = (start + usize::from(byte)).min(len);
                let chunk = b[start..end].to_vec();
                b.splice(end..end, chunk);
            }
            _ => {}
        }
    }
    if let Some(c) = cut {
        b.truncate(c % (b.len() + 1));
    }
    b
}

/// Mutations of the seeds, and now and then random bytes.
fn inputs(seeds: Vec<Vec<u8>>) -> impl Strategy<Value = Vec<u8>> {
    let n = seeds.len();
    let edit = (any::<usize>(), 0u8..5, any::<u8>(), any::<usize>());
    let mutated =
        (0..n, prop::collection::vec(edit, 1..6), prop::option::weighted(0.15, any::<usize>()))
            .prop_map(move |(seed, edits, cut)| apply(seeds[seed].clone(), &edits, cut));
    prop_oneof![12 => mutated, 1 => prop::collection::vec(any::<u8>(), 0..300)]
}

fn env_number(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// Run `target` over mutations of `seeds` until the time or case budget is spent.
fn fuzz(name: &str, seeds: Vec<Vec<u8>>, target: impl Fn(&[u8])) {
    let budget = Duration::from_secs(env_number("KDA_FUZZ_SECONDS", 30));
    let max_cases = env_number("KDA_FUZZ_CASES", 1_000_000);
    let base_seed = env_number("KDA_FUZZ_SEED", 0);
    let strategy = inputs(seeds);
    let start = Instant::now();
    let (mut cases, mut round) = (0u64, 0u64);
    const ROUND: u32 = 256;
    while start.elapsed() < budget && cases < max_cases {
        let mut seed = [0u8; 32];
        seed[..8].copy_from_slice(&base_seed.to_le_bytes());
        seed[8..16].copy_from_slice(&round.to_le_bytes());
        seed[16..16 + name.len().min(16)].copy_from_slice(&name.as_bytes()[..name.len().min(16)]);
        let config = Config {
            cases: ROUND,
            failure_persistence: None,
            max_shrink_iters: 4096,
            ..Config::default()
        };
        let rng = TestRng::from_seed(RngAlgorithm::ChaCha, &seed);
        let mut runner = TestRunner::new_with_rng(config, rng);
        let result = runner.run(&strategy, |bytes| {
            target(&bytes);
            Ok(())
        });
        if let Err(TestError::Fail(reason, bytes)) = result {
            let path = std::env::temp_dir().join(format!("kda-fuzz-{name}-crash.bin"));
            std::fs::write(&path, &bytes).unwrap();
            panic!(
                "fuzz target {name}: {reason} on {} bytes (written to {}; add it to \
                 tests/corpus/{name}/ to keep it as a test): {:?}",
                bytes.len(),
                path.display(),
                String::from_utf8_lossy(&bytes)
            );
        }
        cases += u64::from(ROUND);
        round += 1;
    }
    eprintln!("fuzz target {name}: {cases} cases in {:.1} s", start.elapsed().as_secs_f64());
}

// ---------------------------------------------------------------------------------------------
// The targets.

/// The configs of the corpus.
fn configs() -> Vec<KdaConfig> {
    corpus("config")
        .values()
        .filter_map(|b| KdaConfig::from_json_str(&String::from_utf8_lossy(b), "corpus").ok())
        .collect()
}

/// Every tensor read whole, then layers 0 and 1 loaded under each config: `Ok` or an error.
fn read_everything(c: &Checkpoint, configs: &[KdaConfig]) {
    for name in c.names() {
        if let Ok(t) = c.tensor(&name)
            && let Ok(host) = read_all(&*t)
        {
            assert_eq!(host.shape(), t.shape(), "{name}");
            assert_eq!(host.dtype(), t.dtype(), "{name}");
        }
    }
    for config in configs {
        for layer in [0, 1] {
            if let Ok(loaded) = load_layer(c, config, Tp::SINGLE, layer, LoadOptions::default()) {
                assert_eq!(loaded.weights.layer, layer);
            }
        }
    }
}

/// The safetensors header and data: parse, read, load.
fn safetensors_target(bytes: &[u8], configs: &[KdaConfig]) {
    match Checkpoint::from_bytes("fuzz.safetensors", bytes.to_vec()) {
        Ok(c) => read_everything(&c, configs),
        Err(e) => assert!(matches!(e, WeightError::Safetensors { .. }), "{e}"),
    }
}

/// `config.json`: parse and validate, then TP positions, loaders and loads of the corpus
/// checkpoints under it.
fn config_target(bytes: &[u8], checkpoints: &[Checkpoint]) {
    let Ok(config) = KdaConfig::from_json_str(&String::from_utf8_lossy(bytes), "fuzz.json") else {
        return;
    };
    let attn = &config.linear_attn_config;
    assert!(attn.head_dim >= 1 && attn.head_dim <= MAX_HEAD_DIM, "{config:?}");
    assert!(config.rms_norm_eps > 0.0 && config.rms_norm_eps <= MAX_RMS_NORM_EPS, "{config:?}");
    for size in [1, 2, 3, 8] {
        for rank in [0, size - 1, size] {
            let tp = Tp { size, rank };
            let Ok(dims) = config.dims(tp) else { continue };
            assert_eq!(dims.local_heads * size, dims.heads);
            assert!(dims.proj_range().end <= dims.proj);
            if LayerLoader::new(&config, tp, 0, LoadOptions::default()).is_err() {
                continue;
            }
            for c in checkpoints {
                for layer in [0, 1] {
                    let _ = load_layer(c, &config, tp, layer, LoadOptions::default());
                }
            }
        }
    }
}

/// The shard index: resolve against the corpus's safetensors files, read, load.
fn index_target(bytes: &[u8], files: &BTreeMap<String, Vec<u8>>, configs: &[KdaConfig]) {
    let text = String::from_utf8_lossy(bytes);
    match Checkpoint::from_index_bytes("fuzz.index.json", &text, files) {
        Ok(c) => read_everything(&c, configs),
        Err(e) => assert!(
            matches!(
                e,
                WeightError::Index { .. }
                    | WeightError::Io { .. }
                    | WeightError::Safetensors { .. }
            ),
            "{e}"
        ),
    }
}

/// Reads little-endian u16 words, zero past the end.
struct Words<'a>(&'a [u8], usize);

impl Words<'_> {
    fn next(&mut self) -> usize {
        let at = self.1;
        self.1 += 2;
        let lo = self.0.get(at).copied().unwrap_or(0);
        let hi = self.0.get(at + 1).copied().unwrap_or(0);
        usize::from(u16::from_le_bytes([lo, hi]))
    }
}

/// Bytes as one step's metadata, the rows it runs over and the cache it is checked against:
/// `rows, slots, num_spec, requests`, then per request `len, computed, kind` and a slot (kind
/// 0 to 2) or a speculative `width, slots.., accepted` (kind 3), then a `tweak` that breaks the
/// metadata's own consistency (lengths, the live count, an offset).
fn decode_batch(bytes: &[u8]) -> (BatchMeta, usize, CacheLimits) {
    let mut w = Words(bytes, 0);
    let rows = w.next();
    let limits = CacheLimits { slots: w.next(), num_spec: w.next() % 8 };
    let mut meta = BatchMeta::empty();
    for _ in 0..w.next() % 64 {
        let (len, computed, kind) = (w.next() % 70, w.next(), w.next() % 4);
        let slots = if kind == 3 {
            let width = w.next() % 8;
            let slots = (0..width).map(|_| w.next()).collect();
            RequestSlots::Speculative { slots, num_accepted: w.next() }
        } else {
            RequestSlots::Single(w.next())
        };
        meta.push(len, computed, slots);
    }
    let (tweak, value) = (w.next() % 6, w.next());
    match tweak {
        1 => {
            meta.num_computed_tokens.pop();
        }
        2 => meta.num_actual_tokens = value,
        3 if !meta.query_start_loc.is_empty() => {
            let i = value % meta.query_start_loc.len();
            meta.query_start_loc[i] = value;
        }
        4 => meta.slots.push(RequestSlots::Single(value)),
        5 => meta.query_start_loc.push(value),
        _ => {}
    }
    (meta, rows, limits)
}

/// What a plan promises about the batch it accepted.
fn check_plan(plan: &DispatchGroups, meta: &BatchMeta, rows: usize, limits: CacheLimits) {
    assert_eq!(plan.num_actual_tokens, meta.num_actual_tokens);
    assert!(plan.num_actual_tokens <= rows);
    let tokens: usize = plan.groups().map(|g| g.tokens()).sum();
    assert_eq!(tokens, plan.num_actual_tokens);
    let mut slots = BTreeSet::new();
    for g in plan.groups() {
        for s in &g.state_slots {
            let s = usize::try_from(*s).unwrap();
            assert!(s < limits.slots && slots.insert(s), "slot {s}");
        }
        assert!(g.ranges.iter().all(|r| r.end <= plan.num_actual_tokens && !r.is_empty()));
        match g.kind {
            GroupKind::Decode => assert!(g.ranges.iter().all(|r| r.len() == 1)),
            GroupKind::Speculative { tokens } => {
                assert!(g.ranges.iter().all(|r| r.len() == tokens) && tokens - 1 <= limits.num_spec)
            }
            GroupKind::Prefill => assert_eq!(g.has_initial_state.len(), g.requests()),
        }
    }
}

/// Batch metadata: the structured decoding through `DispatchGroups::new`, and the same bytes as
/// the i32 `query_start_loc` of a `kda layer` input through `BatchMeta::fresh_prefills`.
fn batch_target(bytes: &[u8]) {
    let (meta, rows, limits) = decode_batch(bytes);
    if let Ok(plan) = DispatchGroups::new(&meta, rows, limits) {
        check_plan(&plan, &meta, rows, limits);
    }
    let offsets: Vec<i32> =
        bytes.chunks_exact(4).map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    let rows = offsets.last().map_or(0, |&o| o.unsigned_abs() as usize % 5000);
    if let Ok(meta) = BatchMeta::fresh_prefills(&offsets, rows) {
        assert!(meta.num_requests() <= rows);
        let limits = CacheLimits { slots: meta.num_requests(), num_spec: 0 };
        let plan = DispatchGroups::new(&meta, rows, limits).unwrap();
        check_plan(&plan, &meta, rows, limits);
    }
}

fn checkpoints() -> Vec<Checkpoint> {
    corpus("safetensors")
        .into_iter()
        .filter_map(|(name, bytes)| Checkpoint::from_bytes(&name, bytes).ok())
        .collect()
}

// ---------------------------------------------------------------------------------------------
// The tests.

#[test]
fn fuzz_safetensors() {
    let configs = configs();
    let seeds = corpus("safetensors").into_values().collect();
    fuzz("safetensors", seeds, |b| safetensors_target(b, &configs));
}

#[test]
fn fuzz_config_json() {
    let checkpoints = checkpoints();
    fuzz("config", corpus("config").into_values().collect(), |b| config_target(b, &checkpoints));
}

#[test]
fn fuzz_shard_index() {
    let (files, configs) = (corpus("safetensors"), configs());
    fuzz("index", corpus("index").into_values().collect(), |b| index_target(b, &files, &configs));
}

#[test]
fn fuzz_batch_meta() {
    fuzz("batch", corpus("batch").into_values().collect(), batch_target);
}

/// Every corpus file (the seeds, and every crash a fuzz run found and someone committed) goes
/// through its target; and the seeds reach deep: the checkpoints load, the batches plan.
#[test]
fn every_corpus_file_is_handled_cleanly() {
    let (configs, checkpoints, files) = (configs(), checkpoints(), corpus("safetensors"));
    for bytes in files.values() {
        safetensors_target(bytes, &configs);
    }
    for bytes in corpus("config").values() {
        config_target(bytes, &checkpoints);
    }
    for bytes in corpus("index").values() {
        index_target(bytes, &files, &configs);
    }
    for bytes in corpus("batch").values() {
        batch_target(bytes);
    }

    assert_eq!(configs.len(), corpus("config").len(), "every corpus config is valid");
    let config = |name: &str| {
        let text = String::from_utf8(corpus("config")[name].clone()).unwrap();
        KdaConfig::from_json_str(&text, name).unwrap()
    };
    let load = |c: &Checkpoint, config: &KdaConfig, layer: usize| {
        load_layer(c, config, Tp::new(2, 1).unwrap(), layer, LoadOptions::default()).map(|_| ())
    };
    let k3 = Checkpoint::from_bytes("k3", files["k3-layer0.safetensors"].clone()).unwrap();
    load(&k3, &config("k3-layer0.json"), 0).unwrap();
    let kl = Checkpoint::from_bytes("kl", files["kimi-linear-layer1.safetensors"].clone()).unwrap();
    load(&kl, &config("kimi-linear-layer1.json"), 1).unwrap();
    load(&kl, &config("kimi-linear-extras.json"), 1).unwrap();
    let index = String::from_utf8(corpus("index")["three-shards.json"].clone()).unwrap();
    let sharded = Checkpoint::from_index_bytes("index", &index, &files).unwrap();
    load(&sharded, &config("k3-layer0.json"), 0).unwrap();
    load(&sharded, &config("kimi-linear-layer1.json"), 1).unwrap();
    let (meta, rows, limits) = decode_batch(&corpus("batch")["mixed.bin"]);
    let plan = DispatchGroups::new(&meta, rows, limits).unwrap();
    assert_eq!(plan.groups().count(), 3);
}
