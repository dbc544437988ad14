//! The AscendC twin: kda's kernels (`crates/kda-ascend/kernels/*.cpp`, unchanged) compiled by
//! the host C++ compiler against a strict implementation of the AscendC API subset they use
//! (`crates/kda-ascend/twin/`), and run block by block on the launch's GM memory. A kernel that
//! breaks one of the device's rules (alignment, UB size, queue pairing, pipe synchronisation,
//! two blocks writing one GM range, …) fails with a [`TwinError::Violation`] naming the kernel,
//! the block, the API and the rule; the twin's headers cite where each rule is documented.
//!
//! The kernels are built into this crate (`build.rs`); [`Library::build`] compiles other
//! sources (a test's broken kernel, a planted defect) into a shared library the same way, and
//! the emulated runtime runs a binary that is such a library with its own kernels.

use std::ffi::{CStr, CString, c_char, c_void};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The device architecture the twin runs a kernel as: it decides UB size limits, the 950's
/// stride ranges and ReduceSum's addition order.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Arch {
    /// Atlas A2 / A3 (Ascend 910B, 910_93): `dav-2201`.
    Dav2201,
    /// Ascend 950: `dav-3510`.
    Dav3510,
}

/// What a launch runs on: the architecture and the unified buffer's size.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Profile {
    pub arch: Arch,
    pub ub_bytes: u32,
}

impl Profile {
    /// The profile of a SoC name (`aclrtGetSocName`): UB sizes from CANN's platform files
    /// (hicann/runtime `src/platform/platform_config/cann/Ascend910B*.ini`, `Ascend910_93*.ini`,
    /// `cann-dev/Ascend950*.ini`: `[AICoreSpec] ub_size`).
    pub fn of_soc(soc: &str) -> Profile {
        if soc.starts_with("Ascend950") {
            Profile { arch: Arch::Dav3510, ub_bytes: 253_952 }
        } else {
            Profile { arch: Arch::Dav2201, ub_bytes: 196_608 }
        }
    }
}

/// One GM buffer a launch may touch: `len` bytes from device (host) address `base`.
#[repr(C)]
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct GmRange {
    pub base: u64,
    pub len: u64,
}

/// Why the twin did not run a kernel to completion.
#[derive(Debug, thiserror::Error)]
pub enum TwinError {
    /// The kernel broke a device rule.
    #[error("{kernel} (block {block}): {api}: {rule}: {detail}")]
    Violation { kernel: String, block: u32, api: String, rule: String, detail: String },
    /// The launch itself was malformed (no blocks, a bad UB size).
    #[error("{kernel}: the twin cannot run this launch: {detail}")]
    Launch { kernel: String, detail: String },
    /// No kernel of that name in the code.
    #[error("no twin kernel `{0}`")]
    NoKernel(String),
    /// The host compiler failed on a library's sources.
    #[error("building the twin library {path}: {message}")]
    Build { path: PathBuf, message: String },
    /// A shared library could not be opened or lacks the twin's launch function.
    #[error("loading the twin library {path}: {source}")]
    Load { path: PathBuf, source: libloading::Error },
}

#[repr(C)]
struct CLaunch {
    kernel: *const c_char,
    entry: *const c_void,
    nargs: u32,
    block_num: u32,
    args: *const u64,
    ub_bytes: u32,
    arch: u32,
    gm: *const GmRange,
    gm_count: u32,
}

#[repr(C)]
struct CError {
    block: u32,
    api: [c_char; 64],
    rule: [c_char; 160],
    detail: [c_char; 1024],
}

type LaunchFn = unsafe extern "C" fn(*const CLaunch, *mut CError) -> i32;

unsafe extern "C" {
    fn kda_twin_launch(launch: *const CLaunch, err: *mut CError) -> i32;
    // The kernels built into this crate: their parameters are GM pointers, which the launch
    // passes by arity (the entry's address is all Rust uses).
    fn kda_sigmoid_f32();
    fn kda_gate();
    fn kda_zero_padding();
    fn kda_conv_update();
    fn kda_recurrent_step();
    fn kda_conv_prefill();
    fn kda_l2norm();
    fn kda_gated_rms_norm();
    fn kda_chunk_prefill();
    fn kda_mx_dequant();
}

/// The kernels built into this crate, by name.
fn builtin_entry(name: &str) -> Option<*const c_void> {
    let f: unsafe extern "C" fn() = match name {
        "kda_sigmoid_f32" => kda_sigmoid_f32,
        "kda_gate" => kda_gate,
        "kda_zero_padding" => kda_zero_padding,
        "kda_conv_update" => kda_conv_update,
        "kda_recurrent_step" => kda_recurrent_step,
        "kda_conv_prefill" => kda_conv_prefill,
        "kda_l2norm" => kda_l2norm,
        "kda_gated_rms_norm" => kda_gated_rms_norm,
        "kda_chunk_prefill" => kda_chunk_prefill,
        "kda_mx_dequant" => kda_mx_dequant,
        _ => return None,
    };
    Some(f as *const c_void)
}

/// A twin-compiled kernel entry point, ready to launch.
#[derive(Clone, Debug)]
pub struct Kernel {
    name: CString,
    entry: usize,
    launch: LaunchFn,
    /// The library holding the code, kept loaded while the kernel exists.
    _library: Option<Arc<Library>>,
}

impl Kernel {
    /// A kernel built into this crate.
    pub fn builtin(name: &str) -> Result<Kernel, TwinError> {
        let entry = builtin_entry(name).ok_or_else(|| TwinError::NoKernel(name.to_string()))?;
        Ok(Kernel {
            name: CString::new(name).map_err(|_| TwinError::NoKernel(name.to_string()))?,
            entry: entry as usize,
            launch: kda_twin_launch,
            _library: None,
        })
    }

