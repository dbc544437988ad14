// The KDA delta rule, one token at a time, on a v-first f32 state S^T [V, K] held in the
// unified buffer (docs/design/kda.md): the one device-side form of the recurrence, shared by
// kda_recurrent_step (decode, speculative decode) and kda_chunk_prefill (prefill). For one
// token of one head:
//   q, k L2-normalised (optional, eps 1e-6 inside the square root), q *= scale
//   S^T[v, :] *= exp(g[:])                       (per-channel decay)
//   u[v] = beta * (v_t[v] - S^T[v, :] . k)       (delta rule)
//   S^T[v, :] += u[v] * k
//   o[v] = S^T[v, :] . q
// Operands may each be f32, bf16 or f16 (the HAL lets them differ): rows are read through
// kda_rows.h and computed in f32. The state's UB rows are Kp floats apart (K padded to 32 bytes).
// UB (tiling.rs `delta_rule_bytes` counts exactly this): the state V x Kp, then one buffer of
// q, k, g, tmp (Kp each), v, o (Vp each), red, work, one (8 each) f32 and a 16-bit stage row of
// max(K, V) values.
// AI Core rules: see kda_kernel_util.h (not compiled here: no bisheng).
#ifndef KDA_DELTA_RULE_H
#define KDA_DELTA_RULE_H

#include "kda_rows.h"

struct KdaDelta {
    AscendC::LocalTensor<float> S, qf, kf, gf, tmp, vf, of, red, work, one;
    AscendC::LocalTensor<half> stage;
    int64_t K, V, Kp;
};

// The buffers of one (sequence, head) unit of K x V.
__aicore__ inline KdaDelta kda_delta_init(AscendC::TPipe &pipe,
                                          AscendC::TBuf<AscendC::TPosition::VECCALC> &sb,
                                          AscendC::TBuf<AscendC::TPosition::VECCALC> &vb,
                                          int64_t K, int64_t V)
{
    const int64_t Kp = kda_pitch(K, sizeof(float)), Vp = kda_pitch(V, sizeof(float));
    const int64_t Hp = kda_pitch(K > V ? K : V, sizeof(half));
    const int64_t floats = 4 * Kp + 2 * Vp + 24;
    pipe.InitBuffer(sb, V * Kp * sizeof(float));
    pipe.InitBuffer(vb, floats * sizeof(float) + Hp * sizeof(half));
    KdaDelta d;
    d.S = sb.Get<float>();
    AscendC::LocalTensor<float> f = vb.Get<float>();
    d.qf = f;
    d.kf = f[Kp];
    d.gf = f[2 * Kp];
    d.tmp = f[3 * Kp];
    d.vf = f[4 * Kp];
    d.of = f[4 * Kp + Vp];
    d.red = f[4 * Kp + 2 * Vp];
    d.work = f[4 * Kp + 2 * Vp + 8];
    d.one = f[4 * Kp + 2 * Vp + 16];
    d.stage = f[floats].ReinterpretCast<half>();
    d.K = K;
    d.V = V;
    d.Kp = Kp;
    return d;
}

// sum_i x[i] y[i] over `n` values, read by the scalar unit.
__aicore__ inline float kda_delta_dot(const KdaDelta &d, const AscendC::LocalTensor<float> &x,
                                      const AscendC::LocalTensor<float> &y, int64_t n)
{
    using namespace AscendC;
    Mul(d.tmp, x, y, n);
    PipeBarrier<PIPE_V>();
    ReduceSum(d.red, d.tmp, d.work, n);
    SetFlag<HardEvent::V_S>(EVENT_ID0);
    WaitFlag<HardEvent::V_S>(EVENT_ID0);
    return d.red.GetValue(0);
}

