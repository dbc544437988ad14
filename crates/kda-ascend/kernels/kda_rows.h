// Rows of GM tensors of any kda float dtype (f32, bf16, f16: the dtype code of the tensor's
// descriptor) to and from f32 rows of the unified buffer, for the kernels whose operands the HAL
// lets differ in dtype (the conv and delta-rule kernels). Each call is one DataCopyPad and keeps
// the pipe order of kda_load_f32 / kda_store_f32 (kda_kernel_util.h): on return of a load the
// vector unit may read `dst`; on return of a store `src` and `stage` may be written again.
// Not compiled here (no bisheng).
#ifndef KDA_ROWS_H
#define KDA_ROWS_H

#include "kda_kernel_util.h"

// `n` values of `t` from element `at` into f32 `dst`; `stage` holds at least `n` 16-bit values
// (unused for f32 rows).
__aicore__ inline void kda_load_row(const AscendC::LocalTensor<float> &dst,
                                    const AscendC::LocalTensor<half> &stage, const GmTensor &t,
                                    int64_t at, int64_t n)
{
    using namespace AscendC;
    if (t.dtype == KDA_FLOAT) {
        GlobalTensor<float> g;
        g.SetGlobalBuffer(kda_gm<float>(t));
        kda_load_f32<float>(dst, dst, g, at, n);
    } else if (t.dtype == KDA_BF16) {
        GlobalTensor<bfloat16_t> g;
        g.SetGlobalBuffer(kda_gm<bfloat16_t>(t));
        kda_load_f32<bfloat16_t>(dst, stage.ReinterpretCast<bfloat16_t>(), g, at, n);
    } else {
        GlobalTensor<half> g;
        g.SetGlobalBuffer(kda_gm<half>(t));
        kda_load_f32<half>(dst, stage, g, at, n);
    }
}

// `n` f32 values of `src` to `t` at element `at`, rounded once to the tensor's dtype.
__aicore__ inline void kda_store_row(const GmTensor &t, int64_t at,
                                     const AscendC::LocalTensor<half> &stage,
                                     const AscendC::LocalTensor<float> &src, int64_t n)
{
    using namespace AscendC;
    if (t.dtype == KDA_FLOAT) {
        GlobalTensor<float> g;
        g.SetGlobalBuffer(kda_gm<float>(t));
        kda_store_f32<float>(g, at, src, src, n);
    } else if (t.dtype == KDA_BF16) {
        GlobalTensor<bfloat16_t> g;
        g.SetGlobalBuffer(kda_gm<bfloat16_t>(t));
        kda_store_f32<bfloat16_t>(g, at, stage.ReinterpretCast<bfloat16_t>(), src, n);
    } else {
        GlobalTensor<half> g;
        g.SetGlobalBuffer(kda_gm<half>(t));
        kda_store_f32<half>(g, at, stage, src, n);
    }
}

// One value of `t` at element `at` as f32, read by the scalar unit after a vector conversion
// (`one` is a one-block f32 tensor, `stage` at least one 32-byte block).
__aicore__ inline float kda_load_scalar(const AscendC::LocalTensor<float> &one,
                                        const AscendC::LocalTensor<half> &stage, const GmTensor &t,
                                        int64_t at)
{
    kda_load_row(one, stage, t, at, 1);
    return kda_from_vector(one);
}

#endif
