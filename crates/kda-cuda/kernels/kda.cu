// The KDA layer's vector kernels (kda_core::kda): sigmoid, gate, L2 norm, gated RMSNorm,
// zero padding, causal conv (prefill, decode, speculative), and the delta-rule recurrence for
// decode and prefill. All math in f32, outputs rounded once, as the reference backend.
//
// Per-request metadata (offsets, slots, counts) is device data: one-thread kernels named
// `kda_validate_*` check it in the reference's order and record the first problem in the
// stream's Status, so the op's compute kernels (launched after them) are skipped and nothing is
// written. Codes and details are decoded by src/status.rs.

#define CODE_RANGE 1
#define CODE_SLOT 2
#define CODE_ACCEPTED 3
#define CODE_LIVE 4

#define PARAM_CU_SEQLENS 0
#define PARAM_QUERY_START_LOC 1
#define PARAM_STATE_SLOTS 2

// Conv widths and speculative token counts the conv kernels hold in registers.
#define MAX_CONV_WINDOW 64
// Key dims the recurrence holds in registers: 32 lanes x 8.
#define MAX_KEY_PER_LANE 8
#define ROWS_PER_BLOCK 4

extern "C" __global__ void kda_sigmoid(const Status* status, View x, View y, i64 n) {
    if (stream_failed(status)) return;
    for (i64 i = global_thread(); i < n; i += grid_threads()) {
        st(y, offset_of(y, i), sigmoid_f(ld(x, offset_of(x, i))));
    }
}

// g[t, h, c] from the logits g1 (see gate_value).
extern "C" __global__ void kda_gate(const Status* status, View g1, View a_log, View dt_bias, View g,
                                    i64 tokens, i64 heads, i64 dim, int form, float lower_bound) {
    if (stream_failed(status)) return;
    i64 n = tokens * heads * dim;
    for (i64 i = global_thread(); i < n; i += grid_threads()) {
        i64 c = i % dim, h = (i / dim) % heads, t = i / (dim * heads);
        float out = gate_value(ld(g1, off3(g1, t, h, c)), a_log, dt_bias, h, c, form, lower_bound);
        st(g, off3(g, t, h, c), out);
    }
}

// Sum of squares of row r (of `dim` elements), by the calling warp; every lane gets it.
__device__ __forceinline__ float row_sum_squares(const View& x, i64 r, i64 dim) {
    float ss = 0.0f;
    for (i64 j = threadIdx.x & 31; j < dim; j += 32) {
        float v = ld(x, row_offset(x, r, j));
        ss += v * v;
    }
    return warp_sum(ss);
}

// One warp per row of the last dimension: y = x / sqrt(sum x^2 + 1e-6) * scale.
extern "C" __global__ void kda_l2norm(const Status* status, View x, View y, i64 rows, i64 dim,
                                      float scale) {
    if (stream_failed(status)) return;
    int lane = threadIdx.x & 31;
    i64 warps = grid_threads() / 32;
    for (i64 r = global_thread() / 32; r < rows; r += warps) {
        float inv = 1.0f / sqrtf(row_sum_squares(x, r, dim) + 1e-6f);
        for (i64 j = lane; j < dim; j += 32) {
            st(y, row_offset(y, r, j), ld(x, row_offset(x, r, j)) * inv * scale);
        }
    }
}

// One warp per row: y = x * rsqrt(mean(x^2) + eps) * w * sigmoid(gate).
extern "C" __global__ void kda_gated_rms_norm(const Status* status, View x, View gate, View weight,
                                              View y, i64 rows, i64 dim, float eps) {
    if (stream_failed(status)) return;
    int lane = threadIdx.x & 31;
    i64 warps = grid_threads() / 32;
    for (i64 r = global_thread() / 32; r < rows; r += warps) {
        float mean = row_sum_squares(x, r, dim) / (float)(dim > 0 ? dim : 1);
        float inv = 1.0f / sqrtf(mean + eps);
        for (i64 j = lane; j < dim; j += 32) {
            float v = ld(x, row_offset(x, r, j));
            float w = ld(weight, j * weight.strides[0]);
            float gt = ld(gate, row_offset(gate, r, j));
            st(y, row_offset(y, r, j), v * inv * w * sigmoid_f(gt));
        }
    }
}

