//! Every count the C ABI is given is checked against what bounds it before the arrays it sizes
//! are read, and its errors carry the caller's values as given: regression tests for the two
//! defects reported (`num_requests = 1 << 40` aborted the process with an allocation failure;
//! cache and slot errors lost the number the caller passed), and property tests that drive
//! every count and slot value of `kda_layer_forward`, `kda_cache_create` and
//! `kda_cache_recurrent_state` around its bounds with valid buffers. Each call must return a
//! typed error (never `KDA_STATUS_ERROR_INTERNAL`, never an abort) leaving the cache as it was,
//! or the result the Rust API gives for the same batch, bit for bit.
//!
//! "Valid buffers": an array is as long as its count says whenever the count is within its
//! bound; past the bound it is short (two elements), so a count checked too late reads past it,
//! which the address sanitizer reports (`docs/embedding.md`, "What kda checks").
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test")]

use std::ffi::{CStr, CString, c_void};
use std::path::PathBuf;
use std::ptr;
use std::sync::OnceLock;

use kda_capi::*;
use kda_core::DType;
use kda_embed::testing::write_synthetic_checkpoint;
use kda_embed::{BatchArgs, ForeignArray, Layer, Memory, Runtime, SlotsArg};
use kda_model::schedule::ProjectionSchedule;
use proptest::prelude::*;

/// The caches of the property test: 4 slots, room for 2 speculative tokens.
const SLOTS: usize = 4;
const SPEC: usize = 2;

fn last_error() -> String {
    // SAFETY: a NUL-terminated string owned by this thread's slot.
    unsafe { CStr::from_ptr(kda_last_error()) }.to_str().unwrap().to_string()
}

/// One layer through the C ABI and the same layer through the Rust API, loaded once.
struct Fixture {
    layer: *mut KdaLayer,
    rust: Layer,
    hidden: usize,
    state_len: usize,
}

// SAFETY: a `KdaLayer` is `Send + Sync` (docs/embedding.md, "Threads"); the pointer is never
// destroyed while the tests run.
unsafe impl Send for Fixture {}
// SAFETY: as above.
unsafe impl Sync for Fixture {}

fn fixture() -> &'static Fixture {
    static FIXTURE: OnceLock<Fixture> = OnceLock::new();
    FIXTURE.get_or_init(|| {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("bounds-checkpoint");
        write_synthetic_checkpoint(&dir, "tiny", 3).unwrap();
        let name = CString::new("reference").unwrap();
        let path = CString::new(dir.to_str().unwrap()).unwrap();
        let (mut backend, mut layer) = (ptr::null_mut(), ptr::null_mut());
        let mut info = KdaLayerInfo { hidden_size: 0, local_heads: 0, head_dim: 0, conv_width: 0 };
        // SAFETY: valid strings and out-pointers.
        unsafe {
            assert_eq!(kda_backend_create(name.as_ptr(), 0, &mut backend), KdaStatus::Ok);
            let status = kda_layer_load(backend, path.as_ptr(), 0, 1, 0, 1, &mut layer);
            assert_eq!(status, KdaStatus::Ok, "{}", last_error());
            kda_backend_destroy(backend);
            assert_eq!(kda_layer_info(layer, &mut info), KdaStatus::Ok);
        }
        let runtime = Runtime::new("reference", 0).unwrap();
        let rust = Layer::load(&runtime, &dir, 0, 1, 0, ProjectionSchedule::Overlapped).unwrap();
        let state_len = info.local_heads * info.head_dim * info.head_dim;
        Fixture { layer, rust, hidden: info.hidden_size, state_len }
    })
}

/// A C cache of `SLOTS` slots with room for `SPEC` speculative tokens, destroyed on drop.
struct CCache(*mut KdaCache);

impl CCache {
    fn new(f: &Fixture) -> Self {
        let mut cache = ptr::null_mut();
        // SAFETY: a live layer and a valid out-pointer.
        let status = unsafe { kda_cache_create(f.layer, SLOTS, SPEC, &mut cache) };
        assert_eq!(status, KdaStatus::Ok, "{}", last_error());
        Self(cache)
    }

