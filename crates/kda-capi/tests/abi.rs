//! The C ABI called as C would call it: status codes and the thread-local message for each
//! class of error, NULL handles, a speculative batch through `KdaBatch` equal to the Rust API.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test")]

use std::ffi::{CStr, CString, c_void};
use std::path::PathBuf;
use std::ptr;

use kda_capi::*;
use kda_core::DType;
use kda_embed::testing::{LayerSpec, Step, reference_run, write_synthetic_checkpoint};
use kda_embed::{BatchArgs, SlotsArg};
use kda_model::schedule::ProjectionSchedule;

fn last_error() -> String {
    // SAFETY: a NUL-terminated string owned by this thread's slot.
    unsafe { CStr::from_ptr(kda_last_error()) }.to_str().unwrap().to_string()
}

fn checkpoint() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("abi-checkpoint");
    write_synthetic_checkpoint(&dir, "tiny", 2).unwrap();
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

#[test]
fn status_codes_messages_and_a_speculative_batch() {
    let dir = checkpoint();
    let mut backend = ptr::null_mut();
    // SAFETY: every call below gets live handles, valid strings and arrays of the sizes given.
    unsafe {
        let name = CString::new("tpu").unwrap();
        assert_eq!(kda_backend_create(name.as_ptr(), 0, &mut backend), KdaStatus::ErrorArgument);
        assert!(last_error().starts_with("backend: \"tpu\" is not one of"));
        let name = CString::new("reference").unwrap();
        assert_eq!(kda_backend_create(name.as_ptr(), 0, &mut backend), KdaStatus::Ok);

        let mut layer = ptr::null_mut();
        let missing = CString::new("/nonexistent/kda").unwrap();
        let status = kda_layer_load(backend, missing.as_ptr(), 0, 1, 0, 1, &mut layer);
        assert_eq!(status, KdaStatus::ErrorCheckpoint, "{}", last_error());
        let path = CString::new(dir.to_str().unwrap()).unwrap();
        assert_eq!(
            kda_layer_load(backend, path.as_ptr(), 0, 1, 0, 2, &mut layer),
            KdaStatus::ErrorArgument
        );
        assert_eq!(kda_layer_load(backend, path.as_ptr(), 0, 1, 0, 1, &mut layer), KdaStatus::Ok);
        kda_backend_destroy(backend); // the layer keeps the backend alive
        let mut info = KdaLayerInfo { hidden_size: 0, local_heads: 0, head_dim: 0, conv_width: 0 };
        assert_eq!(kda_layer_info(layer, &mut info), KdaStatus::Ok);
        assert_eq!(kda_layer_info(ptr::null(), &mut info), KdaStatus::ErrorArgument);
        assert_eq!(last_error(), "layer: NULL, expected a non-null pointer");
        let h = info.hidden_size;

        let mut cache = ptr::null_mut();
        assert_eq!(kda_cache_create(layer, 4, 2, &mut cache), KdaStatus::Ok);
        let x: Vec<f32> = (0..12 * h).map(|i| ((i * 37 % 101) as f32 - 50.0) / 64.0).collect();
        let mut out = vec![0f32; 10 * h];
        let forward = |b: &KdaBatch, rows: usize, x: &[f32], out: &mut [f32], dtype: i32| {
            kda_layer_forward(
                layer,
                cache,
                x.as_ptr().cast(),
                dtype,
                rows,
                b,
                out.as_mut_ptr().cast::<c_void>(),
                0,
                0,
            )
        };
        // Each error class, and the cache unchanged after each.
        let mut state = vec![0f32; info.local_heads * info.head_dim * info.head_dim];
        let prefill = batch(&[0, 7], None, Some(&[1]));
        assert_eq!(forward(&prefill, 7, &x, &mut out, KdaDtype::F32 as i32), KdaStatus::Ok);
        assert_eq!(
            kda_cache_recurrent_state(layer, cache, 1, state.as_mut_ptr(), state.len()),
            KdaStatus::Ok
        );
        let before = state.clone();
        assert_eq!(forward(&prefill, 7, &x, &mut out, 9), KdaStatus::ErrorArgument);
        assert_eq!(
            forward(&batch(&[0, 8], None, None), 7, &x, &mut out, 0),
            KdaStatus::ErrorMetadata
        );
        assert_eq!(
            last_error(),
            "batch metadata: 8 live tokens but the hidden states have only 7 rows"
        );
        assert_eq!(forward(&prefill, 7, &x, &mut out, KdaDtype::F16 as i32), KdaStatus::ErrorShape);
        assert_eq!(
            kda_cache_recurrent_state(layer, cache, 1, state.as_mut_ptr(), 3),
            KdaStatus::ErrorShape
        );
        assert_eq!(
            kda_cache_recurrent_state(layer, cache, 1, state.as_mut_ptr(), state.len()),
            KdaStatus::Ok
        );
        assert_eq!(state, before, "rejected calls left the cache as it was");

        // A mixed step: request 0 a speculative decode of 3 tokens over slots [1, 2, 3] (its
        // `slots` entry unused), request 1 a fresh prefill of 2 tokens into slot 0.
        let qsl = [0, 3, 5];
        let computed = [7, 0];
        let slots = [9, 0];
        let spec_slots = [1, 2, 3, -1, -1, -1];
        let accepted = [1, 0];
        let spec = KdaBatch {
            num_requests: 2,
            query_start_loc: qsl.as_ptr(),
            num_computed_tokens: computed.as_ptr(),
            slots: slots.as_ptr(),
            num_spec: 2,
            spec_slots: spec_slots.as_ptr(),
            num_accepted_tokens: accepted.as_ptr(),
        };
        let x2 = &x[7 * h..];
        let mut out_spec = vec![0f32; 5 * h];
        assert_eq!(forward(&spec, 5, x2, &mut out_spec, 0), KdaStatus::Ok, "{}", last_error());

        let rust = reference_run(
            &LayerSpec {
                dir: &dir,
                layer: 0,
                tp_size: 1,
                tp_rank: 0,
                schedule: ProjectionSchedule::Overlapped,
            },
            4,
            2,
            &[
                Step {
                    hidden: x[..7 * h].to_vec(),
                    dtype: DType::F32,
                    rows: 7,
                    batch: BatchArgs {
                        query_start_loc: vec![0, 7],
                        slots: Some(vec![SlotsArg::Single(1)]),
                        ..Default::default()
                    },
                },
                Step {
                    hidden: x2[..5 * h].to_vec(),
                    dtype: DType::F32,
                    rows: 5,
                    batch: BatchArgs {
                        query_start_loc: vec![0, 3, 5],
                        num_computed_tokens: Some(vec![7, 0]),
                        slots: Some(vec![
                            SlotsArg::Speculative(vec![1, 2, 3]),
                            SlotsArg::Single(0),
                        ]),
                        num_accepted_tokens: Some(vec![1, 0]),
                    },
                },
            ],
        )
        .unwrap();
        assert_eq!(out[..7 * h], rust.outputs[0][..]);
        assert_eq!(out_spec, rust.outputs[1]);
        for slot in 0..4 {
            assert_eq!(
                kda_cache_recurrent_state(layer, cache, slot, state.as_mut_ptr(), state.len()),
                KdaStatus::Ok
            );
            let n = state.len();
            assert_eq!(state[..], rust.states[slot * n..(slot + 1) * n]);
        }
        kda_cache_destroy(cache);
        kda_layer_destroy(layer);
        kda_layer_destroy(ptr::null_mut());
        assert!(CStr::from_ptr(kda_version()).to_str().unwrap().starts_with("0."));
    }
}
