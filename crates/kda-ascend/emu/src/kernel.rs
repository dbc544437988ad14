//! Kernel binaries and launches: `aclrtBinaryLoadFromFile`, `aclrtBinaryGetFunction`,
//! `aclrtLaunchKernel`. The emulator serves the kda kernels (`abi::names`) by name and runs each
//! launch through the reference kernel of the same op, after checking the argument block the
//! backend built and the `blockDim` its tiling chose.

use std::ffi::{CStr, c_char, c_void};

use kda_core::kda::{
    CausalConv, CausalConvUpdate, GateForm, GatedRmsNorm, KdaChunk, KdaGate, KdaRecurrent, L2Norm,
    ZeroPadding,
};
use kda_core::{HostFn, Op};

use crate::abi::{self, GmTensor, names};
use crate::types::*;
use crate::{Emu, Ref, Res, T, array, call, emu, invalid, put};

#[unsafe(no_mangle)]
pub unsafe extern "C" fn aclrtBinaryLoadFromFile(
    path: *const c_char,
    _options: *mut aclrtBinaryLoadOptions,
    handle: *mut aclrtBinHandle,
) -> aclError {
    const API: &str = "aclrtBinaryLoadFromFile";
    call(|| {
        if path.is_null() {
            return invalid(format!("{API}: null path"));
        }
        let mut emu = emu();
        emu.ready(API)?;
        let h = emu.handle();
        emu.binaries.insert(h);
        // SAFETY: writable out-parameter per CANN's contract.
        unsafe { put(API, handle, h as aclrtBinHandle) }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn aclrtBinaryUnLoad(handle: aclrtBinHandle) -> aclError {
    call(|| match emu().binaries.remove(&(handle as usize)) {
        true => Ok(()),
        false => invalid(format!("aclrtBinaryUnLoad: unknown binary {handle:?}")),
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn aclrtBinaryGetFunction(
    binary: aclrtBinHandle,
    kernel_name: *const c_char,
    func: *mut aclrtFuncHandle,
) -> aclError {
    const API: &str = "aclrtBinaryGetFunction";
    call(|| {
        let mut emu = emu();
        if !emu.binaries.contains(&(binary as usize)) {
            return invalid(format!("{API}: unknown binary {binary:?}"));
        }
        if kernel_name.is_null() {
            return invalid(format!("{API}: null kernel name"));
        }
        // SAFETY: a C string per CANN's contract.
        let name = unsafe { CStr::from_ptr(kernel_name) }.to_string_lossy();
        let known = names::ALL.iter().find(|n| **n == name).copied();
        let Some(known) = known else {
            return Err((
                ACL_ERROR_INVALID_PARAM,
                format!("{API}: no kernel `{name}` in the binary"),
            ));
        };
        let h = emu.handle();
        emu.functions.insert(h, known);
        // SAFETY: writable out-parameter per CANN's contract.
        unsafe { put(API, func, h as aclrtFuncHandle) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn aclrtLaunchKernel(
    func: aclrtFuncHandle,
    block_dim: u32,
    args: *const c_void,
    args_size: usize,
    stream: aclrtStream,
) -> aclError {
    const API: &str = "aclrtLaunchKernel";
    call(|| {
        let emu = emu();
        let name = *emu.functions.get(&(func as usize)).ok_or_else(|| {
            (ACL_ERROR_INVALID_PARAM, format!("{API}: unknown function {func:?}"))
        })?;
        // SAFETY: `args` holds `args_size` bytes (CANN's contract).
        let bytes = unsafe { array(args.cast::<u8>(), args_size) }?;
        let block = abi::decode(&bytes)
            .map_err(|m| (ACL_ERROR_INVALID_PARAM, format!("{API} {name}: {m}")))?;
        if block_dim == 0 || block_dim != block.tiling.block_dim {
            return invalid(format!(
                "{API} {name}: blockDim {block_dim}, tiling says {}",
                block.tiling.block_dim
            ));
        }
        let s = emu.stream(API, stream)?;
        let op = build(&emu, name, &block).map_err(|(c, m)| (c, format!("{API} {name}: {m}")))?;
        op.validate(emu.backend_instance())
            .map_err(|e| (ACL_ERROR_INVALID_PARAM, format!("{API} {name}: {e}")))?;
        emu.launch(name, &s, vec![op])?;
        crate::log(name, stream as usize, 0);
        Ok(())
    })
}

/// The tensors of a block, in order; `None` for absent optional operands.
fn tensors(emu: &Emu, block: &abi::Args) -> Res<Vec<Option<T>>> {
    block
        .tensors
        .iter()
        .map(|g: &GmTensor| {
            if g.addr == 0 {
                return Ok(None);
            }
            let rank = g.rank as usize;
            if rank > abi::MAX_RANK {
                return invalid(format!("rank {rank}"));
            }
            emu.view(
                "kernel",
                g.addr as usize,
                g.dtype,
                &g.shape[..rank],
                &g.strides[..rank],
                g.offset,
            )
            .map(Some)
        })
        .collect()
}

fn need(t: &mut std::vec::IntoIter<Option<T>>, what: &str) -> Res<T> {
    t.next().flatten().ok_or_else(|| (ACL_ERROR_INVALID_PARAM, format!("missing tensor `{what}`")))
}

fn scalar(block: &abi::Args, i: usize, what: &str) -> Res<f64> {
    block
        .scalars
        .get(i)
        .copied()
        .ok_or_else(|| (ACL_ERROR_INVALID_PARAM, format!("missing scalar `{what}`")))
}

/// The reference op a kernel launch computes.
fn build(emu: &Emu, name: &str, block: &abi::Args) -> Res<Op<Ref>> {
    let list = tensors(emu, block)?;
    let count = list.len();
    let mut t = list.into_iter();
    let expect = |n: usize| {
        if count == n { Ok(()) } else { invalid(format!("{count} tensors, the kernel takes {n}")) }
    };
    Ok(match name {
        names::SIGMOID => {
            expect(2)?;
            Op::Sigmoid { x: need(&mut t, "x")?, y: need(&mut t, "y")? }
        }
        names::GATE => {
            expect(4)?;
            let form = match scalar(block, 0, "form")? as i64 {
                0 => GateForm::Softplus,
                1 => GateForm::LowerBound { lower_bound: scalar(block, 1, "lower_bound")? as f32 },
                other => return invalid(format!("gate form {other}")),
            };
            Op::KdaGate(KdaGate {
                g1: need(&mut t, "g1")?,
                a_log: need(&mut t, "a_log")?,
                dt_bias: need(&mut t, "dt_bias")?,
                form,
                g: need(&mut t, "g")?,
            })
        }
        names::ZERO_PADDING => {
            expect(2)?;
            Op::ZeroPadding(ZeroPadding {
                x: need(&mut t, "x")?,
                num_actual_tokens: need(&mut t, "num_actual_tokens")?,
            })
        }
        names::CONV_UPDATE => {
            expect(6)?;
            Op::CausalConvUpdate(CausalConvUpdate {
                x: need(&mut t, "x")?,
                weight: need(&mut t, "weight")?,
                state_slots: need(&mut t, "state_slots")?,
                num_accepted_tokens: t.next().flatten(),
                state: need(&mut t, "state")?,
                y: need(&mut t, "y")?,
            })
        }
        names::RECURRENT => {
            expect(9)?;
            Op::KdaRecurrent(KdaRecurrent {
                q: need(&mut t, "q")?,
                k: need(&mut t, "k")?,
                v: need(&mut t, "v")?,
                g: need(&mut t, "g")?,
                beta: need(&mut t, "beta")?,
                state_slots: need(&mut t, "state_slots")?,
                num_accepted_tokens: t.next().flatten(),
                state: need(&mut t, "state")?,
                o: need(&mut t, "o")?,
                scale: scalar(block, 0, "scale")? as f32,
                qk_l2norm: scalar(block, 1, "qk_l2norm")? != 0.0,
            })
        }
        names::CONV_PREFILL => {
            expect(7)?;
            Op::CausalConv(CausalConv {
                x: need(&mut t, "x")?,
                weight: need(&mut t, "weight")?,
                query_start_loc: need(&mut t, "query_start_loc")?,
                state_slots: need(&mut t, "state_slots")?,
                has_initial_state: need(&mut t, "has_initial_state")?,
                state: need(&mut t, "state")?,
                y: need(&mut t, "y")?,
            })
        }
        names::L2NORM => {
            expect(2)?;
            Op::L2Norm(L2Norm {
                x: need(&mut t, "x")?,
                y: need(&mut t, "y")?,
                scale: scalar(block, 0, "scale")? as f32,
            })
        }
        names::GATED_RMS_NORM => {
            expect(4)?;
            Op::GatedRmsNorm(GatedRmsNorm {
                x: need(&mut t, "x")?,
                gate: need(&mut t, "gate")?,
                weight: need(&mut t, "weight")?,
                y: need(&mut t, "y")?,
                eps: scalar(block, 0, "eps")? as f32,
            })
        }
        names::CHUNK => {
            expect(11)?;
            Op::KdaChunk(KdaChunk {
                q: need(&mut t, "q")?,
                k: need(&mut t, "k")?,
                v: need(&mut t, "v")?,
                g: need(&mut t, "g")?,
                gate: None,
                beta: need(&mut t, "beta")?,
                cu_seqlens: need(&mut t, "cu_seqlens")?,
                state_slots: need(&mut t, "state_slots")?,
                has_initial_state: need(&mut t, "has_initial_state")?,
                state: need(&mut t, "state")?,
                o: need(&mut t, "o")?,
                chunk_state_slots: t.next().flatten(),
                scale: scalar(block, 0, "scale")? as f32,
                qk_l2norm: scalar(block, 1, "qk_l2norm")? != 0.0,
            })
        }
        names::MX_DEQUANT => {
            expect(3)?;
            Op::MxDequant {
                data: need(&mut t, "data")?,
                scale: need(&mut t, "scale")?,
                y: need(&mut t, "y")?,
            }
        }
        names::MX_QUANT => {
            expect(3)?;
            let alg = match scalar(block, 0, "scale_alg")? as i64 {
                0 => kda_core::ScaleAlg::OcpFloor,
                1 => kda_core::ScaleAlg::RoundUp,
                other => return invalid(format!("scale_alg {other}")),
            };
            Op::DynamicQuant {
                x: need(&mut t, "x")?,
                data: need(&mut t, "data")?,
                scale: need(&mut t, "scale")?,
                alg,
            }
        }
        names::HOST_GUARD => {
            expect(1)?;
            let flag = need(&mut t, "flag")?;
            let offset = flag.layout().offset() * flag.dtype().size_bytes();
            if flag.dtype() != kda_core::DType::I32 || flag.numel() != 1 {
                return invalid("the guard flag is one i32");
            }
            let buf = flag.buffer().clone();
            Op::Host {
                name: "kda_host_guard",
                f: HostFn::new(move || {
                    if crate::rt::flag_is_set(&buf, offset) {
                        Err("a host function on this stream failed".into())
                    } else {
                        Ok(())
                    }
                }),
            }
        }
        other => return invalid(format!("no kernel `{other}`")),
    })
}