    /// Every slot's recurrent state, through the C ABI.
    fn states(&self, f: &Fixture) -> Vec<f32> {
        let mut all = vec![0f32; SLOTS * f.state_len];
        for (slot, chunk) in all.chunks_mut(f.state_len).enumerate() {
            // SAFETY: live handles; `chunk` holds `state_len` floats.
            let status = unsafe {
                kda_cache_recurrent_state(f.layer, self.0, slot, chunk.as_mut_ptr(), chunk.len())
            };
            assert_eq!(status, KdaStatus::Ok, "{}", last_error());
        }
        all
    }
}

impl Drop for CCache {
    fn drop(&mut self) {
        // SAFETY: made by `kda_cache_create`, not used afterwards.
        unsafe { kda_cache_destroy(self.0) }
    }
}

fn empty_batch() -> KdaBatch {
    KdaBatch {
        num_requests: 0,
        query_start_loc: ptr::null(),
        num_computed_tokens: ptr::null(),
        slots: ptr::null(),
        num_spec: 0,
        spec_slots: ptr::null(),
        num_accepted_tokens: ptr::null(),
    }
}

/// `kda_layer_forward` on f32 arrays of `rows` rows.
fn forward(f: &Fixture, cache: &CCache, batch: &KdaBatch, rows: usize) -> (KdaStatus, Vec<f32>) {
    let x: Vec<f32> = (0..rows * f.hidden).map(|i| ((i * 37 % 101) as f32 - 50.0) / 64.0).collect();
    let mut out = vec![0f32; rows * f.hidden];
    // SAFETY: live handles; arrays of `rows` rows (the counts in `batch` are the test's).
    let status = unsafe {
        kda_layer_forward(
            f.layer,
            cache.0,
            x.as_ptr().cast(),
            KdaDtype::F32 as i32,
            rows,
            batch,
            out.as_mut_ptr().cast::<c_void>(),
            KdaDtype::F32 as i32,
            0,
        )
    };
    (status, out)
}

/// The reported defect: `num_requests = 1 << 40` with a valid two-element `query_start_loc`
/// and 10 tokens aborted the process (`memory allocation of 8796093022216 bytes failed`) while
/// widening arrays of that length; a smaller wrong count read past the caller's array.
#[test]
fn a_request_count_above_the_tokens_is_refused_before_any_array_is_read() {
    let f = fixture();
    let cache = CCache::new(f);
    let before = cache.states(f);
    let qsl = [0i32, 10];
    for requests in [1usize << 40, 11, usize::MAX] {
        let batch =
            KdaBatch { num_requests: requests, query_start_loc: qsl.as_ptr(), ..empty_batch() };
        let (status, out) = forward(f, &cache, &batch, 10);
        assert_eq!(status, KdaStatus::ErrorMetadata, "{}", last_error());
        assert_eq!(
            last_error(),
            format!(
                "batch metadata: num_requests = {requests}, expected at most 10 (num_tokens: \
                 every request needs a token)"
            )
        );
        assert!(out.iter().all(|&v| v == 0.0), "a rejected call wrote out");
    }
    // `num_spec` above the cache's is refused before `spec_slots` (two elements) is read.
    let (computed, accepted, spec) = ([3i32], [1i32], [0i32, 1]);
    let batch = KdaBatch {
        num_requests: 1,
        query_start_loc: qsl.as_ptr(),
        num_computed_tokens: computed.as_ptr(),
        num_spec: 1 << 40,
        spec_slots: spec.as_ptr(),
        num_accepted_tokens: accepted.as_ptr(),
        ..empty_batch()
    };
    assert_eq!(forward(f, &cache, &batch, 10).0, KdaStatus::ErrorMetadata);
    assert_eq!(
        last_error(),
        "batch metadata: num_spec = 1099511627776, expected at most 2 (the cache's num_spec)"
    );
    // Tokens no memory holds are refused before they bound anything.
    let mut out = [0f32; 1];
    let batch = KdaBatch { num_requests: 1 << 40, query_start_loc: qsl.as_ptr(), ..empty_batch() };
    // SAFETY: live handles; the row count is refused before any array is touched.
    let status = unsafe {
        kda_layer_forward(
            f.layer,
            cache.0,
            out.as_ptr().cast(),
            0,
            usize::MAX,
            &batch,
            out.as_mut_ptr().cast(),
            0,
            0,
        )
    };
    assert_eq!(status, KdaStatus::ErrorShape, "{}", last_error());
    assert!(last_error().contains(&format!("num_tokens = {}", usize::MAX)), "{}", last_error());
    assert_eq!(cache.states(f), before, "rejected calls left the cache as it was");
}

