//! `kda quant` end to end: a generated safetensors file round-trips through the binary and comes
//! back byte for byte as the library's codec says, for both scale algorithms and both layouts;
//! bad input fails with a message.
#![allow(clippy::expect_used, clippy::unwrap_used, reason = "test setup")]

use std::collections::HashMap;

mod common;

use common::{Input, TempDir, kda, stderr, write_inputs, write_safetensors};
use half::bf16;
use kda_core::mx::{self, ScaleAlg, ScaleLayout};
use kda_testkit::Gen;
use safetensors::tensor::{Dtype, SafeTensors};

impl Input {
    /// (rows, k) of the tensor as the command reads it.
    fn matrix(&self) -> (usize, usize) {
        match self.shape[..] {
            [k] => (1, k),
            [rows, k] => (rows, k),
            _ => unreachable!("inputs are 1-D or 2-D"),
        }
    }

    fn expected(&self, alg: ScaleAlg) -> mx::Quantized {
        let (rows, k) = self.matrix();
        match self.dtype {
            Dtype::BF16 => {
                let v: Vec<bf16> = self.values.iter().map(|&x| bf16::from_f32(x)).collect();
                mx::quantize(&v, rows, k, alg).unwrap()
            }
            _ => mx::quantize(&self.values, rows, k, alg).unwrap(),
        }
    }
}

fn inputs() -> Vec<Input> {
    let mut rng = Gen::new(2024);
    let bf = |v: Vec<f32>| v.into_iter().map(|x| bf16::from_f32(x).to_f32()).collect::<Vec<_>>();
    let mut special = rng.uniform_f32(3 * 64, -500.0, 500.0);
    special[5] = f32::NAN;
    special[64 + 40] = f32::INFINITY;
    special[128..160].fill(0.0);
    vec![
        Input {
            name: "model.layers.0.qkv.weight",
            dtype: Dtype::BF16,
            shape: vec![6, 100],
            values: bf(rng.normal_f32(600, 0.0, 0.02)),
        },
        Input { name: "special", dtype: Dtype::F32, shape: vec![3, 64], values: special },
        Input {
            name: "bias",
            dtype: Dtype::F32,
            shape: vec![40],
            values: rng.uniform_f32(40, -2.0, 2.0),
        },
        Input { name: "empty_k", dtype: Dtype::BF16, shape: vec![2, 0], values: vec![] },
        Input { name: "no_rows", dtype: Dtype::F32, shape: vec![0, 64], values: vec![] },
    ]
}

#[test]
fn round_trip_reproduces_the_codec_for_both_algorithms_and_layouts() {
    let dir = TempDir::new("round-trip");
    let input = dir.path("in.safetensors");
    let inputs = inputs();
    write_inputs(&input, &inputs);
    for alg in ScaleAlg::ALL {
        for layout in ["plain", "ascend"] {
            let output = dir.path(&format!("out-{}-{layout}.safetensors", alg.code()));
            let code = alg.code().to_string();
            let o = kda(&[
                "quant",
                "--input",
                input.to_str().unwrap(),
                "--output",
                output.to_str().unwrap(),
                "--scale-alg",
                &code,
                "--layout",
                layout,
            ]);
            assert!(o.status.success(), "{}", stderr(&o));
            let file = std::fs::read(&output).unwrap();
            let st = SafeTensors::deserialize(&file).unwrap();
            assert_eq!(st.len(), 2 * inputs.len());
            let (_, metadata) = SafeTensors::read_metadata(&file).unwrap();
            let meta: &HashMap<String, String> = metadata.metadata().as_ref().unwrap();
            assert_eq!(meta["scale_alg"], code);
            assert_eq!(meta["scale_layout"], layout);
            for i in &inputs {
                let (rows, k) = i.matrix();
                let want = i.expected(alg);
                let data = st.tensor(&format!("{}.data", i.name)).unwrap();
                assert_eq!((data.dtype(), data.shape()), (Dtype::U8, &i.shape[..]), "{}", i.name);
                assert_eq!(data.data(), &want.data[..], "{} data, scale_alg {alg}", i.name);

                let scale = st.tensor(&format!("{}.scale", i.name)).unwrap();
                let (laid, mut shape) = match layout {
                    "plain" => (want.scale.clone(), ScaleLayout::Plain.scale_shape(rows, k)),
                    _ => (
                        ScaleLayout::AscendWeight.from_plain(&want.scale, rows, k).unwrap(),
                        ScaleLayout::AscendWeight.scale_shape(rows, k),
                    ),
                };
                if i.shape.len() == 1 {
                    shape.remove(if layout == "plain" { 0 } else { 1 });
                }
                assert_eq!((scale.dtype(), scale.shape()), (Dtype::U8, &shape[..]), "{}", i.name);
                assert_eq!(scale.data(), &laid[..], "{} scales, scale_alg {alg} {layout}", i.name);
            }
        }
    }
}

