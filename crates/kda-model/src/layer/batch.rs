//! [`BatchMeta`]: one continuous-batching step's per-request metadata
//! (`docs/design/kda.md#batches-and-dispatch`), checked once on the host, and the [`DispatchGroups`]
//! it turns into.
//!
//! A batch is a flat token array: request `b` owns rows `query_start_loc[b] ..
//! query_start_loc[b + 1]`, the first `num_actual_tokens` rows are live and the rest is graph
//! padding. Each request names its state slot(s): one slot, or for a speculative decode a slot
//! list of `num_spec + 1` entries with the count of tokens the previous step accepted.
//!
//! The dispatch sorts the requests into three groups, run in this order: plain decodes (one new
//! token on a prior state: the recurrent path), speculative decodes (the recurrent path with
//! slot lists), prefills (everything else: the chunked path, fresh when `num_computed_tokens` is
//! 0). Outputs are written back at each request's own token positions, so the merge by token
//! position is free.

use std::ops::Range;

use thiserror::Error;

/// The state slots one request reads and writes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RequestSlots {
    /// One slot: read (unless the request is fresh) and written back.
    Single(usize),
    /// A speculative decode of `slots.len() = num_spec + 1` tokens: the recurrent state is read
    /// from `slots[num_accepted - 1]` (the last token the previous step kept) and the state after
    /// token `t` is written to `slots[t]`; the conv state lives in `slots[0]`.
    Speculative { slots: Vec<usize>, num_accepted: usize },
}

/// One step's metadata (`docs/design/kda.md#batches-and-dispatch`).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct BatchMeta {
    /// `[B + 1]` strictly increasing token offsets starting at 0 (`[]` or `[0]`: an empty batch).
    pub query_start_loc: Vec<usize>,
    /// `[B]` tokens each request has already processed; 0 means fresh (its state is zeroed).
    pub num_computed_tokens: Vec<usize>,
    /// `[B]` each request's state slot(s).
    pub slots: Vec<RequestSlots>,
    /// Live tokens: `query_start_loc[B]`; rows past it are padding (their output is zero).
    pub num_actual_tokens: usize,
}

impl BatchMeta {
    /// No requests: forward zeroes the output and touches nothing else.
    pub fn empty() -> Self {
        Self::default()
    }

    /// Fresh prefills of `lens` tokens into slots `slots` (the `kda layer` input).
    pub fn prefills(lens: &[usize], slots: &[usize]) -> Self {
        let mut meta = Self::empty();
        for (&len, &slot) in lens.iter().zip(slots) {
            meta.push(len, 0, RequestSlots::Single(slot));
        }
        meta
    }

    /// Fresh prefills from the i32 `query_start_loc` a file holds (`kda layer`'s input):
    /// request `b` owns rows `query_start_loc[b]..query_start_loc[b + 1]` and state slot `b`.
    /// Checked as [`DispatchGroups::new`] checks a batch over `rows` rows of hidden states, so the
    /// request count (what a state cache is sized by) is known to be at most `rows` before
    /// anything is allocated for it.
    pub fn fresh_prefills(query_start_loc: &[i32], rows: usize) -> Result<Self, BatchError> {
        let offsets = query_start_loc
            .iter()
            .enumerate()
            .map(|(index, &value)| {
                usize::try_from(value).map_err(|_| BatchError::NegativeOffset { index, value })
            })
            .collect::<Result<Vec<usize>, _>>()?;
        let requests = offsets.len().saturating_sub(1);
        let meta = Self {
            num_actual_tokens: offsets.last().copied().unwrap_or(0),
            query_start_loc: offsets,
            num_computed_tokens: vec![0; requests],
            slots: (0..requests).map(RequestSlots::Single).collect(),
        };
        DispatchGroups::new(&meta, rows, CacheLimits { slots: requests, num_spec: 0 })?;
        Ok(meta)
    }

    /// Append a request of `len` tokens after the current ones.
    pub fn push(&mut self, len: usize, num_computed: usize, slots: RequestSlots) -> &mut Self {
        if self.query_start_loc.is_empty() {
            self.query_start_loc.push(0);
        }
        let end = self.num_actual_tokens + len;
        self.query_start_loc.push(end);
        self.num_computed_tokens.push(num_computed);
        self.slots.push(slots);
        self.num_actual_tokens = end;
        self
    }