/// The reported defect: errors about the cache lost the number the caller passed. A slot of
/// `usize::MAX` was reported as `i64::MAX`, an output length as `len * 4` (wrapped), and a
/// `num_spec` whose conv rows `W - 1 + num_spec` wrap made a cache too small for it.
#[test]
fn cache_errors_carry_the_callers_values_as_given() {
    let f = fixture();
    let mut cache = ptr::null_mut();
    // SAFETY: a live layer and a valid out-pointer.
    unsafe {
        let status = kda_cache_create(f.layer, 1 << 60, 0, &mut cache);
        assert_eq!(status, KdaStatus::ErrorShape, "{}", last_error());
        assert!(last_error().contains("1152921504606846976"), "{}", last_error());
        assert!(!last_error().contains("slots: 0"), "{}", last_error());
        let status = kda_cache_create(f.layer, 1, usize::MAX, &mut cache);
        assert_eq!(status, KdaStatus::ErrorShape, "{}", last_error());
        assert!(
            last_error().contains("parameter num_spec = 18446744073709551615"),
            "{}",
            last_error()
        );
        assert!(cache.is_null(), "no cache was made");
    }
    let cache = CCache::new(f);
    let mut state = vec![0f32; f.state_len];
    // SAFETY: live handles; `state` holds `state_len` floats, and at least `len` where the call
    // succeeds.
    unsafe {
        let status = kda_cache_recurrent_state(
            f.layer,
            cache.0,
            usize::MAX,
            state.as_mut_ptr(),
            state.len(),
        );
        assert_eq!(status, KdaStatus::ErrorMetadata);
        assert_eq!(
            last_error(),
            "batch metadata: slot = 18446744073709551615, expected < 4 (the cache's slots)"
        );
        let len = (usize::MAX >> 2) + 2;
        let status = kda_cache_recurrent_state(f.layer, cache.0, 0, state.as_mut_ptr(), len);
        assert_eq!(status, KdaStatus::ErrorShape);
        assert_eq!(
            last_error(),
            format!(
                "out: len = {len} floats, expected {} ([local_heads, head_dim, head_dim])",
                f.state_len
            )
        );
    }
}

/// A count near its bound (0, 1, bound − 1, bound, bound + 1, huge, the largest) or, half the
/// time, the plausible one.
fn count(pick: u8, bound: usize, plausible: usize) -> usize {
    match pick % 14 {
        0 => 0,
        1 => 1,
        2 => bound.saturating_sub(1),
        3 => bound,
        4 => bound + 1,
        5 => 1 << 40,
        6 => usize::MAX,
        _ => plausible,
    }
}

/// An i32 array element: the plausible value, or (when `edge` picks one) a value at an edge of
/// its bound `0..bound` or of the type.
fn element(plausible: i32, edge: u8, bound: i32) -> i32 {
    match edge % 48 {
        0 => -1,
        1 => bound - 1,
        2 => bound,
        3 => bound + 1,
        4 => i32::MAX,
        5 => i32::MIN,
        _ => plausible,
    }
}

/// One request of a plausible batch: its tokens (speculative requests have `num_spec + 1`),
/// whether it continues a sequence, and whether it is a speculative decode.
#[derive(Clone, Debug)]
struct Request {
    len: usize,
    continues: bool,
    speculative: bool,
    accepted: u8,
}

/// One `kda_layer_forward`, described by picks the property test draws: a plausible batch, and
/// counts and elements moved to an edge of their bounds.
#[derive(Clone, Debug)]
struct Case {
    requests: Vec<Request>,
    pad: usize,
    requests_pick: u8,
    /// Per element of every array: an edge value or the plausible one.
    edges: Vec<u8>,
    computed: bool,
    slots: bool,
    spec: Option<u8>,
    hidden_dtype: u8,
    out_dtype: u8,
    qsl_null: bool,
}