#[test]
fn ascend_scales_of_the_k3_shape_are_paired() {
    // [N, K] = [3, 7168]: 224 blocks pair into [112, 3, 2].
    let dir = TempDir::new("ascend");
    let (input, output) = (dir.path("in.safetensors"), dir.path("out.safetensors"));
    let values = Gen::new(3).uniform_f32(3 * 7168, -1.0, 1.0);
    let input_tensor = Input { name: "w", dtype: Dtype::F32, shape: vec![3, 7168], values };
    write_inputs(&input, std::slice::from_ref(&input_tensor));
    let args = ["quant", "--input", input.to_str().unwrap(), "--output", output.to_str().unwrap()];
    let o = kda(&[&args[..], &["--layout", "ascend"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let file = std::fs::read(&output).unwrap();
    let st = SafeTensors::deserialize(&file).unwrap();
    let scale = st.tensor("w.scale").unwrap();
    assert_eq!(scale.shape(), &[112, 3, 2]);
    let want = input_tensor.expected(ScaleAlg::OcpFloor).scale;
    // Pair g of row n holds blocks 2g and 2g + 1 of that row.
    assert_eq!(scale.data()[(5 * 3 + 2) * 2..][..2], want[2 * 224 + 10..][..2]);
}

#[test]
fn bad_input_fails_with_a_clear_message() {
    let dir = TempDir::new("bad");
    let output = dir.path("out.safetensors");
    let out = output.to_str().unwrap();

    let ints = dir.path("ints.safetensors");
    let good = Input { name: "ok", dtype: Dtype::F32, shape: vec![2, 32], values: vec![1.0; 64] };
    write_safetensors(
        &ints,
        &[
            ("ok".into(), good.dtype, good.shape.clone(), good.bytes()),
            ("positions".into(), Dtype::I32, vec![4], vec![0; 16]),
        ],
    );
    let o = kda(&["quant", "--input", ints.to_str().unwrap(), "--output", out]);
    assert!(!o.status.success());
    let err = stderr(&o);
    assert!(err.contains("\"positions\"") && err.contains("i32") && err.contains("[4]"), "{err}");
    assert!(err.contains("only f32 and bf16"), "{err}");
    assert!(!output.exists(), "nothing is written on error");

    let cube = dir.path("cube.safetensors");
    write_safetensors(&cube, &[("c".into(), Dtype::F32, vec![2, 2, 2], vec![0; 32])]);
    let o = kda(&["quant", "--input", cube.to_str().unwrap(), "--output", out]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("1-D [K] or 2-D [N, K]"), "{}", stderr(&o));

    let missing = dir.path("missing.safetensors");
    let o = kda(&["quant", "--input", missing.to_str().unwrap(), "--output", out]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("missing.safetensors"), "{}", stderr(&o));

    let garbage = dir.path("garbage.safetensors");
    std::fs::write(&garbage, b"not a safetensors file").unwrap();
    let o = kda(&["quant", "--input", garbage.to_str().unwrap(), "--output", out]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("not a valid safetensors file"), "{}", stderr(&o));

    let fine = dir.path("fine.safetensors");
    write_inputs(&fine, std::slice::from_ref(&good));
    let o = kda(&["quant", "--input", fine.to_str().unwrap(), "--output", out, "--scale-alg", "2"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("scale_alg 2 is not defined"), "{}", stderr(&o));
}
