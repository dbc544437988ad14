// The twin's runtime: the state of one AI Vector core while a kernel block runs on the host, and
// the checks every API call goes through. The API headers (kernel_operator.h) call into it; the
// kernel sources never see it.
//
// What a block's state models (each rule cites the asc-devkit document that states it; paths are
// under mirror-cann/asc-devkit/docs/zh/api/SIMD-API/):
// - the unified buffer (UB): its size per SoC (hicann/runtime
//   src/platform/platform_config/cann/Ascend910B*.ini, Ascend910_93*.ini, cann-dev/Ascend950*.ini:
//   [AICoreSpec] ub_size 196608 on A2/A3, 253952 on the 950), filled by TPipe::InitBuffer in
//   32-byte units;
// - four pipes, each an in-order queue: S (scalar: LocalTensor/GlobalTensor GetValue and
//   SetValue), V (vector instructions), MTE2 (GM -> UB) and MTE3 (UB -> GM);
// - per 32-byte UB block (the unit UB addresses and copies align to): the pipe and sequence
//   number of its last write and the last read of each pipe; per UB byte whether an instruction
//   wrote a defined value there (DataCopyPad's dummy padding is not);
// - per pipe a vector clock: how many instructions of each pipe it is known to follow, learnt
//   only through SetFlag/WaitFlag, PipeBarrier and the queues' EnQue/DeQue/FreeTensor/AllocTensor
//   (which synchronise as the framework does). No automatic synchronisation is assumed (CI runs
//   the strict mode: it does not lean on bisheng's --cce-auto-sync).
#ifndef KDA_TWIN_RT_H
#define KDA_TWIN_RT_H

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace kda_twin {

enum Pipe : uint8_t { P_S = 0, P_V = 1, P_MTE2 = 2, P_MTE3 = 3, P_COUNT = 4 };

const char *pipe_name(int p);

// A rule broken by the kernel: thrown from the API, caught at the launch boundary.
struct Violation {
    std::string api;
    std::string rule;
    std::string detail;
};

[[noreturn]] void violate(const char *api, const char *rule, const std::string &detail);

// The device architecture the block runs on: it decides UB size, stride ranges and the order
// of ReduceSum's additions.
enum Arch : uint32_t { ARCH_2201 = 0, ARCH_3510 = 1 };

constexpr uint32_t kBlock = 32;       // one UB data block
constexpr uint32_t kMaxBuffers = 64;  // TPipe/InitBuffer.md: at most 64 buffers per kernel
constexpr int kEventIds = 8;          // SetFlag-WaitFlag(ISASI).md: eventID 0-7 on A2/A3/950

struct Shadow {
    uint32_t wseq;          // sequence number of the last write (0: never written)
    uint32_t rseq[P_COUNT]; // last read per pipe
    uint8_t wpipe;
};

struct Flag {
    bool set;
    uint32_t clock[P_COUNT];
};

struct GmRange {
    uint64_t base, len;
};

struct GmWrite {
    uint64_t lo, hi;  // [lo, hi)
    uint32_t block;
    const char *api;
};

// One queue buffer's state (TQue).
enum BufState : uint8_t { B_FREE, B_ALLOC, B_QUEUED, B_DEQUEUED };

struct QueBuf {
    uint32_t addr;
    BufState state;
    uint32_t clock[P_COUNT];  // the synchronisation a FreeTensor/EnQue left for the next step
};

struct Block {
    // Launch-wide.
    const char *kernel = "";
    uint32_t block_num = 1;
    uint32_t ub_bytes = 0;
    Arch arch = ARCH_2201;
    const std::vector<GmRange> *gm = nullptr;
    std::vector<GmWrite> *gm_writes = nullptr;
    std::vector<GmWrite> *gm_reads = nullptr;
    // This block.
    uint32_t idx = 0;
    std::vector<uint8_t> ub;
    std::vector<Shadow> shadow;    // one per 32-byte block
    std::vector<uint8_t> defined;  // one per byte
    uint32_t issued[P_COUNT] = {};
    uint32_t known[P_COUNT][P_COUNT] = {};  // known[p][q]: q's instructions p follows
    Flag flags[P_COUNT][P_COUNT][kEventIds] = {};
    uint32_t ub_top = 0;
    uint32_t buffers = 0;
    int pipes_alive = 0;
    std::vector<uint64_t> dcci_lines;  // 64-byte GM lines invalidated by this block
    std::string deferred_api, deferred_rule, deferred_detail;  // found in a destructor
};

Block &cur();

// An instruction on `p` starts: its sequence number.
uint32_t issue(Pipe p);

// Checks and records of UB accesses by the instruction `seq` on pipe `p` (bytes [addr, addr+len)).
void ub_read(const char *api, Pipe p, uint32_t addr, uint32_t len);
void ub_write(const char *api, Pipe p, uint32_t seq, uint32_t addr, uint32_t len, bool defined);

// A GM access of `len` bytes at `addr`: inside one of the launch's buffers.
void gm_check(const char *api, const void *addr, uint64_t len);
void gm_wrote(const char *api, const void *addr, uint64_t len);
void gm_read(const char *api, const void *addr, uint64_t len);
void gm_scalar_read(const char *api, const void *addr, uint64_t len);
void dcci(const void *addr);

// Synchronisation.
void set_flag(const char *api, Pipe src, Pipe dst, int id);
void wait_flag(const char *api, Pipe src, Pipe dst, int id);
void barrier(Pipe p);
void barrier_all();
// The clock a synchronisation point leaves for `dst` to learn (src's completed work).
void snapshot(Pipe src, uint32_t out[P_COUNT]);
void learn(Pipe dst, const uint32_t clock[P_COUNT]);

// UB allocation (TPipe::InitBuffer).
uint32_t ub_alloc(const char *api, uint32_t len);

// A violation found where it cannot be thrown (a destructor): reported when the block ends.
void defer(const char *api, const char *rule, const std::string &detail);

std::string hex(uint64_t v);

}  // namespace kda_twin

// The C boundary the host calls (one kernel launch: every block in turn).
extern "C" {
struct KdaTwinGm {
    uint64_t base;
    uint64_t len;
};

struct KdaTwinLaunch {
    const char *kernel;
    const void *entry;
    uint32_t nargs;
    uint32_t block_num;
    const uint64_t *args;
    uint32_t ub_bytes;
    uint32_t arch;
    const KdaTwinGm *gm;
    uint32_t gm_count;
};

struct KdaTwinError {
    uint32_t block;
    char api[64];
    char rule[160];
    char detail[1024];
};

// 0 on success; 1 with `err` filled when the kernel broke a rule; 2 for a bad launch.
__attribute__((visibility("default"))) int kda_twin_launch(const KdaTwinLaunch *launch,
                                                           KdaTwinError *err);
}

#endif
