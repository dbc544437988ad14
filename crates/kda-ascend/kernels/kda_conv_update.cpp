// Causal conv1d update + SiLU (decode and speculative decode). For request b, channel c:
// the window is the cached state [state_len] followed by the new tokens; each new token's
// output is silu(sum_w weight[c, w] * window[...]); the state then keeps the last state_len
// inputs (with speculative decode, shifted by num_accepted_tokens[b] - 1 first).
// Units: channels (each core owns a channel slice across all requests).
#include "kda_kernel_abi.h"

using namespace AscendC;

struct ConvUpdateArgs {
    ArgsHeader h;
    GmTensor x;                    // [B, T, C] (or [B, C] for one token)
    GmTensor weight;               // [C, W]
    GmTensor state_slots;          // [B] i32, slot index or -1 (skip)
    GmTensor num_accepted_tokens;  // [B] i32, optional
    GmTensor state;                // [slots, C, state_len] (v-first)
    GmTensor y;                    // like x
};

template <typename T>
__aicore__ inline float to_f32(T v) { return static_cast<float>(v); }

template <typename T>
__aicore__ inline void conv_update(const ConvUpdateArgs &a)
{
    uint32_t start, count;
    kda_share(a.h.tiling, start, count);
    const bool spec = a.num_accepted_tokens.addr != 0;
    const int64_t batch = a.x.shape[0];
    const int64_t tokens = a.x.rank == 3 ? a.x.shape[1] : 1;
    const int64_t width = a.weight.shape[1];
    const int64_t state_len = a.state.shape[2];
    GlobalTensor<T> x, y, st;
    GlobalTensor<T> w;
    GlobalTensor<int32_t> slots, accepted;
    x.SetGlobalBuffer(kda_gm<T>(a.x));
    y.SetGlobalBuffer(kda_gm<T>(a.y));
    st.SetGlobalBuffer(kda_gm<T>(a.state));
    w.SetGlobalBuffer(kda_gm<T>(a.weight));
    slots.SetGlobalBuffer(kda_gm<int32_t>(a.state_slots));
    if (spec) accepted.SetGlobalBuffer(kda_gm<int32_t>(a.num_accepted_tokens));
    const int64_t xs_b = a.x.strides[0], xs_t = a.x.rank == 3 ? a.x.strides[1] : 0;
    const int64_t xs_c = a.x.strides[a.x.rank - 1];
    // The window of one channel: state then tokens (fp32, in scalar registers: W and the
    // state are a handful of values; the vector work is across channels on the cores).
    float window[64];
    for (int64_t b = 0; b < batch; ++b) {
        int32_t slot = slots.GetValue(b * a.state_slots.strides[0]);
        if (slot < 0) continue;
        int64_t shift = spec ? accepted.GetValue(b * a.num_accepted_tokens.strides[0]) - 1 : 0;
        for (uint32_t c = start; c < start + count; ++c) {
            int64_t s0 = slot * a.state.strides[0] + c * a.state.strides[1];
            int64_t len = 0;
            for (int64_t i = shift; i < state_len; ++i) window[len++] = to_f32(st.GetValue(s0 + i * a.state.strides[2]));
            for (int64_t t = 0; t < tokens; ++t) window[len++] = to_f32(x.GetValue(b * xs_b + t * xs_t + c * xs_c));
            for (int64_t t = 0; t < tokens; ++t) {
                float acc = 0.0f;
                int64_t end = len - tokens + t + 1;
                for (int64_t k = 0; k < width; ++k) {
                    acc += to_f32(w.GetValue(c * a.weight.strides[0] + k * a.weight.strides[1])) * window[end - width + k];
                }
                float out = acc / (1.0f + exp(-acc));
                y.SetValue(b * a.y.strides[0] + t * (a.y.rank == 3 ? a.y.strides[1] : 0) + c * a.y.strides[a.y.rank - 1], static_cast<T>(out));
            }
            for (int64_t i = 0; i < state_len; ++i) {
                st.SetValue(s0 + i * a.state.strides[2], static_cast<T>(window[len - state_len + i]));
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
    KDA_FOR_FLOAT_DTYPE(args.x.dtype, conv_update, args);
}