// x *= 1 / sqrt(sum x^2 + 1e-6): the square root on the vector unit (one block).
__aicore__ inline void kda_delta_l2norm(const KdaDelta &d, const AscendC::LocalTensor<float> &x,
                                        int64_t n)
{
    using namespace AscendC;
    Mul(d.tmp, x, x, n);
    PipeBarrier<PIPE_V>();
    ReduceSum(d.red, d.tmp, d.work, n);
    PipeBarrier<PIPE_V>();
    Adds(d.red, d.red, 1e-6f, 1);
    PipeBarrier<PIPE_V>();
    Sqrt(d.red, d.red, 1);
    SetFlag<HardEvent::V_S>(EVENT_ID0);
    WaitFlag<HardEvent::V_S>(EVENT_ID0);
    float inv = 1.0f / d.red.GetValue(0);
    SetFlag<HardEvent::S_V>(EVENT_ID0);
    WaitFlag<HardEvent::S_V>(EVENT_ID0);
    Muls(x, x, inv, n);
    PipeBarrier<PIPE_V>();
}

// One token: q, k, v, g rows at element offsets qo, ko, vo, go of their tensors and beta at bo;
// updates S and leaves the token's output in `of` (ready for the vector unit and MTE3).
__aicore__ inline void kda_delta_token(const KdaDelta &d, const GmTensor &q, int64_t qo,
                                       const GmTensor &k, int64_t ko, const GmTensor &v,
                                       int64_t vo, const GmTensor &g, int64_t go,
                                       const GmTensor &beta, int64_t bo, float scale, bool l2)
{
    using namespace AscendC;
    const int64_t K = d.K, V = d.V;
    // The previous token's vector work and stores are done with these rows (its store waited
    // MTE3 -> MTE2); the loads may overwrite them.
    SetFlag<HardEvent::V_MTE2>(EVENT_ID0);
    WaitFlag<HardEvent::V_MTE2>(EVENT_ID0);
    const float bt = kda_load_scalar(d.one, d.stage, beta, bo);
    kda_load_row(d.qf, d.stage, q, qo, K);
    kda_load_row(d.kf, d.stage, k, ko, K);
    kda_load_row(d.vf, d.stage, v, vo, V);
    kda_load_row(d.gf, d.stage, g, go, K);
    if (l2) {
        kda_delta_l2norm(d, d.qf, K);
        kda_delta_l2norm(d, d.kf, K);
    }
    Muls(d.qf, d.qf, scale, K);
    Exp(d.gf, d.gf, K);
    PipeBarrier<PIPE_V>();
    // The scalar unit reads v: the loads and conversions above are done.
    SetFlag<HardEvent::V_S>(EVENT_ID0);
    WaitFlag<HardEvent::V_S>(EVENT_ID0);
    for (int64_t r = 0; r < V; ++r) {
        LocalTensor<float> row = d.S[r * d.Kp];
        Mul(row, row, d.gf, K);
        PipeBarrier<PIPE_V>();
        float dot = kda_delta_dot(d, row, d.kf, K);
        float u = bt * (d.vf.GetValue(r) - dot);
        SetFlag<HardEvent::S_V>(EVENT_ID0);
        WaitFlag<HardEvent::S_V>(EVENT_ID0);
        Axpy(row, d.kf, u, K);
        PipeBarrier<PIPE_V>();
        d.of.SetValue(r, kda_delta_dot(d, row, d.qf, K));
    }
    // `of` was written by the scalar unit: hand it to the vector unit (and so to MTE3).
    SetFlag<HardEvent::S_V>(EVENT_ID0);
    WaitFlag<HardEvent::S_V>(EVENT_ID0);
}

