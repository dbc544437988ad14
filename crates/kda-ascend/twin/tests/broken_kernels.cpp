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

// ---- Gather (count form) and Cast's per-SoC tables ----

// UB for the Gather kernels: a `table_bytes` table of T (every value 1), 64 byte offsets (each
// `offset`) and a 64-value destination, all written and ordered before the Gather.
template <typename T>
struct GatherUb {
    TPipe pipe;
    TBuf<TPosition::VECCALC> tb, ob, db;
    LocalTensor<T> table, dst;
    LocalTensor<uint32_t> offsets;

    GatherUb(uint32_t table_bytes, uint32_t offset)
    {
        pipe.InitBuffer(tb, table_bytes);
        pipe.InitBuffer(ob, 64 * sizeof(uint32_t));
        pipe.InitBuffer(db, 64 * sizeof(T));
        table = tb.Get<T>();
        offsets = ob.Get<uint32_t>();
        dst = db.Get<T>();
        Duplicate(table, T(1), static_cast<int32_t>(table_bytes / sizeof(T)));
        Duplicate(offsets, offset, 64);
        PipeBarrier<PIPE_V>();
    }
};

// A correct Gather (the control): y[i] = x[63 - i] through a table of x and byte offsets the
// scalar unit writes, on A2 and on the 950.
extern "C" __global__ __aicore__ void twin_gather_ok(GM_ADDR x, GM_ADDR y)
{
    if (GetBlockIdx() != 0) return;
    GlobalTensor<float> xg, yg;
    xg.SetGlobalBuffer(reinterpret_cast<__gm__ float *>(x));
    yg.SetGlobalBuffer(reinterpret_cast<__gm__ float *>(y));
    TPipe pipe;
    TBuf<TPosition::VECCALC> tb, ob, db;
    pipe.InitBuffer(tb, 64 * sizeof(float));
    pipe.InitBuffer(ob, 64 * sizeof(uint32_t));
    pipe.InitBuffer(db, 64 * sizeof(float));
    LocalTensor<float> table = tb.Get<float>(), dst = db.Get<float>();
    LocalTensor<uint32_t> offsets = ob.Get<uint32_t>();
    DataCopy(table, xg, 64);
    for (uint32_t i = 0; i < 64; ++i) offsets.SetValue(i, (63 - i) * 4);
    SetFlag<HardEvent::MTE2_V>(EVENT_ID0);
    WaitFlag<HardEvent::MTE2_V>(EVENT_ID0);
    SetFlag<HardEvent::S_V>(EVENT_ID0);
    WaitFlag<HardEvent::S_V>(EVENT_ID0);
    Gather(dst, table, offsets, 0, 64);
    SetFlag<HardEvent::V_MTE3>(EVENT_ID0);
    WaitFlag<HardEvent::V_MTE3>(EVENT_ID0);
    DataCopy(yg, dst, 64);
}

// Gather of uint8_t: a 950 type only (count form), not A2/A3's.
extern "C" __global__ __aicore__ void twin_gather_u8(GM_ADDR, GM_ADDR)
{
    GatherUb<uint8_t> u(64, 3);
    Gather(u.dst, u.table, u.offsets, 0, 64);
}

// Gather whose destination is its table: dst and src share memory.
extern "C" __global__ __aicore__ void twin_gather_into_its_table(GM_ADDR, GM_ADDR)
{
    GatherUb<float> u(64 * sizeof(float), 4);
    Gather(u.table, u.table, u.offsets, 0, 64);
}

// A byte offset of 6 into a table of f32: not a multiple of sizeof(T).
extern "C" __global__ __aicore__ void twin_gather_unaligned_offset(GM_ADDR, GM_ADDR)
{
    GatherUb<float> u(64 * sizeof(float), 6);
    Gather(u.dst, u.table, u.offsets, 0, 64);
}

// A byte offset of 256 into a table of 64 f32: the element lies past src.
extern "C" __global__ __aicore__ void twin_gather_offset_past_src(GM_ADDR, GM_ADDR)
{
    GatherUb<float> u(64 * sizeof(float), 256);
    Gather(u.dst, u.table, u.offsets, 0, 64);
}

// srcBaseAddr 2 into a table of f32: not a multiple of sizeof(T).
extern "C" __global__ __aicore__ void twin_gather_unaligned_base(GM_ADDR, GM_ADDR)
{
    GatherUb<float> u(64 * sizeof(float), 0);
    Gather(u.dst, u.table, u.offsets, 2, 64);
}

// srcBaseAddr 256 into a table of 64 f32: past src.
extern "C" __global__ __aicore__ void twin_gather_base_past_src(GM_ADDR, GM_ADDR)
{
    GatherUb<float> u(64 * sizeof(float), 0);
    Gather(u.dst, u.table, u.offsets, 256, 64);
}

// A table at an address that is not 32-byte aligned.
extern "C" __global__ __aicore__ void twin_gather_unaligned_table(GM_ADDR, GM_ADDR)
{
    GatherUb<float> u(64 * sizeof(float), 0);
    Gather(u.dst, u.table[1], u.offsets, 0, 64);
}

// A count past the 64 offsets.
extern "C" __global__ __aicore__ void twin_gather_count_past_offsets(GM_ADDR, GM_ADDR)
{
    GatherUb<float> u(64 * sizeof(float), 0);
    TBuf<TPosition::VECCALC> big;
    u.pipe.InitBuffer(big, 128 * sizeof(float));
    LocalTensor<float> wide = big.Get<float>();
    Gather(wide, u.table, u.offsets, 0, 128);
}

