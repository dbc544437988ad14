//! aclnn: tensor and scalar descriptors, the two-phase executors, and the ops kda calls.

use std::ffi::{CStr, c_char, c_void};

use kda_core::mx::num_blocks as num_blocks_of;
use kda_core::{HostFn, Op, ScaleAlg, Tensor};

use crate::host;
use crate::types::*;
use crate::{Emu, Executor, Res, T, array, call, emu, invalid, put};

/// The task phase two queues: `body` on the stream, in order with the stream's other work, on
/// the tensors it captured (which keep their memory alive until it has run).
fn task(body: impl Fn() -> Result<(), String> + Send + Sync + 'static) -> HostFn {
    HostFn::new(body)
}

/// `aclCreateTensor`: a view of device memory. `tensor_data` is the storage's device address;
/// `offset`, shape and strides count elements.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn aclCreateTensor(
    view_dims: *const i64,
    view_dims_num: u64,
    data_type: aclDataType,
    stride: *const i64,
    offset: i64,
    format: aclFormat,
    storage_dims: *const i64,
    storage_dims_num: u64,
    tensor_data: *mut c_void,
) -> *mut aclTensor {
    const API: &str = "aclCreateTensor";
    let mut handle = std::ptr::null_mut();
    let code = call(|| {
        let mut emu = emu();
        emu.ready(API)?;
        if format != ACL_FORMAT_ND {
            return invalid(format!("{API}: format {format} (kda uses ND)"));
        }
        let rank = view_dims_num as usize;
        // SAFETY: CANN's contract: `view_dims` and `stride` hold `view_dims_num` values,
        // `storage_dims` holds `storage_dims_num`.
        let (shape, strides, storage) = unsafe {
            (
                array(view_dims, rank)?,
                array(stride, rank)?,
                array(storage_dims, storage_dims_num as usize)?,
            )
        };
        if storage.is_empty() && rank > 0 {
            return invalid(format!("{API}: no storage dims"));
        }
        let view = emu.view(API, tensor_data as usize, data_type, &shape, &strides, offset)?;
        let h = emu.handle();
        emu.tensors.insert(h, (view, data_type));
        handle = h as *mut aclTensor;
        Ok(())
    });
    if code == ACL_SUCCESS { handle } else { std::ptr::null_mut() }
}

#[unsafe(no_mangle)]
pub extern "C" fn aclDestroyTensor(tensor: *const aclTensor) -> aclnnStatus {
    call(|| match emu().tensors.remove(&(tensor as usize)) {
        Some(_) => Ok(()),
        None => invalid(format!("aclDestroyTensor: unknown tensor {tensor:?}")),
    })
}

/// `aclCreateScalar`: kda passes doubles (`ACL_DOUBLE`) and f32.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn aclCreateScalar(
    value: *mut c_void,
    data_type: aclDataType,
) -> *mut aclScalar {
    let v = match data_type {
        // SAFETY: `value` points to one value of `data_type` (CANN's contract).
        ACL_DOUBLE if !value.is_null() => unsafe { value.cast::<f64>().read_unaligned() },
        // SAFETY: as above.
        ACL_FLOAT if !value.is_null() => f64::from(unsafe { value.cast::<f32>().read_unaligned() }),
        _ => {
            crate::fail(ACL_ERROR_INVALID_PARAM, format!("aclCreateScalar: dtype {data_type}"));
            return std::ptr::null_mut();
        }
    };
    let mut emu = emu();
    let h = emu.handle();
    emu.scalars.insert(h, v);
    h as *mut aclScalar
}

