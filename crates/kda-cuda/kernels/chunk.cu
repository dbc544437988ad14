// The chunked prefill on tensor cores (docs/design/kda.md, "chunked form"): chunks of 64
// tokens, sub-blocks of 16, the WY / UT form, every product of the chunk a bf16 `mma.sync`
// (m16n8k16) tile with fp32 accumulation, the decay applied in-kernel from the raw gate.
//
// One thread block (8 warps) owns one request, one head and 32 value columns, and walks the
// request's chunks in order, its 128 x 32 slice of the state in shared memory (fp32, and a
// bf16 copy for the products). Per chunk, with gc the within-chunk cumulative log decay:
//
//   A_kk[t, i] = beta_t sum_c k_t k_i e^{gc_t - gc_i}   (i < t)      sub-block by sub-block,
//   A_qk[t, i] =        sum_c q_t k_i e^{gc_t - gc_i}   (i <= t)     one mma product each
//   M          = (I + A_kk)^-1                            fp32, blocks of 16
//   W = M (beta e^{gc} k),  U = M (beta v)                 mma
//   v_new      = U - W S                                  mma
//   o          = (e^{gc} q) S + A_qk v_new                 mma
//   S          = e^{gc_last} S + (e^{gc_last - gc} k)^T v_new   mma
//
// Decays: sub-block T (rows r0..r0+15) factors e^{gc_t - gc_i} around the row before it,
// e^{gc_t - ref} (<= 1) times e^{ref - gc_i} (<= 1 for i < r0), so no off-diagonal factor can
// overflow; on its own diagonal the right factors are >= 1 and the product is kept only when
// every left factor of the block is at least e^-40, else those 16 x 16 pairs are summed directly
// in fp32. src/chunk_model.rs is a host model of exactly this, checked against the f64
// recurrence; the token-by-token kernel (kda_chunk) is the oracle this one is tested against on
// a device (tests/device.rs). Precision is bf16's (every product has bf16 operands), as
// flash-linear-attention's chunk_kda.
//
// Limits: key dim at most 128 (padded to a multiple of 16 with zeros), any value dim (tiles of
// 32, padded), any length. Needs 215.5 KiB of dynamic shared memory (sm_90, sm_100).

#define TC_C 64
#define TC_KP 128
#define TC_BV 32
#define TC_LDB (TC_KP + 8)
#define TC_LDC (TC_C + 8)
#define TC_LDS (TC_KP + 4)
#define TC_LDU (TC_BV + 1)
#define TC_THREADS 256
#define TC_WARPS 8
#define TC_MIN_LEFT 4.248354e-18f

// The dynamic shared memory the launch gives (src/plan.rs, TC_SHARED_BYTES), and the layout
// below adding up to it.
#define TC_SMEM_BYTES 220672
static_assert(TC_SMEM_BYTES ==
                  2 * (2 * TC_C * TC_LDB + 32 * TC_LDB + TC_C * TC_LDB + 2 * TC_C * TC_LDC +
                       TC_C * TC_LDB + TC_KP * TC_LDC + TC_C * TC_LDB + TC_BV * TC_LDC +
                       TC_BV * TC_LDB + TC_BV * TC_LDC) +
                      4 * (TC_C * TC_KP + TC_C * (TC_C + 1) + 3 * 256 + TC_BV * TC_LDS + TC_C +
                           TC_KP),
              "kda_chunk_tc's shared memory layout");
static_assert(TC_C * TC_LDU <= TC_C * TC_KP, "U fits where gc was");

__device__ __forceinline__ u16 bf(float x) { return f32_to_bf16(x); }
__device__ __forceinline__ float fb(u16 x) { return bf16_to_f32(x); }

// Two bf16 at an even element index, as one word (the lower index in the low half).
__device__ __forceinline__ u32 pair(const u16* p) { return *(const u32*)p; }
__device__ __forceinline__ u32 pack2(u16 lo, u16 hi) { return (u32)lo | ((u32)hi << 16); }

