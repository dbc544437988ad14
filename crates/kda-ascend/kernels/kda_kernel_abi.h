// The arguments of every kda kernel: the C side of kda-ascend-sys's abi.rs (keep in step;
// ABI_VERSION guards it). The host launches with aclrtLaunchKernelWithHostArgs: a kernel with n
// tensors is kernel(GM_ADDR t_0, ..., GM_ADDR t_{n-1}, GM_ADDR meta), where `meta` points to a
// device copy (made by the runtime through an aclrtPlaceHolderInfo) of the meta region: the
// ArgsHeader with the tiling, n GmTensor descriptors, then the f64 scalars, laid out exactly as
// each kernel's *Args struct. Every kernel is a vector-only kernel (KDA_VECTOR_KERNEL).
#ifndef KDA_KERNEL_ABI_H
#define KDA_KERNEL_ABI_H

#include "kernel_operator.h"

#define KDA_ABI_VERSION 2
#define KDA_MAX_RANK 6

// ACL dtype codes (acl_base.h).
#define KDA_FLOAT 0
#define KDA_FLOAT16 1
#define KDA_INT32 3
#define KDA_BF16 27

struct GmTensor {
    uint64_t addr;      // device address of the buffer (from the pointer parameter); 0 = absent
    int64_t offset;     // elements
    int64_t shape[KDA_MAX_RANK];
    int64_t strides[KDA_MAX_RANK];
    uint32_t rank;
    int32_t dtype;
};

struct KernelTiling {
    uint32_t block_dim;  // cores launched
    uint32_t per_core;   // units per core (the last core: last_core)
    uint32_t last_core;
    uint32_t tile;       // units per unified-buffer tile
    uint32_t ub_bytes;
    uint32_t reserved;
};

struct ArgsHeader {
    uint32_t version;
    uint32_t tensors;
    uint32_t scalars;
    uint32_t reserved;
    KernelTiling tiling;
};

// Every kda kernel runs on the vector cores only: typed explicitly, since a binary with several
// kernels (and every Ascend 950 kernel) cannot have its type deduced.
#define KDA_VECTOR_KERNEL() KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_AIV_ONLY)

// Read the meta region into the kernel's *Args struct `a` (header, descriptors, scalars: all
// 8-byte words), then take each tensor's address from its pointer parameter.
template <typename A>
__aicore__ inline void kda_load_args(A &a, GM_ADDR meta, GM_ADDR const *tensors, uint32_t n)
{
    static_assert(sizeof(A) % sizeof(uint64_t) == 0, "meta regions are 8-byte words");
    const __gm__ uint64_t *src = reinterpret_cast<const __gm__ uint64_t *>(meta);
    uint64_t *dst = reinterpret_cast<uint64_t *>(&a);
    for (uint32_t i = 0; i < sizeof(A) / sizeof(uint64_t); ++i) {
        dst[i] = src[i];
    }
    GmTensor *t = reinterpret_cast<GmTensor *>(reinterpret_cast<uint8_t *>(&a) + sizeof(ArgsHeader));
    for (uint32_t i = 0; i < n; ++i) {
        t[i].addr = reinterpret_cast<uint64_t>(tensors[i]);
    }
}

// This core's share of the units: [start, start + count).
__aicore__ inline void kda_share(const KernelTiling &t, uint32_t &start, uint32_t &count)
{
    uint32_t core = AscendC::GetBlockIdx();
    start = core * t.per_core;
    count = (core + 1 == t.block_dim) ? t.last_core : t.per_core;
}

template <typename T>
__aicore__ inline __gm__ T *kda_gm(const GmTensor &g)
{
    return reinterpret_cast<__gm__ T *>(g.addr) + g.offset;
}

// Call F<T>(args) with T the element type of the float dtype `code` (bf16, f16, else f32).
#define KDA_FOR_FLOAT_DTYPE(code, F, args)  \
    do {                                    \
        if ((code) == KDA_BF16) {           \
            F<bfloat16_t>(args);            \
        } else if ((code) == KDA_FLOAT16) { \
            F<half>(args);                  \
        } else {                            \
            F<float>(args);                 \
        }                                   \
    } while (0)

#endif
