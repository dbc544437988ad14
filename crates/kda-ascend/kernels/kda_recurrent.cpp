// One KDA recurrent step per token (decode, speculative decode), fp32 state. For sequence b,
// head h, with the v-first state S^T [V, K] in the slot:
//   q, k L2-normalised (optional), q *= scale
//   S^T[v, :] *= exp(g[:])                       (per-channel decay)
//   u[v] = beta * (v_t[v] - S^T[v, :] . k)       (delta rule)
//   S^T[v, :] += u[v] * k
//   o[v] = S^T[v, :] . q
// Units: (sequence, head) pairs; one unit's state (V x K fp32) lives in the unified buffer.
#include "kda_kernel_abi.h"

using namespace AscendC;

struct RecurrentArgs {
    ArgsHeader h;
    GmTensor q, k, v, g, beta;    // [B, T, H, K|V], g f32 [B, T, H, K], beta f32 [B, T, H]
    GmTensor state_slots;         // [B] i32
    GmTensor num_accepted_tokens; // [B] i32, optional
    GmTensor state;               // [slots, H, V, K] f32
    GmTensor o;                   // [B, T, H, V]
    double scale;
    double qk_l2norm;
};

template <typename T>
__aicore__ inline void step(const RecurrentArgs &a)
{
    uint32_t start, count;
    kda_share(a.h.tiling, start, count);
    const int64_t heads = a.q.shape[2], K = a.q.shape[3], V = a.v.shape[3], T_ = a.q.shape[1];
    GlobalTensor<float> st, g, beta;
    GlobalTensor<T> q, k, v, o;
    GlobalTensor<int32_t> slots;
    st.SetGlobalBuffer(kda_gm<float>(a.state));
    g.SetGlobalBuffer(kda_gm<float>(a.g));
    beta.SetGlobalBuffer(kda_gm<float>(a.beta));
    q.SetGlobalBuffer(kda_gm<T>(a.q));
    k.SetGlobalBuffer(kda_gm<T>(a.k));
    v.SetGlobalBuffer(kda_gm<T>(a.v));
    o.SetGlobalBuffer(kda_gm<T>(a.o));
    slots.SetGlobalBuffer(kda_gm<int32_t>(a.state_slots));
    TPipe pipe;
    TBuf<TPosition::VECCALC> sb, vb;
    pipe.InitBuffer(sb, V * K * sizeof(float));
    pipe.InitBuffer(vb, (3 * K + 2 * V) * sizeof(float));
    LocalTensor<float> S = sb.Get<float>();
    LocalTensor<float> scratch = vb.Get<float>();
    LocalTensor<float> qf = scratch, kf = scratch[K], gf = scratch[2 * K], vf = scratch[3 * K], of = scratch[3 * K + V];
    for (uint32_t unit = start; unit < start + count; ++unit) {
        int64_t b = unit / heads, h = unit % heads;
        int32_t slot = slots.GetValue(b * a.state_slots.strides[0]);
        if (slot < 0) continue;
        int64_t s0 = slot * a.state.strides[0] + h * a.state.strides[1];
        DataCopy(S, st[s0], V * K);
        PipeBarrier<PIPE_ALL>();
        for (int64_t t = 0; t < T_; ++t) {
            int64_t qo = b * a.q.strides[0] + t * a.q.strides[1] + h * a.q.strides[2];
            int64_t vo = b * a.v.strides[0] + t * a.v.strides[1] + h * a.v.strides[2];
            for (int64_t i = 0; i < K; ++i) {
                qf.SetValue(i, static_cast<float>(q.GetValue(qo + i)));
                kf.SetValue(i, static_cast<float>(k.GetValue(qo + i)));
                gf.SetValue(i, g.GetValue(b * a.g.strides[0] + t * a.g.strides[1] + h * a.g.strides[2] + i));
            }
            for (int64_t i = 0; i < V; ++i) vf.SetValue(i, static_cast<float>(v.GetValue(vo + i)));
            if (a.qk_l2norm != 0.0) {
                float qq = 0.0f, kk = 0.0f;
                for (int64_t i = 0; i < K; ++i) { qq += qf.GetValue(i) * qf.GetValue(i); kk += kf.GetValue(i) * kf.GetValue(i); }
                Muls(qf, qf, 1.0f / sqrt(qq + 1e-6f), K);
                Muls(kf, kf, 1.0f / sqrt(kk + 1e-6f), K);
            }
            Muls(qf, qf, static_cast<float>(a.scale), K);
            Exp(gf, gf, K);
            float bt = beta.GetValue(b * a.beta.strides[0] + t * a.beta.strides[1] + h * a.beta.strides[2]);
            for (int64_t r = 0; r < V; ++r) {
                LocalTensor<float> row = S[r * K];
                Mul(row, row, gf, K);
                float dot = 0.0f;
                for (int64_t i = 0; i < K; ++i) dot += row.GetValue(i) * kf.GetValue(i);
                float u = bt * (vf.GetValue(r) - dot);
                Axpy(row, kf, u, K);
                float out = 0.0f;
                for (int64_t i = 0; i < K; ++i) out += row.GetValue(i) * qf.GetValue(i);
                of.SetValue(r, out);
            }
            int64_t oo = b * a.o.strides[0] + t * a.o.strides[1] + h * a.o.strides[2];
            for (int64_t i = 0; i < V; ++i) o.SetValue(oo + i, static_cast<T>(of.GetValue(i)));
        }
        PipeBarrier<PIPE_ALL>();
        DataCopy(st[s0], S, V * K);
    }
}

extern "C" __global__ __aicore__ void kda_recurrent_step(GM_ADDR q, GM_ADDR k, GM_ADDR v, GM_ADDR g, GM_ADDR beta, GM_ADDR state_slots, GM_ADDR num_accepted_tokens, GM_ADDR state, GM_ADDR o, GM_ADDR meta)
{
    KDA_VECTOR_KERNEL();
    RecurrentArgs args;
    GM_ADDR tensors[] = {q, k, v, g, beta, state_slots, num_accepted_tokens, state, o};
    kda_load_args(args, meta, tensors, 9);
    KDA_FOR_FLOAT_DTYPE(args.q.dtype, step, args);
}
