//! Each [`Op`] as kernel launches (and, for GEMMs, a cuBLAS call) on a stream.

use std::ptr::{read_volatile, write_volatile};
use std::sync::atomic::Ordering;
use std::sync::{Arc, PoisonError};

use cudarc::driver::result;
use kda_core::kda::{
    CausalConv, CausalConvUpdate, ConvDims, ConvUpdateDims, GateDims, GateForm, KdaChunk, KdaGate,
    KdaRecurrent, PaddingDims, RecurrenceDims, RowDims,
};
use kda_core::{DType, DownloadSlot, HostFn, Launch, Layout, Result, Tensor, Validated};

use super::memory::{OwnedPinned, driver, enqueue_host};
use super::module::{Args, args};
use super::scratch::{self, Owned, Scratch};
use super::{CudaBackend, CudaStream};
use crate::launch::{self, BLOCK, MAX_CONV_WINDOW, MAX_KEY_DIM, MX_TILE, ROWS_PER_BLOCK};
use crate::status::{CheckedOp, FailureId, HostFailure};
use crate::view::{KernelView, fill_bits};

type T = Tensor<CudaBackend>;

/// The kernel view of `t` (its buffer's address plus the layout).
fn view(op: &'static str, param: &'static str, t: &T) -> Result<KernelView> {
    Ok(KernelView::new(op, param, t.layout(), t.buffer().device_ptr())?)
}

/// The kernel view of an optional operand (`ABSENT` when missing).
fn optional(op: &'static str, param: &'static str, t: Option<&T>) -> Result<KernelView> {
    t.map_or(Ok(KernelView::ABSENT), |t| view(op, param, t))
}

const ONE: (u32, u32, u32) = (1, 1, 1);

/// A gate form as the kernels take it: `GATE_SOFTPLUS` (0) or `GATE_LOWER_BOUND` (1) and the
/// bound (kernels/kda.cu).
fn gate_form(form: GateForm) -> (i32, f32) {
    match form {
        GateForm::Softplus => (0, 0.0),
        GateForm::LowerBound { lower_bound } => (1, lower_bound),
    }
}

