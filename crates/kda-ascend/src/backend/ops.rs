//! Each HAL op as ACL work: aclnn two-phase calls, kernel launches, copies and host functions.
//!
//! [`prepare`] does everything that can fail on the host — descriptors, phase one of every
//! aclnn op (`GetWorkspaceSize`, executor), workspaces, tilings, argument blocks — and returns
//! [`Step`]s; [`issue`] queues them. Capture uses the same split: every executor is prepared
//! (and made repeatable) before `aclmdlRICaptureBegin`.
//!
//! | HAL op | ACL |
//! |---|---|
//! | `Gemm` | `aclnnMatmul` (`mat2` = the weight's transposed view) |
//! | `Copy`, `Fill` | `aclnnInplaceCopy`, `aclnnInplaceFillScalar` |
//! | `Upload`, `Download` | `aclrtMemcpyAsync` through pinned staging (+ `aclnnInplaceCopy` for strided views) |
//! | `Host` | `aclrtLaunchHostFunc` (a failure stops the stream on the host) |
//! | `DynamicQuant` | `aclnnDynamicMxQuantV3` (Ascend 950); elsewhere unsupported (a typed error before anything is queued: the layer takes bf16 QKV there) |
//! | `MxGemm` | `aclnnQuantMatmulV5` (Ascend 950); else `kda_mx_dequant` + `aclnnMatmul` |
//! | `Sigmoid`, `KdaGate`, `ZeroPadding`, `CausalConvUpdate`, `L2Norm`, `GatedRmsNorm`, `MxDequant` | their AscendC kernels |
//! | `KdaRecurrent` | `aclnnRecurrentGatedDeltaRule` where its contract fits (`vendor.rs`: installed with an f32 state, bf16 operands, within its limits); else the `kda_recurrent_step` kernel |
//! | `KdaChunk` | `aclnnChunkKdaFwd` where its contract fits (`vendor.rs`: installed, not captured, host offsets, f16/bf16 operands, within its limits); else the `kda_chunk_prefill` kernel (an in-kernel gate runs `kda_gate` into scratch first) |
//! | `CausalConv` | the `kda_conv_prefill` kernel |

use std::any::Any;
use std::ffi::{CStr, c_void};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use kda_core::kda::GateDims;
use kda_core::kda::{GateForm, KdaGate};
use kda_core::mx::num_blocks;
use kda_core::{BufferId, DType, DownloadSlot, HostFn, Layout, Result, Tensor, Validated};

use super::acl::{HostMemory, check};
use super::descriptor::{AclScalar, AclTensor, gm};
use super::host::HostCall;
use super::kernel::Launch;
// The op as launched (kda_core::Launch), named apart from the kernel launch of `super::kernel`.
use super::{AscendBackend, AscendStream};
use crate::error::AscendError;
use crate::kernels::abi::{GmTensor, names};
use crate::kernels::tiling::{self, Work};
use crate::sys;
use kda_core::Launch as Op;

#[path = "vendor.rs"]
mod vendor;

pub(crate) use vendor::prototypes as vendor_prototypes;

type T = Tensor<AscendBackend>;

/// One unit of queued ACL work, owning what it needs until its stream has run it.
#[derive(Debug)]
pub(crate) enum Step {
    Aclnn(AclnnCall),
    Kernel(Launch),
    ToDevice {
        dst: usize,
        staging: HostMemory,
        len: usize,
    },
    ToHost {
        src: usize,
        staging: Arc<HostMemory>,
        len: usize,
    },
    Host(Arc<HostCall>),
    /// A temporary the other steps use.
    Keep(#[allow(dead_code, reason = "held, never read")] KeepAlive),
}

impl Step {
    /// The device task's name (kernel or aclnn API), for failure reports.
    pub(crate) fn task(&self) -> Option<&'static str> {
        match self {
            Step::Aclnn(call) => Some(call.api),
            Step::Kernel(launch) => Some(launch.name),
            _ => None,
        }
    }
}

/// Anything kept alive with the steps (temporaries).
pub(crate) struct KeepAlive(
    #[allow(dead_code, reason = "held, never read")] Box<dyn Any + Send + Sync>,
);

