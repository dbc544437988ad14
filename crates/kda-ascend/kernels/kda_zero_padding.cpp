// Zero-padding mask: rows at or past num_actual_tokens (read on device, so the launch is
// graph-friendly) become exactly zero, even when they held NaN; earlier rows are untouched.
// Units: rows.
#include "kda_kernel_util.h"

using namespace AscendC;

struct ZeroPaddingArgs {
    ArgsHeader h;
    GmTensor x;                  // [rows, ...] (each row contiguous), any dtype
    GmTensor num_actual_tokens;  // [1] i32
};

__aicore__ inline void zero_padding(const ZeroPaddingArgs &a)
{
    uint32_t start, count;
    kda_share(a.h.tiling, start, count);
    GlobalTensor<int32_t> live_gm;
    live_gm.SetGlobalBuffer(kda_gm<int32_t>(a.num_actual_tokens));
    const int64_t live = kda_read(live_gm, 0);  // written by an earlier task: invalidate first
    // A row is a token: everything after the first dimension (contiguous within the row).
    int64_t row_len = 1;
    for (uint32_t d = 1; d < a.x.rank; ++d) row_len *= a.x.shape[d];
    const int64_t stride = a.x.rank > 1 ? a.x.strides[0] : row_len;
    ascendc_assert(live >= 0 && live <= a.x.shape[0], "num_actual_tokens = %d is not within 0..=%d\n",
                   static_cast<int32_t>(live), static_cast<int32_t>(a.x.shape[0]));
    // Zero bytes: the element size does not matter, so the rows are copied as 16-bit words
    // (every kda dtype is a whole number of them, except u8/fp8 rows of odd length, which
    // the host never pads).
    const int64_t elem = (a.x.dtype == KDA_FLOAT || a.x.dtype == KDA_INT32) ? 4 : 2;
    const int64_t words = row_len * elem / 2;
    GlobalTensor<uint16_t> x;
    x.SetGlobalBuffer(reinterpret_cast<__gm__ uint16_t *>(a.x.addr) + a.x.offset * elem / 2);
    TPipe pipe;
    TBuf<TPosition::VECCALC> zeros;
    pipe.InitBuffer(zeros, kda_pitch(words, sizeof(uint16_t)) * sizeof(uint16_t));
    LocalTensor<uint16_t> z = zeros.Get<uint16_t>();
    Duplicate(z, static_cast<uint16_t>(0), words);
    SetFlag<HardEvent::V_MTE3>(EVENT_ID0);
    WaitFlag<HardEvent::V_MTE3>(EVENT_ID0);
    // DataCopyPad: a row whose byte length is not a multiple of 32 is zeroed to its end
    // (DataCopy would leave the tail).
    DataCopyExtParams p{1, static_cast<uint32_t>(words * sizeof(uint16_t)), 0, 0, 0};
    for (uint32_t row = start; row < start + count; ++row) {
        if (static_cast<int64_t>(row) >= live) {
            DataCopyPad(x[row * stride * elem / 2], z, p);
        }
    }
}

extern "C" __global__ __aicore__ void kda_zero_padding(GM_ADDR x, GM_ADDR num_actual_tokens, GM_ADDR meta)
{
    KDA_VECTOR_KERNEL();
    ZeroPaddingArgs args;
    GM_ADDR tensors[] = {x, num_actual_tokens};
    kda_load_args(args, meta, tensors, 2);
    zero_padding(args);
}
