// KDA prefill over a flat batch of requests, the HAL's KdaChunk (docs/design/kda.md): request b
// owns tokens cu_seqlens[b] .. cu_seqlens[b+1] of q, k, g [T, H, K], v, o [T, H, V] and
// beta [T, H], and slot state_slots[b] of the v-first f32 state [N, H, V, K]; it starts from
// that slot's state when has_initial_state[b] is nonzero (else from zero) and writes its final
// state there. A negative slot is a padding request: zero outputs, no state touched. Tokens of no
// request are not written.
//
// This kernel computes the recurrence token by token on the vector unit, with the delta rule of
// kda_delta_rule.h (the one kda_recurrent_step runs), not in the chunked matrix form: the HAL
// contract admits any form that agrees with the recurrence within fp32 rounding, and the tuned
// Cube-unit chunked form on Ascend is the vendor's aclnnChunkKdaFwd, which the backend runs
// wherever its contract fits (backend/vendor.rs). This kernel is the path for f32 operands,
// chunk-boundary states and captured prefills.
//
// `g` is the activated log decay: a KdaChunk with an in-kernel gate has the backend run the
// kda_gate kernel into an f32 scratch first (bit-identical to KdaGate, as the HAL requires).
//
// Chunk-boundary states (optional chunk_state_slots [NC], docs/design/kda.md#chunk-boundary-states):
// request b's chunk c (64 tokens, the last one shorter) has entry sum_{j<b} ceil(len_j / 64) + c;
// after the chunk's last token the state goes to the slot named there when it is >= 0. Padding
// requests keep nothing. The HAL makes these slots distinct from each other and from every
// request slot, so no unit reads a slot another unit writes.
//
// Units: (request, head) pairs; one unit's state (V x K f32, rows padded to 32 bytes) lives in the
// unified buffer. Offsets and slots are device data: a request whose offsets are out of order or
// past T, or whose slot is not below N, fails an ascendc_assert, which stops the core (the
// runtime reports an AI Core exception of this kernel). Two requests naming one state slot
// (which the reference resolves by reading every initial state first) race here: units of
// different requests run on different cores.
// AI Core rules: see kda_recurrent.cpp and kda_kernel_util.h (not compiled here: no bisheng).
#include "kda_delta_rule.h"

using namespace AscendC;

#define KDA_CHUNK 64

struct ChunkArgs {
    ArgsHeader h;
    GmTensor q, k, v, g, beta;    // [T, H, K|V], beta [T, H]; any float each
    GmTensor cu_seqlens;          // [B + 1] i32
    GmTensor state_slots;         // [B] i32
    GmTensor has_initial_state;   // [B] i32
    GmTensor state;               // [N, H, V, K] f32
    GmTensor o;                   // [T, H, V]
    GmTensor chunk_state_slots;   // [NC] i32, optional (addr 0)
    uint64_t scale_bits;          // f64 bits (read without double arithmetic)
    uint64_t qk_l2norm_bits;      // f64 bits, nonzero = on
};

// Element offset of (token t, head h) in a [T, H, ...] tensor.
__aicore__ inline int64_t at(const GmTensor &x, int64_t t, int64_t h)
{
    return t * x.strides[0] + h * x.strides[1];
}