    pub fn name(&self) -> &str {
        self.name.to_str().unwrap_or("?")
    }

    /// Run every block (`GetBlockIdx` 0 .. `blocks`) of the kernel with its pointer parameters
    /// `args` (GM addresses, the last one the meta region for kda's kernels), allowing GM
    /// accesses inside `gm` only.
    ///
    /// # Safety
    /// Every range of `gm` is live memory this call may read and write, nothing else accesses
    /// it meanwhile, and `args` are what the kernel's parameters mean (pointers into `gm`, or
    /// to host memory the kernel reads by plain dereference, as kda's meta region).
    pub unsafe fn launch(
        &self,
        profile: Profile,
        blocks: u32,
        args: &[u64],
        gm: &[GmRange],
    ) -> Result<(), TwinError> {
        let launch = CLaunch {
            kernel: self.name.as_ptr(),
            entry: self.entry as *const c_void,
            nargs: u32::try_from(args.len()).unwrap_or(u32::MAX),
            block_num: blocks,
            args: args.as_ptr(),
            ub_bytes: profile.ub_bytes,
            arch: match profile.arch {
                Arch::Dav2201 => 0,
                Arch::Dav3510 => 1,
            },
            gm: gm.as_ptr(),
            gm_count: u32::try_from(gm.len()).unwrap_or(u32::MAX),
        };
        let mut err = CError { block: 0, api: [0; 64], rule: [0; 160], detail: [0; 1024] };
        // SAFETY: `launch` points to valid arrays for the call's duration; the kernel's memory
        // accesses are the caller's contract; `err` is a writable struct of the C layout.
        let code = unsafe { (self.launch)(&launch, &mut err) };
        let text = |s: &[c_char]| {
            // SAFETY: the runtime NUL-terminates every field it fills, and the zeroed default
            // is an empty string.
            unsafe { CStr::from_ptr(s.as_ptr()) }.to_string_lossy().into_owned()
        };
        match code {
            0 => Ok(()),
            1 => Err(TwinError::Violation {
                kernel: self.name().to_string(),
                block: err.block,
                api: text(&err.api),
                rule: text(&err.rule),
                detail: text(&err.detail),
            }),
            _ => Err(TwinError::Launch {
                kernel: self.name().to_string(),
                detail: format!("{}: {}", text(&err.rule), text(&err.detail)),
            }),
        }
    }
}

/// The twin's sources: its headers and runtime, and kda's kernels.
pub fn twin_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../twin")
}

/// kda's AscendC kernel sources (`crates/kda-ascend/kernels`).
pub fn kernels_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../kernels")
}

/// A shared library of twin-compiled kernels (its own copy of the twin runtime, every symbol
/// hidden except the kernels and `kda_twin_launch`).
#[derive(Debug)]
pub struct Library {
    library: libloading::Library,
    launch: LaunchFn,
    path: PathBuf,
}

impl Library {
    /// Compile `sources` (kernel `.cpp` files) with the twin into the shared library `out`
    /// and open it. `include` adds header directories (kda's kernel directory is always on the
    /// path). The compiler is `$CXX`, else `c++`.
    pub fn build(
        sources: &[PathBuf],
        include: &[PathBuf],
        out: &Path,
    ) -> Result<Library, TwinError> {
        let fail = |message: String| TwinError::Build { path: out.to_path_buf(), message };
        let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".to_string());
        let twin = twin_dir();
        let mut cmd = std::process::Command::new(&cxx);
        cmd.args([
            "-std=c++17",
            "-O1",
            "-fPIC",
            "-shared",
            "-fvisibility=hidden",
            "-Wl,-Bsymbolic",
        ])
        .arg("-I")
        .arg(twin.join("include"));
        for dir in include {
            cmd.arg("-I").arg(dir);
        }
        cmd.arg("-I")
            .arg(kernels_dir())
            .arg(twin.join("src/runtime.cpp"))
            .args(sources)
            .arg("-o")
            .arg(out);
        let output = cmd.output().map_err(|e| fail(format!("running {cxx}: {e}")))?;
        if !output.status.success() {
            return Err(fail(String::from_utf8_lossy(&output.stderr).into_owned()));
        }
        Library::open(out)
    }

    /// Open a library [`Library::build`] wrote.
    pub fn open(path: &Path) -> Result<Library, TwinError> {
        let load = |source| TwinError::Load { path: path.to_path_buf(), source };
        // SAFETY: a twin library's initialisers are the C++ runtime's own (no global state of
        // ours runs at load).
        let library = unsafe { libloading::Library::new(path) }.map_err(load)?;
        // SAFETY: `kda_twin_launch` has the C prototype of kda_twin_rt.h, which `LaunchFn` is.
        let launch = unsafe { library.get::<LaunchFn>(b"kda_twin_launch\0") }.map_err(load)?;
        let launch = *launch;
        Ok(Library { library, launch, path: path.to_path_buf() })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The kernel `name` of this library.
    pub fn kernel(self: &Arc<Self>, name: &str) -> Result<Kernel, TwinError> {
        let c = CString::new(name).map_err(|_| TwinError::NoKernel(name.to_string()))?;
        // SAFETY: the symbol is only used as an address, called through the twin's launch with
        // the arity its caller gives.
        let entry = unsafe { self.library.get::<unsafe extern "C" fn()>(c.as_bytes_with_nul()) }
            .map_err(|_| TwinError::NoKernel(name.to_string()))?;
        let entry = *entry as usize;
        Ok(Kernel { name: c, entry, launch: self.launch, _library: Some(Arc::clone(self)) })
    }

    /// Whether the library defines `name`.
    pub fn has(self: &Arc<Self>, name: &str) -> bool {
        self.kernel(name).is_ok()
    }
}
