//! `kda core` end to end: a generated safetensors file goes through the binary and comes back
//! exactly as the library computes it (the same op on the reference backend), for both
//! algorithms, with and without an initial state, f32 and bf16 inputs; bad files fail with a
//! message naming the tensor.
#![allow(clippy::expect_used, clippy::unwrap_used, reason = "test setup")]

use std::path::Path;

mod common;

use common::{Input, TempDir, kda, stderr, write_inputs, write_safetensors};
use half::bf16;
use kda_core::kda::{KdaChunk, KdaRecurrent};
use kda_core::{DType, Layout, Op, Tensor};
use kda_reference::ReferenceBackend;
use kda_testkit::oracle_kda::{KdaSequence, kda_recurrence, max_abs, recurrence_tolerance};
use kda_testkit::{Gen, Tolerance};
use safetensors::tensor::{Dtype, SafeTensors};

impl Input {
    fn dtype(&self) -> DType {
        if self.dtype == Dtype::BF16 { DType::BF16 } else { DType::F32 }
    }
}

/// A problem `[B, T, H, K]` with L2-normalisable keys, gates in `[-2, 0]` and beta in `[0, 1]`.
fn problem(
    dims: (usize, usize, usize, usize, usize),
    dtype: Dtype,
    initial: bool,
    seed: u64,
) -> Vec<Input> {
    let (b, t, h, k, v) = dims;
    let mut rng = Gen::new(seed);
    let n = b * t * h;
    let mut inputs = vec![
        Input::new("q", dtype, &[b, t, h, k], rng.uniform_f32(n * k, -1.0, 1.0)),
        Input::new("k", dtype, &[b, t, h, k], rng.uniform_f32(n * k, -1.0, 1.0)),
        Input::new("v", dtype, &[b, t, h, v], rng.uniform_f32(n * v, -1.0, 1.0)),
        Input::new("g", dtype, &[b, t, h, k], rng.uniform_f32(n * k, -2.0, 0.0)),
        Input::new("beta", dtype, &[b, t, h], rng.uniform_f32(n, 0.0, 1.0)),
    ];
    if initial {
        inputs.push(Input::new(
            "initial_state",
            dtype,
            &[b, h, k, v],
            rng.uniform_f32(b * h * k * v, -1.0, 1.0),
        ));
    }
    inputs
}

/// Read `o` and `final_state` (f32) of an output file.
fn read_output(path: &Path) -> (Vec<usize>, Vec<f32>, Vec<usize>, Vec<f32>) {
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let get = |name: &str| {
        let t = st.tensor(name).unwrap();
        assert_eq!(t.dtype(), Dtype::F32, "{name} is f32");
        let values = t
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        (t.shape().to_vec(), values)
    };
    let ((os, o), (ss, s)) = (get("o"), get("final_state"));
    (os, o, ss, s)
}

