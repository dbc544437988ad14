// The two row normalisations, fp32 inside. Units: rows of D (the last dimension, contiguous).
//   kda_l2norm:         y = x / sqrt(sum x^2 + 1e-6) * scale       (q/k norm)
//   kda_gated_rms_norm: y = x * rsqrt(mean x^2 + eps) * weight * sigmoid(gate)
#include "kda_kernel_abi.h"

using namespace AscendC;

struct L2NormArgs {
    ArgsHeader h;
    GmTensor x;  // [..., D]
    GmTensor y;  // like x
    double scale;
};

struct GatedRmsNormArgs {
    ArgsHeader h;
    GmTensor x, gate, weight, y;  // [..., D], [..., D], [D], [..., D]
    double eps;
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

template <typename T>
__aicore__ inline void load_f32(LocalTensor<float> dst, LocalTensor<T> raw, GlobalTensor<T> src, int64_t off, int64_t n)
{
    DataCopy(raw, src[off], n);
    PipeBarrier<PIPE_ALL>();
    if constexpr (sizeof(T) == sizeof(float)) {
        DataCopy(dst, raw, n);
    } else {
        Cast(dst, raw, RoundMode::CAST_NONE, n);
    }
}

template <typename T>
__aicore__ inline void store_f32(GlobalTensor<T> dst, int64_t off, LocalTensor<T> raw, LocalTensor<float> src, int64_t n)
{
    if constexpr (sizeof(T) == sizeof(float)) {
        DataCopy(raw, src, n);
    } else {
        Cast(raw, src, RoundMode::CAST_RINT, n);
    }
    PipeBarrier<PIPE_ALL>();
    DataCopy(dst[off], raw, n);
}

__aicore__ inline float sum_squares(LocalTensor<float> v, LocalTensor<float> tmp, int64_t n)
{
    Mul(tmp, v, v, n);
    float s = 0.0f;
    for (int64_t i = 0; i < n; ++i) s += tmp.GetValue(i);  // in order, as the reference sums
    return s;
}

template <typename T>
__aicore__ inline void l2norm(const L2NormArgs &a)
{
    uint32_t start, count;
    kda_share(a.h.tiling, start, count);
    const int64_t dim = a.x.shape[a.x.rank - 1];
    GlobalTensor<T> x, y;
    x.SetGlobalBuffer(kda_gm<T>(a.x));
    y.SetGlobalBuffer(kda_gm<T>(a.y));
    TPipe pipe;
    TBuf<TPosition::VECCALC> rb, vb, tb;
    pipe.InitBuffer(rb, dim * sizeof(T));
    pipe.InitBuffer(vb, dim * sizeof(float));
    pipe.InitBuffer(tb, dim * sizeof(float));
    LocalTensor<T> raw = rb.Get<T>();
    LocalTensor<float> v = vb.Get<float>(), tmp = tb.Get<float>();
    for (uint32_t row = start; row < start + count; ++row) {
        load_f32(v, raw, x, kda_row_offset(a.x, row), dim);
        float inv = 1.0f / sqrt(sum_squares(v, tmp, dim) + 1e-6f);
        Muls(v, v, inv, dim);
        Muls(v, v, static_cast<float>(a.scale), dim);
        store_f32(y, kda_row_offset(a.y, row), raw, v, dim);
    }
}

template <typename T>
__aicore__ inline void gated_rms_norm(const GatedRmsNormArgs &a)
{
    uint32_t start, count;
    kda_share(a.h.tiling, start, count);
    const int64_t dim = a.x.shape[a.x.rank - 1];
    GlobalTensor<T> x, gate, y;
    GlobalTensor<float> weight;
    x.SetGlobalBuffer(kda_gm<T>(a.x));
    gate.SetGlobalBuffer(kda_gm<T>(a.gate));
    y.SetGlobalBuffer(kda_gm<T>(a.y));
    weight.SetGlobalBuffer(kda_gm<float>(a.weight));
    TPipe pipe;
    TBuf<TPosition::VECCALC> rb, vb, gb, wb, tb;
    pipe.InitBuffer(rb, dim * sizeof(T));
    pipe.InitBuffer(vb, dim * sizeof(float));
    pipe.InitBuffer(gb, dim * sizeof(float));
    pipe.InitBuffer(wb, dim * sizeof(float));
    pipe.InitBuffer(tb, dim * sizeof(float));
    LocalTensor<T> raw = rb.Get<T>();
    LocalTensor<float> v = vb.Get<float>(), g = gb.Get<float>(), w = wb.Get<float>(), tmp = tb.Get<float>();
    DataCopy(w, weight, dim);
    for (uint32_t row = start; row < start + count; ++row) {
        load_f32(v, raw, x, kda_row_offset(a.x, row), dim);
        load_f32(g, raw, gate, kda_row_offset(a.gate, row), dim);
        float inv = 1.0f / sqrt(sum_squares(v, tmp, dim) / static_cast<float>(dim) + static_cast<float>(a.eps));
        Muls(v, v, inv, dim);
        Mul(v, v, w, dim);
        // sigmoid(gate) = 1 / (1 + exp(-gate))
        Muls(g, g, -1.0f, dim);
        Exp(g, g, dim);
        Adds(g, g, 1.0f, dim);
        Div(v, v, g, dim);
        store_f32(y, kda_row_offset(a.y, row), raw, v, dim);
    }
}

extern "C" __global__ __aicore__ void kda_l2norm(GM_ADDR x, GM_ADDR y, GM_ADDR meta)
{
    KDA_VECTOR_KERNEL();
    L2NormArgs args;
    GM_ADDR tensors[] = {x, y};
    kda_load_args(args, meta, tensors, 2);
    KDA_FOR_FLOAT_DTYPE(args.x.dtype, l2norm, args);
}

extern "C" __global__ __aicore__ void kda_gated_rms_norm(GM_ADDR x, GM_ADDR gate, GM_ADDR weight, GM_ADDR y, GM_ADDR meta)
{
    KDA_VECTOR_KERNEL();
    GatedRmsNormArgs args;
    GM_ADDR tensors[] = {x, gate, weight, y};
    kda_load_args(args, meta, tensors, 4);
    KDA_FOR_FLOAT_DTYPE(args.x.dtype, gated_rms_norm, args);
}
