// Causal conv1d + SiLU over a flat batch of prefill requests, the HAL's CausalConv
// (docs/design/kda.md#short-conv): request b owns rows query_start_loc[b] ..
// query_start_loc[b+1] of x [T, C] and y [T, C] and slot state_slots[b] of the token-major f32
// conv state [N, L, C]. Its inputs are its W-1 history rows (state rows 0 .. W-2 of its slot
// when has_initial_state[b] is nonzero, else zeros) followed by its tokens;
// y_t[c] = silu(sum_k w[c, k] in_{t+k}[c]), and the last W-1 inputs (history included, so a
// request shorter than W-1 keeps part of its old history) become state rows 0 .. W-2. A
// negative slot is a padding request: zero outputs, no state touched. Rows of y that belong to
// no request are not written.
//
// Order (as the HAL specifies): every history is read before any state is written, so two
// requests naming one slot both see its old rows; the slot then keeps the later request's tail.
// Hence two passes per channel tile: outputs first (no state writes), then each slot's new rows,
// written by the last request that names it.
//
// Units: channels; a core owns a channel range and walks it in tiles of `tiling.tile` channels
// (a tile's rows are contiguous in the token-major x, y and state, so every GM move is one
// DataCopyPad per row). A request streams through a ring of W input rows: token t's row goes
// where the input W rows before it was, which token t no longer reads.
// UB: taps W x tile, ring W x tile, acc and e one tile each (f32), a 16-bit stage row
// (tiling.rs `conv_prefill` counts exactly these).
//
// Offsets and slots are device data: the emulated runtime checks them through the reference and
// fails the launch; this kernel cannot report, so it skips a request whose offsets are out of
// order or past T, or whose slot is not below N (its outputs are left as they were).
// AI Core rules: see kda_kernel_util.h (not compiled here: no bisheng).
#include "kda_conv.h"

using namespace AscendC;

struct ConvPrefillArgs {
    ArgsHeader h;
    GmTensor x;                  // [T, C] any float
    GmTensor weight;             // [C, W] any float (the layer's is [W, C] memory: strides (1, C))
    GmTensor query_start_loc;    // [B + 1] i32
    GmTensor state_slots;        // [B] i32, slot or negative (padding)
    GmTensor has_initial_state;  // [B] i32
    GmTensor state;              // [N, L, C] f32, token-major
    GmTensor y;                  // [T, C] any float
};

// The rows of request b, or false when its offsets are out of range.
__aicore__ inline bool request_rows(const ConvPrefillArgs &a, GlobalTensor<int32_t> &starts,
                                    int64_t b, int64_t &s, int64_t &e)
{
    s = kda_read(starts, b * a.query_start_loc.strides[0]);
    e = kda_read(starts, (b + 1) * a.query_start_loc.strides[0]);
    return 0 <= s && s <= e && e <= a.x.shape[0];
}