fn cases() -> impl Strategy<Value = Case> {
    let request = (1usize..=3, any::<bool>(), prop::bool::weighted(0.4), any::<u8>()).prop_map(
        |(len, continues, speculative, accepted)| Request { len, continues, speculative, accepted },
    );
    (
        (prop::collection::vec(request, 0..=4), 0usize..=1, any::<u8>()),
        (prop::collection::vec(any::<u8>(), 64), any::<bool>(), any::<bool>()),
        (prop::option::of(any::<u8>()), 0u8..32, 0u8..32, prop::bool::weighted(0.03)),
    )
        .prop_map(
            |(
                (requests, pad, requests_pick),
                (edges, computed, slots),
                (spec, hidden_dtype, out_dtype, qsl_null),
            )| Case {
                requests,
                pad,
                requests_pick,
                edges,
                computed,
                slots,
                spec,
                hidden_dtype,
                out_dtype,
                qsl_null,
            },
        )
}

/// The arrays of a case: each as long as its count says when the count is within its bound,
/// two elements when it is not.
#[derive(Debug)]
struct Arrays {
    rows: usize,
    requests: usize,
    num_spec: usize,
    qsl: Option<Vec<i32>>,
    computed: Option<Vec<i32>>,
    slots: Option<Vec<i32>>,
    spec_slots: Option<Vec<i32>>,
    accepted: Option<Vec<i32>>,
}

impl Case {
    fn arrays(&self) -> Arrays {
        let num_spec = self.spec.map_or(0, |p| count(p, SPEC, usize::from(p) % (SPEC + 1)));
        let width = if num_spec <= SPEC { num_spec + 1 } else { 2 };
        let speculative = |r: &Request| self.spec.is_some() && r.speculative;
        let lens: Vec<usize> =
            self.requests.iter().map(|r| if speculative(r) { width } else { r.len }).collect();
        let rows = lens.iter().sum::<usize>() + self.pad;
        let requests = count(self.requests_pick, rows, self.requests.len());
        let n = if requests <= rows { requests } else { 1 };
        let request = |j: usize| self.requests.get(j);
        let mut edges = self.edges.iter().copied().cycle();
        let mut edge = || edges.next().unwrap_or(6);
        let mut offset = 0;
        let qsl = (!self.qsl_null).then(|| {
            (0..=n)
                .map(|j| {
                    if j > 0 {
                        offset += lens.get(j - 1).copied().unwrap_or(1);
                    }
                    element(offset as i32, edge(), rows as i32)
                })
                .collect::<Vec<_>>()
        });
        let computed = self.computed.then(|| {
            (0..n)
                .map(|j| {
                    let continues = request(j).is_some_and(|r| r.continues || speculative(r));
                    element(if continues { 5 } else { 0 }, edge(), 8)
                })
                .collect()
        });
        // Each request takes the next free slots (a speculative one `width` of them); past the
        // cache's slots they collide or run out, as an engine's mistake would.
        let mut next = 0usize;
        let mut taken = Vec::new();
        for j in 0..n {
            let k = if request(j).is_some_and(speculative) { width } else { 1 };
            taken.push((next..next + k).map(|s| s as i32).collect::<Vec<_>>());
            next += k;
        }
        let slots_i = SLOTS as i32;
        let slots =
            self.slots.then(|| taken.iter().map(|t| element(t[0], edge(), slots_i)).collect());
        let (spec_slots, accepted) = match self.spec {
            None => (None, None),
            Some(_) => {
                let mut spec_slots = Vec::with_capacity(n * width);
                let mut accepted = Vec::with_capacity(n);
                for (j, t) in taken.iter().enumerate() {
                    let spec = request(j).filter(|r| speculative(r));
                    for i in 0..width {
                        let plausible = if spec.is_some() { t[i % t.len()] } else { -1 };
                        spec_slots.push(element(plausible, edge(), slots_i));
                    }
                    let plausible = spec.map_or(0, |r| 1 + i32::from(r.accepted) % width as i32);
                    accepted.push(element(plausible, edge(), width as i32 + 1));
                }
                (Some(spec_slots), Some(accepted))
            }
        };
        Arrays { rows, requests, num_spec, qsl, computed, slots, spec_slots, accepted }
    }
}

