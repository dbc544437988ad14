// MXFP8 (kda_core::mx, docs/design/mxfp8.md): dynamic quantization bit for bit as the codec,
// dequantization, and the MX GEMM in the order kda_core::mx::gemm defines. Hopper has no MX
// hardware, so the GEMM sums exact block products in f64 (exact in any order) and accumulates
// blocks in f32.

#define E4M3_NAN 0x7F
#define E8M0_NAN 0xFF
#define EMAX_ELEM 8
#define SATURATE_FROM 0x43E80000u
#define SMALLEST_NORMAL 0x3C800000u
#define SUBNORMAL_GRID_BITS 0x46800000u
#define REBIAS (120u << 3)

// The E4M3 magnitude byte of a non-NaN f32 whose bits without sign are `abs`
// (kda_core::mx::e4m3::encode_magnitude): nearest even, saturating at 448.
__device__ __forceinline__ u32 encode_magnitude(u32 abs) {
    if (abs >= SATURATE_FROM) return 0x7E;
    if (abs < SMALLEST_NORMAL) {
        // The FPU rounds onto the 2^-9 grid (ulp of 2^14): the count of steps is the byte.
        return __float_as_uint(__fadd_rn(__uint_as_float(abs), 16384.0f)) - SUBNORMAL_GRID_BITS;
    }
    u32 rounded = abs + 0x7FFFFu + ((abs >> 20) & 1u);
    return (rounded >> 20) - REBIAS;
}

// The E8M0 byte of the smallest power of two at least |s| (kda_core::mx::e8m0_round_up).
__device__ __forceinline__ u32 e8m0_round_up(float s) {
    u32 bits = __float_as_uint(s) & 0x7FFFFFFFu;
    u32 exp = bits >> 23, man = bits & 0x7FFFFFu;
    if (exp == 0) return man > 0x400000u ? 1u : 0u;
    if (exp == 255) return 255u;
    return exp + (man != 0 ? 1u : 0u);
}

// The E8M0 scale byte of a finite block whose largest magnitude has the bits `amax`: alg 0
// OCP floor (amax's exponent minus E4M3's emax), 1 round up (amax / 448, rounded up to a power of
// two).
__device__ __forceinline__ u32 scale_byte(u32 amax, int alg) {
    if (alg == 0) {
        u32 e = amax >> 23;
        return e > EMAX_ELEM ? e - EMAX_ELEM : 0;
    }
    return e8m0_round_up(__fmul_rn(__uint_as_float(amax), 1.0f / 448.0f));
}

// 2^(127 - b) as f32 (b at most 254).
__device__ __forceinline__ float inverse_scale(u32 b) {
    if (b >= 254) return __uint_as_float(0x00400000u);
    return __uint_as_float((254u - b) << 23);
}

__device__ __forceinline__ float decode_e4m3(u32 b) {
    u32 sign = (b & 0x80u) << 24;
    u32 exp = (b >> 3) & 0xFu, man = b & 7u;
    if (exp == 15 && man == 7) return __uint_as_float(sign | 0x7FC00000u);
    if (exp == 0) {
        // man * 2^-9, exact in f32.
        float v = __fmul_rn((float)man, 0.001953125f);
        return __uint_as_float(sign | __float_as_uint(v));
    }
    return __uint_as_float(sign | ((exp + 120u) << 23) | (man << 20));
}

__device__ __forceinline__ float decode_e8m0(u32 b) {
    if (b == 0) return __uint_as_float(0x00400000u);
    if (b == E8M0_NAN) return __int_as_float(0x7FC00000);
    return __uint_as_float(b << 23);
}

__device__ __forceinline__ double decode_e8m0_f64(u32 b) {
    if (b == E8M0_NAN) return __longlong_as_double(0x7FF8000000000000ll);
    return __longlong_as_double((long long)(b + 1023 - 127) << 52);
}

__device__ __forceinline__ u32 ld_bits(const View& v, i64 off) {
    return v.dtype == DT_F32 ? ((const u32*)v.ptr)[off] : ((u32)((const u16*)v.ptr)[off]) << 16;
}

