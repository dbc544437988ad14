/* kda from C: load layer 0 of a checkpoint on disk, run a prefill of two requests and one
 * decode step, and print a checksum of the outputs; then run the same steps on the engine's own
 * cache arrays (vLLM's layout, used in place by kda_cache_wrap) and print their checksum too.
 *
 *   kda_example CHECKPOINT_DIR
 *
 * The checkpoint is any HF-style KDA checkpoint; tests write a synthetic one (see
 * docs/embedding.md). Build against the kda-capi library (cargo build --release -p kda-capi):
 *
 *   cc -std=c99 -I crates/kda-capi/include examples/c/kda_example.c \
 *      -L target/release -lkda_capi -Wl,-rpath,$PWD/target/release -o kda_example
 *
 * The inputs are exact in f32 (multiples of 2^-16 from a fixed LCG), so the same run through
 * the Rust API gives the same bits: crates/kda-capi/tests/c_example.rs checks the checksum.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kda.h"

#define CHECK(call)                                                                   \
    do {                                                                              \
        KdaStatus status_ = (call);                                                   \
        if (status_ != KDA_STATUS_OK) {                                               \
            fprintf(stderr, "%s failed (status %d): %s\n", #call, (int)status_,       \
                    kda_last_error());                                                \
            return 1;                                                                 \
        }                                                                             \
    } while (0)

/* Hidden-state values: an LCG, each value a multiple of 2^-16 in [-0.5, 0.5). */
static uint32_t lcg_state = 12345u;
static float next_value(void) {
    lcg_state = lcg_state * 1664525u + 1013904223u;
    return (float)((lcg_state >> 16) & 0xFFFFu) / 65536.0f - 0.5f;
}

