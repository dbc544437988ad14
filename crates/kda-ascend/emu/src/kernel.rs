//! Kernel binaries and launches: `aclrtBinaryLoadFromFile`, `aclrtBinaryGetFunction`,
//! `aclrtLaunchKernelWithHostArgs`, `aclrtLaunchKernel`.
//!
//! A binary is a file at an absolute path. Either a shared library of twin-compiled kernels
//! ([`crate::twin::Library::build`]: an ELF file), whose kernels run from that library, or a
//! stand-in: any file holding kernel names as NUL-terminated strings ([`write_stand_in`]), whose
//! kernels are the ones built into this crate (the unchanged `kernels/*.cpp`, compiled with the
//! twin by `build.rs`). Only kernels that have an AscendC source exist (`abi::names::ALL`,
//! checked against the sources by kda-ascend's `kernel_sources` test).
//!
//! A launch is read the way the hardware kernel reads it: the parameter area (one pointer per
//! tensor, then `meta`) and the meta region at the `meta` device address. The decoded arguments
//! are checked against the HAL op they describe (a malformed launch is refused at once); then
//! the kernel itself runs on the stream: every block of the twin-compiled entry point on the GM
//! memory the launch names. A rule the kernel breaks fails the stream, naming the kernel.

use std::ffi::{CStr, c_char, c_void};
use std::path::Path;
use std::sync::Arc;

use kda_core::kda::{
    CausalConv, CausalConvUpdate, GateForm, GatedRmsNorm, KdaChunk, KdaGate, KdaRecurrent, L2Norm,
    ZeroPadding,
};
use kda_core::{BufferHandle, HostFn, Op};

use crate::abi::{self, GmTensor, names};
use crate::mem::Mem;
use crate::twin::{self, GmRange};
use crate::types::*;
use crate::{Emu, Res, T, array, call, emu, invalid, put};

/// Where a loaded binary's kernel code is.
#[derive(Clone, Debug)]
pub(crate) enum Code {
    /// The kernels built into this crate (a stand-in binary).
    BuiltIn,
    /// A twin-compiled shared library.
    Library(Arc<twin::Library>),
}

impl Code {
    fn kernel(&self, name: &str) -> Result<twin::Kernel, twin::TwinError> {
        match self {
            Code::BuiltIn => twin::Kernel::builtin(name),
            Code::Library(lib) => lib.kernel(name),
        }
    }
}

/// A loaded binary: its kda kernels and their code.
#[derive(Debug)]
pub(crate) struct Binary {
    kernels: Vec<&'static str>,
    code: Code,
}

/// The tag that opens a stand-in binary.
const STAND_IN: &[u8] = b"kda-acl-emu stand-in kernel binary\0";

/// Write a stand-in kernel binary holding the kernels `names` at `path`: the emulated backend
/// loads one with every kda kernel ([`names::ALL`]) when no compiled binary is named; a test
/// leaves kernels out to stand for a binary built from older sources.
pub fn write_stand_in(path: &Path, names: &[&str]) -> std::io::Result<()> {
    let mut bytes = STAND_IN.to_vec();
    for name in names {
        bytes.extend_from_slice(name.as_bytes());
        bytes.push(0);
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(path, bytes)
}

/// The kda kernels `bytes` holds (each name as a NUL-terminated string).
fn kernels_in(bytes: &[u8]) -> Vec<&'static str> {
    names::ALL
        .into_iter()
        .filter(|name| {
            let mut needle = name.as_bytes().to_vec();
            needle.push(0);
            bytes.windows(needle.len()).enumerate().any(|(i, w)| {
                // A whole string: preceded by a NUL (or the start), not a longer name's tail.
                w == needle.as_slice() && (i == 0 || bytes[i - 1] == 0)
            })
        })
        .collect()
}

