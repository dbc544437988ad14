//! Issue #21: no input, however hostile, crashes kda, hangs it, makes it allocate what the input
//! does not hold, or destroys a file (`docs/design/reliability.md`).
//!
//! The main test runs every command over a deterministic corpus of hostile files (each at most
//! 1 MB: malformed safetensors, configs, checkpoints, batch metadata, FIFOs and devices in a
//! file's place, outputs that are inputs) under `ulimit -v 4000000` (4 GB of address space), and
//! requires each run to succeed or fail with a one-line `error:` message: never a signal, an
//! abort, a panic or a timeout. Cases that name the error they must give are the regression
//! tests of the issue's items; the other tests cover outputs and signals.
#![allow(clippy::expect_used, clippy::unwrap_used, reason = "test setup")]

mod common;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use common::{Input, TempDir, write_inputs, write_safetensors};
use kda_testkit::checkpoint::{
    SyntheticCheckpoint, SyntheticSpec, scaled_config, write_checkpoint,
};
use kda_testkit::conformance::layer::{Model, tiny_config};
use safetensors::tensor::{Dtype, SafeTensors, TensorView};

/// The address-space limit every hostile run gets, in KiB (`ulimit -v`).
const ULIMIT_V_KIB: u64 = 4_000_000;
/// The longest one run may take (a hang is a failure, not a stuck test).
const CASE_TIMEOUT: Duration = Duration::from_secs(60);
/// The largest file of the corpus.
const MAX_FILE_BYTES: u64 = 1 << 20;

/// One finished (or killed) run of the binary.
#[derive(Debug)]
struct Run {
    status: Option<ExitStatus>,
    stdout: String,
    stderr: String,
    timed_out: bool,
}

/// Run `kda args` under the address-space limit (and `extra_limits`, shell `ulimit` flags),
/// killing it after [`CASE_TIMEOUT`].
fn kda_limited(args: &[String], extra_limits: &str) -> Run {
    let script = format!("ulimit -v {ULIMIT_V_KIB}; {extra_limits} exec \"$0\" \"$@\"");
    let mut child = Command::new("sh")
        .arg("-c")
        .arg(script)
        .arg(env!("CARGO_BIN_EXE_kda"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("sh runs");
    let drain = |mut pipe: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut text = Vec::new();
            let _ = pipe.read_to_end(&mut text);
            String::from_utf8_lossy(&text).into_owned()
        })
    };
    let out = drain(Box::new(child.stdout.take().expect("stdout")));
    let err = drain(Box::new(child.stderr.take().expect("stderr")));
    let start = Instant::now();
    let (status, timed_out) = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break (Some(status), false);
        }
        if start.elapsed() > CASE_TIMEOUT {
            let _ = child.kill();
            let _ = child.wait();
            break (None, true);
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    Run { status, stdout: out.join().unwrap(), stderr: err.join().unwrap(), timed_out }
}