impl CudaBackend {
    /// Queue a validated op with the sizes its validation computed.
    pub(super) fn run(
        &self,
        stream: &CudaStream,
        label: &str,
        valid: &Validated<Self>,
    ) -> Result<()> {
        match valid.launch()? {
            Launch::Gemm { x, w, y, dims } => self.gemm(stream, x, w, y, dims),
            Launch::Copy { src, dst, dims: () } => self.copy(stream, src, dst),
            Launch::Fill { dst, value, dims: () } => self.fill(stream, dst, *value),
            Launch::Upload { dst, data, dims: () } => self.upload(stream, dst, data),
            Launch::Download { src, slot, dims: () } => self.download(stream, src, slot.clone()),
            Launch::Host { f, name: _, dims: () } => self.host(stream, label, f.clone()),
            Launch::DynamicQuant { x, data, scale, alg, dims } => {
                self.dynamic_quant(stream, (x, data, scale), *alg, dims)
            }
            Launch::MxDequant { data, scale, y, dims } => {
                let (m, k) = (dims.m as i64, dims.k as i64);
                let Some(grid) = self.grid(dims.m * dims.k, BLOCK) else { return Ok(()) };
                let (dv, sv, yv) = (
                    view("mx_dequant", "data", data)?,
                    view("mx_dequant", "scale", scale)?,
                    view("mx_dequant", "y", y)?,
                );
                self.kernel(
                    stream,
                    "kda_mx_dequant",
                    grid,
                    args!(stream.inner.status, dv, sv, yv, m, k),
                )
            }
            Launch::MxGemm { a, a_scale, w, w_scale, y, dims } => {
                if dims.m == 0 || dims.n == 0 {
                    return Ok(());
                }
                if self.inner.fast.mx_gemm && dims.k > 0 {
                    return self.mx_gemm_fast(stream, (a, a_scale), (w, w_scale), y, dims);
                }
                const OP: &str = "mx_gemm";
                let views = [
                    view(OP, "a", a)?,
                    view(OP, "a_scale", a_scale)?,
                    view(OP, "w", w)?,
                    view(OP, "w_scale", w_scale)?,
                    view(OP, "y", y)?,
                ];
                let grid = (
                    dims.n.div_ceil(MX_TILE as usize) as u32,
                    dims.m.div_ceil(MX_TILE as usize) as u32,
                    1,
                );
                launch::within(OP, "ceil(M / 16)", grid.1 as usize, 65535)?;
                let (m, n, k) = (dims.m as i64, dims.n as i64, dims.k as i64);
                let [av, asv, wv, wsv, yv] = views;
                self.inner.kernels.launch(
                    stream.raw(),
                    "kda_mx_gemm",
                    grid,
                    (MX_TILE, MX_TILE, 1),
                    args!(stream.inner.status, av, asv, wv, wsv, yv, m, n, k),
                )?;
                Ok(())
            }
            Launch::Sigmoid { x, y, dims: () } => {
                let Some(grid) = self.grid(x.numel(), BLOCK) else { return Ok(()) };
                let (xv, yv, n) =
                    (view("sigmoid", "x", x)?, view("sigmoid", "y", y)?, x.numel() as i64);
                self.kernel(stream, "kda_sigmoid", grid, args!(stream.inner.status, xv, yv, n))
            }
            Launch::KdaGate(op, dims) => self.gate(stream, op, dims),
            Launch::L2Norm(op, RowDims { rows, dim }) => {
                let Some(grid) = self.grid(rows * 32, BLOCK) else { return Ok(()) };
                let (xv, yv) = (view("l2norm", "x", &op.x)?, view("l2norm", "y", &op.y)?);
                let (rows, dim, scale) = (rows as i64, dim as i64, op.scale);
                self.kernel(
                    stream,
                    "kda_l2norm",
                    grid,
                    args!(stream.inner.status, xv, yv, rows, dim, scale),
                )
            }
            Launch::GatedRmsNorm(op, RowDims { rows, dim }) => {
                let Some(grid) = self.grid(rows * 32, BLOCK) else { return Ok(()) };
                const OP: &str = "gated_rms_norm";
                let (xv, gv, wv, yv) = (
                    view(OP, "x", &op.x)?,
                    view(OP, "gate", &op.gate)?,
                    view(OP, "weight", &op.weight)?,
                    view(OP, "y", &op.y)?,
                );
                let (rows, dim, eps) = (rows as i64, dim as i64, op.eps);
                self.kernel(
                    stream,
                    "kda_gated_rms_norm",
                    grid,
                    args!(stream.inner.status, xv, gv, wv, yv, rows, dim, eps),
                )
            }
            Launch::ZeroPadding(op, PaddingDims { rows, row_len }) => {
                let grid = self.grid(rows * row_len, BLOCK).unwrap_or(1);
                let fid = self.fid(stream, CheckedOp::ZeroPadding);
                let (xv, lv) = (
                    view("zero_padding", "x", &op.x)?,
                    view("zero_padding", "num_actual_tokens", &op.num_actual_tokens)?,
                );
                let (rows, row_len, elsize) =
                    (rows as i64, row_len as i64, op.x.dtype().size_bytes() as i32);
                self.kernel(
                    stream,
                    "kda_zero_padding",
                    grid,
                    args!(stream.inner.status, fid, xv, lv, rows, row_len, elsize),
                )
            }
            // The conv kernels take f32 states (any strides).
            Launch::CausalConv(op, dims) => {
                kda_core::kda::require_f32_conv_state("cuda", &op.state)?;
                self.conv_prefill(stream, op, dims)
            }
            Launch::CausalConvUpdate(op, dims) => {
                kda_core::kda::require_f32_conv_state("cuda", &op.state)?;
                self.conv_update(stream, op, dims)
            }
            Launch::KdaRecurrent(op, dims) => self.recurrent(stream, op, dims),
            Launch::KdaChunk(op, dims) => self.chunk(stream, op, dims),
        }
    }

    /// A one-thread kernel (metadata validation, status plumbing).
    fn single(&self, stream: &CudaStream, name: &'static str, params: Args<'_>) -> Result<()> {
        Ok(self.inner.kernels.launch(stream.raw(), name, ONE, ONE, params)?)
    }

