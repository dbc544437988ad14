/* kda: Kimi Delta Attention for inference engines. Generated from crates/kda-capi/src by cbindgen; do not edit (see docs/embedding.md). */

#ifndef KDA_H
#define KDA_H

#include <stddef.h>
#include <stdint.h>

// What a call returned.
typedef enum KdaStatus {
  KDA_STATUS_OK = 0,
  // An argument that is not one of the accepted values (a backend name, a dtype code), or a
  // null pointer where one is required.
  KDA_STATUS_ERROR_ARGUMENT = 1,
  // A tensor of the wrong shape, dtype or layout, or a cache of another layer.
  KDA_STATUS_ERROR_SHAPE = 2,
  // Batch metadata that is malformed or does not fit the cache.
  KDA_STATUS_ERROR_METADATA = 3,
  // A checkpoint that cannot be read or does not hold the layer.
  KDA_STATUS_ERROR_CHECKPOINT = 4,
  // What this backend or build cannot do.
  KDA_STATUS_ERROR_UNSUPPORTED = 5,
  // A device call or an op failed.
  KDA_STATUS_ERROR_BACKEND = 6,
  // A bug in kda (a panic caught at the boundary).
  KDA_STATUS_ERROR_INTERNAL = 7,
} KdaStatus;

// Element types of the arrays a forward reads and writes (pass as `int32_t`).
typedef enum KdaDtype {
  KDA_DTYPE_F32 = 0,
  KDA_DTYPE_BF16 = 1,
  KDA_DTYPE_F16 = 2,
} KdaDtype;

// The projection schedules (pass as `int32_t`).
typedef enum KdaSchedule {
  KDA_SCHEDULE_SERIAL = 0,
  KDA_SCHEDULE_OVERLAPPED = 1,
} KdaSchedule;

// The layouts of an engine's state cache (pass as `int32_t`); `N` slots, `C = 3 lp` channels
// (q | k | v), `L = W - 1 + num_spec`.
typedef enum KdaCacheLayout {
  // vLLM's default ("SD"): conv `[N, L, C]`, recurrent `[N, lh, V, K]` f32.
  KDA_CACHE_LAYOUT_VLLM = 0,
  // vLLM with `VLLM_SSM_CONV_STATE_LAYOUT=DS`: conv `[N, C, L]`, recurrent `[N, lh, V, K]`.
  KDA_CACHE_LAYOUT_VLLM_DIM_FIRST = 1,
  // transformers' `DynamicCache`: conv `[N, C, W]`, recurrent `[N, lh, K, V]` f32.
  KDA_CACHE_LAYOUT_TRANSFORMERS = 2,
} KdaCacheLayout;

// Element types of weights (pass as `int32_t`): the three floats of `KdaDtype`, and bytes for
// MXFP8 data (E4M3) and scales (E8M0).
typedef enum KdaWeightDtype {
  KDA_WEIGHT_DTYPE_F32 = 0,
  KDA_WEIGHT_DTYPE_BF16 = 1,
  KDA_WEIGHT_DTYPE_F16 = 2,
  KDA_WEIGHT_DTYPE_U8 = 3,
} KdaWeightDtype;

// A backend instance (`kda_backend_create`), shared by the layers loaded on it.
typedef struct KdaBackend KdaBackend;

// A layer's per-slot state (`kda_cache_create`).
typedef struct KdaCache KdaCache;

// One KDA layer of a checkpoint for one TP rank (`kda_layer_load`).
typedef struct KdaLayer KdaLayer;

// The sizes of a loaded layer.
typedef struct KdaLayerInfo {
  size_t hidden_size;
  size_t local_heads;
  size_t head_dim;
  size_t conv_width;
} KdaLayerInfo;

// One step's batch metadata, arrays as vLLM keeps them (int32). Request `r` owns rows
// `query_start_loc[r] .. query_start_loc[r + 1]` of the hidden states. kda checks the counts
// before it reads an array they size (an impossible count is `KDA_STATUS_ERROR_METADATA`
// naming it, its value and its bound) and every value it reads; that each array holds the
// entries its counts say is the caller's contract (`docs/embedding.md`, "What kda checks").
typedef struct KdaBatch {
  // Requests `R`, at most `num_tokens` (every request has a token).
  size_t num_requests;
  // `[R + 1]` offsets, starting at 0, strictly increasing, at most `num_tokens`; NULL only
  // with `R` = 0.
  const int32_t *query_start_loc;
  // `[R]` tokens each request already processed (0: fresh), or NULL: all fresh.
  const int32_t *num_computed_tokens;
  // `[R]` each request's state slot (`0 ..` the cache's slots), or NULL: request `r` uses
  // slot `r`.
  const int32_t *slots;
  // Speculative tokens per step (`num_spec`), at most the cache's; 0 without speculative
  // decoding.
  size_t num_spec;
  // `[R, num_spec + 1]` slot lists (`0 ..` the cache's slots), read for the speculative
  // requests only; NULL without any.
  const int32_t *spec_slots;
  // `[R]` tokens the previous step accepted; `> 0` marks request `r` speculative (it then
  // uses row `r` of `spec_slots`); NULL without speculative requests.
  const int32_t *num_accepted_tokens;
} KdaBatch;