__aicore__ inline void conv_prefill(const ConvPrefillArgs &a)
{
    uint32_t start, count;
    kda_share(a.h.tiling, start, count);
    const int64_t batch = a.query_start_loc.shape[0] - 1, width = a.weight.shape[1];
    const int64_t hist = width - 1, slots_n = a.state.shape[0];
    const int64_t tile = a.h.tiling.tile > 0 ? a.h.tiling.tile : 1;
    const int64_t tp = kda_pitch(tile, sizeof(float));
    GlobalTensor<int32_t> starts, slots, initial;
    starts.SetGlobalBuffer(kda_gm<int32_t>(a.query_start_loc));
    slots.SetGlobalBuffer(kda_gm<int32_t>(a.state_slots));
    initial.SetGlobalBuffer(kda_gm<int32_t>(a.has_initial_state));
    TPipe pipe;
    TBuf<TPosition::VECCALC> wb, ringb, accb, eb, sb;
    pipe.InitBuffer(wb, width * tp * sizeof(float));
    pipe.InitBuffer(ringb, width * tp * sizeof(float));
    pipe.InitBuffer(accb, tp * sizeof(float));
    pipe.InitBuffer(eb, tp * sizeof(float));
    pipe.InitBuffer(sb, kda_pitch(tile, sizeof(half)) * sizeof(half));
    LocalTensor<float> w = wb.Get<float>(), ring = ringb.Get<float>();
    LocalTensor<float> acc = accb.Get<float>(), e = eb.Get<float>();
    LocalTensor<half> stage = sb.Get<half>();
    const int64_t xs = a.x.strides[0], ys = a.y.strides[0], ss = a.state.strides[1];
    for (int64_t c0 = start; c0 < start + count; c0 += tile) {
        const int64_t ct = (start + count - c0) < tile ? (start + count - c0) : tile;
        const int64_t xc = c0 * a.x.strides[1], yc = c0 * a.y.strides[1];
        kda_conv_load_taps(w, stage, a.weight, c0, ct, tp);
        // Pass 1: outputs. Every state read happens here, before pass 2 writes any.
        for (int64_t b = 0; b < batch; ++b) {
            int64_t s, end;
            if (!request_rows(a, starts, b, s, end)) continue;
            const int32_t slot = kda_read(slots, b * a.state_slots.strides[0]);
            if (slot >= slots_n) continue;
            if (slot < 0) {
                Duplicate(acc, 0.0f, ct);
                PipeBarrier<PIPE_V>();
                for (int64_t t = s; t < end; ++t) kda_store_row(a.y, t * ys + yc, stage, acc, ct);
                continue;
            }
            if (end == s) continue;
            const bool fresh = kda_read(initial, b * a.has_initial_state.strides[0]) == 0;
            const int64_t s0 = slot * a.state.strides[0] + c0 * a.state.strides[2];
            // Inputs 0 .. W-2: the history (ring rows 0 .. W-2).
            if (fresh && hist > 0) {
                Duplicate(ring, 0.0f, hist * tp);
                PipeBarrier<PIPE_V>();
            } else if (!fresh) {
                for (int64_t r = 0; r < hist; ++r) kda_load_row(ring[r * tp], stage, a.state, s0 + r * ss, ct);
            }
            for (int64_t t = 0; t < end - s; ++t) {
                // Input W-1+t into ring row (W-1+t) % W, which held input t-1: the vector unit
                // has finished with it (token t-1's store waited for it) before MTE2 writes.
                SetFlag<HardEvent::V_MTE2>(EVENT_ID0);
                WaitFlag<HardEvent::V_MTE2>(EVENT_ID0);
                kda_load_row(ring[((hist + t) % width) * tp], stage, a.x, (s + t) * xs + xc, ct);
                kda_conv_silu(acc, e, w, ring, tp, width, t, width, ct);
                kda_store_row(a.y, (s + t) * ys + yc, stage, acc, ct);
            }
        }
        // Pass 2: each slot's new rows 0 .. W-2, from the last request naming it.
        for (int64_t b = 0; b < batch && hist > 0; ++b) {
            int64_t s, end;
            if (!request_rows(a, starts, b, s, end)) continue;
            const int32_t slot = kda_read(slots, b * a.state_slots.strides[0]);
            if (slot < 0 || slot >= slots_n) continue;
            bool later = false;
            for (int64_t j = b + 1; j < batch && !later; ++j) {
                int64_t js, je;
                later = request_rows(a, starts, j, js, je) && kda_read(slots, j * a.state_slots.strides[0]) == slot;
            }
            if (later) continue;
            const bool fresh = kda_read(initial, b * a.has_initial_state.strides[0]) == 0;
            const int64_t len = end - s, s0 = slot * a.state.strides[0] + c0 * a.state.strides[2];
            // Tail row r is input len + r: old history row len + r while len + r < W-1, else
            // token len + r - (W-1). Loaded whole before any row is stored (a short request
            // moves its own slot's rows down).
            SetFlag<HardEvent::V_MTE2>(EVENT_ID0);
            WaitFlag<HardEvent::V_MTE2>(EVENT_ID0);
            for (int64_t r = 0; r < hist; ++r) {
                const int64_t i = len + r;
                if (i >= hist) {
                    kda_load_row(ring[r * tp], stage, a.x, (s + i - hist) * xs + xc, ct);
                } else if (fresh) {
                    Duplicate(ring[r * tp], 0.0f, ct);
                    PipeBarrier<PIPE_V>();
                } else {
                    kda_load_row(ring[r * tp], stage, a.state, s0 + i * ss, ct);
                }
            }
            for (int64_t r = 0; r < hist; ++r) kda_store_row(a.state, s0 + r * ss, stage, ring[r * tp], ct);
        }
    }
}

extern "C" __global__ __aicore__ void kda_conv_prefill(GM_ADDR x, GM_ADDR weight, GM_ADDR query_start_loc, GM_ADDR state_slots, GM_ADDR has_initial_state, GM_ADDR state, GM_ADDR y, GM_ADDR meta)
{
    KDA_VECTOR_KERNEL();
    ConvPrefillArgs args;
    GM_ADDR tensors[] = {x, weight, query_start_loc, state_slots, has_initial_state, state, y};
    kda_load_args(args, meta, tensors, 7);
    conv_prefill(args);
}