__aicore__ inline void chunk(const ChunkArgs &a)
{
    uint32_t start, count;
    kda_share(a.h.tiling, start, count);
    const int64_t heads = a.q.shape[1], K = a.q.shape[2], V = a.v.shape[2];
    const int64_t tokens = a.q.shape[0], slots_n = a.state.shape[0];
    const float scale = kda_f64_bits_to_f32(a.scale_bits);
    const bool l2 = kda_f64_bits_nonzero(a.qk_l2norm_bits);
    const bool keep_chunks = a.chunk_state_slots.addr != 0;
    GlobalTensor<int32_t> cu, slots, initial, kept;
    cu.SetGlobalBuffer(kda_gm<int32_t>(a.cu_seqlens));
    slots.SetGlobalBuffer(kda_gm<int32_t>(a.state_slots));
    initial.SetGlobalBuffer(kda_gm<int32_t>(a.has_initial_state));
    if (keep_chunks) kept.SetGlobalBuffer(kda_gm<int32_t>(a.chunk_state_slots));
    const int64_t cs = a.cu_seqlens.strides[0], requests = a.cu_seqlens.shape[0] - 1;
    TPipe pipe;
    TBuf<TPosition::VECCALC> sb, vb;
    const KdaDelta d = kda_delta_init(pipe, sb, vb, K, V);
    for (uint32_t unit = start; unit < start + count; ++unit) {
        const int64_t b = unit / heads, h = unit % heads;
        const int64_t s = kda_read(cu, b * cs), e = kda_read(cu, (b + 1) * cs);
        // Device data the host cannot check before the launch: a bad value stops the core.
        ascendc_assert(0 <= s && s <= e && e <= tokens, "cu_seqlens[%d..%d] = %d..%d is not within 0..=%d\n",
                       static_cast<int32_t>(b), static_cast<int32_t>(b + 1), static_cast<int32_t>(s),
                       static_cast<int32_t>(e), static_cast<int32_t>(tokens));
        const int32_t slot = kda_read(slots, b * a.state_slots.strides[0]);
        ascendc_assert(slot < slots_n, "state_slots[%d] = %d is not a state slot (N = %d)\n",
                       static_cast<int32_t>(b), slot, static_cast<int32_t>(slots_n));
        if (slot < 0) {
            Duplicate(d.of, 0.0f, V);
            PipeBarrier<PIPE_V>();
            for (int64_t t = s; t < e; ++t) kda_store_row(a.o, at(a.o, t, h), d.stage, d.of, V);
            continue;
        }
        // This request's first chunk entry: the chunks of the requests before it; the list
        // has one entry per chunk of every request.
        int64_t first_chunk = 0;
        if (keep_chunks) {
            int64_t total = 0;
            for (int64_t j = 0; j < requests; ++j) {
                const int64_t len = kda_read(cu, (j + 1) * cs) - kda_read(cu, j * cs);
                if (j < b) first_chunk += (len + KDA_CHUNK - 1) / KDA_CHUNK;
                total += (len + KDA_CHUNK - 1) / KDA_CHUNK;
            }
            ascendc_assert(total == a.chunk_state_slots.shape[0],
                           "chunk_state_slots has %d entries, the requests have %d chunks\n",
                           static_cast<int32_t>(a.chunk_state_slots.shape[0]), static_cast<int32_t>(total));
        }
        const int64_t home = slot * a.state.strides[0] + h * a.state.strides[1];
        if (kda_read(initial, b * a.has_initial_state.strides[0]) != 0) {
            kda_delta_load_state(d, a.state, home);
        } else {
            kda_delta_zero_state(d);
        }
        for (int64_t t = s; t < e; ++t) {
            kda_delta_token(d, a.q, at(a.q, t, h), a.k, at(a.k, t, h), a.v, at(a.v, t, h), a.g,
                            at(a.g, t, h), a.beta, at(a.beta, t, h), scale, l2);
            kda_store_row(a.o, at(a.o, t, h), d.stage, d.of, V);
            const int64_t i = t - s;
            if (keep_chunks && ((i + 1) % KDA_CHUNK == 0 || t + 1 == e)) {
                const int32_t to = kda_read(kept, (first_chunk + i / KDA_CHUNK) * a.chunk_state_slots.strides[0]);
                ascendc_assert(to < slots_n, "chunk_state_slots[%d] = %d is not a state slot (N = %d)\n",
                               static_cast<int32_t>(first_chunk + i / KDA_CHUNK), to, static_cast<int32_t>(slots_n));
                // A kept state never lands on a slot a request reads or writes.
                for (int64_t j = 0; j < requests && to >= 0; ++j) {
                    const int32_t other = kda_read(slots, j * a.state_slots.strides[0]);
                    ascendc_assert(other != to, "chunk_state_slots[%d] = %d is also state_slots[%d]\n",
                                   static_cast<int32_t>(first_chunk + i / KDA_CHUNK), to, static_cast<int32_t>(j));
                }
                // ... nor on one an earlier kept state took.
                const int64_t entry = first_chunk + i / KDA_CHUNK;
                for (int64_t j = 0; j < entry && to >= 0; ++j) {
                    const int32_t other = kda_read(kept, j * a.chunk_state_slots.strides[0]);
                    ascendc_assert(other != to, "chunk_state_slots[%d] = %d is also chunk_state_slots[%d]\n",
                                   static_cast<int32_t>(entry), to, static_cast<int32_t>(j));
                }
                if (to >= 0) {
                    kda_delta_store_state(d, a.state, to * a.state.strides[0] + h * a.state.strides[1]);
                }
            }
        }
        kda_delta_store_state(d, a.state, home);
    }
}

extern "C" __global__ __aicore__ void kda_chunk_prefill(GM_ADDR q, GM_ADDR k, GM_ADDR v, GM_ADDR g, GM_ADDR beta, GM_ADDR cu_seqlens, GM_ADDR state_slots, GM_ADDR has_initial_state, GM_ADDR state, GM_ADDR o, GM_ADDR chunk_state_slots, GM_ADDR meta)
{
    KDA_VECTOR_KERNEL();
    ChunkArgs args;
    GM_ADDR tensors[] = {q, k, v, g, beta, cu_seqlens, state_slots, has_initial_state, state, o, chunk_state_slots};
    kda_load_args(args, meta, tensors, 11);
    chunk(args);
}
