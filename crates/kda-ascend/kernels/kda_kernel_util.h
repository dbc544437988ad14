// Helpers the kda kernel bodies share, written to the AI Core rules of the AscendC programming
// guide (DataCopyPad, SetFlag/WaitFlag/PipeBarrier, GlobalTensor::GetValue,
// DataCacheCleanAndInvalid):
// - GM <-> UB moves are DataCopyPad, whose length is in bytes: a row whose byte length is not a
//   multiple of 32 is moved whole (DataCopy would drop the tail);
// - every hand-over between pipes waits on a flag (MTE2 -> V after a load, V -> MTE3 before a
//   store, MTE3 -> V / MTE3 -> MTE2 before a stored buffer is written again, V -> S before the
//   scalar unit reads a vector result, S -> V after it writes one); the bodies do not rely on
//   --cce-auto-sync;
// - the scalar unit reads GM that other tasks wrote only after invalidating its cache line, and
//   never writes GM (outputs go through MTE3, so no two cores dirty one 64-byte line);
// - no double arithmetic: the meta region's f64 scalars are converted bit by bit, and exp/sqrt
//   are vector instructions on a one-block tensor.
#ifndef KDA_KERNEL_UTIL_H
#define KDA_KERNEL_UTIL_H

#include "kda_kernel_abi.h"

// The f32 with bits `bits`: through a union, not a pointer cast, which breaks C++'s aliasing
// rule and lets an optimising compiler drop the store.
__aicore__ inline float kda_f32_from_bits(uint32_t bits)
{
    union {
        uint32_t u;
        float f;
    } v;
    v.u = bits;
    return v.f;
}

// The f32 nearest to the f64 with bits `x` (round to nearest even; results below the f32 normal
// range flush to zero), with integer operations only.
__aicore__ inline float kda_f64_bits_to_f32(uint64_t x)
{
    uint32_t sign = static_cast<uint32_t>(x >> 63) << 31;
    int32_t e = static_cast<int32_t>((x >> 52) & 0x7ff);
    uint64_t m = x & ((1ULL << 52) - 1);
    uint32_t bits;
    if (e == 0x7ff) {
        bits = sign | 0x7f800000u | (m != 0 ? 0x400000u : 0u);
    } else {
        int32_t e32 = e - 1023 + 127;
        uint32_t m32 = static_cast<uint32_t>(m >> 29);
        uint64_t rem = m & ((1ULL << 29) - 1);
        const uint64_t half = 1ULL << 28;
        if (rem > half || (rem == half && (m32 & 1u) != 0)) {
            ++m32;
            if (m32 == (1u << 23)) {
                m32 = 0;
                ++e32;
            }
        }
        if (e == 0 || e32 <= 0) {
            bits = sign;
        } else if (e32 >= 0xff) {
            bits = sign | 0x7f800000u;
        } else {
            bits = sign | (static_cast<uint32_t>(e32) << 23) | m32;
        }
    }
    return kda_f32_from_bits(bits);
}

// Whether the f64 with bits `x` is nonzero (either sign).
__aicore__ inline bool kda_f64_bits_nonzero(uint64_t x)
{
    return (x << 1) != 0;
}

// Elements that fill whole 32-byte blocks: the UB pitch of `n` values of `bytes` each.
__aicore__ inline int64_t kda_pitch(int64_t n, int64_t bytes)
{
    int64_t per = 32 / bytes;
    return (n + per - 1) / per * per;
}

// The scalar unit reads GM that earlier tasks wrote: drop its cached line first.
template <typename T>
__aicore__ inline T kda_read(AscendC::GlobalTensor<T> &g, int64_t at)
{
    AscendC::DataCacheCleanAndInvalid<T, AscendC::CacheLine::SINGLE_CACHE_LINE,
                                      AscendC::DcciDst::CACHELINE_OUT>(g[at]);
    return g.GetValue(at);
}