// 16384 f32 in one count-form Gather: 256 repeats of 64, past A2/A3's 8-bit repeat count (the
// 950 takes it).
extern "C" __global__ __aicore__ void twin_gather_256_repeats(GM_ADDR x, GM_ADDR y)
{
    (void)x;
    (void)y;
    TPipe pipe;
    TBuf<TPosition::VECCALC> tb, ob, db;
    pipe.InitBuffer(tb, 64 * sizeof(float));
    pipe.InitBuffer(ob, 16384 * sizeof(uint32_t));
    pipe.InitBuffer(db, 16384 * sizeof(float));
    LocalTensor<float> table = tb.Get<float>(), dst = db.Get<float>();
    LocalTensor<uint32_t> offsets = ob.Get<uint32_t>();
    Duplicate(table, 1.0f, 64);
    Duplicate(offsets, 4u, 16384);
    PipeBarrier<PIPE_V>();
    Gather(dst, table, offsets, 0, 16384);
}

// A count of 0: a NOP on A2/A3, not guaranteed one on the 950.
extern "C" __global__ __aicore__ void twin_gather_count_zero(GM_ADDR, GM_ADDR)
{
    GatherUb<float> u(64 * sizeof(float), 0);
    Gather(u.dst, u.table, u.offsets, 0, 0);
}

// A 16-bit table of 70000 values and byte offsets of 131072: past the 950's 16-bit offset range
// (2^17 - 1), inside the table (A2/A3 take it).
extern "C" __global__ __aicore__ void twin_gather_16bit_offset_range(GM_ADDR, GM_ADDR)
{
    GatherUb<half> u(70000 * sizeof(half), 131072);
    Gather(u.dst, u.table, u.offsets, 0, 64);
}

// A table the scalar unit writes, gathered without S_V between.
extern "C" __global__ __aicore__ void twin_gather_of_a_scalar_table_without_a_flag(GM_ADDR, GM_ADDR)
{
    GatherUb<float> u(64 * sizeof(float), 8);
    SetFlag<HardEvent::V_S>(EVENT_ID0);
    WaitFlag<HardEvent::V_S>(EVENT_ID0);
    u.table.SetValue(2, 5.0f);
    Gather(u.dst, u.table, u.offsets, 0, 64);
}

// uint8_t -> uint32_t: a pair Cast lists for the 950 only.
extern "C" __global__ __aicore__ void twin_cast_u8_to_u32(GM_ADDR x, GM_ADDR y)
{
    (void)x;
    (void)y;
    TPipe pipe;
    TBuf<TPosition::VECCALC> a, b;
    pipe.InitBuffer(a, 64);
    pipe.InitBuffer(b, 64 * sizeof(uint32_t));
    LocalTensor<uint8_t> src = a.Get<uint8_t>();
    LocalTensor<uint32_t> dst = b.Get<uint32_t>();
    Duplicate(src.ReinterpretCast<uint16_t>(), uint16_t(0x0101), 32);
    PipeBarrier<PIPE_V>();
    Cast(dst, src, RoundMode::CAST_NONE, 64);
}

// half -> int32_t under CAST_NONE: the pair is listed, that round mode is not.
extern "C" __global__ __aicore__ void twin_cast_half_to_int32_none(GM_ADDR x, GM_ADDR y)
{
    (void)x;
    (void)y;
    TPipe pipe;
    TBuf<TPosition::VECCALC> a, b;
    pipe.InitBuffer(a, 64 * sizeof(half));
    pipe.InitBuffer(b, 64 * sizeof(int32_t));
    LocalTensor<half> src = a.Get<half>();
    LocalTensor<int32_t> dst = b.Get<int32_t>();
    Duplicate(src, half(3.0f), 64);
    PipeBarrier<PIPE_V>();
    Cast(dst, src, RoundMode::CAST_NONE, 64);
}

// f32 3e9 -> int32_t: outside the destination's range.
extern "C" __global__ __aicore__ void twin_cast_out_of_range(GM_ADDR x, GM_ADDR y)
{
    (void)x;
    (void)y;
    TPipe pipe;
    TBuf<TPosition::VECCALC> a, b;
    pipe.InitBuffer(a, 64 * sizeof(float));
    pipe.InitBuffer(b, 64 * sizeof(int32_t));
    LocalTensor<float> src = a.Get<float>();
    LocalTensor<int32_t> dst = b.Get<int32_t>();
    Duplicate(src, 3e9f, 64);
    PipeBarrier<PIPE_V>();
    Cast(dst, src, RoundMode::CAST_RINT, 64);
}

// half 3.5 -> int32_t under CAST_RINT, back to f32 into y: 4 (ties to even; truncation would
// give 3), on A2 and the 950.
extern "C" __global__ __aicore__ void twin_cast_rint_ok(GM_ADDR x, GM_ADDR y)
{
    (void)x;
    if (GetBlockIdx() != 0) return;
    GlobalTensor<float> yg;
    yg.SetGlobalBuffer(reinterpret_cast<__gm__ float *>(y));
    TPipe pipe;
    TBuf<TPosition::VECCALC> a, b, c;
    pipe.InitBuffer(a, 64 * sizeof(half));
    pipe.InitBuffer(b, 64 * sizeof(int32_t));
    pipe.InitBuffer(c, 64 * sizeof(float));
    LocalTensor<half> src = a.Get<half>();
    LocalTensor<int32_t> mid = b.Get<int32_t>();
    LocalTensor<float> out = c.Get<float>();
    Duplicate(src, half(3.5f), 64);
    PipeBarrier<PIPE_V>();
    Cast(mid, src, RoundMode::CAST_RINT, 64);
    PipeBarrier<PIPE_V>();
    Cast(out, mid, RoundMode::CAST_RINT, 64);
    SetFlag<HardEvent::V_MTE3>(EVENT_ID0);
    WaitFlag<HardEvent::V_MTE3>(EVENT_ID0);
    DataCopy(yg, out, 64);
}