impl std::fmt::Debug for KeepAlive {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KeepAlive")
    }
}

/// Phase one done: an executor (and its workspace) waiting for phase two.
#[derive(Debug)]
pub(crate) struct AclnnCall {
    api: &'static str,
    run: sys::AclnnRun,
    executor: usize,
    size: u64,
    workspace: Option<AscendBuffer>,
    repeatable: bool,
    /// Phase two ran; a one-shot executor is then freed by the runtime.
    ran: AtomicBool,
    _tensors: Vec<AclTensor>,
    _scalar: Option<AclScalar>,
}

use super::memory::AscendBuffer;

impl AclnnCall {
    fn issue(&self, stream: sys::aclrtStream) -> Result<()> {
        if self.ran.swap(true, Ordering::AcqRel) && !self.repeatable {
            return Err(AscendError::Unsupported {
                op: self.api,
                message: "a one-shot executor ran already".into(),
            }
            .into());
        }
        let ws = self.workspace.as_ref().map_or(std::ptr::null_mut(), |w| w.addr() as *mut c_void);
        let _span = tracing::trace_span!("aclnn", api = self.api, workspace = self.size).entered();
        // SAFETY: an executor from phase one of the same op (freed by this call unless
        // repeatable), a workspace of at least `size` bytes kept alive with the step, a live stream.
        check(self.api, unsafe {
            (self.run)(ws, self.size, self.executor as *mut sys::aclOpExecutor, stream)
        })?;
        Ok(())
    }
}

impl Drop for AclnnCall {
    fn drop(&mut self) {
        let executor = self.executor as *mut sys::aclOpExecutor;
        if !self.repeatable && !self.ran.load(Ordering::Acquire) {
            // Never run (skipped behind a failed host function): only a repeatable executor is
            // freed by its owner, so make it one first.
            // SAFETY: an executor from phase one that no run consumed.
            let _ = unsafe { sys::aclSetAclOpExecutorRepeatable(executor) };
        } else if !self.repeatable {
            return;
        }
        // SAFETY: a repeatable executor is freed by its owner, once.
        let _ = unsafe { sys::aclDestroyAclOpExecutor(executor) };
    }
}

/// Builds the steps of one op.
struct Prep<'a> {
    b: &'a AscendBackend,
    /// The HAL op being prepared (named when one of its kernels is missing).
    op: &'static str,
    stream: &'a AscendStream,
    repeatable: bool,
    steps: Vec<Step>,
}

type GetWorkspace<'f> = dyn FnOnce(
        &[AclTensor],
        Option<&AclScalar>,
        *mut u64,
        *mut *mut sys::aclOpExecutor,
    ) -> sys::aclnnStatus
    + 'f;

