//! The backend conformance suite: test bodies generic over [`Backend`], instantiated for each
//! backend crate by [`conformance_tests!`](crate::conformance_tests).
//!
//! Every body checks real values against an independent computation (f64 oracles, or values
//! that only the right event order can produce). Bodies that could hang on a broken backend run
//! under a watchdog, so a wrong implementation fails instead of stalling CI.

pub mod gemm;
pub mod kda;
pub mod layer;
pub mod mx;
pub mod sanitize;
pub mod schedule;
pub mod streams;
pub mod views;

use std::sync::mpsc;
use std::time::Duration;

use kda_core::Backend;
use kda_core::Device;

/// Instantiate the whole suite as `#[test]` functions in the calling module.
///
/// `$plain` builds a fresh backend instance; `$jittered` builds one that injects random delays
/// before queued work (or a plain one, for a backend without such a hook); `$checked` builds one
/// in checked mode (the sanitizer's own tests).
#[macro_export]
macro_rules! conformance_tests {
    (plain: $plain:expr, jittered: $jittered:expr, checked: $checked:expr $(,)?) => {
        $crate::conformance_tests!(@tests
            streams_run_concurrently => streams::run_concurrently(&$plain),
            wait_before_record_is_a_no_op => streams::wait_before_record_is_a_no_op(&$plain),
            rerecord_after_wait_keeps_the_earlier_snapshot =>
                streams::rerecord_after_wait_keeps_the_earlier_snapshot(&$plain),
            event_chain_across_two_streams_under_jitter =>
                streams::event_chain_across_two_streams(&$jittered, 1000),
            execution_errors_surface_at_synchronize =>
                streams::execution_errors_surface_at_synchronize(&$plain),
            handles_of_another_instance_are_rejected =>
                streams::handles_of_another_instance_are_rejected(&$plain),
            gemm_matches_f64_at_small_shapes => gemm::matches_f64_at_small_shapes(&$plain),
            gemm_matches_f64_at_k3_tp8_shapes => gemm::matches_f64_at_k3_tp8_shapes(&$plain),
            gemm_reads_and_writes_strided_views => gemm::reads_and_writes_strided_views(&$plain),
            gemm_rejects_bad_operands => gemm::rejects_bad_operands(&$plain),
            views_share_the_buffer => views::share_the_buffer(&$plain),
            views_copy_and_fill_address_the_right_elements =>
                views::copy_and_fill_address_the_right_elements(&$plain),
            views_bad_input_is_an_error => views::bad_input_is_an_error(&$plain),
            sanitize_fork_join_is_clean => sanitize::fork_join_is_clean(&$checked),
            sanitize_missing_join_names_the_consumer =>
                sanitize::missing_join_names_the_consumer(&$checked),
            sanitize_disjoint_views_do_not_conflict =>
                sanitize::disjoint_views_do_not_conflict(&$checked),
            sanitize_free_while_in_use_is_reported =>
                sanitize::free_while_in_use_is_reported(&$checked),
            sanitize_log_can_be_edited_and_reanalysed =>
                sanitize::log_can_be_edited_and_reanalysed(&$checked),
            capture_fork_join_replays_to_identical_results =>
                sanitize::capture_fork_join_replays_to_identical_results(&$checked),
            capture_invalid_cases_are_rejected => sanitize::capture_invalid_cases_are_rejected(&$plain),
            capture_bad_calls_are_typed_errors => sanitize::capture_bad_calls_are_typed_errors(&$plain),
            kda_conv_prefill_matches_f64 => kda::conv_prefill_matches_f64(&$plain),
            kda_conv_prefill_then_decode_equals_one_prefill =>
                kda::conv_prefill_then_decode_equals_one_prefill(&$plain),
            kda_conv_speculative_update_equals_accepted_decodes =>
                kda::conv_speculative_update_equals_accepted_decodes(&$plain),
            kda_l2norm_matches_f64 => kda::l2norm_matches_f64(&$plain),
            kda_gate_forms_match_f64_at_extremes => kda::gate_forms_match_f64_at_extremes(&$plain),
            kda_gated_rms_norm_matches_f64 => kda::gated_rms_norm_matches_f64(&$plain),
            kda_zero_padding_clears_rows => kda::zero_padding_clears_rows(&$plain),
            kda_recurrence_and_chunk_match_f64 => kda::recurrence_and_chunk_match_f64(&$plain),
            kda_chunk_split_equals_one_call => kda::chunk_split_equals_one_call(&$plain),
            kda_chunk_varlen_batch_matches_f64 => kda::chunk_varlen_batch_matches_f64(&$plain),
            kda_chunk_in_kernel_gate_equals_gate_then_chunk =>
                kda::chunk_in_kernel_gate_equals_gate_then_chunk(&$plain),
            kda_recurrent_speculative_reads_and_writes_slots =>
                kda::recurrent_speculative_reads_and_writes_slots(&$plain),
            kda_ops_reject_bad_operands => kda::kda_ops_reject_bad_operands(&$plain),
            kda_bad_metadata_fails_at_synchronize => kda::kda_bad_metadata_fails_at_synchronize(&$plain),
            kda_nan_inputs_propagate_without_crashing =>
                kda::nan_inputs_propagate_without_crashing(&$plain),
            kda_chunk_reads_and_writes_a_transposed_state_view =>
                kda::chunk_reads_and_writes_a_transposed_state_view(&$plain),
            mx_dynamic_quant_matches_the_codec => mx::dynamic_quant_matches_the_codec(&$plain),
            mx_dynamic_quant_edge_shapes_and_views =>
                mx::dynamic_quant_edge_shapes_and_views(&$plain),
            mx_dequant_matches_the_codec => mx::mx_dequant_matches_the_codec(&$plain),
            mx_gemm_matches_the_spec_bit_for_bit => mx::mx_gemm_matches_the_spec_bit_for_bit(&$plain),
            mx_gemm_matches_dequantized_f64_gemm => mx::mx_gemm_matches_dequantized_f64_gemm(&$plain),
            mx_gemm_error_against_bf16_gemm_within_the_derived_bound =>
                mx::mx_gemm_error_against_bf16_gemm_within_the_derived_bound(&$plain),
            mx_special_values_flow_through => mx::mx_special_values_flow_through(&$plain),
            mx_rejects_bad_operands => mx::mx_rejects_bad_operands(&$plain),
            schedule_overlapped_trace_is_the_seeds_sequence =>
                schedule::overlapped_trace_is_the_seeds_sequence(&$checked),
            schedule_aux_stream_is_created_once_per_instance =>
                schedule::aux_stream_is_created_once_per_instance(&$checked),
            schedule_serial_and_overlapped_are_bit_identical =>
                schedule::serial_and_overlapped_are_bit_identical(&$plain),
            schedule_projection_matches_host_computation =>
                schedule::projection_matches_host_computation(&$plain),
            schedule_overlapped_is_hazard_free => schedule::overlapped_schedule_is_hazard_free(&$checked),
            schedule_mutation_drop_record_hidden_ready =>
                schedule::mutation_drop_record_hidden_ready(&$checked),
            schedule_mutation_drop_wait_hidden_ready =>
                schedule::mutation_drop_wait_hidden_ready(&$checked),
            schedule_mutation_drop_record_bfg_projection_ready =>
                schedule::mutation_drop_record_bfg_projection_ready(&$checked),
            schedule_mutation_drop_wait_bfg_projection_ready =>
                schedule::mutation_drop_wait_bfg_projection_ready(&$checked),
            schedule_mutation_drop_record_quant_ready =>
                schedule::mutation_drop_record_quant_ready(&$checked),
            schedule_mutation_drop_wait_quant_ready =>
                schedule::mutation_drop_wait_quant_ready(&$checked),
            schedule_mutation_drop_record_bfg_ready =>
                schedule::mutation_drop_record_bfg_ready(&$checked),
            schedule_mutation_drop_wait_bfg_ready => schedule::mutation_drop_wait_bfg_ready(&$checked),
            schedule_mutation_record_bfg_ready_before_postprocess =>
                schedule::mutation_record_bfg_ready_before_postprocess(&$checked),
            schedule_capture_replays_equal_eager => schedule::capture_replays_equal_eager(&$checked),
            schedule_stress_jittered_overlapped_equals_serial =>
                schedule::stress_jittered_overlapped_equals_serial(&$jittered, 1000),
            schedule_prepare_beta_slices_and_applies_the_sigmoid_once =>
                schedule::prepare_beta_slices_and_applies_the_sigmoid_once(&$checked),
            schedule_postprocess_shapes => schedule::postprocess_shapes(&$checked),
            schedule_mixed_path_passes_preprocessed_beta =>
                schedule::mixed_path_passes_preprocessed_beta(&$plain),
            schedule_dynamic_quant_split_decision => schedule::dynamic_quant_split_decision(&$plain),
            schedule_projection_rejects_bad_input => schedule::projection_rejects_bad_input(&$checked),
            layer_matches_f64_oracle => layer::matches_f64_oracle(&$plain),
            layer_staged_loader_equals_composed_loader =>
                layer::staged_loader_equals_composed_loader(&$plain),
            layer_norm_uses_the_checkpoint_eps => layer::norm_uses_the_checkpoint_eps(&$plain),
            layer_prefill_whole_equals_parts_and_decodes =>
                layer::prefill_whole_equals_parts_and_decodes(&$plain),
            layer_speculative_equals_single_decodes =>
                layer::speculative_equals_single_decodes(&$plain),
            layer_batch_equals_each_alone => layer::batch_equals_each_alone(&$plain),
            layer_tp_partials_sum_to_tp1 => layer::tp_partials_sum_to_tp1(&$plain),
            layer_padding_and_empty_batch => layer::padding_and_empty_batch(&$plain),
            layer_beta_paths_and_intermediate_shapes =>
                layer::beta_paths_and_intermediate_shapes(&$checked),
            layer_prefill_passes_the_raw_gate_to_the_chunk =>
                layer::prefill_passes_the_raw_gate_to_the_chunk(&$checked),
            layer_overlapped_forward_is_clean_and_replays =>
                layer::overlapped_forward_is_clean_and_replays(&$checked),
            layer_bad_input_leaves_the_cache_unchanged =>
                layer::bad_input_leaves_the_cache_unchanged(&$plain),
            layer_jittered_overlapped_equals_serial =>
                layer::jittered_overlapped_equals_serial(&$jittered, 20),
        );
    };
    (@tests $($name:ident => $module:ident :: $body:ident ( $($arg:tt)* )),* $(,)?) => {
        $(
            #[test]
            fn $name() {
                $crate::conformance::$module::$body($($arg)*);
            }
        )*
    };
}

/// Run `f` on its own thread and fail if it does not finish within `limit` (a hang in a broken
/// backend becomes a test failure). Panics inside `f` are re-raised.
pub fn with_watchdog<R: Send + 'static>(
    what: &str,
    limit: Duration,
    f: impl FnOnce() -> R + Send + 'static,
) -> R {
    let (tx, rx) = mpsc::channel();
    let handle = std::thread::spawn(move || {
        let r = f();
        let _ = tx.send(());
        r
    });
    match rx.recv_timeout(limit) {
        Ok(()) | Err(mpsc::RecvTimeoutError::Disconnected) => match handle.join() {
            Ok(r) => r,
            Err(panic) => std::panic::resume_unwind(panic),
        },
        Err(mpsc::RecvTimeoutError::Timeout) => {
            panic!("{what}: did not finish within {limit:?} (hang or serialised streams)")
        }
    }
}

/// Build a fresh backend from a factory expression.
pub trait Factory<B: Backend>: Fn() -> Device<B> + Send + Sync + Clone + 'static {}
impl<B: Backend, F: Fn() -> Device<B> + Send + Sync + Clone + 'static> Factory<B> for F {}