/// The library's answer: the same op the command builds, launched here on the reference
/// backend (one core per stream, like the command's default).
fn library(
    inputs: &[Input],
    dims: (usize, usize, usize, usize, usize),
    chunk: bool,
    scale: f32,
    l2norm: bool,
) -> (Vec<f32>, Vec<f32>) {
    let (bb, t, h, k, v) = dims;
    let backend = ReferenceBackend::new();
    let s = backend.new_stream().unwrap();
    let find = |name: &str| inputs.iter().find(|i| i.name == name);
    let upload = |name: &str, shape: &[usize]| -> Tensor<ReferenceBackend> {
        let input = find(name).unwrap();
        let dst = backend.alloc(input.dtype(), shape).unwrap();
        match input.dtype() {
            DType::BF16 => {
                let vals: Vec<bf16> = input.values.iter().map(|&x| bf16::from_f32(x)).collect();
                backend.upload(&s, &dst, &vals).unwrap();
            }
            _ => backend.upload(&s, &dst, &input.values).unwrap(),
        }
        dst
    };
    let ints = |shape: &[usize], values: &[i32]| {
        let dst = backend.alloc(DType::I32, shape).unwrap();
        backend.upload(&s, &dst, values).unwrap();
        dst
    };
    let kfirst = backend.alloc(DType::F32, &[bb, h, k, v]).unwrap();
    let init = find("initial_state").map_or(vec![0.0; bb * h * k * v], |i| i.values.clone());
    backend.upload(&s, &kfirst, &init).unwrap();
    let layout = Layout::strided(DType::F32, &[bb, h, v, k], &[h * k * v, k * v, 1, v], 0).unwrap();
    let state = Tensor::new(kfirst.buffer().clone(), layout).unwrap();
    let o = backend.alloc(DType::F32, &[bb, t, h, v]).unwrap();
    let slots: Vec<i32> = (0..bb as i32).collect();
    let op = if chunk {
        let n = bb * t;
        Op::KdaChunk(KdaChunk {
            chunk_state_slots: None,
            q: upload("q", &[n, h, k]),
            k: upload("k", &[n, h, k]),
            v: upload("v", &[n, h, v]),
            g: upload("g", &[n, h, k]),
            gate: None,
            beta: upload("beta", &[n, h]),
            cu_seqlens: ints(&[bb + 1], &(0..=bb as i32).map(|r| r * t as i32).collect::<Vec<_>>()),
            state_slots: ints(&[bb], &slots),
            has_initial_state: ints(&[bb], &vec![1; bb]),
            state,
            o: o.reshape(&[n, h, v]).unwrap(),
            scale,
            qk_l2norm: l2norm,
        })
    } else {
        let mut state_slots = vec![-1; bb * t];
        for r in 0..bb {
            state_slots[r * t + t - 1] = r as i32;
        }
        Op::KdaRecurrent(KdaRecurrent {
            q: upload("q", &[bb, t, h, k]),
            k: upload("k", &[bb, t, h, k]),
            v: upload("v", &[bb, t, h, v]),
            g: upload("g", &[bb, t, h, k]),
            beta: upload("beta", &[bb, t, h]),
            state_slots: ints(&[bb, t], &state_slots),
            num_accepted_tokens: Some(ints(&[bb], &vec![t as i32; bb])),
            state,
            o: o.clone(),
            scale,
            qk_l2norm: l2norm,
        })
    };
    backend.launch(&s, op).unwrap();
    (backend.download::<f32>(&s, &o).unwrap(), backend.download::<f32>(&s, &kfirst).unwrap())
}