impl Prep<'_> {
    /// Phase one of an aclnn op, its workspace, and (for capture) repeatability.
    fn aclnn(
        &mut self,
        get_api: &'static str,
        api: &'static str,
        run: sys::AclnnRun,
        tensors: Vec<AclTensor>,
        scalar: Option<AclScalar>,
        get: Box<GetWorkspace<'_>>,
    ) -> Result<()> {
        let (mut size, mut executor) = (0u64, std::ptr::null_mut());
        check(get_api, get(&tensors, scalar.as_ref(), &mut size, &mut executor))?;
        let call = AclnnCall {
            api,
            run,
            executor: executor as usize,
            size,
            workspace: None,
            repeatable: false,
            ran: AtomicBool::new(false),
            _tensors: tensors,
            _scalar: scalar,
        };
        let mut call = call;
        if self.repeatable {
            // SAFETY: a fresh executor from phase one.
            check("aclSetAclOpExecutorRepeatable", unsafe {
                sys::aclSetAclOpExecutorRepeatable(executor)
            })?;
            call.repeatable = true;
        }
        if size > 0 {
            call.workspace = Some(self.scratch(size as usize)?);
        }
        self.steps.push(Step::Aclnn(call));
        Ok(())
    }

    /// Device memory for the op's own use (not seen by the sanitizer: no HAL call touches it).
    fn scratch(&self, bytes: usize) -> Result<AscendBuffer> {
        let inner = &self.b.inner;
        let id =
            BufferId { instance: inner.instance, index: AscendBackend::next(&inner.next_buffer) };
        Ok(inner.pool.alloc(id, bytes)?.0)
    }

    fn temp(&mut self, dtype: DType, shape: &[usize]) -> Result<T> {
        let layout = Layout::contiguous(dtype, shape);
        let t = Tensor::new(self.scratch(layout.numel() * dtype.size_bytes())?, layout)?;
        self.steps.push(Step::Keep(KeepAlive(Box::new(t.clone()))));
        Ok(t)
    }

    fn kernel(
        &mut self,
        name: &'static str,
        work: Work,
        tensors: &[Option<&T>],
        scalars: &[f64],
    ) -> Result<()> {
        let Some(tiling) = tiling::tile(name, &self.b.inner.chip, work)? else { return Ok(()) };
        let gms = tensors.iter().map(|t| gm(name, *t)).collect::<Result<Vec<GmTensor>>>()?;
        let launch = self.b.inner.kernels.prepare(name, self.op, tiling, &gms, scalars)?;
        self.steps.push(Step::Kernel(launch));
        Ok(())
    }

    fn copy(&mut self, src: &T, dst: &T) -> Result<()> {
        const OP: &str = "aclnnInplaceCopy";
        let tensors = vec![AclTensor::of(OP, dst)?, AclTensor::of(OP, src)?];
        self.aclnn(
            "aclnnInplaceCopyGetWorkspaceSize",
            OP,
            sys::aclnnInplaceCopy,
            tensors,
            None,
            Box::new(|t, _, ws, ex| {
                // SAFETY: live descriptors, valid out-parameters.
                unsafe { sys::aclnnInplaceCopyGetWorkspaceSize(t[0].ptr(), t[1].ptr(), ws, ex) }
            }),
        )
    }

    fn fill(&mut self, dst: &T, value: f64) -> Result<()> {
        const OP: &str = "aclnnInplaceFillScalar";
        let tensors = vec![AclTensor::of(OP, dst)?];
        let scalar = AclScalar::double(value)?;
        self.aclnn(
            "aclnnInplaceFillScalarGetWorkspaceSize",
            OP,
            sys::aclnnInplaceFillScalar,
            tensors,
            Some(scalar),
            Box::new(|t, s, ws, ex| {
                let s = s.map_or(std::ptr::null(), AclScalar::ptr);
                // SAFETY: live descriptors, valid out-parameters.
                unsafe { sys::aclnnInplaceFillScalarGetWorkspaceSize(t[0].ptr(), s, ws, ex) }
            }),
        )
    }

    /// `y = x · w^T` through `aclnnMatmul`. Where the chip's `aclnnMatmul` refuses a bf16
    /// operand with an f16 or f32 one (A2/A3), both are widened to f32 first (exact: the GEMM
    /// the HAL defines multiplies the widened values).
    fn matmul(&mut self, x: &T, w: &T, y: &T) -> Result<()> {
        let mixed =
            x.dtype() != w.dtype() && (x.dtype() == DType::BF16 || w.dtype() == DType::BF16);
        if mixed && !self.b.inner.chip.mixed_bf16_matmul() {
            let x = self.widened(x)?;
            let w = self.widened(w)?;
            return self.matmul_as_is(&x, &w, y);
        }
        self.matmul_as_is(x, w, y)
    }

    /// `t` as f32: itself, or an f32 copy in scratch memory.
    fn widened(&mut self, t: &T) -> Result<T> {
        if t.dtype() == DType::F32 {
            return Ok(t.clone());
        }
        let wide = self.temp(DType::F32, t.shape())?;
        self.copy(t, &wide)?;
        Ok(wide)
    }

    fn matmul_as_is(&mut self, x: &T, w: &T, y: &T) -> Result<()> {
        const OP: &str = "aclnnMatmul";
        let tensors =
            vec![AclTensor::of(OP, x)?, AclTensor::transposed(OP, w)?, AclTensor::of(OP, y)?];
        self.aclnn(
            "aclnnMatmulGetWorkspaceSize",
            OP,
            sys::aclnnMatmul,
            tensors,
            None,
            Box::new(|t, _, ws, ex| {
                // SAFETY: live descriptors, valid out-parameters.
                unsafe {
                    sys::aclnnMatmulGetWorkspaceSize(
                        t[0].ptr(),
                        t[1].ptr(),
                        t[2].ptr(),
                        sys::KEEP_DTYPE,
                        ws,
                        ex,
                    )
                }
            }),
        )
    }

    /// A plain `[rows, ceil(K/32)]` E8M0 scale as Ascend's `[rows, ceil(K/64), 2]`: the same
    /// memory when the block count is even and rows are dense, else a padded copy (`into`:
    /// which way the copy goes).
    fn ascend_scale(
        &mut self,
        op: &'static str,
        scale: &T,
        k: usize,
        into_ascend: bool,
    ) -> Result<(AclTensor, Option<(T, T)>)> {
        let rows = scale.shape()[0];
        let blocks = num_blocks(k);
        let pairs = blocks.div_ceil(2);
        let row_stride = scale.layout().strides()[0];
        if blocks.is_multiple_of(2) && (blocks <= 1 || scale.layout().strides()[1] == 1) {
            return Ok((AclTensor::view(op, scale, &[rows, pairs, 2], &[row_stride, 2, 1])?, None));
        }
        let padded = self.temp(DType::E8M0, &[rows, pairs, 2])?;
        let plain = padded.reshape(&[rows, 2 * pairs])?.narrow(1, 0, blocks)?;
        if into_ascend {
            // The padding entries scale nothing; zero keeps them defined.
            self.fill(&padded, 0.0)?;
            self.copy(scale, &plain)?;
        }
        Ok((AclTensor::of(op, &padded)?, Some((plain, scale.clone()))))
    }

    fn host(&mut self, name: &str, f: HostFn) -> Result<()> {
        self.steps.push(Step::Host(HostCall::new(name, f, self.stream)));
        Ok(())
    }
}

