// kda's AscendC twin: the subset of the AscendC API the kda kernels use, for the host compiler,
// with the device's rules checked on every call. The kernel sources include this header under
// the name bisheng gives CANN's own (kernel_operator.h) and compile unchanged, as they do in
// AscendC's CPU debug mode (asc-devkit cmake/asc/legacy_modules/function.cmake,
// -DASCENDC_CPU_DEBUG): the qualifiers are empty, a kernel is a host function, GM is host memory.
//
// Rules and their sources (paths under mirror-cann/asc-devkit/docs/zh/api/SIMD-API/):
// - UB operand addresses 32-byte aligned (通用说明和约束.md, 通用地址对齐约束: "Unified Buffer:
//   32Byte对齐");
// - a vector instruction's source and destination overlap completely or not at all
//   (通用说明和约束.md, 通用地址重叠约束);
// - count-mode vector instructions: count within every operand's tensor; 0 is a NOP on A2/A3
//   (e.g. 基础API/Memory矢量计算/归约计算/ReduceSum.md, 约束说明);
// - DataCopyPad: GM side in bytes, UB side in 32-byte blocks, each block padded to 32 bytes with
//   dummy data, blockCount <= 4095, blockLen <= 2097151 and a multiple of sizeof(T), UB address
//   32-byte aligned, 950 stride limits (基础API/Memory矢量计算/数据搬运/GM与UB数据搬运/
//   GMToUB非对齐数据搬运(DataCopyPad).md, UBToGM非对齐数据搬运(DataCopyPad).md);
// - DataCopy moves whole 32-byte blocks: count * sizeof(T) is a multiple of 32, else the length is
//   silently rounded down (基础API/Memory矢量计算/数据搬运/GM与UB数据搬运/GM与UB连续数据搬运(DataCopy).md);
//   the twin rejects it: a tail needs DataCopyPad;
// - TQue: AllocTensor/FreeTensor in pairs, no double free, DeQue of an empty queue is an error,
//   EnQue past the queue's depth fails, at most 8 tensors allocated per position
//   (基础API/资源管理/Pipe和Que框架/TQue/AllocTensor.md, DeQue.md, EnQue.md, FreeTensor.md);
// - TBuf::Get(len): len * sizeof(T) within the buffer (TBuf/Get.md);
// - SetFlag/WaitFlag paired with identical event and eventID, eventID 0-7
//   (基础API/同步控制/核内同步/SetFlag-WaitFlag(ISASI).md); PipeBarrier orders one pipe's
//   dependent instructions and does not take PIPE_S (PipeBarrier(ISASI).md);
// - the scalar unit reads GM through a cache it must invalidate (缓存控制/DataCacheCleanAndInvalid.md);
// - Cast: only the dtype pairs and round modes its table lists for the SoC
//   (基础API/Memory矢量计算/类型转换/Cast.md, 数据类型);
// - Gather (count form): the SoC's types, operand alignment, no dst/src sharing, offsets and
//   base element-aligned and inside src, the 950's offset ranges, A2/A3's 255 repeats per call,
//   count 0 not a NOP on the 950 (基础API/Memory矢量计算/离散与聚合/Gather.md; the rules at Gather).
// The pipe model behind the synchronisation rules is kda_twin_rt.h's.
#ifndef KDA_TWIN_KERNEL_OPERATOR_H
#define KDA_TWIN_KERNEL_OPERATOR_H

#include <cmath>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <deque>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "kda_twin_rt.h"

// Device qualifiers: nothing on the host (as in CPU debug mode). A kernel entry stays visible
// when the twin is built as a shared library with hidden visibility.
#define __aicore__
#define __gm__
#define __global__ __attribute__((visibility("default")))
#define GM_ADDR uint8_t *

#define KERNEL_TYPE_AIV_ONLY 1
#define KERNEL_TYPE_AIC_ONLY 2
#define KERNEL_TYPE_MIX_AIC_1_2 3
#define KERNEL_TASK_TYPE_DEFAULT(type) ((void)(type))

// ---- 16-bit float types (IEEE binary16; bfloat16: the top half of an f32) ----

namespace kda_twin {
inline uint32_t f32_bits(float f)
{
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
}
inline float f32_from(uint32_t u)
{
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
// f32 -> bf16, round to nearest even (NaN stays NaN).
inline uint16_t bf16_rne(float f)
{
    const uint32_t x = f32_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
    return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}
// f32 -> f16, round to nearest even, overflow to infinity, subnormals kept.
inline uint16_t f16_rne(float f)
{
    const uint32_t x = f32_bits(f);
    const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
    const uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) return sign | (ax > 0x7f800000u ? 0x7e00u : 0x7c00u);
    if (ax >= 0x477ff000u) return sign | 0x7c00u;  // rounds to 65536 or more
    if (ax < 0x38800000u) {                        // below 2^-14: a subnormal half
        const float scaled = std::fabs(f) * 16777216.0f;  // units of 2^-24, exact
        return sign | static_cast<uint16_t>(std::nearbyint(scaled));
    }
    uint32_t h = ((((ax >> 23) - 127u + 15u) << 10) | ((ax & 0x7fffffu) >> 13));
    const uint32_t rem = ax & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
    return static_cast<uint16_t>(sign | h);
}
inline float f16_to_f32(uint16_t h)
{
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    const uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0) {
        const float v = static_cast<float>(m) * 5.9604644775390625e-08f;  // m * 2^-24
        return sign ? -v : v;
    }
    if (e == 31) return f32_from(sign | 0x7f800000u | (m << 13));
    return f32_from(sign | ((e - 15u + 127u) << 23) | (m << 13));
}
}  // namespace kda_twin

struct half {
    uint16_t bits = 0;
    half() = default;
    template <typename A, typename = std::enable_if_t<std::is_arithmetic<A>::value>>
    half(A v) : bits(kda_twin::f16_rne(static_cast<float>(v)))
    {
    }
    operator float() const { return kda_twin::f16_to_f32(bits); }
};

struct bfloat16_t {
    uint16_t bits = 0;
    bfloat16_t() = default;
    template <typename A, typename = std::enable_if_t<std::is_arithmetic<A>::value>>
    bfloat16_t(A v) : bits(kda_twin::bf16_rne(static_cast<float>(v)))
    {
    }
    operator float() const { return kda_twin::f32_from(static_cast<uint32_t>(bits) << 16); }
};

static_assert(sizeof(half) == 2 && sizeof(bfloat16_t) == 2, "16-bit types");

// Event ids and pipes: globals in CANN (the device compiler's builtins).
enum event_t { EVENT_ID0 = 0, EVENT_ID1, EVENT_ID2, EVENT_ID3, EVENT_ID4, EVENT_ID5, EVENT_ID6, EVENT_ID7 };
enum pipe_t { PIPE_S = 0, PIPE_V, PIPE_M, PIPE_MTE1, PIPE_MTE2, PIPE_MTE3, PIPE_ALL, PIPE_FIX };

