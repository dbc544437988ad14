// MXFP8 dequantization for chips without MX GEMMs (the A2/A3 emulation path):
//   y[r, c] = decode_e4m3(data[r, c]) * 2^(scale[r, c / 32] - 127), rounded once to y's dtype.
// E4M3FN: sign, 4 exponent bits (bias 7), 3 mantissa bits; 0x7f/0xff are NaN; subnormals at
// exponent 0. E8M0 0xff is NaN. Units: rows.
#include "kda_kernel_util.h"

using namespace AscendC;

struct MxDequantArgs {
    ArgsHeader h;
    GmTensor data;   // [M, K] e4m3 bytes
    GmTensor scale;  // [M, ceil(K/32)] e8m0 bytes
    GmTensor y;      // [M, K] bf16 or f32
};

__aicore__ inline float decode_e4m3(uint8_t q)
{
    const float sign = (q & 0x80) ? -1.0f : 1.0f;
    const uint32_t e = (q >> 3) & 0xf, m = q & 0x7;
    if (e == 0xf && m == 0x7) return sign * __builtin_nanf("");
    if (e == 0) return sign * static_cast<float>(m) * 0.001953125f;  // m * 2^-9
    return sign * kda_f32_from_bits(((e + 120u) << 23) | (m << 20));  // rebias 7 → 127
}

__aicore__ inline float decode_e8m0(uint8_t s)
{
    if (s == 0xff) return __builtin_nanf("");
    if (s == 0) return 5.877471754111438e-39f;  // 2^-127, an f32 subnormal
    return kda_f32_from_bits(static_cast<uint32_t>(s) << 23);
}

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
    // DataCopyPad; the decode itself is scalar on UB. No scalar GM writes: two cores' rows may
    // share a 64-byte line of y.
    TPipe pipe;
    TBuf<TPosition::VECCALC> db, sb, yb;
    pipe.InitBuffer(db, kda_pitch(k, 1));
    pipe.InitBuffer(sb, kda_pitch(blocks, 1));
    pipe.InitBuffer(yb, kda_pitch(k, sizeof(T)) * sizeof(T));
    LocalTensor<uint8_t> dl = db.Get<uint8_t>(), sl = sb.Get<uint8_t>();
    LocalTensor<T> yl = yb.Get<T>();
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
        SetFlag<HardEvent::MTE2_S>(EVENT_ID0);
        WaitFlag<HardEvent::MTE2_S>(EVENT_ID0);
        // The previous row's store has read yl before it is written again.
        SetFlag<HardEvent::MTE3_S>(EVENT_ID0);
        WaitFlag<HardEvent::MTE3_S>(EVENT_ID0);
        for (int64_t c = 0; c < k; ++c) {
            float v = decode_e4m3(dl.GetValue(c)) * decode_e8m0(sl.GetValue(c / 32));
            if constexpr (IsSameType<T, bfloat16_t>::value) {
                // float -> bf16 on the scalar unit is AscendC's scalar Cast, which rounds to
                // nearest even (CAST_RINT) as the reference does
                // (asc-devkit/docs/zh/api/SIMD-API/基础API/标量计算/Cast（float转bfloat16_t）.md); a plain
                // static_cast leaves the rounding to the compiler.
                yl.SetValue(c, AscendC::Cast(v));
            } else {
                yl.SetValue(c, v);
            }
        }
        SetFlag<HardEvent::S_MTE3>(EVENT_ID0);
        WaitFlag<HardEvent::S_MTE3>(EVENT_ID0);
        DataCopyPad(y[row * a.y.strides[0]], yl, DataCopyExtParams{1, static_cast<uint32_t>(k * sizeof(T)), 0, 0, 0});
        // The next row's loads overwrite dl and sl, which the scalar unit has finished reading.
        SetFlag<HardEvent::S_MTE2>(EVENT_ID0);
        WaitFlag<HardEvent::S_MTE2>(EVENT_ID0);
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
