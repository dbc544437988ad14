// The twin's runtime: block state, the pipe model and the checks behind every API call of
// kernel_operator.h, and the launch boundary (kda_twin_launch) that runs a kernel's blocks in
// turn. See kda_twin_rt.h for what is modelled and where each rule comes from.
#include "kda_twin_rt.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <exception>

namespace kda_twin {

namespace {
thread_local Block *g_block = nullptr;
}

const char *pipe_name(int p)
{
    switch (p) {
        case P_S: return "S";
        case P_V: return "V";
        case P_MTE2: return "MTE2";
        case P_MTE3: return "MTE3";
        default: return "?";
    }
}

std::string hex(uint64_t v)
{
    char buf[32];
    std::snprintf(buf, sizeof buf, "%#llx", static_cast<unsigned long long>(v));
    return buf;
}

void violate(const char *api, const char *rule, const std::string &detail)
{
    throw Violation{api, rule, detail};
}

Block &cur()
{
    if (g_block == nullptr) {
        violate("(twin)", "an AscendC API was called outside a kernel launch", "no block is running");
    }
    return *g_block;
}

uint32_t issue(Pipe p)
{
    Block &b = cur();
    return ++b.issued[p];
}

// Whether pipe `p` is ordered after instruction `seq` of pipe `q`.
static bool ordered(const Block &b, Pipe p, Pipe q, uint32_t seq)
{
    if (seq == 0) return true;
    if (p == q) {
        // The scalar unit and the MTE queues execute in order; vector instructions that depend
        // on each other need PipeBarrier<PIPE_V> between them (PipeBarrier(ISASI).md: "Mul's
        // input is Add's output ... insert PipeBarrier to guarantee the order").
        return p != P_V || seq <= b.known[P_V][P_V];
    }
    return seq <= b.known[p][q];
}

static void need_ub(const Block &b, const char *api, uint32_t addr, uint32_t len)
{
    if (static_cast<uint64_t>(addr) + len > b.ub.size()) {
        violate(api, "UB access past the unified buffer",
                std::to_string(len) + " bytes at UB offset " + std::to_string(addr) + ", UB holds " +
                    std::to_string(b.ub.size()));
    }
}

void ub_read(const char *api, Pipe p, uint32_t addr, uint32_t len)
{
    Block &b = cur();
    need_ub(b, api, addr, len);
    if (len == 0) return;
    const uint32_t seq = b.issued[p];
    const auto first = b.defined.begin() + addr, last = first + len;
    const auto hole = std::find(first, last, uint8_t{0});
    if (hole != last) {
        const uint32_t i = static_cast<uint32_t>(hole - b.defined.begin());
        const Shadow &s = b.shadow[i / kBlock];
        violate(api, "read of UB bytes no instruction defined",
                std::string("pipe ") + pipe_name(p) + " reads UB byte " + std::to_string(i) +
                    (s.wseq == 0 ? ", never written since InitBuffer"
                                 : ", DataCopyPad's dummy padding (GMToUB非对齐数据搬运(DataCopyPad).md: "
                                   "padding up to 32 bytes is dummy data)"));
    }
    for (uint32_t blk = addr / kBlock; blk <= (addr + len - 1) / kBlock; ++blk) {
        Shadow &s = b.shadow[blk];
        if (!ordered(b, p, static_cast<Pipe>(s.wpipe), s.wseq)) {
            const bool vv = p == P_V && s.wpipe == P_V;
            violate(api,
                    vv ? "vector read of a vector result without PipeBarrier<PIPE_V>"
                       : "unsynchronised read of UB written on another pipe (missing SetFlag/WaitFlag)",
                    std::string("pipe ") + pipe_name(p) + " reads UB block at " + std::to_string(blk * kBlock) +
                        " written by " + pipe_name(s.wpipe) + " instruction #" + std::to_string(s.wseq) + "; " +
                        pipe_name(p) + " is ordered after #" + std::to_string(b.known[p][s.wpipe]) + " of " +
                        pipe_name(s.wpipe));
        }
        if (s.rseq[p] < seq) s.rseq[p] = seq;
    }
}

void ub_write(const char *api, Pipe p, uint32_t seq, uint32_t addr, uint32_t len, bool defined)
{
    Block &b = cur();
    need_ub(b, api, addr, len);
    if (len == 0) return;
    for (uint32_t blk = addr / kBlock; blk <= (addr + len - 1) / kBlock; ++blk) {
        Shadow &s = b.shadow[blk];
        if (s.wseq != 0 && s.wpipe != p && !ordered(b, p, static_cast<Pipe>(s.wpipe), s.wseq)) {
            violate(api, "unsynchronised write of UB written on another pipe (missing SetFlag/WaitFlag)",
                    std::string("pipe ") + pipe_name(p) + " writes UB block at " + std::to_string(blk * kBlock) +
                        " last written by " + pipe_name(s.wpipe) + " instruction #" + std::to_string(s.wseq));
        }
        // Reads by the scalar unit are complete before it issues any later instruction (it is
        // the unit that issues them, in program order, and its loads block); its writes are
        // posted, which is why a scalar write needs S_V / S_MTE3 before another pipe reads it.
        for (int q = P_V; q < P_COUNT; ++q) {
            if (q != p && s.rseq[q] != 0 && !ordered(b, p, static_cast<Pipe>(q), s.rseq[q])) {
                violate(api, "unsynchronised write of UB another pipe still reads (missing SetFlag/WaitFlag)",
                        std::string("pipe ") + pipe_name(p) + " writes UB block at " + std::to_string(blk * kBlock) +
                            " read by " + pipe_name(q) + " instruction #" + std::to_string(s.rseq[q]));
            }
        }
        s.wseq = seq;
        s.wpipe = p;
    }
    std::fill(b.defined.begin() + addr, b.defined.begin() + addr + len, defined ? uint8_t{1} : uint8_t{0});
}

static const GmRange *gm_find(const Block &b, uint64_t a, uint64_t len)
{
    if (b.gm == nullptr) return nullptr;
    for (const GmRange &r : *b.gm) {
        if (a >= r.base && a - r.base <= r.len && len <= r.len - (a - r.base)) return &r;
    }
    return nullptr;
}

void gm_check(const char *api, const void *addr, uint64_t len)
{
    Block &b = cur();
    const uint64_t a = reinterpret_cast<uint64_t>(addr);
    if (gm_find(b, a, len) == nullptr) {
        violate(api, "GM access outside the launch's buffers",
                std::to_string(len) + " bytes at " + hex(a) +
                    " lie in no buffer a pointer parameter of the launch names");
    }
}

void gm_wrote(const char *api, const void *addr, uint64_t len)
{
    Block &b = cur();
    if (len == 0 || b.gm_writes == nullptr) return;
    const uint64_t a = reinterpret_cast<uint64_t>(addr);
    std::vector<GmWrite> &w = *b.gm_writes;
    if (!w.empty() && w.back().block == b.idx && w.back().hi == a) {
        w.back().hi = a + len;
        return;
    }
    w.push_back(GmWrite{a, a + len, b.idx, api});
}

void gm_read(const char *api, const void *addr, uint64_t len)
{
    Block &b = cur();
    if (len == 0 || b.gm_reads == nullptr) return;
    const uint64_t a = reinterpret_cast<uint64_t>(addr);
    std::vector<GmWrite> &r = *b.gm_reads;
    if (!r.empty() && r.back().block == b.idx && r.back().hi == a) {
        r.back().hi = a + len;
        return;
    }
    r.push_back(GmWrite{a, a + len, b.idx, api});
}

void dcci(const void *addr)
{
    Block &b = cur();
    const uint64_t line = reinterpret_cast<uint64_t>(addr) / 64;
    if (std::find(b.dcci_lines.begin(), b.dcci_lines.end(), line) == b.dcci_lines.end()) {
        b.dcci_lines.push_back(line);
    }
}

void gm_scalar_read(const char *api, const void *addr, uint64_t len)
{
    Block &b = cur();
    gm_check(api, addr, len);
    gm_read(api, addr, len);
    const uint64_t a = reinterpret_cast<uint64_t>(addr);
    for (uint64_t line = a / 64; line <= (a + len - 1) / 64; ++line) {
        // The scalar unit reads GM through its data cache, which is not coherent with what MTE3
        // or earlier tasks wrote: DataCacheCleanAndInvalid (CACHELINE_OUT) drops the stale line
        // first (缓存控制/DataCacheCleanAndInvalid.md).
        if (std::find(b.dcci_lines.begin(), b.dcci_lines.end(), line) == b.dcci_lines.end()) {
            violate(api, "scalar GM read without DataCacheCleanAndInvalid of its cache line",
                    "GM " + hex(a) + " (64-byte line " + hex(line * 64) +
                        ") was not invalidated by this block");
        }
    }
}

void snapshot(Pipe src, uint32_t out[P_COUNT])
{
    Block &b = cur();
    for (int q = 0; q < P_COUNT; ++q) out[q] = b.known[src][q];
    // A flag set on `src` fires once every earlier instruction of `src` has completed.
    out[src] = b.issued[src];
}

void learn(Pipe dst, const uint32_t clock[P_COUNT])
{
    Block &b = cur();
    for (int q = 0; q < P_COUNT; ++q) {
        if (b.known[dst][q] < clock[q]) b.known[dst][q] = clock[q];
    }
}

static void check_event(const char *api, int id)
{
    if (id < 0 || id >= kEventIds) {
        violate(api, "eventID outside 0-7 (SetFlag-WaitFlag(ISASI).md)", "eventID " + std::to_string(id));
    }
}

void set_flag(const char *api, Pipe src, Pipe dst, int id)
{
    check_event(api, id);
    Block &b = cur();
    Flag &f = b.flags[src][dst][id];
    if (f.set) {
        // SetFlag-WaitFlag(ISASI).md: SetFlag and WaitFlag are used in pairs, with identical
        // event and eventID.
        violate(api, "SetFlag twice without a WaitFlag between (flags are paired)",
                std::string(pipe_name(src)) + "_" + pipe_name(dst) + " eventID " + std::to_string(id));
    }
    f.set = true;
    snapshot(src, f.clock);
}

void wait_flag(const char *api, Pipe src, Pipe dst, int id)
{
    check_event(api, id);
    Block &b = cur();
    Flag &f = b.flags[src][dst][id];
    if (!f.set) {
        violate(api, "WaitFlag without a pending SetFlag (the pipe would wait until timeout)",
                std::string(pipe_name(src)) + "_" + pipe_name(dst) + " eventID " + std::to_string(id));
    }
    learn(dst, f.clock);
    f.set = false;
}

void barrier(Pipe p)
{
    Block &b = cur();
    b.known[p][p] = b.issued[p];
}

void barrier_all()
{
    Block &b = cur();
    for (int p = 0; p < P_COUNT; ++p) {
        for (int q = 0; q < P_COUNT; ++q) b.known[p][q] = b.issued[q];
    }
}

uint32_t ub_alloc(const char *api, uint32_t len)
{
    Block &b = cur();
    // TPipe/InitBuffer.md: a length that is not a multiple of 32 bytes is rounded up; at most
    // 64 buffers in one kernel.
    const uint64_t size = (static_cast<uint64_t>(len) + kBlock - 1) / kBlock * kBlock;
    if (b.buffers + 1 > kMaxBuffers) {
        violate(api, "more than 64 buffers in one kernel (TPipe/InitBuffer.md)",
                std::to_string(b.buffers + 1) + " buffers");
    }
    if (b.ub_top + size > b.ub_bytes) {
        violate(api, "UB overflow: the buffers exceed the SoC's unified buffer",
                "InitBuffer of " + std::to_string(len) + " bytes at UB offset " + std::to_string(b.ub_top) +
                    " ends at " + std::to_string(b.ub_top + size) + ", past the UB of " +
                    std::to_string(b.ub_bytes) + " bytes");
    }
    const uint32_t at = b.ub_top;
    b.ub_top += static_cast<uint32_t>(size);
    b.buffers += 1;
    for (uint32_t i = at / kBlock; i < b.ub_top / kBlock; ++i) b.shadow[i] = Shadow{};
    std::fill(b.defined.begin() + at, b.defined.begin() + b.ub_top, uint8_t{0});
    return at;
}

void defer(const char *api, const char *rule, const std::string &detail)
{
    Block &b = cur();
    if (b.deferred_rule.empty()) {
        b.deferred_api = api;
        b.deferred_rule = rule;
        b.deferred_detail = detail;
    }
}

}  // namespace kda_twin

