// Deliberately broken kernels: each breaks one device rule the twin must reject
// (crates/kda-ascend/emu/tests/twin_rules.rs runs them). Every kernel takes two GM pointers:
// `x`, 64 f32 inputs, and `y`, 64 f32 outputs.
#include "kernel_operator.h"

using namespace AscendC;

// A correct kernel: y = x + 1 over 64 values, block 0 only (the control).
extern "C" __global__ __aicore__ void twin_ok(GM_ADDR x, GM_ADDR y)
{
    if (GetBlockIdx() != 0) return;
    GlobalTensor<float> xg, yg;
    xg.SetGlobalBuffer(reinterpret_cast<__gm__ float *>(x));
    yg.SetGlobalBuffer(reinterpret_cast<__gm__ float *>(y));
    TPipe pipe;
    TBuf<TPosition::VECCALC> buf;
    pipe.InitBuffer(buf, 64 * sizeof(float));
    LocalTensor<float> t = buf.Get<float>();
    DataCopy(t, xg, 64);
    SetFlag<HardEvent::MTE2_V>(EVENT_ID0);
    WaitFlag<HardEvent::MTE2_V>(EVENT_ID0);
    Adds(t, t, 1.0f, 64);
    SetFlag<HardEvent::V_MTE3>(EVENT_ID0);
    WaitFlag<HardEvent::V_MTE3>(EVENT_ID0);
    DataCopy(yg, t, 64);
}

// DataCopy of 20 floats: 80 bytes, not whole 32-byte blocks (a tail needs DataCopyPad).
extern "C" __global__ __aicore__ void twin_unaligned_copy(GM_ADDR x, GM_ADDR y)
{
    (void)y;
    GlobalTensor<float> xg;
    xg.SetGlobalBuffer(reinterpret_cast<__gm__ float *>(x));
    TPipe pipe;
    TBuf<TPosition::VECCALC> buf;
    pipe.InitBuffer(buf, 64 * sizeof(float));
    LocalTensor<float> t = buf.Get<float>();
    DataCopy(t, xg, 20);
}

// Buffers past the unified buffer (192 KiB on A2/A3, 248 KiB on the 950).
extern "C" __global__ __aicore__ void twin_ub_overflow(GM_ADDR x, GM_ADDR y)
{
    (void)x;
    (void)y;
    TPipe pipe;
    TBuf<TPosition::VECCALC> a, b;
    pipe.InitBuffer(a, 128 * 1024);
    pipe.InitBuffer(b, 128 * 1024);
}

// A queue's tensor freed twice.
extern "C" __global__ __aicore__ void twin_double_free(GM_ADDR x, GM_ADDR y)
{
    (void)y;
    GlobalTensor<float> xg;
    xg.SetGlobalBuffer(reinterpret_cast<__gm__ float *>(x));
    TPipe pipe;
    TQue<QuePosition::VECIN, 1> in;
    pipe.InitBuffer(in, 1, 64 * sizeof(float));
    LocalTensor<float> t = in.AllocTensor<float>();
    DataCopy(t, xg, 64);
    in.EnQue(t);
    t = in.DeQue<float>();
    in.FreeTensor(t);
    in.FreeTensor(t);
}

// The scalar unit reads a vector result without V_S between.
extern "C" __global__ __aicore__ void twin_unsynced_scalar_read(GM_ADDR x, GM_ADDR y)
{
    (void)x;
    (void)y;
    TPipe pipe;
    TBuf<TPosition::VECCALC> buf;
    pipe.InitBuffer(buf, 64 * sizeof(float));
    LocalTensor<float> t = buf.Get<float>();
    Duplicate(t, 2.0f, 64);
    float v = t.GetValue(3);
    (void)v;
}

// A scalar store into a tensor a vector instruction still reads: the write needs the vector
// unit done with it first (V_S), as the auto-sync example of 关键特性说明.md inserts.
extern "C" __global__ __aicore__ void twin_unsynced_scalar_write_after_vector_read(GM_ADDR x, GM_ADDR y)
{
    (void)x;
    (void)y;
    TPipe pipe;
    TBuf<TPosition::VECCALC> a, b;
    pipe.InitBuffer(a, 64 * sizeof(float));
    pipe.InitBuffer(b, 64 * sizeof(float));
    LocalTensor<float> src = a.Get<float>(), dst = b.Get<float>();
    for (int i = 0; i < 64; ++i) src.SetValue(i, 2.0f);
    SetFlag<HardEvent::S_V>(EVENT_ID0);
    WaitFlag<HardEvent::S_V>(EVENT_ID0);
    Adds(dst, src, 1.0f, 64);
    src.SetValue(3, 0.0f);
}

