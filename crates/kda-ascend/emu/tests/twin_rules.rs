//! The twin rejects each device rule's violation: one deliberately broken kernel per rule
//! (`crates/kda-ascend/twin/tests/broken_kernels.cpp`), built through the twin into a shared
//! library, each failing with that rule's error and naming the kernel, the API and the rule; a
//! correct kernel runs and computes.
#![allow(clippy::expect_used, reason = "test setup")]

use std::sync::{Arc, OnceLock};

use kda_acl_emu::twin::{GmRange, Library, Profile, TwinError, twin_dir};

fn library() -> Arc<Library> {
    static LIB: OnceLock<Arc<Library>> = OnceLock::new();
    LIB.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("kda-twin-rules-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let src = twin_dir().join("tests/broken_kernels.cpp");
        let lib = Library::build(&[src], &[], &dir.join("broken.so")).expect("build");
        Arc::new(lib)
    })
    .clone()
}

/// Launch `kernel` over `blocks` blocks on 64 f32 inputs (1.0 .. 64.0) and 64 outputs.
fn run(kernel: &str, profile: Profile, blocks: u32) -> (Result<(), TwinError>, Vec<f32>) {
    let lib = library();
    let k = lib.kernel(kernel).expect("kernel");
    let x: Vec<f32> = (1..=64).map(|i| i as f32).collect();
    let mut y = vec![0.0f32; 64];
    let gm = [
        GmRange { base: x.as_ptr() as u64, len: 256 },
        GmRange { base: y.as_mut_ptr() as u64, len: 256 },
    ];
    let args = [x.as_ptr() as u64, y.as_mut_ptr() as u64];
    // SAFETY: both ranges are live vectors of 256 bytes that nothing else touches meanwhile.
    let result = unsafe { k.launch(profile, blocks, &args, &gm) };
    (result, y)
}

fn a2() -> Profile {
    Profile::of_soc("Ascend910B3")
}

/// The violation's rule, asserting the kernel is named.
fn rule(kernel: &str, profile: Profile, blocks: u32) -> String {
    match run(kernel, profile, blocks).0 {
        Err(TwinError::Violation { kernel: k, api, rule, detail, .. }) => {
            assert_eq!(k, kernel);
            assert!(!api.is_empty());
            format!("{api}: {rule}: {detail}")
        }
        other => panic!("{kernel}: expected a violation, got {other:?}"),
    }
}

#[test]
fn a_correct_kernel_runs_and_computes() {
    let (result, y) = run("twin_ok", a2(), 4);
    result.expect("twin_ok");
    let want: Vec<f32> = (2..=65).map(|i| i as f32).collect();
    assert_eq!(y, want);
}

#[test]
fn an_unaligned_data_copy_is_rejected() {
    let r = rule("twin_unaligned_copy", a2(), 1);
    assert!(r.contains("DataCopy length not a multiple of 32 bytes"), "{r}");
}

#[test]
fn buffers_past_the_unified_buffer_are_rejected_per_soc() {
    let r = rule("twin_ub_overflow", a2(), 1);
    assert!(r.contains("UB overflow") && r.contains("196608"), "{r}");
    // 256 KiB exceed the 950's 248 KiB too.
    let r = rule("twin_ub_overflow", Profile::of_soc("Ascend950PR_9599"), 1);
    assert!(r.contains("UB overflow") && r.contains("253952"), "{r}");
}

#[test]
fn a_queue_tensor_freed_twice_is_rejected() {
    let r = rule("twin_double_free", a2(), 1);
    assert!(r.contains("TQue::FreeTensor") && r.contains("double free"), "{r}");
}

#[test]
fn a_scalar_read_of_a_vector_result_without_a_flag_is_rejected() {
    let r = rule("twin_unsynced_scalar_read", a2(), 1);
    assert!(r.contains("LocalTensor::GetValue") && r.contains("unsynchronised read"), "{r}");
}

/// Write after read: a scalar store into a vector instruction's operand before the vector unit
/// is done with it.
#[test]
fn a_scalar_write_of_a_vector_operand_without_a_flag_is_rejected() {
    let r = rule("twin_unsynced_scalar_write_after_vector_read", a2(), 1);
    assert!(r.contains("LocalTensor::SetValue") && r.contains("another pipe still reads"), "{r}");
}

#[test]
fn two_blocks_writing_one_gm_range_are_rejected() {
    let r = rule("twin_two_blocks_one_range", a2(), 2);
    assert!(r.contains("two blocks write the same GM bytes"), "{r}");
    // One block alone is fine.
    run("twin_two_blocks_one_range", a2(), 1).0.expect("one block");
}

#[test]
fn a_vector_chain_without_a_barrier_is_rejected() {
    let r = rule("twin_vector_chain_without_barrier", a2(), 1);
    assert!(r.contains("without PipeBarrier<PIPE_V>"), "{r}");
}

#[test]
fn an_unpaired_set_flag_is_rejected() {
    let r = rule("twin_set_flag_unpaired", a2(), 1);
    assert!(r.contains("SetFlag without a WaitFlag"), "{r}");
}

#[test]
fn an_unaligned_vector_operand_is_rejected() {
    let r = rule("twin_unaligned_operand", a2(), 1);
    assert!(r.contains("Duplicate") && r.contains("not 32-byte aligned"), "{r}");
}

