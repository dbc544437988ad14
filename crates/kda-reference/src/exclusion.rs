//! What keeps the reference backend memory-safe when a caller breaks the stream contract.
//!
//! Two ops on different streams that touch the same bytes, one of them writing, must be ordered
//! by the caller (`docs/design/architecture.md#what-the-caller-must-order`). Checked mode rejects
//! an unordered pair; with checked mode off it would run, and on host memory two worker threads
//! writing the same bytes at once is a data race, which Rust makes undefined behaviour. So every
//! op holds its operands' byte spans while it runs: an op whose spans conflict with a running
//! op's (same buffer, overlapping bytes, one of them writing) waits until that op is done. An
//! ordering bug then gives a result of some order, never undefined behaviour. A correctly ordered
//! program never waits here: ordered ops never run at the same time.
//!
//! An op takes all its spans at once or none (no hold-and-wait), so ops cannot deadlock on each
//! other through this table.

use std::ops::Range;
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};

use kda_core::{BufferHandle, BufferId, Op};

use crate::ReferenceBackend;

/// One operand span held by a running op.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Span {
    buffer: BufferId,
    bytes: Range<usize>,
    write: bool,
}

impl Span {
    fn conflicts(&self, other: &Span) -> bool {
        self.buffer == other.buffer
            && (self.write || other.write)
            && self.bytes.start < other.bytes.end
            && other.bytes.start < self.bytes.end
    }
}

/// The spans of the ops running on one backend instance's streams.
#[derive(Debug, Default)]
pub(crate) struct Exclusion {
    held: Mutex<Vec<(u64, Span)>>,
    released: Condvar,
    next: Mutex<u64>,
}

/// The spans one op holds until dropped.
pub(crate) struct Held<'a> {
    table: &'a Exclusion,
    ticket: u64,
}

impl Exclusion {
    fn lock(&self) -> MutexGuard<'_, Vec<(u64, Span)>> {
        self.held.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Wait until no running op conflicts with `op`'s operands, then hold them.
    pub(crate) fn acquire(&self, op: &Op<ReferenceBackend>) -> Held<'_> {
        let span = |write: bool| {
            move |(_, t): (&'static str, &kda_core::Tensor<ReferenceBackend>)| Span {
                buffer: t.buffer().id(),
                bytes: t.byte_span(),
                write,
            }
        };
        let mine: Vec<Span> = op
            .inputs()
            .into_iter()
            .map(span(false))
            .chain(op.outputs().into_iter().map(span(true)))
            .filter(|s| !s.bytes.is_empty())
            .collect();
        let ticket = {
            let mut next = self.next.lock().unwrap_or_else(PoisonError::into_inner);
            *next += 1;
            *next
        };
        if mine.is_empty() {
            return Held { table: self, ticket };
        }
        let mut held = self.lock();
        while held.iter().any(|(_, h)| mine.iter().any(|m| m.conflicts(h))) {
            held = self.released.wait(held).unwrap_or_else(PoisonError::into_inner);
        }
        held.extend(mine.into_iter().map(|s| (ticket, s)));
        Held { table: self, ticket }
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        let mut held = self.table.lock();
        let before = held.len();
        held.retain(|(t, _)| *t != self.ticket);
        if held.len() != before {
            self.table.released.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "test setup")]

    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    use kda_core::DType;

    use super::*;

    #[test]
    fn spans_conflict_only_on_shared_bytes_with_a_writer() {
        let buffer = BufferId { instance: kda_core::InstanceId::fresh(), index: 0 };
        let other = BufferId { index: 1, ..buffer };
        let s = |buffer, bytes: Range<usize>, write| Span { buffer, bytes, write };
        assert!(s(buffer, 0..8, true).conflicts(&s(buffer, 4..12, false)));
        assert!(!s(buffer, 0..8, false).conflicts(&s(buffer, 4..12, false)), "two readers");
        assert!(!s(buffer, 0..8, true).conflicts(&s(buffer, 8..12, true)), "adjacent bytes");
        assert!(!s(buffer, 0..8, true).conflicts(&s(other, 0..8, true)), "another buffer");
    }

    /// A writer waits for a running op that reads its bytes, and starts once it is released.
    #[test]
    fn a_conflicting_op_waits_for_the_running_one() {
        let b = crate::ReferenceBackend::new();
        let t = b.alloc(DType::F32, &[16]).unwrap();
        let table = Arc::new(Exclusion::default());
        let read = Op::Copy { src: t.clone(), dst: b.alloc(DType::F32, &[16]).unwrap() };
        let write = Op::Fill { dst: t.narrow(0, 8, 8).unwrap(), value: 1.0 };
        let elsewhere = Op::Fill { dst: b.alloc(DType::F32, &[16]).unwrap(), value: 1.0 };
        let first = table.acquire(&read);
        let _free = table.acquire(&elsewhere);
        let started = Arc::new(AtomicBool::new(false));
        let worker = {
            let (table, started) = (Arc::clone(&table), Arc::clone(&started));
            std::thread::spawn(move || {
                let _held = table.acquire(&write);
                started.store(true, Ordering::SeqCst);
            })
        };
        std::thread::sleep(Duration::from_millis(50));
        assert!(!started.load(Ordering::SeqCst), "the writer runs while the reader holds");
        drop(first);
        worker.join().unwrap();
        assert!(started.load(Ordering::SeqCst));
    }
}
