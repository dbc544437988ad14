//! The engine's own memory through the C ABI: a layer from a name -> pointer table equal to the
//! loaded one bit for bit, the engine's cache in place, and prefix-cache states.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test")]

use std::ffi::{CStr, CString, c_void};
use std::path::PathBuf;
use std::ptr;

use kda_capi::*;
use kda_core::DType;
use kda_embed::testing::write_synthetic_checkpoint;
use kda_model::weights::source::read_all;
use kda_model::weights::{Checkpoint, TensorSource};

fn last_error() -> String {
    // SAFETY: a NUL-terminated string owned by this thread's slot.
    unsafe { CStr::from_ptr(kda_last_error()) }.to_str().unwrap().to_string()
}

fn checkpoint(preset: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("engine-{preset}"));
    write_synthetic_checkpoint(&dir, preset, 4).unwrap();
    dir
}

fn batch(qsl: &[i32], computed: Option<&[i32]>, slots: Option<&[i32]>) -> KdaBatch {
    KdaBatch {
        num_requests: qsl.len() - 1,
        query_start_loc: qsl.as_ptr(),
        num_computed_tokens: computed.map_or(ptr::null(), <[i32]>::as_ptr),
        slots: slots.map_or(ptr::null(), <[i32]>::as_ptr),
        num_spec: 0,
        spec_slots: ptr::null(),
        num_accepted_tokens: ptr::null(),
    }
}

fn inputs(rows: usize, hidden: usize, seed: u32) -> Vec<f32> {
    let mut s = seed;
    (0..rows * hidden)
        .map(|_| {
            s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            ((s >> 16) & 0xFFFF) as f32 / 65536.0 - 0.5
        })
        .collect()
}

/// Prefill 70 + 5 tokens in slots 1 and 0, then one decode step; the outputs.
///
/// # Safety
/// Live handles.
unsafe fn two_steps(layer: *const KdaLayer, cache: *const KdaCache, hidden: usize) -> Vec<f32> {
    let mut outputs = Vec::new();
    let (qsl, slots) = ([0, 70, 75], [1, 0]);
    let x = inputs(75, hidden, 9);
    let mut out = vec![0f32; 75 * hidden];
    let b = batch(&qsl, None, Some(&slots));
    let (xp, op) = (x.as_ptr().cast::<c_void>(), out.as_mut_ptr().cast::<c_void>());
    // SAFETY: the caller's live handles; arrays of the sizes given.
    let s = unsafe { kda_layer_forward(layer, cache, xp, 0, 75, &b, op, 0, 0) };
    assert_eq!(s, KdaStatus::Ok, "{}", last_error());
    outputs.extend_from_slice(&out);
    let (qsl, computed) = ([0, 1, 2], [70, 5]);
    let x = inputs(2, hidden, 10);
    let b = batch(&qsl, Some(&computed), Some(&slots));
    let (xp, op) = (x.as_ptr().cast::<c_void>(), out.as_mut_ptr().cast::<c_void>());
    // SAFETY: as above.
    let s = unsafe { kda_layer_forward(layer, cache, xp, 0, 2, &b, op, 0, 0) };
    assert_eq!(s, KdaStatus::Ok, "{}", last_error());
    outputs.extend_from_slice(&out[..2 * hidden]);
    outputs
}

