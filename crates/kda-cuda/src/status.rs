//! A stream's failure record on the device, and the messages it decodes into.
//!
//! Every stream owns one [`StatusRecord`] in device memory. Kernels return at once while its
//! `fid` is non-zero (the HAL's "ops after a failure are skipped"); the one-thread validation
//! kernels write a code and details, then `fid`; host functions report through a mapped
//! mailbox; events carry `fid` to waiting streams. `synchronize` reads the record, turns it into
//! [`kda_core::Error::OpFailed`] (the stream's own failure) or
//! [`kda_core::Error::DependencyFailed`] (one it inherited), and clears it.
//!
//! A failure id says where the failure came from: the origin stream and the failing op for a
//! kernel, or a host-function failure whose message the host keeps.

use kda_core::{Error, StreamId};

/// The `Status` struct of `kernels/common.cuh`.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct StatusRecord {
    pub fid: u32,
    pub code: u32,
    pub detail: [i32; 6],
}

// Codes and parameter ids of `kernels/kda.cu`.
const CODE_RANGE: u32 = 1;
const CODE_SLOT: u32 = 2;
const CODE_ACCEPTED: u32 = 3;
const CODE_LIVE: u32 = 4;
/// `kda_host_wait` gave up on a host function (`kernels/memory.cu`); detail 0: the limit in ms.
pub const CODE_HOST_TIMEOUT: u32 = 5;
const PARAMS: [&str; 3] = ["cu_seqlens", "query_start_loc", "state_slots"];

/// The ops whose kernels check device metadata.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum CheckedOp {
    CausalConv = 1,
    CausalConvUpdate = 2,
    KdaRecurrent = 3,
    KdaChunk = 4,
    ZeroPadding = 5,
}

impl CheckedOp {
    const ALL: [CheckedOp; 5] = [
        CheckedOp::CausalConv,
        CheckedOp::CausalConvUpdate,
        CheckedOp::KdaRecurrent,
        CheckedOp::KdaChunk,
        CheckedOp::ZeroPadding,
    ];

    pub fn name(self) -> &'static str {
        match self {
            CheckedOp::CausalConv => "causal_conv",
            CheckedOp::CausalConvUpdate => "causal_conv_update",
            CheckedOp::KdaRecurrent => "kda_recurrent",
            CheckedOp::KdaChunk => "kda_chunk",
            CheckedOp::ZeroPadding => "zero_padding",
        }
    }
}

/// Host-function failures set the top bit; the rest is the host's key for the message.
const HOST_BIT: u32 = 1 << 31;
/// Streams whose kernel failures a failure id can name (the low 8 bits hold the op).
pub const MAX_STREAMS: u64 = (1 << 23) - 1;

/// Where a failure came from, as its id encodes it.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum FailureId {
    /// A kernel of `op` on the stream with index `stream` found bad metadata.
    Kernel { stream: u64, op: CheckedOp },
    /// A host function failed; the host keeps its stream, name and message under `key`.
    Host { key: u32 },
}

impl FailureId {
    /// The non-zero id a kernel or mailbox carries.
    pub fn encode(self) -> u32 {
        match self {
            FailureId::Kernel { stream, op } => (((stream + 1) as u32) << 8) | op as u32,
            FailureId::Host { key } => HOST_BIT | (key & !HOST_BIT),
        }
    }

    /// The failure an id names; `None` for 0 (healthy) or an id no kernel writes.
    pub fn decode(fid: u32) -> Option<Self> {
        if fid == 0 {
            return None;
        }
        if fid & HOST_BIT != 0 {
            return Some(FailureId::Host { key: fid & !HOST_BIT });
        }
        let op = CheckedOp::ALL.into_iter().find(|op| *op as u32 == fid & 0xFF)?;
        let stream = u64::from(fid >> 8).checked_sub(1)?;
        Some(FailureId::Kernel { stream, op })
    }
}

/// The message of a kernel failure, worded as the reference backend words it.
pub fn kernel_message(record: &StatusRecord) -> String {
    let d = record.detail;
    let param = |i: i32| PARAMS.get(i as usize).copied().unwrap_or("metadata");
    match record.code {
        CODE_RANGE => format!(
            "{}[{}..={}] = {}..{} is not a range within 0..={} (offsets must be non-decreasing)",
            param(d[0]),
            d[1],
            d[1] + 1,
            d[2],
            d[3],
            d[4]
        ),
        CODE_SLOT => {
            let index =
                if d[2] < 0 { format!("[{}]", d[1]) } else { format!("[{}, {}]", d[1], d[2]) };
            format!("{}{index} = {} is out of range for {} state slots", param(d[0]), d[3], d[4])
        }
        CODE_ACCEPTED if d[3] == 0 => {
            format!("num_accepted_tokens[{}] = {} is not within 1..={}", d[0], d[1], d[2])
        }
        CODE_ACCEPTED => format!(
            "num_accepted_tokens[{}] = {} is not within 1..={} (state rows L = {}, W = {})",
            d[0], d[1], d[2], d[4], d[5]
        ),
        CODE_LIVE => {
            format!("num_actual_tokens = {} is not within 0..={} (the rows of x)", d[0], d[1])
        }
        code => format!("unknown failure code {code} (details {d:?})"),
    }
}

/// A failed host function, as the host keeps it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostFailure {
    pub stream: StreamId,
    pub op: String,
    pub message: String,
}

