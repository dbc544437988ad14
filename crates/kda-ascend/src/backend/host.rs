//! Host functions, and how a failure stops a stream — on the host, with no device fault.
//!
//! `Op::Host` runs through `aclrtLaunchHostFunc`, whose callback returns nothing and blocks the
//! stream until it returns. The callback only stores its outcome in its [`HostCall`]: it holds
//! no stream (so it never drops the last owner of one) and never calls the runtime.
//!
//! Work submitted on a stream behind a host function whose outcome is not known yet is *held*
//! on the host ([`StreamState::held`](super::StreamState)), in order. The next HAL call on the
//! stream (and its `synchronize`, which waits for the outcome) settles it: after a success the
//! held work is issued; after a failure it is dropped and the stream is marked failed — its
//! later work is skipped until `synchronize` reports `OpFailed`, and a stream that waits on one
//! of its events after the failure is marked `DependencyFailed`. A stream that waits on an event
//! whose record is still held elsewhere is held itself until that record is issued.
//!
//! A device task that fails is different: under `ACL_STOP_ON_FAILURE` the runtime stops the ACL
//! stream for good. `synchronize` reports the failure and continues the HAL stream on a fresh
//! ACL stream; docs/design/ascend.md#failures says when a new backend instance is the recovery.

use std::ffi::c_void;
use std::sync::{Arc, Condvar, Mutex, PoisonError, Weak};

use kda_core::{Error, HostFn, Result, StreamHandle, StreamId};

use super::acl::{self, RawEvent, check};
use super::memory::AscendBuffer;
use super::ops::{self, Step};
use super::{AscendStream, EventInner, StreamInner};
use crate::error::AscendError;
use crate::sys;

/// A host function queued on a stream (kept alive by the stream until it is synchronized).
pub(crate) struct HostCall {
    name: String,
    f: HostFn,
    /// `None` until the callback has run; then its result.
    outcome: Mutex<Option<std::result::Result<(), String>>>,
    done: Condvar,
}

impl HostCall {
    pub(crate) fn new(name: &str, f: HostFn, _stream: &AscendStream) -> Arc<Self> {
        Arc::new(HostCall {
            name: name.to_string(),
            f,
            outcome: Mutex::new(None),
            done: Condvar::new(),
        })
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

    fn outcome(&self) -> Option<std::result::Result<(), String>> {
        self.outcome.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Block until the callback has run.
    fn wait(&self) {
        let guard = self.outcome.lock().unwrap_or_else(PoisonError::into_inner);
        let _done =
            self.done.wait_while(guard, |o| o.is_none()).unwrap_or_else(PoisonError::into_inner);
    }
}

impl std::fmt::Debug for HostCall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HostCall({})", self.name)
    }
}

/// The callback `aclrtLaunchHostFunc` runs: the function, then its outcome, nothing else.
unsafe extern "C" fn run_host(args: *mut c_void) {
    // SAFETY: `args` is the `HostCall` passed by `issue`, alive while its stream holds it.
    let call = unsafe { &*args.cast::<HostCall>() };
    let result = call.f.call();
    *call.outcome.lock().unwrap_or_else(PoisonError::into_inner) = Some(result);
    call.done.notify_all();
}

/// Why a stream's work is held.
#[derive(Clone, Debug)]
pub(crate) enum Gate {
    /// A host function whose outcome is not known yet.
    Host(Arc<HostCall>),
    /// A wait on an event whose record is held on this stream.
    Stream(Arc<StreamInner>),
}

/// Work submitted behind a gate.
#[derive(Debug)]
pub(crate) enum Held {
    Steps(Vec<Step>),
    Record(Arc<EventInner>),
    Wait(Arc<EventInner>),
    Free(AscendBuffer),
}

/// A failure the stream reports at its next synchronize.
#[derive(Clone, Debug)]
pub(crate) enum Failure {
    /// A host function of this stream failed.
    Own { op: String, message: String },
    /// The stream waited on an event of a failed stream.
    Upstream { upstream: StreamId, message: String },
}

impl Failure {
    fn message(&self) -> &str {
        match self {
            Failure::Own { message, .. } | Failure::Upstream { message, .. } => message,
        }
    }
}

/// Nesting of gates followed by [`settle`] and [`drain`] (a longer chain is a cycle).
const MAX_CHAIN: usize = 64;

/// Submit `item` on `stream`: skipped on a failed stream, held behind a gate, else issued.
pub(crate) fn submit(stream: &AscendStream, item: Held) -> Result<()> {
    let inner = &stream.inner;
    settle(inner, 0)?;
    let mut state = inner.state();
    if let Some(failure) = state.failure.clone() {
        drop(state);
        return skip(inner, item, &failure);
    }
    if state.gate.is_some() || !state.held.is_empty() {
        if let Held::Record(event) = &item {
            event.held_on(Some(Arc::downgrade(inner)));
        }
        state.held.push_back(item);
        return Ok(());
    }
    drop(state);
    issue(inner, item)
}