namespace AscendC {

template <typename A, typename B>
struct IsSameType {
    static constexpr bool value = false;
};
template <typename A>
struct IsSameType<A, A> {
    static constexpr bool value = true;
};

enum class TPosition : uint8_t { GM, VECIN, VECOUT, VECCALC, A1, A2, B1, B2, C1, C2, CO1, CO2 };
using QuePosition = TPosition;

enum class RoundMode : uint8_t { CAST_NONE = 0, CAST_RINT, CAST_FLOOR, CAST_CEIL, CAST_ROUND, CAST_TRUNC, CAST_ODD };

enum class CacheLine : uint8_t { SINGLE_CACHE_LINE = 0, ENTIRE_DATA_CACHE };
enum class DcciDst : uint8_t { CACHELINE_ALL = 0, CACHELINE_UB, CACHELINE_OUT, CACHELINE_ATOMIC };

enum class HardEvent : uint8_t {
    MTE2_V,
    V_MTE2,
    V_MTE3,
    MTE3_V,
    MTE3_MTE2,
    MTE2_MTE3,
    V_S,
    S_V,
    MTE2_S,
    S_MTE2,
    MTE3_S,
    S_MTE3,
    V_V,
};

namespace detail {
constexpr kda_twin::Pipe src_of(HardEvent e)
{
    switch (e) {
        case HardEvent::MTE2_V:
        case HardEvent::MTE2_MTE3:
        case HardEvent::MTE2_S: return kda_twin::P_MTE2;
        case HardEvent::V_MTE2:
        case HardEvent::V_MTE3:
        case HardEvent::V_S:
        case HardEvent::V_V: return kda_twin::P_V;
        case HardEvent::MTE3_V:
        case HardEvent::MTE3_MTE2:
        case HardEvent::MTE3_S: return kda_twin::P_MTE3;
        default: return kda_twin::P_S;
    }
}
constexpr kda_twin::Pipe dst_of(HardEvent e)
{
    switch (e) {
        case HardEvent::MTE2_V:
        case HardEvent::MTE3_V:
        case HardEvent::S_V:
        case HardEvent::V_V: return kda_twin::P_V;
        case HardEvent::V_MTE2:
        case HardEvent::MTE3_MTE2:
        case HardEvent::S_MTE2: return kda_twin::P_MTE2;
        case HardEvent::V_MTE3:
        case HardEvent::MTE2_MTE3:
        case HardEvent::S_MTE3: return kda_twin::P_MTE3;
        default: return kda_twin::P_S;
    }
}
template <typename T>
struct Id {
    using type = T;
};
}  // namespace detail

// ---- Block index and count ----

inline int64_t GetBlockIdx() { return kda_twin::cur().idx; }
inline int64_t GetBlockNum() { return kda_twin::cur().block_num; }

// ---- Synchronisation ----

template <HardEvent E>
inline void SetFlag(int32_t id)
{
    kda_twin::set_flag("SetFlag", detail::src_of(E), detail::dst_of(E), id);
}

template <HardEvent E>
inline void WaitFlag(int32_t id)
{
    kda_twin::wait_flag("WaitFlag", detail::src_of(E), detail::dst_of(E), id);
}

template <pipe_t P>
inline void PipeBarrier()
{
    switch (P) {
        case PIPE_V: kda_twin::barrier(kda_twin::P_V); return;
        case PIPE_MTE2: kda_twin::barrier(kda_twin::P_MTE2); return;
        case PIPE_MTE3: kda_twin::barrier(kda_twin::P_MTE3); return;
        case PIPE_ALL: kda_twin::barrier_all(); return;
        case PIPE_S:
            kda_twin::violate("PipeBarrier", "PipeBarrier does not take PIPE_S (PipeBarrier(ISASI).md)", "PIPE_S");
        default:
            kda_twin::violate("PipeBarrier", "a pipe the twin does not model (the kernel is vector-only)",
                              std::to_string(static_cast<int>(P)));
    }
}

// ---- Exceptions ----

// ascendc_assert (基础API/调试接口/异常检测/ascendc_assert.md, A2/A3/950): a false condition
// prints the message and stops the AI Core (Trap.md), which the runtime reports as an AI Core
// exception of the kernel. The twin reports it as a violation carrying the message.
inline void Trap() { kda_twin::violate("Trap", "the kernel stopped the AI Core (Trap)", ""); }

}  // namespace AscendC

namespace kda_twin {
inline void assert_at(bool ok, const char *expr, const char *file, int line)
{
    if (!ok) violate("ascendc_assert", "ascendc_assert failed: the kernel stopped the AI Core",
                     std::string(file) + ":" + std::to_string(line) + ": `" + expr + "`");
}
template <typename... A>
inline void assert_at(bool ok, const char *expr, const char *file, int line, const char *fmt, A... args)
{
    if (ok) return;
    char text[512];
    std::snprintf(text, sizeof text, fmt, args...);
    violate("ascendc_assert", "ascendc_assert failed: the kernel stopped the AI Core",
            std::string(file) + ":" + std::to_string(line) + ": `" + expr + "` " + text);
}
}  // namespace kda_twin