/// The error `synchronize` of `stream` returns for a failure record: `OpFailed` when the
/// failure is the stream's own, `DependencyFailed` when it came through an event. `host` looks
/// up a host failure's key; `stream_id` turns a stream index into this instance's id.
pub fn to_error(
    stream: StreamId,
    record: &StatusRecord,
    host: impl Fn(u32) -> Option<HostFailure>,
    stream_id: impl Fn(u64) -> StreamId,
) -> Error {
    let (origin, op, message) = match FailureId::decode(record.fid) {
        Some(FailureId::Kernel { stream: index, op }) => {
            (stream_id(index), op.name().to_string(), kernel_message(record))
        }
        Some(FailureId::Host { key }) if record.code == CODE_HOST_TIMEOUT => {
            let origin = host(key).map_or(stream, |f| f.stream);
            let message = format!(
                "host function #{key} did not finish within {} ms; its stream stopped waiting \
                 for it (CudaOptions::host_wait_limit)",
                record.detail[0]
            );
            (origin, "host".into(), message)
        }
        Some(FailureId::Host { key }) => match host(key) {
            Some(f) => (f.stream, f.op, f.message),
            None => (stream, "host".into(), format!("host function failure #{key}")),
        },
        None => (stream, "unknown".into(), format!("unrecognised failure id {:#x}", record.fid)),
    };
    if origin == stream {
        Error::OpFailed { op, stream, message }
    } else {
        Error::DependencyFailed { stream, upstream: origin, message }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kda_core::InstanceId;

    #[test]
    fn the_struct_has_the_c_layout() {
        assert_eq!(std::mem::size_of::<StatusRecord>(), 32);
    }

    #[test]
    fn failure_ids_round_trip_and_zero_is_healthy() {
        for op in CheckedOp::ALL {
            for stream in [0, 1, 77, MAX_STREAMS - 1] {
                let id = FailureId::Kernel { stream, op };
                assert_ne!(id.encode(), 0);
                assert_eq!(FailureId::decode(id.encode()), Some(id));
            }
        }
        for key in [0, 5, HOST_BIT - 1] {
            let id = FailureId::Host { key };
            assert_eq!(FailureId::decode(id.encode()), Some(id));
        }
        assert_eq!(FailureId::decode(0), None);
        assert_eq!(FailureId::decode(0x100), None, "op 0 is no op");
    }

    /// The messages match the reference backend's wording (the conformance suite looks for
    /// these substrings on every backend).
    #[test]
    fn kernel_messages_read_as_the_references() {
        let cases: [(u32, [i32; 6], &str); 6] = [
            (
                CODE_RANGE,
                [0, 1, 4, 3, 6, 0],
                "cu_seqlens[1..=2] = 4..3 is not a range within 0..=6 (offsets must be non-decreasing)",
            ),
            (
                CODE_SLOT,
                [2, 1, -1, 2, 2, 0],
                "state_slots[1] = 2 is out of range for 2 state slots",
            ),
            (
                CODE_SLOT,
                [2, 0, 1, 9, 2, 0],
                "state_slots[0, 1] = 9 is out of range for 2 state slots",
            ),
            (CODE_ACCEPTED, [0, 3, 2, 0, 0, 0], "num_accepted_tokens[0] = 3 is not within 1..=2"),
            (
                CODE_ACCEPTED,
                [0, 3, 2, 1, 4, 3],
                "num_accepted_tokens[0] = 3 is not within 1..=2 (state rows L = 4, W = 3)",
            ),
            (
                CODE_LIVE,
                [9, 8, 0, 0, 0, 0],
                "num_actual_tokens = 9 is not within 0..=8 (the rows of x)",
            ),
        ];
        for (code, detail, want) in cases {
            assert_eq!(kernel_message(&StatusRecord { fid: 1, code, detail }), want);
        }
    }

    #[test]
    fn own_failures_are_op_failed_and_inherited_ones_dependency_failed() {
        let instance = InstanceId::fresh();
        let id = |index| StreamId { instance, index };
        let kernel = FailureId::Kernel { stream: 0, op: CheckedOp::KdaChunk }.encode();
        let record = StatusRecord { fid: kernel, code: CODE_LIVE, detail: [1, 0, 0, 0, 0, 0] };
        match to_error(id(0), &record, |_| None, id) {
            Error::OpFailed { op, stream, .. } => {
                assert_eq!((op.as_str(), stream), ("kda_chunk", id(0)))
            }
            other => panic!("{other:?}"),
        }
        match to_error(id(1), &record, |_| None, id) {
            Error::DependencyFailed { stream, upstream, .. } => {
                assert_eq!((stream, upstream), (id(1), id(0)))
            }
            other => panic!("{other:?}"),
        }
        let host = FailureId::Host { key: 3 }.encode();
        let failure =
            HostFailure { stream: id(2), op: "failing_host_fn".into(), message: "boom".into() };
        let lookup = |key| (key == 3).then(|| failure.clone());
        let record = StatusRecord { fid: host, ..StatusRecord::default() };
        match to_error(id(2), &record, lookup, id) {
            Error::OpFailed { op, message, .. } => {
                assert_eq!((op.as_str(), message.as_str()), ("failing_host_fn", "boom"))
            }
            other => panic!("{other:?}"),
        }
        let timeout = StatusRecord {
            fid: FailureId::Host { key: 9 }.encode(),
            code: CODE_HOST_TIMEOUT,
            detail: [60_000, 0, 0, 0, 0, 0],
        };
        match to_error(id(2), &timeout, |_| None, id) {
            Error::OpFailed { op, message, .. } => {
                assert_eq!(op, "host");
                assert!(message.contains("#9 did not finish within 60000 ms"), "{message}");
            }
            other => panic!("{other:?}"),
        }
        match to_error(id(4), &record, lookup, id) {
            Error::DependencyFailed { upstream, message, .. } => {
                assert_eq!((upstream, message.as_str()), (id(2), "boom"))
            }
            other => panic!("{other:?}"),
        }
    }
}