/// Everything that can fail before queueing, for `op` on `stream`. `repeatable`: executors
/// are made repeatable (capture, replays).
pub(crate) fn prepare(
    b: &AscendBackend,
    stream: &AscendStream,
    op: &Validated<AscendBackend>,
    repeatable: bool,
) -> Result<Vec<Step>> {
    let mut p = Prep { b, op: op.op().name(), stream, repeatable, steps: Vec::new() };
    build(&mut p, op.launch()?)?;
    Ok(p.steps)
}

fn build(p: &mut Prep<'_>, launch: Op<'_, AscendBackend>) -> Result<()> {
    match launch {
        Op::Gemm { x, w, y, dims: _ } => p.matmul(x, w, y),
        Op::Copy { src, dst, dims: () } => p.copy(src, dst),
        Op::Fill { dst, value, dims: () } => p.fill(dst, *value),
        Op::Upload { dst, data, dims: () } => upload(p, dst, data),
        Op::Download { src, slot, dims: () } => download(p, src, slot),
        // A failure stops the stream on the host (see the `host` module): no device task.
        Op::Host { name, f, dims: () } => p.host(name, f.clone()),
        Op::DynamicQuant { x, data, scale, alg, dims } => {
            if !p.b.inner.native_mx {
                // No MXFP8 quantize on this chip (A2/A3 CANN has no aclnnDynamicMxQuantV3, and
                // there is no AscendC kernel for it): the typed refusal, before anything is
                // queued and whatever the shape. The backend reports `NativeOps::mx_quant =
                // false`, so the layer runs bf16 QKV.
                return Err(kda_core::Error::Unsupported {
                    backend: "ascend",
                    feature: format!(
                        "DynamicQuant on {} (capabilities.native.mx_quant is false: \
                         aclnnDynamicMxQuantV3 is absent or not selected, and no AscendC kernel \
                         stands in; the layer's bf16 QKV path does not need it)",
                        p.b.inner.chip.soc
                    )
                    .into(),
                });
            }
            if dims.m == 0 || dims.k == 0 {
                return Ok(());
            }
            const OP: &str = "aclnnDynamicMxQuantV3";
            let (scale_desc, copy_back) = p.ascend_scale(OP, scale, dims.k, false)?;
            let tensors = vec![AclTensor::of(OP, x)?, AclTensor::of(OP, data)?, scale_desc];
            let alg = i64::from(alg.code());
            p.aclnn(
                "aclnnDynamicMxQuantV3GetWorkspaceSize",
                OP,
                sys::aclnnDynamicMxQuantV3,
                tensors,
                None,
                Box::new(move |t, _, ws, ex| {
                    let rint: &CStr = c"rint";
                    // SAFETY: live descriptors, a static C string, valid out-parameters.
                    unsafe {
                        sys::aclnnDynamicMxQuantV3GetWorkspaceSize(
                            t[0].ptr(),
                            -1,
                            rint.as_ptr(),
                            i64::from(sys::ACL_FLOAT8_E4M3FN),
                            sys::MX_BLOCK_SIZE,
                            alg,
                            0.0,
                            0.0,
                            t[1].ptr(),
                            t[2].ptr(),
                            ws,
                            ex,
                        )
                    }
                }),
            )?;
            if let Some((padded_plain, scale)) = copy_back {
                p.copy(&padded_plain, &scale)?;
            }
            Ok(())
        }
        Op::MxDequant { data, scale, y, dims } => {
            let work = tiling::mx_dequant(dims.m, dims.k, y.dtype().size_bytes());
            p.kernel(names::MX_DEQUANT, work, &[Some(data), Some(scale), Some(y)], &[])
        }
        Op::MxGemm { a, a_scale, w, w_scale, y, dims } => {
            if dims.m == 0 || dims.n == 0 {
                return Ok(());
            }
            if !p.b.inner.native_mx {
                // A2/A3: no MX GEMM. Dequantize both operands to bf16 (exact for E4M3 times a
                // power of two in bf16's range) and run the bf16 GEMM.
                let a16 = p.temp(DType::BF16, &[dims.m, dims.k])?;
                let w16 = p.temp(DType::BF16, &[dims.n, dims.k])?;
                for (d, s, out, rows) in [(a, a_scale, &a16, dims.m), (w, w_scale, &w16, dims.n)] {
                    let work = tiling::mx_dequant(rows, dims.k, DType::BF16.size_bytes());
                    p.kernel(names::MX_DEQUANT, work, &[Some(d), Some(s), Some(out)], &[])?;
                }
                return p.matmul(&a16, &w16, y);
            }
            const OP: &str = "aclnnQuantMatmulV5";
            let (a_scale_desc, _) = p.ascend_scale(OP, a_scale, dims.k, true)?;
            let (w_scale_desc, _) = p.ascend_scale(OP, w_scale, dims.k, true)?;
            let tensors = vec![
                AclTensor::of(OP, a)?,
                AclTensor::of(OP, w)?,
                a_scale_desc,
                w_scale_desc,
                AclTensor::of(OP, y)?,
            ];
            p.aclnn(
                "aclnnQuantMatmulV5GetWorkspaceSize",
                OP,
                sys::aclnnQuantMatmulV5,
                tensors,
                None,
                Box::new(|t, _, ws, ex| {
                    let none = std::ptr::null();
                    // SAFETY: live descriptors, null optional operands, valid out-parameters.
                    unsafe {
                        sys::aclnnQuantMatmulV5GetWorkspaceSize(
                            t[0].ptr(),
                            t[1].ptr(),
                            t[2].ptr(),
                            t[3].ptr(),
                            none,
                            none,
                            none,
                            none,
                            none,
                            false,
                            true,
                            sys::MX_GROUP_SIZE,
                            t[4].ptr(),
                            ws,
                            ex,
                        )
                    }
                }),
            )
        }
        Op::Sigmoid { x, y, dims: () } => {
            let work = tiling::sigmoid(x.numel(), x.dtype().size_bytes());
            p.kernel(names::SIGMOID, work, &[Some(x), Some(y)], &[])
        }
        Op::KdaGate(g, d) => gate(p, g, d),
        Op::ZeroPadding(z, d) => {
            let work = tiling::zero_padding(d.rows, d.row_len, z.x.dtype().size_bytes());
            p.kernel(names::ZERO_PADDING, work, &[Some(&z.x), Some(&z.num_actual_tokens)], &[])
        }
        Op::CausalConvUpdate(c, d) => {
            // The conv kernels take f32 states (any strides).
            kda_core::kda::require_f32_conv_state("ascend", &c.state)?;
            let work = tiling::conv_update(d.channels, d.width, d.tokens);
            let t = [
                Some(&c.x),
                Some(&c.weight),
                Some(&c.state_slots),
                c.num_accepted_tokens.as_ref(),
                Some(&c.state),
                Some(&c.y),
            ];
            p.kernel(names::CONV_UPDATE, work, &t, &[])
        }
        Op::KdaRecurrent(r, d) => {
            match vendor::recurrent_route(r, d, crate::sys::installed()) {
                Ok(()) => {
                    if vendor::recurrent(p, r, d)? {
                        return Ok(());
                    }
                }
                Err(why) => tracing::trace!(reason = %why, "kda_recurrent: the project's kernel"),
            }
            let work = tiling::recurrent(d.batch, d.heads, d.k, d.v);
            let t = [
                Some(&r.q),
                Some(&r.k),
                Some(&r.v),
                Some(&r.g),
                Some(&r.beta),
                Some(&r.state_slots),
                r.num_accepted_tokens.as_ref(),
                Some(&r.state),
                Some(&r.o),
            ];
            p.kernel(
                names::RECURRENT,
                work,
                &t,
                &[f64::from(r.scale), f64::from(u8::from(r.qk_l2norm))],
            )
        }
        Op::CausalConv(c, d) => {
            // The conv kernels take f32 states (any strides).
            kda_core::kda::require_f32_conv_state("ascend", &c.state)?;
            let work = tiling::conv_prefill(d.channels, d.width);
            let t = [
                Some(&c.x),
                Some(&c.weight),
                Some(&c.query_start_loc),
                Some(&c.state_slots),
                Some(&c.has_initial_state),
                Some(&c.state),
                Some(&c.y),
            ];
            p.kernel(names::CONV_PREFILL, work, &t, &[])
        }
        Op::L2Norm(n, d) => {
            let work = tiling::l2norm(d.rows, d.dim, n.x.dtype().size_bytes());
            p.kernel(names::L2NORM, work, &[Some(&n.x), Some(&n.y)], &[f64::from(n.scale)])
        }
        Op::GatedRmsNorm(n, d) => {
            let work = tiling::gated_rms_norm(d.rows, d.dim, n.x.dtype().size_bytes());
            p.kernel(
                names::GATED_RMS_NORM,
                work,
                &[Some(&n.x), Some(&n.gate), Some(&n.weight), Some(&n.y)],
                &[f64::from(n.eps)],
            )
        }
        Op::KdaChunk(c, d) => {
            match vendor::chunk_route(c, d, p.repeatable, crate::sys::installed()) {
                Ok(meta) => return vendor::chunk(p, c, d, meta),
                Err(why) => tracing::trace!(reason = %why, "kda_chunk: the project's kernel"),
            }
            // The in-kernel gate: the chunk kernel takes the activated log decay, so the gate
            // kernel (the one `KdaGate` runs, hence its bits) first fills a scratch buffer.
            let g = match &c.gate {
                None => c.g.clone(),
                Some(params) => {
                    let activated = p.temp(DType::F32, c.g.shape())?;
                    let op = KdaGate {
                        g1: c.g.clone(),
                        a_log: params.a_log.clone(),
                        dt_bias: params.dt_bias.clone(),
                        form: params.form,
                        g: activated.clone(),
                    };
                    // A gate the backend composes itself, so its sizes are checked here.
                    let gate_dims = op.validate()?;
                    gate(p, &op, gate_dims)?;
                    activated
                }
            };
            let work = tiling::chunk(d.batch, d.heads, d.k, d.v);
            let t = [
                Some(&c.q),
                Some(&c.k),
                Some(&c.v),
                Some(&g),
                Some(&c.beta),
                Some(&c.cu_seqlens),
                Some(&c.state_slots),
                Some(&c.has_initial_state),
                Some(&c.state),
                Some(&c.o),
                c.chunk_state_slots.as_ref(),
            ];
            p.kernel(
                names::CHUNK,
                work,
                &t,
                &[f64::from(c.scale), f64::from(u8::from(c.qk_l2norm))],
            )
        }
    }
}

