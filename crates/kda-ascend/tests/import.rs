//! An engine's ACL device memory, imported without a copy: written and read by kda's ops in
//! place, its owner (which frees it with `aclrtFree`) kept alive until the work that holds it
//! has completed.
#![cfg(feature = "emulated")]
#![allow(clippy::expect_used, clippy::unwrap_used, reason = "tests")]

use std::ffi::c_void;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use kda_ascend::{AscendBackend, AscendOptions, sys};
use kda_core::{DType, Layout, Op, Tensor};

/// Device memory the engine allocated; freed (and flagged) when its owner drops.
struct EngineBlock {
    ptr: usize,
    freed: Arc<AtomicBool>,
}

impl Drop for EngineBlock {
    fn drop(&mut self) {
        // SAFETY: allocated by `aclrtMalloc` below, freed once.
        unsafe { sys::aclrtFree(self.ptr as *mut c_void) };
        self.freed.store(true, Ordering::SeqCst);
    }
}

fn engine_block(bytes: usize) -> (EngineBlock, Arc<AtomicBool>) {
    let mut p: *mut c_void = std::ptr::null_mut();
    // SAFETY: a valid out-parameter and size.
    let code = unsafe { sys::aclrtMalloc(&mut p, bytes, sys::ACL_MEM_MALLOC_HUGE_FIRST) };
    assert_eq!(code, 0, "aclrtMalloc");
    let freed = Arc::new(AtomicBool::new(false));
    (EngineBlock { ptr: p as usize, freed: Arc::clone(&freed) }, freed)
}

#[test]
fn engine_device_memory_is_used_in_place_and_kept_alive() {
    let b = AscendBackend::with_options(AscendOptions { checked: false, ..Default::default() })
        .unwrap();
    let s = b.new_stream().unwrap();
    let (m, k, n) = (2, 4, 3);
    let (x_block, x_freed) = engine_block(m * k * 4);
    let (y_block, y_freed) = engine_block(m * n * 4);
    let (x_ptr, y_ptr) = (x_block.ptr as *mut u8, y_block.ptr as *mut u8);
    let import = |ptr, len, owner: EngineBlock, shape: &[usize]| {
        // SAFETY: the block is the engine's live device memory of `len` bytes, freed only by
        // its owner; the engine touches it only after synchronizing the stream.
        let buf = unsafe { b.import_buffer(ptr, len, Box::new(owner)) }.unwrap();
        Tensor::new(buf, Layout::contiguous(DType::F32, shape)).unwrap()
    };
    let x = import(x_ptr, m * k * 4, x_block, &[m, k]);
    let y = import(y_ptr, m * n * 4, y_block, &[m, n]);
    let values: Vec<f32> = (0..m * k).map(|i| i as f32).collect();
    b.upload(&s, &x, &values).unwrap();
    let w = b.alloc(DType::F32, &[n, k]).unwrap();
    b.launch(&s, Op::Fill { dst: w.clone(), value: 0.5 }).unwrap();
    b.launch(&s, Op::Gemm { x: x.clone(), w, y: y.clone() }).unwrap();
    // A second import of the same bytes (owned by nothing) reads what kda wrote there: the
    // memory is the engine's, not a copy.
    // SAFETY: `x` keeps the block alive past this alias's last use (the download below).
    let alias = unsafe { b.import_buffer(x_ptr, m * k * 4, Box::new(())) }.unwrap();
    let alias = Tensor::new(alias, Layout::contiguous(DType::F32, &[m, k])).unwrap();
    assert_eq!(b.download::<f32>(&s, &alias).unwrap(), values);
    assert_eq!(b.download::<f32>(&s, &y).unwrap(), vec![3.0, 3.0, 3.0, 11.0, 11.0, 11.0]);
    b.launch(&s, Op::Fill { dst: x.clone(), value: 1.0 }).unwrap();
    drop((x, y, alias));
    // The fill still holds x until the stream is synchronized.
    assert!(!x_freed.load(Ordering::SeqCst), "x was freed under queued work");
    b.synchronize(&s).unwrap();
    assert!(x_freed.load(Ordering::SeqCst) && y_freed.load(Ordering::SeqCst));
}
