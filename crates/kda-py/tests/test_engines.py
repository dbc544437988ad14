"""kda inside an engine's own memory: weights from memory, the engine's cache in place, and
prefix-cache states (keep_states), each against kda's own path (load, its own cache, a prefill
cut at the same position)."""

import glob
import json
import os

import numpy as np
import pytest

import kda
from conftest import assert_close, hidden

ml_dtypes = pytest.importorskip("ml_dtypes")

_SAFETENSORS = {
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I32": np.int32,
    "U8": np.uint8,
    "F8_E4M3": np.uint8,
    "F8_E8M0": np.uint8,
}


def read_checkpoint(path):
    """(config dict, name -> numpy array) of a synthetic checkpoint, read with numpy alone."""
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    weights = {}
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        with open(file, "rb") as f:
            data = f.read()
        n = int.from_bytes(data[:8], "little")
        header = json.loads(data[8:8 + n])
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            start, end = entry["data_offsets"]
            raw = data[8 + n + start:8 + n + end]
            weights[name] = np.frombuffer(raw, dtype=_SAFETENSORS[entry["dtype"]]).reshape(
                entry["shape"]).copy()
    return config, weights


def run_steps(layer, cache, steps):
    return [layer.forward(x, qsl, cache, slots=slots, num_computed_tokens=nct)
            for x, qsl, slots, nct in steps]


def two_steps(layer, seed=0):
    """A prefill of 70 and 5 tokens (the first crosses a chunk boundary), then a decode."""
    w = layer.hidden_size
    return [
        (hidden(75, w, seed=seed), [0, 70, 75], [1, 0], None),
        (hidden(2, w, seed=seed + 1), [0, 1, 2], [1, 0], [70, 5]),
        (hidden(3, w, seed=seed + 2), [0, 3], [0], [6]),
    ]


# --- weights from memory -------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["checkpoint", "checkpoint_linear"])
@pytest.mark.parametrize("tp", [(1, 0), (2, 1)])
def test_from_weights_is_load_bit_for_bit(request, preset, tp):
    ckpt = request.getfixturevalue(preset)
    config, weights = read_checkpoint(ckpt)
    loaded = kda.Layer.load(ckpt, tp_size=tp[0], tp_rank=tp[1])
    built = kda.Layer.from_weights(config, weights, tp_size=tp[0], tp_rank=tp[1])
    assert built.local_heads == loaded.local_heads
    steps = two_steps(loaded)
    a, b = loaded.new_cache(2), built.new_cache(2)
    for x, y in zip(run_steps(loaded, a, steps), run_steps(built, b, steps)):
        assert np.array_equal(x, y)
    for s in range(2):
        assert np.array_equal(a.recurrent_state(s), b.recurrent_state(s))


def test_from_weights_takes_another_layer_index_and_a_json_config(checkpoint_linear):
    config, weights = read_checkpoint(checkpoint_linear)
    moved = {k.replace("model.layers.0.", "model.layers.3."): v for k, v in weights.items()}
    loaded = kda.Layer.load(checkpoint_linear)
    built = kda.Layer.from_weights(json.dumps(config), moved, layer=3)
    steps = two_steps(loaded, seed=7)
    for x, y in zip(run_steps(loaded, loaded.new_cache(2), steps),
                    run_steps(built, built.new_cache(2), steps)):
        assert np.array_equal(x, y)
    # Layer 0's names are not layer 3's.
    with pytest.raises(kda.CheckpointError, match="missing"):
        kda.Layer.from_weights(config, weights, layer=3)


def test_from_weights_checks_like_the_loader(checkpoint_linear):
    config, weights = read_checkpoint(checkpoint_linear)
    name = "model.layers.0.self_attn.f_b_proj.weight"
    bad = dict(weights)
    bad[name] = weights[name][:, :-1].copy()
    with pytest.raises(kda.CheckpointError, match="f_b_proj"):
        kda.Layer.from_weights(config, bad)
    missing = {k: v for k, v in weights.items() if "o_proj" not in k}
    with pytest.raises(kda.CheckpointError, match="o_proj"):
        kda.Layer.from_weights(config, missing)
    # A non-contiguous array is read (copied once); the result is the same layer.
    strided = dict(weights)
    w = weights["model.layers.0.self_attn.o_proj.weight"]
    strided["model.layers.0.self_attn.o_proj.weight"] = np.asfortranarray(w)
    a = kda.Layer.from_weights(config, weights)
    b = kda.Layer.from_weights(config, strided)
    x = hidden(4, a.hidden_size)
    assert np.array_equal(a.forward(x, [0, 4], a.new_cache(1)),
                          b.forward(x, [0, 4], b.new_cache(1)))


# --- the engine's cache in place -----------------------------------------------------------


def own_run(layer, steps, slots):
    cache = layer.new_cache(slots)
    outs = run_steps(layer, cache, steps)
    rec = np.stack([cache.recurrent_state(s) for s in range(slots)])
    conv = np.stack([cache.conv_state(s) for s in range(slots)])
    return outs, rec, conv


