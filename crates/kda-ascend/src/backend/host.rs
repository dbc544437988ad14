//! Host functions, and how a failing one stops its stream.
//!
//! `Op::Host` runs through `aclrtLaunchHostFunc`, whose callback returns nothing and blocks the
//! stream until it returns. A failure is therefore carried in two places: the stream's state
//! (the op name and message the HAL reports at `synchronize`) and a flag in pinned host memory
//! mapped for the device. Right behind every host function the backend launches the
//! `kda_host_guard` kernel, which fails when the flag is set; streams run with
//! `ACL_STOP_ON_FAILURE`, so the stream's later tasks are skipped and streams waiting on its
//! events fail too — the HAL's failure contract.

use std::ffi::c_void;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Arc, Weak};

use kda_core::{Error, HostFn, Result, StreamHandle};

use super::acl::check;
use super::{AscendStream, StreamInner};
use crate::error::AscendError;
use crate::sys;

/// A host function queued on a stream (kept alive by the stream until it is synchronized).
pub(crate) struct HostCall {
    name: String,
    f: HostFn,
    stream: Weak<StreamInner>,
}

impl HostCall {
    pub(crate) fn new(name: &str, f: HostFn, stream: &AscendStream) -> Arc<Self> {
        Arc::new(HostCall { name: name.to_string(), f, stream: Arc::downgrade(&stream.inner) })
    }

    /// Queue it (`aclrtLaunchHostFunc`).
    pub(crate) fn issue(self: &Arc<Self>, stream: sys::aclrtStream) -> Result<()> {
        let args = Arc::as_ptr(self).cast_mut().cast::<c_void>();
        // SAFETY: a live stream; `args` points to a `HostCall` the stream keeps alive until it
        // is synchronized, which is after the callback has run.
        check("aclrtLaunchHostFunc", unsafe {
            sys::aclrtLaunchHostFunc(stream, Some(run_host), args)
        })?;
        Ok(())
    }
}

impl std::fmt::Debug for HostCall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HostCall({})", self.name)
    }
}

/// The callback `aclrtLaunchHostFunc` runs.
unsafe extern "C" fn run_host(args: *mut c_void) {
    // SAFETY: `args` is the `HostCall` passed by `issue`, alive while its stream holds it.
    let call = unsafe { &*args.cast::<HostCall>() };
    if let Err(message) = call.f.call() {
        if let Some(stream) = call.stream.upgrade() {
            stream.fail(&call.name, message);
        }
    }
}

impl StreamInner {
    /// Device address of the failure flag the guard kernel reads.
    pub(crate) fn guard_addr(&self) -> usize {
        self.guard.device_addr()
    }

    fn flag(&self) -> &AtomicI32 {
        // SAFETY: the guard memory is 4 pinned bytes, aligned by the allocator, alive as long as
        // `self`, and only accessed atomically by the host.
        unsafe { &*self.guard.ptr().cast::<AtomicI32>() }
    }

    /// A host function failed: keep the first failure and raise the flag.
    fn fail(&self, op: &str, message: String) {
        let mut state = self.state();
        state.host_failure.get_or_insert((op.to_string(), message));
        drop(state);
        self.flag().store(1, Ordering::Release);
    }
}

/// `aclrtSynchronizeStream`, mapped onto the HAL's errors: the stream's own failed host
/// function, else a failed stream it waited on, else the ACL error itself.
pub(crate) fn synchronize(stream: &AscendStream) -> Result<()> {
    let inner = &stream.inner;
    // SAFETY: a live stream.
    let code = unsafe { sys::aclrtSynchronizeStream(inner.raw.get()) };
    let message = if code == sys::ACL_SUCCESS { String::new() } else { sys::recent_error() };
    let (kept, upstream, failure, tasks) = {
        let mut state = inner.state();
        let failure = if code == sys::ACL_SUCCESS { None } else { state.host_failure.take() };
        let tasks = std::mem::take(&mut state.tasks);
        (std::mem::take(&mut state.in_flight), std::mem::take(&mut state.upstream), failure, tasks)
    };
    // Everything queued so far has finished (or was skipped): release what it kept.
    drop(kept);
    if code == sys::ACL_SUCCESS {
        return Ok(());
    }
    if let Some((op, message)) = failure {
        inner.flag().store(0, Ordering::Release);
        return Err(Error::OpFailed { op, stream: stream.id(), message });
    }
    for up in upstream.iter().filter_map(Weak::upgrade) {
        let failed = up.state().host_failure.clone();
        if let Some((_, message)) = failed {
            return Err(Error::DependencyFailed { stream: stream.id(), upstream: up.id, message });
        }
    }
    // A device task failed: the runtime's report names the kernel or aclnn op (an AI Core
    // exception report on hardware; the emulator's names the reference op), which names the
    // HAL op that queued it.
    let op = tasks
        .iter()
        .find(|(task, label)| message.contains(task) || message.contains(label.as_str()))
        .map_or_else(|| "device task".to_string(), |(_, label)| label.clone());
    let acl = AscendError::Acl { func: "aclrtSynchronizeStream", code, message };
    Err(Error::OpFailed { op, stream: stream.id(), message: acl.to_string() })
}