/// `aclrtBinaryLoadFromFile`: CANN requires an absolute path (API reference, "binPath … 要求绝对
/// 路径") and fails when the file cannot be resolved (`RealPath` in the runtime's binary
/// loader: `ACL_ERROR_RT_PARAM_INVALID`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn aclrtBinaryLoadFromFile(
    path: *const c_char,
    _options: *mut aclrtBinaryLoadOptions,
    handle: *mut aclrtBinHandle,
) -> aclError {
    const API: &str = "aclrtBinaryLoadFromFile";
    call(|| {
        if path.is_null() {
            return Err((ACL_ERROR_RT_PARAM_INVALID, format!("{API}: null path")));
        }
        // SAFETY: a C string per CANN's contract.
        let text = unsafe { CStr::from_ptr(path) }.to_string_lossy().into_owned();
        let file = Path::new(&text);
        if !file.is_absolute() {
            return Err((
                ACL_ERROR_RT_PARAM_INVALID,
                format!("{API}: binPath `{text}` is not an absolute path"),
            ));
        }
        let bytes = std::fs::read(file).map_err(|e| {
            (ACL_ERROR_RT_PARAM_INVALID, format!("{API}: cannot read `{text}`: {e}"))
        })?;
        let binary = if bytes.starts_with(b"\x7fELF") {
            let lib = twin::Library::open(file).map_err(|e| {
                (ACL_ERROR_RT_PARAM_INVALID, format!("{API}: `{text}` is not a kernel binary: {e}"))
            })?;
            let lib = Arc::new(lib);
            let kernels = names::ALL.into_iter().filter(|n| lib.has(n)).collect();
            Binary { kernels, code: Code::Library(lib) }
        } else {
            Binary { kernels: kernels_in(&bytes), code: Code::BuiltIn }
        };
        let mut emu = emu();
        emu.ready(API)?;
        let h = emu.handle();
        emu.binaries.insert(h, binary);
        // SAFETY: writable out-parameter per CANN's contract.
        unsafe { put(API, handle, h as aclrtBinHandle) }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn aclrtBinaryUnLoad(handle: aclrtBinHandle) -> aclError {
    call(|| match emu().binaries.remove(&(handle as usize)) {
        Some(_) => Ok(()),
        None => invalid(format!("aclrtBinaryUnLoad: unknown binary {handle:?}")),
    })
}

/// A name the binary does not contain is the runtime's `RT_ERROR_KERNEL_NULL` ("Cannot find
/// kernel by name"), which it reports as `ACL_ERROR_RT_INTERNAL_ERROR`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn aclrtBinaryGetFunction(
    binary: aclrtBinHandle,
    kernel_name: *const c_char,
    func: *mut aclrtFuncHandle,
) -> aclError {
    const API: &str = "aclrtBinaryGetFunction";
    call(|| {
        let mut emu = emu();
        let Some(bin) = emu.binaries.get(&(binary as usize)) else {
            return invalid(format!("{API}: unknown binary {binary:?}"));
        };
        if kernel_name.is_null() {
            return invalid(format!("{API}: null kernel name"));
        }
        // SAFETY: a C string per CANN's contract.
        let name = unsafe { CStr::from_ptr(kernel_name) }.to_string_lossy();
        let Some(known) = bin.kernels.iter().find(|n| **n == name).copied() else {
            return Err((
                ACL_ERROR_RT_INTERNAL_ERROR,
                format!("{API}: cannot find kernel by name `{name}` in the binary"),
            ));
        };
        let code = bin.code.clone();
        let h = emu.handle();
        emu.functions.insert(h, (known, code));
        // SAFETY: writable out-parameter per CANN's contract.
        unsafe { put(API, func, h as aclrtFuncHandle) }
    })
}

/// `aclrtLaunchKernel` reads `argsData` from device memory (the runtime does not copy it:
/// `isNoNeedH2DCopy = 1`), and is not the launch function for binaries loaded from a file
/// (those take `aclrtLaunchKernelWithConfig`, `…V2` or `…WithHostArgs`). A host block is
/// rejected here; on hardware the kernel would fault reading it.
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
        let (name, _) = function(&emu, API, func)?;
        if emu.locate(API, args as usize, args_size).is_err() {
            return Err((
                ACL_ERROR_RT_PARAM_INVALID,
                format!(
                    "{API} {name}: argsData {args:?} ({args_size} bytes) is not device memory \
                     (aclrtLaunchKernel does not copy host arguments)"
                ),
            ));
        }
        Err((
            ACL_ERROR_RT_PARAM_INVALID,
            format!(
                "{API} {name}: a kernel of a binary loaded with aclrtBinaryLoadFromFile is \
                 launched with aclrtLaunchKernelWithConfig, V2 or WithHostArgs (block_dim \
                 {block_dim}, stream {stream:?})"
            ),
        ))
    })
}

