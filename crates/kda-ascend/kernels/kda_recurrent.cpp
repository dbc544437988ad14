// One KDA recurrent step per token (decode, speculative decode), fp32 state. For sequence b,
// head h, with the v-first state S^T [V, K] in a slot:
//   q, k L2-normalised (optional), q *= scale
//   S^T[v, :] *= exp(g[:])                       (per-channel decay)
//   u[v] = beta * (v_t[v] - S^T[v, :] . k)       (delta rule)
//   S^T[v, :] += u[v] * k
//   o[v] = S^T[v, :] . q
// Slots (the HAL's KdaRecurrent, docs/design/kda.md#speculative-decode): request b starts from
// slot state_slots[b, a - 1], a = num_accepted_tokens[b] (1 when absent), and writes the state
// after its token t into slot state_slots[b, t] when that entry is >= 0; a negative initial
// slot marks a padding request (zero outputs, no state written).
// Units: (sequence, head) pairs; one unit's state (V x K fp32, rows padded to 32 bytes) lives
// in the unified buffer.
//
// AI Core rules this body keeps (AscendC programming guide: DataCopyPad, SetFlag/WaitFlag,
// GlobalTensor::GetValue, DataCacheCleanAndInvalid):
// - every GM <-> UB move is a DataCopyPad, so rows whose byte length is not a multiple of 32
//   (K or V not a multiple of 8 in f32, of 16 in bf16) are moved whole, not truncated;
// - each hand-over between pipes is ordered by a flag: MTE2 -> V after a load, V -> MTE3
//   before a store, MTE3 -> V before the stored buffer is modified again, MTE3 -> MTE2 before
//   a stored buffer is loaded again, V -> S before the scalar unit reads a vector result, and
//   PIPE_V barriers between dependent vector instructions (explicit: this file does not rely
//   on --cce-auto-sync);
// - outputs and states go to GM through MTE3 only (no scalar GM writes, so no two cores share
//   a dirtied cache line); the scalar metadata reads (slots, counts, beta) invalidate their
//   cache line first, since earlier tasks wrote that memory;
// - no double arithmetic: the f64 scalars of the meta region are converted bit by bit; exp and
//   sqrt are vector instructions on one-block tensors, never scalar library calls.
#include "kda_kernel_util.h"

using namespace AscendC;

struct RecurrentArgs {
    ArgsHeader h;
    GmTensor q, k, v, g, beta;    // [B, T, H, K|V], g f32 [B, T, H, K], beta f32 [B, T, H]
    GmTensor state_slots;         // [B, T] i32
    GmTensor num_accepted_tokens; // [B] i32, optional (addr 0)
    GmTensor state;               // [slots, H, V, K] f32
    GmTensor o;                   // [B, T, H, V]
    uint64_t scale_bits;          // f64 bits (read without double arithmetic)
    uint64_t qk_l2norm_bits;      // f64 bits, nonzero = on
};

// Σ x[i]·y[i] over `n` values, read by the scalar unit.
__aicore__ inline float kda_dot(const LocalTensor<float> &x, const LocalTensor<float> &y,
                                const LocalTensor<float> &tmp, const LocalTensor<float> &red,
                                const LocalTensor<float> &work, int64_t n)
{
    Mul(tmp, x, y, n);
    PipeBarrier<PIPE_V>();
    ReduceSum(red, tmp, work, n);
    SetFlag<HardEvent::V_S>(EVENT_ID0);
    WaitFlag<HardEvent::V_S>(EVENT_ID0);
    return red.GetValue(0);
}

// x *= 1 / sqrt(Σ x² + 1e-6): the square root on the vector unit (one block).
__aicore__ inline void kda_l2norm(const LocalTensor<float> &x, const LocalTensor<float> &tmp,
                                  const LocalTensor<float> &red, const LocalTensor<float> &work,
                                  int64_t n)
{
    Mul(tmp, x, x, n);
    PipeBarrier<PIPE_V>();
    ReduceSum(red, tmp, work, n);
    PipeBarrier<PIPE_V>();
    Adds(red, red, 1e-6f, 1);
    PipeBarrier<PIPE_V>();
    Sqrt(red, red, 1);
    SetFlag<HardEvent::V_S>(EVENT_ID0);
    WaitFlag<HardEvent::V_S>(EVENT_ID0);
    float inv = 1.0f / red.GetValue(0);
    SetFlag<HardEvent::S_V>(EVENT_ID0);
    WaitFlag<HardEvent::S_V>(EVENT_ID0);
    Muls(x, x, inv, n);
    PipeBarrier<PIPE_V>();
}

