// The KDA recurrence through ggml's `ggml_gated_delta_net` with a per-channel gate (the CPU
// kernel llama.cpp runs for Kimi Linear, `src/models/kimi-linear.cpp`), as a small shared
// library that `peer.py` loads with ctypes, so that ggml and `kda.core` are timed alternately
// in one process on the same inputs (`cargo xtask bench`, `xtask/src/peer.rs`).
//
// flash-linear-attention's row-major `[B, T, H, D]` is ggml's `ne = [D, H, T, B]`, so q, k, v,
// g and beta are copied as they are; ggml's state is v-first (`[B, H, V, K]` row-major), the
// caller transposes. Only `ggml_graph_compute` is timed: the copies in and out are not.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ggml-cpu.h"
#include "ggml.h"

struct peer {
    struct ggml_context *ctx;
    struct ggml_cgraph *graph;
    struct ggml_threadpool *pool;
    struct ggml_cplan plan;
    struct ggml_tensor *q, *k, *v, *g, *beta, *state, *out;
    int64_t b, t, h, d;
};

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

// A graph of one `ggml_gated_delta_net` for `b` sequences of `t` tokens, `h` heads of `d`, run
// by a pool of `threads` threads; NULL on failure.
struct peer *peer_new(int64_t b, int64_t t, int64_t h, int64_t d, int threads) {
    struct peer *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    p->b = b, p->t = t, p->h = h, p->d = d;
    size_t floats = (size_t)(4 * b * t * h * d + b * t * h + b * h * d * d +
                             d * h * (t * b + d * b));
    struct ggml_init_params params = {
        .mem_size = floats * sizeof(float) + 64 * ggml_tensor_overhead() + ggml_graph_overhead(),
        .mem_buffer = NULL,
        .no_alloc = false,
    };
    p->ctx = ggml_init(params);
    if (!p->ctx) return free(p), NULL;
    p->q = ggml_new_tensor_4d(p->ctx, GGML_TYPE_F32, d, h, t, b);
    p->k = ggml_new_tensor_4d(p->ctx, GGML_TYPE_F32, d, h, t, b);
    p->v = ggml_new_tensor_4d(p->ctx, GGML_TYPE_F32, d, h, t, b);
    p->g = ggml_new_tensor_4d(p->ctx, GGML_TYPE_F32, d, h, t, b);
    p->beta = ggml_new_tensor_4d(p->ctx, GGML_TYPE_F32, 1, h, t, b);
    p->state = ggml_new_tensor_4d(p->ctx, GGML_TYPE_F32, d, d, h, b);
    p->out = ggml_gated_delta_net(p->ctx, p->q, p->k, p->v, p->g, p->beta, p->state, 1);
    p->graph = ggml_new_graph(p->ctx);
    ggml_build_forward_expand(p->graph, p->out);
    struct ggml_threadpool_params tpp = ggml_threadpool_params_default(threads);
    p->pool = ggml_threadpool_new(&tpp);
    if (!p->pool) return ggml_free(p->ctx), free(p), NULL;
    p->plan = ggml_graph_plan(p->graph, threads, p->pool);
    if (p->plan.work_size > 0) {
        p->plan.work_data = malloc(p->plan.work_size);
        if (!p->plan.work_data) {
            ggml_threadpool_free(p->pool);
            ggml_free(p->ctx);
            free(p);
            return NULL;
        }
    }
    return p;
}

// Copy the inputs in, compute, copy `o` (`[B, T, H, D]`) and the v-first final state out;
// returns the seconds `ggml_graph_compute` took, or a negative number on failure.
double peer_run(struct peer *p, const float *q, const float *k, const float *v, const float *g,
                const float *beta, const float *state_vfirst, float *o, float *state_out) {
    size_t n = (size_t)(p->b * p->t * p->h * p->d), s = (size_t)(p->b * p->h * p->d * p->d);
    memcpy(p->q->data, q, n * sizeof(float));
    memcpy(p->k->data, k, n * sizeof(float));
    memcpy(p->v->data, v, n * sizeof(float));
    memcpy(p->g->data, g, n * sizeof(float));
    memcpy(p->beta->data, beta, (size_t)(p->b * p->t * p->h) * sizeof(float));
    memcpy(p->state->data, state_vfirst, s * sizeof(float));
    double start = now();
    enum ggml_status status = ggml_graph_compute(p->graph, &p->plan);
    double seconds = now() - start;
    if (status != GGML_STATUS_SUCCESS) return -1.0;
    memcpy(o, p->out->data, n * sizeof(float));
    memcpy(state_out, (const float *)p->out->data + n, s * sizeof(float));
    return seconds;
}

void peer_free(struct peer *p) {
    if (!p) return;
    free(p->plan.work_data);
    ggml_threadpool_free(p->pool);
    ggml_free(p->ctx);
    free(p);
}