// One thread per (row, block of 32): x [m, k] (bf16 or f32) to E4M3 data and E8M0 scale.
// alg 0: OCP floor, 1: round up (kda_core::mx::ScaleAlg).
extern "C" __global__ void kda_dynamic_quant(const Status* status, View x, View data, View scale,
                                             i64 m, i64 k, int alg) {
    if (stream_failed(status)) return;
    i64 blocks = (k + 31) / 32;
    for (i64 i = global_thread(); i < m * blocks; i += grid_threads()) {
        i64 row = i / blocks, blk = i % blocks;
        i64 k0 = blk * 32, len = k - k0 < 32 ? k - k0 : 32;
        u32 bits[32];
        u32 amax = 0;
        for (int j = 0; j < len; ++j) {
            bits[j] = ld_bits(x, row * x.strides[0] + (k0 + j) * x.strides[1]);
            u32 a = bits[j] & 0x7FFFFFFFu;
            amax = a > amax ? a : amax;
        }
        u8* d = (u8*)data.ptr;
        i64 drow = row * data.strides[0];
        u32 sbyte;
        if (amax >= 0x7F800000u) {
            sbyte = E8M0_NAN;
            for (int j = 0; j < len; ++j) d[drow + (k0 + j) * data.strides[1]] = E4M3_NAN;
        } else {
            sbyte = scale_byte(amax, alg);
            float inv = inverse_scale(sbyte);
            for (int j = 0; j < len; ++j) {
                u32 v = __float_as_uint(__fmul_rn(__uint_as_float(bits[j]), inv));
                u32 q = ((v >> 24) & 0x80u) | encode_magnitude(v & 0x7FFFFFFFu);
                d[drow + (k0 + j) * data.strides[1]] = (u8)q;
            }
        }
        ((u8*)scale.ptr)[row * scale.strides[0] + blk * scale.strides[1]] = (u8)sbyte;
    }
}

// y[m, k] = decode(q) * 2^(s - 127), exact in f32, rounded once to y's dtype.
extern "C" __global__ void kda_mx_dequant(const Status* status, View data, View scale, View y,
                                          i64 m, i64 k) {
    if (stream_failed(status)) return;
    for (i64 i = global_thread(); i < m * k; i += grid_threads()) {
        i64 row = i / k, col = i % k;
        u32 q = ((const u8*)data.ptr)[row * data.strides[0] + col * data.strides[1]];
        u32 s = ((const u8*)scale.ptr)[row * scale.strides[0] + (col / 32) * scale.strides[1]];
        st(y, row * y.strides[0] + col * y.strides[1], __fmul_rn(decode_e4m3(q), decode_e8m0(s)));
    }
}

#define MX_TILE 16

// y[m, n] = sum over blocks b, in order, of fl32((S_b * 2^(sa-127)) * 2^(sw-127)) in f32,
// with S_b the exact block dot product. 16x16 outputs per block of threads; each K block of 32
// is staged in shared memory as decoded f32 (exact).
extern "C" __global__ void kda_mx_gemm(const Status* status, View a, View a_scale, View w,
                                       View w_scale, View y, i64 m, i64 n, i64 k) {
    if (stream_failed(status)) return;
    __shared__ float ta[MX_TILE][33];
    __shared__ float tw[MX_TILE][33];
    __shared__ u32 sa[MX_TILE], sw[MX_TILE];
    int tx = threadIdx.x, ty = threadIdx.y;
    i64 row = (i64)blockIdx.y * MX_TILE + ty;  // output row (m)
    i64 col = (i64)blockIdx.x * MX_TILE + tx;  // output column (n)
    i64 blocks = (k + 31) / 32;
    float acc = 0.0f;
    for (i64 b = 0; b < blocks; ++b) {
        i64 k0 = b * 32;
        int len = (int)(k - k0 < 32 ? k - k0 : 32);
        // 256 threads load two 16x32 tiles: each thread two elements of each.
        for (int e = ty * MX_TILE + tx; e < MX_TILE * 32; e += MX_TILE * MX_TILE) {
            int r = e / 32, c = e % 32;
            i64 ar = (i64)blockIdx.y * MX_TILE + r, wr = (i64)blockIdx.x * MX_TILE + r;
            float av = 0.0f, wv = 0.0f;
            if (c < len && ar < m) av = decode_e4m3(((const u8*)a.ptr)[ar * a.strides[0] + (k0 + c) * a.strides[1]]);
            if (c < len && wr < n) wv = decode_e4m3(((const u8*)w.ptr)[wr * w.strides[0] + (k0 + c) * w.strides[1]]);
            ta[r][c] = av;
            tw[r][c] = wv;
        }
        if (ty == 0) {
            i64 ar = (i64)blockIdx.y * MX_TILE + tx, wr = (i64)blockIdx.x * MX_TILE + tx;
            sa[tx] = ar < m ? ((const u8*)a_scale.ptr)[ar * a_scale.strides[0] + b * a_scale.strides[1]] : 127u;
            sw[tx] = wr < n ? ((const u8*)w_scale.ptr)[wr * w_scale.strides[0] + b * w_scale.strides[1]] : 127u;
        }
        __syncthreads();
        double sum = 0.0;
        for (int c = 0; c < len; ++c) sum = __dadd_rn(sum, __dmul_rn((double)ta[ty][c], (double)tw[tx][c]));
        double scaled = __dmul_rn(__dmul_rn(sum, decode_e8m0_f64(sa[ty])), decode_e8m0_f64(sw[tx]));
        acc = __fadd_rn(acc, __double2float_rn(scaled));
        __syncthreads();
    }
    if (row < m && col < n) st(y, row * y.strides[0] + col * y.strides[1], acc);
}

