// The argument block of every kda kernel: the C side of src/kernels/abi.rs (keep in step;
// ABI_VERSION guards it). aclrtLaunchKernel copies the block into the kernel's parameter area,
// so each kernel takes one by-value struct: the header, its tensors, its scalars.
#ifndef KDA_KERNEL_ABI_H
#define KDA_KERNEL_ABI_H

#include "kernel_operator.h"

#define KDA_ABI_VERSION 1
#define KDA_MAX_RANK 6

// ACL dtype codes (acl_base.h).
#define KDA_FLOAT 0
#define KDA_FLOAT16 1
#define KDA_INT32 3
#define KDA_BF16 27

struct GmTensor {
    uint64_t addr;      // device address of the buffer; 0 = absent optional operand
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