// Zero rows live.. of x (any dtype, `elsize` bytes); every thread checks the count itself, so
// a bad count writes nothing.
extern "C" __global__ void kda_zero_padding(Status* status, u32 fid, View x, View live_view,
                                            i64 rows, i64 row_len, int elsize) {
    if (stream_failed(status)) return;
    int live = ((const int*)live_view.ptr)[0];
    if (live < 0 || (i64)live > rows) {
        if (global_thread() == 0) fail(status, fid, CODE_LIVE, live, (int)rows, 0, 0, 0, 0);
        return;
    }
    i64 n = (rows - live) * row_len;
    for (i64 i = global_thread(); i < n; i += grid_threads()) {
        i64 d = offset_of(x, (i64)live * row_len + i);
        switch (elsize) {
            case 1: ((u8*)x.ptr)[d] = 0; break;
            case 2: ((u16*)x.ptr)[d] = 0; break;
            default: ((u32*)x.ptr)[d] = 0; break;
        }
    }
}

// ---- metadata validation (one thread) -------------------------------------------------------

// Offsets [B + 1] non-decreasing within 0..=tokens; then slots [B] below `slots`.
__device__ bool check_ranges(Status* status, u32 fid, int param, const View& starts, i64 batch,
                             i64 tokens) {
    for (i64 b = 0; b < batch; ++b) {
        int lo = ld_i32(starts, b), hi = ld_i32(starts, b + 1);
        if (lo < 0 || hi < lo || (i64)hi > tokens) {
            fail(status, fid, CODE_RANGE, param, (int)b, lo, hi, (int)tokens, 0);
            return false;
        }
    }
    return true;
}

__device__ bool check_slot(Status* status, u32 fid, int value, i64 slots, int b, int t) {
    if (value >= 0 && (i64)value >= slots) {
        fail(status, fid, CODE_SLOT, PARAM_STATE_SLOTS, b, t, value, (int)slots, 0);
        return false;
    }
    return true;
}

// CausalConv and KdaChunk: offsets, then one slot per request.
extern "C" __global__ void kda_validate_varlen(Status* status, u32 fid, int param, View starts,
                                               View state_slots, i64 batch, i64 tokens, i64 slots) {
    if (stream_failed(status)) return;
    if (!check_ranges(status, fid, param, starts, batch, tokens)) return;
    for (i64 b = 0; b < batch; ++b) {
        if (!check_slot(status, fid, ld_i32(state_slots, b), slots, (int)b, -1)) return;
    }
}

// CausalConvUpdate: every slot, then the accepted count of each live request within 1..=max.
extern "C" __global__ void kda_validate_conv_update(Status* status, u32 fid, View state_slots,
                                                    View accepted, i64 batch, i64 slots,
                                                    int max_accepted, int state_len, int width) {
    if (stream_failed(status)) return;
    for (i64 b = 0; b < batch; ++b) {
        if (!check_slot(status, fid, ld_i32(state_slots, b), slots, (int)b, -1)) return;
    }
    if (accepted.ptr == 0) return;
    for (i64 b = 0; b < batch; ++b) {
        if (ld_i32(state_slots, b) < 0) continue;
        int a = ld_i32(accepted, b);
        if (a < 1 || a > max_accepted) {
            fail(status, fid, CODE_ACCEPTED, (int)b, a, max_accepted, 1, state_len, width);
            return;
        }
    }
}

// KdaRecurrent: per request, the accepted count within 1..=n, its initial slot, then every slot.
extern "C" __global__ void kda_validate_recurrent(Status* status, u32 fid, View state_slots,
                                                  View accepted, i64 batch, i64 n, i64 slots) {
    if (stream_failed(status)) return;
    if (n == 0) return;
    for (i64 b = 0; b < batch; ++b) {
        int a = accepted.ptr == 0 ? 1 : ld_i32(accepted, b);
        if (a < 1 || (i64)a > n) {
            fail(status, fid, CODE_ACCEPTED, (int)b, a, (int)n, 0, 0, 0);
            return;
        }
        i64 row = b * state_slots.strides[0];
        const int* s = (const int*)state_slots.ptr;
        int first = s[row + (a - 1) * state_slots.strides[1]];
        if (!check_slot(status, fid, first, slots, (int)b, a - 1)) return;
        for (i64 t = 0; t < n; ++t) {
            if (!check_slot(status, fid, s[row + t * state_slots.strides[1]], slots, (int)b, (int)t)) return;
        }
    }
}