#[test]
fn core_reproduces_the_library_exactly() {
    let dir = TempDir::new("exact");
    let dims = (2, 70, 3, 16, 8);
    let (b, t, h, k, v) = dims;
    for (case, (dtype, initial)) in
        [(Dtype::F32, true), (Dtype::BF16, false), (Dtype::BF16, true)].into_iter().enumerate()
    {
        let inputs = problem(dims, dtype, initial, case as u64);
        let input = dir.path(&format!("in{case}.safetensors"));
        write_inputs(&input, &inputs);
        for (algo, chunk) in [("chunk", true), ("recurrent", false)] {
            let output = dir.path(&format!("out{case}-{algo}.safetensors"));
            let out = kda(&[
                "core",
                "--input",
                input.to_str().unwrap(),
                "--output",
                output.to_str().unwrap(),
                "--algo",
                algo,
                "--l2norm",
            ]);
            assert!(out.status.success(), "{algo}: {}", stderr(&out));
            let said = String::from_utf8_lossy(&out.stdout).into_owned();
            assert!(
                said.contains(&format!("kda core ({algo}): B={b} T={t} H={h} K={k} V={v}")),
                "{said}"
            );
            let (o_shape, o, s_shape, s) = read_output(&output);
            assert_eq!((o_shape, s_shape), (vec![b, t, h, v], vec![b, h, k, v]));
            let (o_lib, s_lib) = library(&inputs, dims, chunk, 1.0 / (k as f32).sqrt(), true);
            Tolerance::exact().assert_close(&[b, t, h, v], &o, &o_lib);
            Tolerance::exact().assert_close(&[b, h, k, v], &s, &s_lib);

            // And the library is right: the f64 recurrence of each request.
            let seq_len = t * h;
            for r in 0..b {
                let rows = |x: &Input, d: usize| -> Vec<f64> {
                    x.values[r * seq_len * d..(r + 1) * seq_len * d]
                        .iter()
                        .map(|&v| f64::from(v))
                        .collect()
                };
                let (q, kk, vv, g) = (
                    rows(&inputs[0], k),
                    rows(&inputs[1], k),
                    rows(&inputs[2], v),
                    rows(&inputs[3], k),
                );
                let beta = rows(&inputs[4], 1);
                let init = inputs.get(5).map(|i| {
                    i.values[r * h * k * v..(r + 1) * h * k * v]
                        .iter()
                        .map(|&x| f64::from(x))
                        .collect::<Vec<_>>()
                });
                let seq = KdaSequence {
                    q: &q,
                    k: &kk,
                    v: &vv,
                    g: &g,
                    beta: &beta,
                    heads: h,
                    kd: k,
                    vd: v,
                };
                let (o_ref, s_ref) =
                    kda_recurrence(seq, init.as_deref(), 1.0 / (k as f64).sqrt(), true);
                let tol = recurrence_tolerance(t, k, 64, max_abs(&o_ref));
                tol.assert_close(&[t, h, v], &o[r * seq_len * v..(r + 1) * seq_len * v], &o_ref);
                let tol = recurrence_tolerance(t, k, 64, max_abs(&s_ref));
                tol.assert_close(&[h, k, v], &s[r * h * k * v..(r + 1) * h * k * v], &s_ref);
            }
        }
    }
}

