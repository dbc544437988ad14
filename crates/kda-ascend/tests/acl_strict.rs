//! The emulated runtime is as strict as CANN, and the backend keeps its rules (the rules table
//! in docs/ascend.md names the CANN source of each): kernel binaries and launches (absolute
//! path, the symbols a binary holds, the launch function of file-loaded binaries, where each
//! launch function reads its arguments), host-side failures without a device fault, and capture (no query or
//! synchronize of what a capture holds, phase one of an aclnn op allowed, reuse events that are not SYNC events). A device fault stops every stream
//! of the context (stop-on-failure), so the tests of one are in binaries of their own
//! (`stop_on_failure.rs`, `device_failure.rs`).
#![cfg(feature = "emulated")]
#![allow(clippy::expect_used, clippy::unwrap_used, reason = "tests")]

use std::ffi::{CString, c_void};
use std::path::{Path, PathBuf};

use kda_ascend::kernels::abi::{self, GmTensor, KernelTiling, names};
use kda_ascend::{AscendBackend, AscendOptions, sys};
use kda_core::{DType, Device, Error, HostFn, Op};

fn backend(kernels: Option<PathBuf>) -> Device<AscendBackend> {
    let options = AscendOptions { checked: false, kernels, ..AscendOptions::default() };
    AscendBackend::with_options(options).expect("backend")
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kda-acl-launch-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

fn load(path: &Path) -> (sys::aclError, sys::aclrtBinHandle) {
    let c = CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    let mut bin = std::ptr::null_mut();
    // SAFETY: a C string, no options, a valid out-parameter.
    let code = unsafe { sys::aclrtBinaryLoadFromFile(c.as_ptr(), std::ptr::null_mut(), &mut bin) };
    (code, bin)
}

fn function(bin: sys::aclrtBinHandle, name: &str) -> (sys::aclError, sys::aclrtFuncHandle) {
    let c = CString::new(name).unwrap();
    let mut f = std::ptr::null_mut();
    // SAFETY: a loaded binary, a C string, a valid out-parameter.
    let code = unsafe { sys::aclrtBinaryGetFunction(bin, c.as_ptr(), &mut f) };
    (code, f)
}

/// The sigmoid kernel of a stand-in binary holding every kda kernel.
fn sigmoid_kernel() -> sys::aclrtFuncHandle {
    // One file per call: tests run in parallel.
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let i = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let path = scratch(&format!("all_{i}.o"));
    kda_acl_emu::write_stand_in(&path, &names::ALL).unwrap();
    let (code, bin) = load(&path);
    assert_eq!(code, 0, "{}", sys::recent_error());
    let (code, f) = function(bin, names::SIGMOID);
    assert_eq!(code, 0, "{}", sys::recent_error());
    f
}

fn stream() -> sys::aclrtStream {
    let mut s = std::ptr::null_mut();
    // SAFETY: valid out-parameter.
    assert_eq!(unsafe { sys::aclrtCreateStream(&mut s) }, 0);
    s
}

fn device_alloc(bytes: usize) -> *mut c_void {
    let mut p = std::ptr::null_mut();
    // SAFETY: valid out-parameter.
    assert_eq!(unsafe { sys::aclrtMalloc(&mut p, bytes, sys::ACL_MEM_MALLOC_HUGE_FIRST) }, 0);
    p
}

fn copy(dst: *mut c_void, src: *const c_void, bytes: usize, kind: i32, s: sys::aclrtStream) {
    // SAFETY: both sides hold `bytes` bytes and outlive the synchronize below.
    unsafe {
        assert_eq!(sys::aclrtMemcpyAsync(dst, bytes, src, bytes, kind, s), 0);
        assert_eq!(sys::aclrtSynchronizeStream(s), 0, "{}", sys::recent_error());
    }
}

/// A one-core sigmoid launch over `n` f32 at `x`, `y`.
fn sigmoid_args(x: *mut c_void, y: *mut c_void, n: usize) -> abi::HostArgs {
    let t = |addr: *mut c_void| GmTensor {
        addr: addr as u64,
        shape: [n as i64, 0, 0, 0, 0, 0],
        strides: [1, 0, 0, 0, 0, 0],
        rank: 1,
        dtype: sys::ACL_FLOAT,
        ..GmTensor::default()
    };
    let n = n as u32;
    let tiling = KernelTiling {
        block_dim: 1,
        per_core: n,
        last_core: n,
        tile: n,
        ub_bytes: 1 << 16,
        reserved: 0,
    };
    abi::encode(tiling, &[t(x), t(y)], &[])
}

fn launch_with_host_args(
    f: sys::aclrtFuncHandle,
    s: sys::aclrtStream,
    args: &abi::HostArgs,
    place_holders: &[sys::aclrtPlaceHolderInfo],
) -> sys::aclError {
    let (mut bytes, mut holders) = (args.bytes.clone(), place_holders.to_vec());
    // SAFETY: a function handle, a live stream, a host block and placeholder array of the sizes
    // given.
    unsafe {
        sys::aclrtLaunchKernelWithHostArgs(
            f,
            1,
            s,
            std::ptr::null_mut(),
            bytes.as_mut_ptr().cast(),
            bytes.len(),
            if holders.is_empty() { std::ptr::null_mut() } else { holders.as_mut_ptr() },
            holders.len(),
        )
    }
}

/// The documented path: pointers in the block, the meta region placed on the device through the
/// placeholder; the kernel's result is the sigmoid, computed here independently.
#[test]
fn a_host_args_launch_with_its_meta_placeholder_runs_the_kernel() {
    let _init = backend(None);
    let (f, s) = (sigmoid_kernel(), stream());
    let xs: Vec<f32> = vec![-3.0, -0.5, 0.0, 0.25, 2.0, 8.0];
    let n = xs.len();
    let (x, y) = (device_alloc(n * 4), device_alloc(n * 4));
    copy(x, xs.as_ptr().cast(), n * 4, sys::ACL_MEMCPY_HOST_TO_DEVICE, s);
    let args = sigmoid_args(x, y, n);
    assert_eq!(
        launch_with_host_args(f, s, &args, &[args.place_holder]),
        0,
        "{}",
        sys::recent_error()
    );
    let mut got = vec![0f32; n];
    copy(got.as_mut_ptr().cast(), y, n * 4, sys::ACL_MEMCPY_DEVICE_TO_HOST, s);
    let want: Vec<f32> = xs.iter().map(|v| (1.0 / (1.0 + f64::from(-*v).exp())) as f32).collect();
    for (g, w) in got.iter().zip(&want) {
        assert!((g - w).abs() <= 1e-6 * w.abs().max(1.0), "got {got:?}, want {want:?}");
    }
}

/// Without the placeholder the `meta` parameter is not a device address: the kernel cannot read
/// its tiling.
#[test]
fn a_host_args_launch_without_the_meta_placeholder_is_rejected() {
    let _init = backend(None);
    let (f, s) = (sigmoid_kernel(), stream());
    let (x, y) = (device_alloc(16), device_alloc(16));
    let args = sigmoid_args(x, y, 4);
    assert_eq!(launch_with_host_args(f, s, &args, &[]), sys::ACL_ERROR_RT_PARAM_INVALID);
    assert!(sys::recent_error().contains("not device memory"), "{}", sys::recent_error());
}

/// `aclrtLaunchKernel` reads its argument block from device memory; a host block is not there.
#[test]
fn a_host_argument_block_passed_to_acl_launch_kernel_is_rejected() {
    let _init = backend(None);
    let (f, s) = (sigmoid_kernel(), stream());
    let (x, y) = (device_alloc(16), device_alloc(16));
    let args = sigmoid_args(x, y, 4);
    // SAFETY: a function, a host block of the given size, a live stream.
    let code =
        unsafe { sys::aclrtLaunchKernel(f, 1, args.bytes.as_ptr().cast(), args.bytes.len(), s) };
    assert_eq!(code, sys::ACL_ERROR_RT_PARAM_INVALID);
    assert!(sys::recent_error().contains("is not device memory"), "{}", sys::recent_error());
}

/// A kernel of a binary loaded from a file is launched with `…WithConfig`, `…V2` or
/// `…WithHostArgs`, even when its argument block is in device memory.
#[test]
fn acl_launch_kernel_of_a_file_loaded_binary_is_rejected() {
    let _init = backend(None);
    let (f, s) = (sigmoid_kernel(), stream());
    let block = device_alloc(abi::args_size(2, 0));
    // SAFETY: a function, `block` is device memory of the given size, a live stream.
    let code = unsafe { sys::aclrtLaunchKernel(f, 1, block, abi::args_size(2, 0), s) };
    assert_eq!(code, sys::ACL_ERROR_RT_PARAM_INVALID);
    assert!(sys::recent_error().contains("WithHostArgs"), "{}", sys::recent_error());
}

#[test]
fn a_relative_binary_path_is_rejected() {
    let _init = backend(None);
    let (code, _) = load(Path::new("target/ascend-kernels/kda_kernels.o"));
    assert_eq!(code, sys::ACL_ERROR_RT_PARAM_INVALID);
    assert!(sys::recent_error().contains("not an absolute path"), "{}", sys::recent_error());
}

#[test]
fn a_kernel_symbol_the_binary_does_not_contain_is_rejected() {
    let _init = backend(None);
    let path = scratch("gate_only.o");
    std::fs::write(&path, b"\0kda_gate\0").unwrap();
    let (code, bin) = load(&path);
    assert_eq!(code, 0, "{}", sys::recent_error());
    assert_eq!(function(bin, names::GATE).0, 0, "{}", sys::recent_error());
    assert_eq!(function(bin, names::SIGMOID).0, sys::ACL_ERROR_RT_INTERNAL_ERROR);
    assert!(sys::recent_error().contains("kda_sigmoid_f32"), "{}", sys::recent_error());
}

/// The backend hands the runtime an absolute path, and names it when loading fails.
#[test]
fn the_backend_loads_its_kernels_by_absolute_path_and_names_it_on_failure() {
    let b = backend(Some(PathBuf::from("no/such/kda_kernels.o")));
    let s = b.new_stream().unwrap();
    let x = b.alloc(DType::F32, &[4]).unwrap();
    let y = b.alloc(DType::F32, &[4]).unwrap();
    let err = b.launch(&s, Op::Sigmoid { x, y }).expect_err("no such binary");
    let absolute = std::env::current_dir().unwrap().join("no/such/kda_kernels.o");
    let text = err.to_string();
    assert!(text.contains(&absolute.display().to_string()), "{text}");
    assert!(text.contains("aclrtBinaryLoadFromFile"), "{text}");
}

fn calls() -> Vec<String> {
    kda_acl_emu::calls_of_this_thread().into_iter().map(|c| c.api).collect()
}

fn event(flags: u32) -> sys::aclrtEvent {
    let mut e = std::ptr::null_mut();
    // SAFETY: valid out-parameter.
    assert_eq!(unsafe { sys::aclrtCreateEventExWithFlag(&mut e, flags) }, 0);
    e
}

/// A failing host function stops its stream on the host: no device task faults, the work behind
/// it is skipped, `synchronize` reports it once, and the stream works again afterwards.
#[test]
fn a_failed_host_function_stops_its_stream_without_a_device_fault() {
    let b = backend(None);
    let s = b.new_stream().unwrap();
    let x = b.alloc(DType::F32, &[4]).unwrap();
    b.launch(&s, Op::Fill { dst: x.clone(), value: 1.0 }).unwrap();
    let start = calls().len();
    b.launch(&s, Op::Host { name: "failing", f: HostFn::new(|| Err("boom".into())) }).unwrap();
    b.launch(&s, Op::Fill { dst: x.clone(), value: 2.0 }).unwrap();
    match b.synchronize(&s) {
        Err(Error::OpFailed { op, message, .. }) => {
            assert_eq!(op, "failing");
            assert!(message.contains("boom"), "{message}");
        }
        other => panic!("expected the host function's failure, got {other:?}"),
    }
    // The skipped fill's executor is released (made repeatable to be destroyed); no task but
    // the host function reached the runtime.
    let issued: Vec<String> = calls()
        .split_off(start)
        .into_iter()
        .filter(|c| c != "aclSetAclOpExecutorRepeatable")
        .collect();
    assert_eq!(issued, vec!["aclrtLaunchHostFunc".to_string()], "only the host function ran");
    assert_eq!(b.download::<f32>(&s, &x).unwrap(), vec![1.0; 4]);
}

/// Work behind a host function still running is held on the host, and issued once it returns.
#[test]
fn work_behind_a_running_host_function_is_held_until_it_returns() {
    let b = backend(None);
    let s = b.new_stream().unwrap();
    let x = b.alloc(DType::F32, &[4]).unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let rx = std::sync::Mutex::new(rx);
    let wait = HostFn::new(move || {
        rx.lock().map_err(|e| e.to_string())?.recv().map_err(|e| e.to_string())
    });
    let start = calls().len();
    b.launch(&s, Op::Host { name: "wait", f: wait }).unwrap();
    b.launch(&s, Op::Fill { dst: x.clone(), value: 3.0 }).unwrap();
    assert_eq!(calls().split_off(start), vec!["aclrtLaunchHostFunc".to_string()]);
    tx.send(()).unwrap();
    b.synchronize(&s).unwrap();
    let issued = calls().split_off(start);
    assert_eq!(issued, vec!["aclrtLaunchHostFunc".to_string(), "aclnnInplaceFillScalar".into()]);
    assert_eq!(b.download::<f32>(&s, &x).unwrap(), vec![3.0; 4]);
}

#[test]
fn synchronizing_a_capturing_stream_is_rejected() {
    let _init = backend(None);
    let s = stream();
    // SAFETY: a live stream; the capture is ended below.
    unsafe {
        assert_eq!(sys::aclmdlRICaptureBegin(s, sys::ACL_MODEL_RI_CAPTURE_MODE_RELAXED), 0);
        assert_eq!(sys::aclrtSynchronizeStream(s), sys::ACL_ERROR_RT_STREAM_CAPTURED);
        let mut ri = std::ptr::null_mut();
        assert_eq!(sys::aclmdlRICaptureEnd(s, &mut ri), 0, "{}", sys::recent_error());
        assert_eq!(sys::aclmdlRIDestroy(ri), 0);
    }
}

#[test]
fn querying_an_event_recorded_in_an_open_capture_is_rejected() {
    let _init = backend(None);
    let s = stream();
    let e = event(sys::ACL_EVENT_CAPTURE_STREAM_PROGRESS);
    let mut status = sys::ACL_EVENT_RECORDED_STATUS_NOT_READY;
    // SAFETY: live stream and event, valid out-parameters; the capture is ended below.
    unsafe {
        assert_eq!(sys::aclmdlRICaptureBegin(s, sys::ACL_MODEL_RI_CAPTURE_MODE_RELAXED), 0);
        assert_eq!(sys::aclrtRecordEvent(e, s), 0);
        assert_eq!(sys::aclrtQueryEventStatus(e, &mut status), sys::ACL_ERROR_RT_EVENT_CAPTURED);
        let mut ri = std::ptr::null_mut();
        assert_eq!(sys::aclmdlRICaptureEnd(s, &mut ri), 0, "{}", sys::recent_error());
        assert_eq!(sys::aclrtQueryEventStatus(e, &mut status), 0);
        assert_eq!(sys::aclmdlRIDestroy(ri), 0);
    }
}

/// Phase one of an aclnn op queues no task: CANN allows it while a capture is open.
#[test]
fn aclnn_phase_one_is_allowed_while_a_capture_is_open() {
    let _init = backend(None);
    let s = stream();
    let mem = device_alloc(16);
    let (dims, strides) = ([4i64], [1i64]);
    // SAFETY: arrays of one value, a live allocation of 4 f32; valid out-parameters; the
    // capture is ended below.
    unsafe {
        let t = sys::aclCreateTensor(
            dims.as_ptr(),
            1,
            sys::ACL_FLOAT,
            strides.as_ptr(),
            0,
            sys::ACL_FORMAT_ND,
            dims.as_ptr(),
            1,
            mem,
        );
        let mut v = 1.5f64;
        let scalar = sys::aclCreateScalar((&raw mut v).cast(), sys::ACL_DOUBLE);
        assert_eq!(sys::aclmdlRICaptureBegin(s, sys::ACL_MODEL_RI_CAPTURE_MODE_RELAXED), 0);
        let (mut ws, mut ex) = (0u64, std::ptr::null_mut());
        let code = sys::aclnnInplaceFillScalarGetWorkspaceSize(t, scalar, &mut ws, &mut ex);
        assert_eq!(code, 0, "{}", sys::recent_error());
        assert_eq!(sys::aclnnInplaceFillScalar(std::ptr::null_mut(), ws, ex, s), 0);
        let mut ri = std::ptr::null_mut();
        assert_eq!(sys::aclmdlRICaptureEnd(s, &mut ri), 0, "{}", sys::recent_error());
        assert_eq!(sys::aclmdlRIExecuteAsync(ri, s), 0);
        assert_eq!(sys::aclrtSynchronizeStream(s), 0);
        assert_eq!(sys::aclmdlRIDestroy(ri), 0);
        assert_eq!(sys::aclDestroyScalar(scalar), 0);
        assert_eq!(sys::aclDestroyTensor(t), 0);
    }
    let mut got = [0f32; 4];
    copy(got.as_mut_ptr().cast(), mem, 16, sys::ACL_MEMCPY_DEVICE_TO_HOST, s);
    assert_eq!(got, [1.5; 4]);
}

/// The allocator's reuse events only mark progress: `ACL_EVENT_CAPTURE_STREAM_PROGRESS`, not the
/// scarce SYNC events.
#[test]
fn reuse_events_are_capture_stream_progress_events() {
    let b = backend(None);
    let s = b.new_stream().unwrap();
    let x = b.alloc(DType::F32, &[4]).unwrap();
    let start = calls().len();
    b.free(&s, x.buffer().clone()).unwrap();
    drop(x);
    let created: Vec<String> = calls()
        .split_off(start)
        .into_iter()
        .filter(|c| c.starts_with("aclrtCreateEventExWithFlag"))
        .collect();
    assert_eq!(created, vec!["aclrtCreateEventExWithFlag(CAPTURE_STREAM_PROGRESS)".to_string()]);
}

/// A graph launched as an ACL model behind work held on the host (behind a host function) runs
/// after that work, as the submission order says.
#[test]
fn a_model_launched_behind_held_work_runs_after_it() {
    let b = backend(None);
    let s = b.new_stream().unwrap();
    let x = b.alloc(DType::F32, &[4]).unwrap();
    let y = b.alloc(DType::F32, &[4]).unwrap();
    b.launch(&s, Op::Fill { dst: x.clone(), value: 0.0 }).unwrap();
    b.launch(&s, Op::Fill { dst: y.clone(), value: 0.0 }).unwrap();
    b.synchronize(&s).unwrap();
    b.begin_capture(&s).unwrap();
    b.launch(&s, Op::Copy { src: x.clone(), dst: y.clone() }).unwrap();
    let graph = b.end_capture(&s).unwrap();
    let slow = HostFn::new(|| {
        std::thread::sleep(std::time::Duration::from_millis(50));
        Ok(())
    });
    b.launch(&s, Op::Host { name: "slow", f: slow }).unwrap();
    b.launch(&s, Op::Fill { dst: x.clone(), value: 3.0 }).unwrap();
    b.launch_graph(&graph, &s).unwrap();
    assert_eq!(b.download::<f32>(&s, &y).unwrap(), vec![3.0; 4]);
}