// ---- causal conv ------------------------------------------------------------------------------

__device__ __forceinline__ float silu(float a) { return a * sigmoid_f(a); }

// The request owning token t of a flat batch (offsets `starts`), or -1.
__device__ i64 request_of(const View& starts, i64 batch, i64 t) {
    i64 lo = 0, hi = batch;  // first request whose end is > t
    while (lo < hi) {
        i64 mid = (lo + hi) / 2;
        if ((i64)ld_i32(starts, mid + 1) <= t) lo = mid + 1; else hi = mid;
    }
    if (lo >= batch) return -1;
    return (i64)ld_i32(starts, lo) <= t ? lo : -1;
}

// Prefill outputs, one thread per (token, channel); history rows come from the state, which
// `kda_conv_prefill_state` (launched after) overwrites.
extern "C" __global__ void kda_conv_prefill(const Status* status, View x, View weight, View starts,
                                            View state_slots, View has_initial, View state, View y,
                                            i64 tokens, i64 channels, i64 width, i64 batch) {
    if (stream_failed(status)) return;
    for (i64 i = global_thread(); i < tokens * channels; i += grid_threads()) {
        i64 t = i / channels, c = i % channels;
        i64 b = request_of(starts, batch, t);
        if (b < 0) continue;
        int slot = ld_i32(state_slots, b);
        i64 yo = t * y.strides[0] + c * y.strides[1];
        if (slot < 0) { st(y, yo, 0.0f); continue; }
        i64 start = ld_i32(starts, b);
        bool fresh = ld_i32(has_initial, b) == 0;
        float acc = 0.0f;
        for (i64 j = 0; j < width; ++j) {
            i64 p = t - width + 1 + j;
            float v;
            if (p >= start) {
                v = ld(x, p * x.strides[0] + c * x.strides[1]);
            } else {
                i64 hrow = width - 1 - (start - p);
                v = fresh ? 0.0f : ld(state, off3(state, slot, hrow, c));
            }
            acc += ld(weight, c * weight.strides[0] + j * weight.strides[1]) * v;
        }
        st(y, yo, silu(acc));
    }
}

// The last W - 1 inputs of each live request (history included) into state rows 0..W-1; one
// thread per (request, channel), requests in order so a shared slot ends as the reference's.
extern "C" __global__ void kda_conv_prefill_state(const Status* status, View x, View starts,
                                                  View state_slots, View has_initial, View state,
                                                  i64 channels, i64 width, i64 batch) {
    if (stream_failed(status)) return;
    i64 hist = width - 1;
    for (i64 c = global_thread(); c < channels; c += grid_threads()) {
        for (i64 b = 0; b < batch; ++b) {
            int slot = ld_i32(state_slots, b);
            if (slot < 0) continue;
            i64 start = ld_i32(starts, b), len = ld_i32(starts, b + 1) - start;
            bool fresh = ld_i32(has_initial, b) == 0;
            float tail[MAX_CONV_WINDOW];
            for (i64 j = 0; j < hist; ++j) {
                i64 at = len + j;  // index into history ++ x
                if (at < hist) {
                    tail[j] = fresh ? 0.0f : ld(state, off3(state, slot, at, c));
                } else {
                    tail[j] = ld(x, (start + at - hist) * x.strides[0] + c * x.strides[1]);
                }
            }
            for (i64 j = 0; j < hist; ++j) st(state, off3(state, slot, j, c), tail[j]);
        }
    }
}

// Decode and speculative decode, one thread per (request, channel): inputs are the history at
// row a-1 followed by the n new tokens; writes (history ++ x)[1..] into rows 0..W-2+n.
extern "C" __global__ void kda_conv_update(const Status* status, View x, View weight,
                                           View state_slots, View accepted, View state, View y,
                                           i64 batch, i64 n, i64 channels, i64 width) {
    if (stream_failed(status)) return;
    i64 hist = width - 1;
    for (i64 i = global_thread(); i < batch * channels; i += grid_threads()) {
        i64 b = i / channels, c = i % channels;
        int slot = ld_i32(state_slots, b);
        if (slot < 0) {
            for (i64 t = 0; t < n; ++t) st(y, off3(y, b, t, c), 0.0f);
            continue;
        }
        if (n == 0) continue;  // no new tokens: the state keeps its history
        int a = accepted.ptr == 0 ? 1 : ld_i32(accepted, b);
        float in[MAX_CONV_WINDOW];
        for (i64 j = 0; j < hist; ++j) in[j] = ld(state, off3(state, slot, a - 1 + j, c));
        for (i64 t = 0; t < n; ++t) in[hist + t] = ld(x, off3(x, b, t, c));
        for (i64 t = 0; t < n; ++t) {
            float acc = 0.0f;
            for (i64 j = 0; j < width; ++j) {
                acc += ld(weight, c * weight.strides[0] + j * weight.strides[1]) * in[t + j];
            }
            st(y, off3(y, b, t, c), silu(acc));
        }
        for (i64 j = 0; j + 1 < hist + n; ++j) st(state, off3(state, slot, j, c), in[j + 1]);
    }
}

