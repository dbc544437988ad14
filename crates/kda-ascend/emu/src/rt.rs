//! The ACL runtime: init, device, memory, copies, streams, events, host functions, capture.

use std::ffi::{CString, c_char, c_void};
use std::sync::atomic::Ordering;
use std::sync::{Arc, PoisonError};

use kda_core::HostFn;

use crate::host;
use crate::types::*;
use crate::{EmuEvent, Res, array, call, emu, invalid, put};

/// The SoC the emulated device reports: `KDA_ACL_EMU_SOC`, else an Ascend 950PR part (MX
/// GEMMs).
pub(crate) fn soc_name() -> CString {
    let name = std::env::var("KDA_ACL_EMU_SOC").unwrap_or_else(|_| "Ascend950PR_9599".into());
    CString::new(name).unwrap_or_default()
}

/// Whether the MX dtypes (and their aclnn ops) exist on `soc` (Ascend 950 only).
pub(crate) fn soc_has_mx(soc: &CString) -> bool {
    soc.to_bytes().starts_with(b"Ascend950")
}

#[unsafe(no_mangle)]
pub extern "C" fn aclInit(_config_path: *const c_char) -> aclError {
    let mut emu = emu();
    if emu.initialized {
        return crate::fail(ACL_ERROR_REPEAT_INITIALIZE, "aclInit: already initialized");
    }
    emu.initialized = true;
    emu.soc = soc_name();
    ACL_SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn aclrtSetDevice(device: i32) -> aclError {
    call(|| {
        emu().ready("aclrtSetDevice")?;
        if device != 0 {
            return invalid(format!("aclrtSetDevice: device {device} (the emulator has device 0)"));
        }
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn aclrtGetSocName() -> *const c_char {
    // The CString lives in the static emulator state and is replaced only by `aclInit`.
    emu().soc.as_ptr()
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn aclrtMalloc(
    dev_ptr: *mut *mut c_void,
    size: usize,
    _policy: aclrtMemMallocPolicy,
) -> aclError {
    call(|| {
        let mut emu = emu();
        emu.ready("aclrtMalloc")?;
        if size == 0 {
            return invalid("aclrtMalloc: size 0");
        }
        let buf = crate::allocate(&emu, "aclrtMalloc", size)?;
        let addr = buf.element_ptr::<u8>(0);
        emu.memory.insert(addr as usize, buf);
        // SAFETY: the caller passes a writable out-parameter (CANN's contract).
        unsafe { put("aclrtMalloc", dev_ptr, addr.cast()) }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn aclrtFree(dev_ptr: *mut c_void) -> aclError {
    call(|| match emu().memory.remove(&(dev_ptr as usize)) {
        // Queued work holds its own handles: the memory lives until that work has run.
        Some(_) => Ok(()),
        None => invalid(format!("aclrtFree: {dev_ptr:?} is not an allocation")),
    })
}

/// Host-pinned memory: in the emulator it is device memory too (the device reads host memory).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn aclrtMallocHost(host_ptr: *mut *mut c_void, size: usize) -> aclError {
    // SAFETY: forwarded contract.
    unsafe { aclrtMalloc(host_ptr, size, ACL_MEM_MALLOC_HUGE_FIRST) }
}

#[unsafe(no_mangle)]
pub extern "C" fn aclrtFreeHost(host_ptr: *mut c_void) -> aclError {
    aclrtFree(host_ptr)
}

/// A host address the emulator may write later, on a stream's thread.
struct HostPtr(usize);

#[unsafe(no_mangle)]
pub unsafe extern "C" fn aclrtMemcpyAsync(
    dst: *mut c_void,
    dest_max: usize,
    src: *const c_void,
    count: usize,
    kind: aclrtMemcpyKind,
    stream: aclrtStream,
) -> aclError {
    const API: &str = "aclrtMemcpyAsync";
    call(|| {
        let emu = emu();
        emu.ready(API)?;
        if count > dest_max {
            return invalid(format!("{API}: count {count} > destMax {dest_max}"));
        }
        let s = emu.stream(API, stream)?;
        if count == 0 {
            return Ok(());
        }
        let body: HostFn = match kind {
            ACL_MEMCPY_HOST_TO_DEVICE => {
                // SAFETY: `src` holds `count` readable bytes (CANN's contract); the emulator
                // stages them at once, which the real runtime does not promise.
                let data = unsafe { array(src.cast::<u8>(), count) }?;
                let dst = emu.bytes(API, dst as usize, count)?;
                HostFn::new(move || {
                    // SAFETY: the view keeps its memory alive; stream order as the device.
                    unsafe { host::write_bytes(&dst, &data) };
                    Ok(())
                })
            }
            ACL_MEMCPY_DEVICE_TO_HOST => {
                let src = emu.bytes(API, src as usize, count)?;
                let target = HostPtr(dst as usize);
                HostFn::new(move || {
                    // SAFETY: the view keeps its memory alive; stream order as the device.
                    let bytes = unsafe { host::read_bytes(&src) };
                    let target = &target;
                    // SAFETY: the caller keeps `dst` valid for `count` bytes until the stream has
                    // passed this copy (CANN's contract for asynchronous copies).
                    unsafe {
                        std::ptr::copy_nonoverlapping(bytes.as_ptr(), target.0 as *mut u8, count)
                    };
                    Ok(())
                })
            }
            ACL_MEMCPY_DEVICE_TO_DEVICE => {
                let (src, dst) =
                    (emu.bytes(API, src as usize, count)?, emu.bytes(API, dst as usize, count)?);
                HostFn::new(move || {
                    // SAFETY: the views keep their memory alive; stream order as the device.
                    unsafe { host::copy_raw(&src, &dst) };
                    Ok(())
                })
            }
            other => return invalid(format!("{API}: copy kind {other}")),
        };
        let ops = vec![body];
        emu.launch(API, &s, ops)?;
        crate::log(API, stream as usize, 0);
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn aclrtCreateStream(stream: *mut aclrtStream) -> aclError {
    call(|| {
        let mut emu = emu();
        emu.ready("aclrtCreateStream")?;
        let h = emu.handle();
        let s = crate::sched::Stream::new(h)
            .map_err(|e| (ACL_ERROR_RT_INTERNAL_ERROR, format!("aclrtCreateStream: {e}")))?;
        emu.streams.insert(h, s);
        // SAFETY: writable out-parameter per CANN's contract.
        unsafe { put("aclrtCreateStream", stream, h as aclrtStream) }
    })
}

/// `ACL_STOP_ON_FAILURE`: after a failed task no task of the context runs and no new one is
/// accepted; set on one stream, the mode holds for every stream of the context (hicann/runtime
/// `hicann/runtime/docs/zh/api_ref/06_stream_management.md`, `aclrtSetStreamFailureMode`,
/// 约束说明; `hicann/runtime/docs/zh/dev_guide/03-02_stream_management.md`, 配置任务遇错即停: a
/// failed task stops the tasks of every stream of the context). The emulator implements only
/// this mode. Setting it queues no task (`stream.cc`, `Stream::SetFailMode`), so a stopped
/// context accepts it.
#[unsafe(no_mangle)]
pub extern "C" fn aclrtSetStreamFailureMode(stream: aclrtStream, mode: u64) -> aclError {
    call(|| {
        let mut emu = emu();
        emu.known_stream("aclrtSetStreamFailureMode", stream)?;
        if mode != ACL_STOP_ON_FAILURE {
            return invalid(format!(
                "aclrtSetStreamFailureMode: mode {mode} (the emulator implements STOP_ON_FAILURE)"
            ));
        }
        emu.stop_on_failure = true;
        Ok(())
    })
}

/// Destroying a stream, stopped or not, is allowed; it does not clear the context's failure
/// (the runtime destroys a stream of a failed context through its control stream,
/// `stream.cc`, `Stream::TearDown`).
#[unsafe(no_mangle)]
pub extern "C" fn aclrtDestroyStream(stream: aclrtStream) -> aclError {
    call(|| {
        let mut emu = emu();
        if emu.capture.is_some_and(|c| c.stream == stream as usize) {
            return Err((
                ACL_ERROR_RT_STREAM_CAPTURED,
                "aclrtDestroyStream: the stream is capturing".into(),
            ));
        }
        // The worker finishes its queue and exits once the last handle is gone.
        match emu.streams.remove(&(stream as usize)) {
            Some(_) => Ok(()),
            None => invalid(format!("aclrtDestroyStream: unknown stream {stream:?}")),
        }
    })
}

/// Block until the stream's work has run; a failed task is returned
/// (`ACL_ERROR_RT_AICORE_EXCEPTION`, its text in `aclGetRecentErrMsg`) and recorded on the
/// context. Under stop-on-failure every synchronize of every stream of the context then reports
/// that failure (`stream.cc`, `Stream::GetSynchronizeError`: the context's failure error), and
/// no stream accepts a task ([`crate::Emu::stream`]). A capturing stream cannot be synchronized
/// (`ACL_ERROR_RT_STREAM_CAPTURED`).
#[unsafe(no_mangle)]
pub extern "C" fn aclrtSynchronizeStream(stream: aclrtStream) -> aclError {
    const API: &str = "aclrtSynchronizeStream";
    call(|| {
        let (s, failure) = {
            let emu = emu();
            if emu.captured_streams.contains(&(stream as usize)) {
                return Err((
                    ACL_ERROR_RT_STREAM_CAPTURED,
                    format!("{API}: stream {stream:?} is capturing"),
                ));
            }
            (emu.known_stream(API, stream)?, emu.failure.clone())
        };
        // Blocks without the emulator lock: host functions on the stream may call the runtime.
        let result = s.synchronize();
        if let Err(other) = &result {
            failure.record(
                ACL_ERROR_RT_AICORE_EXCEPTION,
                format!("a task on stream {stream:?} failed: {other}"),
            );
        }
        let emu = emu();
        match (emu.stop_on_failure, failure.get(), result) {
            (true, Some((code, why)), _) => Err((
                code,
                format!(
                    "{API}: stream {stream:?}: the context stopped on a failed task \
                     (stop-on-failure): {why}"
                ),
            )),
            (_, _, Ok(())) => Ok(()),
            (_, _, Err(other)) => Err((ACL_ERROR_RT_AICORE_EXCEPTION, format!("{API}: {other}"))),
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn aclrtCreateEventExWithFlag(event: *mut aclrtEvent, flag: u32) -> aclError {
    call(|| {
        let mut emu = emu();
        emu.ready("aclrtCreateEventExWithFlag")?;
        let h = emu.handle();
        let at = Arc::default();
        emu.events
            .insert(h, EmuEvent { mark: None, flags: flag, recorded: 0, done: Arc::default(), at });
        let kind = match flag {
            ACL_EVENT_SYNC => "SYNC".to_string(),
            ACL_EVENT_CAPTURE_STREAM_PROGRESS => "CAPTURE_STREAM_PROGRESS".to_string(),
            0 => "no SYNC".to_string(),
            other => format!("{other:#x}"),
        };
        crate::log(format!("aclrtCreateEventExWithFlag({kind})"), 0, h);
        // SAFETY: writable out-parameter per CANN's contract.
        unsafe { put("aclrtCreateEventExWithFlag", event, h as aclrtEvent) }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn aclrtDestroyEvent(event: aclrtEvent) -> aclError {
    call(|| match emu().events.remove(&(event as usize)) {
        Some(_) => Ok(()),
        None => invalid(format!("aclrtDestroyEvent: unknown event {event:?}")),
    })
}

fn event<'a>(api: &str, emu: &'a crate::Emu, event: aclrtEvent) -> Res<&'a EmuEvent> {
    emu.events
        .get(&(event as usize))
        .ok_or_else(|| (ACL_ERROR_INVALID_PARAM, format!("{api}: unknown event {event:?}")))
}

#[unsafe(no_mangle)]
pub extern "C" fn aclrtRecordEvent(ev: aclrtEvent, stream: aclrtStream) -> aclError {
    const API: &str = "aclrtRecordEvent";
    call(|| {
        let mut emu = emu();
        let s = emu.stream(API, stream)?;
        event(API, &emu, ev)?;
        crate::log(API, stream as usize, ev as usize);
        let captured = {
            let mut recording = emu.recording.lock().unwrap_or_else(PoisonError::into_inner);
            match recording.as_mut() {
                Some(c) if c.holds(stream as usize) => {
                    c.record(stream as usize, ev as usize);
                    true
                }
                _ => false,
            }
        };
        if captured {
            // A captured record completes when the model runs; until the capture ends the event
            // cannot be queried.
            emu.captured_events.insert(ev as usize);
            return Ok(());
        }
        let mark = s.mark();
        // Completion for `aclrtQueryEventStatus`: a marker right behind the recorded work.
        let slot =
            emu.events.get_mut(&(ev as usize)).ok_or((ACL_ERROR_INVALID_PARAM, API.into()))?;
        slot.mark = Some(mark);
        slot.recorded += 1;
        let (generation, done, at) = (slot.recorded, Arc::clone(&slot.done), Arc::clone(&slot.at));
        let mark = HostFn::new(move || {
            *at.lock().map_err(|e| e.to_string())? = Some(std::time::Instant::now());
            done.fetch_max(generation, Ordering::AcqRel);
            Ok(())
        });
        emu.launch("event_complete", &s, vec![mark])
    })
}

/// Only an event created with `ACL_EVENT_SYNC` orders another stream; CANN rejects the rest.
#[unsafe(no_mangle)]
pub extern "C" fn aclrtStreamWaitEvent(stream: aclrtStream, ev: aclrtEvent) -> aclError {
    const API: &str = "aclrtStreamWaitEvent";
    call(|| {
        let mut emu = emu();
        let (mark, flags) = event(API, &emu, ev).map(|e| (e.mark.clone(), e.flags))?;
        if flags & ACL_EVENT_SYNC == 0 {
            return Err((
                ACL_ERROR_RT_PARAM_INVALID,
                format!(
                    "{API}: event {ev:?} was created with flags {flags:#x}, without ACL_EVENT_SYNC"
                ),
            ));
        }
        let s = emu.stream(API, stream)?;
        if emu.captured_events.contains(&(ev as usize)) {
            // A wait on an event recorded inside the open capture pulls the stream into it.
            let mut recording = emu.recording.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(c) = recording.as_mut() {
                c.wait(stream as usize, ev as usize);
            }
            drop(recording);
            emu.captured_streams.insert(stream as usize);
        } else if let Some(mark) = mark {
            // Outside the capture (or on a record made before it began, which a model then
            // finds satisfied): order the stream after the record. An event never recorded
            // orders nothing.
            let held = emu.recording.lock().unwrap_or_else(PoisonError::into_inner);
            if !held.as_ref().is_some_and(|c| c.holds(stream as usize)) {
                s.wait(&mark);
            }
        }
        crate::log(API, stream as usize, ev as usize);
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn aclrtQueryEventStatus(
    ev: aclrtEvent,
    status: *mut aclrtEventRecordedStatus,
) -> aclError {
    const API: &str = "aclrtQueryEventStatus";
    call(|| {
        let emu = emu();
        let e = event(API, &emu, ev)?;
        if emu.captured_events.contains(&(ev as usize)) {
            return Err((
                ACL_ERROR_RT_EVENT_CAPTURED,
                format!("{API}: event {ev:?} was recorded in a capture that is still open"),
            ));
        }
        let done = e.done.load(Ordering::Acquire) >= e.recorded;
        let value = if done {
            ACL_EVENT_RECORDED_STATUS_COMPLETE
        } else {
            ACL_EVENT_RECORDED_STATUS_NOT_READY
        };
        // SAFETY: writable out-parameter per CANN's contract.
        unsafe { put(API, status, value) }
    })
}

/// Milliseconds between the completions of two recorded `ACL_EVENT_TIME_LINE` events.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn aclrtEventElapsedTime(
    ms: *mut f32,
    start: aclrtEvent,
    end: aclrtEvent,
) -> aclError {
    const API: &str = "aclrtEventElapsedTime";
    call(|| {
        let emu = emu();
        let time = |ev: aclrtEvent| -> Res<std::time::Instant> {
            let e = event(API, &emu, ev)?;
            if e.flags & ACL_EVENT_TIME_LINE == 0 {
                return invalid(format!(
                    "{API}: event {ev:?} was created without ACL_EVENT_TIME_LINE"
                ));
            }
            let at = *e.at.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            match at {
                Some(t) if e.done.load(Ordering::Acquire) >= e.recorded => Ok(t),
                _ => Err((
                    ACL_ERROR_RT_EVENT_NOT_COMPLETE,
                    format!("{API}: event {ev:?} has not completed"),
                )),
            }
        };
        let (a, b) = (time(start)?, time(end)?);
        let elapsed = b.saturating_duration_since(a).as_secs_f64() * 1e3;
        // SAFETY: writable out-parameter per CANN's contract.
        unsafe { put(API, ms, elapsed as f32) }
    })
}

/// The user data of a host function, sent to the stream's thread.
struct HostCall {
    f: unsafe extern "C" fn(*mut c_void),
    args: usize,
}

#[unsafe(no_mangle)]
pub extern "C" fn aclrtLaunchHostFunc(
    stream: aclrtStream,
    f: aclrtHostFunc,
    args: *mut c_void,
) -> aclError {
    const API: &str = "aclrtLaunchHostFunc";
    call(|| {
        let emu = emu();
        let s = emu.stream(API, stream)?;
        let Some(f) = f else { return invalid(format!("{API}: null function")) };
        let host = Arc::new(HostCall { f, args: args as usize });
        let run = HostFn::new(move || {
            // SAFETY: the caller keeps `args` valid until the function has run and `f` is a
            // valid host function (CANN's contract).
            unsafe { (host.f)(host.args as *mut c_void) };
            Ok(())
        });
        emu.launch("host_func", &s, vec![run])?;
        crate::log(API, stream as usize, 0);
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn aclmdlRICaptureBegin(stream: aclrtStream, mode: aclmdlRICaptureMode) -> aclError {
    const API: &str = "aclmdlRICaptureBegin";
    call(|| {
        let mut emu = loop {
            let emu = emu();
            match emu.capture {
                // Another thread's capture: wait for it to end (see `Capturing`).
                Some(open) if open.thread != std::thread::current().id() => {
                    drop(emu);
                    std::thread::sleep(std::time::Duration::from_micros(50));
                }
                _ => break emu,
            }
        };
        if !(ACL_MODEL_RI_CAPTURE_MODE_GLOBAL..=ACL_MODEL_RI_CAPTURE_MODE_RELAXED).contains(&mode) {
            return invalid(format!("{API}: capture mode {mode}"));
        }
        emu.known_stream(API, stream)?;
        *emu.recording.lock().unwrap_or_else(PoisonError::into_inner) =
            Some(crate::sched::Capture::new(stream as usize));
        emu.capture =
            Some(crate::Capturing { stream: stream as usize, thread: std::thread::current().id() });
        emu.captured_streams.insert(stream as usize);
        crate::log(API, stream as usize, 0);
        Ok(())
    })
}

/// End the capture: fails with `ACL_ERROR_RT_STREAM_UNJOINED` when a forked stream was
/// not joined back to the origin after its last work.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn aclmdlRICaptureEnd(
    stream: aclrtStream,
    model_ri: *mut aclmdlRI,
) -> aclError {
    const API: &str = "aclmdlRICaptureEnd";
    call(|| {
        let mut emu = emu();
        emu.known_stream(API, stream)?;
        let recording = {
            let mut held = emu.recording.lock().unwrap_or_else(PoisonError::into_inner);
            match held.as_ref() {
                Some(c) if c.origin == stream as usize => held.take(),
                _ => None,
            }
        };
        let Some(recording) = recording else {
            return Err((
                ACL_ERROR_RT_STREAM_CAPTURE_INVALIDATED,
                format!("{API}: stream {stream:?} is not the origin of an open capture"),
            ));
        };
        emu.capture = None;
        emu.captured_events.clear();
        emu.captured_streams.clear();
        let graph =
            recording.end().map_err(|crate::sched::Unjoined::NotJoined { stream: s }| {
                (
                    ACL_ERROR_RT_STREAM_UNJOINED,
                    format!(
                        "{API}: stream {s:#x} of the capture was never joined back to its origin \
                     after its last work"
                    ),
                )
            })?;
        let h = emu.handle();
        emu.models.insert(h, graph);
        // SAFETY: writable out-parameter per CANN's contract.
        unsafe { put(API, model_ri, h as aclmdlRI) }?;
        crate::log(API, stream as usize, 0);
        Ok(())
    })
}

/// Whether `stream` is in the open capture (its origin, or a stream that waited on an event
/// recorded inside it): `ACL_MODEL_RI_CAPTURE_STATUS_ACTIVE`, else `…_NONE`. The model out-parameter
/// is optional (null allowed) and receives null: the instance exists only at `aclmdlRICaptureEnd`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn aclmdlRICaptureGetInfo(
    stream: aclrtStream,
    status: *mut aclmdlRICaptureStatus,
    model_ri: *mut aclmdlRI,
) -> aclError {
    const API: &str = "aclmdlRICaptureGetInfo";
    call(|| {
        let emu = emu();
        if !emu.streams.contains_key(&(stream as usize)) {
            return invalid(format!("{API}: unknown stream {stream:?}"));
        }
        let value = if emu.captured_streams.contains(&(stream as usize)) {
            ACL_MODEL_RI_CAPTURE_STATUS_ACTIVE
        } else {
            ACL_MODEL_RI_CAPTURE_STATUS_NONE
        };
        if !model_ri.is_null() {
            // SAFETY: non-null, writable per CANN's contract.
            unsafe { put(API, model_ri, std::ptr::null_mut()) }?;
        }
        // SAFETY: writable out-parameter per CANN's contract.
        unsafe { put(API, status, value) }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn aclmdlRIExecuteAsync(model_ri: aclmdlRI, stream: aclrtStream) -> aclError {
    const API: &str = "aclmdlRIExecuteAsync";
    call(|| {
        let emu = emu();
        let s = emu.stream(API, stream)?;
        let model = emu.models.get(&(model_ri as usize)).ok_or_else(|| {
            (ACL_ERROR_INVALID_PARAM, format!("{API}: unknown model {model_ri:?}"))
        })?;
        emu.launch(API, &s, vec![model.replay()])?;
        crate::log(API, stream as usize, 0);
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn aclmdlRIDestroy(model_ri: aclmdlRI) -> aclError {
    call(|| match emu().models.remove(&(model_ri as usize)) {
        Some(_) => {
            crate::log("aclmdlRIDestroy", 0, 0);
            Ok(())
        }
        None => invalid(format!("aclmdlRIDestroy: unknown model {model_ri:?}")),
    })
}
