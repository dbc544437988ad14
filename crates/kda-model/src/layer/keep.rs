//! States kept at chosen token positions of a prefill, for prefix caching
//! (`docs/design/kda.md#chunk-boundary-states`).
//!
//! A serving engine that caches prefixes asks, for a prefill request, for the layer's state after
//! `position` tokens of the sequence (block boundaries, in absolute positions: counting the
//! tokens the request had already computed), written into a cache slot it names. Both halves of
//! the state are written: the recurrent state (the chunk op keeps it at the chunk boundary, see
//! [`KdaChunk::chunk_state_slots`](kda_core::kda::KdaChunk::chunk_state_slots)) and the conv state
//! (the `W - 1` inputs before that position), so a later request that shares the prefix starts
//! from that slot with `num_computed_tokens = position` and continues exactly as the
//! uninterrupted prefill would.
//!
//! The recurrent state exists only at chunk boundaries of the call: a position must be
//! `num_computed_tokens + 64·j` (`j ≥ 1`) or the request's last token. Engines that cache by
//! blocks whose size is a multiple of 64 and schedule chunked prefills at block boundaries get
//! every block boundary this way.

use std::collections::HashMap;

use crate::layer::error::{KeepError, Result};
use kda_core::device::Device;
use kda_core::hal::Backend;
use kda_core::kda::{CHUNK_SIZE, CausalConv, chunks_of};
use kda_core::op::Op;
use kda_core::tensor::Tensor;

use super::batch::{BatchMeta, DispatchGroups, RequestSlots};
use super::cache::StateCache;
use super::dispatch::meta_tensor;

/// Keep the state of prefill request `request` (its index in the batch) after `position` tokens
/// of its sequence in cache slot `slot`.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct KeepState {
    pub request: usize,
    /// Tokens of the sequence, counting `num_computed_tokens`: `num_computed_tokens + 64·j`
    /// (`j ≥ 1`) or `num_computed_tokens + len` (the request's end).
    pub position: usize,
    pub slot: usize,
}

/// Checked [`KeepState`]s: the prefill group's `chunk_state_slots` (one entry per chunk of each
/// prefill request, in the group's order; `-1` keeps nothing) and the conv histories to write.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct KeepWrites {
    /// `None` when nothing is kept.
    pub(super) chunk_state_slots: Option<Vec<i32>>,
    conv: Vec<ConvKeep>,
}

/// Where a kept slot's conv state comes from.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum ConvKeep {
    /// The `W - 1` batch rows ending before live row `row_end`.
    Rows { row_end: usize, slot: usize },
    /// The request's own slot after the forward (the request's end).
    Slot { from: usize, slot: usize },
}