// ---- the delta-rule recurrence ------------------------------------------------------------------
//
// Rows of the v-first state S^T [V, K] evolve independently given a token's q, k, g, beta: one
// warp owns one row r, its K entries spread over the lanes, for the whole sequence.

struct Token {
    float q[MAX_KEY_PER_LANE], k[MAX_KEY_PER_LANE], g[MAX_KEY_PER_LANE];
};

// Load q, k, g of one token and head (offsets of element 0 given), normalised and scaled as
// the reference: q = q * inv * scale (or q * scale), k = k * inv.
__device__ __forceinline__ void load_token(Token& tk, const View& q, i64 qo, const View& k, i64 ko,
                                           const View& g, i64 go, i64 kd, float scale, bool l2) {
    int lane = threadIdx.x & 31;
    float qs = 0.0f, ks = 0.0f;
#pragma unroll
    for (int i = 0; i < MAX_KEY_PER_LANE; ++i) {
        i64 j = lane + 32 * i;
        bool in = j < kd;
        tk.q[i] = in ? ld(q, qo + j * q.strides[q.rank - 1]) : 0.0f;
        tk.k[i] = in ? ld(k, ko + j * k.strides[k.rank - 1]) : 0.0f;
        tk.g[i] = in ? ld(g, go + j * g.strides[g.rank - 1]) : 0.0f;
        qs += tk.q[i] * tk.q[i];
        ks += tk.k[i] * tk.k[i];
    }
    if (l2) {
        float qi = 1.0f / sqrtf(warp_sum(qs) + 1e-6f);
        float ki = 1.0f / sqrtf(warp_sum(ks) + 1e-6f);
#pragma unroll
        for (int i = 0; i < MAX_KEY_PER_LANE; ++i) {
            tk.q[i] = tk.q[i] * qi * scale;
            tk.k[i] = tk.k[i] * ki * 1.0f;
        }
    } else {
#pragma unroll
        for (int i = 0; i < MAX_KEY_PER_LANE; ++i) tk.q[i] = tk.q[i] * scale;
    }
}

// One token through one state row s (this lane's entries): decay, delta update, output.
__device__ __forceinline__ float step_row(float* s, const Token& tk, float v, float beta, i64 kd) {
    int lane = threadIdx.x & 31;
    float dot = 0.0f;
#pragma unroll
    for (int i = 0; i < MAX_KEY_PER_LANE; ++i) {
        if (lane + 32 * i < kd) s[i] *= expf(tk.g[i]);
        dot += s[i] * tk.k[i];
    }
    float u = beta * (v - warp_sum(dot));
    float o = 0.0f;
#pragma unroll
    for (int i = 0; i < MAX_KEY_PER_LANE; ++i) {
        s[i] += tk.k[i] * u;
        o += s[i] * tk.q[i];
    }
    return warp_sum(o);
}

__device__ __forceinline__ void load_row(float* s, const View& state, i64 slot, i64 h, i64 r, i64 kd) {
    int lane = threadIdx.x & 31;
#pragma unroll
    for (int i = 0; i < MAX_KEY_PER_LANE; ++i) {
        i64 j = lane + 32 * i;
        s[i] = j < kd ? ((const float*)state.ptr)[off4(state, slot, h, r, j)] : 0.0f;
    }
}

__device__ __forceinline__ void store_row(const float* s, const View& state, i64 slot, i64 h, i64 r,
                                          i64 kd) {
    int lane = threadIdx.x & 31;
#pragma unroll
    for (int i = 0; i < MAX_KEY_PER_LANE; ++i) {
        i64 j = lane + 32 * i;
        if (j < kd) ((float*)state.ptr)[off4(state, slot, h, r, j)] = s[i];
    }
}