/* Sum (in order, as double) and FNV-1a of the bytes of the outputs. */
static double sum = 0.0;
static uint64_t fnv = 0xcbf29ce484222325ull;
static void add_to_checksum(const float *values, size_t n) {
    for (size_t i = 0; i < n; i++) {
        sum += (double)values[i];
        unsigned char bytes[4];
        memcpy(bytes, &values[i], 4);
        for (int b = 0; b < 4; b++) {
            fnv ^= bytes[b];
            fnv *= 0x100000001b3ull;
        }
    }
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s CHECKPOINT_DIR\n", argv[0]);
        return 2;
    }
    KdaBackend *backend = NULL;
    KdaLayer *layer = NULL;
    KdaCache *cache = NULL;
    CHECK(kda_backend_create("reference", 0, &backend));
    CHECK(kda_layer_load(backend, argv[1], 0, 1, 0, KDA_SCHEDULE_OVERLAPPED, &layer));
    KdaLayerInfo info;
    CHECK(kda_layer_info(layer, &info));
    CHECK(kda_cache_create(layer, 2, 0, &cache));
    printf("kda %s: layer 0 (hidden %zu, %zu heads of %zu) on the reference backend\n",
           kda_version(), info.hidden_size, info.local_heads, info.head_dim);

    /* Prefill: request 0 has 5 tokens (slot 1), request 1 has 3 (slot 0). */
    const size_t hidden = info.hidden_size, prefill_tokens = 8;
    float *x = malloc(prefill_tokens * hidden * sizeof(float));
    float *out = malloc(prefill_tokens * hidden * sizeof(float));
    if (!x || !out) return 1;
    for (size_t i = 0; i < prefill_tokens * hidden; i++) x[i] = next_value();
    float *prefill_x = malloc(prefill_tokens * hidden * sizeof(float));
    float *decode_x = malloc(2 * hidden * sizeof(float));
    if (!prefill_x || !decode_x) return 1;
    memcpy(prefill_x, x, prefill_tokens * hidden * sizeof(float));
    const int32_t prefill_qsl[3] = {0, 5, 8};
    const int32_t slots[2] = {1, 0};
    KdaBatch prefill = {2, prefill_qsl, NULL, slots, 0, NULL, NULL};
    CHECK(kda_layer_forward(layer, cache, x, KDA_DTYPE_F32, prefill_tokens, &prefill, out,
                            KDA_DTYPE_F32, 0));
    add_to_checksum(out, prefill_tokens * hidden);
    printf("prefill: 2 requests (5 + 3 tokens)\n");

    /* Decode: one more token per request, continuing from the cached state. */
    for (size_t i = 0; i < 2 * hidden; i++) x[i] = next_value();
    memcpy(decode_x, x, 2 * hidden * sizeof(float));
    const int32_t decode_qsl[3] = {0, 1, 2};
    const int32_t computed[2] = {5, 3};
    KdaBatch decode = {2, decode_qsl, computed, slots, 0, NULL, NULL};
    CHECK(kda_layer_forward(layer, cache, x, KDA_DTYPE_F32, 2, &decode, out, KDA_DTYPE_F32, 0));
    add_to_checksum(out, 2 * hidden);
    printf("decode: 1 token per request\n");

    /* A rejected call: the slot is out of range, the message says which. */
    const int32_t bad_slots[2] = {1, 7};
    KdaBatch bad = {2, decode_qsl, computed, bad_slots, 0, NULL, NULL};
    KdaStatus status = kda_layer_forward(layer, cache, x, KDA_DTYPE_F32, 2, &bad, out,
                                         KDA_DTYPE_F32, 0);
    printf("rejected (status %d): %s\n", (int)status, kda_last_error());

    printf("checksum %.17g fnv1a %016llx\n", sum, (unsigned long long)fnv);

    /* The same two steps on the engine's own state arrays, in vLLM's layout: conv
     * [slots, W - 1, 3 lp] and recurrent [slots, lh, V, K], f32. kda updates them in place. */
    const size_t channels = 3 * info.local_heads * info.head_dim, rows = info.conv_width - 1;
    const size_t state_len = info.local_heads * info.head_dim * info.head_dim;
    float *conv = calloc(2 * rows * channels, sizeof(float));
    float *recurrent = calloc(2 * state_len, sizeof(float));
    float *own_state = malloc(state_len * sizeof(float));
    if (!conv || !recurrent || !own_state) return 1;
    KdaCache *wrapped = NULL;
    CHECK(kda_cache_wrap(layer, conv, KDA_DTYPE_F32, recurrent, KDA_CACHE_LAYOUT_VLLM, 2, 0,
                         &wrapped));
    sum = 0.0;
    fnv = 0xcbf29ce484222325ull;
    CHECK(kda_layer_forward(layer, wrapped, prefill_x, KDA_DTYPE_F32, prefill_tokens, &prefill,
                            out, KDA_DTYPE_F32, 0));
    add_to_checksum(out, prefill_tokens * hidden);
    CHECK(kda_layer_forward(layer, wrapped, decode_x, KDA_DTYPE_F32, 2, &decode, out,
                            KDA_DTYPE_F32, 0));
    add_to_checksum(out, 2 * hidden);
    printf("wrapped checksum %.17g fnv1a %016llx\n", sum, (unsigned long long)fnv);
    /* Slot 1's state, read from the engine's array, is kda's own cache's bit for bit. */
    CHECK(kda_cache_recurrent_state(layer, cache, 1, own_state, state_len));
    int same = memcmp(own_state, recurrent + state_len, state_len * sizeof(float)) == 0;
    printf("wrapped recurrent state: %s\n", same ? "same bits as kda's cache" : "differs");

    kda_cache_destroy(wrapped);
    free(conv);
    free(recurrent);
    free(own_state);
    free(prefill_x);
    free(decode_x);
    kda_cache_destroy(cache);
    kda_layer_destroy(layer);
    kda_backend_destroy(backend);
    free(x);
    free(out);
    return status == KDA_STATUS_ERROR_METADATA && same ? 0 : 1;
}
