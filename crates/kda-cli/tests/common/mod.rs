//! What the CLI's integration tests share: running the binary and scratch directories.
#![allow(dead_code, reason = "each test crate uses its own subset")]
#![allow(clippy::expect_used, reason = "test setup")]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicUsize, Ordering};

use half::bf16;
use safetensors::tensor::{Dtype, TensorView};

/// Run the `kda` binary with `args`.
pub fn kda(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kda")).args(args).output().expect("the kda binary runs")
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A fresh directory under the system temp dir, unique per test, removed when dropped.
pub struct TempDir(PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("kda-test-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temp dir");
        Self(dir)
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// One tensor of an input file: values exact in `dtype` (f32 or bf16).
pub struct Input {
    pub name: &'static str,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub values: Vec<f32>,
}

impl Input {
    /// An input whose values are first rounded to `dtype`, so they are exactly what is stored.
    pub fn new(name: &'static str, dtype: Dtype, shape: &[usize], values: Vec<f32>) -> Self {
        let values = match dtype {
            Dtype::BF16 => values.iter().map(|&v| bf16::from_f32(v).to_f32()).collect(),
            _ => values,
        };
        Self { name, dtype, shape: shape.to_vec(), values }
    }

    /// The stored little-endian bytes.
    pub fn bytes(&self) -> Vec<u8> {
        match self.dtype {
            Dtype::BF16 => {
                self.values.iter().flat_map(|&v| bf16::from_f32(v).to_le_bytes()).collect()
            }
            _ => self.values.iter().flat_map(|&v| v.to_le_bytes()).collect(),
        }
    }
}

/// Write raw tensors `(name, dtype, shape, bytes)` as one safetensors file.
pub fn write_safetensors(path: &Path, tensors: &[(String, Dtype, Vec<usize>, Vec<u8>)]) {
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(name, dtype, shape, bytes)| {
            (name.clone(), TensorView::new(*dtype, shape.clone(), bytes).expect("a valid view"))
        })
        .collect();
    let bytes = safetensors::serialize(views, None).expect("serialisable");
    std::fs::write(path, bytes).expect("writable temp file");
}

/// Write `inputs` as one safetensors file.
pub fn write_inputs(path: &Path, inputs: &[Input]) {
    let tensors: Vec<_> =
        inputs.iter().map(|i| (i.name.to_string(), i.dtype, i.shape.clone(), i.bytes())).collect();
    write_safetensors(path, &tensors);
}
