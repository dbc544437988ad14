// Causal conv1d update + SiLU (decode and speculative decode), the HAL's CausalConvUpdate
// (docs/design/kda.md#short-conv): request b reads its history from rows a-1 .. a-1+W-2 of
// its slot of the token-major f32 state [N, L, C] (a = num_accepted_tokens[b], 1 when
// absent), computes for each of its n new tokens y_t[c] = silu(sum_k w[c, k] x_{t-W+1+k}[c])
// over history ++ tokens, and writes (history ++ tokens)[1..], W-2+n rows, into rows
// 0 .. W-2+n. A negative slot is a padding request: zero outputs, no state touched.
// Units: channels; a core owns a channel range and walks it in tiles of `tiling.tile`
// channels, each tile through every request (rows of a tile are contiguous in the
// token-major layout, so every GM move is one DataCopyPad per row).
// UB: taps W x tile, window (W-1+n) x tile, acc and e one tile each (f32), a 16-bit stage
// row (tiling.rs `conv_update` counts exactly these).
// AI Core rules: see kda_kernel_util.h (not compiled here: no bisheng).
#include "kda_conv.h"

using namespace AscendC;

struct ConvUpdateArgs {
    ArgsHeader h;
    GmTensor x;                    // [B, n, C] any float
    GmTensor weight;               // [C, W] any float (the layer's is [W, C] memory: strides (1, C))
    GmTensor state_slots;          // [B] i32, slot or negative (padding)
    GmTensor num_accepted_tokens;  // [B] i32, optional (addr 0)
    GmTensor state;                // [N, L, C] f32, token-major
    GmTensor y;                    // [B, n, C] any float
};

__aicore__ inline void conv_update(const ConvUpdateArgs &a)
{
    uint32_t start, count;
    kda_share(a.h.tiling, start, count);
    const bool spec = a.num_accepted_tokens.addr != 0;
    const int64_t batch = a.x.shape[0], n = a.x.shape[1], width = a.weight.shape[1];
    const int64_t hist = width - 1, rows = hist + n;
    const int64_t tile = a.h.tiling.tile > 0 ? a.h.tiling.tile : 1;
    const int64_t tp = kda_pitch(tile, sizeof(float));
    GlobalTensor<int32_t> slots, accepted;
    slots.SetGlobalBuffer(kda_gm<int32_t>(a.state_slots));
    if (spec) accepted.SetGlobalBuffer(kda_gm<int32_t>(a.num_accepted_tokens));
    TPipe pipe;
    TBuf<TPosition::VECCALC> wb, winb, accb, eb, sb;
    pipe.InitBuffer(wb, width * tp * sizeof(float));
    pipe.InitBuffer(winb, rows * tp * sizeof(float));
    pipe.InitBuffer(accb, tp * sizeof(float));
    pipe.InitBuffer(eb, tp * sizeof(float));
    pipe.InitBuffer(sb, kda_pitch(tile, sizeof(half)) * sizeof(half));
    LocalTensor<float> w = wb.Get<float>(), win = winb.Get<float>();
    LocalTensor<float> acc = accb.Get<float>(), e = eb.Get<float>();
    LocalTensor<half> stage = sb.Get<half>();
    for (int64_t c0 = start; c0 < start + count; c0 += tile) {
        const int64_t ct = (start + count - c0) < tile ? (start + count - c0) : tile;
        kda_conv_load_taps(w, stage, a.weight, c0, ct, tp);
        for (int64_t b = 0; b < batch; ++b) {
            const int64_t y0 = b * a.y.strides[0] + c0 * a.y.strides[2];
            int32_t slot = kda_read(slots, b * a.state_slots.strides[0]);
            if (slot < 0) {
                Duplicate(acc, 0.0f, ct);
                PipeBarrier<PIPE_V>();
                for (int64_t t = 0; t < n; ++t) kda_store_row(a.y, y0 + t * a.y.strides[1], stage, acc, ct);
                continue;
            }
            const int64_t acc_n = spec ? kda_read(accepted, b * a.num_accepted_tokens.strides[0]) : 1;
            const int64_t state_len = a.state.shape[1];
            ascendc_assert(acc_n >= 1 && acc_n <= state_len + 1 - hist,
                           "num_accepted_tokens[%d] = %d is not within 1..=%d (state rows L = %d, W = %d)\n",
                           static_cast<int32_t>(b), static_cast<int32_t>(acc_n),
                           static_cast<int32_t>(state_len + 1 - hist), static_cast<int32_t>(state_len),
                           static_cast<int32_t>(width));
            const int64_t s0 = slot * a.state.strides[0] + c0 * a.state.strides[2];
            // Window: the history rows, then the new tokens.
            for (int64_t r = 0; r < hist; ++r) {
                kda_load_row(win[r * tp], stage, a.state, s0 + (acc_n - 1 + r) * a.state.strides[1], ct);
            }
            for (int64_t t = 0; t < n; ++t) {
                kda_load_row(win[(hist + t) * tp], stage, a.x, b * a.x.strides[0] + t * a.x.strides[1] + c0 * a.x.strides[2], ct);
            }
            for (int64_t t = 0; t < n; ++t) {
                kda_conv_silu(acc, e, w, win, tp, width, t, rows, ct);
                kda_store_row(a.y, y0 + t * a.y.strides[1], stage, acc, ct);
            }
            // State rows 0 .. W-2+n: the window from its second row (every read above is done:
            // the loads waited for MTE2 before the vector work these stores wait for).
            for (int64_t r = 0; r + 1 < rows; ++r) {
                kda_store_row(a.state, s0 + r * a.state.strides[1], stage, win[(r + 1) * tp], ct);
            }
        }
    }
}

extern "C" __global__ __aicore__ void kda_conv_update(GM_ADDR x, GM_ADDR weight, GM_ADDR state_slots, GM_ADDR num_accepted_tokens, GM_ADDR state, GM_ADDR y, GM_ADDR meta)
{
    KDA_VECTOR_KERNEL();
    ConvUpdateArgs args;
    GM_ADDR tensors[] = {x, weight, state_slots, num_accepted_tokens, state, y};
    kda_load_args(args, meta, tensors, 6);
    conv_update(args);
}
