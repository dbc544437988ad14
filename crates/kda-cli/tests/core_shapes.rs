//! `kda core` on a sample of the small shapes the conformance suite's property bodies draw
//! (`kda_testkit::conformance::kda_props`): a decode step (`T = 1`, which once failed on the
//! K-first state for `--algo recurrent`), two tokens and both sides of the chunk boundaries,
//! one or three requests and heads, `K != V`, with and without an initial state, both
//! algorithms, against the f64 recurrence; on the reference backend, and on the Ascend backend
//! where this build has it.
#![allow(clippy::expect_used, clippy::unwrap_used, reason = "test setup")]

mod common;

use std::path::Path;

use common::{Input, TempDir, kda, stderr, stdout, write_inputs};
use kda_testkit::Gen;
use kda_testkit::oracle_kda::{KdaSequence, kda_recurrence, max_abs, recurrence_tolerance};
use safetensors::tensor::{Dtype, SafeTensors};

/// `(B, T, H, K, V, initial state)`: every `T` of the property bodies once.
const SAMPLE: [(usize, usize, usize, usize, usize, bool); 7] = [
    (1, 1, 1, 16, 16, false),
    (3, 1, 3, 32, 128, true),
    (3, 2, 1, 128, 16, true),
    (1, 63, 3, 16, 32, false),
    (3, 64, 1, 32, 32, true),
    (1, 65, 3, 128, 128, true),
    (3, 129, 3, 16, 32, false),
];

/// Inputs `[B, T, H, K]` … as flash-linear-attention lays them out.
fn problem(
    (b, t, h, k, v): (usize, usize, usize, usize, usize),
    initial: bool,
    seed: u64,
) -> Vec<Input> {
    let mut rng = Gen::new(seed);
    let n = b * t * h;
    let mut inputs = vec![
        Input::new("q", Dtype::F32, &[b, t, h, k], rng.uniform_f32(n * k, -1.0, 1.0)),
        Input::new("k", Dtype::F32, &[b, t, h, k], rng.uniform_f32(n * k, -1.0, 1.0)),
        Input::new("v", Dtype::F32, &[b, t, h, v], rng.uniform_f32(n * v, -1.0, 1.0)),
        Input::new("g", Dtype::F32, &[b, t, h, k], rng.uniform_f32(n * k, -2.0, 0.0)),
        Input::new("beta", Dtype::F32, &[b, t, h], rng.uniform_f32(n, 0.0, 1.0)),
    ];
    if initial {
        let values = rng.uniform_f32(b * h * k * v, -1.0, 1.0);
        inputs.push(Input::new("initial_state", Dtype::F32, &[b, h, k, v], values));
    }
    inputs
}

/// `o` and `final_state` of an output file.
fn read_output(path: &Path) -> (Vec<f32>, Vec<f32>) {
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let get = |name: &str| -> Vec<f32> {
        let t = st.tensor(name).unwrap();
        assert_eq!(t.dtype(), Dtype::F32, "{name} is f32");
        t.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
    };
    (get("o"), get("final_state"))
}

/// Whether this build has the Ascend backend (kda-ascend's `emulated` or `acl` feature).
fn ascend_compiled_in() -> bool {
    let o = kda(&["info"]);
    assert!(o.status.success(), "{}", stderr(&o));
    stdout(&o)
        .lines()
        .find(|l| l.trim_start().starts_with("ascend "))
        .is_some_and(|l| !l.contains("not compiled in"))
}

#[test]
fn core_on_small_shapes_matches_the_f64_recurrence() {
    let dir = TempDir::new("core-shapes");
    let mut backends = vec!["reference"];
    if ascend_compiled_in() {
        backends.push("ascend");
    } else {
        eprintln!("kda-ascend is not compiled in: the sample runs on the reference only");
    }
    for (case, &(b, t, h, k, v, initial)) in SAMPLE.iter().enumerate() {
        let inputs = problem((b, t, h, k, v), initial, 40 + case as u64);
        let input = dir.path(&format!("in{case}.safetensors"));
        write_inputs(&input, &inputs);
        // The f64 recurrence of each request, L2 norm on, scale K^-0.5.
        let per_req = t * h;
        let want: Vec<_> = (0..b)
            .map(|r| {
                let rows = |i: usize, d: usize| -> Vec<f64> {
                    let x = &inputs[i].values[r * per_req * d..(r + 1) * per_req * d];
                    x.iter().map(|&x| f64::from(x)).collect()
                };
                let (q, kk, vv, g, beta) =
                    (rows(0, k), rows(1, k), rows(2, v), rows(3, k), rows(4, 1));
                let init = inputs.get(5).map(|i| {
                    let x = &i.values[r * h * k * v..(r + 1) * h * k * v];
                    x.iter().map(|&x| f64::from(x)).collect::<Vec<_>>()
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
                kda_recurrence(seq, init.as_deref(), 1.0 / (k as f64).sqrt(), true)
            })
            .collect();
        for backend in &backends {
            for (algo, chunk) in [("chunk", 64), ("recurrent", 0)] {
                let what =
                    format!("{backend} {algo} B={b} T={t} H={h} K={k} V={v} initial={initial}");
                let output = dir.path(&format!("out{case}-{backend}-{algo}.safetensors"));
                let out = kda(&[
                    "core",
                    "--input",
                    input.to_str().unwrap(),
                    "--output",
                    output.to_str().unwrap(),
                    "--algo",
                    algo,
                    "--l2norm",
                    "--backend",
                    backend,
                ]);
                assert!(out.status.success(), "{what}: {}", stderr(&out));
                let (o, s) = read_output(&output);
                assert_eq!((o.len(), s.len()), (b * t * h * v, b * h * k * v), "{what}");
                for (r, (o_ref, s_ref)) in want.iter().enumerate() {
                    let got = &o[r * per_req * v..(r + 1) * per_req * v];
                    let tol = recurrence_tolerance(t, k, chunk, max_abs(o_ref));
                    if let Err(e) = tol.compare_as(&[t, h, v], got, o_ref) {
                        panic!("{what}: request {r} outputs: {e}");
                    }
                    let got = &s[r * h * k * v..(r + 1) * h * k * v];
                    let tol = recurrence_tolerance(t, k, chunk, max_abs(s_ref));
                    if let Err(e) = tol.compare_as(&[h, k, v], got, s_ref) {
                        panic!("{what}: request {r} final state: {e}");
                    }
                }
            }
        }
    }
}