    /// Requests in the batch.
    pub fn num_requests(&self) -> usize {
        self.query_start_loc.len().saturating_sub(1)
    }
}

/// Malformed batch metadata, or metadata that does not fit the buffers it is used with. Every
/// variant names the request (its index in the batch) and the offending values.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum BatchError {
    #[error("batch metadata: {param} has {actual} entries, expected {expected}")]
    Length { param: &'static str, expected: String, actual: usize },
    #[error("batch metadata: query_start_loc[{index}] = {value}: offsets must be non-negative")]
    NegativeOffset { index: usize, value: i32 },
    #[error("batch metadata: query_start_loc[0] = {actual}, expected 0")]
    FirstOffset { actual: usize },
    #[error(
        "batch metadata: query_start_loc is not strictly increasing at request {request} \
         ({start} then {end}); every request needs at least one token"
    )]
    NotIncreasing { request: usize, start: usize, end: usize },
    #[error(
        "batch metadata: num_actual_tokens = {actual}, expected {expected} (the last offset of \
         query_start_loc)"
    )]
    LiveTokens { expected: usize, actual: usize },
    #[error("batch metadata: {live} live tokens but the hidden states have only {rows} rows")]
    TooManyTokens { live: usize, rows: usize },
    #[error("batch metadata: request {request} uses slot {slot}, but the cache has {slots} slots")]
    SlotOutOfRange { request: usize, slot: usize, slots: usize },
    #[error("batch metadata: slot {slot} is used twice (requests {first} and {second})")]
    DuplicateSlot { slot: usize, first: usize, second: usize },
    #[error(
        "batch metadata: speculative request {request} has num_accepted_tokens = {actual}, \
         expected 1..={max} (num_spec + 1)"
    )]
    Accepted { request: usize, actual: usize, max: usize },
    #[error(
        "batch metadata: speculative request {request} has {tokens} tokens but a slot list of \
         {slots} (num_spec + 1 each)"
    )]
    SpecTokens { request: usize, tokens: usize, slots: usize },
    #[error(
        "batch metadata: speculative request {request} has a slot list of {actual}, expected \
         {expected} like the batch's first speculative request"
    )]
    SpecWidth { request: usize, expected: usize, actual: usize },
    #[error(
        "batch metadata: speculative request {request} has num_computed_tokens = 0 (it must continue a sequence)"
    )]
    SpecFresh { request: usize },
    #[error(
        "batch metadata: num_spec = {num_spec}, but the cache's conv state has room for \
         {capacity} speculative tokens (make the cache with num_spec >= {num_spec})"
    )]
    SpecCapacity { num_spec: usize, capacity: usize },
    #[error("batch metadata: {param} = {value} does not fit in i32")]
    TooLarge { param: &'static str, value: usize },
}

/// Which path a group of requests takes.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum GroupKind {
    /// One token each on a prior state: conv update + recurrence.
    Decode,
    /// `tokens` tokens each (`num_spec + 1`), slot lists: conv update + recurrence.
    Speculative { tokens: usize },
    /// Any lengths, fresh or continued: causal conv + chunked recurrence.
    Prefill,
}

/// The requests of one path, in batch order, with their device metadata as i32.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Group {
    pub kind: GroupKind,
    /// Each request's rows in the flat batch.
    pub ranges: Vec<Range<usize>>,
    /// Decode / prefill: one slot per request. Speculative: the slot lists, `[B, n]` row-major.
    pub state_slots: Vec<i32>,
    /// Each request's conv state slot (speculative: the first of its list).
    pub conv_slots: Vec<i32>,
    /// Prefill: 1 when the request continues from its slot, 0 when fresh.
    pub has_initial_state: Vec<i32>,
    /// Speculative: tokens accepted from the previous step.
    pub num_accepted: Vec<i32>,
}