/// What a case must end with.
#[derive(Debug)]
enum Expect {
    /// Success or a clean error, either.
    Clean,
    /// A clean error whose message contains this.
    Error(&'static str),
    /// Success, with this on stderr (a warning) when not empty.
    Success(&'static str),
}

#[derive(Debug)]
struct Case {
    name: String,
    args: Vec<String>,
    expect: Expect,
}

/// Check that `run` ended cleanly and as `expect` says; returns the problem, if any.
fn judge(run: &Run, expect: &Expect) -> Option<String> {
    if run.timed_out {
        return Some(format!("did not finish within {CASE_TIMEOUT:?}"));
    }
    let status = run.status?;
    let Some(code) = status.code() else {
        return Some(format!("killed by a signal ({status})"));
    };
    if run.stderr.contains("panicked") {
        return Some("panicked".into());
    }
    let first = run.stderr.lines().next().unwrap_or("");
    match (code, expect) {
        (0, Expect::Error(needle)) => Some(format!("succeeded, expected an error with {needle:?}")),
        (0, Expect::Success(needle)) if !run.stderr.contains(needle) => {
            Some(format!("no {needle:?} on stderr"))
        }
        (0, _) => None,
        (1 | 2, Expect::Success(_)) => Some("failed, expected success".into()),
        (1 | 2, _) if !first.starts_with("error: ") => {
            Some("failed without a one-line `error:` message first".into())
        }
        (1 | 2, Expect::Error(needle)) if !run.stderr.contains(needle) => {
            Some(format!("the error does not say {needle:?}"))
        }
        (1 | 2, _) => None,
        (code, _) => Some(format!("exit code {code}")),
    }
}

// ---------------------------------------------------------------------------------------------
// The corpus.

/// A safetensors file from a raw header (JSON text) and data bytes: anything the format's
/// framing allows, valid or not.
fn raw_safetensors(header: &str, data: &[u8]) -> Vec<u8> {
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(data);
    bytes
}

/// A header entry `"name": {dtype, shape, data_offsets}`.
fn entry(name: &str, dtype: &str, shape: &[u64], offsets: (usize, usize)) -> String {
    format!(
        "\"{name}\": {{\"dtype\": \"{dtype}\", \"shape\": {shape:?}, \"data_offsets\": [{}, {}]}}",
        offsets.0, offsets.1
    )
}

/// Deterministic pseudo-random bytes (xorshift), for junk files.
fn junk(len: usize, mut seed: u64) -> Vec<u8> {
    (0..len)
        .map(|_| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed as u8
        })
        .collect()
}

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn i32_bytes(values: &[i32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

#[cfg(unix)]
fn mkfifo(path: &Path) {
    let status = Command::new("mkfifo").arg(path).status().expect("mkfifo runs");
    assert!(status.success(), "mkfifo {}", path.display());
}

/// Safetensors files that are broken as files, whatever command reads them.
fn broken_safetensors(dir: &TempDir) -> Vec<(String, PathBuf)> {
    let valid = {
        let path = dir.path("valid-for-cuts.safetensors");
        write_safetensors(&path, &[("x".into(), Dtype::F32, vec![64], f32_bytes(&[1.0; 64]))]);
        std::fs::read(&path).unwrap()
    };
    let mut files: Vec<(&str, Vec<u8>)> = vec![
        ("empty", Vec::new()),
        ("header-length-max", u64::MAX.to_le_bytes().to_vec()),
        ("header-longer-than-file", [1000u64.to_le_bytes().to_vec(), b"{}".to_vec()].concat()),
        ("truncated", valid[..valid.len() / 2].to_vec()),
        ("padded", [valid.clone(), vec![0; 9]].concat()),
        ("random-1mb", junk(MAX_FILE_BYTES as usize, 21)),
        (
            "deep-json",
            raw_safetensors(
                &format!("{{\"a\": {}{}}}", "[".repeat(100_000), "]".repeat(100_000)),
                b"",
            ),
        ),
        ("not-utf8-header", raw_safetensors("{\"\u{0}\u{1}\": 3}", b"")),
        (
            "offsets-overlap",
            raw_safetensors(
                &format!(
                    "{{{}, {}}}",
                    entry("a", "F32", &[2], (0, 8)),
                    entry("b", "F32", &[2], (4, 12))
                ),
                &[0; 12],
            ),
        ),
        (
            "offsets-past-end",
            raw_safetensors(
                &format!("{{{}}}", entry("a", "F32", &[1 << 40], (0, 1 << 42))),
                &[0; 16],
            ),
        ),
        (
            "shape-overflows",
            raw_safetensors(
                &format!("{{{}}}", entry("a", "F32", &[1 << 32, 1 << 32, 0], (0, 0))),
                b"",
            ),
        ),
        (
            "unknown-dtype",
            raw_safetensors(&format!("{{{}}}", entry("a", "F128", &[1], (0, 16))), &[0; 16]),
        ),
    ];
    // Many tiny tensors: a large header, a larger table, still under 1 MB.
    let many: Vec<String> =
        (0..12_000).map(|i| entry(&format!("t{i}"), "U8", &[1], (i, i + 1))).collect();
    files.push(("many-tensors", raw_safetensors(&format!("{{{}}}", many.join(",")), &[7; 12_000])));
    files
        .into_iter()
        .map(|(name, bytes)| {
            let path = dir.path(&format!("{name}.safetensors"));
            std::fs::write(&path, bytes).unwrap();
            (name.to_string(), path)
        })
        .collect()
}

/// `kda core` inputs: well-formed files whose tensors are hostile.
fn core_inputs(dir: &TempDir) -> Vec<(String, PathBuf, Expect)> {
    let mut out = Vec::new();
    let mut add = |name: &str, bytes: Vec<u8>, expect: Expect| {
        let path = dir.path(&format!("core-{name}.safetensors"));
        std::fs::write(&path, bytes).unwrap();
        out.push((name.to_string(), path, expect));
    };
    // Item 2: 403 bytes naming 2^31 - 1 requests of zero heads.
    let b = 2_147_483_647u64;
    let empty = |name: &str, shape: &[u64]| entry(name, "F32", shape, (0, 0));
    let header = [
        empty("q", &[b, 1, 0, 4]),
        empty("k", &[b, 1, 0, 4]),
        empty("g", &[b, 1, 0, 4]),
        empty("v", &[b, 1, 0, 4]),
        empty("beta", &[b, 1, 0]),
    ];
    add(
        "zero-heads",
        raw_safetensors(&format!("{{{}}}", header.join(",")), b""),
        Expect::Error("H must be at least 1"),
    );
    // Item 1: a [1, 1, 2^32, 2^32] state from a file with no tokens.
    let k = 1u64 << 32;
    let header = [
        empty("q", &[1, 0, 1, k]),
        empty("k", &[1, 0, 1, k]),
        empty("g", &[1, 0, 1, k]),
        empty("v", &[1, 0, 1, k]),
        empty("beta", &[1, 0, 1]),
    ];
    add(
        "zero-tokens-huge-state",
        raw_safetensors(&format!("{{{}}}", header.join(",")), b""),
        Expect::Error("T must be at least 1"),
    );
    // A state K·V the file does not hold: V = 1024 beside K = 1.
    let small =
        |name: &'static str, v: usize| Input::new(name, Dtype::F32, &[1, 1, 1, v], vec![0.5; v]);
    let file = dir.path("core-wide-v.safetensors");
    write_inputs(
        &file,
        &[
            small("q", 1),
            small("k", 1),
            small("g", 1),
            small("v", 1024),
            Input::new("beta", Dtype::F32, &[1, 1, 1], vec![0.5]),
        ],
    );
    out.push(("wide-v".into(), file, Expect::Error("V = 1024, expected at most 512")));
    // Valid problems: one with a NaN (computed, with a warning), one with many requests.
    let (bt, h, d) = (3, 2, 4);
    let problem = |nan: bool, batch: usize| {
        let n = batch * bt * h * d;
        let mut q = vec![0.25; n];
        if nan {
            q[5] = f32::NAN;
        }
        vec![
            Input::new("q", Dtype::F32, &[batch, bt, h, d], q),
            Input::new("k", Dtype::BF16, &[batch, bt, h, d], vec![0.5; n]),
            Input::new("g", Dtype::F32, &[batch, bt, h, d], vec![-0.1; n]),
            Input::new("v", Dtype::F32, &[batch, bt, h, d], vec![1.0; n]),
            Input::new("beta", Dtype::F32, &[batch, bt, h], vec![0.5; batch * bt * h]),
        ]
    };
    for (name, nan, batch, expect) in [
        ("valid", false, 1, Expect::Success("")),
        ("nan", true, 1, Expect::Success("non-finite")),
        ("many-requests", false, 2000, Expect::Success("")),
    ] {
        let path = dir.path(&format!("core-{name}.safetensors"));
        write_inputs(&path, &problem(nan, batch));
        out.push((name.into(), path, expect));
    }
    out
}

/// `kda quant` inputs.
fn quant_inputs(dir: &TempDir) -> Vec<(String, PathBuf, Expect)> {
    let mut out = Vec::new();
    for (name, shape, expect) in [
        ("empty-huge-rows", vec![1u64 << 40, 0], Expect::Success("")),
        ("empty-huge-k", vec![0, 1u64 << 40], Expect::Success("")),
        ("rank-3", vec![2, 2, 2], Expect::Error("expected a 1-D [K] or 2-D [N, K] tensor")),
    ] {
        let n: u64 = shape.iter().product();
        let path = dir.path(&format!("quant-{name}.safetensors"));
        let data = vec![0u8; (n * 4) as usize];
        std::fs::write(
            &path,
            raw_safetensors(&format!("{{{}}}", entry("w", "F32", &shape, (0, data.len()))), &data),
        )
        .unwrap();
        out.push((name.into(), path, expect));
    }
    let path = dir.path("quant-1mb.safetensors");
    let values: Vec<f32> =
        (0..(MAX_FILE_BYTES as usize / 4 - 64)).map(|i| (i as f32).sin()).collect();
    write_safetensors(
        &path,
        &[("w".into(), Dtype::F32, vec![values.len() / 64, 64], f32_bytes(&values))],
    );
    out.push(("1mb".into(), path, Expect::Success("")));
    let path = dir.path("quant-inf.safetensors");
    write_safetensors(
        &path,
        &[(
            "w".into(),
            Dtype::F32,
            vec![2, 32],
            f32_bytes(&[[f32::INFINITY].as_slice(), &[1.0; 63]].concat()),
        )],
    );
    out.push(("inf".into(), path, Expect::Success("non-finite")));
    out
}

/// A `kda layer` input for the tiny checkpoint: `rows` rows of hidden states (hidden size
/// 48) and `query_start_loc`.
fn write_layer_input(path: &Path, rows: usize, qsl: &[i32]) {
    let hidden = tiny_config(Model::K3).hidden_size;
    let x: Vec<f32> = (0..rows * hidden).map(|i| ((i % 97) as f32 * 0.01).sin()).collect();
    write_safetensors(
        path,
        &[
            ("hidden_states".into(), Dtype::F32, vec![rows, hidden], f32_bytes(&x)),
            ("query_start_loc".into(), Dtype::I32, vec![qsl.len()], i32_bytes(qsl)),
        ],
    );
}

/// `kda layer` inputs over the tiny checkpoint.
fn layer_inputs(dir: &TempDir) -> Vec<(String, PathBuf, Expect)> {
    let hidden = tiny_config(Model::K3).hidden_size;
    let mut out = Vec::new();
    let mut add = |name: &str, rows: usize, qsl: &[i32], expect: Expect| {
        let path = dir.path(&format!("layer-{name}.safetensors"));
        write_layer_input(&path, rows, qsl);
        out.push((name.to_string(), path, expect));
    };
    add("valid", 9, &[0, 5, 8], Expect::Success(""));
    // Item 2: a state cache sized by len(query_start_loc) before the offsets were checked.
    add("many-offsets", 4, &vec![0; 250_000], Expect::Error("not strictly increasing"));
    let climbing: Vec<i32> = (0..250_000).collect();
    add(
        "climbing-offsets",
        4,
        &climbing,
        Expect::Error("live tokens but the hidden states have only 4 rows"),
    );
    add("negative-offset", 4, &[0, -2147483648], Expect::Error("must be non-negative"));
    add("many-requests", 2000, &(0..=2000).collect::<Vec<i32>>(), Expect::Success(""));
    let path = dir.path("layer-empty-huge-rows.safetensors");
    let header = [
        entry("hidden_states", "F32", &[1 << 40, 0], (0, 0)),
        entry("query_start_loc", "I32", &[1], (0, 4)),
    ];
    std::fs::write(&path, raw_safetensors(&format!("{{{}}}", header.join(",")), &[0; 4])).unwrap();
    out.push(("empty-huge-rows".into(), path, Expect::Error("hidden_size of the checkpoint")));
    let path = dir.path("layer-nan.safetensors");
    let mut x = vec![0.1f32; 2 * hidden];
    x[hidden + 3] = f32::NAN;
    write_safetensors(
        &path,
        &[
            ("hidden_states".into(), Dtype::F32, vec![2, hidden], f32_bytes(&x)),
            ("query_start_loc".into(), Dtype::I32, vec![2], i32_bytes(&[0, 2])),
        ],
    );
    out.push(("nan".into(), path, Expect::Success("non-finite")));
    out
}

/// A tiny synthetic K3 checkpoint directory.
fn tiny_checkpoint(path: &Path) {
    let spec = SyntheticSpec::new(tiny_config(Model::K3), 5);
    write_checkpoint(path, &SyntheticCheckpoint::new(spec), 1).expect("checkpoint written");
}

/// `file` (a safetensors file) with the bytes of tensor `suffix` (layer 0) rewritten by `edit`.
fn poison(file: &Path, suffix: &str, edit: impl Fn(Dtype, &mut [u8])) {
    let bytes = std::fs::read(file).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec()))
        .collect();
    let target = tensors.iter_mut().find(|t| t.0.ends_with(suffix)).expect("the tensor");
    edit(target.1, &mut target.3);
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    std::fs::write(file, safetensors::serialize(views, None).unwrap()).unwrap();
}

/// Edit `config.json` of `dir` as JSON.
fn edit_config(dir: &Path, edit: impl Fn(&mut serde_json::Value)) {
    let path = dir.join("config.json");
    let mut json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    edit(&mut json);
    std::fs::write(&path, json.to_string()).unwrap();
}

/// Checkpoint directories, each a tiny checkpoint with one thing wrong.
fn checkpoints(dir: &TempDir) -> Vec<(String, PathBuf, Expect)> {
    let mut out = Vec::new();
    let mut add = |name: &str, expect: Expect, edit: &dyn Fn(&Path)| {
        let path = dir.path(&format!("ckpt-{name}"));
        tiny_checkpoint(&path);
        edit(&path);
        out.push((name.to_string(), path, expect));
    };
    let model = |d: &Path| d.join("model.safetensors");
    add("valid", Expect::Success(""), &|_| {});
    // Item 2 and 6: config numbers the checkpoint does not back, and a non-epsilon.
    add("head-dim-2-20", Expect::Error("head_dim = 1048576, expected at most 512"), &|d| {
        edit_config(d, |j| j["linear_attn_config"]["head_dim"] = (1 << 20).into())
    });
    add("head-dim-512", Expect::Error("expected [4096] or [8, 512]"), &|d| {
        edit_config(d, |j| j["linear_attn_config"]["head_dim"] = 512.into())
    });
    add("heads-overflow", Expect::Error("overflows"), &|d| {
        edit_config(d, |j| j["linear_attn_config"]["num_heads"] = (1u64 << 62).into())
    });
    add("eps-1e300", Expect::Error("rms_norm_eps = 1e300"), &|d| {
        edit_config(d, |j| j["rms_norm_eps"] = 1e300.into())
    });
    // Nesting under a key the config ignores (skipped without recursion): it loads.
    add("config-deep-json", Expect::Success(""), &|d| {
        edit_config(d, |j| j["x"] = 0.into());
        let text = std::fs::read_to_string(d.join("config.json")).unwrap();
        let deep = format!("{}{}", "[".repeat(400_000), "]".repeat(400_000));
        std::fs::write(d.join("config.json"), text.replacen("\"x\":0", &format!("\"x\":{deep}"), 1))
            .unwrap()
    });
    add("config-missing", Expect::Error("config.json: cannot read the config"), &|d| {
        std::fs::remove_file(d.join("config.json")).unwrap()
    });
    // Item 6: a NaN weight, a NaN E8M0 scale.
    add("nan-weight", Expect::Error("o_proj.weight: element 0 (flat, row-major) is NaN"), &|d| {
        poison(&model(d), "o_proj.weight", |dtype, b| match dtype {
            Dtype::BF16 => b[..2].copy_from_slice(&0x7FC0u16.to_le_bytes()),
            _ => b[..4].copy_from_slice(&f32::NAN.to_le_bytes()),
        })
    });
    add("nan-scale", Expect::Error("NaN (E8M0 scale byte 0xff)"), &|d| {
        poison(&model(d), "q_proj.weight_scale", |_, b| b[3] = 0xFF)
    });
    add("truncated", Expect::Error("not a valid safetensors file"), &|d| {
        let bytes = std::fs::read(model(d)).unwrap();
        std::fs::write(model(d), &bytes[..bytes.len() - 100]).unwrap()
    });
    // Item 7: a file that exists but is no regular file.
    add("model-is-dir", Expect::Error("it is a directory, expected a regular file"), &|d| {
        std::fs::remove_file(model(d)).unwrap();
        std::fs::create_dir(model(d)).unwrap();
    });
    #[cfg(unix)]
    {
        add("model-symlink-loop", Expect::Error("symbolic links"), &|d| {
            std::fs::remove_file(model(d)).unwrap();
            std::os::unix::fs::symlink("model.safetensors", model(d)).unwrap();
        });
        // Item 5: FIFOs in a file's place never block.
        add("model-is-fifo", Expect::Error("it is a FIFO"), &|d| {
            std::fs::remove_file(model(d)).unwrap();
            mkfifo(&model(d));
        });
        add("config-is-fifo", Expect::Error("it is a FIFO"), &|d| {
            std::fs::remove_file(d.join("config.json")).unwrap();
            mkfifo(&d.join("config.json"));
        });
        add("shard-is-fifo", Expect::Error("it is a FIFO"), &|d| {
            std::fs::rename(model(d), d.join("s1.safetensors")).unwrap();
            mkfifo(&d.join("s2.safetensors"));
            let index = r#"{"weight_map": {"a": "s2.safetensors"}}"#;
            std::fs::write(d.join("model.safetensors.index.json"), index).unwrap();
        });
    }
    add("shard-is-dir", Expect::Error("it is a directory, expected a regular file"), &|d| {
        std::fs::create_dir(d.join("s2.safetensors")).unwrap();
        let index = r#"{"weight_map": {"a": "s2.safetensors"}}"#;
        std::fs::write(d.join("model.safetensors.index.json"), index).unwrap();
    });
    add("index-many-shards", Expect::Error("cannot open"), &|d| {
        let map: Vec<String> =
            (0..20_000).map(|i| format!("\"t{i}\": \"s{i}.safetensors\"")).collect();
        std::fs::write(
            d.join("model.safetensors.index.json"),
            format!("{{\"weight_map\": {{{}}}}}", map.join(",")),
        )
        .unwrap();
    });
    add("index-escapes", Expect::Error("not a plain file name"), &|d| {
        std::fs::write(
            d.join("model.safetensors.index.json"),
            r#"{"weight_map": {"a": "/dev/zero"}}"#,
        )
        .unwrap();
    });
    // Shapes with a zero dimension and a huge one: no data, all header.
    add("zero-dim-weights", Expect::Error("shape [0, 1099511627776]"), &|d| {
        let header = format!(
            "{{{}}}",
            entry("model.layers.0.self_attn.q_proj.weight", "BF16", &[0, 1 << 40], (0, 0))
        );
        std::fs::write(model(d), raw_safetensors(&header, b"")).unwrap();
    });
    // A consistent checkpoint at the largest head dim kda accepts, under 1 MB: it runs.
    let path = dir.path("ckpt-big-head");
    let spec = SyntheticSpec::new(scaled_config(&tiny_config(Model::K3), 32, 1, 512), 9);
    write_checkpoint(&path, &SyntheticCheckpoint::new(spec), 1).expect("checkpoint written");
    out.push(("big-head".into(), path, Expect::Clean));
    out
}

fn s(x: impl AsRef<std::ffi::OsStr>) -> String {
    x.as_ref().to_string_lossy().into_owned()
}

/// `kda <cmd> --input IN --output OUT`.
fn io_args(cmd: &str, input: &Path, output: &Path) -> Vec<String> {
    vec![cmd.into(), "--input".into(), s(input), "--output".into(), s(output)]
}

/// `kda layer --checkpoint DIR --input IN --output OUT`.
fn layer_args(checkpoint: &Path, input: &Path, output: &Path) -> Vec<String> {
    [
        vec!["layer".into(), "--checkpoint".into(), s(checkpoint)],
        io_args("", input, output)[1..].to_vec(),
    ]
    .concat()
}

/// `kda trace --checkpoint DIR --tokens 2 <flag> FILE` (`--svg` or `--chrome`).
fn trace_args(checkpoint: &Path, flag: &str, file: &Path) -> Vec<String> {
    ["trace", "--checkpoint", &s(checkpoint), "--tokens", "2", flag, &s(file)]
        .map(String::from)
        .to_vec()
}

/// Every file under `dir`, recursively, with its size.
fn file_sizes(dir: &Path) -> Vec<(PathBuf, u64)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let e = e.unwrap();
        let meta = std::fs::symlink_metadata(e.path()).unwrap();
        if meta.is_dir() {
            out.extend(file_sizes(&e.path()));
        } else if meta.is_file() {
            out.push((e.path(), meta.len()));
        }
    }
    out
}