#[test]
fn scale_and_l2norm_flags_reach_the_op() {
    let dir = TempDir::new("flags");
    let dims = (1, 9, 2, 4, 4);
    let inputs = problem(dims, Dtype::F32, true, 9);
    let (input, output) = (dir.path("in.safetensors"), dir.path("out.safetensors"));
    write_inputs(&input, &inputs);
    let out = kda(&[
        "core",
        "--input",
        input.to_str().unwrap(),
        "--output",
        output.to_str().unwrap(),
        "--scale",
        "0.3",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let (_, o, _, s) = read_output(&output);
    let (o_lib, s_lib) = library(&inputs, dims, true, 0.3, false);
    Tolerance::exact().assert_close(&[o.len()], &o, &o_lib);
    Tolerance::exact().assert_close(&[s.len()], &s, &s_lib);
}

#[test]
fn nan_inputs_give_nan_outputs_not_a_crash() {
    let dir = TempDir::new("nan");
    let dims = (1, 20, 1, 4, 4);
    let mut inputs = problem(dims, Dtype::F32, false, 3);
    inputs[1].values[10 * 4] = f32::NAN;
    let (input, output) = (dir.path("in.safetensors"), dir.path("out.safetensors"));
    write_inputs(&input, &inputs);
    for algo in ["chunk", "recurrent"] {
        let out = kda(&[
            "core",
            "--input",
            input.to_str().unwrap(),
            "--output",
            output.to_str().unwrap(),
            "--algo",
            algo,
            "--l2norm",
        ]);
        assert!(out.status.success(), "{algo}: {}", stderr(&out));
        let (_, o, _, s) = read_output(&output);
        assert!(
            o[10 * 4..].iter().all(|x| x.is_nan()),
            "{algo}: outputs from the NaN token on are NaN"
        );
        assert!(s.iter().all(|x| x.is_nan()), "{algo}: final state NaN");
    }
}

#[test]
fn bad_files_fail_with_a_message_naming_the_tensor() {
    let dir = TempDir::new("bad");
    let dims = (1, 5, 2, 4, 3);
    let run = |inputs: &[Input], extra: &[&str]| {
        let (input, output) = (dir.path("in.safetensors"), dir.path("out.safetensors"));
        write_inputs(&input, inputs);
        let mut args =
            vec!["core", "--input", input.to_str().unwrap(), "--output", output.to_str().unwrap()];
        args.extend(extra);
        kda(&args)
    };
    let fails = |out: std::process::Output, needles: &[&str]| {
        assert!(!out.status.success(), "should fail: {needles:?}");
        let err = stderr(&out);
        for n in needles {
            assert!(err.contains(n), "missing {n:?} in: {err}");
        }
    };
    let base = || problem(dims, Dtype::F32, true, 4);

    let mut inputs = base();
    inputs.retain(|i| i.name != "beta");
    fails(run(&inputs, &[]), &["no tensor named \"beta\""]);

    let mut inputs = base();
    inputs[1] = Input::new("k", Dtype::F32, &[1, 5, 2, 5], vec![0.0; 50]);
    fails(
        run(&inputs, &[]),
        &["tensor \"k\"", "[1, 5, 2, 5]", "expected [B, T, H, K] = [1, 5, 2, 4]"],
    );

    let mut inputs = base();
    inputs[2] = Input::new("v", Dtype::F32, &[1, 5, 3, 3], vec![0.0; 45]);
    fails(run(&inputs, &[]), &["tensor \"v\"", "[1, 5, 3, 3]", "[B, T, H] = [1, 5, 2]"]);

    let mut inputs = base();
    inputs[4] = Input::new("beta", Dtype::F32, &[1, 5, 2, 1], vec![0.5; 10]);
    fails(run(&inputs, &[]), &["tensor \"beta\"", "expected [B, T, H] = [1, 5, 2]"]);

    // A v-first state is the classic mistake: the file speaks flash-linear-attention's K-first.
    let mut inputs = base();
    inputs[5] = Input::new("initial_state", Dtype::F32, &[1, 2, 3, 4], vec![0.0; 24]);
    fails(
        run(&inputs, &[]),
        &[
            "tensor \"initial_state\"",
            "[1, 2, 3, 4]",
            "expected [B, H, K, V] = [1, 2, 4, 3]",
            "K-first",
        ],
    );

    let mut inputs = base();
    inputs[0] = Input::new("q", Dtype::F32, &[5, 2, 4], vec![0.0; 40]);
    fails(run(&inputs, &[]), &["tensor \"q\"", "expected [B, T, H, K]"]);

    // An integer tensor.
    let (input, output) = (dir.path("int.safetensors"), dir.path("out.safetensors"));
    let mut named: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = base()
        .into_iter()
        .map(|i| (i.name.to_string(), i.dtype, i.shape.clone(), i.bytes()))
        .collect();
    named[3] = ("g".into(), Dtype::I32, vec![1, 5, 2, 4], vec![0; 160]);
    write_safetensors(&input, &named);
    let out =
        kda(&["core", "--input", input.to_str().unwrap(), "--output", output.to_str().unwrap()]);
    fails(out, &["tensor \"g\"", "expected f32 or bf16"]);

    // Not a safetensors file at all, and no file.
    std::fs::write(&input, b"definitely not safetensors").unwrap();
    let out =
        kda(&["core", "--input", input.to_str().unwrap(), "--output", output.to_str().unwrap()]);
    fails(out, &["not a valid safetensors file"]);
    let missing = dir.path("missing.safetensors");
    let out =
        kda(&["core", "--input", missing.to_str().unwrap(), "--output", output.to_str().unwrap()]);
    fails(out, &["cannot read", "missing.safetensors"]);

    fails(run(&base(), &["--scale", "inf"]), &["--scale"]);
    fails(run(&base(), &["--algo", "fast"]), &["fast"]);
}