/// `KdaGate` as the AscendC `kda_gate` kernel.
fn gate(p: &mut Prep<'_>, g: &KdaGate<AscendBackend>, d: GateDims) -> Result<()> {
    let work = tiling::gate(d.tokens, d.heads, d.dim, g.g1.dtype().size_bytes());
    let (form, bound) = match g.form {
        GateForm::Softplus => (0.0, 0.0),
        GateForm::LowerBound { lower_bound } => (1.0, f64::from(lower_bound)),
    };
    p.kernel(
        names::GATE,
        work,
        &[Some(&g.g1), Some(&g.a_log), Some(&g.dt_bias), Some(&g.g)],
        &[form, bound],
    )
}

/// Byte address of a view's first element.
fn addr_of(t: &T) -> usize {
    t.buffer().addr() + t.layout().offset() * t.dtype().size_bytes()
}

fn upload(p: &mut Prep<'_>, dst: &T, data: &[u8]) -> Result<()> {
    if data.is_empty() {
        return Ok(());
    }
    let staging = HostMemory::alloc(data.len())?;
    // SAFETY: `staging` holds `data.len()` fresh pinned bytes no one else uses.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), staging.ptr(), data.len()) };
    if dst.layout().is_contiguous() {
        p.steps.push(Step::ToDevice { dst: addr_of(dst), staging, len: data.len() });
        return Ok(());
    }
    let dense = p.temp(dst.dtype(), dst.shape())?;
    p.steps.push(Step::ToDevice { dst: addr_of(&dense), staging, len: data.len() });
    p.copy(&dense, dst)
}