/// `aclrtLaunchKernelWithHostArgs`: the runtime copies each placeholder's data region into
/// device memory and writes its address into the block at `addrOffset` (`aclrtPlaceHolderInfo`);
/// the kernel then reads its parameter area and its meta region at the `meta` address.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments, reason = "CANN's prototype")]
pub unsafe extern "C" fn aclrtLaunchKernelWithHostArgs(
    func: aclrtFuncHandle,
    num_blocks: u32,
    stream: aclrtStream,
    _cfg: *mut aclrtLaunchKernelCfg,
    host_args: *mut c_void,
    args_size: usize,
    place_holders: *mut aclrtPlaceHolderInfo,
    place_holder_num: usize,
) -> aclError {
    const API: &str = "aclrtLaunchKernelWithHostArgs";
    call(|| {
        // SAFETY: `hostArgs` holds `argsSize` bytes and `placeHolderArray` `placeHolderNum`
        // entries (CANN's contract).
        let mut block = unsafe { array(host_args.cast_const().cast::<u8>(), args_size) }?;
        // SAFETY: as above.
        let holders = unsafe { array(place_holders.cast_const(), place_holder_num) }?;
        let mut emu = emu();
        let (name, code) = function(&emu, API, func)?;
        // The runtime's part: each data region to device memory, its address into the block.
        let staged = stage_place_holders(&mut emu, API, &mut block, &holders)?;
        let result = read_and_queue(&emu, API, name, &code, num_blocks, &block, stream);
        for addr in staged {
            emu.memory.remove(&addr);
        }
        result
    })
}

fn function(emu: &Emu, api: &str, func: aclrtFuncHandle) -> Res<(&'static str, Code)> {
    emu.functions
        .get(&(func as usize))
        .cloned()
        .ok_or_else(|| (ACL_ERROR_RT_PARAM_INVALID, format!("{api}: unknown function {func:?}")))
}

/// Copy each placeholder's data region (from its `dataOffset` to the next region or the end)
/// into fresh device memory and write the address at its `addrOffset`; returns the addresses.
fn stage_place_holders(
    emu: &mut Emu,
    api: &str,
    block: &mut [u8],
    holders: &[aclrtPlaceHolderInfo],
) -> Res<Vec<usize>> {
    let len = block.len();
    let mut starts: Vec<usize> = holders.iter().map(|h| h.data_offset as usize).collect();
    starts.sort_unstable();
    let first_data = starts.first().copied().unwrap_or(len);
    let mut staged = Vec::new();
    for h in holders {
        let (slot, data) = (h.addr_offset as usize, h.data_offset as usize);
        if slot % 8 != 0 || slot + 8 > first_data || data > len {
            return Err((
                ACL_ERROR_RT_PARAM_INVALID,
                format!(
                    "{api}: placeholder {{addrOffset {slot}, dataOffset {data}}} outside a block \
                     of {len} bytes whose data regions start at {first_data}"
                ),
            ));
        }
        let end = starts.iter().copied().find(|&s| s > data).unwrap_or(len);
        let region = &block[data..end];
        let buf = crate::allocate(emu, api, region.len().max(1))
            .map_err(|(_, m)| (ACL_ERROR_RT_MEMORY_ALLOCATION, m))?;
        let addr = buf.element_ptr::<u8>(0);
        // SAFETY: `addr` starts a fresh allocation of at least `region.len()` bytes that nothing
        // else references yet.
        unsafe { std::ptr::copy_nonoverlapping(region.as_ptr(), addr, region.len()) };
        emu.memory.insert(addr as usize, buf);
        block[slot..slot + 8].copy_from_slice(&(addr as u64).to_ne_bytes());
        staged.push(addr as usize);
    }
    Ok(staged)
}

/// `len` bytes of device memory at `addr`, read now (the emulator's kernels read their
/// arguments at launch).
fn device_bytes(emu: &Emu, api: &str, addr: u64, len: usize) -> Res<Vec<u8>> {
    let (buf, offset) = emu.locate(api, addr as usize, len).map_err(|_| {
        (
            ACL_ERROR_RT_PARAM_INVALID,
            format!(
                "{api}: the kernel reads {len} bytes of meta at {addr:#x}, which is not device \
                 memory (no placeholder filled it)"
            ),
        )
    })?;
    let ptr = buf.element_ptr::<u8>(offset);
    // SAFETY: `ptr` and the `len` bytes after it lie inside a live allocation (`locate`).
    Ok(unsafe { std::slice::from_raw_parts(ptr, len) }.to_vec())
}

