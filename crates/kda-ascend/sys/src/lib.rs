//! `kda-ascend-sys`: the CANN C declarations kda uses, written once.
//!
//! - [`types`]: the C types, codes and flags (values from CANN's headers).
//! - `cann_symbols!` below: the one list of prototypes. It generates [`Api`], a table of
//!   function pointers, one field per symbol; [`SYMBOLS`], what each symbol is; and one
//!   `unsafe extern "C"` function per symbol that calls through the installed table, so callers
//!   write `kda_ascend_sys::aclrtMalloc(..)` as with a linked library.
//! - The table is filled either by [`load`], which opens CANN's libraries at run time (a build
//!   needs no toolkit; a machine without one fails at backend creation with
//!   [`LoadError::MissingLibrary`]), or by the emulated runtime (`kda-acl-emu`), which assigns
//!   its own `extern "C"` functions to the fields — so the compiler checks every emulated
//!   prototype against this list. [`install`] makes a table current for the process.
//!
//! # Adding a symbol
//!
//! One line in the list: `required` or `optional`, the library it lives in ([`Library`]), and
//! the C prototype in Rust types. A `required` symbol missing from the installed CANN fails
//! [`load`] with [`LoadError::MissingSymbols`], which names every missing one and the release
//! that brings it (a symbol newer than CANN 8.0 gets a line in [`SINCE`], citing its release in
//! docs/ascend.md's table); an `optional` one (an op only some chips or
//! releases have, e.g. `aclnnDynamicMxQuantV3`, Ascend 950 only) is left `None`: the backend
//! reports it as an absent capability ([`Api::absent`]) and takes another path. Calling an absent
//! symbol through its function returns `ACL_ERROR_UNINITIALIZE` (null for pointer results); it
//! never crashes. The emulator implements a symbol by assigning its function in its `table()`.
//!
//! `docs/design/ascend.md#linking` says why the symbols are resolved at run time.

#![deny(unsafe_op_in_unsafe_fn)]
#![allow(non_camel_case_types, non_snake_case, reason = "CANN's C names")]

pub mod abi;
pub mod types;

use std::ffi::{c_char, c_int, c_void};
use std::path::PathBuf;
use std::sync::OnceLock;

pub use types::*;

/// The CANN library a symbol is resolved in.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Library {
    /// The ACL runtime: `libascendcl.so` (CANN 8.x and 9.x), `libacl_rt.so` (the open-sourced
    /// runtime of 9.x).
    Runtime,
    /// The aclnn meta API (`aclCreateTensor`, executors): `libnnopbase.so`.
    NnOpBase,
    /// The aclnn ops: `libopapi.so` (8.x), or the per-repository libraries of 9.x
    /// (`libopapi_math.so`, `libopapi_nn.so`, …).
    OpApi,
}

impl Library {
    pub const ALL: [Library; 3] = [Library::Runtime, Library::NnOpBase, Library::OpApi];

    /// The file names tried, in order; every one that opens is searched.
    pub const fn candidates(self) -> &'static [&'static str] {
        match self {
            Library::Runtime => &["libascendcl.so", "libacl_rt.so"],
            Library::NnOpBase => &["libnnopbase.so"],
            Library::OpApi => &[
                "libopapi.so",
                "libopapi_math.so",
                "libopapi_nn.so",
                "libopapi_transformer.so",
                "libcust_opapi.so",
            ],
        }
    }
}

/// One symbol of the list.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Symbol {
    pub name: &'static str,
    pub library: Library,
    /// Backend creation fails without it; an optional symbol is a capability.
    pub required: bool,
}

