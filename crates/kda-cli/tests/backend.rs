//! `--backend` end to end: `kda info` lists every backend kda knows; the commands run on the
//! Ascend backend where it is compiled in (`cargo xtask test` builds it over the emulated ACL
//! runtime) with the reference's results, and say cleanly why where it is not; CUDA without a
//! GPU names the reason; the timeline-only commands refuse other backends.
#![allow(clippy::expect_used, clippy::unwrap_used, reason = "test setup")]

mod common;

use std::path::Path;
use std::process::Output;

use common::{Input, TempDir, kda, stderr, stdout, write_inputs, write_safetensors};
use kda_model::config::KdaConfig;
use kda_synth::Gen;
use kda_synth::checkpoint::{SyntheticCheckpoint, SyntheticSpec, scaled_config, write_checkpoint};
use safetensors::tensor::{Dtype, SafeTensors};

/// `kda info`'s line for `backend` (the first, for the reference).
fn info_line(backend: &str) -> String {
    let o = kda(&["info"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    out.lines()
        .find(|l| l.trim_start().starts_with(&format!("{backend} ")))
        .unwrap_or_else(|| panic!("no line for {backend} in:\n{out}"))
        .to_string()
}

/// Whether this build has the Ascend backend (kda-ascend's `emulated` or `acl` feature).
fn ascend_compiled_in() -> bool {
    !info_line("ascend").contains("not compiled in")
}

/// A failed command's one-line error for a backend that is not available.
fn assert_unavailable(o: &Output, backend: &str, reason: &[&str]) {
    assert!(!o.status.success(), "should fail: {}", stdout(o));
    let err = stderr(o);
    assert!(err.starts_with(&format!("error: --backend {backend}: ")), "{err}");
    assert!(reason.iter().any(|r| err.contains(r)), "expected one of {reason:?} in: {err}");
}

/// The `checksum:` figure of a `kda run` report.
fn checksum(out: &str) -> f64 {
    out.lines()
        .find_map(|l| l.trim().strip_prefix("checksum: "))
        .expect("a checksum line")
        .parse()
        .expect("a number")
}

/// f32 core operands on every backend: the reference and the emulated Ascend runtime (whose
/// AscendC kernels execute under the twin) then agree to rounding (Ascend's default bf16
/// prefills take CANN's `aclnnChunkKdaFwd`, compared within tolerance in kda-ascend's
/// `vendor_layer` tests).
const RUN_TINY: [&str; 11] = [
    "run",
    "--preset",
    "tiny",
    "--requests",
    "2",
    "--tokens",
    "40",
    "--decode-steps",
    "2",
    "--core-operands",
    "f32",
];

fn run_tiny(backend: &str) -> Output {
    let mut args = RUN_TINY.to_vec();
    args.extend(["--backend", backend]);
    kda(&args)
}

#[test]
fn info_lists_every_backend_with_capabilities_or_the_reason() {
    let reference = info_line("reference");
    assert!(reference.contains("execution: one core per stream"), "{reference}");
    for backend in ["ascend", "cuda"] {
        let line = info_line(backend);
        assert!(
            line.contains("execution: ") && line.contains("gemm inputs: ")
                || line.contains("unavailable: "),
            "{line}"
        );
        if line.contains("not compiled in") {
            assert!(line.contains("build kda-cli with feature"), "{line}");
        }
    }
}

#[test]
fn run_on_ascend_equals_the_reference_to_rounding() {
    let o = run_tiny("ascend");
    if !ascend_compiled_in() {
        assert_unavailable(&o, "ascend", &["not compiled in: build kda-cli with feature `ascend`"]);
        assert!(stderr(&o).contains("`ascend-emulated`"), "{}", stderr(&o));
        eprintln!("kda-ascend is not compiled in: checked its error instead of its run");
        return;
    }
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    for needle in [
        "(ascend backend",
        "checked)",
        "speedup",
        "not measured (the ascend backend records no op timeline",
        "identical bit for bit: prefill, 2 decode steps, final states",
        "capture valid",
        "no hazards",
    ] {
        assert!(out.contains(needle), "missing {needle:?} in:\n{out}");
    }
    assert!(out.contains("core operands f32"), "{out}");
    let r = run_tiny("reference");
    assert!(r.status.success(), "{}", stderr(&r));
    let (ascend, reference) = (checksum(&out), checksum(&stdout(&r)));
    // The emulated runtime executes the AscendC kernels' own arithmetic: equal to rounding.
    let close = (ascend - reference).abs() <= 1e-4 * reference.abs();
    assert!(close, "ascend {ascend} vs reference {reference}");
}

/// Without `--core-operands`, `kda run` on Ascend takes the backend's choice, bf16 (the emulated
/// CANN has `aclnnChunkKdaFwd`), and its own checks hold: overlapped against serial bit for bit
/// and the captured decode steps against eager ones.
#[test]
fn run_on_ascend_defaults_to_bf16_core_operands() {
    if !ascend_compiled_in() {
        return;
    }
    let o = kda(&RUN_TINY[..9].iter().copied().chain(["--backend", "ascend"]).collect::<Vec<_>>());
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    for needle in [
        "core operands bf16",
        "identical bit for bit: prefill, 2 decode steps, final states",
        "capture valid",
    ] {
        assert!(out.contains(needle), "missing {needle:?} in:\n{out}");
    }
}

/// Every tensor of a safetensors file, by name: dtype, shape and bytes.
fn tensors(path: &Path) -> Vec<(String, Dtype, Vec<usize>, Vec<u8>)> {
    let file = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&file).unwrap();
    let mut names = st.names().into_iter().map(String::from).collect::<Vec<_>>();
    names.sort();
    names
        .into_iter()
        .map(|n| {
            let t = st.tensor(&n).unwrap();
            (n, t.dtype(), t.shape().to_vec(), t.data().to_vec())
        })
        .collect()
}

/// The values of a float tensor's little-endian bytes, or `None` for other dtypes.
fn floats(dtype: Dtype, bytes: &[u8]) -> Option<Vec<f64>> {
    let half =
        |f: fn(u16) -> f64| bytes.chunks(2).map(|b| f(u16::from_le_bytes([b[0], b[1]]))).collect();
    match dtype {
        Dtype::F32 => Some(
            bytes
                .chunks(4)
                .map(|b| f64::from(f32::from_le_bytes([b[0], b[1], b[2], b[3]])))
                .collect(),
        ),
        Dtype::BF16 => Some(half(|u| f64::from(f32::from_bits(u32::from(u) << 16)))),
        _ => None,
    }
}

/// `args` with `--output FILE --backend B` on the reference and on Ascend: the same tensors
/// (names, dtypes, shapes); integer and MX tensors bit for bit, float tensors within a
/// tolerance far above f32 rounding (1e-3 relative, 1e-3 of the largest value absolute): the
/// emulated runtime executes the AscendC kernels' own arithmetic (token-by-token recurrence,
/// the hardware's reduction order), which agrees with the reference's to rounding, not bit for
/// bit. Returns how many.
fn same_tensors_on_reference_and_ascend(dir: &TempDir, args: &[&str]) -> usize {
    let [reference, ascend] = ["reference", "ascend"].map(|backend| {
        let output = dir.path(&format!("{}-{backend}.safetensors", args[0]));
        let mut args = args.to_vec();
        args.extend(["--output", output.to_str().unwrap(), "--backend", backend]);
        let o = kda(&args);
        assert!(o.status.success(), "{args:?}: {}", stderr(&o));
        tensors(&output)
    });
    assert_eq!(reference.len(), ascend.len(), "{args:?}: tensor counts");
    for (r, a) in reference.iter().zip(&ascend) {
        assert_eq!((&r.0, r.1, &r.2), (&a.0, a.1, &a.2), "{args:?}: names, dtypes and shapes");
        match (floats(r.1, &r.3), floats(a.1, &a.3)) {
            (Some(want), Some(got)) => {
                let max = kda_testkit::oracle_kda::max_abs(&want);
                kda_testkit::Tolerance::new(1e-3, 1e-3 * max).assert_close(&r.2, &got, &want);
            }
            _ => assert_eq!(r.3, a.3, "{args:?}: {} differs between reference and ascend", r.0),
        }
    }
    reference.len()
}

#[test]
fn every_device_command_runs_on_ascend_with_the_references_results() {
    if !ascend_compiled_in() {
        let o = kda(&["check", "--preset", "tiny", "--backend", "ascend"]);
        assert_unavailable(&o, "ascend", &["not compiled in"]);
        return;
    }
    let o = kda(&["check", "--preset", "tiny", "--tokens", "8", "--backend", "ascend"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("replay: equals eager execution bit for bit"), "{}", stdout(&o));

    let dir = TempDir::new("backends");
    let mut rng = Gen::new(5);
    // quant: the MXFP8 bytes of each backend's DynamicQuant, specials included.
    let quant_in = dir.path("quant-in.safetensors");
    let mut w = rng.uniform_f32(3 * 70, -300.0, 300.0);
    (w[3], w[100]) = (f32::NAN, f32::NEG_INFINITY);
    write_inputs(&quant_in, &[Input::new("w", Dtype::F32, &[3, 70], w)]);
    let quant = ["quant", "--input", quant_in.to_str().unwrap()];
    assert_eq!(same_tensors_on_reference_and_ascend(&dir, &quant), 2, "w.data and w.scale");

    // core: both forms of the recurrence.
    let core_in = dir.path("core-in.safetensors");
    let (b, t, h, k) = (2, 70, 2, 16);
    let mut input = |name, shape: &[usize], lo, hi| {
        let count = shape.iter().product();
        Input::new(name, Dtype::BF16, shape, rng.uniform_f32(count, lo, hi))
    };
    let inputs = [
        input("q", &[b, t, h, k], -1.0, 1.0),
        input("k", &[b, t, h, k], -1.0, 1.0),
        input("v", &[b, t, h, k], -1.0, 1.0),
        input("g", &[b, t, h, k], -2.0, 0.0),
        input("beta", &[b, t, h], 0.0, 1.0),
    ];
    write_inputs(&core_in, &inputs);
    for algo in ["chunk", "recurrent"] {
        let core = ["core", "--input", core_in.to_str().unwrap(), "--algo", algo, "--l2norm"];
        assert_eq!(same_tensors_on_reference_and_ascend(&dir, &core), 2, "o and final_state");
    }

    // layer: a synthetic checkpoint directory, two prefills and a padding row.
    let ckpt = dir.path("ckpt");
    let config = scaled_config(&KdaConfig::kimi_k3(), 64, 4, 16);
    write_checkpoint(&ckpt, &SyntheticCheckpoint::new(SyntheticSpec::new(config, 3)), 1).unwrap();
    let layer_in = dir.path("layer-in.safetensors");
    let hidden =
        Input::new("hidden_states", Dtype::BF16, &[9, 64], rng.normal_f32(9 * 64, 0.0, 1.0));
    let qsl: Vec<u8> = [0i32, 5, 8].iter().flat_map(|v| v.to_le_bytes()).collect();
    write_safetensors(
        &layer_in,
        &[
            ("hidden_states".into(), Dtype::BF16, vec![9, 64], hidden.bytes()),
            ("query_start_loc".into(), Dtype::I32, vec![3], qsl),
        ],
    );
    let (ckpt, layer_in) = (ckpt.to_str().unwrap(), layer_in.to_str().unwrap());
    let layer =
        ["layer", "--checkpoint", ckpt, "--input", layer_in, "--dump", "--core-operands", "f32"];
    assert_eq!(same_tensors_on_reference_and_ascend(&dir, &layer), 8, "outputs and the dump");

    // The benchmarks: timed on Ascend, the per-op breakdown said to be missing.
    let gemm = ["bench", "gemm", "--m", "3", "--n", "5", "--k", "7", "--repeats", "1"];
    let layer = [
        "bench",
        "layer",
        "--preset",
        "tiny",
        "--prefill-requests",
        "1",
        "--prefill-len",
        "8",
        "--decode-batch",
        "2",
        "--repeats",
        "1",
        "--decode-repeats",
        "1",
    ];
    for (args, needles) in [
        (&gemm[..], &["gemm m=3 n=5 k=7", "GFLOP/s"][..]),
        (&layer[..], &["overlapped: prefill 1 x 8 tokens", "not timed (the ascend backend"][..]),
    ] {
        let mut args = args.to_vec();
        args.extend(["--backend", "ascend"]);
        let o = kda(&args);
        assert!(o.status.success(), "{args:?}: {}", stderr(&o));
        for needle in needles {
            assert!(stdout(&o).contains(needle), "{args:?}: no {needle:?} in {}", stdout(&o));
        }
    }
}

#[test]
fn cuda_without_a_gpu_names_the_reason() {
    let o = run_tiny("cuda");
    if o.status.success() {
        // A machine with a GPU: the run is the check.
        assert!(stdout(&o).contains("(cuda backend"), "{}", stdout(&o));
        return;
    }
    assert_unavailable(&o, "cuda", &["no CUDA device", "not compiled in"]);
    assert_eq!(stderr(&o).lines().count(), 1, "one line: {}", stderr(&o));
}

#[test]
fn timeline_commands_refuse_backends_without_one() {
    let dir = TempDir::new("trace-backend");
    let svg = dir.path("t.svg");
    let trace = ["trace", "--preset", "tiny", "--tokens", "4", "--svg", svg.to_str().unwrap()];
    let schedule = ["bench", "schedule", "--tokens", "2", "--repeats", "1"];
    for command in [&trace[..], &schedule[..]] {
        let mut args = command.to_vec();
        args.extend(["--backend", "ascend"]);
        let o = kda(&args);
        assert!(!o.status.success(), "{args:?} should fail");
        let err = stderr(&o);
        if ascend_compiled_in() {
            assert!(err.contains("needs an op timeline") && err.contains("ascend"), "{err}");
            assert!(err.contains("--backend reference"), "{err}");
        } else {
            assert_unavailable(&o, "ascend", &["not compiled in"]);
        }
    }
    assert!(!svg.exists(), "nothing written");
}

#[test]
fn threads_are_checked_on_every_backend() {
    for backend in ["reference", "ascend", "cuda"] {
        let o = kda(&["bench", "gemm", "--threads", "0", "--backend", backend]);
        assert!(!o.status.success(), "{backend}");
        assert!(stderr(&o).contains("--threads"), "{backend}: {}", stderr(&o));
    }
    let o = kda(&["run", "--backend", "tpu"]);
    assert!(!o.status.success());
    let err = stderr(&o);
    assert!(err.contains("reference") && err.contains("ascend") && err.contains("cuda"), "{err}");
}

/// The CLI is product code: the synthetic checkpoint and workload it runs on come from
/// kda-synth, and kda-testkit is only a dev-dependency of its tests.
#[test]
fn the_cli_does_not_depend_on_the_testkit() {
    let manifest = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml"))
        .expect("kda-cli's Cargo.toml");
    let mut table = String::new();
    let mut offending = Vec::new();
    for line in manifest.lines().map(str::trim) {
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            table = name.to_string();
            continue;
        }
        // `[dependencies]`, `[build-dependencies]`, `[target.'cfg(..)'.dependencies]`, and
        // `[dependencies.kda-testkit]`: all but the dev-dependencies ship with the binary.
        let shipped = (table.ends_with("dependencies") || table.starts_with("dependencies."))
            && !table.contains("dev-dependencies");
        let names_testkit = line.starts_with("kda-testkit") || table.ends_with(".kda-testkit");
        if shipped && names_testkit {
            offending.push(format!("[{table}] {line}"));
        }
    }
    assert!(offending.is_empty(), "kda-cli ships with kda-testkit: {offending:?}");
    assert!(manifest.contains("kda-synth"), "the embedded default comes from kda-synth");
}