#[test]
fn a_layer_from_a_weight_table_is_the_loaded_layer_bit_for_bit() {
    for preset in ["tiny", "tiny-linear"] {
        let dir = checkpoint(preset);
        let source = Checkpoint::open(&dir).unwrap();
        let tensors: Vec<_> = source
            .names()
            .into_iter()
            .map(|n| {
                let t = read_all(&*source.tensor(&n).unwrap()).unwrap();
                (CString::new(n).unwrap(), t)
            })
            .collect();
        let table: Vec<KdaWeight> = tensors
            .iter()
            .map(|(name, t)| KdaWeight {
                name: name.as_ptr(),
                data: t.as_bytes().as_ptr().cast(),
                dtype: match t.dtype() {
                    DType::F32 => 0,
                    DType::BF16 => 1,
                    DType::F16 => 2,
                    _ => 3,
                },
                rank: t.shape().len(),
                shape: t.shape().as_ptr(),
            })
            .collect();
        let config =
            CString::new(std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
        let path = CString::new(dir.to_str().unwrap()).unwrap();
        let name = CString::new("reference").unwrap();
        // SAFETY: live handles, valid strings, the table's arrays alive during the calls.
        unsafe {
            let mut backend = ptr::null_mut();
            assert_eq!(kda_backend_create(name.as_ptr(), 0, &mut backend), KdaStatus::Ok);
            let (mut loaded, mut built) = (ptr::null_mut(), ptr::null_mut());
            let s = kda_layer_load(backend, path.as_ptr(), 0, 1, 0, 1, &mut loaded);
            assert_eq!(s, KdaStatus::Ok, "{}", last_error());
            let (t, n) = (table.as_ptr(), table.len());
            let s = kda_layer_from_weights(backend, config.as_ptr(), t, n, 0, 1, 0, 1, &mut built);
            assert_eq!(s, KdaStatus::Ok, "{}", last_error());
            // One weight short: the loader's error, naming it.
            let mut none = ptr::null_mut();
            let s =
                kda_layer_from_weights(backend, config.as_ptr(), t, n - 1, 0, 1, 0, 1, &mut none);
            assert_eq!(s, KdaStatus::ErrorCheckpoint);
            assert!(last_error().contains("missing"), "{}", last_error());
            let bad = CString::new("{\"hidden_size\": 0}").unwrap();
            let s = kda_layer_from_weights(backend, bad.as_ptr(), t, n, 0, 1, 0, 1, &mut none);
            assert_eq!(s, KdaStatus::ErrorCheckpoint);
            assert!(none.is_null());
            let mut info = std::mem::zeroed::<KdaLayerInfo>();
            assert_eq!(kda_layer_info(built, &mut info), KdaStatus::Ok);
            let (mut a, mut b) = (ptr::null_mut(), ptr::null_mut());
            assert_eq!(kda_cache_create(loaded, 2, 0, &mut a), KdaStatus::Ok);
            assert_eq!(kda_cache_create(built, 2, 0, &mut b), KdaStatus::Ok);
            let want = two_steps(loaded, a, info.hidden_size);
            let got = two_steps(built, b, info.hidden_size);
            assert!(want.iter().zip(&got).all(|(x, y)| x.to_bits() == y.to_bits()), "{preset}");
            kda_cache_destroy(a);
            kda_cache_destroy(b);
            kda_layer_destroy(loaded);
            kda_layer_destroy(built);
            kda_backend_destroy(backend);
        }
    }
}

#[test]
fn wrapped_caches_and_kept_states() {
    let dir = checkpoint("tiny-linear");
    let path = CString::new(dir.to_str().unwrap()).unwrap();
    let name = CString::new("reference").unwrap();
    // SAFETY: live handles, valid strings, arrays of the sizes given, alive while used.
    unsafe {
        let mut backend = ptr::null_mut();
        assert_eq!(kda_backend_create(name.as_ptr(), 0, &mut backend), KdaStatus::Ok);
        let mut layer = ptr::null_mut();
        assert_eq!(kda_layer_load(backend, path.as_ptr(), 0, 1, 0, 1, &mut layer), KdaStatus::Ok);
        let mut info = std::mem::zeroed::<KdaLayerInfo>();
        assert_eq!(kda_layer_info(layer, &mut info), KdaStatus::Ok);
        let (h, d, w) = (info.local_heads, info.head_dim, info.conv_width);
        let (channels, state) = (3 * h * d, h * d * d);
        let mut own = ptr::null_mut();
        assert_eq!(kda_cache_create(layer, 3, 0, &mut own), KdaStatus::Ok);
        let want = two_steps(layer, own, info.hidden_size);

        // transformers' layout: conv [N, C, W], recurrent [N, lh, K, V].
        let mut conv = vec![0f32; 3 * channels * w];
        let mut rec = vec![0f32; 3 * state];
        let mut wrapped = ptr::null_mut();
        let (cp, rp) = (conv.as_mut_ptr().cast::<c_void>(), rec.as_mut_ptr().cast::<c_void>());
        assert_eq!(
            kda_cache_wrap(layer, cp, 0, rp, 9, 3, 0, &mut wrapped),
            KdaStatus::ErrorArgument
        );
        assert_eq!(
            kda_cache_wrap(layer, cp, 0, rp, 2, 3, 1, &mut wrapped),
            KdaStatus::ErrorArgument
        );
        assert_eq!(
            kda_cache_wrap(layer, cp, 7, rp, 2, 3, 0, &mut wrapped),
            KdaStatus::ErrorArgument
        );
        assert_eq!(kda_cache_wrap(layer, cp, 0, rp, 2, 3, 0, &mut wrapped), KdaStatus::Ok);
        let got = two_steps(layer, wrapped, info.hidden_size);
        assert!(want.iter().zip(&got).all(|(x, y)| x.to_bits() == y.to_bits()));
        let mut own_state = vec![0f32; state];
        let mut own_conv = vec![0f32; (w - 1) * channels];
        for slot in 0..2 {
            let s = kda_cache_recurrent_state(layer, own, slot, own_state.as_mut_ptr(), state);
            assert_eq!(s, KdaStatus::Ok);
            let engine = &rec[slot * state..(slot + 1) * state];
            for (head, v, k) in
                (0..h).flat_map(|a| (0..d).flat_map(move |b| (0..d).map(move |c| (a, b, c))))
            {
                // kda's [lh, V, K] against the engine's [lh, K, V].
                let (mine, theirs) =
                    (own_state[(head * d + v) * d + k], engine[(head * d + k) * d + v]);
                assert_eq!(mine.to_bits(), theirs.to_bits());
            }
            let s = kda_cache_conv_state(layer, own, slot, own_conv.as_mut_ptr(), own_conv.len());
            assert_eq!(s, KdaStatus::Ok);
            for (row, c) in (0..w - 1).flat_map(|r| (0..channels).map(move |c| (r, c))) {
                let theirs = conv[(slot * channels + c) * w + 1 + row];
                assert_eq!(own_conv[row * channels + c].to_bits(), theirs.to_bits());
            }
        }
        let short = own_conv.len() - 1;
        let s = kda_cache_conv_state(layer, own, 0, own_conv.as_mut_ptr(), short);
        assert_eq!(s, KdaStatus::ErrorShape, "{}", last_error());

        // Kept states: the state after the whole 100-token request, kept in slot 2, is the
        // request's own final state bit for bit; a bad triple runs nothing.
        let x = inputs(100, info.hidden_size, 11);
        let mut out = vec![0f32; 100 * info.hidden_size];
        let (qsl, slots) = ([0, 100], [0]);
        let b = batch(&qsl, None, Some(&slots));
        let (xp, op) = (x.as_ptr().cast::<c_void>(), out.as_mut_ptr().cast::<c_void>());
        let bad = [0, 50, 2];
        let s =
            kda_layer_forward_keeping_states(layer, own, xp, 0, 100, &b, bad.as_ptr(), 1, op, 0, 0);
        assert_eq!(s, KdaStatus::ErrorMetadata, "{}", last_error());
        assert!(last_error().contains("keep[0]"), "{}", last_error());
        let keep = [0, 64, 1, 0, 100, 2];
        let s = kda_layer_forward_keeping_states(
            layer,
            own,
            xp,
            0,
            100,
            &b,
            keep.as_ptr(),
            2,
            op,
            0,
            0,
        );
        assert_eq!(s, KdaStatus::Ok, "{}", last_error());
        let (mut end, mut kept) = (vec![0f32; state], vec![0f32; state]);
        assert_eq!(
            kda_cache_recurrent_state(layer, own, 0, end.as_mut_ptr(), state),
            KdaStatus::Ok
        );
        assert_eq!(
            kda_cache_recurrent_state(layer, own, 2, kept.as_mut_ptr(), state),
            KdaStatus::Ok
        );
        assert!(end.iter().zip(&kept).all(|(a, b)| a.to_bits() == b.to_bits()));
        assert!(kept.iter().any(|v| *v != 0.0));

        kda_cache_destroy(wrapped);
        kda_cache_destroy(own);
        kda_layer_destroy(layer);
        kda_backend_destroy(backend);
    }
}