impl KeepWrites {
    /// Check `keep` against the batch (`meta`, already checked into `groups`), the cache's
    /// `slots` and the conv width.
    pub(super) fn new(
        keep: &[KeepState],
        meta: &BatchMeta,
        groups: &DispatchGroups,
        slots: usize,
        conv_width: usize,
    ) -> Result<Self, KeepError> {
        if keep.is_empty() {
            return Ok(Self::default());
        }
        let requests = meta.num_requests();
        let mut taken: HashMap<usize, String> = HashMap::new();
        for (r, s) in meta.slots.iter().enumerate() {
            let list = match s {
                RequestSlots::Single(slot) => std::slice::from_ref(slot),
                RequestSlots::Speculative { slots, .. } => slots.as_slice(),
            };
            for &slot in list {
                taken.insert(slot, format!("a slot of request {r}"));
            }
        }
        // The prefill group's requests, in its order, by their rows.
        let group = &groups.prefill;
        let order: HashMap<usize, usize> =
            group.ranges.iter().enumerate().map(|(i, r)| (r.start, i)).collect();
        let mut starts = Vec::with_capacity(group.ranges.len() + 1);
        starts.push(0);
        for r in &group.ranges {
            starts.push(starts[starts.len() - 1] + chunks_of(r.len()));
        }
        let mut slots_per_chunk = vec![-1i32; starts[starts.len() - 1]];
        let mut by_position: HashMap<(usize, usize), usize> = HashMap::new();
        let mut conv = Vec::new();
        let history = conv_width.saturating_sub(1);
        for (index, k) in keep.iter().enumerate() {
            let &KeepState { request, position, slot } = k;
            if request >= requests {
                return Err(KeepError::NoSuchRequest { index, request, requests });
            }
            let row = meta.query_start_loc[request];
            let len = meta.query_start_loc[request + 1] - row;
            let Some(&in_group) = order.get(&row) else {
                return Err(KeepError::NotAPrefill { index, request });
            };
            let computed = meta.num_computed_tokens[request];
            let end = computed + len;
            let into = position.saturating_sub(computed);
            let on_boundary = into > 0 && into % CHUNK_SIZE == 0 && position <= end;
            if position != end && !on_boundary {
                return Err(KeepError::Position { index, request, position, computed, end });
            }
            if slot >= slots {
                return Err(KeepError::SlotOutOfRange { index, slot, slots });
            }
            if let Some(other) = taken.insert(slot, format!("kept by keep[{index}]")) {
                return Err(KeepError::SlotTaken { index, slot, other });
            }
            if let Some(first) = by_position.insert((request, position), index) {
                return Err(KeepError::SamePosition { index, first, request, position });
            }
            let chunk = into.div_ceil(CHUNK_SIZE) - 1;
            slots_per_chunk[starts[in_group] + chunk] = i32::try_from(slot).unwrap_or(i32::MAX);
            if position == end {
                let from = match &meta.slots[request] {
                    RequestSlots::Single(s) => *s,
                    // A prefill has one slot (checked by `DispatchGroups::new`).
                    RequestSlots::Speculative { .. } => {
                        return Err(KeepError::NotAPrefill { index, request });
                    }
                };
                conv.push(ConvKeep::Slot { from, slot });
            } else if into < history {
                return Err(KeepError::ConvHistory { index, request, position, into, history });
            } else {
                conv.push(ConvKeep::Rows { row_end: row + into, slot });
            }
        }
        Ok(Self { chunk_state_slots: Some(slots_per_chunk), conv })
    }

    /// Write the kept slots' conv states, once every group of the forward has run: the `W - 1`
    /// live rows of `qkv` before an interior position (through `CausalConv` on just those rows,
    /// which stores exactly them, widened to f32), or a copy of the request's own history at its
    /// end. `history` is `W - 1`.
    pub(super) fn write_conv<B: Backend>(
        &self,
        b: &Device<B>,
        stream: &B::Stream,
        qkv: &Tensor<B>,
        conv_weight: &Tensor<B>,
        cache: &StateCache<B>,
        history: usize,
    ) -> Result<()> {
        if history == 0 {
            return Ok(());
        }
        let channels = qkv.shape()[1];
        for keep in &self.conv {
            match *keep {
                ConvKeep::Rows { row_end, slot } => {
                    let x = qkv.narrow(0, row_end - history, history)?;
                    let y = b.alloc(kda_core::dtype::DType::F32, &[history, channels])?;
                    b.launch_labeled(
                        stream,
                        "keep_conv_state",
                        Op::CausalConv(CausalConv {
                            x,
                            weight: conv_weight.clone(),
                            query_start_loc: meta_tensor(b, stream, &[0, history as i32])?,
                            state_slots: meta_tensor(b, stream, &[slot as i32])?,
                            has_initial_state: meta_tensor(b, stream, &[0])?,
                            state: cache.conv().clone(),
                            y,
                        }),
                    )?;
                }
                ConvKeep::Slot { from, slot } => {
                    let src = cache.conv_slot(from)?.narrow(0, 0, history)?;
                    let dst = cache.conv_slot(slot)?.narrow(0, 0, history)?;
                    b.launch_labeled(stream, "keep_conv_state", Op::Copy { src, dst })?;
                }
            }
        }
        Ok(())
    }
}
