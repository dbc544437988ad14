// Shared by every kda-cuda kernel source: prepended to each .cu before NVRTC compiles it (see
// src/kernels.rs), so the sources need no include path.
//
// Operands arrive as `View`s: a device pointer already advanced to the view's first element,
// the dtype, and shape and strides in elements (row-major logical order). Every kernel takes the
// stream's `Status` first and returns at once when an earlier op on the stream failed: that is
// how the HAL's "ops after a failure are skipped" is kept on the device.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

#define KDA_MAX_RANK 6

// Dtype codes, as src/view.rs assigns them.
#define DT_F32 0
#define DT_BF16 1
#define DT_F16 2
#define DT_I32 3
#define DT_U8 4

struct View {
    u64 ptr;
    int dtype;
    int rank;
    i64 shape[KDA_MAX_RANK];
    i64 strides[KDA_MAX_RANK];
};

// A stream's failure record (src/status.rs decodes it): `fid` is zero while the stream is
// healthy; a kernel that finds bad metadata writes the code and details, then `fid`.
struct Status {
    u32 fid;
    u32 code;
    int detail[6];
};

__device__ __forceinline__ bool stream_failed(const Status* st) {
    return *((volatile const u32*)&st->fid) != 0;
}

// Record a failure (single writer: only the one-thread validation kernels and thread 0 of
// the self-checking kernels call this).
__device__ __forceinline__ void fail(Status* st, u32 fid, u32 code, int a, int b, int c, int d,
                                     int e, int f) {
    if (stream_failed(st)) return;
    st->code = code;
    st->detail[0] = a;
    st->detail[1] = b;
    st->detail[2] = c;
    st->detail[3] = d;
    st->detail[4] = e;
    st->detail[5] = f;
    __threadfence();
    *((volatile u32*)&st->fid) = fid;
}

__device__ __forceinline__ float bf16_to_f32(u16 b) { return __uint_as_float(((u32)b) << 16); }

__device__ __forceinline__ u16 f32_to_bf16(float x) {
    u16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
    return r;
}

__device__ __forceinline__ float f16_to_f32(u16 h) {
    float r;
    asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(h));
    return r;
}

__device__ __forceinline__ u16 f32_to_f16(float x) {
    u16 r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(x));
    return r;
}

// The value at element offset `off` of a float view, widened exactly to f32.
__device__ __forceinline__ float ld(const View& v, i64 off) {
    switch (v.dtype) {
        case DT_F32: return ((const float*)v.ptr)[off];
        case DT_BF16: return bf16_to_f32(((const u16*)v.ptr)[off]);
        case DT_F16: return f16_to_f32(((const u16*)v.ptr)[off]);
        default: return __int_as_float(0x7fc00000);
    }
}

// Store `x` rounded once (nearest even) to the view's float dtype.
__device__ __forceinline__ void st(const View& v, i64 off, float x) {
    switch (v.dtype) {
        case DT_F32: ((float*)v.ptr)[off] = x; break;
        case DT_BF16: ((u16*)v.ptr)[off] = f32_to_bf16(x); break;
        case DT_F16: ((u16*)v.ptr)[off] = f32_to_f16(x); break;
        default: break;
    }
}

__device__ __forceinline__ int ld_i32(const View& v, i64 i) {
    return ((const int*)v.ptr)[i * v.strides[0]];
}

// Offset of the element with row-major index `linear`.
__device__ __forceinline__ i64 offset_of(const View& v, i64 linear) {
    i64 off = 0;
    for (int d = v.rank - 1; d >= 0; --d) {
        i64 n = v.shape[d];
        off += (linear % n) * v.strides[d];
        linear /= n;
    }
    return off;
}

// Offset of element `j` of row `r` when the view is read as rows of its last dimension.
__device__ __forceinline__ i64 row_offset(const View& v, i64 r, i64 j) {
    i64 off = j * v.strides[v.rank - 1];
    for (int d = v.rank - 2; d >= 0; --d) {
        i64 n = v.shape[d];
        off += (r % n) * v.strides[d];
        r /= n;
    }
    return off;
}

__device__ __forceinline__ i64 off3(const View& v, i64 a, i64 b, i64 c) {
    return a * v.strides[0] + b * v.strides[1] + c * v.strides[2];
}

__device__ __forceinline__ i64 off4(const View& v, i64 a, i64 b, i64 c, i64 d) {
    return a * v.strides[0] + b * v.strides[1] + c * v.strides[2] + d * v.strides[3];
}

__device__ __forceinline__ float warp_sum(float x) {
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

// `1 / (1 + e^-z)`, written so that neither branch overflows (as the reference).
__device__ __forceinline__ float sigmoid_f(float z) {
    if (z >= 0.0f) return 1.0f / (1.0f + expf(-z));
    float e = expf(z);
    return e / (1.0f + e);
}

__device__ __forceinline__ i64 global_thread() {
    return (i64)blockIdx.x * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ i64 grid_threads() { return (i64)gridDim.x * blockDim.x; }

#define GATE_NONE -1
#define GATE_SOFTPLUS 0
#define GATE_LOWER_BOUND 1

// The log decay of channel c of head h from its raw logit x: a = x + dt_bias[h, c], then form 0
// softplus, 1 lower bound. The one place the gate is computed: kda_gate and the chunked
// prefills' in-kernel gate (kda_chunk, kda_chunk_tc) all call it, so their log decays are the
// same bits.
__device__ __forceinline__ float gate_value(float x, const View& a_log, const View& dt_bias, i64 h,
                                            i64 c, int form, float lower_bound) {
    float a = x + ld(dt_bias, h * dt_bias.strides[0] + c * dt_bias.strides[1]);
    float al = ld(a_log, h * a_log.strides[0]);
    if (form == GATE_SOFTPLUS) {
        float sp = a > 20.0f ? a : log1pf(expf(a));
        return -expf(al) * sp;
    }
    float out = lower_bound * sigmoid_f(expf(al) * a);
    // Keep the interval open: one ulp towards zero once sigmoid rounds to 1.
    if (out <= lower_bound) out = __uint_as_float(__float_as_uint(lower_bound) - 1u);
    return out;
}

