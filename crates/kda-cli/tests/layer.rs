//! `kda layer` end to end: a synthetic checkpoint directory and an input file go through the
//! binary; the output and final state match the f64 layer oracle, TP ranks sum to the TP 1
//! output, serial and overlapped agree bit for bit, `--dump` writes the intermediates, and bad
//! input fails with a message naming the problem.
#![allow(clippy::expect_used, clippy::unwrap_used, reason = "test setup")]

use std::path::Path;

mod common;

use common::{Input, TempDir, kda, stderr, stdout, write_inputs, write_safetensors};
use kda_model::config::Tp;
use kda_model::layer::ForgetProjection;
use kda_testkit::checkpoint::{SyntheticCheckpoint, SyntheticSpec, write_checkpoint};
use kda_testkit::conformance::layer::{Model, load, tiny_config};
use kda_testkit::oracle_kda::{gate_lower_bound, max_abs};
use kda_testkit::oracle_layer::LayerOracle;
use kda_testkit::{Gen, Tolerance};
use safetensors::tensor::{Dtype, SafeTensors};

const HIDDEN: usize = 48;
const SEED: u64 = 17;
/// Two requests (5 and 3 tokens) and one padding row.
const ROWS: usize = 9;
const QSL: [i32; 3] = [0, 5, 8];

fn checkpoint(dir: &TempDir) -> std::path::PathBuf {
    let path = dir.path("ckpt");
    let spec = SyntheticSpec::new(tiny_config(Model::K3), SEED);
    write_checkpoint(&path, &SyntheticCheckpoint::new(spec), 2).expect("checkpoint written");
    path
}

fn input(dir: &TempDir) -> (std::path::PathBuf, Vec<f32>) {
    let path = dir.path("in.safetensors");
    let hidden = Input::new(
        "hidden_states",
        Dtype::BF16,
        &[ROWS, HIDDEN],
        Gen::new(3).normal_f32(ROWS * HIDDEN, 0.0, 1.0),
    );
    let values = hidden.values.clone();
    let qsl: Vec<u8> = QSL.iter().flat_map(|v| v.to_le_bytes()).collect();
    let mut tensors =
        vec![("hidden_states".to_string(), Dtype::BF16, vec![ROWS, HIDDEN], hidden.bytes())];
    tensors.push(("query_start_loc".to_string(), Dtype::I32, vec![3], qsl));
    write_safetensors(&path, &tensors);
    (path, values)
}