template <typename T>
__aicore__ inline void step(const RecurrentArgs &a)
{
    uint32_t start, count;
    kda_share(a.h.tiling, start, count);
    const int64_t heads = a.q.shape[2], K = a.q.shape[3], V = a.v.shape[3], T_ = a.q.shape[1];
    const int64_t Kp = kda_pitch(K, sizeof(float)), Vp = kda_pitch(V, sizeof(float));
    const int64_t Sp = kda_pitch(K > V ? K : V, sizeof(T));
    const float scale = kda_f64_bits_to_f32(a.scale_bits);
    const bool l2 = kda_f64_bits_nonzero(a.qk_l2norm_bits);
    const bool has_accepted = a.num_accepted_tokens.addr != 0;
    GlobalTensor<float> st, g, beta;
    GlobalTensor<T> q, k, v, o;
    GlobalTensor<int32_t> slots, accepted;
    st.SetGlobalBuffer(kda_gm<float>(a.state));
    g.SetGlobalBuffer(kda_gm<float>(a.g));
    beta.SetGlobalBuffer(kda_gm<float>(a.beta));
    q.SetGlobalBuffer(kda_gm<T>(a.q));
    k.SetGlobalBuffer(kda_gm<T>(a.k));
    v.SetGlobalBuffer(kda_gm<T>(a.v));
    o.SetGlobalBuffer(kda_gm<T>(a.o));
    slots.SetGlobalBuffer(kda_gm<int32_t>(a.state_slots));
    if (has_accepted) {
        accepted.SetGlobalBuffer(kda_gm<int32_t>(a.num_accepted_tokens));
    }
    TPipe pipe;
    TBuf<TPosition::VECCALC> sb, vb, tb;
    pipe.InitBuffer(sb, V * Kp * sizeof(float));
    pipe.InitBuffer(vb, (4 * Kp + 2 * Vp + 16) * sizeof(float));
    pipe.InitBuffer(tb, 2 * Sp * sizeof(T));
    LocalTensor<float> S = sb.Get<float>();
    LocalTensor<float> f = vb.Get<float>();
    LocalTensor<float> qf = f, kf = f[Kp], gf = f[2 * Kp], tmp = f[3 * Kp];
    LocalTensor<float> vf = f[4 * Kp], of = f[4 * Kp + Vp], red = f[4 * Kp + 2 * Vp];
    LocalTensor<float> work = f[4 * Kp + 2 * Vp + 8];
    LocalTensor<T> stage = tb.Get<T>(), ot = stage[Sp];
    // State rows: V blocks of K floats, GM rows state.strides[2] apart, UB rows Kp apart.
    const uint32_t row_bytes = static_cast<uint32_t>(K * sizeof(float));
    const uint32_t gm_gap = static_cast<uint32_t>((a.state.strides[2] - K) * sizeof(float));
    DataCopyPadExtParams<float> no_pad{false, 0, 0, 0};
    for (uint32_t unit = start; unit < start + count; ++unit) {
        int64_t b = unit / heads, h = unit % heads;
        int64_t a0 = has_accepted ? kda_read(accepted, b * a.num_accepted_tokens.strides[0]) : 1;
        int64_t slot_at = b * a.state_slots.strides[0];
        int32_t first = kda_read(slots, slot_at + (a0 - 1) * a.state_slots.strides[1]);
        if (first < 0) {
            // Padding: zero outputs, no state.
            Duplicate(of, 0.0f, V);
            PipeBarrier<PIPE_V>();
            if constexpr (IsSameType<T, float>::value) {
                SetFlag<HardEvent::V_MTE3>(EVENT_ID0);
                WaitFlag<HardEvent::V_MTE3>(EVENT_ID0);
                for (int64_t t = 0; t < T_; ++t) {
                    int64_t oo = b * a.o.strides[0] + t * a.o.strides[1] + h * a.o.strides[2];
                    DataCopyPad(o[oo], of, DataCopyExtParams{1, static_cast<uint32_t>(V * sizeof(T)), 0, 0, 0});
                }
            } else {
                Cast(ot, of, RoundMode::CAST_RINT, V);
                SetFlag<HardEvent::V_MTE3>(EVENT_ID0);
                WaitFlag<HardEvent::V_MTE3>(EVENT_ID0);
                for (int64_t t = 0; t < T_; ++t) {
                    int64_t oo = b * a.o.strides[0] + t * a.o.strides[1] + h * a.o.strides[2];
                    DataCopyPad(o[oo], ot, DataCopyExtParams{1, static_cast<uint32_t>(V * sizeof(T)), 0, 0, 0});
                }
            }
            SetFlag<HardEvent::MTE3_V>(EVENT_ID0);
            WaitFlag<HardEvent::MTE3_V>(EVENT_ID0);
            continue;
        }
        int64_t s0 = first * a.state.strides[0] + h * a.state.strides[1];
        DataCopyPad(S, st[s0], DataCopyExtParams{static_cast<uint16_t>(V), row_bytes, gm_gap, 0, 0}, no_pad);
        SetFlag<HardEvent::MTE2_V>(EVENT_ID1);
        WaitFlag<HardEvent::MTE2_V>(EVENT_ID1);
        for (int64_t t = 0; t < T_; ++t) {
            int64_t qo = b * a.q.strides[0] + t * a.q.strides[1] + h * a.q.strides[2];
            int64_t ko = b * a.k.strides[0] + t * a.k.strides[1] + h * a.k.strides[2];
            int64_t vo = b * a.v.strides[0] + t * a.v.strides[1] + h * a.v.strides[2];
            int64_t go = b * a.g.strides[0] + t * a.g.strides[1] + h * a.g.strides[2];
            kda_load_f32<T>(qf, stage, q, qo, K);
            kda_load_f32<T>(kf, stage, k, ko, K);
            kda_load_f32<T>(vf, stage, v, vo, V);
            kda_load_f32<float>(gf, gf, g, go, K);
            if (l2) {
                kda_l2norm(qf, tmp, red, work, K);
                kda_l2norm(kf, tmp, red, work, K);
            }
            Muls(qf, qf, scale, K);
            Exp(gf, gf, K);
            PipeBarrier<PIPE_V>();
            float bt = kda_read(beta, b * a.beta.strides[0] + t * a.beta.strides[1] + h * a.beta.strides[2]);
            for (int64_t r = 0; r < V; ++r) {
                LocalTensor<float> row = S[r * Kp];
                Mul(row, row, gf, K);
                PipeBarrier<PIPE_V>();
                float dot = kda_dot(row, kf, tmp, red, work, K);
                float u = bt * (vf.GetValue(r) - dot);
                SetFlag<HardEvent::S_V>(EVENT_ID0);
                WaitFlag<HardEvent::S_V>(EVENT_ID0);
                Axpy(row, kf, u, K);
                PipeBarrier<PIPE_V>();
                float out = kda_dot(row, qf, tmp, red, work, K);
                of.SetValue(r, out);
            }
            SetFlag<HardEvent::S_V>(EVENT_ID0);
            WaitFlag<HardEvent::S_V>(EVENT_ID0);
            int64_t oo = b * a.o.strides[0] + t * a.o.strides[1] + h * a.o.strides[2];
            if constexpr (IsSameType<T, float>::value) {
                SetFlag<HardEvent::V_MTE3>(EVENT_ID0);
                WaitFlag<HardEvent::V_MTE3>(EVENT_ID0);
                DataCopyPad(o[oo], of, DataCopyExtParams{1, static_cast<uint32_t>(V * sizeof(T)), 0, 0, 0});
            } else {
                Cast(ot, of, RoundMode::CAST_RINT, V);
                SetFlag<HardEvent::V_MTE3>(EVENT_ID0);
                WaitFlag<HardEvent::V_MTE3>(EVENT_ID0);
                DataCopyPad(o[oo], ot, DataCopyExtParams{1, static_cast<uint32_t>(V * sizeof(T)), 0, 0, 0});
            }
            // The state after token t, where the request keeps it.
            int32_t keep = kda_read(slots, slot_at + t * a.state_slots.strides[1]);
            if (keep >= 0) {
                int64_t d0 = keep * a.state.strides[0] + h * a.state.strides[1];
                DataCopyPad(st[d0], S, DataCopyExtParams{static_cast<uint16_t>(V), row_bytes, 0, gm_gap, 0});
            }
            // The next token modifies S, of and ot only after these stores have read them.
            SetFlag<HardEvent::MTE3_V>(EVENT_ID0);
            WaitFlag<HardEvent::MTE3_V>(EVENT_ID0);
        }
        // The next unit loads into S, which the last store read.
        SetFlag<HardEvent::MTE3_MTE2>(EVENT_ID0);
        WaitFlag<HardEvent::MTE3_MTE2>(EVENT_ID0);
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
