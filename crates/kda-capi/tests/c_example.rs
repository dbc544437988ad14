//! `examples/c/kda_example.c`, compiled with `cc` against this crate's shared library and run
//! on a synthetic checkpoint written to disk: its checksum equals the same run through the Rust
//! API (`kda_embed::testing::reference_run`, kda's own buffers and stream).
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test")]

use std::path::{Path, PathBuf};
use std::process::Command;

use kda_core::DType;
use kda_embed::testing::{LayerSpec, Step, reference_run, write_synthetic_checkpoint};
use kda_embed::{BatchArgs, SlotsArg};
use kda_model::schedule::ProjectionSchedule;

/// The directory holding `libkda_capi.so` (cargo's output directory of this test's profile).
fn library_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap();
    let profile = deps.parent().unwrap();
    for dir in [profile, deps] {
        if dir.join("libkda_capi.so").exists() || dir.join("libkda_capi.dylib").exists() {
            return dir.to_path_buf();
        }
    }
    panic!("libkda_capi not found next to {}", exe.display());
}

/// The example's inputs: its LCG, values `k / 2^16 - 0.5`.
struct Lcg(u32);

impl Lcg {
    fn next(&mut self) -> f32 {
        self.0 = self.0.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
        ((self.0 >> 16) & 0xFFFF) as f32 / 65536.0 - 0.5
    }
}

fn checksum(outputs: &[Vec<f32>]) -> String {
    let (mut sum, mut fnv) = (0f64, 0xcbf2_9ce4_8422_2325u64);
    for v in outputs.iter().flatten() {
        sum += f64::from(*v);
        for b in v.to_ne_bytes() {
            fnv ^= u64::from(b);
            fnv = fnv.wrapping_mul(0x0100_0000_01b3);
        }
    }
    // C's `%.17g`: Rust's shortest round-trip text parses back to the same double, so compare
    // the numbers, and the hash as text.
    format!("{sum:e} {fnv:016x}")
}

fn rust_checksum(dir: &Path, hidden: usize) -> String {
    let mut lcg = Lcg(12345);
    let prefill: Vec<f32> = (0..8 * hidden).map(|_| lcg.next()).collect();
    let decode: Vec<f32> = (0..2 * hidden).map(|_| lcg.next()).collect();
    let slots = Some(vec![SlotsArg::Single(1), SlotsArg::Single(0)]);
    let steps = [
        Step {
            hidden: prefill,
            dtype: DType::F32,
            rows: 8,
            batch: BatchArgs {
                query_start_loc: vec![0, 5, 8],
                slots: slots.clone(),
                ..Default::default()
            },
        },
        Step {
            hidden: decode,
            dtype: DType::F32,
            rows: 2,
            batch: BatchArgs {
                query_start_loc: vec![0, 1, 2],
                num_computed_tokens: Some(vec![5, 3]),
                slots,
                num_accepted_tokens: None,
            },
        },
    ];
    let spec = LayerSpec {
        dir,
        layer: 0,
        tp_size: 1,
        tp_rank: 0,
        schedule: ProjectionSchedule::Overlapped,
    };
    checksum(&reference_run(&spec, 2, 0, &steps).unwrap().outputs)
}

#[test]
fn the_c_example_prints_the_rust_apis_checksum() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let work = Path::new(env!("CARGO_TARGET_TMPDIR")).join("c_example");
    let checkpoint = work.join("checkpoint");
    write_synthetic_checkpoint(&checkpoint, "tiny", 0).unwrap();
    let lib = library_dir();
    let exe = work.join("kda_example");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let status = Command::new(&cc)
        .args(["-std=c99", "-Wall", "-Wextra", "-Werror", "-I"])
        .arg(root.join("include"))
        .arg(root.join("../../examples/c/kda_example.c"))
        .arg("-L")
        .arg(&lib)
        .arg("-lkda_capi")
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .arg("-o")
        .arg(&exe)
        .status()
        .unwrap_or_else(|e| panic!("cannot run {cc} (a C compiler is needed): {e}"));
    assert!(status.success(), "{cc} failed to compile examples/c/kda_example.c");
    let run = Command::new(&exe).arg(&checkpoint).output().unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success(),
        "kda_example failed:\n{stdout}{}",
        String::from_utf8_lossy(&run.stderr)
    );
    print!("{stdout}");
    assert!(stdout.contains(
        "rejected (status 3): batch metadata: slots[1] = 7, expected 0..2 (the cache's slots)"
    ));
    let line = stdout.lines().find_map(|l| l.strip_prefix("checksum ")).expect("a checksum line");
    let (sum, fnv) = line.split_once(" fnv1a ").expect("checksum SUM fnv1a HEX");
    let c = format!("{:e} {fnv}", sum.parse::<f64>().unwrap());
    let rust = rust_checksum(&checkpoint, 256);
    assert_eq!(c, rust);
    // The same steps on the engine's own arrays (kda_cache_wrap, vLLM's layout, f32): the same
    // bits.
    let line =
        stdout.lines().find_map(|l| l.strip_prefix("wrapped checksum ")).expect("a wrapped run");
    let (sum, fnv) = line.split_once(" fnv1a ").expect("checksum SUM fnv1a HEX");
    assert_eq!(format!("{:e} {fnv}", sum.parse::<f64>().unwrap()), rust);
    assert!(stdout.contains("wrapped recurrent state: same bits as kda's cache"));
}
