// MXFP8 dequantization for chips without MX GEMMs (the A2/A3 emulation path):
//   y[r, c] = decode_e4m3(data[r, c]) * 2^(scale[r, c / 32] - 127), rounded once to y's dtype.
// E4M3FN: sign, 4 exponent bits (bias 7), 3 mantissa bits; 0x7f/0xff are NaN; subnormals at
// exponent 0. E8M0 0xff is NaN. The product is exact but for its one rounding to f32 (the
// reference's, crates/kda-core mx::dequantize_value; docs/design/mxfp8.md), then to bf16. Units:
// rows.
#include "kda_kernel_util.h"

using namespace AscendC;

struct MxDequantArgs {
    ArgsHeader h;
    GmTensor data;   // [M, K] e4m3 bytes
    GmTensor scale;  // [M, ceil(K/32)] e8m0 bytes
    GmTensor y;      // [M, K] bf16 or f32
};

// The f32 bits of an E4M3 byte, built from its fields without floating-point arithmetic (so no
// rounding and no subnormal operand on the scalar unit): normal codes rebias 7 -> 127; the
// subnormal codes m * 2^-9 (m = 1..7) are normal f32 values.
__aicore__ inline uint32_t e4m3_bits(uint8_t q)
{
    const uint32_t sign = static_cast<uint32_t>(q & 0x80) << 24;
    const uint32_t e = (q >> 3) & 0xf, m = q & 0x7;
    if (e == 0xf && m == 0x7) return sign | 0x7fc00000u;  // NaN
    if (e != 0) return sign | ((e + 120u) << 23) | (m << 20);
    if (m == 0) return sign;  // +-0
    const uint32_t p = m >= 4 ? 2 : (m >= 2 ? 1 : 0);  // m = 2^p * 1.f
    return sign | ((p + 118u) << 23) | ((m ^ (1u << p)) << (23 - p));
}

// y = x * 2^(s - 127) over `n` f32 on the vector unit, rounded once as the reference's one f32
// product: a scale below 2^-63 (s < 64; 2^-127 is an f32 subnormal) is applied as
// 2^(s - 63) (exact: an E4M3 value has 4 significant bits and stays in f32's normal range)
// then 2^-64 (the one rounding), so no factor is subnormal; the NaN scale gives NaN.
__aicore__ inline void scale_block(const LocalTensor<float> &x, uint8_t s, int32_t n)
{
    if (s == 0xff) {
        Muls(x, x, kda_f32_from_bits(0x7fc00000u), n);
    } else if (s < 64) {
        Muls(x, x, kda_f32_from_bits((static_cast<uint32_t>(s) + 64u) << 23), n);
        PipeBarrier<PIPE_V>();
        Muls(x, x, kda_f32_from_bits(63u << 23), n);  // 2^-64
    } else {
        Muls(x, x, kda_f32_from_bits(static_cast<uint32_t>(s) << 23), n);
    }
}

// Gather's count form on A2/A3 issues its 64-value f32 repeats with an 8-bit repeat count
// (mirror-cann/asc-devkit/docs/zh/api/SIMD-API/基础API/Memory矢量计算/离散与聚合/Gather.md,
// 约束说明: repeatTime in [0, 255]): longer rows are gathered in pieces of 255 repeats.
constexpr int64_t kGatherPiece = 255 * 64;

