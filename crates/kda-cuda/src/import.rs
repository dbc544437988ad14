//! What an engine hands the CUDA backend, checked before kda uses it
//! (`kda_core::Device::import_buffer` / `import_stream`, `docs/embedding.md`): a `CUdeviceptr`
//! with a byte length, and a `CUstream`.
//!
//! The checks are plain functions of what the driver reports (`cuPointerGetAttribute`,
//! `cuStreamGetCtx`), so the rules are tested without a GPU; the backend feeds them the
//! driver's answers.

use kda_core::Error;
use kda_core::device::retention::Capture;

/// The alignment an imported buffer needs: the widest element kda reads (f32, i32).
pub const IMPORT_ALIGN: u64 = 4;

/// `CUmemorytype` as `cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_MEMORY_TYPE)` reports it.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum MemoryType {
    Host,
    Device,
    Array,
    Unified,
    Other(u32),
}

impl MemoryType {
    pub fn from_raw(value: u32) -> Self {
        match value {
            1 => Self::Host,
            2 => Self::Device,
            3 => Self::Array,
            4 => Self::Unified,
            other => Self::Other(other),
        }
    }
}

/// What the driver says about the allocation holding an imported pointer.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct PointerInfo {
    pub memory: MemoryType,
    /// The device the memory is on.
    pub device_ordinal: i32,
    /// The allocation holding the pointer: its first byte and its size.
    pub range_start: u64,
    pub range_size: u64,
}

fn bad(param: &'static str, expected: String, actual: String) -> Error {
    Error::Param { op: "import_buffer", param, expected, actual }
}

/// The checks that need no driver: a non-null, 4-byte aligned pointer whose `len` bytes do not
/// wrap the address space. A zero-length import of a null pointer is allowed (an empty tensor).
pub fn check_pointer(ptr: u64, len: usize) -> Result<(), Error> {
    if len == 0 && ptr == 0 {
        return Ok(());
    }
    if ptr == 0 {
        let expected = "a CUdeviceptr (not null) for a non-empty buffer".into();
        return Err(bad("ptr", expected, "null".into()));
    }
    if !ptr.is_multiple_of(IMPORT_ALIGN) {
        let expected = format!("a CUdeviceptr aligned to {IMPORT_ALIGN} bytes");
        return Err(bad("ptr", expected, format!("{ptr:#x}")));
    }
    if ptr.checked_add(len as u64).is_none() {
        let expected = format!("at most {} bytes from {ptr:#x}", u64::MAX - ptr);
        return Err(bad("len", expected, len.to_string()));
    }
    Ok(())
}

/// The checks on the driver's answer: device (or managed) memory of device `ordinal`, and
/// `ptr..ptr + len` inside the one allocation that holds `ptr` (kda would otherwise read or
/// write past what the engine allocated).
pub fn check_allocation(
    ptr: u64,
    len: usize,
    info: &PointerInfo,
    ordinal: usize,
) -> Result<(), Error> {
    if !matches!(info.memory, MemoryType::Device | MemoryType::Unified) {
        let expected = "device memory (cuMemAlloc, a memory pool, or managed)".into();
        return Err(bad("ptr", expected, format!("{:?} memory at {ptr:#x}", info.memory)));
    }
    if usize::try_from(info.device_ordinal).ok() != Some(ordinal) {
        let expected = format!("memory of CUDA device {ordinal} (this backend's)");
        let actual = format!("memory of device {} at {ptr:#x}", info.device_ordinal);
        return Err(bad("ptr", expected, actual));
    }
    let end = info.range_start.saturating_add(info.range_size);
    let wanted_end = ptr.saturating_add(len as u64);
    if ptr < info.range_start || wanted_end > end {
        let expected = format!(
            "at most {} bytes: the allocation holding {ptr:#x} spans {:#x}..{end:#x}",
            end.saturating_sub(ptr),
            info.range_start,
        );
        return Err(bad("len", expected, len.to_string()));
    }
    Ok(())
}

/// The check on an imported stream: it belongs to this backend's context (`cuStreamGetCtx`).
/// `0` (the legacy default stream) has no context of its own and is taken as the current
/// context's.
pub fn check_stream_context(handle: usize, stream_ctx: usize, ours: usize) -> Result<(), Error> {
    if handle == 0 || stream_ctx == ours {
        return Ok(());
    }
    Err(Error::Param {
        op: "import_stream",
        param: "handle",
        expected: format!("a CUstream of this backend's context ({ours:#x})"),
        actual: format!("stream {handle:#x} of context {stream_ctx:#x}"),
    })
}

/// How an op submitted on a stream is queued (`docs/cuda.md#engine-streams`).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Route {
    /// As on kda's own streams: the op's handles drop once it is queued.
    Direct,
    /// Through the stream's retention, released in stream order once passed: an engine's
    /// stream, which kda never synchronizes.
    Ordered,
    /// Under a capture someone else made (the engine's, reaching kda's auxiliary stream too):
    /// run with plain scratch and staging, everything it uses pinned for the stream's life.
    Pinned,
    /// Work that needs the host at run time (a download, a host function) under an engine's
    /// capture: the engine's graph would replay it without kda.
    Refused,
}

