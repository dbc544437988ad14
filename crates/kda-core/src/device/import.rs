//! What an engine owns, taken as it is: its memory as buffers, its stream as a stream
//! (`docs/embedding.md`).

use std::any::Any;

use crate::error::Result;
use crate::hal::Backend;
use crate::resource::BufferHandle;

use super::Device;

impl<B: Backend> Device<B> {
    /// Wrap `len` bytes of memory the caller allocated at `ptr` as a buffer of this instance,
    /// without a copy: host memory on the reference backend, a `CUdeviceptr` on CUDA, an ACL
    /// device pointer on Ascend. kda never frees the memory; it drops `owner` (the engine's
    /// tensor, or anything that keeps the memory alive) once the last handle to the buffer is
    /// gone, including the handles queued ops hold until they have run. A backend that cannot
    /// import memory returns [`Error::Unsupported`](crate::Error::Unsupported).
    ///
    /// # Safety
    /// The caller owes, for as long as `owner` is alive:
    /// - `ptr` points to `len` bytes of memory of this backend's kind and device, valid for
    ///   reads and writes, aligned to 4 bytes (the widest kda element);
    /// - the memory stays allocated (it is released only by dropping `owner`, or after it);
    /// - nothing outside kda touches those bytes while kda work on them may be running, unless
    ///   ordered against it: before a launch, the engine's writes are complete or ordered
    ///   before the launch on the same stream; after it, the engine reads or writes only once
    ///   the stream has reached that point (a synchronize, an event, or later work on the
    ///   same stream). Checked mode sees only kda's own work, not the engine's.
    pub unsafe fn import_buffer(
        &self,
        ptr: *mut u8,
        len: usize,
        owner: Box<dyn Any + Send + Sync>,
    ) -> Result<B::Buffer> {
        // SAFETY: the caller's contract above is the backend's.
        let buffer = unsafe { self.raw().import_buffer(ptr, len, owner) }?;
        if self.instrumentation().is_checked() {
            self.instrumentation().alloc(buffer.id(), len);
        }
        Ok(buffer)
    }

    /// Use a stream the caller created (an engine's `CUstream` or `aclrtStream`, as an integer)
    /// as a stream of this instance: kda queues its work on it, forks its auxiliary streams
    /// from it by an event and joins them back before a call returns, so the engine's ordering
    /// and its graph capture of that stream see kda's work as their own. kda never destroys the
    /// stream. Backends without foreign streams (the reference: there, the engine's stream is
    /// the calling thread) return [`Error::Unsupported`](crate::Error::Unsupported).
    ///
    /// # Safety
    /// `handle` is a live stream of this backend's device and context, and stays alive as long
    /// as any handle kda returned for it (or work queued on it) does.
    pub unsafe fn import_stream(&self, handle: usize) -> Result<B::Stream> {
        // SAFETY: the caller's contract above is the backend's.
        unsafe { self.raw().import_stream(handle) }
    }
}

pub mod retention {
    //! Stream-ordered release on streams kda never synchronizes (an engine's), for a device
    //! backend's bookkeeping (`docs/embedding.md#streams-the-engines-on-a-device`).
    //!
    //! On its own streams a backend may drop what queued work uses whenever it synchronizes. On an
    //! engine's stream that never happens, and while the engine captures the stream into a device
    //! graph nothing may be freed, synchronized or queried (each would invalidate the engine's
    //! capture), and what the captured work addresses must outlive every replay of the engine's
    //! graph, which kda cannot see. So such a stream keeps a [`Retention`] of what its queued work
    //! uses (the ops' buffers, scratch, staging, descriptors):
    //!
    //! - outside a capture, the handles of the work queued since the last mark form the *open*
    //!   batch; the next call on the stream closes it behind an event recorded there (a *mark*) and
    //!   releases, oldest first, every batch whose mark the stream has passed: nothing is dropped
    //!   while the device may still use it, and nothing waits;
    //! - inside a capture, nothing is marked, queried or released: what the captured work uses is
    //!   *pinned* for the life of the retention (the stream handle), as the engine's graph may
    //!   replay it at any time.
    //!
    //! Plain logic over any marker (an event on a device, a flag in the tests).

    use std::collections::VecDeque;

    /// Whether a stream is being captured into a device graph (`cuStreamIsCapturing`,
    /// `aclmdlRICaptureGetInfo`).
    #[derive(Copy, Clone, Debug, PartialEq, Eq)]
    pub enum Capture {
        None,
        Active,
        /// A capture that failed and has not been ended yet: still a capture for the driver's
        /// rules.
        Invalidated,
    }

    impl Capture {
        /// Whether marking, querying and releasing are allowed on the stream.
        pub fn allows_release(self) -> bool {
            self == Self::None
        }
    }

    /// What a stream's queued work holds, released in stream order or pinned by a capture.
    #[derive(Debug)]
    pub struct Retention<M, T> {
        /// Held by work queued since the last mark.
        open: Vec<T>,
        /// Closed batches, oldest first, each behind the mark recorded after its work.
        marked: VecDeque<(M, Vec<T>)>,
        /// Held by captured work: kept as long as the retention.
        pinned: Vec<T>,
    }

