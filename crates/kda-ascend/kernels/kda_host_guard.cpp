// Fails the launch when the stream's host-function failure flag (pinned host memory mapped for
// the device) is set, so that ACL_STOP_ON_FAILURE stops the stream's later tasks.
#include "kda_kernel_abi.h"

using namespace AscendC;

struct GuardArgs {
    ArgsHeader h;
    GmTensor flag;  // [1] i32
};

extern "C" __global__ __aicore__ void kda_host_guard(GM_ADDR flag_addr, GM_ADDR meta)
{
    KDA_VECTOR_KERNEL();
    GuardArgs a;
    GM_ADDR tensors[] = {flag_addr};
    kda_load_args(a, meta, tensors, 1);
    GlobalTensor<int32_t> flag;
    flag.SetGlobalBuffer(kda_gm<int32_t>(a.flag));
    if (flag.GetValue(0) != 0) {
        trap();  // an AI Core exception: the stream fails here
    }
}