#define ascendc_assert(expr, ...) \
    ::kda_twin::assert_at(static_cast<bool>(expr), #expr, __FILE__, __LINE__, ##__VA_ARGS__)

namespace AscendC {

// ---- Tensors ----

template <typename T>
class LocalTensor {
public:
    LocalTensor() = default;
    LocalTensor(uint32_t addr, uint32_t elems, uint32_t lo, uint32_t hi, TPosition pos)
        : addr_(addr), size_(elems), lo_(lo), hi_(hi), pos_(pos)
    {
    }

    LocalTensor operator[](uint64_t offset) const
    {
        if (offset > size_) {
            kda_twin::violate("LocalTensor::operator[]", "offset past the tensor's buffer (TBuf/TQue bounds)",
                              "offset " + std::to_string(offset) + " of a tensor of " + std::to_string(size_) +
                                  " elements");
        }
        return LocalTensor(addr_ + static_cast<uint32_t>(offset * sizeof(T)), size_ - static_cast<uint32_t>(offset),
                           lo_, hi_, pos_);
    }

    template <typename U>
    LocalTensor<U> ReinterpretCast() const
    {
        return LocalTensor<U>(addr_, static_cast<uint32_t>(static_cast<uint64_t>(size_) * sizeof(T) / sizeof(U)), lo_,
                              hi_, pos_);
    }

    T GetValue(uint64_t i) const
    {
        check_elem("LocalTensor::GetValue", i);
        kda_twin::issue(kda_twin::P_S);
        kda_twin::ub_read("LocalTensor::GetValue", kda_twin::P_S, byte(i), sizeof(T));
        T v;
        std::memcpy(&v, kda_twin::cur().ub.data() + byte(i), sizeof(T));
        return v;
    }

    void SetValue(uint64_t i, T v) const
    {
        check_elem("LocalTensor::SetValue", i);
        const uint32_t seq = kda_twin::issue(kda_twin::P_S);
        kda_twin::ub_write("LocalTensor::SetValue", kda_twin::P_S, seq, byte(i), sizeof(T), true);
        std::memcpy(kda_twin::cur().ub.data() + byte(i), &v, sizeof(T));
    }

    uint32_t GetSize() const { return size_; }

    // The twin's view (not AscendC API): UB byte offset, element count, buffer bounds.
    uint32_t twin_addr() const { return addr_; }
    uint32_t twin_size() const { return size_; }
    uint32_t twin_hi() const { return hi_; }
    TPosition twin_pos() const { return pos_; }

private:
    uint32_t byte(uint64_t i) const { return addr_ + static_cast<uint32_t>(i * sizeof(T)); }
    void check_elem(const char *api, uint64_t i) const
    {
        if (i >= size_ || byte(i) + sizeof(T) > hi_) {
            kda_twin::violate(api, "element past the tensor's buffer (TBuf/TQue bounds)",
                              "element " + std::to_string(i) + " of a tensor of " + std::to_string(size_));
        }
    }

    uint32_t addr_ = 0, size_ = 0, lo_ = 0, hi_ = 0;
    TPosition pos_ = TPosition::VECCALC;
};

template <typename T>
class GlobalTensor {
public:
    GlobalTensor() = default;
    void SetGlobalBuffer(__gm__ T *buffer, uint64_t size = 0)
    {
        addr_ = buffer;
        size_ = size;
    }
    GlobalTensor operator[](uint64_t offset) const
    {
        GlobalTensor g;
        g.addr_ = addr_ + offset;
        g.size_ = size_ > offset ? size_ - offset : 0;
        return g;
    }
    T GetValue(uint64_t i) const
    {
        kda_twin::issue(kda_twin::P_S);
        kda_twin::gm_scalar_read("GlobalTensor::GetValue", addr_ + i, sizeof(T));
        T v;
        std::memcpy(&v, addr_ + i, sizeof(T));
        return v;
    }
    void SetValue(uint64_t i, T v) const
    {
        kda_twin::issue(kda_twin::P_S);
        kda_twin::gm_check("GlobalTensor::SetValue", addr_ + i, sizeof(T));
        kda_twin::gm_wrote("GlobalTensor::SetValue", addr_ + i, sizeof(T));
        std::memcpy(addr_ + i, &v, sizeof(T));
    }
    __gm__ T *GetPhyAddr() const { return addr_; }

private:
    T *addr_ = nullptr;
    uint64_t size_ = 0;
};

template <typename T, CacheLine L, DcciDst D>
inline void DataCacheCleanAndInvalid(const GlobalTensor<T> &g)
{
    static_assert(L == CacheLine::SINGLE_CACHE_LINE, "the twin models single-line invalidation");
    kda_twin::dcci(g.GetPhyAddr());
}

// ---- Pipe, queues, buffers ----

class TPipe;

template <TPosition POS = TPosition::VECCALC>
class TBuf {
public:
    template <typename T>
    LocalTensor<T> Get() const
    {
        need("TBuf::Get");
        return LocalTensor<T>(addr_, len_ / static_cast<uint32_t>(sizeof(T)), addr_, addr_ + len_, POS);
    }
    template <typename T>
    LocalTensor<T> Get(uint32_t len) const
    {
        need("TBuf::Get");
        if (static_cast<uint64_t>(len) * sizeof(T) > len_) {
            kda_twin::violate("TBuf::Get", "len * sizeof(T) exceeds the TBuf's length (TBuf/Get.md)",
                              std::to_string(len) + " elements of " + std::to_string(sizeof(T)) + " bytes, TBuf of " +
                                  std::to_string(len_) + " bytes");
        }
        return LocalTensor<T>(addr_, len, addr_, addr_ + len_, POS);
    }

private:
    friend class TPipe;
    void need(const char *api) const
    {
        if (!init_) kda_twin::violate(api, "TBuf used before TPipe::InitBuffer", "");
    }
    uint32_t addr_ = 0, len_ = 0;
    bool init_ = false;
};

template <TPosition POS, int32_t DEPTH>
class TQue {
public:
    TQue() = default;
    TQue(const TQue &) = delete;
    TQue &operator=(const TQue &) = delete;
    ~TQue()
    {
        for (const auto &b : bufs_) {
            if (b.state != kda_twin::B_FREE) {
                kda_twin::defer("TQue", "AllocTensor without FreeTensor by the kernel's end (AllocTensor.md: paired)",
                                "a buffer at UB offset " + std::to_string(b.addr) + " is still in use");
                return;
            }
        }
    }

    template <typename T>
    LocalTensor<T> AllocTensor()
    {
        const char *api = "TQue::AllocTensor";
        if (bufs_.empty()) kda_twin::violate(api, "TQue used before TPipe::InitBuffer", "");
        // AllocTensor.md: at most 8 tensors allocated in a row on one position.
        if (outstanding() >= 8) {
            kda_twin::violate(api, "more than 8 tensors allocated from one queue position (AllocTensor.md)", "");
        }
        for (size_t k = 0; k < bufs_.size(); ++k) {
            auto &b = bufs_[(next_ + k) % bufs_.size()];
            if (b.state == kda_twin::B_FREE) {
                next_ = (next_ + k + 1) % bufs_.size();
                b.state = kda_twin::B_ALLOC;
                // The framework's wait: the producer may write once the last consumer is done.
                kda_twin::learn(producer(), b.clock);
                return LocalTensor<T>(b.addr, len_ / static_cast<uint32_t>(sizeof(T)), b.addr, b.addr + len_, POS);
            }
        }
        kda_twin::violate(api, "AllocTensor with every buffer of the queue in use (a FreeTensor is missing)",
                          std::to_string(bufs_.size()) + " buffers");
    }

    template <typename T>
    bool EnQue(const LocalTensor<T> &t)
    {
        const char *api = "TQue::EnQue";
        auto &b = find(api, t.twin_addr());
        if (b.state != kda_twin::B_ALLOC) {
            kda_twin::violate(api, "EnQue of a tensor that is not freshly allocated from this queue",
                              "UB offset " + std::to_string(b.addr));
        }
        if (static_cast<int32_t>(queued_.size()) >= DEPTH) {
            // EnQue.md: false when the queue is full; the tensor is then never dequeued.
            kda_twin::violate(api, "EnQue on a full queue (its depth)", "depth " + std::to_string(DEPTH));
        }
        kda_twin::snapshot(producer(), b.clock);
        b.state = kda_twin::B_QUEUED;
        queued_.push_back(&b - bufs_.data());
        return true;
    }

    template <typename T>
    LocalTensor<T> DeQue()
    {
        const char *api = "TQue::DeQue";
        if (queued_.empty()) kda_twin::violate(api, "DeQue of an empty queue (DeQue.md)", "");
        auto &b = bufs_[queued_.front()];
        queued_.pop_front();
        b.state = kda_twin::B_DEQUEUED;
        kda_twin::learn(consumer(), b.clock);
        return LocalTensor<T>(b.addr, len_ / static_cast<uint32_t>(sizeof(T)), b.addr, b.addr + len_, POS);
    }

    template <typename T>
    void FreeTensor(const LocalTensor<T> &t)
    {
        const char *api = "TQue::FreeTensor";
        auto &b = find(api, t.twin_addr());
        if (b.state == kda_twin::B_FREE) {
            kda_twin::violate(api, "FreeTensor of a tensor already freed (double free)",
                              "UB offset " + std::to_string(b.addr));
        }
        if (b.state == kda_twin::B_QUEUED) {
            kda_twin::violate(api, "FreeTensor of a tensor still in the queue", "UB offset " + std::to_string(b.addr));
        }
        kda_twin::snapshot(consumer(), b.clock);
        b.state = kda_twin::B_FREE;
    }

private:
    friend class TPipe;
    static constexpr kda_twin::Pipe producer()
    {
        return POS == TPosition::VECIN ? kda_twin::P_MTE2 : kda_twin::P_V;
    }
    static constexpr kda_twin::Pipe consumer()
    {
        return POS == TPosition::VECOUT ? kda_twin::P_MTE3 : kda_twin::P_V;
    }
    size_t outstanding() const
    {
        size_t n = 0;
        for (const auto &b : bufs_) n += b.state != kda_twin::B_FREE;
        return n;
    }
    kda_twin::QueBuf &find(const char *api, uint32_t addr)
    {
        for (auto &b : bufs_) {
            if (b.addr == addr) return b;
        }
        kda_twin::violate(api, "a tensor this queue did not allocate", "UB offset " + std::to_string(addr));
    }
    std::vector<kda_twin::QueBuf> bufs_;
    std::deque<size_t> queued_;
    uint32_t len_ = 0;
    size_t next_ = 0;
};

class TPipe {
public:
    TPipe() { ++kda_twin::cur().pipes_alive; }
    ~TPipe()
    {
        // The buffers are released with the pipe (InitBuffer.md).
        kda_twin::Block &b = kda_twin::cur();
        if (--b.pipes_alive == 0) {
            b.ub_top = 0;
            b.buffers = 0;
        }
    }
    TPipe(const TPipe &) = delete;
    TPipe &operator=(const TPipe &) = delete;

    template <TPosition POS, int32_t DEPTH>
    bool InitBuffer(TQue<POS, DEPTH> &que, uint8_t num, uint32_t len)
    {
        if (!que.bufs_.empty()) kda_twin::violate("TPipe::InitBuffer", "a queue initialised twice", "");
        const uint32_t rounded = (len + kda_twin::kBlock - 1) / kda_twin::kBlock * kda_twin::kBlock;
        for (uint8_t i = 0; i < num; ++i) {
            kda_twin::QueBuf b{};
            b.addr = kda_twin::ub_alloc("TPipe::InitBuffer", len);
            b.state = kda_twin::B_FREE;
            que.bufs_.push_back(b);
        }
        que.len_ = rounded;
        return true;
    }

    template <TPosition POS>
    bool InitBuffer(TBuf<POS> &buf, uint32_t len)
    {
        if (buf.init_) kda_twin::violate("TPipe::InitBuffer", "a TBuf initialised twice", "");
        buf.addr_ = kda_twin::ub_alloc("TPipe::InitBuffer", len);
        buf.len_ = (len + kda_twin::kBlock - 1) / kda_twin::kBlock * kda_twin::kBlock;
        buf.init_ = true;
        return true;
    }
};

// ---- Data movement ----

struct DataCopyExtParams {
    uint16_t blockCount = 1;
    uint32_t blockLen = 0;
    uint32_t srcStride = 0;
    uint32_t dstStride = 0;
    uint32_t rsv = 0;
};

template <typename T>
struct DataCopyPadExtParams {
    bool isPad = false;
    uint8_t leftPadding = 0;
    uint8_t rightPadding = 0;
    T paddingValue{};
};

namespace detail {
inline void check_ub_addr(const char *api, uint32_t addr, const char *what)
{
    if (addr % kda_twin::kBlock != 0) {
        kda_twin::violate(api, "UB address not 32-byte aligned (通用说明和约束.md, 通用地址对齐约束)",
                          std::string(what) + " at UB offset " + std::to_string(addr));
    }
}

inline void check_copy_params(const char *api, const DataCopyExtParams &p, size_t elem)
{
    if (p.blockCount > 4095) {
        kda_twin::violate(api, "DataCopyExtParams.blockCount outside [0, 4095]", std::to_string(p.blockCount));
    }
    if (p.blockLen > 2097151) {
        kda_twin::violate(api, "DataCopyExtParams.blockLen outside [0, 2097151]", std::to_string(p.blockLen));
    }
    if (p.blockLen % elem != 0) {
        kda_twin::violate(api, "DataCopyExtParams.blockLen not a multiple of sizeof(T)",
                          std::to_string(p.blockLen) + " bytes, sizeof(T) " + std::to_string(elem));
    }
}

inline void check_extent(const char *api, uint64_t end, uint32_t hi, const char *what)
{
    if (end > hi) {
        kda_twin::violate(api, "access past the tensor's buffer (TBuf/TQue bounds)",
                          std::string(what) + " ends at UB offset " + std::to_string(end) + ", its buffer at " +
                              std::to_string(hi));
    }
}
}  // namespace detail

// GM -> UB: blocks of blockLen bytes, srcStride bytes apart on GM, each padded to 32 bytes in UB
// with dstStride 32-byte blocks between them.
template <typename T>
inline void DataCopyPad(const LocalTensor<T> &dst, const GlobalTensor<T> &src, const DataCopyExtParams &p,
                        const DataCopyPadExtParams<T> &pad)
{
    const char *api = "DataCopyPad(GM->UB)";
    detail::check_copy_params(api, p, sizeof(T));
    detail::check_ub_addr(api, dst.twin_addr(), "the destination");
    if (kda_twin::cur().arch == kda_twin::ARCH_3510 && p.dstStride > 65535) {
        kda_twin::violate(api, "dstStride outside [0, 65535] on the 950", std::to_string(p.dstStride));
    }
    const uint32_t left = pad.leftPadding * sizeof(T), right = pad.rightPadding * sizeof(T);
    if (left > 32 || right > 32) {
        kda_twin::violate(api, "leftPadding/rightPadding of more than 32 bytes", std::to_string(left) + "/" +
                                                                                     std::to_string(right));
    }
    if (p.blockCount == 0 || p.blockLen == 0) return;  // a NOP on A2/A3/950
    const uint64_t span = (static_cast<uint64_t>(left) + p.blockLen + right + 31) / 32 * 32;
    const uint64_t pitch = span + static_cast<uint64_t>(p.dstStride) * 32;
    const uint64_t end = dst.twin_addr() + pitch * (p.blockCount - 1) + span;
    detail::check_extent(api, end, dst.twin_hi(), "the destination");
    const uint32_t seq = kda_twin::issue(kda_twin::P_MTE2);
    kda_twin::Block &b = kda_twin::cur();
    const uint8_t *g = reinterpret_cast<const uint8_t *>(src.GetPhyAddr());
    for (uint32_t i = 0; i < p.blockCount; ++i) {
        const uint8_t *from = g + static_cast<uint64_t>(i) * (p.blockLen + p.srcStride);
        kda_twin::gm_check(api, from, p.blockLen);
        kda_twin::gm_read(api, from, p.blockLen);
        const uint32_t at = dst.twin_addr() + static_cast<uint32_t>(pitch * i);
        uint8_t *u = b.ub.data() + at;
        // Left padding, data, right padding: the padding value with isPad, otherwise undefined.
        kda_twin::ub_write(api, kda_twin::P_MTE2, seq, at, left, pad.isPad);
        for (uint32_t k = 0; k < left; k += sizeof(T)) std::memcpy(u + k, &pad.paddingValue, sizeof(T));
        kda_twin::ub_write(api, kda_twin::P_MTE2, seq, at + left, p.blockLen, true);
        std::memcpy(u + left, from, p.blockLen);
        kda_twin::ub_write(api, kda_twin::P_MTE2, seq, at + left + p.blockLen, right, pad.isPad);
        for (uint32_t k = 0; k < right; k += sizeof(T)) std::memcpy(u + left + p.blockLen + k, &pad.paddingValue, sizeof(T));
        // The dummy bytes up to 32: the block's first element (GMToUB非对齐数据搬运(DataCopyPad).md),
        // but no value a kernel may rely on.
        const uint32_t used = left + p.blockLen + right;
        kda_twin::ub_write(api, kda_twin::P_MTE2, seq, at + used, static_cast<uint32_t>(span) - used, false);
        for (uint32_t k = used; k + sizeof(T) <= span; k += sizeof(T)) std::memcpy(u + k, from, sizeof(T));
    }
}

// UB -> GM: blocks of blockLen bytes read from 32-byte aligned UB blocks with srcStride 32-byte
// blocks between them, written dstStride bytes apart on GM.
template <typename T>
inline void DataCopyPad(const GlobalTensor<T> &dst, const LocalTensor<T> &src, const DataCopyExtParams &p)
{
    const char *api = "DataCopyPad(UB->GM)";
    detail::check_copy_params(api, p, sizeof(T));
    detail::check_ub_addr(api, src.twin_addr(), "the source");
    if (kda_twin::cur().arch == kda_twin::ARCH_3510 && p.srcStride > 65535) {
        kda_twin::violate(api, "srcStride outside [0, 65535] on the 950", std::to_string(p.srcStride));
    }
    if (p.blockCount == 0 || p.blockLen == 0) return;
    const uint64_t span = (static_cast<uint64_t>(p.blockLen) + 31) / 32 * 32;
    const uint64_t pitch = span + static_cast<uint64_t>(p.srcStride) * 32;
    detail::check_extent(api, src.twin_addr() + pitch * (p.blockCount - 1) + p.blockLen, src.twin_hi(), "the source");
    kda_twin::issue(kda_twin::P_MTE3);
    kda_twin::Block &b = kda_twin::cur();
    uint8_t *g = reinterpret_cast<uint8_t *>(dst.GetPhyAddr());
    for (uint32_t i = 0; i < p.blockCount; ++i) {
        uint8_t *to = g + static_cast<uint64_t>(i) * (p.blockLen + p.dstStride);
        const uint32_t at = src.twin_addr() + static_cast<uint32_t>(pitch * i);
        kda_twin::ub_read(api, kda_twin::P_MTE3, at, p.blockLen);
        kda_twin::gm_check(api, to, p.blockLen);
        std::memcpy(to, b.ub.data() + at, p.blockLen);
        kda_twin::gm_wrote(api, to, p.blockLen);
    }
}

// DataCopy moves whole 32-byte blocks: a length that is not one is the classic tail bug.
template <typename T>
inline void DataCopy(const LocalTensor<T> &dst, const GlobalTensor<T> &src, uint32_t count)
{
    const char *api = "DataCopy(GM->UB)";
    const uint64_t bytes = static_cast<uint64_t>(count) * sizeof(T);
    if (bytes % 32 != 0) {
        kda_twin::violate(api, "DataCopy length not a multiple of 32 bytes (a tail needs DataCopyPad)",
                          std::to_string(bytes) + " bytes");
    }
    detail::check_ub_addr(api, dst.twin_addr(), "the destination");
    detail::check_extent(api, dst.twin_addr() + bytes, dst.twin_hi(), "the destination");
    const uint32_t seq = kda_twin::issue(kda_twin::P_MTE2);
    kda_twin::gm_check(api, src.GetPhyAddr(), bytes);
    kda_twin::gm_read(api, src.GetPhyAddr(), bytes);
    kda_twin::ub_write(api, kda_twin::P_MTE2, seq, dst.twin_addr(), static_cast<uint32_t>(bytes), true);
    std::memcpy(kda_twin::cur().ub.data() + dst.twin_addr(), src.GetPhyAddr(), bytes);
}

template <typename T>
inline void DataCopy(const GlobalTensor<T> &dst, const LocalTensor<T> &src, uint32_t count)
{
    const char *api = "DataCopy(UB->GM)";
    const uint64_t bytes = static_cast<uint64_t>(count) * sizeof(T);
    if (bytes % 32 != 0) {
        kda_twin::violate(api, "DataCopy length not a multiple of 32 bytes (a tail needs DataCopyPad)",
                          std::to_string(bytes) + " bytes");
    }
    detail::check_ub_addr(api, src.twin_addr(), "the source");
    detail::check_extent(api, src.twin_addr() + bytes, src.twin_hi(), "the source");
    kda_twin::issue(kda_twin::P_MTE3);
    kda_twin::ub_read(api, kda_twin::P_MTE3, src.twin_addr(), static_cast<uint32_t>(bytes));
    kda_twin::gm_check(api, dst.GetPhyAddr(), bytes);
    std::memcpy(dst.GetPhyAddr(), kda_twin::cur().ub.data() + src.twin_addr(), bytes);
    kda_twin::gm_wrote(api, dst.GetPhyAddr(), bytes);
}

// ---- Vector instructions (count mode: the first `count` elements) ----

namespace detail {

template <typename T>
inline T *ub_ptr(const LocalTensor<T> &t)
{
    return reinterpret_cast<T *>(kda_twin::cur().ub.data() + t.twin_addr());
}

template <typename T>
inline void operand(const char *api, const LocalTensor<T> &t, int64_t count, const char *what)
{
    check_ub_addr(api, t.twin_addr(), what);
    if (count > static_cast<int64_t>(t.twin_size())) {
        kda_twin::violate(api, "count past the operand's tensor (count <= the tensor's elements)",
                          std::string(what) + ": count " + std::to_string(count) + ", tensor of " +
                              std::to_string(t.twin_size()) + " elements");
    }
}

template <typename D, typename S>
inline void no_partial_overlap(const char *api, const LocalTensor<D> &d, const LocalTensor<S> &s, int64_t count)
{
    const uint64_t d0 = d.twin_addr(), d1 = d0 + count * sizeof(D);
    const uint64_t s0 = s.twin_addr(), s1 = s0 + count * sizeof(S);
    const bool overlap = d0 < s1 && s0 < d1;
    if (overlap && !(d0 == s0 && d1 == s1)) {
        kda_twin::violate(api, "source and destination overlap partially (通用说明和约束.md, 通用地址重叠约束)",
                          "dst UB [" + std::to_string(d0) + ", " + std::to_string(d1) + "), src [" +
                              std::to_string(s0) + ", " + std::to_string(s1) + ")");
    }
}

inline bool vector_count(const char *api, int64_t count)
{
    if (count < 0) kda_twin::violate(api, "negative count", std::to_string(count));
    return count > 0;  // 0: a NOP on A2/A3
}

template <typename T>
inline void vread(const char *api, const LocalTensor<T> &t, int64_t count)
{
    kda_twin::ub_read(api, kda_twin::P_V, t.twin_addr(), static_cast<uint32_t>(count * sizeof(T)));
}

template <typename T>
inline void vwrite(const char *api, uint32_t seq, const LocalTensor<T> &t, int64_t count)
{
    kda_twin::ub_write(api, kda_twin::P_V, seq, t.twin_addr(), static_cast<uint32_t>(count * sizeof(T)), true);
}

template <typename T>
inline void float_only(const char *api)
{
    static_assert(std::is_same<T, float>::value || std::is_same<T, half>::value,
                  "this vector instruction takes half or float");
    (void)api;
}

// dst[i] = f(a[i], b[i])
template <typename T, typename F>
inline void binary(const char *api, const LocalTensor<T> &dst, const LocalTensor<T> &a, const LocalTensor<T> &b,
                   int64_t count, F f)
{
    if (!vector_count(api, count)) return;
    operand(api, dst, count, "dst");
    operand(api, a, count, "src0");
    operand(api, b, count, "src1");
    no_partial_overlap(api, dst, a, count);
    no_partial_overlap(api, dst, b, count);
    const uint32_t seq = kda_twin::issue(kda_twin::P_V);
    vread(api, a, count);
    vread(api, b, count);
    vwrite(api, seq, dst, count);
    // Operands overlap completely or not at all: element i depends on element i only.
    const T *x = ub_ptr(a), *y = ub_ptr(b);
    T *out = ub_ptr(dst);
    for (int64_t i = 0; i < count; ++i) out[i] = f(x[i], y[i]);
}

// dst[i] = f(src[i])
template <typename T, typename S, typename F>
inline void unary(const char *api, const LocalTensor<T> &dst, const LocalTensor<S> &src, int64_t count, F f)
{
    if (!vector_count(api, count)) return;
    operand(api, dst, count, "dst");
    operand(api, src, count, "src");
    no_partial_overlap(api, dst, src, count);
    const uint32_t seq = kda_twin::issue(kda_twin::P_V);
    vread(api, src, count);
    vwrite(api, seq, dst, count);
    const S *x = ub_ptr(src);
    T *out = ub_ptr(dst);
    for (int64_t i = 0; i < count; ++i) out[i] = f(x[i]);
}

}  // namespace detail

// Arithmetic is IEEE f32 (half through f32): the hardware's Exp/Ln/Sqrt/Div approximations are
// not modelled (docs/ascend.md, "What the twin does not model").
template <typename T>
inline void Add(const LocalTensor<T> &dst, const LocalTensor<T> &a, const LocalTensor<T> &b, const int32_t &count)
{
    detail::binary("Add", dst, a, b, count, [](T x, T y) { return T(float(x) + float(y)); });
}

template <typename T>
inline void Mul(const LocalTensor<T> &dst, const LocalTensor<T> &a, const LocalTensor<T> &b, const int32_t &count)
{
    detail::binary("Mul", dst, a, b, count, [](T x, T y) { return T(float(x) * float(y)); });
}

template <typename T>
inline void Div(const LocalTensor<T> &dst, const LocalTensor<T> &a, const LocalTensor<T> &b, const int32_t &count)
{
    detail::float_only<T>("Div");
    detail::binary("Div", dst, a, b, count, [](T x, T y) { return T(float(x) / float(y)); });
}

template <typename T>
inline void Adds(const LocalTensor<T> &dst, const LocalTensor<T> &src, const typename detail::Id<T>::type &s,
                 const int32_t &count)
{
    detail::unary("Adds", dst, src, count, [s](T x) { return T(float(x) + float(s)); });
}

template <typename T>
inline void Muls(const LocalTensor<T> &dst, const LocalTensor<T> &src, const typename detail::Id<T>::type &s,
                 const int32_t &count)
{
    detail::unary("Muls", dst, src, count, [s](T x) { return T(float(x) * float(s)); });
}

template <typename T>
inline void Exp(const LocalTensor<T> &dst, const LocalTensor<T> &src, const int32_t &count)
{
    detail::float_only<T>("Exp");
    detail::unary("Exp", dst, src, count, [](T x) { return T(std::exp(float(x))); });
}

template <typename T>
inline void Ln(const LocalTensor<T> &dst, const LocalTensor<T> &src, const int32_t &count)
{
    detail::float_only<T>("Ln");
    detail::unary("Ln", dst, src, count, [](T x) { return T(std::log(float(x))); });
}

template <typename T>
inline void Sqrt(const LocalTensor<T> &dst, const LocalTensor<T> &src, const int32_t &count)
{
    detail::float_only<T>("Sqrt");
    detail::unary("Sqrt", dst, src, count, [](T x) { return T(std::sqrt(float(x))); });
}

// dst[i] = src[i] * s + dst[i] (Axpy.md): the product rounded, then the sum.
template <typename T, typename U>
inline void Axpy(const LocalTensor<T> &dst, const LocalTensor<U> &src, const U &s, const int32_t &count)
{
    const char *api = "Axpy";
    if (!detail::vector_count(api, count)) return;
    detail::operand(api, dst, count, "dst");
    detail::operand(api, src, count, "src");
    detail::no_partial_overlap(api, dst, src, count);
    const uint32_t seq = kda_twin::issue(kda_twin::P_V);
    detail::vread(api, src, count);
    detail::vread(api, dst, count);
    detail::vwrite(api, seq, dst, count);
    T *d = detail::ub_ptr(dst);
    const U *x = detail::ub_ptr(src);
    for (int32_t i = 0; i < count; ++i) {
        const float prod = float(x[i]) * float(s);
        d[i] = T(prod + float(d[i]));
    }
}

template <typename T>
inline void Duplicate(const LocalTensor<T> &dst, const typename detail::Id<T>::type &s, const int32_t &count)
{
    const char *api = "Duplicate";
    if (!detail::vector_count(api, count)) return;
    detail::operand(api, dst, count, "dst");
    const uint32_t seq = kda_twin::issue(kda_twin::P_V);
    detail::vwrite(api, seq, dst, count);
    T *d = detail::ub_ptr(dst);
    for (int32_t i = 0; i < count; ++i) d[i] = s;
}

namespace detail {
// Round `v` to an integral value under `mode` (CAST_RINT: to nearest, ties to even).
inline double round_to(double v, RoundMode m)
{
    switch (m) {
        case RoundMode::CAST_RINT: return std::nearbyint(v);
        case RoundMode::CAST_FLOOR: return std::floor(v);
        case RoundMode::CAST_CEIL: return std::ceil(v);
        case RoundMode::CAST_ROUND: return std::round(v);
        case RoundMode::CAST_TRUNC: return std::trunc(v);
        default: return v;
    }
}

// f32 -> 16-bit float under `mode` (Cast.md: CAST_NONE is CAST_RINT where precision is lost).
template <typename D>
inline D narrow(float v, RoundMode mode)
{
    if (mode == RoundMode::CAST_NONE || mode == RoundMode::CAST_RINT) return D(v);
    // Directed modes: the neighbours of the nearest value, chosen by direction.
    const D nearest(v);
    const float n = float(nearest);
    if (std::isnan(v) || n == v) return nearest;
    D lower = nearest, upper = nearest;
    const uint16_t step = 1;
    if (n > v) {
        lower.bits = static_cast<uint16_t>((n > 0 || (n == 0 && !std::signbit(n))) ? nearest.bits - step : nearest.bits + step);
    } else {
        upper.bits = static_cast<uint16_t>((n > 0 || (n == 0 && !std::signbit(n))) ? nearest.bits + step : nearest.bits - step);
    }
    switch (mode) {
        case RoundMode::CAST_FLOOR: return lower;
        case RoundMode::CAST_CEIL: return upper;
        case RoundMode::CAST_TRUNC: return v > 0 ? lower : upper;
        default: return nearest;
    }
}

// The element types of the per-SoC dtype tables (the twin's tensors take no others).
enum class Ty : uint8_t { I8, U8, I16, U16, I32, U32, I64, U64, F16, BF16, F32, F64, OTHER };

template <typename T>
constexpr Ty ty()
{
    return std::is_same<T, int8_t>::value        ? Ty::I8
           : std::is_same<T, uint8_t>::value     ? Ty::U8
           : std::is_same<T, int16_t>::value     ? Ty::I16
           : std::is_same<T, uint16_t>::value    ? Ty::U16
           : std::is_same<T, int32_t>::value     ? Ty::I32
           : std::is_same<T, uint32_t>::value    ? Ty::U32
           : std::is_same<T, int64_t>::value     ? Ty::I64
           : std::is_same<T, uint64_t>::value    ? Ty::U64
           : std::is_same<T, half>::value        ? Ty::F16
           : std::is_same<T, bfloat16_t>::value  ? Ty::BF16
           : std::is_same<T, float>::value       ? Ty::F32
           : std::is_same<T, double>::value      ? Ty::F64
                                                 : Ty::OTHER;
}

inline const char *ty_name(Ty t)
{
    static const char *const names[] = {"int8_t", "uint8_t",    "int16_t", "uint16_t", "int32_t", "uint32_t", "int64_t",
                                        "uint64_t", "half", "bfloat16_t", "float", "double", "(a type the twin does not model)"};
    return names[static_cast<int>(t)];
}

inline const char *soc_name() { return kda_twin::cur().arch == kda_twin::ARCH_3510 ? "the 950" : "A2/A3"; }

constexpr uint8_t rm(RoundMode m) { return static_cast<uint8_t>(1u << static_cast<unsigned>(m)); }
constexpr uint8_t kNone = rm(RoundMode::CAST_NONE);
constexpr uint8_t kRounding = rm(RoundMode::CAST_RINT) | rm(RoundMode::CAST_FLOOR) | rm(RoundMode::CAST_CEIL) |
                              rm(RoundMode::CAST_ROUND) | rm(RoundMode::CAST_TRUNC);
constexpr uint8_t kTrunc = rm(RoundMode::CAST_TRUNC);
constexpr uint8_t kOdd = rm(RoundMode::CAST_ODD);

struct CastPair {
    Ty src, dst;
    uint8_t modes;
};

// The src -> dst pairs and round modes Cast lists per SoC (mirror-cann/asc-devkit/docs/zh/api/
// SIMD-API/基础API/Memory矢量计算/类型转换/Cast.md, 数据类型: the A2 and A3 tables are the same),
// less the types the twin has no tensors of (int4b_t, the fp8/fp4/hifloat8 types, complex) and
// int32_t -> half, whose scale comes from SetDeqScale, which the twin does not model.
constexpr CastPair kCastA2[] = {
    {Ty::I8, Ty::F16, kNone},           {Ty::U8, Ty::F16, kNone},
    {Ty::I16, Ty::F16, kRounding | kNone}, {Ty::I16, Ty::F32, kNone},
    {Ty::F16, Ty::I8, kRounding | kNone}, {Ty::F16, Ty::U8, kRounding | kNone},
    {Ty::F16, Ty::I16, kRounding},      {Ty::F16, Ty::I32, kRounding},
    {Ty::F16, Ty::F32, kNone},          {Ty::BF16, Ty::I32, kRounding},
    {Ty::BF16, Ty::F32, kNone},         {Ty::I32, Ty::I16, kNone},
    {Ty::I32, Ty::F32, kRounding | kNone}, {Ty::I32, Ty::I64, kNone},
    {Ty::F32, Ty::I16, kRounding},      {Ty::F32, Ty::F16, kRounding | kOdd | kNone},
    {Ty::F32, Ty::BF16, kRounding},     {Ty::F32, Ty::I32, kRounding},
    {Ty::F32, Ty::F32, kRounding},      {Ty::F32, Ty::I64, kRounding},
    {Ty::I64, Ty::I32, kNone},          {Ty::I64, Ty::F32, kRounding},
};

// Cast.md's Ascend 950PR/950DT table, less the same types.
constexpr CastPair kCast950[] = {
    {Ty::I8, Ty::I16, kNone},    {Ty::I8, Ty::F16, kNone},     {Ty::I8, Ty::I32, kNone},
    {Ty::U8, Ty::U16, kNone},    {Ty::U8, Ty::F16, kNone},     {Ty::U8, Ty::U32, kNone},
    {Ty::I16, Ty::U8, kNone},    {Ty::I16, Ty::F16, kRounding}, {Ty::I16, Ty::I32, kNone},
    {Ty::I16, Ty::U32, kNone},   {Ty::I16, Ty::F32, kNone},    {Ty::U16, Ty::U8, kNone},
    {Ty::U16, Ty::U32, kNone},   {Ty::F16, Ty::I8, kRounding}, {Ty::F16, Ty::U8, kRounding},
    {Ty::F16, Ty::I16, kRounding}, {Ty::F16, Ty::BF16, kRounding}, {Ty::F16, Ty::I32, kRounding},
    {Ty::F16, Ty::F32, kNone},   {Ty::BF16, Ty::F16, kRounding}, {Ty::BF16, Ty::I32, kRounding},
    {Ty::BF16, Ty::F32, kNone},  {Ty::I32, Ty::U8, kNone},     {Ty::I32, Ty::I16, kNone},
    {Ty::I32, Ty::U16, kNone},   {Ty::I32, Ty::F32, kRounding}, {Ty::I32, Ty::I64, kNone},
    {Ty::U32, Ty::U8, kNone},    {Ty::U32, Ty::I16, kNone},    {Ty::U32, Ty::U16, kNone},
    {Ty::F32, Ty::I16, kRounding}, {Ty::F32, Ty::F16, kRounding | kOdd | kNone}, {Ty::F32, Ty::BF16, kRounding},
    {Ty::F32, Ty::I32, kRounding}, {Ty::F32, Ty::F32, kRounding}, {Ty::F32, Ty::I64, kRounding},
    {Ty::I64, Ty::I32, kNone},   {Ty::I64, Ty::F32, kRounding}, {Ty::I64, Ty::F64, kRounding},
    {Ty::F64, Ty::BF16, kRounding}, {Ty::F64, Ty::I32, kTrunc}, {Ty::F64, Ty::F32, kRounding},
    {Ty::F64, Ty::I64, kTrunc},
};

// Cast's dtype rule: the pair and the round mode are in the SoC's table.
inline void cast_pair(Ty src, Ty dst, RoundMode mode)
{
    const bool a950 = kda_twin::cur().arch == kda_twin::ARCH_3510;
    const CastPair *pairs = a950 ? kCast950 : kCastA2;
    const size_t n = a950 ? sizeof(kCast950) / sizeof(CastPair) : sizeof(kCastA2) / sizeof(CastPair);
    const std::string what = std::string(ty_name(src)) + " -> " + ty_name(dst) + " on " + soc_name();
    for (size_t i = 0; i < n; ++i) {
        if (pairs[i].src != src || pairs[i].dst != dst) continue;
        if (!(pairs[i].modes & rm(mode))) {
            kda_twin::violate("Cast", "a round mode Cast.md does not list for the dtype pair on this SoC (数据类型)",
                              what + ", RoundMode " + std::to_string(static_cast<int>(mode)));
        }
        return;
    }
    kda_twin::violate("Cast", "a dtype pair Cast.md does not list for this SoC (数据类型)", what);
}

template <typename S>
inline double as_double(S x)
{
    if constexpr (std::is_arithmetic<S>::value) {
        return static_cast<double>(x);
    } else {
        return static_cast<double>(float(x));  // half, bfloat16_t: exact through f32
    }
}

// One element of Cast: `x` converted to D under `mode`.
template <typename D, typename S>
inline D cast_one(S x, RoundMode mode)
{
    const double v = as_double(x);
    if constexpr (std::is_integral<D>::value) {
        // Integer results: rounded by `mode`; out of D's range the device saturates or wraps
        // by rules the twin does not model, so such a value is refused.
        const double r = std::is_integral<S>::value ? v : round_to(v, mode);
        if (!(r >= static_cast<double>(std::numeric_limits<D>::min()) &&
              r <= static_cast<double>(std::numeric_limits<D>::max()))) {
            kda_twin::violate("Cast", "a value outside the destination type's range (the twin does not model "
                                      "the device's saturation)",
                              std::to_string(v) + " to " + ty_name(ty<D>()));
        }
        return static_cast<D>(r);
    } else if constexpr (std::is_same<D, half>::value || std::is_same<D, bfloat16_t>::value) {
        if (static_cast<double>(static_cast<float>(v)) != v && !std::isnan(v)) {
            kda_twin::violate("Cast", "a value the twin would round twice (no f32 form)", std::to_string(v));
        }
        return narrow<D>(static_cast<float>(v), mode);
    } else {
        // float or double: float -> float rounds to an integral value; otherwise the
        // conversion is exact or rounds to nearest.
        const double r = std::is_floating_point<S>::value && std::is_same<D, S>::value ? round_to(v, mode) : v;
        const D out = static_cast<D>(r);
        if (static_cast<double>(out) != r && !std::isnan(r) && mode != RoundMode::CAST_RINT &&
            mode != RoundMode::CAST_NONE) {
            kda_twin::violate("Cast", "a directed rounding of an inexact conversion (the twin models only to-nearest)",
                              std::to_string(v));
        }
        return out;
    }
}
}  // namespace detail

// Element type conversion (Cast.md): only the dtype pairs and round modes its table lists for
// the SoC; widening is exact (CAST_NONE), narrowing rounds by `mode`.
template <typename D, typename S>
inline void Cast(const LocalTensor<D> &dst, const LocalTensor<S> &src, const RoundMode &mode, const uint32_t &count)
{
    const char *api = "Cast";
    detail::cast_pair(detail::ty<S>(), detail::ty<D>(), mode);
    if (!detail::vector_count(api, count)) return;
    detail::operand(api, dst, count, "dst");
    detail::operand(api, src, count, "src");
    detail::no_partial_overlap(api, dst, src, count);
    const uint32_t seq = kda_twin::issue(kda_twin::P_V);
    detail::vread(api, src, count);
    std::vector<D> out(count);
    const S *x = detail::ub_ptr(src);
    for (uint32_t i = 0; i < count; ++i) out[i] = detail::cast_one<D>(x[i], mode);
    detail::vwrite(api, seq, dst, count);
    std::memcpy(detail::ub_ptr(dst), out.data(), count * sizeof(D));
}

// Gather, the count form (mirror-cann/asc-devkit/docs/zh/api/SIMD-API/基础API/Memory矢量计算/
// 离散与聚合/Gather.md): dst[i] = the element of src at byte srcBaseAddr + srcOffset[i] from
// src's start, for i < count. Its rules, each a violation:
// - T among the SoC's types (数据类型): A2/A3 int16_t, uint16_t, half, bfloat16_t, int32_t,
//   uint32_t, float; the 950 also int8_t, uint8_t, int64_t, uint64_t;
// - dst, src and srcOffset 32-byte aligned in UB (参数说明; 通用说明和约束.md);
// - dst and src share no memory (约束说明); dst and srcOffset follow the general overlap rule;
// - srcBaseAddr a multiple of sizeof(T) (参数说明, 约束说明) and inside src (the interface's
//   debug check, mirror-cann/asc-devkit/impl/basic_api/kernel_operator_vec_gather_intf_impl.h);
// - each srcOffset a multiple of sizeof(T), and on the 950 at most 2^16 - 1 for 8-bit and
//   2^17 - 1 for 16-bit T (约束说明); the element it names lies inside src (约束说明 bounds it
//   by the UB; the twin holds it to src's tensor, as every other operand);
// - count within dst and srcOffset; on A2/A3 the count form issues count / (256 / sizeof(T))
//   full repeats with an 8-bit repeat count (repeatTime in [0, 255], 约束说明; the same
//   intf_impl.h), so a count of 256 repeats or more is refused; count 0 is a NOP on A2/A3 and
//   not guaranteed one on the 950 (约束说明), where the twin refuses it.
template <typename T>
inline void Gather(const LocalTensor<T> &dst, const LocalTensor<T> &src, const LocalTensor<uint32_t> &srcOffset,
                   const uint32_t srcBaseAddr, const uint32_t count)
{
    const char *api = "Gather";
    const bool a950 = kda_twin::cur().arch == kda_twin::ARCH_3510;
    const detail::Ty t = detail::ty<T>();
    const bool both = t == detail::Ty::I16 || t == detail::Ty::U16 || t == detail::Ty::F16 ||
                      t == detail::Ty::BF16 || t == detail::Ty::I32 || t == detail::Ty::U32 || t == detail::Ty::F32;
    const bool only950 = t == detail::Ty::I8 || t == detail::Ty::U8 || t == detail::Ty::I64 || t == detail::Ty::U64;
    if (!(both || (a950 && only950))) {
        kda_twin::violate(api, "a dtype Gather.md does not list for this SoC (数据类型)",
                          std::string(detail::ty_name(t)) + " on " + detail::soc_name());
    }
    if (count == 0) {
        if (a950) kda_twin::violate(api, "count 0 on the 950: not guaranteed a NOP (Gather.md, 约束说明)", "");
        return;  // a NOP on A2/A3
    }
    detail::operand(api, dst, count, "dst");
    detail::check_ub_addr(api, src.twin_addr(), "src");
    detail::operand(api, srcOffset, count, "srcOffset");
    if (!a950 && count / (256 / sizeof(T)) > 255) {
        kda_twin::violate(api, "count of more than 255 full repeats on A2/A3 (Gather.md: repeatTime in [0, 255])",
                          "count " + std::to_string(count) + " of " + std::to_string(256 / sizeof(T)) +
                              " elements per repeat");
    }
    const uint64_t src_bytes = static_cast<uint64_t>(src.twin_size()) * sizeof(T);
    const uint64_t d0 = dst.twin_addr(), d1 = d0 + static_cast<uint64_t>(count) * sizeof(T);
    const uint64_t s0 = src.twin_addr(), s1 = s0 + src_bytes;
    if (d0 < s1 && s0 < d1) {
        kda_twin::violate(api, "dst and src share memory (Gather.md, 约束说明)",
                          "dst UB [" + std::to_string(d0) + ", " + std::to_string(d1) + "), src [" +
                              std::to_string(s0) + ", " + std::to_string(s1) + ")");
    }
    detail::no_partial_overlap(api, dst, srcOffset, count);
    if (srcBaseAddr % sizeof(T) != 0 || srcBaseAddr >= src_bytes) {
        kda_twin::violate(api, "srcBaseAddr not a multiple of sizeof(T) or past src (Gather.md)",
                          std::to_string(srcBaseAddr) + " bytes into a src of " + std::to_string(src_bytes));
    }
    const uint32_t seq = kda_twin::issue(kda_twin::P_V);
    detail::vread(api, srcOffset, count);
    const uint32_t *off = detail::ub_ptr(srcOffset);
    const uint64_t limit = !a950 ? UINT32_MAX : sizeof(T) == 1 ? 65535 : sizeof(T) == 2 ? 131071 : UINT32_MAX;
    std::vector<T> out(count);
    for (uint32_t i = 0; i < count; ++i) {
        const uint64_t o = off[i], at = srcBaseAddr + o;
        if (o % sizeof(T) != 0 || o > limit) {
            kda_twin::violate(api, "a srcOffset not a multiple of sizeof(T) or past its range on this SoC (Gather.md, 约束说明)",
                              "srcOffset[" + std::to_string(i) + "] = " + std::to_string(o));
        }
        if (at + sizeof(T) > src_bytes) {
            kda_twin::violate(api, "a gathered element past src (srcBaseAddr + srcOffset[i])",
                              "srcOffset[" + std::to_string(i) + "] = " + std::to_string(o) + " into a src of " +
                                  std::to_string(src_bytes) + " bytes");
        }
        kda_twin::ub_read(api, kda_twin::P_V, src.twin_addr() + static_cast<uint32_t>(at), sizeof(T));
        std::memcpy(&out[i], kda_twin::cur().ub.data() + src.twin_addr() + at, sizeof(T));
    }
    detail::vwrite(api, seq, dst, count);
    std::memcpy(detail::ub_ptr(dst), out.data(), static_cast<size_t>(count) * sizeof(T));
}

// The scalar f32 -> bf16 conversion (标量计算/Cast（float转bfloat16_t）.md): round to nearest even.
inline bfloat16_t Cast(float v) { return bfloat16_t(v); }

// dst[0] = the sum of the first `count` elements of src. The order of the additions is the
// hardware's (归约计算/ReduceSum.md, 关键特性说明): within one repeat (256 bytes) a binary tree of
// adjacent pairs; on A2/A3 (tensor-first-n form) the repeats' sums added in order (方式一); on the
// 950 repeats combined by a tree too (方式二), or, for 256 to 1024 bytes in counter mode, added
// lane-wise into one repeat first (方式三). The 950 needs sharedTmpBuffer of
// ceil(max(1, count / elements-per-repeat) / elements-per-block) blocks.
template <typename T>
inline void ReduceSum(const LocalTensor<T> &dst, const LocalTensor<T> &src, const LocalTensor<T> &work,
                      const int32_t &count)
{
    const char *api = "ReduceSum";
    detail::float_only<T>(api);
    if (!detail::vector_count(api, count)) return;
    detail::operand(api, dst, 1, "dst");
    detail::operand(api, src, count, "src");
    detail::check_ub_addr(api, work.twin_addr(), "sharedTmpBuffer");
    constexpr int32_t lanes = 256 / sizeof(T), per_block = 32 / sizeof(T);
    const int32_t repeats = (count + lanes - 1) / lanes;
    const bool a950 = kda_twin::cur().arch == kda_twin::ARCH_3510;
    if (a950) {
        const int32_t first = count / lanes > 1 ? count / lanes : 1;
        const int32_t need = (first + per_block - 1) / per_block * per_block;
        if (need > static_cast<int32_t>(work.twin_size())) {
            kda_twin::violate(api, "sharedTmpBuffer smaller than ReduceSum needs on the 950 (ReduceSum.md)",
                              std::to_string(need) + " elements needed, " + std::to_string(work.twin_size()) +
                                  " given");
        }
    }
    const uint32_t seq = kda_twin::issue(kda_twin::P_V);
    detail::vread(api, src, count);
    const T *x = detail::ub_ptr(src);
    auto tree = [](std::vector<float> v) {
        // Adjacent pairs, level by level, over a power-of-two width (masked lanes are 0).
        size_t w = 1;
        while (w < v.size()) w *= 2;
        v.resize(w, 0.0f);
        for (; w > 1; w /= 2) {
            for (size_t i = 0; i < w / 2; ++i) v[i] = v[2 * i] + v[2 * i + 1];
        }
        return v[0];
    };
    auto repeat = [&](int32_t r) {
        std::vector<float> v(lanes, 0.0f);
        for (int32_t i = 0; i < lanes && r * lanes + i < count; ++i) v[i] = float(x[r * lanes + i]);
        return tree(v);
    };
    float sum;
    const int64_t bytes = static_cast<int64_t>(count) * sizeof(T);
    if (!a950) {
        sum = repeat(0);
        for (int32_t r = 1; r < repeats; ++r) sum = sum + repeat(r);
    } else if (bytes >= 256 && bytes <= 1024) {
        std::vector<float> v(lanes, 0.0f);
        for (int32_t r = 0; r < repeats; ++r) {
            for (int32_t i = 0; i < lanes && r * lanes + i < count; ++i) v[i] = v[i] + float(x[r * lanes + i]);
        }
        sum = tree(v);
    } else {
        std::vector<float> parts;
        for (int32_t r = 0; r < repeats; ++r) parts.push_back(repeat(r));
        while (parts.size() > 1) {
            std::vector<float> next;
            for (size_t r = 0; r < parts.size(); r += lanes) {
                std::vector<float> chunk(parts.begin() + r, parts.begin() + std::min(parts.size(), r + lanes));
                next.push_back(tree(chunk));
            }
            parts = next;
        }
        sum = parts[0];
    }
    detail::vwrite(api, seq, dst, 1);
    *detail::ub_ptr(dst) = T(sum);
}

}  // namespace AscendC

#endif
