// MXFP8 dequantization for chips without MX GEMMs (the A2/A3 emulation path):
//   y[r, c] = decode_e4m3(data[r, c]) * 2^(scale[r, c / 32] - 127), rounded once to y's dtype.
// E4M3FN: sign, 4 exponent bits (bias 7), 3 mantissa bits; 0x7f/0xff are NaN; subnormals at
// exponent 0. E8M0 0xff is NaN. Units: rows.
#include "kda_kernel_abi.h"

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
    uint32_t bits = ((e + 120u) << 23) | (m << 20);                   // rebias 7 → 127
    float v = *reinterpret_cast<float *>(&bits);
    return sign * v;
}

__aicore__ inline float decode_e8m0(uint8_t s)
{
    if (s == 0xff) return __builtin_nanf("");
    if (s == 0) return 5.877471754111438e-39f;  // 2^-127, an f32 subnormal
    uint32_t bits = static_cast<uint32_t>(s) << 23;
    return *reinterpret_cast<float *>(&bits);
}

template <typename T>
__aicore__ inline void dequant(const MxDequantArgs &a)
{
    uint32_t start, count;
    kda_share(a.h.tiling, start, count);
    const int64_t k = a.data.shape[1];
    GlobalTensor<uint8_t> data, scale;
    GlobalTensor<T> y;
    data.SetGlobalBuffer(kda_gm<uint8_t>(a.data));
    scale.SetGlobalBuffer(kda_gm<uint8_t>(a.scale));
    y.SetGlobalBuffer(kda_gm<T>(a.y));
    for (uint32_t row = start; row < start + count; ++row) {
        for (int64_t c = 0; c < k; ++c) {
            float f = decode_e8m0(scale.GetValue(row * a.scale.strides[0] + (c / 32) * a.scale.strides[1]));
            float v = decode_e4m3(data.GetValue(row * a.data.strides[0] + c * a.data.strides[1])) * f;
            y.SetValue(row * a.y.strides[0] + c * a.y.strides[1], static_cast<T>(v));
        }
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