fn ptr_of(v: &Option<Vec<i32>>) -> *const i32 {
    v.as_ref().map_or(ptr::null(), |v| v.as_ptr())
}

fn widen(v: &[i32]) -> Vec<i64> {
    v.iter().map(|&x| i64::from(x)).collect()
}

/// The same batch as the Rust API's arguments, where the C arguments can be said in them:
/// counts within their arrays, and `spec_slots` given wherever `num_accepted_tokens` is.
fn rust_args(a: &Arrays, rows: usize) -> Option<BatchArgs> {
    if a.requests > rows || a.num_spec > SPEC {
        return None;
    }
    let r = a.requests;
    let qsl = match &a.qsl {
        Some(q) => widen(q),
        None if r == 0 => Vec::new(),
        None => return None,
    };
    let single =
        |i: usize| SlotsArg::Single(a.slots.as_ref().map_or(i as i64, |s| i64::from(s[i])));
    let slots = match (&a.accepted, &a.spec_slots) {
        (Some(acc), Some(spec)) => (0..r)
            .map(|i| {
                let width = a.num_spec + 1;
                if acc[i] > 0 {
                    SlotsArg::Speculative(widen(&spec[i * width..(i + 1) * width]))
                } else {
                    single(i)
                }
            })
            .collect(),
        _ => (0..r).map(single).collect(),
    };
    Some(BatchArgs {
        query_start_loc: qsl,
        num_computed_tokens: a.computed.as_deref().map(widen),
        slots: Some(slots),
        num_accepted_tokens: a.accepted.as_deref().map(widen),
    })
}

/// Mostly f32 and bf16; now and then f16 (not an input dtype) or a code that is none.
fn dtype_code(pick: u8) -> i32 {
    match pick {
        0 => 2,
        1 => 3,
        2 => -1,
        p => i32::from(p % 2),
    }
}

fn dtype_of(code: i32) -> DType {
    match code {
        1 => DType::BF16,
        2 => DType::F16,
        _ => DType::F32,
    }
}