    impl<M, T> Default for Retention<M, T> {
        fn default() -> Self {
            Self { open: Vec::new(), marked: VecDeque::new(), pinned: Vec::new() }
        }
    }

    impl<M, T> Retention<M, T> {
        /// Keep `item` until the work queued so far on the stream has run, or, under a capture,
        /// for as long as the retention lives.
        pub fn hold(&mut self, item: T, capture: Capture) {
            if capture.allows_release() { self.open.push(item) } else { self.pinned.push(item) }
        }

        /// Whether there is an open batch to close with a mark.
        pub fn needs_mark(&self) -> bool {
            !self.open.is_empty()
        }

        /// Close the open batch behind `mark`, recorded on the stream after its work (never under a
        /// capture: the caller checks [`Capture::allows_release`]).
        pub fn mark(&mut self, mark: M) {
            if self.open.is_empty() {
                return;
            }
            let batch = std::mem::take(&mut self.open);
            self.marked.push_back((mark, batch));
        }

        /// Take out, oldest first, the batches whose mark `reached` says the stream has passed,
        /// stopping at the first it has not (a later mark cannot be passed before it). The caller
        /// drops them, outside any capture.
        pub fn collect(&mut self, mut reached: impl FnMut(&M) -> bool) -> Vec<T> {
            let mut out = Vec::new();
            while let Some((mark, _)) = self.marked.front() {
                if !reached(mark) {
                    break;
                }
                if let Some((_, batch)) = self.marked.pop_front() {
                    out.extend(batch);
                }
            }
            out
        }

        /// Take out everything held in stream order (open and marked), once the stream has been
        /// synchronized; pinned items stay.
        pub fn settle(&mut self) -> Vec<T> {
            let mut out: Vec<T> = self.marked.drain(..).flat_map(|(_, batch)| batch).collect();
            out.append(&mut self.open);
            out
        }

        /// Items held in stream order (open and marked).
        pub fn queued(&self) -> usize {
            self.open.len() + self.marked.iter().map(|(_, b)| b.len()).sum::<usize>()
        }

        /// Items pinned by captures.
        pub fn pinned(&self) -> usize {
            self.pinned.len()
        }

        /// Give up the pinned items (the caller has promised that no graph that captured them
        /// will run again).
        pub fn unpin(&mut self) -> Vec<T> {
            std::mem::take(&mut self.pinned)
        }
    }

    #[cfg(test)]
    mod retention_tests {
        use std::cell::Cell;
        use std::rc::Rc;

        use super::*;

        /// A mark the test reaches by hand, as the device would reach an event.
        type Mark = Rc<Cell<bool>>;

        fn mark() -> Mark {
            Rc::new(Cell::new(false))
        }

        #[test]
        fn batches_are_released_in_stream_order_once_their_mark_is_passed() {
            let mut r: Retention<Mark, &str> = Retention::default();
            r.hold("a", Capture::None);
            r.hold("b", Capture::None);
            assert!(r.needs_mark());
            let first = mark();
            r.mark(first.clone());
            assert!(!r.needs_mark());
            r.hold("c", Capture::None);
            let second = mark();
            r.mark(second.clone());
            assert_eq!(r.queued(), 3);

            // Nothing passed: nothing released.
            assert!(r.collect(|m| m.get()).is_empty());
            // The second mark passed but not the first cannot happen on one stream; if a marker
            // said so anyway, the order still holds: nothing past an unreached mark goes.
            second.set(true);
            assert!(r.collect(|m| m.get()).is_empty());
            first.set(true);
            assert_eq!(r.collect(|m| m.get()), vec!["a", "b", "c"]);
            assert_eq!(r.queued(), 0);
            // An empty open batch records no mark.
            r.mark(mark());
            assert!(r.collect(|_| panic!("no mark to query")).is_empty());
        }

        #[test]
        fn captured_work_is_pinned_never_marked_nor_released() {
            let mut r: Retention<Mark, &str> = Retention::default();
            r.hold("eager", Capture::None);
            r.hold("captured", Capture::Active);
            r.hold("failed capture", Capture::Invalidated);
            assert_eq!((r.queued(), r.pinned()), (1, 2));
            let m = mark();
            r.mark(m.clone());
            m.set(true);
            // Only the eager item comes back; the captured ones stay however far the stream runs.
            assert_eq!(r.collect(|m| m.get()), vec!["eager"]);
            assert_eq!(r.pinned(), 2);
            assert!(r.collect(|_| true).is_empty());
            r.hold("queued", Capture::None);
            r.mark(mark());
            r.hold("open", Capture::None);
            // A synchronize passes every mark at once; what a capture pinned stays pinned.
            assert_eq!(r.settle(), vec!["queued", "open"]);
            assert_eq!((r.queued(), r.pinned()), (0, 2));
            assert_eq!(r.unpin(), vec!["captured", "failed capture"]);
            assert_eq!(r.pinned(), 0);
        }

        #[test]
        fn only_a_stream_outside_a_capture_may_release() {
            assert!(Capture::None.allows_release());
            assert!(!Capture::Active.allows_release());
            assert!(!Capture::Invalidated.allows_release());
        }
    }
}
