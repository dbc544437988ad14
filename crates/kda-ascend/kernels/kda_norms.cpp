// The two row normalisations, fp32 inside. Units: rows of D (the last dimension, contiguous).
// x, gate, weight and y are each f32, bf16 or f16, independently (the HAL's contract).
//   kda_l2norm:         y = x / sqrt(sum x^2 + 1e-6) * scale       (q/k norm)
//   kda_gated_rms_norm: y = x * rsqrt(mean x^2 + eps) * weight * sigmoid(gate)
#include "kda_rows.h"

using namespace AscendC;

struct L2NormArgs {
    ArgsHeader h;
    GmTensor x;  // [..., D]
    GmTensor y;  // like x
    uint64_t scale_bits;  // f64 bits (read without double arithmetic)
};

struct GatedRmsNormArgs {
    ArgsHeader h;
    GmTensor x, gate, weight, y;  // [..., D], [..., D], [D], [..., D]
    uint64_t eps_bits;            // f64 bits
};

// Row `row` of a [..., D] view whose leading dimensions are row-major over `rows`.
__aicore__ inline int64_t kda_row_offset(const GmTensor &t, int64_t row)
{
    int64_t off = 0;
    for (int32_t d = static_cast<int32_t>(t.rank) - 2; d >= 0; --d) {
        off += (row % t.shape[d]) * t.strides[d];
        row /= t.shape[d];
    }
    return off;
}

__aicore__ inline float sum_squares(LocalTensor<float> v, LocalTensor<float> tmp, int64_t n)
{
    Mul(tmp, v, v, n);
    SetFlag<HardEvent::V_S>(EVENT_ID0);
    WaitFlag<HardEvent::V_S>(EVENT_ID0);
    float s = 0.0f;
    for (int64_t i = 0; i < n; ++i) s += tmp.GetValue(i);  // in order, as the reference sums
    return s;
}

// 1 / sqrt(x), the square root on the vector unit.
__aicore__ inline float inv_sqrt(const LocalTensor<float> &one, float x)
{
    return 1.0f / kda_vector_sqrt(one, x);
}

// Every tensor is read and written in its own dtype (the HAL lets x, gate, weight and y differ):
// rows go through kda_rows.h, with a 16-bit stage row.
__aicore__ inline void l2norm(const L2NormArgs &a)
{
    uint32_t start, count;
    kda_share(a.h.tiling, start, count);
    const int64_t dim = a.x.shape[a.x.rank - 1];
    TPipe pipe;
    const float scale = kda_f64_bits_to_f32(a.scale_bits);
    const int64_t pitch = kda_pitch(dim, sizeof(float));
    TBuf<TPosition::VECCALC> rb, vb, tb, ob;
    pipe.InitBuffer(rb, kda_pitch(dim, sizeof(half)) * sizeof(half));
    pipe.InitBuffer(vb, pitch * sizeof(float));
    pipe.InitBuffer(tb, pitch * sizeof(float));
    pipe.InitBuffer(ob, 8 * sizeof(float));
    LocalTensor<half> stage = rb.Get<half>();
    LocalTensor<float> v = vb.Get<float>(), tmp = tb.Get<float>(), one = ob.Get<float>();
    for (uint32_t row = start; row < start + count; ++row) {
        kda_load_row(v, stage, a.x, kda_row_offset(a.x, row), dim);
        float inv = inv_sqrt(one, sum_squares(v, tmp, dim) + 1e-6f);
        SetFlag<HardEvent::S_V>(EVENT_ID0);
        WaitFlag<HardEvent::S_V>(EVENT_ID0);
        Muls(v, v, inv, dim);
        PipeBarrier<PIPE_V>();
        Muls(v, v, scale, dim);
        PipeBarrier<PIPE_V>();
        kda_store_row(a.y, kda_row_offset(a.y, row), stage, v, dim);
    }
}

__aicore__ inline void gated_rms_norm(const GatedRmsNormArgs &a)
{
    uint32_t start, count;
    kda_share(a.h.tiling, start, count);
    const int64_t dim = a.x.shape[a.x.rank - 1];
    TPipe pipe;
    const float eps = kda_f64_bits_to_f32(a.eps_bits);
    const int64_t pitch = kda_pitch(dim, sizeof(float));
    TBuf<TPosition::VECCALC> rb, vb, gb, wb, tb, ob;
    pipe.InitBuffer(rb, kda_pitch(dim, sizeof(half)) * sizeof(half));
    pipe.InitBuffer(vb, pitch * sizeof(float));
    pipe.InitBuffer(gb, pitch * sizeof(float));
    pipe.InitBuffer(wb, pitch * sizeof(float));
    pipe.InitBuffer(tb, pitch * sizeof(float));
    pipe.InitBuffer(ob, 8 * sizeof(float));
    LocalTensor<half> stage = rb.Get<half>();
    LocalTensor<float> v = vb.Get<float>(), g = gb.Get<float>(), w = wb.Get<float>(), tmp = tb.Get<float>();
    LocalTensor<float> one = ob.Get<float>();
    kda_load_row(w, stage, a.weight, 0, dim);
    for (uint32_t row = start; row < start + count; ++row) {
        kda_load_row(v, stage, a.x, kda_row_offset(a.x, row), dim);
        kda_load_row(g, stage, a.gate, kda_row_offset(a.gate, row), dim);
        float inv = inv_sqrt(one, sum_squares(v, tmp, dim) / static_cast<float>(dim) + eps);
        SetFlag<HardEvent::S_V>(EVENT_ID0);
        WaitFlag<HardEvent::S_V>(EVENT_ID0);
        Muls(v, v, inv, dim);
        PipeBarrier<PIPE_V>();
        Mul(v, v, w, dim);
        // sigmoid(gate) = 1 / (1 + exp(-gate))
        Muls(g, g, -1.0f, dim);
        PipeBarrier<PIPE_V>();
        Exp(g, g, dim);
        PipeBarrier<PIPE_V>();
        Adds(g, g, 1.0f, dim);
        PipeBarrier<PIPE_V>();
        Div(v, v, g, dim);
        PipeBarrier<PIPE_V>();
        kda_store_row(a.y, kda_row_offset(a.y, row), stage, v, dim);
    }
}

extern "C" __global__ __aicore__ void kda_l2norm(GM_ADDR x, GM_ADDR y, GM_ADDR meta)
{
    KDA_VECTOR_KERNEL();
    L2NormArgs args;
    GM_ADDR tensors[] = {x, y};
    kda_load_args(args, meta, tensors, 2);
    l2norm(args);
}

extern "C" __global__ __aicore__ void kda_gated_rms_norm(GM_ADDR x, GM_ADDR gate, GM_ADDR weight, GM_ADDR y, GM_ADDR meta)
{
    KDA_VECTOR_KERNEL();
    GatedRmsNormArgs args;
    GM_ADDR tensors[] = {x, gate, weight, y};
    kda_load_args(args, meta, tensors, 4);
    gated_rms_norm(args);
}