/// Why the CANN libraries could not be opened or lack a required symbol.
#[derive(Clone, Debug, thiserror::Error, PartialEq, Eq)]
pub enum LoadError {
    #[error(
        "CANN library {library} not found (tried {tried}); install CANN and source its set_env.sh \
         (ASCEND_TOOLKIT_HOME, LD_LIBRARY_PATH)"
    )]
    MissingLibrary { library: String, tried: String },
    /// Every required symbol the installed CANN lacks, each with the release that brings it:
    /// one error, so an older installation is told everything it needs at once.
    #[error("{}", missing_text(.missing))]
    MissingSymbols { missing: Vec<MissingSymbol> },
}

/// A required symbol absent from the installed CANN.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MissingSymbol {
    pub symbol: &'static str,
    /// The libraries it was looked for in.
    pub library: String,
    /// The first CANN release documented to have it ([`since`]).
    pub since: Release,
}

fn missing_text(missing: &[MissingSymbol]) -> String {
    let newest = missing.iter().map(|m| m.since).max().unwrap_or(Release::BASELINE);
    let each: Vec<String> = missing
        .iter()
        .map(|m| format!("`{}` (in {}; CANN {} and later)", m.symbol, m.library, m.since))
        .collect();
    format!(
        "this CANN lacks {} symbol(s) kda requires: {}; install CANN {newest} or later",
        missing.len(),
        each.join(", ")
    )
}

/// A CANN release, `major.minor` (the RC, alpha and beta drops of a release count as it).
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Release {
    pub major: u32,
    pub minor: u32,
}

impl Release {
    /// The oldest release kda's table is written against: every symbol not in [`SINCE`].
    pub const BASELINE: Release = Release { major: 8, minor: 0 };

    pub const fn new(major: u32, minor: u32) -> Self {
        Release { major, minor }
    }

    /// `8.5.0`, `8.0.RC3`, `9.0.0-beta.1`, `8.3.RC1.alpha002` → the release; `None` for text
    /// that does not start with `major.minor`.
    pub fn parse(text: &str) -> Option<Release> {
        let mut parts = text.trim().split(['.', '-']);
        let major = parts.next()?.parse().ok()?;
        let minor: String = parts.next()?.chars().take_while(char::is_ascii_digit).collect();
        Some(Release { major, minor: minor.parse().ok()? })
    }
}