/// The corpus: every command over every hostile file meant for it, under 4 GB of address space.
#[test]
fn every_command_on_hostile_files_succeeds_or_fails_cleanly_under_4gb() {
    let dir = TempDir::new("hostile");
    let out_dir = dir.path("out");
    std::fs::create_dir(&out_dir).unwrap();
    let out = |name: &str| out_dir.join(format!("{name}.out"));
    let ckpt = dir.path("ckpt-tiny");
    tiny_checkpoint(&ckpt);
    let hidden_input = dir.path("layer-input.safetensors");
    write_layer_input(&hidden_input, 3, &[0, 3]);
    let mut cases: Vec<Case> = Vec::new();
    let mut case =
        |name: String, args: Vec<String>, expect: Expect| cases.push(Case { name, args, expect });

    // Files broken as safetensors, through every command that reads one.
    for (name, path) in broken_safetensors(&dir) {
        for cmd in ["core", "quant"] {
            case(format!("{cmd} {name}"), io_args(cmd, &path, &out(&name)), Expect::Clean);
        }
        case(format!("layer {name}"), layer_args(&ckpt, &path, &out(&name)), Expect::Clean);
        let as_model = dir.path(&format!("ckpt-broken-{name}"));
        tiny_checkpoint(&as_model);
        std::fs::copy(&path, as_model.join("model.safetensors")).unwrap();
        case(
            format!("check with model.safetensors = {name}"),
            vec!["check".into(), "--checkpoint".into(), s(&as_model)],
            Expect::Clean,
        );
    }
    for (name, path, expect) in core_inputs(&dir) {
        case(format!("core {name}"), io_args("core", &path, &out(&name)), expect);
    }
    for (name, path, expect) in quant_inputs(&dir) {
        case(format!("quant {name}"), io_args("quant", &path, &out(&name)), expect);
    }
    for (name, path, expect) in layer_inputs(&dir) {
        case(format!("layer {name}"), layer_args(&ckpt, &path, &out(&name)), expect);
    }
    for (name, path, expect) in checkpoints(&dir) {
        let clean = || match &expect {
            Expect::Error(e) => Expect::Error(e),
            _ => Expect::Clean,
        };
        case(
            format!("check {name}"),
            vec!["check".into(), "--checkpoint".into(), s(&path)],
            clean(),
        );
        let small_run =
            ["--requests", "2", "--tokens", "5", "--decode-steps", "2"].map(String::from);
        case(
            format!("run {name}"),
            [vec!["run".into(), "--checkpoint".into(), s(&path)], small_run.to_vec()].concat(),
            clean(),
        );
        case(format!("layer {name}"), layer_args(&path, &hidden_input, &out(&name)), Expect::Clean);
        let svg = out(&format!("{name}-svg"));
        case(format!("trace {name}"), trace_args(&path, "--svg", &svg), Expect::Clean);
    }
    // Item 5: devices and FIFOs as inputs, unbounded numbers.
    let zero = io_args("core", Path::new("/dev/zero"), &out("zero"));
    case("core /dev/zero".into(), zero, Expect::Error("it is a character device"));
    #[cfg(unix)]
    {
        let fifo = dir.path("input.fifo");
        mkfifo(&fifo);
        for cmd in ["core", "quant"] {
            let args = io_args(cmd, &fifo, &out("fifo"));
            case(format!("{cmd} fifo"), args, Expect::Error("it is a FIFO"));
        }
        let args = layer_args(&ckpt, &fifo, &out("fifo"));
        case("layer fifo".into(), args, Expect::Error("it is a FIFO"));
    }
    let args = io_args("core", &out_dir, &out("d"));
    case("core dir".into(), args, Expect::Error("it is a directory"));
    let threads = ["bench", "gemm", "--m", "4", "--n", "4", "--k", "4", "--threads", "100000"];
    case(
        "threads 100000".into(),
        threads.map(String::from).to_vec(),
        Expect::Error("threads = 100000, expected at most 1024"),
    );
    // Item 1: element counts that wrap to 0.
    for dtype in ["f32", "bf16"] {
        let big = "4294967296";
        let args = ["bench", "gemm", "--m", big, "--n", big, "--k", big, "--dtype", dtype];
        case(
            format!("gemm 2^32 {dtype}"),
            args.map(String::from).to_vec(),
            Expect::Error("is too large"),
        );
    }

    for (path, len) in file_sizes(&dir.path("")) {
        assert!(
            len <= MAX_FILE_BYTES,
            "{} has {len} bytes, more than the corpus bound",
            path.display()
        );
    }
    let mut failures = Vec::new();
    let count = cases.len();
    for c in &cases {
        let run = kda_limited(&c.args, "");
        if let Some(problem) = judge(&run, &c.expect) {
            failures.push(format!(
                "{}: {problem}\n  args: {:?}\n  stderr: {}\n  stdout: {}",
                c.name,
                c.args,
                run.stderr.trim(),
                run.stdout.lines().next().unwrap_or("")
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {count} cases failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
    let leftovers: Vec<_> = file_sizes(&out_dir)
        .into_iter()
        .filter(|(p, _)| p.to_string_lossy().contains(".tmp"))
        .collect();
    assert!(leftovers.is_empty(), "temporary files left: {leftovers:?}");
}

// ---------------------------------------------------------------------------------------------
// Outputs (item 3) and signals (item 4).

fn quant_args(input: &Path, output: &Path) -> Vec<String> {
    io_args("quant", input, output)
}

/// Item 3: a write that fails (here past `ulimit -f`, as a full disk would) leaves the previous
/// output whole and no temporary file behind, and kda says why; before, SIGXFSZ killed kda
/// and left a truncated file in place of the good one.
#[test]
fn a_failed_write_leaves_the_previous_output_whole() {
    let dir = TempDir::new("fsize");
    let input = dir.path("in.safetensors");
    let values: Vec<f32> = (0..64 * 256).map(|i| (i as f32 * 0.1).sin()).collect();
    write_safetensors(&input, &[("w".into(), Dtype::F32, vec![64, 256], f32_bytes(&values))]);
    let output = dir.path("out.safetensors");
    let run = kda_limited(&quant_args(&input, &output), "");
    assert_eq!(judge(&run, &Expect::Success("")), None, "{}", run.stderr);
    let good = std::fs::read(&output).unwrap();
    assert!(good.len() > 8 * 1024, "{}", good.len());

    // 8 blocks of 512 bytes: less than the output.
    let run = kda_limited(&quant_args(&input, &output), "ulimit -f 8;");
    assert_eq!(judge(&run, &Expect::Error("File too large")), None, "{run:?}");
    assert!(run.stderr.starts_with(&format!("error: cannot write {}", output.display())));
    assert_eq!(std::fs::read(&output).unwrap(), good, "the previous output is untouched");
    let names: Vec<String> = std::fs::read_dir(dir.path(""))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names.len(), 2, "only the input and the output: {names:?}");
}

/// Item 3: an output that is an input, or a file of the checkpoint a command loads, is refused
/// before any work, and the file is left as it was; before, kda silently overwrote it.
#[test]
fn outputs_that_are_inputs_or_checkpoint_files_are_refused() {
    let dir = TempDir::new("guard");
    let input = dir.path("in.safetensors");
    write_safetensors(&input, &[("w".into(), Dtype::F32, vec![2, 32], f32_bytes(&[0.5; 64]))]);
    let before = std::fs::read(&input).unwrap();
    let run = kda_limited(&quant_args(&input, &input), "");
    assert_eq!(judge(&run, &Expect::Error("kda never overwrites what it reads")), None, "{run:?}");
    assert_eq!(std::fs::read(&input).unwrap(), before);

    let ckpt = dir.path("ckpt");
    tiny_checkpoint(&ckpt);
    let hidden = dir.path("x.safetensors");
    write_layer_input(&hidden, 2, &[0, 2]);
    for file in ["model.safetensors", "config.json"] {
        let target = ckpt.join(file);
        let before = std::fs::read(&target).unwrap();
        for args in [layer_args(&ckpt, &hidden, &target), trace_args(&ckpt, "--chrome", &target)] {
            let run = kda_limited(&args, "");
            let needle = "kda never overwrites what it reads";
            assert_eq!(judge(&run, &Expect::Error(needle)), None, "{file}: {run:?}");
            assert_eq!(std::fs::read(&target).unwrap(), before, "{file} untouched");
        }
    }
}

/// Item 4: a SIGBUS (what a mapped checkpoint file truncated under kda raises) ends kda with a
/// one-line message and exit status 1; before, it died of the signal without a word.
#[cfg(unix)]
#[test]
fn sigbus_ends_kda_with_a_message() {
    let child = Command::new(env!("CARGO_BIN_EXE_kda"))
        .args(["bench", "gemm", "--m", "64", "--n", "64", "--k", "64", "--repeats", "100000000"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kda runs");
    std::thread::sleep(Duration::from_millis(300));
    let status = Command::new("kill").args(["-BUS", &child.id().to_string()]).status().unwrap();
    assert!(status.success());
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{:?}: {err}", out.status);
    let want = "error: a memory-mapped file shrank or changed while kda read it (SIGBUS)";
    assert!(err.starts_with(want), "{err}");
}