// `n` values of GM at `at` into `dst` as f32 (through `stage` for 16-bit types); on return
// the vector unit may read `dst` and `stage` may be loaded again.
template <typename T>
__aicore__ inline void kda_load_f32(const AscendC::LocalTensor<float> &dst,
                                    const AscendC::LocalTensor<T> &stage,
                                    AscendC::GlobalTensor<T> &src, int64_t at, int64_t n)
{
    using namespace AscendC;
    DataCopyExtParams p{1, static_cast<uint32_t>(n * sizeof(T)), 0, 0, 0};
    DataCopyPadExtParams<T> pad{false, 0, 0, 0};
    if constexpr (IsSameType<T, float>::value) {
        DataCopyPad(dst, src[at], p, pad);
        SetFlag<HardEvent::MTE2_V>(EVENT_ID0);
        WaitFlag<HardEvent::MTE2_V>(EVENT_ID0);
    } else {
        DataCopyPad(stage, src[at], p, pad);
        SetFlag<HardEvent::MTE2_V>(EVENT_ID0);
        WaitFlag<HardEvent::MTE2_V>(EVENT_ID0);
        Cast(dst, stage, RoundMode::CAST_NONE, n);
        PipeBarrier<PIPE_V>();
        SetFlag<HardEvent::V_MTE2>(EVENT_ID0);
        WaitFlag<HardEvent::V_MTE2>(EVENT_ID0);
    }
}

// `n` f32 values of `src` to GM at `at` as T (rounded to nearest even, through `stage` for
// 16-bit types); on return `src` and `stage` may be written again.
template <typename T>
__aicore__ inline void kda_store_f32(AscendC::GlobalTensor<T> &dst, int64_t at,
                                     const AscendC::LocalTensor<T> &stage,
                                     const AscendC::LocalTensor<float> &src, int64_t n)
{
    using namespace AscendC;
    DataCopyExtParams p{1, static_cast<uint32_t>(n * sizeof(T)), 0, 0, 0};
    if constexpr (IsSameType<T, float>::value) {
        SetFlag<HardEvent::V_MTE3>(EVENT_ID0);
        WaitFlag<HardEvent::V_MTE3>(EVENT_ID0);
        DataCopyPad(dst[at], src, p);
    } else {
        Cast(stage, src, RoundMode::CAST_RINT, n);
        SetFlag<HardEvent::V_MTE3>(EVENT_ID0);
        WaitFlag<HardEvent::V_MTE3>(EVENT_ID0);
        DataCopyPad(dst[at], stage, p);
    }
    SetFlag<HardEvent::MTE3_V>(EVENT_ID0);
    WaitFlag<HardEvent::MTE3_V>(EVENT_ID0);
    SetFlag<HardEvent::MTE3_MTE2>(EVENT_ID0);
    WaitFlag<HardEvent::MTE3_MTE2>(EVENT_ID0);
}

// One scalar through a vector instruction on the one-block tensor `one` (the AI Core has no
// scalar exp or sqrt to rely on): the scalar unit writes it, the vector unit transforms it, the
// scalar unit reads the result.
__aicore__ inline void kda_to_vector(const AscendC::LocalTensor<float> &one, float x)
{
    using namespace AscendC;
    one.SetValue(0, x);
    SetFlag<HardEvent::S_V>(EVENT_ID0);
    WaitFlag<HardEvent::S_V>(EVENT_ID0);
}

__aicore__ inline float kda_from_vector(const AscendC::LocalTensor<float> &one)
{
    using namespace AscendC;
    SetFlag<HardEvent::V_S>(EVENT_ID0);
    WaitFlag<HardEvent::V_S>(EVENT_ID0);
    return one.GetValue(0);
}

// sqrt(x) on the vector unit.
__aicore__ inline float kda_vector_sqrt(const AscendC::LocalTensor<float> &one, float x)
{
    kda_to_vector(one, x);
    AscendC::Sqrt(one, one, 1);
    return kda_from_vector(one);
}

// exp(x) on the vector unit.
__aicore__ inline float kda_vector_exp(const AscendC::LocalTensor<float> &one, float x)
{
    kda_to_vector(one, x);
    AscendC::Exp(one, one, 1);
    return kda_from_vector(one);
}

#endif
