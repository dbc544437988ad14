// KDA gate, both forms, fp32: for row (t, h) and c in [0, D):
//   a = g1[t, h, c] + dt_bias[h, c]
//   softplus form:    g = -exp(A_log[h]) * softplus(a)   (softplus(a) = a past the threshold 20)
//   lower-bound form: g = lower_bound * sigmoid(exp(A_log[h]) * a)
// Units: (token, head) rows of D values.
#include "kda_kernel_abi.h"

using namespace AscendC;

struct GateArgs {
    ArgsHeader h;
    GmTensor g1;       // [T, H, D] any float
    GmTensor a_log;    // [H] f32
    GmTensor dt_bias;  // [H, D] f32
    GmTensor g;        // [T, H, D] f32, dense
    double form;       // 0 softplus, 1 lower bound
    double lower_bound;
};

constexpr float SOFTPLUS_THRESHOLD = 20.0f;

template <typename T>
__aicore__ inline void gate_rows(const GateArgs &a)
{
    uint32_t start, count;
    kda_share(a.h.tiling, start, count);
    const int64_t heads = a.g1.shape[1], dim = a.g1.shape[2];
    GlobalTensor<T> g1;
    GlobalTensor<float> alog, bias, out;
    g1.SetGlobalBuffer(kda_gm<T>(a.g1));
    alog.SetGlobalBuffer(kda_gm<float>(a.a_log));
    bias.SetGlobalBuffer(kda_gm<float>(a.dt_bias));
    out.SetGlobalBuffer(kda_gm<float>(a.g));
    TPipe pipe;
    TBuf<TPosition::VECCALC> raw, x, b, t;
    pipe.InitBuffer(raw, dim * sizeof(T));
    pipe.InitBuffer(x, dim * sizeof(float));
    pipe.InitBuffer(b, dim * sizeof(float));
    pipe.InitBuffer(t, dim * sizeof(float));
    LocalTensor<T> r = raw.Get<T>();
    LocalTensor<float> v = x.Get<float>(), bv = b.Get<float>(), tv = t.Get<float>();
    for (uint32_t row = start; row < start + count; ++row) {
        int64_t tok = row / heads, h = row % heads;
        DataCopy(r, g1[tok * a.g1.strides[0] + h * a.g1.strides[1]], dim);
        DataCopy(bv, bias[h * a.dt_bias.strides[0]], dim);
        PipeBarrier<PIPE_ALL>();
        if constexpr (sizeof(T) == sizeof(float)) {
            DataCopy(v, r, dim);
        } else {
            Cast(v, r, RoundMode::CAST_NONE, dim);
        }
        Add(v, v, bv, dim);
        float e = alog.GetValue(h * a.a_log.strides[0]);
        e = exp(e);
        if (a.form == 0.0) {
            // softplus(a) = log(1 + exp(a)), a itself past the threshold.
            Exp(tv, v, dim);
            Adds(tv, tv, 1.0f, dim);
            Ln(tv, tv, dim);
            for (int64_t c = 0; c < dim; ++c) {
                if (v.GetValue(c) > SOFTPLUS_THRESHOLD) tv.SetValue(c, v.GetValue(c));
            }
            Muls(v, tv, -e, dim);
        } else {
            Muls(v, v, -e, dim);
            Exp(v, v, dim);
            Adds(v, v, 1.0f, dim);
            Duplicate(tv, static_cast<float>(a.lower_bound), dim);
            Div(v, tv, v, dim);
        }
        PipeBarrier<PIPE_ALL>();
        DataCopy(out[row * dim], v, dim);
    }
}

extern "C" __global__ __aicore__ void kda_gate(GM_ADDR g1, GM_ADDR a_log, GM_ADDR dt_bias, GM_ADDR g, GM_ADDR meta)
{
    KDA_VECTOR_KERNEL();
    GateArgs args;
    GM_ADDR tensors[] = {g1, a_log, dt_bias, g};
    kda_load_args(args, meta, tensors, 4);
    KDA_FOR_FLOAT_DTYPE(args.g1.dtype, gate_rows, args);
}