// The state of (slot, head) at GM element `at` into S: rows state.strides[2] apart with K
// contiguous (one DataCopyPad), or a transposed (k-first) view whose V values are contiguous,
// gathered by the scalar unit (each read invalidates its line: earlier tasks wrote the state).
__aicore__ inline void kda_delta_load_state(const KdaDelta &d, const GmTensor &state, int64_t at)
{
    using namespace AscendC;
    GlobalTensor<float> st;
    st.SetGlobalBuffer(kda_gm<float>(state));
    // A store of S (the previous unit's) has finished reading it.
    SetFlag<HardEvent::MTE3_MTE2>(EVENT_ID0);
    WaitFlag<HardEvent::MTE3_MTE2>(EVENT_ID0);
    if (state.strides[3] != 1) {
        ascendc_assert(state.strides[2] == 1, "state view with neither K nor V contiguous\n");
        SetFlag<HardEvent::MTE3_S>(EVENT_ID0);
        WaitFlag<HardEvent::MTE3_S>(EVENT_ID0);
        SetFlag<HardEvent::V_S>(EVENT_ID0);
        WaitFlag<HardEvent::V_S>(EVENT_ID0);
        for (int64_t v = 0; v < d.V; ++v) {
            for (int64_t k = 0; k < d.K; ++k) {
                d.S.SetValue(v * d.Kp + k, kda_read(st, at + v + k * state.strides[3]));
            }
        }
        SetFlag<HardEvent::S_V>(EVENT_ID1);
        WaitFlag<HardEvent::S_V>(EVENT_ID1);
        return;
    }
    const uint32_t row_bytes = static_cast<uint32_t>(d.K * sizeof(float));
    const uint32_t gap = static_cast<uint32_t>((state.strides[2] - d.K) * sizeof(float));
    DataCopyPadExtParams<float> no_pad{false, 0, 0, 0};
    DataCopyPad(d.S, st[at], DataCopyExtParams{static_cast<uint16_t>(d.V), row_bytes, gap, 0, 0}, no_pad);
    SetFlag<HardEvent::MTE2_V>(EVENT_ID1);
    WaitFlag<HardEvent::MTE2_V>(EVENT_ID1);
}

// A zero state (a request without an initial state).
__aicore__ inline void kda_delta_zero_state(const KdaDelta &d)
{
    using namespace AscendC;
    SetFlag<HardEvent::MTE3_V>(EVENT_ID0);
    WaitFlag<HardEvent::MTE3_V>(EVENT_ID0);
    Duplicate(d.S, 0.0f, static_cast<int32_t>(d.V * d.Kp));
    PipeBarrier<PIPE_V>();
}

// S to the state of (slot, head) at GM element `at`; on return S may be modified again. A
// transposed (k-first) view is written column by column: the scalar unit gathers S[:, k] into
// the `of` row (free here: the token's output was stored), then one DataCopyPad per k.
__aicore__ inline void kda_delta_store_state(const KdaDelta &d, const GmTensor &state, int64_t at)
{
    using namespace AscendC;
    GlobalTensor<float> st;
    st.SetGlobalBuffer(kda_gm<float>(state));
    if (state.strides[3] != 1) {
        ascendc_assert(state.strides[2] == 1, "state view with neither K nor V contiguous\n");
        const DataCopyExtParams col{1, static_cast<uint32_t>(d.V * sizeof(float)), 0, 0, 0};
        SetFlag<HardEvent::V_S>(EVENT_ID0);
        WaitFlag<HardEvent::V_S>(EVENT_ID0);
        for (int64_t k = 0; k < d.K; ++k) {
            // The previous column's store has read `of`.
            SetFlag<HardEvent::MTE3_S>(EVENT_ID0);
            WaitFlag<HardEvent::MTE3_S>(EVENT_ID0);
            for (int64_t v = 0; v < d.V; ++v) d.of.SetValue(v, d.S.GetValue(v * d.Kp + k));
            SetFlag<HardEvent::S_MTE3>(EVENT_ID0);
            WaitFlag<HardEvent::S_MTE3>(EVENT_ID0);
            DataCopyPad(st[at + k * state.strides[3]], d.of, col);
        }
        SetFlag<HardEvent::MTE3_V>(EVENT_ID0);
        WaitFlag<HardEvent::MTE3_V>(EVENT_ID0);
        SetFlag<HardEvent::MTE3_S>(EVENT_ID0);
        WaitFlag<HardEvent::MTE3_S>(EVENT_ID0);
        return;
    }
    const uint32_t row_bytes = static_cast<uint32_t>(d.K * sizeof(float));
    const uint32_t gap = static_cast<uint32_t>((state.strides[2] - d.K) * sizeof(float));
    SetFlag<HardEvent::V_MTE3>(EVENT_ID0);
    WaitFlag<HardEvent::V_MTE3>(EVENT_ID0);
    DataCopyPad(st[at], d.S, DataCopyExtParams{static_cast<uint16_t>(d.V), row_bytes, 0, gap, 0});
    SetFlag<HardEvent::MTE3_V>(EVENT_ID0);
    WaitFlag<HardEvent::MTE3_V>(EVENT_ID0);
}

#endif
