//! Stream hazards: two accesses to the same bytes from different streams, at least one a write
//! (or a free), that no chain of stream order, events and host synchronisation orders.

use std::fmt;
use std::ops::Range;

use crate::resource::BufferId;
use crate::sanitize::log::OpRef;

/// What kind of conflict a [`Hazard`] is; "first" is the earlier call in host order.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum HazardKind {
    /// The second op reads bytes the first writes.
    ReadAfterWrite,
    /// The second op writes bytes the first reads.
    WriteAfterRead,
    /// Both write.
    WriteAfterWrite,
    /// The buffer is freed (or handed back for reuse) while another stream may still use it:
    /// the `record_stream` contract.
    FreeWhileInUse,
    /// An op uses a buffer after it was freed.
    UseAfterFree,
    /// Two matrix ops (GEMMs) on different streams with no order between them, on a backend
    /// whose streams share one set of matrix units (checked only when
    /// [`ExclusiveUnits::matrix`](crate::sanitize::ExclusiveUnits) is on).
    MatrixOverlap,
    /// Two vector ops on different streams with no order between them, on a backend whose
    /// streams share the vector units (checked only when
    /// [`ExclusiveUnits::vector`](crate::sanitize::ExclusiveUnits) is on).
    VectorOverlap,
}

impl HazardKind {
    fn describe(self) -> &'static str {
        match self {
            HazardKind::ReadAfterWrite => "read-after-write",
            HazardKind::WriteAfterRead => "write-after-read",
            HazardKind::WriteAfterWrite => "write-after-write",
            HazardKind::FreeWhileInUse => "free while in use",
            HazardKind::UseAfterFree => "use after free",
            HazardKind::MatrixOverlap => "matrix units shared",
            HazardKind::VectorOverlap => "vector units shared",
        }
    }
}

/// One side of a hazard: the op, the parameter and the buffer it touched.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct HazardSide {
    pub op: OpRef,
    pub param: &'static str,
    pub buffer: BufferId,
    pub writes: bool,
}

/// A stream hazard, with both ops, both streams, the buffer and the conflicting bytes. For the
/// exclusive-unit kinds the sides name each op's first output and `bytes` is empty.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Hazard {
    pub kind: HazardKind,
    pub first: HazardSide,
    pub second: HazardSide,
    /// The first conflicting bytes (of the memory both buffers share).
    pub bytes: Range<usize>,
}

impl fmt::Display for HazardSide {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let verb = if self.writes { "writes" } else { "reads" };
        write!(f, "{} {verb} `{}` ({})", self.op, self.param, self.buffer)
    }
}

impl fmt::Display for Hazard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Range { start, end } = self.bytes;
        if let HazardKind::MatrixOverlap | HazardKind::VectorOverlap = self.kind {
            return write!(
                f,
                "stream hazard ({}): {} and {} may run at the same time on units this backend's \
                 streams share; order them with an event",
                self.kind.describe(),
                self.first.op,
                self.second.op
            );
        }
        write!(f, "stream hazard ({}) on bytes {start}..{end}: ", self.kind.describe())?;
        match self.kind {
            HazardKind::UseAfterFree => {
                write!(f, "{} after {} freed it", self.second, self.first.op)
            }
            HazardKind::FreeWhileInUse => write!(
                f,
                "{} frees the buffer while {} may still be running; order the use before the free",
                self.second.op, self.first
            ),
            HazardKind::MatrixOverlap | HazardKind::VectorOverlap => Ok(()),
            _ => write!(
                f,
                "{} and {} with no event ordering them; make stream {} wait on an event recorded \
                 after the first",
                self.first, self.second, self.second.op.stream
            ),
        }
    }
}

impl std::error::Error for Hazard {}