@pytest.mark.parametrize("orientation", ["SD", "DS"])
def test_vllm_layout_is_kdas_own_cache_bit_for_bit(checkpoint_linear, orientation):
    layer = kda.Layer.load(checkpoint_linear)
    lh, d, w = layer.local_heads, layer.head_dim, layer.conv_width
    steps = two_steps(layer, seed=11)
    outs, rec, conv = own_run(layer, steps, 3)
    c = 3 * lh * d
    conv_state = np.zeros((3, w - 1, c) if orientation == "SD" else (3, c, w - 1), np.float32)
    rec_state = np.zeros((3, lh, d, d), np.float32)
    cache = layer.wrap_cache(conv_state=conv_state, recurrent_state=rec_state, layout="vllm")
    for x, y in zip(outs, run_steps(layer, cache, steps)):
        assert np.array_equal(x, y)
    # kda wrote the engine's arrays themselves.
    assert np.array_equal(rec_state, rec)
    seen = conv_state if orientation == "SD" else conv_state.transpose(0, 2, 1)
    assert np.array_equal(seen, conv)
    assert np.array_equal(cache.conv_state(1), conv[1])


def test_an_older_vllms_k_first_state_wraps_as_a_transposed_view(checkpoint_linear):
    # Earlier vLLM releases index the recurrent state [N, lh, K, V] (docs/embedding.md): the
    # engine passes the transposed view, and kda writes the K-first array itself.
    layer = kda.Layer.load(checkpoint_linear)
    lh, d, w = layer.local_heads, layer.head_dim, layer.conv_width
    steps = two_steps(layer, seed=13)
    outs, rec, conv = own_run(layer, steps, 2)
    conv_state = np.zeros((2, w - 1, 3 * lh * d), np.float32)
    k_first = np.zeros((2, lh, d, d), np.float32)
    cache = layer.wrap_cache(conv_state, k_first.transpose(0, 1, 3, 2), layout="vllm")
    for x, y in zip(outs, run_steps(layer, cache, steps)):
        assert np.array_equal(x, y)
    assert np.array_equal(k_first.transpose(0, 1, 3, 2), rec)
    assert np.array_equal(conv_state, conv)


def test_vllm_layout_with_bf16_conv_states(checkpoint_linear):
    layer = kda.Layer.load(checkpoint_linear)
    lh, d, w = layer.local_heads, layer.head_dim, layer.conv_width
    # bf16 inputs: the conv history is bf16 in both caches, so bf16 conv states lose nothing.
    steps = [(x.astype(ml_dtypes.bfloat16), q, s, n) for x, q, s, n in two_steps(layer, 5)]
    outs, rec, conv = own_run(layer, steps, 2)
    conv_state = np.zeros((2, w - 1, 3 * lh * d), ml_dtypes.bfloat16)
    rec_state = np.zeros((2, lh, d, d), np.float32)
    cache = layer.wrap_cache(conv_state, rec_state, layout="vllm")
    for x, y in zip(outs, run_steps(layer, cache, steps)):
        assert np.array_equal(x, y)
    assert np.array_equal(conv_state.astype(np.float32), conv)
    assert np.array_equal(rec_state, rec)


def test_transformers_layout_is_kdas_own_cache_bit_for_bit(checkpoint_linear):
    layer = kda.Layer.load(checkpoint_linear)
    lh, d, w = layer.local_heads, layer.head_dim, layer.conv_width
    steps = two_steps(layer, seed=3)
    outs, rec, conv = own_run(layer, steps, 2)
    conv_state = np.zeros((2, 3 * lh * d, w), np.float32)   # DynamicCache keeps W inputs
    rec_state = np.zeros((2, lh, d, d), np.float32)          # [B, H, K, V]
    cache = layer.wrap_cache(conv_state, rec_state, layout="transformers")
    for x, y in zip(outs, run_steps(layer, cache, steps)):
        assert np.array_equal(x, y)
    assert np.array_equal(rec_state.transpose(0, 1, 3, 2), rec)
    assert np.array_equal(conv_state[:, :, 1:].transpose(0, 2, 1), conv)


def test_a_rejected_call_leaves_the_engines_tensors_unchanged(checkpoint_linear):
    layer = kda.Layer.load(checkpoint_linear)
    lh, d, w = layer.local_heads, layer.head_dim, layer.conv_width
    conv_state = np.full((2, w - 1, 3 * lh * d), 0.5, np.float32)
    rec_state = np.full((2, lh, d, d), 0.25, np.float32)
    with pytest.raises(kda.ShapeError, match="conv_state"):
        layer.wrap_cache(conv_state[:, :, 1:], rec_state)
    with pytest.raises(kda.ShapeError, match="recurrent_state"):
        layer.wrap_cache(conv_state, rec_state[:1])
    with pytest.raises(ValueError, match="layout"):
        layer.wrap_cache(conv_state, rec_state, layout="sglang")
    cache = layer.wrap_cache(conv_state, rec_state)
    x = hidden(4, layer.hidden_size)
    with pytest.raises(kda.MetadataError):
        layer.forward(x, [0, 4], cache, slots=[5])
    assert np.all(conv_state == 0.5) and np.all(rec_state == 0.25)


