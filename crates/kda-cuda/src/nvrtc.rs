//! NVRTC: a kernel program compiled with the crate's options, to CUBIN for a real architecture
//! (`sm_90`: what the backend loads, so no PTX JIT and no dependence on the driver knowing the
//! NVRTC's PTX version) or to PTX for a virtual one (`compute_90`: to list its entries).

use std::ffi::{CString, c_char};

use cudarc::nvrtc::{result, sys};

use crate::CudaError;
use crate::kernels::{COMPILE_OPTIONS, KernelSource};

/// Whether libnvrtc can be loaded.
pub fn present() -> bool {
    // SAFETY: only tries to open the library; no NVRTC function is called.
    unsafe { sys::is_culib_present() }
}

fn text(chars: &[c_char]) -> String {
    let bytes: Vec<u8> = chars.iter().map(|&c| c as u8).take_while(|&b| b != 0).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Compile `source` for `arch`: CUBIN bytes for `sm_*`, PTX text for `compute_*`. Call only
/// when [`present`] (cudarc panics on a missing library).
pub fn compile(source: &KernelSource, arch: &str) -> Result<Vec<u8>, CudaError> {
    let fail = |log: String| CudaError::KernelCompile { source_name: source.name, log };
    let program = CString::new(source.program()).map_err(|e| fail(e.to_string()))?;
    let name = CString::new(source.name).map_err(|e| fail(e.to_string()))?;
    let prog = result::create_program(&program, Some(&name)).map_err(|e| fail(format!("{e:?}")))?;
    let mut options = vec![format!("--gpu-architecture={arch}")];
    options.extend(COMPILE_OPTIONS.iter().map(|s| s.to_string()));
    // SAFETY: `prog` is a live program; every call below uses it before it is destroyed once,
    // at the end.
    let out = unsafe {
        match result::compile_program(prog, &options) {
            Err(e) => {
                let log = result::get_program_log(prog).map(|l| text(&l)).unwrap_or_default();
                Err(fail(format!("{e:?}: {log}")))
            }
            Ok(()) if arch.starts_with("sm_") => {
                let mut size = 0usize;
                let sized = sys::nvrtcGetCUBINSize(prog, &mut size).result();
                let mut cubin = vec![0u8; size];
                sized
                    .and_then(|()| {
                        sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr() as *mut c_char).result()
                    })
                    .map(|()| cubin)
                    .map_err(|e| fail(format!("nvrtcGetCUBIN: {e:?}")))
            }
            Ok(()) => result::get_ptx(prog)
                .map(|ptx| text(&ptx).into_bytes())
                .map_err(|e| fail(format!("nvrtcGetPTX: {e:?}"))),
        }
    };
    // SAFETY: created above and not used after this.
    let _ = unsafe { result::destroy_program(prog) };
    out
}