// d += a b for one 16 x 8 tile, bf16 operands, fp32 accumulators.
__device__ __forceinline__ void mma16816(float* d, const u32* a, const u32* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// The A fragment of rows m0..m0+15, columns k0..k0+15 of a row-major bf16 matrix: lane
// (g = lane / 4, j = lane % 4) holds (g, 2j..), (g + 8, 2j..), (g, 8 + 2j..), (g + 8, 8 + 2j..).
__device__ __forceinline__ void frag_a(u32* a, const u16* m, int ld, int m0, int k0) {
    int lane = threadIdx.x & 31, g = lane >> 2, j = lane & 3;
    const u16* r0 = m + (m0 + g) * ld + k0 + 2 * j;
    const u16* r8 = r0 + 8 * ld;
    a[0] = pair(r0);
    a[1] = pair(r8);
    a[2] = pair(r0 + 8);
    a[3] = pair(r8 + 8);
}

// The B fragment (k rows k0..k0+15, n columns n0..n0+7) of a matrix stored n-major,
// element (k, n) at m[n * ld + k]: lane holds (2j.., g) and (8 + 2j.., g).
__device__ __forceinline__ void frag_b_nk(u32* b, const u16* m, int ld, int n0, int k0) {
    int lane = threadIdx.x & 31, g = lane >> 2, j = lane & 3;
    const u16* r = m + (n0 + g) * ld + k0 + 2 * j;
    b[0] = pair(r);
    b[1] = pair(r + 8);
}

// The same fragment of a matrix stored k-major, element (k, n) at m[k * ld + n].
__device__ __forceinline__ void frag_b_kn(u32* b, const u16* m, int ld, int n0, int k0) {
    int lane = threadIdx.x & 31, g = lane >> 2, j = lane & 3;
    const u16* c = m + (k0 + 2 * j) * ld + n0 + g;
    b[0] = pack2(c[0], c[ld]);
    b[1] = pack2(c[8 * ld], c[9 * ld]);
}

// d += a[m0..m0+16, 0..kdim] b[0..kdim, n0..n0+8]: a row-major, b n-major (tile_nk) or k-major
// (tile_kn).
template <bool K_MAJOR_B>
__device__ __forceinline__ void tile_mma(float* d, const u16* a, int lda, const u16* b, int ldb,
                                         int m0, int n0, int kdim) {
    for (int k0 = 0; k0 < kdim; k0 += 16) {
        u32 fa[4], fbk[2];
        frag_a(fa, a, lda, m0, k0);
        if (K_MAJOR_B) {
            frag_b_kn(fbk, b, ldb, n0, k0);
        } else {
            frag_b_nk(fbk, b, ldb, n0, k0);
        }
        mma16816(d, fa, fbk);
    }
}
#define tile_nk tile_mma<false>
#define tile_kn tile_mma<true>

// Hand each accumulator of a 16 x 8 tile at (m0, n0) to f(row, column, value).
template <class F>
__device__ __forceinline__ void tile_out(const float* d, int m0, int n0, F f) {
    int lane = threadIdx.x & 31, g = lane >> 2, j = lane & 3;
    f(m0 + g, n0 + 2 * j, d[0]);
    f(m0 + g, n0 + 2 * j + 1, d[1]);
    f(m0 + g + 8, n0 + 2 * j, d[2]);
    f(m0 + g + 8, n0 + 2 * j + 1, d[3]);
}

// Grid (ceil(V / 32), H, B), 256 threads, TC_SMEM_BYTES of dynamic shared memory. Operands as
// kda_chunk's; metadata already validated by kda_validate_varlen (launched before, on the same
// stream: a failure there makes this kernel return at once).
extern "C" __global__ void kda_chunk_tc(const Status* status, View q, View k, View v, View g,
                                        View beta, View cu_seqlens, View state_slots,
                                        View has_initial, View state, View o, i64 kd64, i64 vd64,
                                        float scale, int l2, View a_log, View dt_bias,
                                        int gate_form, float lower_bound) {
    if (stream_failed(status)) return;
    extern __shared__ __align__(16) unsigned char smem[];
    u16* q_b = (u16*)smem;                     // [C][LDB] normalised, scaled q
    u16* k_b = q_b + TC_C * TC_LDB;            // [C][LDB] normalised k
    u16* opl = k_b + TC_C * TC_LDB;            // [32][LDB] left operands of one sub-block
    u16* opr = opl + 32 * TC_LDB;              // [C][LDB] right operands; then W
    u16* m_b = opr + TC_C * TC_LDB;            // [C][LDC] M
    u16* aqk_b = m_b + TC_C * TC_LDC;          // [C][LDC] A_qk
    u16* qg_b = aqk_b + TC_C * TC_LDC;         // [C][LDB] e^{gc} q
    u16* kdT = qg_b + TC_C * TC_LDB;           // [KP][LDC] (e^{gc_last - gc} k)^T
    u16* wrhs_b = kdT + TC_KP * TC_LDC;        // [C][LDB] beta e^{gc} k
    u16* urhsT = wrhs_b + TC_C * TC_LDB;       // [BV][LDC] (beta v)^T
    u16* sbT = urhsT + TC_BV * TC_LDC;         // [BV][LDB] the state slice, bf16, v-first
    u16* vnewT = sbT + TC_BV * TC_LDB;         // [BV][LDC] v_new^T
    float* gc = (float*)(vnewT + TC_BV * TC_LDC);  // [C][KP] cumulative log decay; then U
    float* akk = gc + TC_C * TC_KP;            // [C][C + 1] A_kk; then M
    float* tmp = akk + TC_C * (TC_C + 1);      // [3][16][16]
    float* sv = tmp + 3 * 256;                 // [BV][LDS] the state slice, fp32, v-first
    float* beta_s = sv + TC_BV * TC_LDS;       // [C]
    float* dlast = beta_s + TC_C;              // [KP] e^{gc_last}

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int kd = (int)kd64, vd = (int)vd64;
    const int kp = (kd + 15) & ~15;
    const int v0 = blockIdx.x * TC_BV, h = blockIdx.y, b = blockIdx.z;
    const int nv = min(TC_BV, vd - v0);
    const i64 start = ld_i32(cu_seqlens, b), end = ld_i32(cu_seqlens, b + 1);
    const int slot = ld_i32(state_slots, b);
    if (slot < 0) {
        for (i64 i = tid; i < (end - start) * nv; i += TC_THREADS) {
            st(o, off3(o, start + i / nv, h, v0 + i % nv), 0.0f);
        }
        return;
    }
    const bool initial = ld_i32(has_initial, b) != 0;
    for (int i = tid; i < TC_BV * TC_KP; i += TC_THREADS) {
        int vv = i / TC_KP, c = i % TC_KP;
        float x = 0.0f;
        if (initial && vv < nv && c < kd) x = ((const float*)state.ptr)[off4(state, slot, h, v0 + vv, c)];
        sv[vv * TC_LDS + c] = x;
        sbT[vv * TC_LDB + c] = bf(x);
    }
    __syncthreads();

    for (i64 c0 = start; c0 < end; c0 += TC_C) {
        const int len = (int)min((i64)TC_C, end - c0);

        // ---- A: raw rows, the cumulative decay, normalised q and k, derived operands ----
        for (int i = tid; i < TC_C * TC_KP; i += TC_THREADS) {
            int t = i / TC_KP, c = i % TC_KP;
            float x = 0.0f;
            if (t < len && c < kd) {
                x = ld(g, off3(g, c0 + t, h, c));
                if (gate_form != GATE_NONE) x = gate_value(x, a_log, dt_bias, h, c, gate_form, lower_bound);
            }
            gc[t * TC_KP + c] = x;
        }
        for (int t = tid; t < TC_C; t += TC_THREADS) {
            beta_s[t] = t < len ? ld(beta, (c0 + t) * beta.strides[0] + h * beta.strides[1]) : 0.0f;
        }
        for (int i = tid; i < TC_C * (TC_C + 1); i += TC_THREADS) akk[i] = 0.0f;
        for (int i = tid; i < TC_C * TC_LDC; i += TC_THREADS) aqk_b[i] = 0;
        __syncthreads();
        // Padding rows have g = 0, so gc there stays gc[len - 1].
        for (int c = tid; c < TC_KP; c += TC_THREADS) {
            float run = 0.0f;
            for (int t = 0; t < TC_C; ++t) {
                run += gc[t * TC_KP + c];
                gc[t * TC_KP + c] = run;
            }
            dlast[c] = expf(run);
        }
        __syncthreads();
        // A warp per token: q and k normalised across the lanes.
        for (int t = warp; t < TC_C; t += TC_WARPS) {
            float qv[4], kv[4];
            float qs = 0.0f, ks = 0.0f;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                int c = lane + 32 * i;
                bool in = t < len && c < kd;
                qv[i] = in ? ld(q, off3(q, c0 + t, h, c)) : 0.0f;
                kv[i] = in ? ld(k, off3(k, c0 + t, h, c)) : 0.0f;
                qs += qv[i] * qv[i];
                ks += kv[i] * kv[i];
            }
            if (l2) {
                float qi = 1.0f / sqrtf(warp_sum(qs) + 1e-6f);
                float ki = 1.0f / sqrtf(warp_sum(ks) + 1e-6f);
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    qv[i] = qv[i] * qi * scale;
                    kv[i] = kv[i] * ki;
                }
            } else {
#pragma unroll
                for (int i = 0; i < 4; ++i) qv[i] = qv[i] * scale;
            }
            float bt = beta_s[t];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                int c = lane + 32 * i;
                float gct = gc[t * TC_KP + c];
                float e = expf(gct);
                q_b[t * TC_LDB + c] = bf(qv[i]);
                k_b[t * TC_LDB + c] = bf(kv[i]);
                qg_b[t * TC_LDB + c] = bf(qv[i] * e);
                wrhs_b[t * TC_LDB + c] = bf(bt * (kv[i] * e));
                kdT[c * TC_LDC + t] = bf(kv[i] * expf(gc[(TC_C - 1) * TC_KP + c] - gct));
            }
        }
        for (int i = tid; i < TC_BV * TC_C; i += TC_THREADS) {
            int vv = i / TC_C, t = i % TC_C;
            float x = 0.0f;
            if (vv < nv && t < len) x = beta_s[t] * ld(v, off3(v, c0 + t, h, v0 + vv));
            urhsT[vv * TC_LDC + t] = bf(x);
        }
        __syncthreads();

        // ---- B: A_kk and A_qk by sub-blocks of 16 rows ----
        for (int r0 = 0; r0 < len; r0 += 16) {
            const int r1 = r0 + 16;
            int ok = 1;
            for (int i = tid; i < 16 * TC_KP; i += TC_THREADS) {
                int tt = i / TC_KP, c = i % TC_KP, t = r0 + tt;
                float ref = r0 == 0 ? 0.0f : gc[(r0 - 1) * TC_KP + c];
                float left = expf(gc[t * TC_KP + c] - ref);
                if (c < kd && !(left >= TC_MIN_LEFT)) ok = 0;
                opl[tt * TC_LDB + c] = bf(fb(k_b[t * TC_LDB + c]) * left);
                opl[(16 + tt) * TC_LDB + c] = bf(fb(q_b[t * TC_LDB + c]) * left);
            }
            for (int i = tid; i < r1 * TC_KP; i += TC_THREADS) {
                int ii = i / TC_KP, c = i % TC_KP;
                float ref = r0 == 0 ? 0.0f : gc[(r0 - 1) * TC_KP + c];
                opr[ii * TC_LDB + c] = bf(fb(k_b[ii * TC_LDB + c]) * expf(ref - gc[ii * TC_KP + c]));
            }
            const bool factored = __syncthreads_and(ok) != 0;
            // Rows 0..15 of the product are A_kk's, 16..31 A_qk's; columns 0..r1.
            const int nt = r1 / 8;
            for (int tile = warp; tile < 2 * nt; tile += TC_WARPS) {
                int m0 = (tile / nt) * 16, n0 = (tile % nt) * 8;
                float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                tile_nk(d, opl, TC_LDB, opr, TC_LDB, m0, n0, kp);
                tile_out(d, m0, n0, [&](int rr, int i, float val) {
                    if (rr < 16) {
                        int t = r0 + rr;
                        akk[t * (TC_C + 1) + i] = i < t ? beta_s[t] * val : 0.0f;
                    } else {
                        int t = r0 + rr - 16;
                        aqk_b[t * TC_LDC + i] = bf(i <= t ? val : 0.0f);
                    }
                });
            }
            if (!factored) {
                __syncthreads();
                // The 136 pairs i <= t of the diagonal sub-block, a warp each, directly.
                for (int p = warp; p < 136; p += TC_WARPS) {
                    int tt = 0;
                    while ((tt + 1) * (tt + 2) / 2 <= p) ++tt;
                    int t = r0 + tt, i = r0 + p - tt * (tt + 1) / 2;
                    float sk = 0.0f, sq = 0.0f;
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        int c = lane + 32 * j;
                        float e = expf(gc[t * TC_KP + c] - gc[i * TC_KP + c]);
                        float ki = fb(k_b[i * TC_LDB + c]);
                        sk += fb(k_b[t * TC_LDB + c]) * ki * e;
                        sq += fb(q_b[t * TC_LDB + c]) * ki * e;
                    }
                    sk = warp_sum(sk);
                    sq = warp_sum(sq);
                    if (lane == 0) {
                        akk[t * (TC_C + 1) + i] = i < t ? beta_s[t] * sk : 0.0f;
                        aqk_b[t * TC_LDC + i] = bf(sq);
                    }
                }
            }
            __syncthreads();
        }

        // ---- C: M = (I + A_kk)^-1, in place, by blocks of 16 ----
        // Diagonal blocks: a warp each, lane j < 16 substitutes for column j.
        if (warp < 4) {
            const int o16 = 16 * warp;
            float x[16];
#pragma unroll
            for (int t = 0; t < 16; ++t) {
                float s = 0.0f;
#pragma unroll
                for (int i = 0; i < 16; ++i) {
                    if (i < t) s += akk[(o16 + t) * (TC_C + 1) + o16 + i] * x[i];
                }
                x[t] = t == lane ? 1.0f : (t < lane ? 0.0f : -s);
            }
            __syncwarp();
            if (lane < 16) {
#pragma unroll
                for (int t = 0; t < 16; ++t) akk[(o16 + t) * (TC_C + 1) + o16 + lane] = x[t];
            }
        }
        __syncthreads();
        // Block rows top down: M_ij = -M_ii sum_{k=j}^{i-1} A_ik M_kj.
        for (int bi = 1; bi < 4; ++bi) {
            for (int i = tid; i < bi * 256; i += TC_THREADS) {
                int bj = i / 256, r = (i / 16) % 16, c = i % 16;
                float s = 0.0f;
                for (int bk = bj; bk < bi; ++bk) {
                    for (int u = 0; u < 16; ++u) {
                        s += akk[(16 * bi + r) * (TC_C + 1) + 16 * bk + u] *
                             akk[(16 * bk + u) * (TC_C + 1) + 16 * bj + c];
                    }
                }
                tmp[i] = s;
            }
            __syncthreads();
            for (int i = tid; i < bi * 256; i += TC_THREADS) {
                int bj = i / 256, r = (i / 16) % 16, c = i % 16;
                float s = 0.0f;
                for (int u = 0; u < 16; ++u) {
                    s += akk[(16 * bi + r) * (TC_C + 1) + 16 * bi + u] * tmp[bj * 256 + u * 16 + c];
                }
                akk[(16 * bi + r) * (TC_C + 1) + 16 * bj + c] = -s;
            }
            __syncthreads();
        }
        for (int i = tid; i < TC_C * TC_C; i += TC_THREADS) {
            int t = i / TC_C, j = i % TC_C;
            m_b[t * TC_LDC + j] = bf(akk[t * (TC_C + 1) + j]);
        }
        __syncthreads();

        // ---- D: W = M (beta e^{gc} k) into opr (bf16), U = M (beta v) into gc (fp32) ----
        float* u = gc;
        {
            const int nt = kp / 8;
            for (int tile = warp; tile < 4 * nt + 4 * (TC_BV / 8); tile += TC_WARPS) {
                float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                if (tile < 4 * nt) {
                    int m0 = (tile / nt) * 16, n0 = (tile % nt) * 8;
                    tile_kn(d, m_b, TC_LDC, wrhs_b, TC_LDB, m0, n0, TC_C);
                    tile_out(d, m0, n0, [&](int t, int c, float val) { opr[t * TC_LDB + c] = bf(val); });
                } else {
                    int s = tile - 4 * nt;
                    int m0 = (s / (TC_BV / 8)) * 16, n0 = (s % (TC_BV / 8)) * 8;
                    tile_nk(d, m_b, TC_LDC, urhsT, TC_LDC, m0, n0, TC_C);
                    // gc is no longer read: every reader of it finished before the last barrier.
                    tile_out(d, m0, n0, [&](int t, int vv, float val) { u[t * TC_LDU + vv] = val; });
                }
            }
        }
        __syncthreads();

        // ---- E: v_new = U - W S; then the outputs and the state ----
        for (int tile = warp; tile < 4 * (TC_BV / 8); tile += TC_WARPS) {
            int m0 = (tile / (TC_BV / 8)) * 16, n0 = (tile % (TC_BV / 8)) * 8;
            float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            tile_nk(d, opr, TC_LDB, sbT, TC_LDB, m0, n0, kp);
            tile_out(d, m0, n0, [&](int t, int vv, float val) {
                vnewT[vv * TC_LDC + t] = bf(u[t * TC_LDU + vv] - val);
            });
        }
        __syncthreads();
        // Output tiles (16) read the old state's bf16 copy; state tiles write the fp32 one.
        const int out_tiles = 4 * (TC_BV / 8);
        for (int tile = warp; tile < out_tiles + (kp / 16) * (TC_BV / 8); tile += TC_WARPS) {
            float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            if (tile < out_tiles) {
                int m0 = (tile / (TC_BV / 8)) * 16, n0 = (tile % (TC_BV / 8)) * 8;
                tile_nk(d, qg_b, TC_LDB, sbT, TC_LDB, m0, n0, kp);
                tile_nk(d, aqk_b, TC_LDC, vnewT, TC_LDC, m0, n0, TC_C);
                tile_out(d, m0, n0, [&](int t, int vv, float val) {
                    if (t < len && vv < nv) st(o, off3(o, c0 + t, h, v0 + vv), val);
                });
            } else {
                int s = tile - out_tiles;
                int m0 = (s / (TC_BV / 8)) * 16, n0 = (s % (TC_BV / 8)) * 8;
                tile_nk(d, kdT, TC_LDC, vnewT, TC_LDC, m0, n0, TC_C);
                tile_out(d, m0, n0, [&](int c, int vv, float val) {
                    sv[vv * TC_LDS + c] = sv[vv * TC_LDS + c] * dlast[c] + val;
                });
            }
        }
        __syncthreads();
        for (int i = tid; i < TC_BV * TC_KP; i += TC_THREADS) {
            int vv = i / TC_KP, c = i % TC_KP;
            sbT[vv * TC_LDB + c] = bf(sv[vv * TC_LDS + c]);
        }
        __syncthreads();
    }
    for (int i = tid; i < TC_BV * TC_KP; i += TC_THREADS) {
        int vv = i / TC_KP, c = i % TC_KP;
        if (vv < nv && c < kd) ((float*)state.ptr)[off4(state, slot, h, v0 + vv, c)] = sv[vv * TC_LDS + c];
    }
}