// DynamicQuant at memory bandwidth, bit for bit as kda_dynamic_quant: rows of x (bf16 or f32)
// and of data dense, k a multiple of 32, rows aligned (16 bytes of x, 8 of data; the host
// checks). Four lanes own one 32-element block, eight consecutive elements each: one 16-byte
// load (two for f32), the block's amax across the four lanes, one 8-byte store.
extern "C" __global__ void kda_dynamic_quant_rows(const Status* status, View x, View data,
                                                  View scale, i64 m, i64 k, int alg) {
    if (stream_failed(status)) return;
    const i64 blocks = k / 32;
    const int lane = threadIdx.x & 31, sub = lane & 3;
    // The four lanes of a block shuffle among themselves only.
    const u32 group = 0xFu << (lane & ~3);
    for (i64 gi = global_thread() / 4; gi < m * blocks; gi += grid_threads() / 4) {
        const i64 row = gi / blocks, blk = gi % blocks;
        const i64 k0 = blk * 32 + sub * 8;
        u32 bits[8];
        if (x.dtype == DT_F32) {
            const uint4* p = (const uint4*)((const float*)x.ptr + row * x.strides[0] + k0);
            uint4 lo = p[0], hi = p[1];
            bits[0] = lo.x; bits[1] = lo.y; bits[2] = lo.z; bits[3] = lo.w;
            bits[4] = hi.x; bits[5] = hi.y; bits[6] = hi.z; bits[7] = hi.w;
        } else {
            uint4 w = *(const uint4*)((const u16*)x.ptr + row * x.strides[0] + k0);
            u32 words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                bits[2 * i] = words[i] << 16;
                bits[2 * i + 1] = words[i] & 0xFFFF0000u;
            }
        }
        u32 amax = 0;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            u32 a = bits[i] & 0x7FFFFFFFu;
            amax = a > amax ? a : amax;
        }
        amax = max(amax, __shfl_xor_sync(group, amax, 1));
        amax = max(amax, __shfl_xor_sync(group, amax, 2));
        u32 sbyte;
        u32 q[8];
        if (amax >= 0x7F800000u) {
            sbyte = E8M0_NAN;
#pragma unroll
            for (int i = 0; i < 8; ++i) q[i] = E4M3_NAN;
        } else {
            sbyte = scale_byte(amax, alg);
            float inv = inverse_scale(sbyte);
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                u32 s = __float_as_uint(__fmul_rn(__uint_as_float(bits[i]), inv));
                q[i] = ((s >> 24) & 0x80u) | encode_magnitude(s & 0x7FFFFFFFu);
            }
        }
        uint2 out;
        out.x = q[0] | (q[1] << 8) | (q[2] << 16) | (q[3] << 24);
        out.y = q[4] | (q[5] << 8) | (q[6] << 16) | (q[7] << 24);
        *(uint2*)((u8*)data.ptr + row * data.strides[0] + k0) = out;
        if (sub == 0) ((u8*)scale.ptr)[row * scale.strides[0] + blk * scale.strides[1]] = (u8)sbyte;
    }
}

// The fast MX GEMM's operands: y[m, k] bf16 = decode(q) * 2^(s - 127), dense rows of data and
// y, k a multiple of 32, rows aligned (8 bytes of data, 16 of y). Exact whenever the value has
// a bf16 (an E4M3 value has 4 significant bits, so only scales that push it out of bf16's
// range round); eight elements per thread, one scale each.
extern "C" __global__ void kda_mx_dequant_bf16(const Status* status, View data, View scale,
                                               View y, i64 m, i64 k) {
    if (stream_failed(status)) return;
    const i64 per_row = k / 8;
    for (i64 i = global_thread(); i < m * per_row; i += grid_threads()) {
        const i64 row = i / per_row, k0 = (i % per_row) * 8;
        uint2 in = *(const uint2*)((const u8*)data.ptr + row * data.strides[0] + k0);
        u32 s = ((const u8*)scale.ptr)[row * scale.strides[0] + (k0 / 32) * scale.strides[1]];
        float sc = decode_e8m0(s);
        u32 bytes[2] = {in.x, in.y};
        u32 words[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            u32 w = bytes[j / 2] >> (16 * (j % 2));
            u16 lo = f32_to_bf16(__fmul_rn(decode_e4m3(w & 0xFFu), sc));
            u16 hi = f32_to_bf16(__fmul_rn(decode_e4m3((w >> 8) & 0xFFu), sc));
            words[j] = (u32)lo | ((u32)hi << 16);
        }
        *(uint4*)((u16*)y.ptr + row * y.strides[0] + k0) = make_uint4(words[0], words[1], words[2], words[3]);
    }
}