    /// Check a recurrence against the kernels' limits and return its grid: a warp per state
    /// row, `(ceil(V / ROWS_PER_BLOCK), H, B)`; `None` when there is nothing to compute.
    fn recurrence_grid(op: &'static str, dims: &RecurrenceDims) -> Result<Option<(u32, u32, u32)>> {
        launch::within(op, "K", dims.k, MAX_KEY_DIM)?;
        launch::within(op, "H", dims.heads, 65535)?;
        launch::within(op, "B", dims.batch, 65535)?;
        if dims.batch == 0 || dims.heads == 0 || dims.v == 0 {
            return Ok(None);
        }
        let rows = dims.v.div_ceil(ROWS_PER_BLOCK as usize) as u32;
        Ok(Some((rows, dims.heads as u32, dims.batch as u32)))
    }

    /// Launch a recurrence kernel on `grid`.
    fn recurrence(
        &self,
        stream: &CudaStream,
        name: &'static str,
        grid: (u32, u32, u32),
        params: Args<'_>,
    ) -> Result<()> {
        Ok(self.inner.kernels.launch(
            stream.raw(),
            name,
            grid,
            (32 * ROWS_PER_BLOCK, 1, 1),
            params,
        )?)
    }

    /// A grid-stride kernel of `grid` blocks of [`BLOCK`] threads.
    pub(super) fn kernel(
        &self,
        stream: &CudaStream,
        name: &'static str,
        grid: u32,
        params: Args<'_>,
    ) -> Result<()> {
        Ok(self.inner.kernels.launch(stream.raw(), name, (grid, 1, 1), (BLOCK, 1, 1), params)?)
    }

    /// The failure id a checking kernel of `op` on `stream` records.
    fn fid(&self, stream: &CudaStream, op: CheckedOp) -> u32 {
        FailureId::Kernel { stream: stream.id.index, op }.encode()
    }

    /// Scratch for work queued on `stream` until [`Self::release`] (see `scratch.rs`).
    pub(super) fn scratch(&self, stream: &CudaStream, bytes: usize) -> Result<Scratch> {
        Ok(self.inner.scratch.take(stream.raw(), bytes)?)
    }

    pub(super) fn release(&self, stream: &CudaStream, scratch: Scratch) -> Result<()> {
        Ok(self.inner.scratch.release(stream.raw(), scratch)?)
    }

    /// A dense row-major view of `shape` in `dtype` over scratch memory.
    fn scratch_view(ptr: u64, dtype: DType, shape: &[usize]) -> Result<KernelView> {
        Ok(KernelView::new("scratch", "scratch", &Layout::contiguous(dtype, shape), ptr)?)
    }

    fn copy_views(
        &self,
        stream: &CudaStream,
        src: KernelView,
        dst: KernelView,
        n: usize,
        elsize: usize,
    ) -> Result<()> {
        let Some(grid) = self.grid(n, BLOCK) else { return Ok(()) };
        let (n, elsize) = (n as i64, elsize as i32);
        self.kernel(stream, "kda_copy", grid, args!(stream.inner.status, src, dst, n, elsize))
    }

    pub(super) fn convert_views(
        &self,
        stream: &CudaStream,
        src: KernelView,
        dst: KernelView,
        n: usize,
    ) -> Result<()> {
        let Some(grid) = self.grid(n, BLOCK) else { return Ok(()) };
        let n = n as i64;
        self.kernel(stream, "kda_convert", grid, args!(stream.inner.status, src, dst, n))
    }

    /// Same dtype: moved by element size. Two float dtypes: converted (through f32: exact
    /// widening, round-to-nearest-even narrowing).
    fn copy(&self, stream: &CudaStream, src: &T, dst: &T) -> Result<()> {
        let (sv, dv) = (view("copy", "src", src)?, view("copy", "dst", dst)?);
        if src.dtype() != dst.dtype() {
            return self.convert_views(stream, sv, dv, src.numel());
        }
        self.copy_views(stream, sv, dv, src.numel(), src.dtype().size_bytes())
    }

    pub(super) fn fill(&self, stream: &CudaStream, dst: &T, value: f64) -> Result<()> {
        let Some(grid) = self.grid(dst.numel(), BLOCK) else { return Ok(()) };
        let dv = view("fill", "dst", dst)?;
        let (n, elsize, bits) =
            (dst.numel() as i64, dst.dtype().size_bytes() as i32, fill_bits(dst.dtype(), value));
        self.kernel(stream, "kda_fill", grid, args!(stream.inner.status, dv, n, elsize, bits))
    }