#[unsafe(no_mangle)]
pub extern "C" fn aclDestroyScalar(scalar: *const aclScalar) -> aclnnStatus {
    call(|| match emu().scalars.remove(&(scalar as usize)) {
        Some(_) => Ok(()),
        None => invalid(format!("aclDestroyScalar: unknown scalar {scalar:?}")),
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn aclSetAclOpExecutorRepeatable(executor: *mut aclOpExecutor) -> aclnnStatus {
    call(|| match emu().executors.get_mut(&(executor as usize)) {
        Some(e) => {
            e.repeatable = true;
            crate::log("aclSetAclOpExecutorRepeatable", 0, 0);
            Ok(())
        }
        None => Err((
            ACLNN_ERR_PARAM_INVALID,
            format!("aclSetAclOpExecutorRepeatable: unknown executor {executor:?}"),
        )),
    })
}

/// Free a repeatable executor (a one-shot one is freed by its run).
#[unsafe(no_mangle)]
pub extern "C" fn aclDestroyAclOpExecutor(executor: *mut aclOpExecutor) -> aclnnStatus {
    call(|| {
        let mut emu = emu();
        match emu.executors.get(&(executor as usize)) {
            Some(e) if e.repeatable => {
                emu.executors.remove(&(executor as usize));
                Ok(())
            }
            Some(e) => Err((
                ACLNN_ERR_PARAM_INVALID,
                format!("aclDestroyAclOpExecutor: {} executor was not made repeatable", e.api),
            )),
            None => Err((
                ACLNN_ERR_PARAM_INVALID,
                format!("aclDestroyAclOpExecutor: unknown executor {executor:?}"),
            )),
        }
    })
}

pub(crate) fn tensor(
    emu: &Emu,
    api: &str,
    param: &str,
    t: *const aclTensor,
) -> Res<(T, aclDataType)> {
    if t.is_null() {
        return Err((ACLNN_ERR_PARAM_NULLPTR, format!("{api}: {param} is null")));
    }
    emu.tensors
        .get(&(t as usize))
        .cloned()
        .ok_or_else(|| (ACLNN_ERR_PARAM_INVALID, format!("{api}: {param}: unknown tensor {t:?}")))
}

/// Phase one: validate, build the executor, report its workspace (allowed while a capture is
/// open: phase one queues no task).
///
/// # Safety
/// `workspace_size` and `executor` are valid out-parameters.
pub(crate) unsafe fn prepare(
    api: &'static str,
    workspace: u64,
    workspace_size: *mut u64,
    executor: *mut *mut aclOpExecutor,
    build: impl FnOnce(&Emu) -> Res<Vec<HostFn>>,
) -> aclnnStatus {
    call(|| {
        let mut emu = emu();
        emu.ready(api)?;
        let tasks = build(&emu).map_err(|(code, m)| {
            (if code == ACL_ERROR_INVALID_PARAM { ACLNN_ERR_PARAM_INVALID } else { code }, m)
        })?;
        let h = emu.handle();
        emu.executors.insert(h, Executor { api, tasks, workspace, repeatable: false });
        // SAFETY: the caller's contract.
        unsafe {
            put(api, workspace_size, workspace)?;
            put(api, executor, h as *mut aclOpExecutor)
        }
    })
}

/// Phase two: check the workspace, queue the ops, free a one-shot executor.
pub(crate) fn execute(
    api: &'static str,
    workspace: *mut c_void,
    workspace_size: u64,
    executor: *mut aclOpExecutor,
    stream: aclrtStream,
) -> aclnnStatus {
    call(|| {
        let mut emu = emu();
        let key = executor as usize;
        let Some(e) = emu.executors.get(&key) else {
            let why = if emu.spent.contains(&key) {
                "was already run and freed (call aclSetAclOpExecutorRepeatable to run it again)"
            } else {
                "is unknown"
            };
            return Err((ACLNN_ERR_PARAM_INVALID, format!("{api}: executor {executor:?} {why}")));
        };
        if e.api != api {
            return Err((
                ACLNN_ERR_PARAM_INVALID,
                format!("{api}: executor was prepared by {}", e.api),
            ));
        }
        if workspace_size < e.workspace {
            return Err((
                ACLNN_ERR_PARAM_INVALID,
                format!("{api}: workspace of {workspace_size} bytes, needs {}", e.workspace),
            ));
        }
        if e.workspace > 0 {
            emu.locate(api, workspace as usize, e.workspace as usize)?;
        }
        let s = emu.stream(api, stream)?;
        let (tasks, repeatable) = (e.tasks.clone(), e.repeatable);
        // A one-shot executor is freed by its run, whether or not the run succeeds.
        if !repeatable {
            emu.executors.remove(&key);
            emu.spent.insert(key);
        }
        emu.launch(api, &s, tasks)?;
        crate::log(api, stream as usize, 0);
        Ok(())
    })
}

/// Emulated workspace of the GEMMs: real kernels ask for scratch, so the protocol is exercised.
const GEMM_WORKSPACE: u64 = 32 << 10;

#[unsafe(no_mangle)]
pub unsafe extern "C" fn aclnnMatmulGetWorkspaceSize(
    self_: *const aclTensor,
    mat2: *const aclTensor,
    out: *mut aclTensor,
    cube_math_type: i8,
    workspace_size: *mut u64,
    executor: *mut *mut aclOpExecutor,
) -> aclnnStatus {
    const API: &str = "aclnnMatmul";
    // SAFETY: forwarded out-parameters.
    unsafe {
        prepare(API, GEMM_WORKSPACE, workspace_size, executor, |emu| {
            if cube_math_type != KEEP_DTYPE {
                return invalid(format!(
                    "{API}: cubeMathType {cube_math_type} (kda keeps the dtype)"
                ));
            }
            let (x, xc) = tensor(emu, API, "self", self_)?;
            let (mat2, wc) = tensor(emu, API, "mat2", mat2)?;
            let (y, _) = tensor(emu, API, "out", out)?;
            // hicann/ops-nn `matmul/mat_mul_v3/docs/aclnnMatmul.md` (约束说明): on Atlas A2/A3
            // no dtype deduction between BFLOAT16 and FLOAT16, nor BFLOAT16 and FLOAT32.
            let bf16_mix = xc != wc
                && (xc == ACL_BF16 || wc == ACL_BF16)
                && [xc, wc].iter().all(|c| [ACL_BF16, ACL_FLOAT16, ACL_FLOAT].contains(c));
            if bf16_mix && !emu.has_mx() {
                return Err((
                    ACLNN_ERR_PARAM_INVALID,
                    format!(
                        "{API}: self and mat2 cannot be deduced to one dtype (codes {xc} and {wc}: \
                         A2/A3 refuse BFLOAT16 with FLOAT16 or FLOAT32)"
                    ),
                ));
            }
            // `mat2` is `[K, N]`; the HAL's GEMM takes `w[N, K]`, the same memory transposed:
            // the shapes and dtypes are checked as the HAL's GEMM, whose contract kda maps here.
            let w = transpose(&mat2)?;
            Op::Gemm { x: x.clone(), w, y: y.clone() }
                .validate(emu.backend_instance())
                .map_err(crate::bad)?;
            Ok(vec![task(move || matmul(&x, &mat2, &y))])
        })
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn aclnnMatmul(
    ws: *mut c_void,
    size: u64,
    ex: *mut aclOpExecutor,
    stream: aclrtStream,
) -> aclnnStatus {
    execute("aclnnMatmul", ws, size, ex, stream)
}

/// `aclnnInplaceCopy`: `src` into `selfRef`, converting when their dtypes differ (hicann/ops-math
/// `conversion/view_copy/docs/aclnnInplaceCopy.md`: both take FLOAT32, FLOAT16 and BFLOAT16
/// among others, and a `src` that cannot be converted to `selfRef`'s dtype is 161002). The HAL's
/// `Op::Copy` check admits exactly the float conversions kda uses.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn aclnnInplaceCopyGetWorkspaceSize(
    self_ref: *mut aclTensor,
    src: *const aclTensor,
    workspace_size: *mut u64,
    executor: *mut *mut aclOpExecutor,
) -> aclnnStatus {
    const API: &str = "aclnnInplaceCopy";
    // SAFETY: forwarded out-parameters.
    unsafe {
        prepare(API, 0, workspace_size, executor, |emu| {
            let (dst, _) = tensor(emu, API, "selfRef", self_ref)?;
            let (src, _) = tensor(emu, API, "src", src)?;
            Op::Copy { src: src.clone(), dst: dst.clone() }
                .validate(emu.backend_instance())
                .map_err(crate::bad)?;
            Ok(vec![task(move || {
                copy(&src, &dst);
                Ok(())
            })])
        })
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn aclnnInplaceCopy(
    ws: *mut c_void,
    size: u64,
    ex: *mut aclOpExecutor,
    stream: aclrtStream,
) -> aclnnStatus {
    execute("aclnnInplaceCopy", ws, size, ex, stream)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn aclnnInplaceFillScalarGetWorkspaceSize(
    self_ref: *mut aclTensor,
    value: *const aclScalar,
    workspace_size: *mut u64,
    executor: *mut *mut aclOpExecutor,
) -> aclnnStatus {
    const API: &str = "aclnnInplaceFillScalar";
    // SAFETY: forwarded out-parameters.
    unsafe {
        prepare(API, 0, workspace_size, executor, |emu| {
            let (dst, _) = tensor(emu, API, "selfRef", self_ref)?;
            let value = *emu.scalars.get(&(value as usize)).ok_or_else(|| {
                (ACLNN_ERR_PARAM_INVALID, format!("{API}: unknown scalar {value:?}"))
            })?;
            Op::Fill { dst: dst.clone(), value }
                .validate(emu.backend_instance())
                .map_err(crate::bad)?;
            Ok(vec![task(move || {
                fill(&dst, value);
                Ok(())
            })])
        })
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn aclnnInplaceFillScalar(
    ws: *mut c_void,
    size: u64,
    ex: *mut aclOpExecutor,
    stream: aclrtStream,
) -> aclnnStatus {
    execute("aclnnInplaceFillScalar", ws, size, ex, stream)
}

/// `[M, ceil(K/64), 2]` E8M0 (Ascend's MX scale layout) as the plain `[M, ceil(K/32)]` view the
/// codec writes, plus the padding column (when `ceil(K/32)` is odd) as a separate view.
fn mx_scale_views(api: &str, scale: &T, m: usize, k: usize) -> Res<(T, Option<T>)> {
    let blocks = num_blocks_of(k);
    let pairs = blocks.div_ceil(2);
    if scale.shape() != [m, pairs, 2] {
        return invalid(format!(
            "{api}: scale shape {:?}, expected [{m}, {pairs}, 2]",
            scale.shape()
        ));
    }
    let flat = scale.reshape(&[m, 2 * pairs]).map_err(crate::bad)?;
    let plain = flat.narrow(1, 0, blocks).map_err(crate::bad)?;
    let pad =
        (2 * pairs > blocks).then(|| flat.narrow(1, blocks, 1)).transpose().map_err(crate::bad)?;
    Ok((plain, pad))
}

fn require_mx(emu: &Emu, api: &str) -> Res<()> {
    if emu.has_mx() {
        Ok(())
    } else {
        Err((
            ACLNN_ERR_PARAM_INVALID,
            format!(
                "{api}: MX dtypes need an Ascend 950; this SoC is {}",
                emu.soc.to_string_lossy()
            ),
        ))
    }
}

#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments, reason = "CANN's signature")]
pub unsafe extern "C" fn aclnnDynamicMxQuantV3GetWorkspaceSize(
    x: *const aclTensor,
    axis: i64,
    round_mode: *const c_char,
    dst_type: i64,
    blocksize: i64,
    scale_alg: i64,
    _dst_type_max: f64,
    _max_low_bound: f64,
    y_out: *mut aclTensor,
    mxscale_out: *mut aclTensor,
    workspace_size: *mut u64,
    executor: *mut *mut aclOpExecutor,
) -> aclnnStatus {
    const API: &str = "aclnnDynamicMxQuantV3";
    // SAFETY: `round_mode` is null or a C string (CANN's contract).
    let round = (!round_mode.is_null()).then(|| unsafe { CStr::from_ptr(round_mode) }.to_owned());
    // SAFETY: forwarded out-parameters.
    unsafe {
        prepare(API, 0, workspace_size, executor, |emu| {
            require_mx(emu, API)?;
            if axis != -1 || blocksize != MX_BLOCK_SIZE || dst_type != i64::from(ACL_FLOAT8_E4M3FN)
            {
                return invalid(format!(
                    "{API}: axis {axis}, blocksize {blocksize}, dstType {dst_type} (kda: -1, 32, 36)"
                ));
            }
            if round.as_ref().is_some_and(|r| r.to_bytes() != b"rint") {
                return invalid(format!("{API}: roundMode {round:?} (E4M3 uses rint)"));
            }
            let alg = match scale_alg {
                0 => ScaleAlg::OcpFloor,
                1 => ScaleAlg::RoundUp,
                other => return invalid(format!("{API}: scaleAlg {other}")),
            };
            let (x, _) = tensor(emu, API, "x", x)?;
            let (data, _) = tensor(emu, API, "yOut", y_out)?;
            let (scale, _) = tensor(emu, API, "mxscaleOut", mxscale_out)?;
            let [m, k] = *x.shape() else {
                return invalid(format!("{API}: x shape {:?} (kda quantizes [M, K])", x.shape()));
            };
            let (plain, pad) = mx_scale_views(API, &scale, m, k)?;
            Op::DynamicQuant { x: x.clone(), data: data.clone(), scale: plain.clone(), alg }
                .validate(emu.backend_instance())
                .map_err(crate::bad)?;
            Ok(vec![task(move || mx_quant(&x, &data, &plain, pad.as_ref(), alg, (m, k)))])
        })
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn aclnnDynamicMxQuantV3(
    ws: *mut c_void,
    size: u64,
    ex: *mut aclOpExecutor,
    stream: aclrtStream,
) -> aclnnStatus {
    execute("aclnnDynamicMxQuantV3", ws, size, ex, stream)
}

#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments, reason = "CANN's signature")]
pub unsafe extern "C" fn aclnnQuantMatmulV5GetWorkspaceSize(
    x1: *const aclTensor,
    x2: *const aclTensor,
    x1_scale: *const aclTensor,
    x2_scale: *const aclTensor,
    y_scale: *const aclTensor,
    x1_offset: *const aclTensor,
    x2_offset: *const aclTensor,
    y_offset: *const aclTensor,
    bias: *const aclTensor,
    transpose_x1: bool,
    transpose_x2: bool,
    group_size: i64,
    out: *mut aclTensor,
    workspace_size: *mut u64,
    executor: *mut *mut aclOpExecutor,
) -> aclnnStatus {
    const API: &str = "aclnnQuantMatmulV5";
    // SAFETY: forwarded out-parameters.
    unsafe {
        prepare(API, GEMM_WORKSPACE, workspace_size, executor, |emu| {
            require_mx(emu, API)?;
            if group_size != MX_GROUP_SIZE {
                return invalid(format!(
                    "{API}: groupSize {group_size} (MX needs {MX_GROUP_SIZE})"
                ));
            }
            if transpose_x1 || !transpose_x2 {
                return invalid(format!("{API}: kda passes x1 [M, K] and x2 [N, K] (transposeX2)"));
            }
            let unused = [
                ("yScale", y_scale),
                ("x1Offset", x1_offset),
                ("x2Offset", x2_offset),
                ("yOffset", y_offset),
                ("bias", bias),
            ];
            if let Some((name, _)) = unused.iter().find(|(_, t)| !t.is_null()) {
                return invalid(format!("{API}: {name} is not used in MX mode"));
            }
            let (a, a_code) = tensor(emu, API, "x1", x1)?;
            let (w, w_code) = tensor(emu, API, "x2", x2)?;
            if a_code != ACL_FLOAT8_E4M3FN || w_code != ACL_FLOAT8_E4M3FN {
                return invalid(format!("{API}: x1/x2 dtypes {a_code}/{w_code} (MXFP8: 36)"));
            }
            let (a_scale, _) = tensor(emu, API, "x1Scale", x1_scale)?;
            let (w_scale, _) = tensor(emu, API, "x2Scale", x2_scale)?;
            let (y, _) = tensor(emu, API, "out", out)?;
            let ([m, k], [n, _]) = (a.shape(), w.shape()) else {
                return invalid(format!("{API}: x1 {:?}, x2 {:?}", a.shape(), w.shape()));
            };
            let dims = (*m, *n, *k);
            let (a_scale, _) = mx_scale_views(API, &a_scale, dims.0, dims.2)?;
            let (w_scale, _) = mx_scale_views(API, &w_scale, dims.1, dims.2)?;
            let op = Op::MxGemm { a, a_scale, w, w_scale, y };
            op.validate(emu.backend_instance()).map_err(crate::bad)?;
            let Op::MxGemm { a, a_scale, w, w_scale, y } = op else {
                return invalid(format!("{API}: not an MX GEMM"));
            };
            Ok(vec![task(move || mx_gemm(&a, &a_scale, &w, &w_scale, &y, dims))])
        })
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn aclnnQuantMatmulV5(
    ws: *mut c_void,
    size: u64,
    ex: *mut aclOpExecutor,
    stream: aclrtStream,
) -> aclnnStatus {
    execute("aclnnQuantMatmulV5", ws, size, ex, stream)
}

/// The same memory with the two dimensions swapped.
fn transpose(t: &T) -> Res<T> {
    let l = t.layout();
    let ([r, c], [sr, sc]) = (l.shape(), l.strides()) else {
        return invalid(format!("expected a matrix, got shape {:?}", l.shape()));
    };
    let layout = kda_core::Layout::strided(l.dtype(), &[*c, *r], &[*sc, *sr], l.offset())
        .map_err(crate::bad)?;
    Tensor::new(t.buffer().clone(), layout).map_err(crate::bad)
}

/// `aclnnMatmul` with `cubeMathType` `KEEP_DTYPE` (hicann/ops-nn
/// `matmul/mat_mul_v3/docs/aclnnMatmul.md`: 0 keeps the (deduced) input dtype, so f32 inputs
/// are not lowered to HFLOAT32, which only types 1 and 3 do): `out = self @ mat2`, with bf16 and
/// f16 inputs widened exactly (their products are exact in f32), an f32 accumulation (the
/// emulator's model of the Cube's accumulator; the document fixes no summation order) and one
/// round-to-nearest-even to `out`'s dtype. A mixed pair is deduced to FLOAT32 on the 950 (the
/// phase-one check refuses it on A2/A3).
fn matmul(x: &T, mat2: &T, y: &T) -> Result<(), String> {
    let (&[m, k], &[_, n]) = (x.shape(), mat2.shape()) else {
        return Err(format!("aclnnMatmul: shapes {:?} @ {:?}", x.shape(), mat2.shape()));
    };
    // SAFETY: the executor's tensors keep their memory alive; the stream runs this task in
    // order with the work on them, as the device does.
    let (a, b) = unsafe { (host::read_f32(x), host::read_f32(mat2)) };
    let mut out = vec![0.0f32; m * n];
    if m > 0 && n > 0 && k > 0 {
        // SAFETY: `a` is `[m, k]`, `b` `[k, n]`, `out` `[m, n]`, all row-major and distinct.
        unsafe {
            gemm::gemm(
                m,
                n,
                k,
                out.as_mut_ptr(),
                1,
                n as isize,
                false,
                a.as_ptr(),
                1,
                k as isize,
                b.as_ptr(),
                1,
                n as isize,
                0.0,
                1.0,
                false,
                false,
                false,
                gemm::Parallelism::None,
            );
        }
    }
    // SAFETY: as above; `out` is this task's to write.
    unsafe { host::write_f32(y, &out) };
    Ok(())
}

/// `aclnnInplaceCopy`: the same dtype bit for bit; between float dtypes an exact widening or one
/// round-to-nearest-even narrowing (hicann/ops-math `conversion/view_copy/docs/aclnnInplaceCopy.md`).
fn copy(src: &T, dst: &T) {
    // SAFETY: the executor's tensors keep their memory alive; stream order as the device.
    unsafe {
        if src.dtype() == dst.dtype() {
            host::copy_raw(src, dst);
        } else {
            host::write_f32(dst, &host::read_f32(src));
        }
    }
}

/// `aclnnInplaceFillScalar`: the scalar cast to `selfRef`'s dtype in every element.
fn fill(dst: &T, value: f64) {
    // SAFETY: the executor's tensor keeps its memory alive; stream order as the device.
    unsafe { host::fill(dst, value) };
}

/// `aclnnDynamicMxQuantV3` with `axis` −1, block size 32, `dstType` FLOAT8_E4M3FN, "rint"
/// (hicann/ops-nn `quant/dynamic_mx_quant/docs/aclnnDynamicMxQuantV3.md`, 计算公式: `scaleAlg` 0
/// is `shared_exp = floor(log2(amax)) − emax` with `emax` 8, `scaleAlg` 1 the block scale
/// `amax / Amax(E4M3)` rounded up to a power of two; each element `x / mxscale` cast to E4M3 with
/// round-to-nearest-even; `mxscaleOut`'s axis is padded to an even count with 0). kda's MX codec
/// (`kda_core::mx`) implements that definition once, for every backend.
fn mx_quant(
    x: &T,
    data: &T,
    scale: &T,
    pad: Option<&T>,
    alg: ScaleAlg,
    (m, k): (usize, usize),
) -> Result<(), String> {
    // SAFETY: the executor's tensors keep their memory alive; stream order as the device.
    let values = unsafe { host::read_f32(x) };
    let blocks = num_blocks_of(k);
    let (mut q, mut s) = (vec![0u8; m * k], vec![0u8; m * blocks]);
    for r in 0..m {
        let row = &values[r * k..(r + 1) * k];
        kda_core::mx::quantize_row(row, alg, &mut q[r * k..][..k], &mut s[r * blocks..][..blocks])
            .map_err(|e| format!("aclnnDynamicMxQuantV3: {e}"))?;
    }
    // SAFETY: as above; the outputs are this task's to write.
    unsafe {
        host::write_bytes(data, &q);
        host::write_bytes(scale, &s);
        if let Some(pad) = pad {
            host::write_bytes(pad, &vec![0; pad.numel()]);
        }
    }
    Ok(())
}

/// `aclnnQuantMatmulV5` in MX mode (`groupSize` `[1, 1, 32]`, hicann/ops-nn
/// `matmul/quant_batch_matmul_v4/docs/aclnnQuantMatmulV5.md`): `out = Σ_blocks (x1·x2ᵀ over the
/// block) · 2^(s1) · 2^(s2)`, as kda's MX specification (`kda_core::mx::gemm`, docs/design/
/// mxfp8.md: exact block sums, each scaled block term rounded to f32 once, terms summed in f32
/// in block order), rounded to `out`'s dtype.
fn mx_gemm(
    a: &T,
    a_scale: &T,
    w: &T,
    w_scale: &T,
    y: &T,
    dims: (usize, usize, usize),
) -> Result<(), String> {
    // SAFETY: the executor's tensors keep their memory alive; stream order as the device.
    let (av, asv, wv, wsv) = unsafe {
        (
            host::read_bytes(a),
            host::read_bytes(a_scale),
            host::read_bytes(w),
            host::read_bytes(w_scale),
        )
    };
    let out = kda_core::mx::gemm::gemm(&av, &asv, &wv, &wsv, dims)
        .map_err(|e| format!("aclnnQuantMatmulV5: {e}"))?;
    // SAFETY: as above; `out` is this task's to write.
    unsafe { host::write_f32(y, &out) };
    Ok(())
}
