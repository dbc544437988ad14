// The depthwise causal conv + SiLU of one channel tile, shared by kda_conv_prefill and
// kda_conv_update (docs/design/kda.md#short-conv): the taps of the tile and
// y_t[c] = silu(sum_k w[c, k] * in_{t+k}[c]) over a window of input rows held in the unified
// buffer. Rows are f32, `tp` floats apart (the tile's channel count padded to 32 bytes).
// Not compiled here (no bisheng).
#ifndef KDA_CONV_H
#define KDA_CONV_H

#include "kda_rows.h"

// Taps of channels c0 .. c0+ct into `w`: row k holds w[c0 .. c0+ct, k].
__aicore__ inline void kda_conv_load_taps(const AscendC::LocalTensor<float> &w,
                                          const AscendC::LocalTensor<half> &stage,
                                          const GmTensor &weight, int64_t c0, int64_t ct,
                                          int64_t tp)
{
    using namespace AscendC;
    const int64_t width = weight.shape[1];
    const bool packed = weight.strides[0] == 1;  // tap k's channels contiguous
    if (!packed) {
        // The scalar stores below overwrite taps the vector unit read for the previous tile
        // (kda_conv_silu): they wait for it, V -> S (asc-devkit's auto-sync example puts
        // SetFlag/WaitFlag<HardEvent::V_S> between a vector instruction and SetValue on its
        // operand: mirror-cann/asc-devkit/docs/zh/api/SIMD-API/基础API/同步控制/核内同步/关键特性说明.md).
        // The packed path's loads are ordered by the previous tile's stores (V -> MTE3 -> MTE2).
        SetFlag<HardEvent::V_S>(EVENT_ID0);
        WaitFlag<HardEvent::V_S>(EVENT_ID0);
    }
    for (int64_t k = 0; k < width; ++k) {
        LocalTensor<float> row = w[k * tp];
        if (packed) {
            kda_load_row(row, stage, weight, k * weight.strides[1] + c0, ct);
        } else {
            // [C, W] row-major: a strided gather through the scalar unit (weights are constant,
            // written by earlier tasks: each read invalidates its line). This path reads f32
            // weights (the checkpoint's dtype; the layer's packed weights take the path above).
            GlobalTensor<float> g;
            g.SetGlobalBuffer(kda_gm<float>(weight));
            for (int64_t c = 0; c < ct; ++c) {
                row.SetValue(c, kda_read(g, (c0 + c) * weight.strides[0] + k * weight.strides[1]));
            }
            SetFlag<HardEvent::S_V>(EVENT_ID0);
            WaitFlag<HardEvent::S_V>(EVENT_ID0);
        }
    }
}

// acc = silu(sum_k w[k] * in[(first + k) % ring]) over `ct` channels, the window rows `tp`
// floats apart in `win` (`ring`: rows before the index wraps; a straight window passes a ring
// longer than any index). Sums in tap order, as the reference does; `e` is scratch. On return
// the vector unit has written `acc` (the caller's store orders MTE3 after it).
__aicore__ inline void kda_conv_silu(const AscendC::LocalTensor<float> &acc,
                                     const AscendC::LocalTensor<float> &e,
                                     const AscendC::LocalTensor<float> &w,
                                     const AscendC::LocalTensor<float> &win, int64_t tp,
                                     int64_t width, int64_t first, int64_t ring, int64_t ct)
{
    using namespace AscendC;
    Mul(acc, w, win[(first % ring) * tp], ct);
    PipeBarrier<PIPE_V>();
    for (int64_t k = 1; k < width; ++k) {
        Mul(e, w[k * tp], win[((first + k) % ring) * tp], ct);
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
}

#endif