/// The route of an op on a stream that is an engine's (`imported`) or kda's, while kda replays
/// one of its own graphs into a capture on this thread (`kda_replay`: that graph owns what it
/// uses) or not, under `capture` (`cuStreamIsCapturing`), needing the host (`host_work`) or not.
pub fn route(imported: bool, kda_replay: bool, capture: Capture, host_work: bool) -> Route {
    match (kda_replay, capture.allows_release()) {
        (true, _) => Route::Direct,
        (false, false) if host_work => Route::Refused,
        (false, false) => Route::Pinned,
        (false, true) if imported => Route::Ordered,
        (false, true) => Route::Direct,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn param_of(e: Error) -> (&'static str, String, String) {
        match e {
            Error::Param { op: "import_buffer", param, expected, actual } => {
                (param, expected, actual)
            }
            other => panic!("expected an import_buffer Param error, got {other:?}"),
        }
    }

    #[test]
    fn pointers_are_refused_null_misaligned_or_wrapping() {
        assert_eq!(check_pointer(0x7f00_0000_0000, 1 << 20), Ok(()));
        assert_eq!(check_pointer(0, 0), Ok(()));
        let (param, expected, actual) = param_of(check_pointer(0, 16).unwrap_err());
        assert_eq!((param, actual.as_str()), ("ptr", "null"));
        assert!(expected.contains("not null"), "{expected}");
        let (param, expected, actual) = param_of(check_pointer(0x1002, 16).unwrap_err());
        assert_eq!((param, actual.as_str()), ("ptr", "0x1002"));
        assert!(expected.contains("aligned to 4 bytes"), "{expected}");
        let (param, _, actual) = param_of(check_pointer(u64::MAX - 3, 8).unwrap_err());
        assert_eq!((param, actual.as_str()), ("len", "8"));
    }

    #[test]
    fn allocations_must_be_this_devices_and_hold_every_byte() {
        let info = PointerInfo {
            memory: MemoryType::Device,
            device_ordinal: 0,
            range_start: 0x1000,
            range_size: 0x100,
        };
        // The whole allocation, and a slice of it ending at its end.
        assert_eq!(check_allocation(0x1000, 0x100, &info, 0), Ok(()));
        assert_eq!(check_allocation(0x1080, 0x80, &info, 0), Ok(()));
        // One byte past the end.
        let (param, expected, actual) =
            param_of(check_allocation(0x1080, 0x81, &info, 0).unwrap_err());
        assert_eq!((param, actual.as_str()), ("len", "129"));
        assert!(expected.contains("at most 128 bytes") && expected.contains("0x1000..0x1100"));
        // Another device's memory.
        let (param, expected, actual) =
            param_of(check_allocation(0x1000, 4, &info, 1).unwrap_err());
        assert_eq!(param, "ptr");
        assert!(expected.contains("device 1") && actual.contains("device 0"), "{expected}");
        // Pinned host memory is not device memory, even if the device can map it.
        let host = PointerInfo { memory: MemoryType::from_raw(1), ..info };
        let (param, _, actual) = param_of(check_allocation(0x1000, 4, &host, 0).unwrap_err());
        assert_eq!((param, actual.as_str()), ("ptr", "Host memory at 0x1000"));
        let managed = PointerInfo { memory: MemoryType::from_raw(4), ..info };
        assert_eq!(check_allocation(0x1000, 4, &managed, 0), Ok(()));
    }

    #[test]
    fn ops_are_routed_by_stream_and_capture() {
        use Capture::{Active, Invalidated, None as Idle};
        // kda's own stream, nobody capturing: as always.
        assert_eq!(route(false, false, Idle, false), Route::Direct);
        assert_eq!(route(false, false, Idle, true), Route::Direct);
        // The engine's stream: in stream order, host work included.
        assert_eq!(route(true, false, Idle, false), Route::Ordered);
        assert_eq!(route(true, false, Idle, true), Route::Ordered);
        // Under the engine's capture, on its stream or on kda's forked one (a failed capture
        // is still a capture).
        for (imported, capture) in [(true, Active), (false, Active), (true, Invalidated)] {
            assert_eq!(route(imported, false, capture, false), Route::Pinned);
            assert_eq!(route(imported, false, capture, true), Route::Refused);
        }
        // kda's own graph replayed into a capture: its graph owns what the ops use.
        assert_eq!(route(false, true, Active, false), Route::Direct);
        assert_eq!(route(true, true, Active, true), Route::Direct);
    }

    #[test]
    fn streams_of_another_context_are_refused() {
        assert_eq!(check_stream_context(0x55, 0xa0, 0xa0), Ok(()));
        assert_eq!(check_stream_context(0, 0, 0xa0), Ok(()));
        match check_stream_context(0x55, 0xb0, 0xa0) {
            Err(Error::Param { op: "import_stream", param: "handle", actual, .. }) => {
                assert_eq!(actual, "stream 0x55 of context 0xb0")
            }
            other => panic!("expected a Param error, got {other:?}"),
        }
    }
}
