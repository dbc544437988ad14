// Causal conv1d update + SiLU (decode and speculative decode), the HAL's CausalConvUpdate
// (docs/design/kda.md#short-conv): request b reads its history from rows a-1 .. a-1+W-2 of
// its slot of the token-major f32 state [N, L, C] (a = num_accepted_tokens[b], 1 when
// absent), computes for each of its n new tokens y_t[c] = silu(sum_k w[c, k] x_{t-W+1+k}[c])
// over history ++ tokens, and writes (history ++ tokens)[1..], W-2+n rows, into rows
// 0 .. W-2+n. A negative slot is a padding request: zero outputs, no state touched.
// Units: channels; a core owns a channel range and walks it in tiles of `tiling.tile`
// channels, each tile through every request (rows of a tile are contiguous in the
// token-major layout, so every GM move is one DataCopyPad per row).
// AI Core rules: see kda_kernel_util.h (not compiled here: no bisheng).
#include "kda_kernel_util.h"

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

// A float row of any kda float dtype `code` into f32 `dst`.
__aicore__ inline void load_row(const LocalTensor<float> &dst, const LocalTensor<half> &stage,
                                const GmTensor &t, int64_t at, int64_t n)
{
    if (t.dtype == KDA_FLOAT) {
        GlobalTensor<float> g;
        g.SetGlobalBuffer(kda_gm<float>(t));
        kda_load_f32<float>(dst, dst, g, at, n);
    } else if (t.dtype == KDA_BF16) {
        GlobalTensor<bfloat16_t> g;
        g.SetGlobalBuffer(kda_gm<bfloat16_t>(t));
        kda_load_f32<bfloat16_t>(dst, stage.ReinterpretCast<bfloat16_t>(), g, at, n);
    } else {
        GlobalTensor<half> g;
        g.SetGlobalBuffer(kda_gm<half>(t));
        kda_load_f32<half>(dst, stage, g, at, n);
    }
}

// f32 `src` to a row of `t` (any kda float dtype), rounded once.
__aicore__ inline void store_row(const GmTensor &t, int64_t at, const LocalTensor<half> &stage,
                                 const LocalTensor<float> &src, int64_t n)
{
    if (t.dtype == KDA_FLOAT) {
        GlobalTensor<float> g;
        g.SetGlobalBuffer(kda_gm<float>(t));
        kda_store_f32<float>(g, at, src, src, n);
    } else if (t.dtype == KDA_BF16) {
        GlobalTensor<bfloat16_t> g;
        g.SetGlobalBuffer(kda_gm<bfloat16_t>(t));
        kda_store_f32<bfloat16_t>(g, at, stage.ReinterpretCast<bfloat16_t>(), src, n);
    } else {
        GlobalTensor<half> g;
        g.SetGlobalBuffer(kda_gm<half>(t));
        kda_store_f32<half>(g, at, stage, src, n);
    }
}

__aicore__ inline void conv_update(const ConvUpdateArgs &a)
{
    uint32_t start, count;
    kda_share(a.h.tiling, start, count);
    const bool spec = a.num_accepted_tokens.addr != 0;
    const int64_t batch = a.x.shape[0], n = a.x.shape[1], width = a.weight.shape[1];
    const int64_t hist = width - 1, rows = hist + n;
    const int64_t tile = a.h.tiling.tile > 0 ? a.h.tiling.tile : 1;
    const int64_t tp = kda_pitch(tile, sizeof(float));
    GlobalTensor<float> st;
    GlobalTensor<int32_t> slots, accepted;
    st.SetGlobalBuffer(kda_gm<float>(a.state));
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
    const bool packed = a.weight.strides[0] == 1;  // tap k's channels contiguous
    for (int64_t c0 = start; c0 < start + count; c0 += tile) {
        const int64_t ct = (start + count - c0) < tile ? (start + count - c0) : tile;
        // Taps of this tile: row k holds w[c0 .. c0+ct, k].
        for (int64_t k = 0; k < width; ++k) {
            LocalTensor<float> row = w[k * tp];
            if (packed) {
                load_row(row, stage, a.weight, k * a.weight.strides[1] + c0, ct);
            } else {
                // [C, W] row-major: a strided gather through the scalar unit (weights are
                // constant, written by earlier tasks: each read invalidates its line). This
                // path reads f32 weights (the checkpoint's dtype; the layer's packed weights
                // take the path above).
                GlobalTensor<float> g;
                g.SetGlobalBuffer(kda_gm<float>(a.weight));
                for (int64_t c = 0; c < ct; ++c) {
                    row.SetValue(c, kda_read(g, (c0 + c) * a.weight.strides[0] + k * a.weight.strides[1]));
                }
                SetFlag<HardEvent::S_V>(EVENT_ID0);
                WaitFlag<HardEvent::S_V>(EVENT_ID0);
            }
        }
        for (int64_t b = 0; b < batch; ++b) {
            const int64_t y0 = b * a.y.strides[0] + c0 * a.y.strides[2];
            int32_t slot = kda_read(slots, b * a.state_slots.strides[0]);
            if (slot < 0) {
                Duplicate(acc, 0.0f, ct);
                PipeBarrier<PIPE_V>();
                for (int64_t t = 0; t < n; ++t) store_row(a.y, y0 + t * a.y.strides[1], stage, acc, ct);
                continue;
            }
            const int64_t acc_n = spec ? kda_read(accepted, b * a.num_accepted_tokens.strides[0]) : 1;
            const int64_t s0 = slot * a.state.strides[0] + c0 * a.state.strides[2];
            // Window: the history rows, then the new tokens.
            for (int64_t r = 0; r < hist; ++r) {
                load_row(win[r * tp], stage, a.state, s0 + (acc_n - 1 + r) * a.state.strides[1], ct);
            }
            for (int64_t t = 0; t < n; ++t) {
                load_row(win[(hist + t) * tp], stage, a.x, b * a.x.strides[0] + t * a.x.strides[1] + c0 * a.x.strides[2], ct);
            }
            for (int64_t t = 0; t < n; ++t) {
                // acc = sum_k w[k] * window[t + k], in tap order (as the reference sums).
                Mul(acc, w, win[t * tp], ct);
                PipeBarrier<PIPE_V>();
                for (int64_t k = 1; k < width; ++k) {
                    Mul(e, w[k * tp], win[(t + k) * tp], ct);
                    PipeBarrier<PIPE_V>();
                    Add(acc, acc, e, ct);
                    PipeBarrier<PIPE_V>();
                }
                // silu(acc) = acc / (1 + exp(-acc))
                Muls(e, acc, -1.0f, ct);
                PipeBarrier<PIPE_V>();
                Exp(e, e, ct);
                PipeBarrier<PIPE_V>();
                Adds(e, e, 1.0f, ct);
                PipeBarrier<PIPE_V>();
                Div(acc, acc, e, ct);
                PipeBarrier<PIPE_V>();
                store_row(a.y, y0 + t * a.y.strides[1], stage, acc, ct);
            }
            // State rows 0 .. W-2+n: the window from its second row (every read above is done:
            // the loads waited for MTE2 before the vector work these stores wait for).
            for (int64_t r = 0; r + 1 < rows; ++r) {
                store_row(a.state, s0 + r * a.state.strides[1], stage, win[(r + 1) * tp], ct);
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