fn check_case(case: &Case) -> Result<(), TestCaseError> {
    let f = fixture();
    let a = case.arrays();
    let rows = a.rows;
    let batch = KdaBatch {
        num_requests: a.requests,
        query_start_loc: ptr_of(&a.qsl),
        num_computed_tokens: ptr_of(&a.computed),
        slots: ptr_of(&a.slots),
        num_spec: a.num_spec,
        spec_slots: ptr_of(&a.spec_slots),
        num_accepted_tokens: ptr_of(&a.accepted),
    };
    let (hidden_code, out_code) = (dtype_code(case.hidden_dtype), dtype_code(case.out_dtype));
    // Buffers of f32 size hold the rows in any of the dtypes.
    let x: Vec<f32> = (0..rows * f.hidden).map(|i| ((i * 13 % 29) as f32 - 14.0) / 16.0).collect();
    let mut out = vec![0f32; rows * f.hidden];
    let cache = CCache::new(f);
    // SAFETY: live handles; every array is as long as its count when the count is within its
    // bound (`Case::arrays`), which is what the property checks.
    let status = unsafe {
        kda_layer_forward(
            f.layer,
            cache.0,
            x.as_ptr().cast(),
            hidden_code,
            rows,
            &batch,
            out.as_mut_ptr().cast::<c_void>(),
            out_code,
            0,
        )
    };
    let message = last_error();
    prop_assert!(
        !matches!(status, KdaStatus::ErrorInternal | KdaStatus::ErrorBackend),
        "{status:?}: {message}"
    );
    let states = cache.states(f);
    if status != KdaStatus::Ok {
        prop_assert!(!message.is_empty());
        prop_assert!(states.iter().all(|&v| v == 0.0), "a rejected call changed the cache");
        prop_assert!(out.iter().all(|&v| v == 0.0), "a rejected call wrote out: {message}");
    }
    // The Rust API on the same batch: accepted exactly when the C call was, with the same
    // output and states.
    let Some(args) = rust_args(&a, rows) else {
        prop_assert_ne!(status, KdaStatus::Ok, "a batch the Rust API cannot express was accepted");
        return Ok(());
    };
    if !(0..=2).contains(&hidden_code) || !(0..=2).contains(&out_code) {
        prop_assert_eq!(status, KdaStatus::ErrorArgument, "{}", message);
        return Ok(());
    }
    let rust_cache = f.rust.new_cache(SLOTS, SPEC).unwrap();
    let mut rust_out = vec![0f32; rows * f.hidden];
    let array = |p: *mut u8, code: i32| {
        // SAFETY: host arrays of `rows` rows of f32 size, alive until the call returns.
        unsafe {
            ForeignArray::new(
                p,
                dtype_of(code),
                vec![rows, f.hidden],
                None,
                Memory::Host,
                Box::new(()),
            )
        }
        .unwrap()
    };
    let (xa, ya) = (
        array(x.as_ptr().cast_mut().cast(), hidden_code),
        array(rust_out.as_mut_ptr().cast(), out_code),
    );
    // SAFETY: kda's own stream; the arrays outlive the call.
    let rust = unsafe { f.rust.forward(xa, &args, &rust_cache, ya, None) };
    match rust {
        Ok(_) => {
            prop_assert_eq!(status, KdaStatus::Ok, "{}", message);
            prop_assert!(out == rust_out, "C and Rust outputs differ");
            let rust_states: Vec<f32> =
                (0..SLOTS).flat_map(|s| rust_cache.recurrent_state(&f.rust, s).unwrap()).collect();
            prop_assert!(states == rust_states, "C and Rust states differ");
        }
        Err(e) => prop_assert_ne!(status, KdaStatus::Ok, "C accepted what Rust refused: {}", e),
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn every_forward_count_near_its_bound_is_a_typed_error_or_the_rust_result(case in cases()) {
        check_case(&case)?;
    }

    #[test]
    fn cache_counts_near_their_bounds_are_typed_errors_or_caches(
        slots in any::<u8>(), spec in any::<u8>(), slot in any::<u8>(), len in any::<u8>()
    ) {
        let f = fixture();
        let (num_slots, num_spec) = (count(slots, SLOTS, SLOTS), count(spec, SPEC, SPEC));
        let mut cache = ptr::null_mut();
        // SAFETY: a live layer and a valid out-pointer.
        let status = unsafe { kda_cache_create(f.layer, num_slots, num_spec, &mut cache) };
        if num_slots == 0 || num_slots >= 1 << 40 || num_spec >= 1 << 40 {
            // Sizes no memory holds (`ErrorShape`) or this host cannot give (`ErrorBackend`,
            // out of memory), the caller's values in the message either way.
            let message = last_error();
            prop_assert!(
                matches!(status, KdaStatus::ErrorShape | KdaStatus::ErrorBackend),
                "{:?}: {}", status, message
            );
            prop_assert!(cache.is_null());
            let given = format!("a cache of num_slots = {num_slots}, num_spec = {num_spec}: ");
            prop_assert!(message.starts_with(&given), "{}", message);
            return Ok(());
        }
        prop_assert_eq!(status, KdaStatus::Ok, "{}", last_error());
        let cache = CCache(cache);
        let (slot, len) = (count(slot, num_slots, 0), count(len, f.state_len, f.state_len));
        let mut state = vec![0f32; f.state_len];
        // SAFETY: live handles; `state` holds `state_len` floats, all the call may write.
        let status = unsafe {
            kda_cache_recurrent_state(f.layer, cache.0, slot, state.as_mut_ptr(), len)
        };
        let message = last_error();
        if slot >= num_slots {
            prop_assert_eq!(status, KdaStatus::ErrorMetadata, "{}", message);
            prop_assert!(message.contains(&format!("slot = {slot}")), "{}", message);
        } else if len != f.state_len {
            prop_assert_eq!(status, KdaStatus::ErrorShape, "{}", message);
            prop_assert!(message.contains(&format!("len = {len}")), "{}", message);
        } else {
            prop_assert_eq!(status, KdaStatus::Ok, "{}", message);
            prop_assert!(state.iter().all(|&v| v == 0.0));
        }
    }
}

/// The engine entry points' counts, checked before what they size is read: `num_keep` against
/// the cache's slots (each kept state needs its own; `keep_states` is two triples long here),
/// a weight's `rank` against the highest a checkpoint tensor has (its `shape` is NULL here, so
/// a rank read first would be reported as a NULL shape), and a wrapped cache's `num_spec`
/// whose conv rows `W - 1 + num_spec` would wrap.
#[test]
fn engine_counts_are_bounded_before_their_arrays_are_read() {
    let f = fixture();
    let cache = CCache::new(f);
    let before = cache.states(f);
    let (qsl, slots) = ([0i32, 10], [0i32]);
    let batch = KdaBatch {
        num_requests: 1,
        query_start_loc: qsl.as_ptr(),
        slots: slots.as_ptr(),
        ..empty_batch()
    };
    let keep = [0i32, 10, 1, 0, 10, 2];
    let x = vec![0f32; 10 * f.hidden];
    let mut out = vec![0f32; 10 * f.hidden];
    for num_keep in [SLOTS + 1, 1 << 40, usize::MAX] {
        // SAFETY: live handles, arrays of 10 rows; `num_keep` is refused before `keep` is read.
        let status = unsafe {
            kda_layer_forward_keeping_states(
                f.layer,
                cache.0,
                x.as_ptr().cast(),
                KdaDtype::F32 as i32,
                10,
                &batch,
                keep.as_ptr(),
                num_keep,
                out.as_mut_ptr().cast(),
                KdaDtype::F32 as i32,
                0,
            )
        };
        assert_eq!(status, KdaStatus::ErrorMetadata, "{}", last_error());
        assert_eq!(
            last_error(),
            format!(
                "batch metadata: num_keep = {num_keep}, expected at most {SLOTS} (the cache's \
                 slots: each kept state needs its own)"
            )
        );
    }
    assert!(out.iter().all(|&v| v == 0.0), "a rejected call wrote out");
    assert_eq!(cache.states(f), before, "rejected calls left the cache as it was");

    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("bounds-checkpoint");
    let json = std::fs::read_to_string(dir.join("config.json")).unwrap();
    let (name, config) = (CString::new("w").unwrap(), CString::new(json).unwrap());
    let weight =
        KdaWeight { name: name.as_ptr(), data: ptr::null(), dtype: 0, rank: 9, shape: ptr::null() };
    let backend_name = CString::new("reference").unwrap();
    let (mut backend, mut layer) = (ptr::null_mut(), ptr::null_mut());
    // SAFETY: a valid name and out-pointer; a one-entry weight table.
    unsafe {
        assert_eq!(kda_backend_create(backend_name.as_ptr(), 0, &mut backend), KdaStatus::Ok);
        let status =
            kda_layer_from_weights(backend, config.as_ptr(), &weight, 1, 0, 1, 0, 1, &mut layer);
        kda_backend_destroy(backend);
        assert_eq!(status, KdaStatus::ErrorMetadata, "{}", last_error());
    }
    assert_eq!(
        last_error(),
        "batch metadata: weights.rank = 9, expected at most 8 (a checkpoint tensor's rank)"
    );

    let mut wrapped = ptr::null_mut();
    let mut conv = [0f32; 4];
    // SAFETY: a live layer; `num_spec` is refused before the arrays are described.
    let status = unsafe {
        kda_cache_wrap(
            f.layer,
            conv.as_mut_ptr().cast(),
            KdaDtype::F32 as i32,
            conv.as_mut_ptr().cast(),
            0,
            1,
            usize::MAX,
            &mut wrapped,
        )
    };
    assert_eq!(status, KdaStatus::ErrorMetadata, "{}", last_error());
    assert!(last_error().contains(&format!("num_spec = {}", usize::MAX)), "{}", last_error());
}