/// Work on a failed stream: skipped (the HAL contract). A free still marks the stream's progress,
/// so the block is reused only after the work issued before it; a record marks the event failed.
fn skip(inner: &Arc<StreamInner>, item: Held, failure: &Failure) -> Result<()> {
    match item {
        Held::Free(buffer) => free_now(inner, buffer),
        Held::Record(event) => {
            event.held_on(None);
            event.failed(Some((inner.id, failure.message().to_string())));
            Ok(())
        }
        Held::Steps(_) | Held::Wait(_) => Ok(()),
    }
}

fn handle(inner: &Arc<StreamInner>) -> AscendStream {
    AscendStream { inner: Arc::clone(inner) }
}

fn free_now(inner: &StreamInner, buffer: AscendBuffer) -> Result<()> {
    let event = RawEvent::progress()?;
    event.record(&inner.raw)?;
    buffer.free_after(event);
    Ok(())
}

/// Issue `item` now; it may set a gate (a host step, a wait on a held record), behind which the
/// rest of it is held.
fn issue(inner: &Arc<StreamInner>, item: Held) -> Result<()> {
    match item {
        Held::Steps(steps) => {
            let mut rest = steps.into_iter();
            while let Some(step) = rest.next() {
                let issued = ops::issue_steps(&handle(inner), std::slice::from_ref(&step));
                let host = match &step {
                    Step::Host(call) => Some(Arc::clone(call)),
                    _ => None,
                };
                // Even after a failed step, what was queued before it must stay alive.
                inner.keep(step);
                issued?;
                if let Some(call) = host {
                    let remaining: Vec<Step> = rest.collect();
                    let mut state = inner.state();
                    state.gate = Some(Gate::Host(call));
                    if !remaining.is_empty() {
                        state.held.push_front(Held::Steps(remaining));
                    }
                    return Ok(());
                }
            }
            Ok(())
        }
        Held::Record(event) => {
            event.raw.record(&inner.raw)?;
            event.held_on(None);
            event.failed(None);
            inner.keep(event);
            Ok(())
        }
        Held::Wait(event) => {
            if let Some((upstream, message)) = event.failure() {
                fail(inner, Failure::Upstream { upstream, message });
                return Ok(());
            }
            if let Some(up) = event.held_stream()
                && !Arc::ptr_eq(&up, inner)
            {
                let mut state = inner.state();
                state.gate = Some(Gate::Stream(up));
                state.held.push_front(Held::Wait(event));
                return Ok(());
            }
            acl::wait(&inner.raw, &event.raw)?;
            inner.keep(event);
            Ok(())
        }
        Held::Free(buffer) => free_now(inner, buffer),
    }
}

/// Mark the stream failed and drop its held work (frees still take effect).
fn fail(inner: &Arc<StreamInner>, failure: Failure) {
    let held: Vec<Held> = {
        let mut state = inner.state();
        state.failure.get_or_insert(failure.clone());
        state.gate = None;
        state.held.drain(..).collect()
    };
    for item in held {
        // A free that cannot record leaves its block to the instance's drop; nothing to report.
        let _ = skip(inner, item, &failure);
    }
}

/// Resolve the stream's gate as far as known outcomes allow, without blocking.
pub(crate) fn settle(inner: &Arc<StreamInner>, depth: usize) -> Result<()> {
    if depth > MAX_CHAIN {
        return Err(AscendError::Unsupported {
            op: "stream wait",
            message: format!("a chain of more than {MAX_CHAIN} held streams (a wait cycle)"),
        }
        .into());
    }
    loop {
        let gate = inner.state().gate.clone();
        match gate {
            None => {}
            Some(Gate::Host(call)) => match call.outcome() {
                None => return Ok(()),
                Some(Err(message)) => {
                    fail(inner, Failure::Own { op: call.name.clone(), message });
                    return Ok(());
                }
                Some(Ok(())) => inner.state().gate = None,
            },
            Some(Gate::Stream(up)) => {
                settle(&up, depth + 1)?;
                let (failed, gated) = {
                    let s = up.state();
                    (s.failure.clone(), s.gate.is_some())
                };
                if let Some(f) = failed {
                    fail(inner, Failure::Upstream { upstream: up.id, message: f.message().into() });
                    return Ok(());
                }
                if gated {
                    return Ok(());
                }
                inner.state().gate = None;
            }
        }
        // No gate: issue held work until one is set again.
        let next = {
            let mut state = inner.state();
            if state.gate.is_some() {
                continue;
            }
            state.held.pop_front()
        };
        match next {
            Some(item) => issue(inner, item)?,
            None => return Ok(()),
        }
    }
}

/// Settle the stream, waiting for every outcome it is held on.
pub(crate) fn drain(inner: &Arc<StreamInner>, depth: usize) -> Result<()> {
    loop {
        settle(inner, depth)?;
        let gate = inner.state().gate.clone();
        match gate {
            None => return Ok(()),
            Some(Gate::Host(call)) => {
                if !wait_unless_stopped(inner, &call) {
                    drop_behind_a_device_failure(inner);
                    return Ok(());
                }
            }
            Some(Gate::Stream(up)) => {
                if depth > MAX_CHAIN {
                    return settle(inner, depth);
                }
                drain(&up, depth + 1)?;
            }
        }
    }
}

