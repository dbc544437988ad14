// KDA gate, both forms, fp32: for row (t, h) and c in [0, D):
//   a = g1[t, h, c] + dt_bias[h, c]
//   softplus form:    g = -exp(A_log[h]) * softplus(a)   (softplus(a) = a past the threshold 20)
//   lower-bound form: g = lower_bound * sigmoid(exp(A_log[h]) * a), kept strictly above the bound
// Units: (token, head) rows of D values.
#include "kda_kernel_util.h"

using namespace AscendC;

struct GateArgs {
    ArgsHeader h;
    GmTensor g1;       // [T, H, D] any float
    GmTensor a_log;    // [H] f32
    GmTensor dt_bias;  // [H, D] f32
    GmTensor g;        // [T, H, D] f32, dense
    uint64_t form_bits;         // f64 bits: 0 softplus, 1 lower bound
    uint64_t lower_bound_bits;  // f64 bits
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
    const bool lower = kda_f64_bits_nonzero(a.form_bits);
    const float bound = kda_f64_bits_to_f32(a.lower_bound_bits);
    // The f32 next to the (negative) bound toward zero: its bit pattern minus one.
    union {
        float f;
        uint32_t u;
    } nudge;
    nudge.f = bound;
    nudge.u -= 1u;
    const float above = nudge.f;
    const int64_t pitch = kda_pitch(dim, sizeof(float));
    TPipe pipe;
    TBuf<TPosition::VECCALC> raw, x, b, t, o;
    pipe.InitBuffer(raw, kda_pitch(dim, sizeof(T)) * sizeof(T));
    pipe.InitBuffer(x, pitch * sizeof(float));
    pipe.InitBuffer(b, pitch * sizeof(float));
    pipe.InitBuffer(t, pitch * sizeof(float));
    pipe.InitBuffer(o, 8 * sizeof(float));
    LocalTensor<T> r = raw.Get<T>();
    LocalTensor<float> v = x.Get<float>(), bv = b.Get<float>(), tv = t.Get<float>();
    LocalTensor<float> one = o.Get<float>();
    for (uint32_t row = start; row < start + count; ++row) {
        int64_t tok = row / heads, h = row % heads;
        kda_load_f32<T>(v, r, g1, tok * a.g1.strides[0] + h * a.g1.strides[1], dim);
        kda_load_f32<float>(bv, bv, bias, h * a.dt_bias.strides[0], dim);
        Add(v, v, bv, dim);
        PipeBarrier<PIPE_V>();
        float e = kda_vector_exp(one, kda_read(alog, h * a.a_log.strides[0]));
        if (!lower) {
            // softplus(a) = log(1 + exp(a)), a itself past the threshold.
            Exp(tv, v, dim);
            PipeBarrier<PIPE_V>();
            Adds(tv, tv, 1.0f, dim);
            PipeBarrier<PIPE_V>();
            Ln(tv, tv, dim);
            SetFlag<HardEvent::V_S>(EVENT_ID0);
            WaitFlag<HardEvent::V_S>(EVENT_ID0);
            for (int64_t c = 0; c < dim; ++c) {
                if (v.GetValue(c) > SOFTPLUS_THRESHOLD) tv.SetValue(c, v.GetValue(c));
            }
            SetFlag<HardEvent::S_V>(EVENT_ID0);
            WaitFlag<HardEvent::S_V>(EVENT_ID0);
            Muls(v, tv, -e, dim);
        } else {
            SetFlag<HardEvent::S_V>(EVENT_ID0);
            WaitFlag<HardEvent::S_V>(EVENT_ID0);
            Muls(v, v, -e, dim);
            PipeBarrier<PIPE_V>();
            Exp(v, v, dim);
            PipeBarrier<PIPE_V>();
            Adds(v, v, 1.0f, dim);
            Duplicate(tv, bound, dim);
            PipeBarrier<PIPE_V>();
            Div(v, tv, v, dim);
            // Once the sigmoid rounds to 1 (e·a past about 17) the quotient is the bound itself,
            // and f32 has nothing strictly between: the form promises g in (bound, 0], so such
            // values move one ulp toward zero, as the reference does (kda-reference
            // kernels/kda/gate.rs). NaN compares false and passes through.
            SetFlag<HardEvent::V_S>(EVENT_ID0);
            WaitFlag<HardEvent::V_S>(EVENT_ID0);
            for (int64_t c = 0; c < dim; ++c) {
                if (v.GetValue(c) <= bound) v.SetValue(c, above);
            }
            SetFlag<HardEvent::S_V>(EVENT_ID0);
            WaitFlag<HardEvent::S_V>(EVENT_ID0);
        }
        PipeBarrier<PIPE_V>();
        kda_store_f32<float>(out, row * dim, tv, v, dim);
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