/// The kernel's side: the parameter area, then the meta region from device memory; queue the
/// kernel's execution.
fn read_and_queue(
    emu: &Emu,
    api: &str,
    name: &'static str,
    code: &Code,
    num_blocks: u32,
    block: &[u8],
    stream: aclrtStream,
) -> Res<()> {
    let bad = |m: String| (ACL_ERROR_RT_PARAM_INVALID, format!("{api} {name}: {m}"));
    let n = names::tensors(name).ok_or_else(|| bad("no parameter list".into()))?;
    let params = abi::decode_params(block, n).map_err(bad)?;
    let head = device_bytes(emu, api, params.meta, size_of::<abi::ArgsHeader>())?;
    let header = abi::decode_header(&head).map_err(bad)?;
    let size = abi::meta_size(header.tensors as usize, header.scalars as usize);
    let meta = device_bytes(emu, api, params.meta, size)?;
    let args = abi::decode_meta(&meta, &params).map_err(bad)?;
    if num_blocks == 0 || num_blocks != args.tiling.block_dim {
        return invalid(format!(
            "{api} {name}: numBlocks {num_blocks}, tiling says {}",
            args.tiling.block_dim
        ));
    }
    let s = emu.stream(api, stream)?;
    // The launch must describe the HAL op it stands for (the descriptors' shapes and dtypes
    // agree): checked here, as the backend's own validation would have.
    let op = describe(emu, name, &args).map_err(|(c, m)| (c, format!("{api} {name}: {m}")))?;
    op.validate(emu.backend_instance())
        .map_err(|e| (ACL_ERROR_RT_PARAM_INVALID, format!("{api} {name}: {e}")))?;
    let kernel = code.kernel(name).map_err(|e| bad(e.to_string()))?;
    let run = execution(emu, api, kernel, num_blocks, &params, &meta, stream)?;
    emu.launch(name, &s, vec![run])?;
    crate::log(name, stream as usize, 0);
    Ok(())
}

/// The kernel's execution on the stream: its pointer parameters, a copy of the meta region (the
/// runtime copied it to the device at launch), the GM buffers those pointers lie in (kept alive
/// until the stream has run it, and the only GM it may touch) and the SoC's profile. A fault is
/// recorded on the context as it happens (the runtime's error report), not at a synchronize.
fn execution(
    emu: &Emu,
    api: &str,
    kernel: twin::Kernel,
    blocks: u32,
    params: &abi::Params,
    meta: &[u8],
    stream: aclrtStream,
) -> Res<HostFn> {
    let mut words = vec![0u64; meta.len().div_ceil(8)];
    for (w, chunk) in words.iter_mut().zip(meta.chunks(8)) {
        let mut b = [0u8; 8];
        b[..chunk.len()].copy_from_slice(chunk);
        *w = u64::from_ne_bytes(b);
    }
    let meta_words: Arc<[u64]> = words.into();
    let mut gm = Vec::new();
    let mut keep = Vec::new();
    for &addr in &params.tensors {
        if addr == 0 {
            continue;
        }
        let (buf, offset) = emu.locate(api, addr as usize, 0)?;
        let base = addr - offset as u64;
        let range = GmRange { base, len: buf.len_bytes() as u64 };
        if !gm.contains(&range) {
            gm.push(range);
            keep.push(buf);
        }
    }
    let profile = twin::Profile::of_soc(&emu.soc.to_string_lossy());
    let tensors = params.tensors.clone();
    let (failure, stream) = (emu.failure.clone(), stream as usize);
    Ok(HostFn::new(move || {
        let mut args = tensors.clone();
        args.push(meta_words.as_ptr() as u64);
        let _alive = &keep;
        // SAFETY: every range of `gm` is an allocation `keep` holds alive; the stream runs one
        // task at a time and orders this one after the work it depends on, as the device
        // does; the meta pointer is `meta_words`, which the kernel reads as its meta region.
        unsafe { kernel.launch(profile, blocks, &args, &gm) }.map_err(|e| {
            let text = e.to_string();
            failure.record(
                ACL_ERROR_RT_AICORE_EXCEPTION,
                format!("a task on stream {stream:#x} failed: {text}"),
            );
            text
        })
    }))
}

/// The tensors of a launch, in order; `None` for absent optional operands.
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

/// The HAL op a kernel launch describes (its arguments are checked against it).
fn describe(emu: &Emu, name: &str, block: &abi::Args) -> Res<Op<Mem>> {
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
                host_meta: None,
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
        other => return invalid(format!("no kernel `{other}`")),
    })
}