    /// Staged through pinned memory: from the pool (returned by a host callback once the copy
    /// is done), or, while a graph is being captured, a buffer the CUDA graph owns (each launch
    /// copies the same bytes, as a replayed upload does).
    fn upload(&self, stream: &CudaStream, dst: &T, data: &[u8]) -> Result<()> {
        if data.is_empty() {
            return Ok(());
        }
        let (pooled, owned) = if scratch::capturing() {
            (None, Some(OwnedPinned::new(&self.inner.ctx, data.len())?))
        } else {
            (Some(self.inner.staging.take(data.len())?), None)
        };
        let staging = match (&pooled, &owned) {
            (Some(p), _) => p.host,
            (None, Some(o)) => o.host(),
            (None, None) => return Ok(()),
        };
        // SAFETY: the staging buffer holds at least `data.len()` bytes and no queued work uses
        // it (it was free in the pool, or is new).
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), staging, data.len()) };
        // SAFETY: the slice covers the staging bytes just written; it stays alive (in the
        // callback below, or with the graph) until the copy, queued before, has finished.
        let host = unsafe { std::slice::from_raw_parts(staging, data.len()) };
        if dst.layout().is_contiguous() {
            let at = view("upload", "dst", dst)?.ptr;
            // SAFETY: `at` starts `data.len()` bytes of `dst`'s buffer (validated view).
            unsafe { result::memcpy_htod_async(at, host, stream.raw()) }
                .map_err(driver("cuMemcpyHtoDAsync"))?;
        } else {
            let scratch = self.scratch(stream, data.len())?;
            // SAFETY: the scratch holds `data.len()` bytes and belongs to this stream.
            unsafe { result::memcpy_htod_async(scratch.ptr, host, stream.raw()) }
                .map_err(driver("cuMemcpyHtoDAsync"))?;
            let src = Self::scratch_view(scratch.ptr, dst.dtype(), dst.shape())?;
            self.copy_views(
                stream,
                src,
                view("upload", "dst", dst)?,
                dst.numel(),
                dst.dtype().size_bytes(),
            )?;
            self.release(stream, scratch)?;
        }
        match (pooled, owned) {
            (Some(staging), _) => {
                let pool = Arc::clone(&self.inner.staging);
                Ok(enqueue_host(stream.raw(), move || pool.give(staging))?)
            }
            // The graph owns it now.
            (None, Some(owned)) => {
                drop(scratch::keep(Owned::Pinned(owned)));
                Ok(())
            }
            (None, None) => Ok(()),
        }
    }

    fn download(&self, stream: &CudaStream, src: &T, slot: DownloadSlot) -> Result<()> {
        let bytes = src.numel() * src.dtype().size_bytes();
        if bytes == 0 {
            return Ok(enqueue_host(stream.raw(), move || slot.put(Vec::new()))?);
        }
        let staging = self.inner.staging.take(bytes)?;
        // SAFETY: the staging buffer holds at least `bytes` bytes and only this download uses
        // it until the callback returns it to the pool.
        let host = unsafe { std::slice::from_raw_parts_mut(staging.host, bytes) };
        if src.layout().is_contiguous() {
            let at = view("download", "src", src)?.ptr;
            // SAFETY: `at` starts `bytes` bytes of `src`'s buffer (validated view).
            unsafe { result::memcpy_dtoh_async(host, at, stream.raw()) }
                .map_err(driver("cuMemcpyDtoHAsync"))?;
        } else {
            let scratch = self.scratch(stream, bytes)?;
            let dst = Self::scratch_view(scratch.ptr, src.dtype(), src.shape())?;
            self.copy_views(
                stream,
                view("download", "src", src)?,
                dst,
                src.numel(),
                src.dtype().size_bytes(),
            )?;
            // SAFETY: the scratch holds `bytes` bytes written by the copy queued before.
            unsafe { result::memcpy_dtoh_async(host, scratch.ptr, stream.raw()) }
                .map_err(driver("cuMemcpyDtoHAsync"))?;
            self.release(stream, scratch)?;
        }
        let pool = Arc::clone(&self.inner.staging);
        Ok(enqueue_host(stream.raw(), move || {
            // SAFETY: the copy into the staging buffer, queued before this callback, is done.
            let bytes = unsafe { std::slice::from_raw_parts(staging.host, bytes) }.to_vec();
            slot.put(bytes);
            pool.give(staging);
        })?)
    }

    /// A host function in stream order. The publish kernel tells the stream's mailbox whether
    /// the stream has failed; a driver callback only hands the function to the stream's host
    /// worker (so a blocking function never holds up another stream's); the worker runs it
    /// (or skips it), reports a failure in the mailbox and raises the stream's flag; the stream
    /// waits for the flag, then the absorb kernel takes over the failure.
    fn host(&self, stream: &CudaStream, label: &str, f: HostFn) -> Result<()> {
        let inner = &self.inner;
        let key = inner.next_host_key.fetch_add(1, Ordering::Relaxed);
        let fid = FailureId::Host { key }.encode();
        let ticket = stream.inner.next_ticket.fetch_add(1, Ordering::Relaxed).wrapping_add(1);
        let (status, mailbox, flag) =
            (stream.inner.status, stream.inner.mailbox_device, stream.inner.flag_device);
        let worker = stream.host_worker()?.clone();
        self.single(stream, "kda_status_publish", args!(status, mailbox))?;
        let (mailbox_host, flag_host) = (stream.inner.mailbox_host, stream.inner.flag_host);
        let failures = Arc::clone(&inner.host_failures);
        let graveyard = Arc::clone(&inner.graveyard);
        let (sid, name) = (stream.id, label.to_string());
        let job = move || {
            let (mailbox, flag) = (mailbox_host, flag_host);
            // SAFETY: this stream's mailbox and flag (see `MailboxPtr`); the publish kernel,
            // queued before the callback that sent this job, has finished writing the mailbox,
            // and the stream reads both only after the flag is raised below.
            let skipped = unsafe { read_volatile(mailbox.0) } != 0;
            if !skipped {
                let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f.call()))
                    .unwrap_or_else(|_| Err("the host function panicked".into()));
                if let Err(message) = outcome {
                    let failure = HostFailure { stream: sid, op: name, message };
                    failures.lock().unwrap_or_else(PoisonError::into_inner).insert(key, failure);
                    // SAFETY: as above.
                    unsafe { write_volatile(mailbox.0, fid) };
                }
            }
            // SAFETY: as above; raising the flag releases the stream's wait kernel.
            unsafe { write_volatile(flag.0, ticket) };
            // Dropping the function here could free device memory, which waits for the device,
            // which may be waiting for this thread: a host thread drops it later.
            graveyard.lock().unwrap_or_else(PoisonError::into_inner).push(f);
        };
        enqueue_host(stream.raw(), move || {
            // A worker that is gone (its stream dropped) leaves nothing to run.
            let _ = worker.send(Box::new(job));
        })?;
        let wait = crate::launch::HostWait::new(ticket, fid, inner.host_wait_limit);
        let (ticket, fid, limit_ns) = (wait.ticket, wait.fid, wait.limit_ns);
        self.single(stream, "kda_host_wait", args!(status, flag, ticket, fid, limit_ns))?;
        self.single(stream, "kda_status_absorb", args!(status, mailbox))?;
        Ok(())
    }

    fn gate(&self, stream: &CudaStream, op: &KdaGate<Self>, dims: GateDims) -> Result<()> {
        let Some(grid) = self.grid(dims.tokens * dims.heads * dims.dim, BLOCK) else {
            return Ok(());
        };
        const OP: &str = "kda_gate";
        let (g1, a_log, dt_bias, g) = (
            view(OP, "g1", &op.g1)?,
            view(OP, "a_log", &op.a_log)?,
            view(OP, "dt_bias", &op.dt_bias)?,
            view(OP, "g", &op.g)?,
        );
        let (form, lower_bound) = gate_form(op.form);
        let (t, h, d) = (dims.tokens as i64, dims.heads as i64, dims.dim as i64);
        self.kernel(
            stream,
            "kda_gate",
            grid,
            args!(stream.inner.status, g1, a_log, dt_bias, g, t, h, d, form, lower_bound),
        )
    }

    fn conv_prefill(
        &self,
        stream: &CudaStream,
        op: &CausalConv<Self>,
        dims: ConvDims,
    ) -> Result<()> {
        const OP: &str = "causal_conv";
        let ConvDims { tokens, channels, width, batch, slots, .. } = dims;
        if channels == 0 {
            return Ok(());
        }
        launch::within(OP, "W - 1", width - 1, MAX_CONV_WINDOW)?;
        let fid = self.fid(stream, CheckedOp::CausalConv);
        let (x, w, starts, slot_v, init, state, y) = (
            view(OP, "x", &op.x)?,
            view(OP, "weight", &op.weight)?,
            view(OP, "query_start_loc", &op.query_start_loc)?,
            view(OP, "state_slots", &op.state_slots)?,
            view(OP, "has_initial_state", &op.has_initial_state)?,
            view(OP, "state", &op.state)?,
            view(OP, "y", &op.y)?,
        );
        let (t, c, wd, b, n, param) =
            (tokens as i64, channels as i64, width as i64, batch as i64, slots as i64, 1i32);
        let status = stream.inner.status;
        self.single(
            stream,
            "kda_validate_varlen",
            args!(status, fid, param, starts, slot_v, b, t, n),
        )?;
        if let Some(grid) = self.grid(tokens * channels, BLOCK) {
            self.kernel(
                stream,
                "kda_conv_prefill",
                grid,
                args!(status, x, w, starts, slot_v, init, state, y, t, c, wd, b),
            )?;
        }
        if batch > 0 && width > 1 {
            let grid = self.grid(channels, BLOCK).unwrap_or(1);
            self.kernel(
                stream,
                "kda_conv_prefill_state",
                grid,
                args!(status, x, starts, slot_v, init, state, c, wd, b),
            )?;
        }
        Ok(())
    }

    fn conv_update(
        &self,
        stream: &CudaStream,
        op: &CausalConvUpdate<Self>,
        dims: ConvUpdateDims,
    ) -> Result<()> {
        const OP: &str = "causal_conv_update";
        let ConvUpdateDims { batch, tokens, channels, width, slots, state_len } = dims;
        if channels == 0 {
            return Ok(());
        }
        launch::within(OP, "W - 1 + n", width - 1 + tokens, MAX_CONV_WINDOW)?;
        let fid = self.fid(stream, CheckedOp::CausalConvUpdate);
        let (x, w, slot_v, state, y) = (
            view(OP, "x", &op.x)?,
            view(OP, "weight", &op.weight)?,
            view(OP, "state_slots", &op.state_slots)?,
            view(OP, "state", &op.state)?,
            view(OP, "y", &op.y)?,
        );
        let accepted = optional(OP, "num_accepted_tokens", op.num_accepted_tokens.as_ref())?;
        let max_accepted = (state_len + 2 - width) as i32;
        let (b, n, c, wd, slots, l, w32) = (
            batch as i64,
            tokens as i64,
            channels as i64,
            width as i64,
            slots as i64,
            state_len as i32,
            width as i32,
        );
        let status = stream.inner.status;
        self.single(
            stream,
            "kda_validate_conv_update",
            args!(status, fid, slot_v, accepted, b, slots, max_accepted, l, w32),
        )?;
        let Some(grid) = self.grid(batch * channels, BLOCK) else { return Ok(()) };
        self.kernel(
            stream,
            "kda_conv_update",
            grid,
            args!(status, x, w, slot_v, accepted, state, y, b, n, c, wd),
        )
    }

    fn recurrent(
        &self,
        stream: &CudaStream,
        op: &KdaRecurrent<Self>,
        dims: RecurrenceDims,
    ) -> Result<()> {
        const OP: &str = "kda_recurrent";
        let grid = Self::recurrence_grid(OP, &dims)?;
        let fid = self.fid(stream, CheckedOp::KdaRecurrent);
        let (q, k, v, g, beta, slots, state, o) = (
            view(OP, "q", &op.q)?,
            view(OP, "k", &op.k)?,
            view(OP, "v", &op.v)?,
            view(OP, "g", &op.g)?,
            view(OP, "beta", &op.beta)?,
            view(OP, "state_slots", &op.state_slots)?,
            view(OP, "state", &op.state)?,
            view(OP, "o", &op.o)?,
        );
        let accepted = optional(OP, "num_accepted_tokens", op.num_accepted_tokens.as_ref())?;
        let (b, n, kd, vd, n_slots) = (
            dims.batch as i64,
            dims.tokens as i64,
            dims.k as i64,
            dims.v as i64,
            dims.slots as i64,
        );
        let (scale, l2, status) = (op.scale, i32::from(op.qk_l2norm), stream.inner.status);
        let validate = args!(status, fid, slots, accepted, b, n, n_slots);
        self.single(stream, "kda_validate_recurrent", validate)?;
        let Some(grid) = grid.filter(|_| dims.tokens > 0) else { return Ok(()) };
        let params =
            args!(status, q, k, v, g, beta, slots, accepted, state, o, n, kd, vd, scale, l2);
        self.recurrence(stream, "kda_recurrent", grid, params)
    }

    fn chunk(&self, stream: &CudaStream, op: &KdaChunk<Self>, dims: RecurrenceDims) -> Result<()> {
        const OP: &str = "kda_chunk";
        // The chunk kernels keep no state between chunks in memory; writing the states at chunk
        // boundaries (`docs/design/kda.md#chunk-boundary-states`) is not implemented on CUDA yet.
        if op.chunk_state_slots.is_some() {
            return Err(kda_core::Error::Unsupported {
                backend: "cuda",
                feature: "chunk_state_slots".into(),
            });
        }
        let grid = Self::recurrence_grid(OP, &dims)?;
        let fid = self.fid(stream, CheckedOp::KdaChunk);
        let (q, k, v, g, beta, starts, slots, init, state, o) = (
            view(OP, "q", &op.q)?,
            view(OP, "k", &op.k)?,
            view(OP, "v", &op.v)?,
            view(OP, "g", &op.g)?,
            view(OP, "beta", &op.beta)?,
            view(OP, "cu_seqlens", &op.cu_seqlens)?,
            view(OP, "state_slots", &op.state_slots)?,
            view(OP, "has_initial_state", &op.has_initial_state)?,
            view(OP, "state", &op.state)?,
            view(OP, "o", &op.o)?,
        );
        let (b, t, kd, vd, n_slots, param) = (
            dims.batch as i64,
            dims.tokens as i64,
            dims.k as i64,
            dims.v as i64,
            dims.slots as i64,
            0i32,
        );
        let (scale, l2, status) = (op.scale, i32::from(op.qk_l2norm), stream.inner.status);
        // The in-kernel gate: its parameters, or absent views and GATE_NONE (-1).
        let gate = op.gate.as_ref();
        let a_log = optional(OP, "a_log", gate.map(|p| &p.a_log))?;
        let dt_bias = optional(OP, "dt_bias", gate.map(|p| &p.dt_bias))?;
        let (form, lower_bound) = gate.map_or((-1, 0.0), |p| gate_form(p.form));
        let validate = args!(status, fid, param, starts, slots, b, t, n_slots);
        self.single(stream, "kda_validate_varlen", validate)?;
        let Some(grid) = grid else { return Ok(()) };
        // The tensor-core chunked form (FastPaths::chunk): the same operands, a block per
        // (32 value columns, head, request).
        let tensor_cores = self.inner.fast.chunk && dims.k <= launch::TC_MAX_KEY;
        let (name, grid, block, shared) = if tensor_cores {
            let tiles = dims.v.div_ceil(launch::TC_BV) as u32;
            (
                "kda_chunk_tc",
                (tiles, grid.1, grid.2),
                (launch::TC_THREADS, 1, 1),
                launch::TC_SHARED_BYTES,
            )
        } else {
            ("kda_chunk", grid, (32 * ROWS_PER_BLOCK, 1, 1), 0)
        };
        let params = args!(
            status,
            q,
            k,
            v,
            g,
            beta,
            starts,
            slots,
            init,
            state,
            o,
            kd,
            vd,
            scale,
            l2,
            a_log,
            dt_bias,
            form,
            lower_bound
        );
        Ok(self.inner.kernels.launch_shared(stream.raw(), name, grid, block, shared, params)?)
    }
}