#[test]
fn a_scalar_gm_read_without_invalidation_is_rejected() {
    let r = rule("twin_stale_scalar_read", a2(), 1);
    assert!(r.contains("without DataCacheCleanAndInvalid"), "{r}");
}

#[test]
fn a_copy_past_the_launch_buffers_is_rejected() {
    let r = rule("twin_gm_out_of_bounds", a2(), 1);
    assert!(r.contains("GM access outside the launch's buffers"), "{r}");
}

#[test]
fn a_queue_tensor_never_freed_is_rejected() {
    let r = rule("twin_alloc_without_free", a2(), 1);
    assert!(r.contains("AllocTensor without FreeTensor"), "{r}");
}

#[test]
fn a_block_reading_another_blocks_output_is_rejected() {
    let r = rule("twin_block_reads_another_blocks_output", a2(), 2);
    assert!(r.contains("a block reads GM bytes another block writes"), "{r}");
}

fn a950() -> Profile {
    Profile::of_soc("Ascend950PR_9599")
}

/// The rule a kernel breaks on `profile`, and that it runs clean on `other` (a SoC-specific rule).
fn rule_on_only(kernel: &str, profile: Profile, other: Profile) -> String {
    run(kernel, other, 1).0.unwrap_or_else(|e| panic!("{kernel} on the other SoC: {e:?}"));
    rule(kernel, profile, 1)
}

#[test]
fn a_correct_gather_runs_and_computes_on_both_socs() {
    for profile in [a2(), a950()] {
        let (result, y) = run("twin_gather_ok", profile, 2);
        result.expect("twin_gather_ok");
        let want: Vec<f32> = (1..=64).rev().map(|i| i as f32).collect();
        assert_eq!(y, want);
    }
}

#[test]
fn a_gather_of_a_type_the_soc_lacks_is_rejected() {
    let r = rule_on_only("twin_gather_u8", a2(), a950());
    assert!(
        r.contains("Gather")
            && r.contains("dtype Gather.md does not list")
            && r.contains("uint8_t"),
        "{r}"
    );
}

#[test]
fn a_gather_into_its_own_table_is_rejected() {
    let r = rule("twin_gather_into_its_table", a2(), 1);
    assert!(r.contains("dst and src share memory"), "{r}");
}

#[test]
fn gather_offsets_and_base_must_be_element_aligned_and_inside_the_table() {
    let r = rule("twin_gather_unaligned_offset", a2(), 1);
    assert!(r.contains("srcOffset not a multiple of sizeof(T)"), "{r}");
    let r = rule("twin_gather_offset_past_src", a2(), 1);
    assert!(r.contains("gathered element past src"), "{r}");
    let r = rule("twin_gather_unaligned_base", a2(), 1);
    assert!(r.contains("srcBaseAddr not a multiple of sizeof(T) or past src"), "{r}");
    let r = rule("twin_gather_base_past_src", a2(), 1);
    assert!(r.contains("srcBaseAddr not a multiple of sizeof(T) or past src"), "{r}");
}

#[test]
fn gather_operands_must_be_aligned_and_within_count() {
    let r = rule("twin_gather_unaligned_table", a2(), 1);
    assert!(r.contains("Gather") && r.contains("not 32-byte aligned"), "{r}");
    let r = rule("twin_gather_count_past_offsets", a2(), 1);
    assert!(r.contains("Gather") && r.contains("srcOffset: count 128"), "{r}");
}

#[test]
fn a_gather_of_256_repeats_is_rejected_on_a2_only() {
    let r = rule_on_only("twin_gather_256_repeats", a2(), a950());
    assert!(r.contains("more than 255 full repeats"), "{r}");
}

#[test]
fn a_gather_of_count_zero_is_rejected_on_the_950_only() {
    let r = rule_on_only("twin_gather_count_zero", a950(), a2());
    assert!(r.contains("count 0 on the 950"), "{r}");
}

#[test]
fn a_16_bit_gather_offset_past_2_17_is_rejected_on_the_950_only() {
    let r = rule_on_only("twin_gather_16bit_offset_range", a950(), a2());
    assert!(r.contains("past its range on this SoC") && r.contains("131072"), "{r}");
}

#[test]
fn a_gather_of_a_scalar_written_table_without_a_flag_is_rejected() {
    let r = rule("twin_gather_of_a_scalar_table_without_a_flag", a2(), 1);
    assert!(r.contains("Gather") && r.contains("unsynchronised read"), "{r}");
}

#[test]
fn cast_takes_only_the_pairs_and_round_modes_its_table_lists_for_the_soc() {
    let r = rule_on_only("twin_cast_u8_to_u32", a2(), a950());
    assert!(
        r.contains("dtype pair Cast.md does not list") && r.contains("uint8_t -> uint32_t"),
        "{r}"
    );
    for profile in [a2(), a950()] {
        let r = rule("twin_cast_half_to_int32_none", profile, 1);
        assert!(
            r.contains("round mode Cast.md does not list") && r.contains("half -> int32_t"),
            "{r}"
        );
    }
}

#[test]
fn a_cast_to_an_integer_rounds_by_its_mode_and_refuses_values_out_of_range() {
    for profile in [a2(), a950()] {
        let (result, y) = run("twin_cast_rint_ok", profile, 1);
        result.expect("twin_cast_rint_ok");
        assert_eq!(y, vec![4.0f32; 64], "3.5 rounds to even");
    }
    let r = rule("twin_cast_out_of_range", a2(), 1);
    assert!(r.contains("outside the destination type's range"), "{r}");
}