template <typename T>
__aicore__ inline void dequant(const MxDequantArgs &a)
{
    uint32_t start, count;
    kda_share(a.h.tiling, start, count);
    const int64_t k = a.data.shape[1], blocks = (k + 31) / 32;
    GlobalTensor<uint8_t> data, scale;
    GlobalTensor<T> y;
    data.SetGlobalBuffer(kda_gm<uint8_t>(a.data));
    scale.SetGlobalBuffer(kda_gm<uint8_t>(a.scale));
    y.SetGlobalBuffer(kda_gm<T>(a.y));
    // A row moves GM -> UB (data and scale bytes) and UB -> GM (the decoded row) through
    // DataCopyPad; the vector unit decodes, scales each 32-value block and rounds to y's dtype.
    // No scalar GM writes: two cores' rows may share a 64-byte line of y.
    //
    // The decode is a table lookup on the vector unit: the scalar unit writes the f32 value of
    // each of the 256 codes once per core (e4m3_bits: 256 scalar writes, not one per element),
    // and each row's codes become byte offsets into that table — uint8 -> half (exact for
    // 0..255), x4 in half (exact up to 1020), half -> int32 (CAST_RINT of an integer) — from
    // which Gather picks the values. The 950 also has a direct fp8_e4m3fn_t -> float Cast,
    // A2/A3 do not; these two casts and an f32 Gather are listed for both (数据类型 of
    // mirror-cann/asc-devkit/docs/zh/api/SIMD-API/基础API/Memory矢量计算/类型转换/Cast.md and
    // of mirror-cann/asc-devkit/docs/zh/api/SIMD-API/基础API/Memory矢量计算/离散与聚合/Gather.md),
    // so one path serves both chips, and its NaN bits are the table's, as the reference's. The
    // codes widen to half inside the row's f32 buffer (2 of its 4 bytes per value), which the
    // Gather then overwrites.
    TPipe pipe;
    TBuf<TPosition::VECCALC> tb, db, sb, ob, fb, yb;
    pipe.InitBuffer(tb, 256 * sizeof(float));
    pipe.InitBuffer(db, kda_pitch(k, 1));
    pipe.InitBuffer(sb, kda_pitch(blocks, 1));
    pipe.InitBuffer(ob, kda_pitch(k, sizeof(int32_t)) * sizeof(int32_t));
    pipe.InitBuffer(fb, kda_pitch(k, sizeof(float)) * sizeof(float));
    pipe.InitBuffer(yb, IsSameType<T, float>::value ? 32 : kda_pitch(k, sizeof(T)) * sizeof(T));
    LocalTensor<float> tl = tb.Get<float>(), fl = fb.Get<float>();
    LocalTensor<uint8_t> dl = db.Get<uint8_t>(), sl = sb.Get<uint8_t>();
    LocalTensor<int32_t> ol = ob.Get<int32_t>();
    LocalTensor<half> hl = fl.ReinterpretCast<half>();
    LocalTensor<T> yl = yb.Get<T>();
    for (uint32_t q = 0; q < 256; ++q) tl.SetValue(q, kda_f32_from_bits(e4m3_bits(static_cast<uint8_t>(q))));
    SetFlag<HardEvent::S_V>(EVENT_ID0);
    WaitFlag<HardEvent::S_V>(EVENT_ID0);
    DataCopyPadExtParams<uint8_t> no_pad{false, 0, 0, 0};
    for (uint32_t row = start; row < start + count; ++row) {
        // The scale row may be strided ([M, ceil(K/64), 2] memory): blocks of one byte each
        // would pad to 32 bytes in UB, so a strided scale row is read byte by byte instead.
        DataCopyPad(dl, data[row * a.data.strides[0]], DataCopyExtParams{1, static_cast<uint32_t>(k), 0, 0, 0}, no_pad);
        if (a.scale.strides[1] == 1) {
            DataCopyPad(sl, scale[row * a.scale.strides[0]], DataCopyExtParams{1, static_cast<uint32_t>(blocks), 0, 0, 0}, no_pad);
        } else {
            for (int64_t j = 0; j < blocks; ++j) {
                sl.SetValue(j, kda_read(scale, row * a.scale.strides[0] + j * a.scale.strides[1]));
            }
        }
        SetFlag<HardEvent::MTE2_V>(EVENT_ID0);
        WaitFlag<HardEvent::MTE2_V>(EVENT_ID0);
        SetFlag<HardEvent::MTE2_S>(EVENT_ID0);
        WaitFlag<HardEvent::MTE2_S>(EVENT_ID0);
        Cast(hl, dl, RoundMode::CAST_NONE, k);
        PipeBarrier<PIPE_V>();
        Muls(hl, hl, half(4.0f), k);
        PipeBarrier<PIPE_V>();
        Cast(ol, hl, RoundMode::CAST_RINT, k);
        PipeBarrier<PIPE_V>();
        const LocalTensor<uint32_t> offsets = ol.ReinterpretCast<uint32_t>();
        for (int64_t c = 0; c < k; c += kGatherPiece) {
            const int64_t n = k - c < kGatherPiece ? k - c : kGatherPiece;
            Gather(fl[c], tl, offsets[c], 0, static_cast<uint32_t>(n));
        }
        PipeBarrier<PIPE_V>();
        // The last block may be partial: only its live values are scaled.
        for (int64_t j = 0; j < blocks; ++j) {
            const int64_t n = k - j * 32 < 32 ? k - j * 32 : 32;
            scale_block(fl[j * 32], sl.GetValue(j), static_cast<int32_t>(n));
        }
        PipeBarrier<PIPE_V>();
        if constexpr (IsSameType<T, float>::value) {
            SetFlag<HardEvent::V_MTE3>(EVENT_ID0);
            WaitFlag<HardEvent::V_MTE3>(EVENT_ID0);
            DataCopyPad(y[row * a.y.strides[0]], fl, DataCopyExtParams{1, static_cast<uint32_t>(k * sizeof(T)), 0, 0, 0});
        } else {
            // f32 -> bf16 rounds to nearest even, as the reference's conversion does.
            Cast(yl, fl, RoundMode::CAST_RINT, k);
            SetFlag<HardEvent::V_MTE3>(EVENT_ID0);
            WaitFlag<HardEvent::V_MTE3>(EVENT_ID0);
            DataCopyPad(y[row * a.y.strides[0]], yl, DataCopyExtParams{1, static_cast<uint32_t>(k * sizeof(T)), 0, 0, 0});
        }
        // The next row's loads overwrite dl, which the vector unit has finished reading, and
        // sl, which the scalar unit has; its first Cast overwrites fl (and the next bf16 Cast
        // yl), which this store reads.
        SetFlag<HardEvent::V_MTE2>(EVENT_ID0);
        WaitFlag<HardEvent::V_MTE2>(EVENT_ID0);
        SetFlag<HardEvent::S_MTE2>(EVENT_ID0);
        WaitFlag<HardEvent::S_MTE2>(EVENT_ID0);
        SetFlag<HardEvent::MTE3_V>(EVENT_ID0);
        WaitFlag<HardEvent::MTE3_V>(EVENT_ID0);
    }
}

extern "C" __global__ __aicore__ void kda_mx_dequant(GM_ADDR data, GM_ADDR scale, GM_ADDR y, GM_ADDR meta)
{
    KDA_VECTOR_KERNEL();
    MxDequantArgs args;
    GM_ADDR tensors[] = {data, scale, y};
    kda_load_args(args, meta, tensors, 3);
    if (args.y.dtype == KDA_BF16) {
        dequant<bfloat16_t>(args);
    } else {
        dequant<float>(args);
    }
}
