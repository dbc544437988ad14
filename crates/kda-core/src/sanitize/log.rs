//! The recorded log: what the host asked of the device, in the order it asked.
//!
//! A log is plain data. The analysis judges it without looking at timing, so a test can take a
//! recorded log, drop or move a single record or wait, and analyse it again.

use std::fmt;

use crate::resource::{BufferId, ComputeUnit, EventId, StreamId};
use crate::sanitize::ranges::ByteRanges;

/// One buffer access of an op: which parameter, which buffer, which bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Access {
    pub param: &'static str,
    pub buffer: BufferId,
    pub bytes: ByteRanges,
}

/// One recorded host call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Entry {
    /// An op queued on a stream, with the bytes it reads and writes and the execution unit it
    /// occupies ([`Op::unit`](crate::Op::unit), for the exclusive-unit rules).
    Launch {
        stream: StreamId,
        label: String,
        reads: Vec<Access>,
        writes: Vec<Access>,
        unit: Option<ComputeUnit>,
        /// The op's floating-point operations (`2·m·n·k` for a GEMM, 0 for every other op), for
        /// the planner's cost model (docs/design/planner.md#the-model).
        flops: u64,
    },
    /// `record(event, stream)`.
    Record { stream: StreamId, event: EventId },
    /// `wait(stream, event)`.
    Wait { stream: StreamId, event: EventId },
    /// The host blocked until `stream` finished its queued work.
    Synchronize { stream: StreamId },
    /// A buffer of `bytes` bytes came into use.
    Alloc { buffer: BufferId, bytes: usize },
    /// The buffer's memory was released in the order of `stream` (later work on that stream may
    /// reuse it); every use by another stream must be ordered before this point.
    Free { stream: StreamId, buffer: BufferId },
    /// `buffer` was handed out on the memory of `previous`, which had been freed.
    Reuse { buffer: BufferId, previous: BufferId },
}

impl Entry {
    /// The stream the entry is ordered on, if any.
    pub fn stream(&self) -> Option<StreamId> {
        match self {
            Entry::Launch { stream, .. }
            | Entry::Record { stream, .. }
            | Entry::Wait { stream, .. }
            | Entry::Synchronize { stream }
            | Entry::Free { stream, .. } => Some(*stream),
            Entry::Alloc { .. } | Entry::Reuse { .. } => None,
        }
    }
}

/// An op (or a free) as named in diagnostics: its position in the log, label and stream.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct OpRef {
    pub index: usize,
    pub label: String,
    pub stream: StreamId,
}

impl fmt::Display for OpRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "`{}` (#{} on stream {})", self.label, self.index, self.stream)
    }
}