fn download(p: &mut Prep<'_>, src: &T, slot: &DownloadSlot) -> Result<()> {
    let len = src.numel() * src.dtype().size_bytes();
    let staging = Arc::new(HostMemory::alloc(len)?);
    let from = if src.layout().is_contiguous() || len == 0 {
        src.clone()
    } else {
        let dense = p.temp(src.dtype(), src.shape())?;
        p.copy(src, &dense)?;
        dense
    };
    if len > 0 {
        p.steps.push(Step::ToHost { src: addr_of(&from), staging: Arc::clone(&staging), len });
    }
    let (slot, bytes) = (slot.clone(), Mutex::new(Some(staging)));
    let deliver = HostFn::new(move || {
        let staging =
            bytes.lock().map_err(|e| e.to_string())?.take().ok_or("download delivered twice")?;
        // SAFETY: the copy into `staging` (`len` bytes) ran before this host function on the
        // same stream; nothing writes it any more.
        let data = unsafe { std::slice::from_raw_parts(staging.ptr(), len) }.to_vec();
        slot.put(data);
        Ok(())
    });
    p.host("download", deliver)
}

/// Queue `steps` on `stream`.
pub(crate) fn issue_steps(stream: &AscendStream, steps: &[Step]) -> Result<()> {
    let raw = stream.raw().get();
    for step in steps {
        match step {
            Step::Aclnn(call) => call.issue(raw)?,
            Step::Kernel(launch) => launch.issue(raw)?,
            Step::ToDevice { dst, staging, len } => {
                // SAFETY: `dst` is `len` bytes of a live device view; `staging` is pinned memory
                // of `len` bytes kept alive with the step until the stream has run it.
                check("aclrtMemcpyAsync", unsafe {
                    sys::aclrtMemcpyAsync(
                        *dst as *mut c_void,
                        *len,
                        staging.ptr().cast(),
                        *len,
                        sys::ACL_MEMCPY_HOST_TO_DEVICE,
                        raw,
                    )
                })?;
            }
            Step::ToHost { src, staging, len } => {
                // SAFETY: as above, the other way.
                check("aclrtMemcpyAsync", unsafe {
                    sys::aclrtMemcpyAsync(
                        staging.ptr().cast(),
                        *len,
                        *src as *const c_void,
                        *len,
                        sys::ACL_MEMCPY_DEVICE_TO_HOST,
                        raw,
                    )
                })?;
            }
            Step::Host(call) => call.issue(raw)?,
            Step::Keep(_) => {}
        }
    }
    Ok(())
}