/// Wait for `call`'s callback; false when it will never run: the ACL stream stopped on a failed
/// device task queued before it (under `ACL_STOP_ON_FAILURE` the runtime runs none of the
/// stream's later tasks, host callbacks included), which `aclrtSynchronizeStream` reports. A
/// stream an engine is capturing is not synchronized (the runtime refuses it): there the wait is
/// plain.
fn wait_unless_stopped(inner: &Arc<StreamInner>, call: &HostCall) -> bool {
    if call.outcome().is_some() || !inner.capture().allows_release() {
        call.wait();
        return true;
    }
    // SAFETY: a live stream.
    let code = unsafe { sys::aclrtSynchronizeStream(inner.raw.get()) };
    if code == sys::ACL_SUCCESS || call.outcome().is_some() {
        call.wait();
        return true;
    }
    false
}

/// The gate's host function will never run: drop the work held behind it (frees still take
/// effect, held records mark their events failed). The device failure itself stays with the ACL
/// stream, which reports it at the next `synchronize`.
fn drop_behind_a_device_failure(inner: &Arc<StreamInner>) {
    let held: Vec<Held> = {
        let mut state = inner.state();
        state.gate = None;
        state.held.drain(..).collect()
    };
    let failure = Failure::Own {
        op: "device task".to_string(),
        message: "the ACL stream stopped on a failed device task".to_string(),
    };
    for item in held {
        // A free that cannot record leaves its block to the instance's drop; nothing to report.
        let _ = skip(inner, item, &failure);
    }
}

/// `aclrtSynchronizeStream`, mapped onto the HAL's errors: the stream's host-side failure (its
/// own host function, or a failed stream it waited on), else a failed device task — after which
/// the stopped ACL stream is replaced — else success.
///
/// A stream being captured (by an engine, or kda's auxiliary stream pulled into that capture)
/// is not synchronized: CANN refuses it (`ACL_ERROR_RT_STREAM_CAPTURED`) and the refusal would
/// invalidate the engine's capture, so it is a typed error before any runtime call.
pub(crate) fn synchronize(stream: &AscendStream) -> Result<()> {
    let inner = &stream.inner;
    if !inner.capture().allows_release() {
        return Err(super::engine::refused(
            "synchronize of a stream an engine is capturing (synchronize after its capture ends)",
        ));
    }
    drain(inner, 0)?;
    // SAFETY: a live stream.
    let code = unsafe { sys::aclrtSynchronizeStream(inner.raw.get()) };
    let message = if code == sys::ACL_SUCCESS { String::new() } else { sys::recent_error() };
    let (kept, failure, tasks) = {
        let mut state = inner.state();
        let tasks = std::mem::take(&mut state.tasks);
        (std::mem::take(&mut state.in_flight), state.failure.take(), tasks)
    };
    // Everything queued so far has finished (or was skipped): release what it kept (what a
    // capture pinned stays).
    let settled = inner.retention().settle();
    drop(kept);
    drop(settled);
    let device = if code == sys::ACL_SUCCESS {
        None
    } else {
        // The runtime stopped the ACL stream for good (stop-on-failure): continue on a new one
        // (kda's own; an engine's stream is the engine's to recover).
        inner.raw.replace()?;
        Some(code)
    };
    match failure {
        Some(Failure::Own { op, message }) => {
            return Err(Error::OpFailed { op, stream: stream.id(), message });
        }
        Some(Failure::Upstream { upstream, message }) => {
            return Err(Error::DependencyFailed { stream: stream.id(), upstream, message });
        }
        None => {}
    }
    let Some(code) = device else { return Ok(()) };
    // A device task failed: the runtime's report names the kernel or aclnn op (an AI Core
    // exception report on hardware; the emulator's names the reference op), which names the
    // HAL op that queued it.
    let op = tasks
        .iter()
        .find(|(task, label)| message.contains(task) || message.contains(label.as_str()))
        .map_or_else(|| "device task".to_string(), |(_, label)| label.clone());
    let acl = AscendError::Acl { func: "aclrtSynchronizeStream", code, message };
    Err(Error::OpFailed {
        op,
        stream: stream.id(),
        message: if inner.raw.owned() {
            format!("{acl} (the ACL stream stopped on the failure and was replaced)")
        } else {
            format!(
                "{acl} (the engine's stream stopped on the failure; its recovery is the engine's)"
            )
        },
    })
}

impl EventInner {
    fn held_on(&self, stream: Option<Weak<StreamInner>>) {
        *self.held_on.lock().unwrap_or_else(PoisonError::into_inner) = stream;
    }

    fn held_stream(&self) -> Option<Arc<StreamInner>> {
        self.held_on.lock().unwrap_or_else(PoisonError::into_inner).as_ref().and_then(Weak::upgrade)
    }

    fn failed(&self, failure: Option<(StreamId, String)>) {
        *self.failed_upstream.lock().unwrap_or_else(PoisonError::into_inner) = failure;
    }

    fn failure(&self) -> Option<(StreamId, String)> {
        self.failed_upstream.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }
}