// One named weight of `kda_layer_from_weights`: a dense row-major host array.
typedef struct KdaWeight {
  // The checkpoint's name (`model.layers.0.self_attn.q_proj.weight`), NUL-terminated.
  const char *name;
  // The elements, row-major.
  const void *data;
  // A `KdaWeightDtype`.
  int32_t dtype;
  // Dimensions.
  size_t rank;
  // `[rank]` sizes.
  const size_t *shape;
} KdaWeight;

#ifdef __cplusplus
extern "C" {
#endif // __cplusplus

// kda's version, `"major.minor.patch"` (a static string).
const char *kda_version(void);

// The message of the last call on this thread that failed (empty if none has): the Rust
// error's text, naming the parameter, the expected and the actual value. Valid until the next
// failing call on this thread.
const char *kda_last_error(void);

// Create the backend `name` (`"reference"`, or `"cuda"` / `"ascend"` where built with them) on
// device `device` (ignored by the reference) into `*out`.
//
// # Safety
// `name` is a NUL-terminated string; `out` is valid for a write.
enum KdaStatus kda_backend_create(const char *name, int64_t device, struct KdaBackend **out);

// Destroy a backend (layers loaded on it keep it alive until they are destroyed). NULL is a
// no-op.
//
// # Safety
// `backend` is NULL or a live handle, not used afterwards.
void kda_backend_destroy(struct KdaBackend *backend);

// Load layer `layer` of the HF-style checkpoint in directory `checkpoint_dir` for TP rank
// `tp_rank` of `tp_size` on `backend`, with the projection `schedule` (a `KdaSchedule`), into
// `*out`.
//
// # Safety
// `backend` is a live handle; `checkpoint_dir` a NUL-terminated string; `out` valid for a
// write.
enum KdaStatus kda_layer_load(const struct KdaBackend *backend,
                              const char *checkpoint_dir,
                              size_t layer,
                              size_t tp_size,
                              size_t tp_rank,
                              int32_t schedule,
                              struct KdaLayer **out);

// Destroy a layer. NULL is a no-op.
//
// # Safety
// `layer` is NULL or a live handle, not used afterwards (nor by a call still running).
void kda_layer_destroy(struct KdaLayer *layer);

// The sizes of `layer` into `*out`.
//
// # Safety
// `layer` is a live handle; `out` valid for a write.
enum KdaStatus kda_layer_info(const struct KdaLayer *layer, struct KdaLayerInfo *out);

// A zeroed cache for `layer` of `num_slots` slots with room for `num_spec` speculative tokens
// per step, into `*out`.
//
// # Safety
// `layer` is a live handle; `out` valid for a write.
enum KdaStatus kda_cache_create(const struct KdaLayer *layer,
                                size_t num_slots,
                                size_t num_spec,
                                struct KdaCache **out);

// Destroy a cache. NULL is a no-op.
//
// # Safety
// `cache` is NULL or a live handle, not used afterwards.
void kda_cache_destroy(struct KdaCache *cache);

// Run `layer` on `hidden_states` (`[num_tokens, hidden_size]` row-major, `hidden_dtype` a
// `KdaDtype`: bf16 or f32) for `batch`, reading and updating `cache`, and write this rank's
// partial output (before the all-reduce) into `out` (`[num_tokens, hidden_size]` row-major,
// `out_dtype` f32, bf16 or f16). Both arrays are used in place: host memory on the reference
// backend, device memory of the layer's device on the others. `stream` 0: kda's own stream,
// and the call returns with `out` and the cache complete; otherwise the engine's stream
// (`CUstream`, `aclrtStream`) on a device backend: the work is queued on it, in its order, and
// the call returns at once. A rejected call changes neither `out` nor the cache.
//
// Checked before anything is read: the dtype codes, that `num_tokens` rows fit the address
// space, the batch's counts against their bounds (`KdaBatch`), then every value read.
//
// # Safety
// `layer`, `cache` and `batch` are live; `batch`'s arrays hold the entries its counts say
// (whenever those pass the checks); `hidden_states` and `out` point to arrays of the
// sizes above, aligned to 4 bytes, valid until the work completes (the call's return with
// `stream` 0, else the engine stream passing it), untouched by others meanwhile; `stream`
// is 0 or a live stream of the layer's device that outlives the backend (kda imports it once
// and keeps it).
enum KdaStatus kda_layer_forward(const struct KdaLayer *layer,
                                 const struct KdaCache *cache,
                                 const void *hidden_states,
                                 int32_t hidden_dtype,
                                 size_t num_tokens,
                                 const struct KdaBatch *batch,
                                 void *out,
                                 int32_t out_dtype,
                                 size_t stream);

// Slot `slot`'s recurrent state of `cache` (`[local_heads, head_dim, head_dim]` f32, v-first:
// `[lh, V, K]`) into `out`, which holds `len` floats (exactly that many), once kda's own
// stream has finished (after a forward on an engine stream, synchronize that stream first).
//
// # Safety
// `layer` and `cache` are live; `out` is valid for `len` float writes.
enum KdaStatus kda_cache_recurrent_state(const struct KdaLayer *layer,
                                         const struct KdaCache *cache,
                                         size_t slot,
                                         float *out,
                                         size_t len);

// A cache for `layer` over the engine's own state arrays, used in place (kda reads and writes
// them where they lie, never copies them): `conv_state` (`conv_dtype` a `KdaDtype`) and
// `recurrent_state` (f32), dense row-major in `layout` (a `KdaCacheLayout`) with `num_slots`
// slots and room for `num_spec` speculative tokens (vLLM layouts only), into `*out`. The
// engine keeps both arrays alive while the cache is used. Reference backend only (a device
// backend refuses it with `KDA_STATUS_ERROR_UNSUPPORTED` at the first forward).
//
// # Safety
// `layer` is live; the arrays hold the elements the layout gives, 4-byte aligned, valid and
// untouched by others while the cache is used; `out` is valid for a write.
enum KdaStatus kda_cache_wrap(const struct KdaLayer *layer,
                              void *conv_state,
                              int32_t conv_dtype,
                              void *recurrent_state,
                              int32_t layout,
                              size_t num_slots,
                              size_t num_spec,
                              struct KdaCache **out);

// Slot `slot`'s conv history of `cache` (`[conv_width - 1, 3 * local_heads * head_dim]` f32,
// q | k | v channels, oldest input first) into `out`, which holds `len` floats (exactly that
// many), once kda's own stream has finished.
//
// # Safety
// `layer` and `cache` are live; `out` is valid for `len` float writes.
enum KdaStatus kda_cache_conv_state(const struct KdaLayer *layer,
                                    const struct KdaCache *cache,
                                    size_t slot,
                                    float *out,
                                    size_t len);

// `kda_layer_forward`, also keeping prefix-cache states: `keep_states` holds `num_keep`
// `(request, position, slot)` int32 triples; for each, the state of prefill request `request`
// after `position` tokens of its sequence (counting `num_computed_tokens`:
// `num_computed_tokens + 64 j` or the request's end) is written into cache slot `slot`, both
// the recurrent and the conv halves (`docs/design/kda.md#chunk-boundary-states`). A bad triple
// is `KDA_STATUS_ERROR_METADATA` and nothing runs.
//
// # Safety
// As `kda_layer_forward`; `keep_states` is NULL (with `num_keep` 0) or valid for
// `3 * num_keep` reads.
enum KdaStatus kda_layer_forward_keeping_states(const struct KdaLayer *layer,
                                                const struct KdaCache *cache,
                                                const void *hidden_states,
                                                int32_t hidden_dtype,
                                                size_t num_tokens,
                                                const struct KdaBatch *batch,
                                                const int32_t *keep_states,
                                                size_t num_keep,
                                                void *out,
                                                int32_t out_dtype,
                                                size_t stream);

// Build layer `layer` for TP rank `tp_rank` of `tp_size` on `backend` from weights in host
// memory, into `*out`: `config_json` is the model's `config.json` text, `weights` a table of
// `num_weights` named arrays (the checkpoint's names), read in place. The same checks and the
// same fused BFG as `kda_layer_load`: the same layer, bit for bit.
//
// # Safety
// `backend` is live; `config_json` a NUL-terminated string; `weights` valid for `num_weights`
// entries whose names are NUL-terminated, shapes valid for `rank` reads and data valid for
// the elements they give, during the call; `out` valid for a write.
enum KdaStatus kda_layer_from_weights(const struct KdaBackend *backend,
                                      const char *config_json,
                                      const struct KdaWeight *weights,
                                      size_t num_weights,
                                      size_t layer,
                                      size_t tp_size,
                                      size_t tp_rank,
                                      int32_t schedule,
                                      struct KdaLayer **out);

#ifdef __cplusplus
}  // extern "C"
#endif  // __cplusplus

#endif  /* KDA_H */