using namespace kda_twin;

namespace {

using Arg = uint8_t *;

void call_entry(const void *entry, uint32_t n, const uint64_t *a)
{
    auto p = [&](uint32_t i) { return reinterpret_cast<Arg>(a[i]); };
    // The kernel's parameters are n GM pointers (GM_ADDR each), as the launch's argument block.
    switch (n) {
#define KDA_TWIN_ARGS_1 p(0)
#define KDA_TWIN_ARGS_2 KDA_TWIN_ARGS_1, p(1)
#define KDA_TWIN_ARGS_3 KDA_TWIN_ARGS_2, p(2)
#define KDA_TWIN_ARGS_4 KDA_TWIN_ARGS_3, p(3)
#define KDA_TWIN_ARGS_5 KDA_TWIN_ARGS_4, p(4)
#define KDA_TWIN_ARGS_6 KDA_TWIN_ARGS_5, p(5)
#define KDA_TWIN_ARGS_7 KDA_TWIN_ARGS_6, p(6)
#define KDA_TWIN_ARGS_8 KDA_TWIN_ARGS_7, p(7)
#define KDA_TWIN_ARGS_9 KDA_TWIN_ARGS_8, p(8)
#define KDA_TWIN_ARGS_10 KDA_TWIN_ARGS_9, p(9)
#define KDA_TWIN_ARGS_11 KDA_TWIN_ARGS_10, p(10)
#define KDA_TWIN_ARGS_12 KDA_TWIN_ARGS_11, p(11)
#define KDA_TWIN_ARGS_13 KDA_TWIN_ARGS_12, p(12)
#define KDA_TWIN_ARGS_14 KDA_TWIN_ARGS_13, p(13)
#define KDA_TWIN_ARGS_15 KDA_TWIN_ARGS_14, p(14)
#define KDA_TWIN_ARGS_16 KDA_TWIN_ARGS_15, p(15)
#define KDA_TWIN_CASE(N, ...)                                                  \
    case N: {                                                                  \
        using F = void (*)(__VA_ARGS__);                                       \
        reinterpret_cast<F>(const_cast<void *>(entry))(KDA_TWIN_ARGS_##N);     \
        return;                                                                \
    }
        KDA_TWIN_CASE(1, Arg)
        KDA_TWIN_CASE(2, Arg, Arg)
        KDA_TWIN_CASE(3, Arg, Arg, Arg)
        KDA_TWIN_CASE(4, Arg, Arg, Arg, Arg)
        KDA_TWIN_CASE(5, Arg, Arg, Arg, Arg, Arg)
        KDA_TWIN_CASE(6, Arg, Arg, Arg, Arg, Arg, Arg)
        KDA_TWIN_CASE(7, Arg, Arg, Arg, Arg, Arg, Arg, Arg)
        KDA_TWIN_CASE(8, Arg, Arg, Arg, Arg, Arg, Arg, Arg, Arg)
        KDA_TWIN_CASE(9, Arg, Arg, Arg, Arg, Arg, Arg, Arg, Arg, Arg)
        KDA_TWIN_CASE(10, Arg, Arg, Arg, Arg, Arg, Arg, Arg, Arg, Arg, Arg)
        KDA_TWIN_CASE(11, Arg, Arg, Arg, Arg, Arg, Arg, Arg, Arg, Arg, Arg, Arg)
        KDA_TWIN_CASE(12, Arg, Arg, Arg, Arg, Arg, Arg, Arg, Arg, Arg, Arg, Arg, Arg)
        KDA_TWIN_CASE(13, Arg, Arg, Arg, Arg, Arg, Arg, Arg, Arg, Arg, Arg, Arg, Arg, Arg)
        KDA_TWIN_CASE(14, Arg, Arg, Arg, Arg, Arg, Arg, Arg, Arg, Arg, Arg, Arg, Arg, Arg, Arg)
        KDA_TWIN_CASE(15, Arg, Arg, Arg, Arg, Arg, Arg, Arg, Arg, Arg, Arg, Arg, Arg, Arg, Arg, Arg)
        KDA_TWIN_CASE(16, Arg, Arg, Arg, Arg, Arg, Arg, Arg, Arg, Arg, Arg, Arg, Arg, Arg, Arg, Arg, Arg)
        default:
            violate("(launch)", "more than 16 kernel parameters", std::to_string(n));
    }
}

void copy_text(char *dst, size_t cap, const std::string &s)
{
    const size_t n = std::min(cap - 1, s.size());
    std::memcpy(dst, s.data(), n);
    dst[n] = '\0';
}

void fill(KdaTwinError *err, uint32_t block, const std::string &api, const std::string &rule,
          const std::string &detail)
{
    if (err == nullptr) return;
    err->block = block;
    copy_text(err->api, sizeof err->api, api);
    copy_text(err->rule, sizeof err->rule, rule);
    copy_text(err->detail, sizeof err->detail, detail);
}

// The block's end: flags set and never waited for, queue buffers never freed.
void end_of_block(Block &b)
{
    if (!b.deferred_rule.empty()) violate(b.deferred_api.c_str(), b.deferred_rule.c_str(), b.deferred_detail);
    for (int s = 0; s < P_COUNT; ++s) {
        for (int d = 0; d < P_COUNT; ++d) {
            for (int id = 0; id < kEventIds; ++id) {
                if (b.flags[s][d][id].set) {
                    violate("SetFlag", "SetFlag without a WaitFlag by the kernel's end (flags are paired)",
                            std::string(pipe_name(s)) + "_" + pipe_name(d) + " eventID " + std::to_string(id));
                }
            }
        }
    }
}

}  // namespace

extern "C" int kda_twin_launch(const KdaTwinLaunch *l, KdaTwinError *err)
{
    if (l == nullptr || l->entry == nullptr || (l->nargs > 0 && l->args == nullptr) || l->block_num == 0 ||
        l->ub_bytes == 0 || l->ub_bytes % kBlock != 0) {
        fill(err, 0, "(launch)", "a launch the twin cannot run", "null entry or arguments, no blocks, or a bad UB size");
        return 2;
    }
    std::vector<GmRange> gm;
    for (uint32_t i = 0; i < l->gm_count; ++i) gm.push_back(GmRange{l->gm[i].base, l->gm[i].len});
    std::vector<GmWrite> writes, reads;
    Block b;
    b.kernel = l->kernel != nullptr ? l->kernel : "";
    b.block_num = l->block_num;
    b.ub_bytes = l->ub_bytes;
    b.arch = l->arch == 1 ? ARCH_3510 : ARCH_2201;
    b.gm = &gm;
    b.gm_writes = &writes;
    b.gm_reads = &reads;
    b.ub.assign(l->ub_bytes, 0xff);
    b.shadow.assign(l->ub_bytes / kBlock, Shadow{});
    b.defined.assign(l->ub_bytes, 0);
    Block *saved = g_block;
    g_block = &b;
    uint32_t idx = 0;
    try {
        for (idx = 0; idx < l->block_num; ++idx) {
            // A fresh core: nothing issued, no flags, an empty pipe and a cold data cache.
            b.idx = idx;
            std::memset(b.issued, 0, sizeof b.issued);
            std::memset(b.known, 0, sizeof b.known);
            std::memset(b.flags, 0, sizeof b.flags);
            b.ub_top = 0;
            b.buffers = 0;
            b.pipes_alive = 0;
            b.dcci_lines.clear();
            b.deferred_api.clear();
            b.deferred_rule.clear();
            b.deferred_detail.clear();
            call_entry(l->entry, l->nargs, l->args);
            end_of_block(b);
        }
        // Blocks run on different cores in no defined order: two of them writing the same GM
        // bytes race (the outcome depends on timing).
        std::sort(writes.begin(), writes.end(),
                  [](const GmWrite &x, const GmWrite &y) { return x.lo < y.lo || (x.lo == y.lo && x.hi < y.hi); });
        const GmWrite *far = nullptr;
        for (const GmWrite &w : writes) {
            if (far != nullptr && w.lo < far->hi && w.block != far->block) {
                const uint64_t hi = std::min(w.hi, far->hi);
                g_block = saved;
                fill(err, w.block, w.api, "two blocks write the same GM bytes",
                     "blocks " + std::to_string(far->block) + " and " + std::to_string(w.block) + " both write GM [" +
                         hex(w.lo) + ", " + hex(hi) + ")");
                return 1;
            }
            if (far == nullptr || w.hi > far->hi) far = &w;
        }
        // A block reading GM bytes another block writes races too: the cores run concurrently,
        // so what it reads depends on timing.
        std::vector<uint64_t> reach(writes.size());
        for (size_t i = 0; i < writes.size(); ++i) reach[i] = std::max(i ? reach[i - 1] : 0, writes[i].hi);
        for (const GmWrite &r : reads) {
            // Writes starting below r.hi, newest first, while any of them can still reach r.lo.
            size_t i = std::lower_bound(writes.begin(), writes.end(), r.hi,
                                        [](const GmWrite &w, uint64_t hi) { return w.lo < hi; }) -
                       writes.begin();
            while (i > 0 && reach[i - 1] > r.lo) {
                const GmWrite &w = writes[--i];
                if (w.hi > r.lo && w.block != r.block) {
                    g_block = saved;
                    fill(err, r.block, r.api, "a block reads GM bytes another block writes",
                         "block " + std::to_string(r.block) + " reads and block " + std::to_string(w.block) +
                             " writes GM [" + hex(std::max(w.lo, r.lo)) + ", " + hex(std::min(w.hi, r.hi)) + ")");
                    return 1;
                }
            }
        }
    } catch (const Violation &v) {
        g_block = saved;
        fill(err, idx, v.api, v.rule, v.detail);
        return 1;
    } catch (const std::exception &e) {
        g_block = saved;
        fill(err, idx, "(twin)", "internal error", e.what());
        return 2;
    }
    g_block = saved;
    return 0;
}