// Every block writes y[0 .. 8): two blocks write the same GM bytes.
extern "C" __global__ __aicore__ void twin_two_blocks_one_range(GM_ADDR x, GM_ADDR y)
{
    (void)x;
    GlobalTensor<float> yg;
    yg.SetGlobalBuffer(reinterpret_cast<__gm__ float *>(y));
    TPipe pipe;
    TBuf<TPosition::VECCALC> buf;
    pipe.InitBuffer(buf, 8 * sizeof(float));
    LocalTensor<float> t = buf.Get<float>();
    Duplicate(t, static_cast<float>(GetBlockIdx()), 8);
    SetFlag<HardEvent::V_MTE3>(EVENT_ID0);
    WaitFlag<HardEvent::V_MTE3>(EVENT_ID0);
    DataCopyPad(yg, t, DataCopyExtParams{1, 8 * sizeof(float), 0, 0, 0});
}

// A vector instruction reads the previous one's result without PipeBarrier<PIPE_V>.
extern "C" __global__ __aicore__ void twin_vector_chain_without_barrier(GM_ADDR x, GM_ADDR y)
{
    (void)x;
    (void)y;
    TPipe pipe;
    TBuf<TPosition::VECCALC> a, b;
    pipe.InitBuffer(a, 64 * sizeof(float));
    pipe.InitBuffer(b, 64 * sizeof(float));
    LocalTensor<float> ta = a.Get<float>(), tb = b.Get<float>();
    Duplicate(ta, 1.0f, 64);
    Muls(tb, ta, 2.0f, 64);
}

// A SetFlag nobody waits for.
extern "C" __global__ __aicore__ void twin_set_flag_unpaired(GM_ADDR x, GM_ADDR y)
{
    (void)x;
    (void)y;
    SetFlag<HardEvent::V_S>(EVENT_ID1);
}

// A vector operand at an address that is not 32-byte aligned.
extern "C" __global__ __aicore__ void twin_unaligned_operand(GM_ADDR x, GM_ADDR y)
{
    (void)x;
    (void)y;
    TPipe pipe;
    TBuf<TPosition::VECCALC> buf;
    pipe.InitBuffer(buf, 64 * sizeof(float));
    LocalTensor<float> t = buf.Get<float>();
    Duplicate(t[1], 0.0f, 8);
}

// A scalar GM read without DataCacheCleanAndInvalid of its line.
extern "C" __global__ __aicore__ void twin_stale_scalar_read(GM_ADDR x, GM_ADDR y)
{
    (void)y;
    GlobalTensor<float> xg;
    xg.SetGlobalBuffer(reinterpret_cast<__gm__ float *>(x));
    float v = xg.GetValue(0);
    (void)v;
}

// A copy past the end of y (64 floats).
extern "C" __global__ __aicore__ void twin_gm_out_of_bounds(GM_ADDR x, GM_ADDR y)
{
    (void)x;
    GlobalTensor<float> yg;
    yg.SetGlobalBuffer(reinterpret_cast<__gm__ float *>(y));
    TPipe pipe;
    TBuf<TPosition::VECCALC> buf;
    pipe.InitBuffer(buf, 64 * sizeof(float));
    LocalTensor<float> t = buf.Get<float>();
    Duplicate(t, 0.0f, 64);
    SetFlag<HardEvent::V_MTE3>(EVENT_ID0);
    WaitFlag<HardEvent::V_MTE3>(EVENT_ID0);
    DataCopyPad(yg[32], t, DataCopyExtParams{1, 64 * sizeof(float), 0, 0, 0});
}

// A queue tensor allocated and never freed.
extern "C" __global__ __aicore__ void twin_alloc_without_free(GM_ADDR x, GM_ADDR y)
{
    (void)x;
    (void)y;
    TPipe pipe;
    TQue<QuePosition::VECOUT, 1> out;
    pipe.InitBuffer(out, 1, 64 * sizeof(float));
    LocalTensor<float> t = out.AllocTensor<float>();
    (void)t;
}

// Block 0 writes y[0 .. 8) while block 1 reads it: a race between cores.
extern "C" __global__ __aicore__ void twin_block_reads_another_blocks_output(GM_ADDR x, GM_ADDR y)
{
    (void)x;
    GlobalTensor<float> yg;
    yg.SetGlobalBuffer(reinterpret_cast<__gm__ float *>(y));
    TPipe pipe;
    TBuf<TPosition::VECCALC> buf;
    pipe.InitBuffer(buf, 8 * sizeof(float));
    LocalTensor<float> t = buf.Get<float>();
    if (GetBlockIdx() == 0) {
        Duplicate(t, 1.0f, 8);
        SetFlag<HardEvent::V_MTE3>(EVENT_ID0);
        WaitFlag<HardEvent::V_MTE3>(EVENT_ID0);
        DataCopyPad(yg, t, DataCopyExtParams{1, 8 * sizeof(float), 0, 0, 0});
    } else {
        DataCopyPad(t, yg, DataCopyExtParams{1, 8 * sizeof(float), 0, 0, 0}, DataCopyPadExtParams<float>{false, 0, 0, 0});
    }
}