impl Group {
    fn new(kind: GroupKind) -> Self {
        Self {
            kind,
            ranges: Vec::new(),
            state_slots: Vec::new(),
            conv_slots: Vec::new(),
            has_initial_state: Vec::new(),
            num_accepted: Vec::new(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }

    pub fn requests(&self) -> usize {
        self.ranges.len()
    }

    /// Tokens of all its requests.
    pub fn tokens(&self) -> usize {
        self.ranges.iter().map(|r| r.len()).sum()
    }

    /// The group's rows as maximal runs of consecutive rows of the flat batch, in order.
    pub fn runs(&self) -> Vec<Range<usize>> {
        let mut runs: Vec<Range<usize>> = Vec::new();
        for r in &self.ranges {
            match runs.last_mut() {
                Some(last) if last.end == r.start => last.end = r.end,
                _ => runs.push(r.clone()),
            }
        }
        runs
    }

    /// `[0, l0, l0 + l1, …]`: offsets of the requests inside the group's own token buffer.
    pub fn local_offsets(&self) -> Vec<i32> {
        let mut at = 0i32;
        std::iter::once(0)
            .chain(self.ranges.iter().map(|r| {
                at += r.len() as i32;
                at
            }))
            .collect()
    }
}

/// A checked batch: the live token count and the three groups in dispatch order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DispatchGroups {
    pub num_actual_tokens: usize,
    pub decode: Group,
    pub speculative: Group,
    pub prefill: Group,
}

/// The cache sizes a batch is checked against.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct CacheLimits {
    pub slots: usize,
    /// Speculative tokens the conv state has room for (`L - (W - 1)`).
    pub num_spec: usize,
}

fn to_i32(param: &'static str, value: usize) -> Result<i32, BatchError> {
    i32::try_from(value).map_err(|_| BatchError::TooLarge { param, value })
}

impl DispatchGroups {
    /// Check `meta` against a hidden-state buffer of `rows` rows and a cache: every error
    /// [`BatchError`] lists is found here, before anything is launched.
    pub fn new(meta: &BatchMeta, rows: usize, cache: CacheLimits) -> Result<Self, BatchError> {
        let qsl = &meta.query_start_loc;
        let batch = qsl.len().saturating_sub(1);
        for (param, len) in
            [("num_computed_tokens", meta.num_computed_tokens.len()), ("slots", meta.slots.len())]
        {
            if len != batch {
                let expected = format!("{batch} (B, from query_start_loc)");
                return Err(BatchError::Length { param, expected, actual: len });
            }
        }
        if let Some(&first) = qsl.first()
            && first != 0
        {
            return Err(BatchError::FirstOffset { actual: first });
        }
        for (request, w) in qsl.windows(2).enumerate() {
            if w[1] <= w[0] {
                return Err(BatchError::NotIncreasing { request, start: w[0], end: w[1] });
            }
        }
        let live = qsl.last().copied().unwrap_or(0);
        if meta.num_actual_tokens != live {
            return Err(BatchError::LiveTokens { expected: live, actual: meta.num_actual_tokens });
        }
        if live > rows {
            return Err(BatchError::TooManyTokens { live, rows });
        }
        to_i32("num_actual_tokens", live)?;

        let mut groups = DispatchGroups {
            num_actual_tokens: live,
            decode: Group::new(GroupKind::Decode),
            speculative: Group::new(GroupKind::Decode),
            prefill: Group::new(GroupKind::Prefill),
        };
        let mut owner: std::collections::HashMap<usize, usize> = Default::default();
        let mut claim = |request: usize, slot: usize| -> Result<i32, BatchError> {
            if slot >= cache.slots {
                return Err(BatchError::SlotOutOfRange { request, slot, slots: cache.slots });
            }
            if let Some(first) = owner.insert(slot, request) {
                return Err(BatchError::DuplicateSlot { slot, first, second: request });
            }
            to_i32("slot", slot)
        };
        let mut spec_width = None;
        for request in 0..batch {
            let range = qsl[request]..qsl[request + 1];
            let computed = meta.num_computed_tokens[request];
            match &meta.slots[request] {
                RequestSlots::Single(slot) => {
                    let slot = claim(request, *slot)?;
                    let group = if range.len() == 1 && computed > 0 {
                        &mut groups.decode
                    } else {
                        groups.prefill.has_initial_state.push(i32::from(computed > 0));
                        &mut groups.prefill
                    };
                    group.ranges.push(range);
                    group.state_slots.push(slot);
                    group.conv_slots.push(slot);
                }
                RequestSlots::Speculative { slots, num_accepted } => {
                    let width = *spec_width.get_or_insert(slots.len());
                    if slots.len() != width {
                        let actual = slots.len();
                        return Err(BatchError::SpecWidth { request, expected: width, actual });
                    }
                    if range.len() != width {
                        let (tokens, slots) = (range.len(), width);
                        return Err(BatchError::SpecTokens { request, tokens, slots });
                    }
                    if !(1..=width).contains(num_accepted) {
                        let (actual, max) = (*num_accepted, width);
                        return Err(BatchError::Accepted { request, actual, max });
                    }
                    if computed == 0 {
                        return Err(BatchError::SpecFresh { request });
                    }
                    if width - 1 > cache.num_spec {
                        let (num_spec, capacity) = (width - 1, cache.num_spec);
                        return Err(BatchError::SpecCapacity { num_spec, capacity });
                    }
                    let g = &mut groups.speculative;
                    g.kind = GroupKind::Speculative { tokens: width };
                    for &slot in slots {
                        let slot = claim(request, slot)?;
                        g.state_slots.push(slot);
                    }
                    let first = g.state_slots[g.state_slots.len() - width];
                    g.conv_slots.push(first);
                    g.num_accepted.push(to_i32("num_accepted_tokens", *num_accepted)?);
                    g.ranges.push(range);
                }
            }
        }
        Ok(groups)
    }