fn run_layer(ckpt: &Path, input: &Path, output: &Path, extra: &[&str]) -> std::process::Output {
    let mut args = vec![
        "layer",
        "--checkpoint",
        ckpt.to_str().unwrap(),
        "--input",
        input.to_str().unwrap(),
        "--output",
        output.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    kda(&args)
}

/// Every f32 tensor of a safetensors file: name → (shape, values).
fn read_f32(path: &Path) -> std::collections::HashMap<String, (Vec<usize>, Vec<f64>)> {
    let bytes = std::fs::read(path).expect("output written");
    let st = SafeTensors::deserialize(&bytes).expect("valid safetensors");
    st.tensors()
        .into_iter()
        .map(|(name, view)| {
            assert_eq!(view.dtype(), Dtype::F32, "{name} is f32");
            let values = view
                .data()
                .chunks_exact(4)
                .map(|c| f64::from(f32::from_le_bytes([c[0], c[1], c[2], c[3]])))
                .collect();
            (name, (view.shape().to_vec(), values))
        })
        .collect()
}

/// As the conformance suite's layer tolerance: one bf16 projection flip moves a result by 2^-8.
fn tolerance(expected: &[f64]) -> Tolerance {
    Tolerance::new(1.0 / 256.0, max_abs(expected) / 256.0)
}

#[test]
fn layer_matches_the_oracle_and_tp_ranks_sum_to_tp1() {
    let dir = TempDir::new("layer");
    let ckpt = checkpoint(&dir);
    let (input, x) = input(&dir);
    let out = dir.path("out.safetensors");
    let o = run_layer(&ckpt, &input, &out, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("2 requests, 8 live of 9 tokens"), "{}", stdout(&o));
    let got = read_f32(&out);
    let (shape, output) = &got["output"];
    assert_eq!(shape, &[ROWS, HIDDEN]);
    let weights = load(&tiny_config(Model::K3), Tp::SINGLE, SEED);
    let oracle = LayerOracle::new(&weights, ForgetProjection::Composed);
    let (fs_shape, final_state) = &got["final_state"];
    assert_eq!(fs_shape, &[2, 8, 8, 8]);
    for (r, w) in QSL.windows(2).enumerate() {
        let (a, b) = (w[0] as usize, w[1] as usize);
        let (want, state) = oracle.run(&x[a * HIDDEN..b * HIDDEN], &oracle.fresh());
        tolerance(&want).assert_close(&[b - a, HIDDEN], &output[a * HIDDEN..b * HIDDEN], &want);
        let want_state = state.v_first(8, 8);
        let per = want_state.len();
        tolerance(&want_state).assert_close(
            &[8, 8, 8],
            &final_state[r * per..(r + 1) * per],
            &want_state,
        );
    }
    assert!(output[8 * HIDDEN..].iter().all(|&v| v == 0.0), "the padding row is zero");

    let mut sum = vec![0.0; output.len()];
    for rank in 0..2 {
        let part = dir.path(&format!("rank{rank}.safetensors"));
        let rank_arg = rank.to_string();
        let o = run_layer(&ckpt, &input, &part, &["--tp-size", "2", "--tp-rank", &rank_arg]);
        assert!(o.status.success(), "{}", stderr(&o));
        let got = read_f32(&part);
        assert_eq!(got["final_state"].0, [2, 4, 8, 8], "rank {rank} holds its 4 heads");
        for (acc, v) in sum.iter_mut().zip(&got["output"].1) {
            *acc += v;
        }
    }
    tolerance(output).assert_close(&[ROWS, HIDDEN], &sum, output);
}

#[test]
fn dump_writes_the_intermediates_and_schedules_agree() {
    let dir = TempDir::new("layer-dump");
    let ckpt = checkpoint(&dir);
    let (input, _) = input(&dir);
    let (serial, overlapped) = (dir.path("serial.safetensors"), dir.path("overlapped.safetensors"));
    for (path, schedule) in [(&serial, "serial"), (&overlapped, "overlapped")] {
        let o =
            run_layer(&ckpt, &input, path, &["--schedule", schedule, "--dump", "--threads", "2"]);
        assert!(o.status.success(), "{}", stderr(&o));
    }
    let (s, o) = (read_f32(&serial), read_f32(&overlapped));
    assert_eq!(s, o, "serial and overlapped schedules give the same bits");
    let shape = |name: &str| s[name].0.clone();
    assert_eq!(shape("beta"), [ROWS, 8]);
    for name in ["g1", "gate", "g2", "core_attn_out"] {
        assert_eq!(shape(name), [ROWS, 8, 8], "{name}");
    }
    assert_eq!(shape("mixed_qkv"), [ROWS, 3 * 64]);
    let live = 8;
    let beta = &s["beta"].1;
    assert!(beta[..live * 8].iter().all(|&b| b > 0.0 && b < 1.0), "beta after one sigmoid");
    assert!(beta[live * 8..].iter().all(|&b| b == 0.0), "padding rows of the dump are zero");
    // The dumped gate is the K3 gate of the dumped logits.
    let weights = load(&tiny_config(Model::K3), Tp::SINGLE, SEED);
    let (a_log, dt_bias) =
        (weights.a_log.to_f64_vec().unwrap(), weights.dt_bias.to_f64_vec().unwrap());
    let (g1, gate) = (&s["g1"].1, &s["gate"].1);
    let want: Vec<f64> = (0..live * 64)
        .map(|i| gate_lower_bound(-5.0, a_log[(i % 64) / 8], g1[i] + dt_bias[i % 64]))
        .collect();
    Tolerance::for_dtype(kda_core::DType::F32).assert_close(
        &[live, 8, 8],
        &gate[..live * 64],
        &want,
    );
}

#[test]
fn bad_input_is_named() {
    let dir = TempDir::new("layer-bad");
    let ckpt = checkpoint(&dir);
    let out = dir.path("out.safetensors");
    let write = |name: &str, hidden: usize, qsl: &[i32]| {
        let path = dir.path(name);
        let x = Input::new("hidden_states", Dtype::F32, &[4, hidden], vec![0.5; 4 * hidden]);
        let q: Vec<u8> = qsl.iter().flat_map(|v| v.to_le_bytes()).collect();
        write_safetensors(
            &path,
            &[
                ("hidden_states".into(), Dtype::F32, vec![4, hidden], x.bytes()),
                ("query_start_loc".into(), Dtype::I32, vec![qsl.len()], q),
            ],
        );
        path
    };
    let cases = [
        (
            write("narrow.safetensors", HIDDEN - 1, &[0, 4]),
            vec![],
            "expected [N, 48] (hidden_size of the checkpoint)",
        ),
        (
            write("order.safetensors", HIDDEN, &[0, 3, 2]),
            vec![],
            "not strictly increasing at request 1",
        ),
        (
            write("long.safetensors", HIDDEN, &[0, 5]),
            vec![],
            "5 live tokens but the hidden states have only 4 rows",
        ),
        (write("neg.safetensors", HIDDEN, &[0, -1]), vec![], "offsets must be non-negative"),
        (
            write("ok.safetensors", HIDDEN, &[0, 4]),
            vec!["--tp-size", "3"],
            "not divisible by tp_size = 3",
        ),
        (
            write("ok2.safetensors", HIDDEN, &[0, 4]),
            vec!["--tp-size", "2", "--tp-rank", "2"],
            "tp_rank = 2",
        ),
    ];
    for (input, extra, needle) in &cases {
        let o = run_layer(&ckpt, input, &out, extra);
        assert!(!o.status.success(), "{needle}");
        assert!(stderr(&o).contains(needle), "wanted {needle:?} in: {}", stderr(&o));
    }
    let only_hidden = dir.path("only.safetensors");
    write_inputs(
        &only_hidden,
        &[Input::new("hidden_states", Dtype::F32, &[1, HIDDEN], vec![0.0; HIDDEN])],
    );
    let o = run_layer(&ckpt, &only_hidden, &out, &[]);
    assert!(stderr(&o).contains("no tensor named \"query_start_loc\""), "{}", stderr(&o));
    let o = run_layer(&dir.path("nowhere"), &only_hidden, &out, &[]);
    assert!(!o.status.success() && stderr(&o).contains("config.json"), "{}", stderr(&o));
}
