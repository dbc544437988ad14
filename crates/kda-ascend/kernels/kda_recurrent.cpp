// One KDA recurrent step per token (decode, speculative decode), fp32 v-first state: the delta
// rule of kda_delta_rule.h, token after token.
// Slots (the HAL's KdaRecurrent, docs/design/kda.md#speculative-decode): request b starts from
// slot state_slots[b, a - 1], a = num_accepted_tokens[b] (1 when absent), and writes the state
// after its token t into slot state_slots[b, t] when that entry is >= 0; a negative initial
// slot marks a padding request (zero outputs, no state written).
// Units: (sequence, head) pairs; one unit's state (V x K fp32, rows padded to 32 bytes) lives
// in the unified buffer. Operands of any kda float dtype, each its own (kda_rows.h).
//
// AI Core rules this body keeps (AscendC programming guide: DataCopyPad, SetFlag/WaitFlag,
// GlobalTensor::GetValue, DataCacheCleanAndInvalid), with the helpers of kda_kernel_util.h,
// kda_rows.h and kda_delta_rule.h:
// - every GM <-> UB move is a DataCopyPad, so rows whose byte length is not a multiple of 32
//   are moved whole, not truncated;
// - each hand-over between pipes is ordered by a flag (MTE2 -> V after a load, V -> MTE3
//   before a store, MTE3 -> V / MTE3 -> MTE2 before a stored buffer is written again, V -> S
//   before the scalar unit reads a vector result) and PIPE_V barriers order dependent vector
//   instructions (explicit: this file does not rely on --cce-auto-sync);
// - outputs and states go to GM through MTE3 only (no scalar GM writes, so no two cores share
//   a dirtied cache line); the scalar metadata reads (slots, counts) invalidate their cache
//   line first, since earlier tasks wrote that memory;
// - no double arithmetic: the f64 scalars of the meta region are converted bit by bit; exp and
//   sqrt are vector instructions, never scalar library calls.
// Not compiled here (no bisheng).
#include "kda_delta_rule.h"

using namespace AscendC;

struct RecurrentArgs {
    ArgsHeader h;
    GmTensor q, k, v, g, beta;    // [B, T, H, K|V], beta [B, T, H]; any float each
    GmTensor state_slots;         // [B, T] i32
    GmTensor num_accepted_tokens; // [B] i32, optional (addr 0)
    GmTensor state;               // [slots, H, V, K] f32
    GmTensor o;                   // [B, T, H, V]
    uint64_t scale_bits;          // f64 bits (read without double arithmetic)
    uint64_t qk_l2norm_bits;      // f64 bits, nonzero = on
};

// Element offset of (sequence b, token t, head h) in a [B, T, H, ...] tensor.
__aicore__ inline int64_t at(const GmTensor &x, int64_t b, int64_t t, int64_t h)
{
    return b * x.strides[0] + t * x.strides[1] + h * x.strides[2];
}

__aicore__ inline void step(const RecurrentArgs &a)
{
    uint32_t start, count;
    kda_share(a.h.tiling, start, count);
    const int64_t heads = a.q.shape[2], K = a.q.shape[3], V = a.v.shape[3], T_ = a.q.shape[1];
    const float scale = kda_f64_bits_to_f32(a.scale_bits);
    const bool l2 = kda_f64_bits_nonzero(a.qk_l2norm_bits);
    const bool has_accepted = a.num_accepted_tokens.addr != 0;
    GlobalTensor<int32_t> slots, accepted;
    slots.SetGlobalBuffer(kda_gm<int32_t>(a.state_slots));
    if (has_accepted) {
        accepted.SetGlobalBuffer(kda_gm<int32_t>(a.num_accepted_tokens));
    }
    TPipe pipe;
    TBuf<TPosition::VECCALC> sb, vb;
    const KdaDelta d = kda_delta_init(pipe, sb, vb, K, V);
    for (uint32_t unit = start; unit < start + count; ++unit) {
        int64_t b = unit / heads, h = unit % heads;
        int64_t a0 = has_accepted ? kda_read(accepted, b * a.num_accepted_tokens.strides[0]) : 1;
        ascendc_assert(a0 >= 1 && a0 <= T_, "num_accepted_tokens[%d] = %d is not within 1..=%d\n",
                       static_cast<int32_t>(b), static_cast<int32_t>(a0), static_cast<int32_t>(T_));
        int64_t slot_at = b * a.state_slots.strides[0];
        int32_t first = kda_read(slots, slot_at + (a0 - 1) * a.state_slots.strides[1]);
        if (first < 0) {
            // Padding: zero outputs, no state.
            Duplicate(d.of, 0.0f, V);
            PipeBarrier<PIPE_V>();
            for (int64_t t = 0; t < T_; ++t) kda_store_row(a.o, at(a.o, b, t, h), d.stage, d.of, V);
            continue;
        }
        kda_delta_load_state(d, a.state, first * a.state.strides[0] + h * a.state.strides[1]);
        for (int64_t t = 0; t < T_; ++t) {
            kda_delta_token(d, a.q, at(a.q, b, t, h), a.k, at(a.k, b, t, h), a.v, at(a.v, b, t, h),
                            a.g, at(a.g, b, t, h), a.beta, at(a.beta, b, t, h), scale, l2);
            kda_store_row(a.o, at(a.o, b, t, h), d.stage, d.of, V);
            // The state after token t, where the request keeps it.
            int32_t keep = kda_read(slots, slot_at + t * a.state_slots.strides[1]);
            if (keep >= 0) {
                kda_delta_store_state(d, a.state, keep * a.state.strides[0] + h * a.state.strides[1]);
            }
        }
    }
}

extern "C" __global__ __aicore__ void kda_recurrent_step(GM_ADDR q, GM_ADDR k, GM_ADDR v, GM_ADDR g, GM_ADDR beta, GM_ADDR state_slots, GM_ADDR num_accepted_tokens, GM_ADDR state, GM_ADDR o, GM_ADDR meta)
{
    KDA_VECTOR_KERNEL();
    RecurrentArgs args;
    GM_ADDR tensors[] = {q, k, v, g, beta, state_slots, num_accepted_tokens, state, o};
    kda_load_args(args, meta, tensors, 9);
    step(args);
}