    /// No live tokens: forward only zeroes its output.
    pub fn is_empty(&self) -> bool {
        self.num_actual_tokens == 0
    }

    /// The non-empty groups in dispatch order: decodes, speculative decodes, prefills.
    pub fn groups(&self) -> impl Iterator<Item = &Group> {
        [&self.decode, &self.speculative, &self.prefill].into_iter().filter(|g| !g.is_empty())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CACHE: CacheLimits = CacheLimits { slots: 8, num_spec: 2 };

    fn spec(slots: &[usize], num_accepted: usize) -> RequestSlots {
        RequestSlots::Speculative { slots: slots.to_vec(), num_accepted }
    }

    #[test]
    fn groups_follow_the_request_kinds_and_keep_token_positions() {
        let mut meta = BatchMeta::empty();
        meta.push(3, 0, RequestSlots::Single(4)) // fresh prefill
            .push(1, 7, RequestSlots::Single(0)) // decode
            .push(3, 9, spec(&[1, 2, 3], 2)) // speculative
            .push(1, 0, RequestSlots::Single(5)) // a fresh one-token prefill
            .push(1, 2, RequestSlots::Single(6)); // decode
        let groups = DispatchGroups::new(&meta, 10, CACHE).unwrap();
        assert_eq!(groups.num_actual_tokens, 9);
        assert_eq!(groups.decode.ranges, vec![3..4, 8..9]);
        assert_eq!(groups.decode.state_slots, vec![0, 6]);
        assert_eq!(groups.decode.runs(), vec![3..4, 8..9]);
        assert_eq!(groups.speculative.kind, GroupKind::Speculative { tokens: 3 });
        assert_eq!(groups.speculative.state_slots, vec![1, 2, 3]);
        assert_eq!(groups.speculative.conv_slots, vec![1]);
        assert_eq!(groups.speculative.num_accepted, vec![2]);
        assert_eq!(groups.prefill.ranges, vec![0..3, 7..8]);
        assert_eq!(groups.prefill.has_initial_state, vec![0, 0]);
        assert_eq!(groups.prefill.local_offsets(), vec![0, 3, 4]);
        let kinds: Vec<_> = groups.groups().map(|g| g.kind).collect();
        assert_eq!(
            kinds,
            vec![GroupKind::Decode, GroupKind::Speculative { tokens: 3 }, GroupKind::Prefill]
        );
    }

    #[test]
    fn adjacent_requests_merge_into_one_run() {
        let meta = BatchMeta::prefills(&[2, 3, 1], &[0, 1, 2]);
        let groups = DispatchGroups::new(&meta, 6, CACHE).unwrap();
        assert_eq!(groups.prefill.runs(), vec![0..6]);
        assert!(groups.decode.is_empty() && groups.speculative.is_empty());
    }

    #[test]
    fn empty_batches() {
        for meta in
            [BatchMeta::empty(), BatchMeta { query_start_loc: vec![0], ..BatchMeta::empty() }]
        {
            let groups = DispatchGroups::new(&meta, 4, CACHE).unwrap();
            assert!(groups.is_empty() && groups.groups().count() == 0);
        }
    }

    /// Issue #21, item 2: `kda layer` sized its state cache by `len(query_start_loc)` before
    /// checking it; the offsets are now checked against the rows first, so a million offsets
    /// over a few rows are an error, not a million-slot cache.
    #[test]
    fn fresh_prefills_from_file_offsets_are_checked_against_the_rows() {
        let meta = BatchMeta::fresh_prefills(&[0, 5, 8], 9).unwrap();
        assert_eq!(meta, BatchMeta::prefills(&[5, 3], &[0, 1]));
        assert_eq!(BatchMeta::fresh_prefills(&[], 0).unwrap(), BatchMeta::empty());
        let many = vec![0i32; 1 << 20];
        assert_eq!(
            BatchMeta::fresh_prefills(&many, 4).unwrap_err(),
            BatchError::NotIncreasing { request: 0, start: 0, end: 0 }
        );
        let climbing: Vec<i32> = (0..1 << 20).collect();
        assert_eq!(
            BatchMeta::fresh_prefills(&climbing, 4).unwrap_err(),
            BatchError::TooManyTokens { live: (1 << 20) - 1, rows: 4 }
        );
        assert_eq!(
            BatchMeta::fresh_prefills(&[0, 2, -1], 4).unwrap_err(),
            BatchError::NegativeOffset { index: 2, value: -1 }
        );
        assert_eq!(
            BatchMeta::fresh_prefills(&[3, 4], 4).unwrap_err(),
            BatchError::FirstOffset { actual: 3 }
        );
    }

    #[test]
    fn malformed_metadata_is_named() {
        let ok = BatchMeta::prefills(&[2, 1], &[0, 1]);
        let err = |edit: &dyn Fn(&mut BatchMeta), rows: usize| {
            let mut m = ok.clone();
            edit(&mut m);
            DispatchGroups::new(&m, rows, CACHE).unwrap_err()
        };
        assert_eq!(
            err(&|m| m.query_start_loc = vec![0, 2, 2], 4),
            BatchError::NotIncreasing { request: 1, start: 2, end: 2 }
        );
        assert_eq!(
            err(&|m| m.query_start_loc = vec![1, 2, 3], 4),
            BatchError::FirstOffset { actual: 1 }
        );
        assert!(matches!(
            err(
                &|m| {
                    m.num_computed_tokens.pop();
                },
                4
            ),
            BatchError::Length { param: "num_computed_tokens", actual: 1, .. }
        ));
        assert_eq!(
            err(&|m| m.num_actual_tokens = 2, 4),
            BatchError::LiveTokens { expected: 3, actual: 2 }
        );
        assert_eq!(err(&|_| {}, 2), BatchError::TooManyTokens { live: 3, rows: 2 });
        assert_eq!(
            err(&|m| m.slots[1] = RequestSlots::Single(8), 4),
            BatchError::SlotOutOfRange { request: 1, slot: 8, slots: 8 }
        );
        assert_eq!(
            err(&|m| m.slots[1] = RequestSlots::Single(0), 4),
            BatchError::DuplicateSlot { slot: 0, first: 0, second: 1 }
        );
        let with_spec = |s: RequestSlots, computed: usize| {
            move |m: &mut BatchMeta| {
                m.push(3, computed, s.clone());
            }
        };
        assert_eq!(
            err(&with_spec(spec(&[3, 4, 5], 4), 5), 8),
            BatchError::Accepted { request: 2, actual: 4, max: 3 }
        );
        assert_eq!(
            err(&with_spec(spec(&[3, 4, 5], 0), 5), 8),
            BatchError::Accepted { request: 2, actual: 0, max: 3 }
        );
        assert_eq!(
            err(&with_spec(spec(&[3, 4, 5], 1), 0), 8),
            BatchError::SpecFresh { request: 2 }
        );
        assert_eq!(
            err(&with_spec(spec(&[3, 4], 1), 5), 8),
            BatchError::SpecTokens { request: 2, tokens: 3, slots: 2 }
        );
        assert_eq!(
            err(&with_spec(spec(&[3, 0, 5], 1), 5), 8),
            BatchError::DuplicateSlot { slot: 0, first: 0, second: 2 }
        );
        let mut wide = ok.clone();
        wide.push(4, 5, spec(&[3, 4, 5, 6], 1));
        assert_eq!(
            DispatchGroups::new(&wide, 8, CACHE).unwrap_err(),
            BatchError::SpecCapacity { num_spec: 3, capacity: 2 }
        );
        let mut mixed = ok.clone();
        mixed.push(3, 5, spec(&[3, 4, 5], 1)).push(2, 5, spec(&[6, 7], 1));
        assert_eq!(
            DispatchGroups::new(&mixed, 10, CACHE).unwrap_err(),
            BatchError::SpecWidth { request: 3, expected: 3, actual: 2 }
        );
    }
}