# --- prefix-cache states -------------------------------------------------------------------


def test_keep_states_equals_a_prefill_cut_at_the_position(checkpoint_linear):
    layer = kda.Layer.load(checkpoint_linear)
    x = hidden(150, layer.hidden_size, seed=21)
    cache = layer.new_cache(4)
    whole = layer.forward(x, [0, 150], cache, slots=[0], keep_states=[(0, 64, 1), (0, 128, 2)])
    for position, slot in [(64, 1), (128, 2)]:
        cut = layer.new_cache(1)
        layer.forward(x[:position], [0, position], cut, slots=[0])
        # The projections of a 64-row and a 150-row batch may round differently (the GEMM's
        # blocking depends on the rows), so the recurrent states agree to the layer tolerance;
        # the conv history is the projected inputs themselves.
        assert_close(cache.recurrent_state(slot), cut.recurrent_state(0))
        assert_close(cache.conv_state(slot), cut.conv_state(0))
    # A request sharing the prefix continues from the kept slot as the whole prefill did.
    rest = layer.forward(x[128:], [0, 22], cache, slots=[2], num_computed_tokens=[128])
    assert_close(rest, whole[128:])
    assert_close(cache.recurrent_state(2), cache.recurrent_state(0))


def test_keep_states_in_a_wrapped_cache(checkpoint_linear):
    layer = kda.Layer.load(checkpoint_linear)
    lh, d, w = layer.local_heads, layer.head_dim, layer.conv_width
    x = hidden(100, layer.hidden_size, seed=22)
    own = layer.new_cache(2)
    layer.forward(x, [0, 100], own, slots=[0], keep_states=[(0, 64, 1)])
    conv_state = np.zeros((2, 3 * lh * d, w), np.float32)
    rec_state = np.zeros((2, lh, d, d), np.float32)
    cache = layer.wrap_cache(conv_state, rec_state, layout="transformers")
    layer.forward(x, [0, 100], cache, slots=[0], keep_states=[(0, 64, 1)])
    assert np.array_equal(rec_state[1].transpose(0, 2, 1), own.recurrent_state(1))
    assert np.array_equal(cache.conv_state(1), own.conv_state(1))


@pytest.mark.parametrize("keep", [
    [(1, 64, 2)],          # no such request
    [(0, 50, 2)],          # not a chunk boundary nor the end
    [(0, 64, 0)],          # the request's own slot
    [(0, 64, 2), (0, 100, 2)],   # one slot twice
    [(0, -1, 2)],          # negative
])
def test_bad_keep_states_are_metadata_errors(checkpoint_linear, keep):
    layer = kda.Layer.load(checkpoint_linear)
    x = hidden(100, layer.hidden_size, seed=23)
    cache = layer.new_cache(4)
    with pytest.raises(kda.MetadataError):
        layer.forward(x, [0, 100], cache, slots=[0], keep_states=keep)
    assert np.all(cache.recurrent_state(2) == 0)
    with pytest.raises(TypeError, match="keep_states"):
        layer.forward(x, [0, 100], cache, slots=[0], keep_states=[(0, 64)])


def test_vllm_layout_with_speculative_slots(checkpoint):
    """Spec-decode slots as in forward_spec: the conv state has num_spec spare rows."""
    layer = kda.Layer.load(checkpoint)
    lh, d, w, num_spec = layer.local_heads, layer.head_dim, layer.conv_width, 2
    x0, x1, x2 = (hidden(n, layer.hidden_size, seed=s) for n, s in [(10, 20), (3, 21), (3, 22)])

    def run(cache):
        outs = [layer.forward(x0, [0, 10], cache, slots=[0])]
        outs.append(layer.forward_spec(x1, [0, 3], cache, [[0, 1, 2]], [10], [1]))
        outs.append(layer.forward_spec(x2, [0, 3], cache, [[0, 1, 2]], [12], [2]))
        return outs

    own = layer.new_cache(num_slots=4, num_spec=num_spec)
    conv_state = np.zeros((4, w - 1 + num_spec, 3 * lh * d), np.float32)
    rec_state = np.zeros((4, lh, d, d), np.float32)
    wrapped = layer.wrap_cache(conv_state, rec_state, layout="vllm", num_spec=num_spec)
    for a, b in zip(run(own), run(wrapped)):
        assert np.array_equal(a, b)
    for s in range(4):
        assert np.array_equal(rec_state[s], own.recurrent_state(s))
    with pytest.raises(kda.ShapeError, match="conv_state"):
        layer.wrap_cache(conv_state, rec_state, layout="vllm", num_spec=1)