impl std::fmt::Display for Release {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

/// The symbols of the list that came after [`Release::BASELINE`], with the first release whose
/// documentation has them (docs/ascend.md, "CANN releases", cites each page). The rest of the
/// list is in the 8.0 documentation. No older equivalent is used in their place: the launch
/// of a file-loaded kernel before 8.5 goes through `aclrtKernelArgs*` handles and the host
/// callbacks before 8.3 through a report thread the caller subscribes, neither of which the
/// backend's argument layout or host-function contract fits.
pub const SINCE: &[(&str, Release)] = &[
    ("aclmdlRICaptureBegin", Release::new(8, 1)),
    ("aclmdlRICaptureEnd", Release::new(8, 1)),
    ("aclmdlRICaptureGetInfo", Release::new(8, 1)),
    ("aclmdlRIExecuteAsync", Release::new(8, 1)),
    ("aclmdlRIDestroy", Release::new(8, 1)),
    ("aclrtBinaryLoadFromFile", Release::new(8, 3)),
    ("aclrtLaunchHostFunc", Release::new(8, 3)),
    ("aclrtLaunchKernelWithHostArgs", Release::new(8, 5)),
];

/// The first release documented to have `symbol`.
pub fn since(symbol: &str) -> Release {
    SINCE.iter().find(|(s, _)| *s == symbol).map_or(Release::BASELINE, |(_, r)| *r)
}

/// What a call through an absent symbol returns.
pub trait Unbound {
    const UNBOUND: Self;
}
impl Unbound for c_int {
    const UNBOUND: Self = ACL_ERROR_UNINITIALIZE;
}
impl<T> Unbound for *mut T {
    const UNBOUND: Self = std::ptr::null_mut();
}
impl<T> Unbound for *const T {
    const UNBOUND: Self = std::ptr::null();
}

macro_rules! required_flag {
    (required) => {
        true
    };
    (optional) => {
        false
    };
}

/// The one list of CANN prototypes (see the crate docs for how to add one).
macro_rules! cann_symbols {
    ($( $need:ident $lib:ident fn $name:ident ( $($arg:ident : $ty:ty),* $(,)? ) -> $ret:ty ; )*) => {
        /// One function pointer per CANN symbol kda uses; `None`: absent in this installation
        /// (or not emulated).
        #[derive(Clone, Copy, Default)]
        pub struct Api {
            $( pub $name: Option<unsafe extern "C" fn($($ty),*) -> $ret>, )*
        }

        /// Every symbol of the list, in order.
        pub const SYMBOLS: &[Symbol] = &[
            $( Symbol { name: stringify!($name), library: Library::$lib, required: required_flag!($need) }, )*
        ];

        impl Api {
            /// Resolve every symbol in the opened libraries.
            fn resolve(libs: &Opened) -> Api {
                Api { $( $name: libs.get(Library::$lib, concat!(stringify!($name), "\0")), )* }
            }

            /// Whether `symbol` is present in this table.
            pub fn has(&self, symbol: &str) -> bool {
                match symbol {
                    $( stringify!($name) => self.$name.is_some(), )*
                    _ => false,
                }
            }
        }

        $(
            #[doc = concat!("`", stringify!($name), "` through the installed table.")]
            ///
            /// # Safety
            /// The C function's contract (CANN's documentation of the symbol).
            pub unsafe extern "C" fn $name($($arg: $ty),*) -> $ret {
                match installed().and_then(|api| api.$name) {
                    // SAFETY: forwarded; the caller owes the C function's contract.
                    Some(f) => unsafe { f($($arg),*) },
                    None => <$ret as Unbound>::UNBOUND,
                }
            }
        )*
    };
}

cann_symbols! {
    // acl.h / acl_rt.h: init, device, errors.
    required Runtime fn aclInit(config_path: *const c_char) -> aclError;
    required Runtime fn aclrtSetDevice(device_id: i32) -> aclError;
    required Runtime fn aclrtGetSocName() -> *const c_char;
    required Runtime fn aclGetRecentErrMsg() -> *const c_char;

    // Memory.
    required Runtime fn aclrtMalloc(dev_ptr: *mut *mut c_void, size: usize, policy: aclrtMemMallocPolicy) -> aclError;
    required Runtime fn aclrtFree(dev_ptr: *mut c_void) -> aclError;
    required Runtime fn aclrtMallocHost(host_ptr: *mut *mut c_void, size: usize) -> aclError;
    required Runtime fn aclrtFreeHost(host_ptr: *mut c_void) -> aclError;
    required Runtime fn aclrtMemcpyAsync(dst: *mut c_void, dest_max: usize, src: *const c_void, count: usize, kind: aclrtMemcpyKind, stream: aclrtStream) -> aclError;

    // Streams, events, host functions.
    required Runtime fn aclrtCreateStream(stream: *mut aclrtStream) -> aclError;
    required Runtime fn aclrtDestroyStream(stream: aclrtStream) -> aclError;
    required Runtime fn aclrtSetStreamFailureMode(stream: aclrtStream, mode: u64) -> aclError;
    required Runtime fn aclrtSynchronizeStream(stream: aclrtStream) -> aclError;
    required Runtime fn aclrtCreateEventExWithFlag(event: *mut aclrtEvent, flag: u32) -> aclError;
    required Runtime fn aclrtDestroyEvent(event: aclrtEvent) -> aclError;
    required Runtime fn aclrtRecordEvent(event: aclrtEvent, stream: aclrtStream) -> aclError;
    required Runtime fn aclrtStreamWaitEvent(stream: aclrtStream, event: aclrtEvent) -> aclError;
    required Runtime fn aclrtQueryEventStatus(event: aclrtEvent, status: *mut aclrtEventRecordedStatus) -> aclError;
    required Runtime fn aclrtEventElapsedTime(ms: *mut f32, start: aclrtEvent, end: aclrtEvent) -> aclError;
    required Runtime fn aclrtLaunchHostFunc(stream: aclrtStream, f: aclrtHostFunc, args: *mut c_void) -> aclError;

    // acl_mdl.h: capture into a model runtime instance.
    required Runtime fn aclmdlRICaptureBegin(stream: aclrtStream, mode: aclmdlRICaptureMode) -> aclError;
    required Runtime fn aclmdlRICaptureEnd(stream: aclrtStream, model_ri: *mut aclmdlRI) -> aclError;
    required Runtime fn aclmdlRIExecuteAsync(model_ri: aclmdlRI, stream: aclrtStream) -> aclError;
    required Runtime fn aclmdlRIDestroy(model_ri: aclmdlRI) -> aclError;
    required Runtime fn aclmdlRICaptureGetInfo(stream: aclrtStream, status: *mut aclmdlRICaptureStatus, model_ri: *mut aclmdlRI) -> aclError;

    // Kernel binaries and launches.
    required Runtime fn aclrtBinaryLoadFromFile(path: *const c_char, options: *mut aclrtBinaryLoadOptions, handle: *mut aclrtBinHandle) -> aclError;
    required Runtime fn aclrtBinaryUnLoad(handle: aclrtBinHandle) -> aclError;
    required Runtime fn aclrtBinaryGetFunction(binary: aclrtBinHandle, kernel_name: *const c_char, func: *mut aclrtFuncHandle) -> aclError;
    required Runtime fn aclrtLaunchKernel(func: aclrtFuncHandle, num_blocks: u32, args: *const c_void, args_size: usize, stream: aclrtStream) -> aclError;
    required Runtime fn aclrtLaunchKernelWithHostArgs(func: aclrtFuncHandle, num_blocks: u32, stream: aclrtStream, cfg: *mut aclrtLaunchKernelCfg, host_args: *mut c_void, args_size: usize, place_holders: *mut aclrtPlaceHolderInfo, place_holder_num: usize) -> aclError;

    // aclnn meta: descriptors and executors.
    required NnOpBase fn aclCreateTensor(view_dims: *const i64, view_dims_num: u64, data_type: aclDataType, stride: *const i64, offset: i64, format: aclFormat, storage_dims: *const i64, storage_dims_num: u64, tensor_data: *mut c_void) -> *mut aclTensor;
    required NnOpBase fn aclDestroyTensor(tensor: *const aclTensor) -> aclnnStatus;
    required NnOpBase fn aclCreateScalar(value: *mut c_void, data_type: aclDataType) -> *mut aclScalar;
    required NnOpBase fn aclDestroyScalar(scalar: *const aclScalar) -> aclnnStatus;
    required NnOpBase fn aclSetAclOpExecutorRepeatable(executor: *mut aclOpExecutor) -> aclnnStatus;
    required NnOpBase fn aclDestroyAclOpExecutor(executor: *mut aclOpExecutor) -> aclnnStatus;

    // aclnn ops, two phases each. Matmul, copy and fill exist on every chip kda runs on.
    required OpApi fn aclnnMatmulGetWorkspaceSize(self_: *const aclTensor, mat2: *const aclTensor, out: *mut aclTensor, cube_math_type: i8, workspace_size: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
    required OpApi fn aclnnMatmul(workspace: *mut c_void, workspace_size: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
    required OpApi fn aclnnInplaceCopyGetWorkspaceSize(self_ref: *mut aclTensor, src: *const aclTensor, workspace_size: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
    required OpApi fn aclnnInplaceCopy(workspace: *mut c_void, workspace_size: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
    required OpApi fn aclnnInplaceFillScalarGetWorkspaceSize(self_ref: *mut aclTensor, value: *const aclScalar, workspace_size: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
    required OpApi fn aclnnInplaceFillScalar(workspace: *mut c_void, workspace_size: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
    // MXFP8 ops: Ascend 950 only (absent on A2/A3 installations: the bf16 path runs instead).
    optional OpApi fn aclnnDynamicMxQuantV3GetWorkspaceSize(x: *const aclTensor, axis: i64, round_mode: *const c_char, dst_type: i64, blocksize: i64, scale_alg: i64, dst_type_max: f64, max_low_bound: f64, y_out: *mut aclTensor, mxscale_out: *mut aclTensor, workspace_size: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
    optional OpApi fn aclnnDynamicMxQuantV3(workspace: *mut c_void, workspace_size: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
    optional OpApi fn aclnnQuantMatmulV5GetWorkspaceSize(x1: *const aclTensor, x2: *const aclTensor, x1_scale: *const aclTensor, x2_scale: *const aclTensor, y_scale: *const aclTensor, x1_offset: *const aclTensor, x2_offset: *const aclTensor, y_offset: *const aclTensor, bias: *const aclTensor, transpose_x1: bool, transpose_x2: bool, group_size: i64, out: *mut aclTensor, workspace_size: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
    optional OpApi fn aclnnQuantMatmulV5(workspace: *mut c_void, workspace_size: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
    // Host int64 arrays (acl_meta.h), for the vendor KDA op's cuSeqlens.
    optional NnOpBase fn aclCreateIntArray(value: *const i64, size: u64) -> *mut aclIntArray;
    optional NnOpBase fn aclDestroyIntArray(array: *const aclIntArray) -> aclnnStatus;
    // The vendor KDA ops of ops-transformer (attention/chunk_kda_fwd,
    // attention/recurrent_gated_delta_rule): present only in CANN releases that ship them; absent,
    // the backend runs its own kernels (docs/ascend.md, vendor operators).
    optional OpApi fn aclnnChunkKdaFwdGetWorkspaceSize(q: *const aclTensor, k: *const aclTensor, v: *const aclTensor, g: *const aclTensor, beta: *const aclTensor, a_log: *const aclTensor, dt_bias: *const aclTensor, initial_state: *const aclTensor, cu_seqlens: *const aclIntArray, chunk_indices: *const aclIntArray, layout: *const c_char, scale: f64, chunk_size: i64, safe_gate: bool, lower_bound: f64, use_gate_in_kernel: bool, state_v_first: bool, attn_out: *const aclTensor, final_state_out: *const aclTensor, gk_out: *const aclTensor, aqk_out: *const aclTensor, akk_out: *const aclTensor, w_out: *const aclTensor, u_out: *const aclTensor, qg_out: *const aclTensor, kg_out: *const aclTensor, v_new_out: *const aclTensor, h_out: *const aclTensor, workspace_size: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
    optional OpApi fn aclnnChunkKdaFwd(workspace: *mut c_void, workspace_size: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
    optional OpApi fn aclnnRecurrentGatedDeltaRuleGetWorkspaceSize(query: *const aclTensor, key: *const aclTensor, value: *const aclTensor, beta: *const aclTensor, state_ref: *mut aclTensor, actual_seq_lengths: *const aclTensor, ssm_state_indices: *const aclTensor, g: *const aclTensor, gk: *const aclTensor, num_accepted_tokens: *const aclTensor, scale_value: f32, out: *mut aclTensor, workspace_size: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
    optional OpApi fn aclnnRecurrentGatedDeltaRule(workspace: *mut c_void, workspace_size: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
}

/// The symbols the vendor chunked-prefill path needs (the capability "aclnnChunkKdaFwd").
pub const CHUNK_KDA_SYMBOLS: [&str; 4] = [
    "aclCreateIntArray",
    "aclDestroyIntArray",
    "aclnnChunkKdaFwdGetWorkspaceSize",
    "aclnnChunkKdaFwd",
];

/// The symbols of the vendor recurrent op (the capability "aclnnRecurrentGatedDeltaRule").
pub const RECURRENT_GDR_SYMBOLS: [&str; 2] =
    ["aclnnRecurrentGatedDeltaRuleGetWorkspaceSize", "aclnnRecurrentGatedDeltaRule"];

/// The symbols an MXFP8 GEMM path needs natively (the capability "native MXFP8").
pub const MX_SYMBOLS: [&str; 4] = [
    "aclnnDynamicMxQuantV3GetWorkspaceSize",
    "aclnnDynamicMxQuantV3",
    "aclnnQuantMatmulV5GetWorkspaceSize",
    "aclnnQuantMatmulV5",
];

impl Api {
    /// The required symbols this table lacks (empty for a usable table).
    pub fn missing_required(&self) -> Vec<&'static str> {
        SYMBOLS.iter().filter(|s| s.required && !self.has(s.name)).map(|s| s.name).collect()
    }

    /// `Ok` when every required symbol is present; else one error naming each missing one,
    /// the libraries it was looked for in and the release that brings it.
    pub fn check(&self) -> Result<(), LoadError> {
        let missing: Vec<MissingSymbol> = SYMBOLS
            .iter()
            .filter(|s| s.required && !self.has(s.name))
            .map(|s| MissingSymbol {
                symbol: s.name,
                library: s.library.candidates().join(" or "),
                since: since(s.name),
            })
            .collect();
        if missing.is_empty() { Ok(()) } else { Err(LoadError::MissingSymbols { missing }) }
    }

    /// The optional symbols this table lacks: capabilities absent here.
    pub fn absent(&self) -> Vec<&'static str> {
        SYMBOLS.iter().filter(|s| !s.required && !self.has(s.name)).map(|s| s.name).collect()
    }

    /// Whether every symbol of `names` is present.
    pub fn has_all(&self, names: &[&str]) -> bool {
        names.iter().all(|n| self.has(n))
    }
}

impl std::fmt::Debug for Api {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let present = SYMBOLS.iter().filter(|s| self.has(s.name)).count();
        write!(f, "Api({present} of {} symbols, absent: {:?})", SYMBOLS.len(), self.absent())
    }
}

static INSTALLED: OnceLock<Api> = OnceLock::new();

/// Make `api` the process's table, unless one is installed already; returns the one in force.
/// A table lacking required symbols is refused, naming every one and its release.
pub fn install(api: Api) -> Result<&'static Api, LoadError> {
    api.check()?;
    Ok(INSTALLED.get_or_init(|| api))
}

/// The table in force, if any.
pub fn installed() -> Option<&'static Api> {
    INSTALLED.get()
}

/// The toolkit directories CANN's `set_env.sh` names, in the order they are trusted, then the
/// default install location.
const TOOLKIT_VARS: [&str; 3] =
    ["ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH", "ASCEND_CANN_PACKAGE_PATH"];
/// Where CANN installs without set_env.sh's variables: from 8.5 on, then before.
const DEFAULT_TOOLKITS: [&str; 2] =
    ["/usr/local/Ascend/cann", "/usr/local/Ascend/ascend-toolkit/latest"];

/// Where a library file name is looked for: the bare name first (the loader's search path,
/// which `set_env.sh` sets), then `lib64` of each toolkit directory.
fn locations(file: &str) -> Vec<PathBuf> {
    let mut roots: Vec<PathBuf> =
        TOOLKIT_VARS.iter().filter_map(std::env::var_os).map(PathBuf::from).collect();
    roots.extend(DEFAULT_TOOLKITS.iter().map(PathBuf::from));
    let arch = format!("{}-linux", std::env::consts::ARCH);
    let mut all = vec![PathBuf::from(file)];
    for root in roots {
        all.push(root.join("lib64").join(file));
        all.push(root.join(&arch).join("lib64").join(file));
    }
    all
}

/// The libraries opened, by kind (kept for the life of the process: the table points into them).
struct Opened {
    libs: Vec<(Library, libloading::Library)>,
}

impl Opened {
    fn open() -> Result<Self, LoadError> {
        let mut libs = Vec::new();
        for kind in Library::ALL {
            let mut tried = Vec::new();
            let before = libs.len();
            for file in kind.candidates() {
                for path in locations(file) {
                    tried.push(path.display().to_string());
                    // SAFETY: opening a CANN library runs its initialisers, which CANN supports
                    // (torch_npu opens the same libraries this way).
                    if let Ok(lib) = unsafe { libloading::Library::new(&path) } {
                        libs.push((kind, lib));
                        break;
                    }
                }
            }
            if libs.len() == before {
                return Err(LoadError::MissingLibrary {
                    library: kind.candidates().join(" or "),
                    tried: tried.join(", "),
                });
            }
        }
        Ok(Opened { libs })
    }

    /// `name` (NUL-terminated) from the first library of `kind` that exports it.
    fn get<T: Copy>(&self, kind: Library, name: &str) -> Option<T> {
        self.libs.iter().filter(|(k, _)| *k == kind).find_map(|(_, lib)| {
            // SAFETY: `T` is the symbol's C prototype as the list declares it; the library stays
            // open for the life of the process (`Opened` is never dropped once installed).
            unsafe { lib.get::<T>(name.as_bytes()) }.ok().map(|s| *s)
        })
    }
}

static OPENED: OnceLock<Result<Opened, LoadError>> = OnceLock::new();

/// Open CANN's libraries, resolve the list and install the table (once per process; a table
/// installed earlier, e.g. the emulator's, is returned as is).
pub fn load() -> Result<&'static Api, LoadError> {
    if let Some(api) = installed() {
        return Ok(api);
    }
    let opened = OPENED.get_or_init(Opened::open).as_ref().map_err(Clone::clone)?;
    install(Api::resolve(opened))
}

/// `aclCANNPackageVersion` (hicann/runtime `include/external/acl/acl_rt.h`).
#[repr(C)]
struct CannPackageVersion {
    version: [c_char; 128],
    major: [c_char; 64],
    minor: [c_char; 64],
    release: [c_char; 64],
    patch: [c_char; 64],
    reserved: [c_char; 128],
}

/// `aclsysGetCANNVersion`'s prototype. Not in the table: it is only read here, once, and an
/// installation before 8.2 lacks it (the install records below cover those).
type GetCannVersion = unsafe extern "C" fn(c_int, *mut CannPackageVersion) -> c_int;
/// `aclCANNPackageName`: `ACL_PKG_NAME_OPP` (the operator package, which holds the vendor
/// ops) and `ACL_PKG_NAME_CANN`.
const PKG_OPP: c_int = 5;
const PKG_CANN: c_int = 0;

/// The installed CANN release and where it was read: `aclsysGetCANNVersion` of the opened
/// runtime (the operator package's version first), else the install records CANN writes
/// (`<arch>-linux/ascend_ops_install.info`, then `ascend_toolkit_install.info`, their
/// `version=` line) under the toolkit that set_env.sh names or the default install path.
/// `None` when neither says.
pub fn installed_release() -> Option<(Release, String)> {
    if let Some(Ok(opened)) = OPENED.get()
        && let Some(query) =
            opened.get::<GetCannVersion>(Library::Runtime, "aclsysGetCANNVersion\0")
    {
        for (pkg, name) in [(PKG_OPP, "opp"), (PKG_CANN, "CANN")] {
            // SAFETY: zeroed plain C chars are a valid struct.
            let mut v: CannPackageVersion = unsafe { std::mem::zeroed() };
            // SAFETY: the runtime's own prototype (acl_rt.h), a valid out-parameter.
            if unsafe { query(pkg, &mut v) } == ACL_SUCCESS {
                let bytes: Vec<u8> =
                    v.version.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
                let text = String::from_utf8_lossy(&bytes).into_owned();
                if let Some(r) = Release::parse(&text) {
                    return Some((r, format!("aclsysGetCANNVersion({name}) = {text}")));
                }
            }
        }
    }
    let mut roots: Vec<PathBuf> =
        TOOLKIT_VARS.iter().filter_map(std::env::var_os).map(PathBuf::from).collect();
    roots.extend(DEFAULT_TOOLKITS.iter().map(PathBuf::from));
    let arch = format!("{}-linux", std::env::consts::ARCH);
    for root in roots.iter().filter(|r| r.is_dir()) {
        for record in ["ascend_ops_install.info", "ascend_toolkit_install.info"] {
            let path = root.join(&arch).join(record);
            let Ok(text) = std::fs::read_to_string(&path) else { continue };
            let version = text.lines().find_map(|l| l.trim().strip_prefix("version="));
            if let Some(r) = version.and_then(Release::parse) {
                return Some((r, format!("{} version={}", path.display(), version.unwrap_or(""))));
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_list_names_each_symbol_once_and_marks_the_mx_ops_optional() {
        let mut names: Vec<&str> = SYMBOLS.iter().map(|s| s.name).collect();
        names.sort_unstable();
        let before = names.len();
        names.dedup();
        assert_eq!(names.len(), before, "a symbol is listed twice");
        for mx in MX_SYMBOLS {
            let s = SYMBOLS.iter().find(|s| s.name == mx);
            assert_eq!(s.map(|s| s.required), Some(false), "{mx}");
        }
        let empty = Api::default();
        assert_eq!(empty.absent().len(), SYMBOLS.iter().filter(|s| !s.required).count());
        assert!(empty.missing_required().contains(&"aclrtLaunchKernelWithHostArgs"));
    }

    #[test]
    fn an_incomplete_table_is_refused_naming_every_symbol_and_its_release() {
        let Err(LoadError::MissingSymbols { missing }) = install(Api::default()) else {
            panic!("an empty table was installed");
        };
        let required = SYMBOLS.iter().filter(|s| s.required).count();
        assert_eq!(missing.len(), required);
        let host_args = missing.iter().find(|m| m.symbol == "aclrtLaunchKernelWithHostArgs");
        assert_eq!(host_args.map(|m| m.since), Some(Release::new(8, 5)));
        let text = LoadError::MissingSymbols { missing }.to_string();
        assert!(text.contains("`aclInit` (in libascendcl.so or libacl_rt.so; CANN 8.0 and later)"));
        assert!(text.ends_with("install CANN 8.5 or later"), "{text}");
    }

    #[test]
    fn releases_parse_from_cann_version_strings() {
        assert_eq!(Release::parse("8.5.0"), Some(Release::new(8, 5)));
        assert_eq!(Release::parse("8.0.RC3"), Some(Release::new(8, 0)));
        assert_eq!(Release::parse("9.0.0-beta.1"), Some(Release::new(9, 0)));
        assert_eq!(Release::parse("8.3.RC1.alpha002"), Some(Release::new(8, 3)));
        assert_eq!(Release::parse("unknown"), None);
        assert!(Release::new(8, 5) < Release::new(9, 0));
        for (symbol, _) in SINCE {
            assert!(SYMBOLS.iter().any(|s| s.name == *symbol), "{symbol} is not in the list");
        }
    }

    #[test]
    fn locations_try_the_loader_path_then_each_toolkit() {
        let all = locations("libascendcl.so");
        assert_eq!(all[0], PathBuf::from("libascendcl.so"));
        assert_eq!(
            all.last().map(|p| p.display().to_string()),
            Some(format!(
                "{}/{}-linux/lib64/libascendcl.so",
                DEFAULT_TOOLKITS[1],
                std::env::consts::ARCH
            ))
        );
    }
}