// Decode / speculative decode. Grid (ceil(V / ROWS_PER_BLOCK), H, B), a warp per state row.
extern "C" __global__ void kda_recurrent(const Status* status, View q, View k, View v, View g,
                                         View beta, View state_slots, View accepted, View state,
                                         View o, i64 n, i64 kd, i64 vd, float scale, int l2) {
    if (stream_failed(status)) return;
    i64 r = (i64)blockIdx.x * ROWS_PER_BLOCK + threadIdx.x / 32;
    i64 h = blockIdx.y, b = blockIdx.z;
    if (r >= vd || n == 0) return;
    int lane = threadIdx.x & 31;
    const int* slots = (const int*)state_slots.ptr;
    i64 srow = b * state_slots.strides[0];
    int a = accepted.ptr == 0 ? 1 : ld_i32(accepted, b);
    int first = slots[srow + (a - 1) * state_slots.strides[1]];
    if (first < 0) {
        if (lane == 0) for (i64 t = 0; t < n; ++t) st(o, off4(o, b, t, h, r), 0.0f);
        return;
    }
    float s[MAX_KEY_PER_LANE];
    load_row(s, state, first, h, r, kd);
    Token tk;
    for (i64 t = 0; t < n; ++t) {
        load_token(tk, q, off4(q, b, t, h, 0), k, off4(k, b, t, h, 0), g, off4(g, b, t, h, 0), kd,
                   scale, l2 != 0);
        float vv = ld(v, off4(v, b, t, h, r));
        float bt = ld(beta, off3(beta, b, t, h));
        float out = step_row(s, tk, vv, bt, kd);
        if (lane == 0) st(o, off4(o, b, t, h, r), out);
        int keep = slots[srow + t * state_slots.strides[1]];
        if (keep >= 0) store_row(s, state, keep, h, r, kd);
    }
}

// Prefill over a flat batch, token by token (exact recurrence order; agrees with the chunked
// form within fp32 rounding). Grid (ceil(V / ROWS_PER_BLOCK), H, B). With gate_form other than
// GATE_NONE, g holds raw logits, activated as they are loaded (gate_value, as kda_gate).
extern "C" __global__ void kda_chunk(const Status* status, View q, View k, View v, View g,
                                     View beta, View cu_seqlens, View state_slots,
                                     View has_initial, View state, View o, i64 kd, i64 vd,
                                     float scale, int l2, View a_log, View dt_bias, int gate_form,
                                     float lower_bound) {
    if (stream_failed(status)) return;
    i64 r = (i64)blockIdx.x * ROWS_PER_BLOCK + threadIdx.x / 32;
    i64 h = blockIdx.y, b = blockIdx.z;
    if (r >= vd) return;
    int lane = threadIdx.x & 31;
    i64 start = ld_i32(cu_seqlens, b), end = ld_i32(cu_seqlens, b + 1);
    int slot = ld_i32(state_slots, b);
    if (slot < 0) {
        if (lane == 0) for (i64 t = start; t < end; ++t) st(o, off3(o, t, h, r), 0.0f);
        return;
    }
    float s[MAX_KEY_PER_LANE];
    if (ld_i32(has_initial, b) != 0) {
        load_row(s, state, slot, h, r, kd);
    } else {
#pragma unroll
        for (int i = 0; i < MAX_KEY_PER_LANE; ++i) s[i] = 0.0f;
    }
    Token tk;
    for (i64 t = start; t < end; ++t) {
        load_token(tk, q, off3(q, t, h, 0), k, off3(k, t, h, 0), g, off3(g, t, h, 0), kd, scale,
                   l2 != 0);
        if (gate_form != GATE_NONE) {
#pragma unroll
            for (int i = 0; i < MAX_KEY_PER_LANE; ++i) {
                i64 j = lane + 32 * i;
                if (j < kd) tk.g[i] = gate_value(tk.g[i], a_log, dt_bias, h, j, gate_form, lower_bound);
            }
        }
        float out = step_row(s, tk, ld(v, off3(v, t, h, r)), ld(beta, t * beta.strides[0] + h * beta.strides[1]), kd);
        if (lane == 0) st(o, off3(o, t, h, r), out);
    }
    store_row(s, state, slot, h, r, kd);
}
