"""kda.Layer through Python against the same layer through the plain Rust API, bit for bit."""

import numpy as np
import pytest

import kda
from conftest import assert_close, hidden, states


def bf16():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    return ml_dtypes.bfloat16


@pytest.mark.parametrize("schedule", ["serial", "overlapped"])
@pytest.mark.parametrize("preset", ["checkpoint", "checkpoint_linear"])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_forward_equals_the_rust_layer_bit_for_bit(request, schedule, preset, dtype):
    ckpt = request.getfixturevalue(preset)
    layer = kda.Layer.load(ckpt, layer=0, tp_size=1, tp_rank=0, backend="reference",
                           schedule=schedule)
    assert layer.schedule == schedule and layer.backend == "reference"
    x = hidden(23, layer.hidden_size, seed=3)
    if dtype == "bf16":
        x = x.astype(bf16())
    qsl = [0, 5, 12, 20]  # three fresh prefills, rows 20..23 padding
    cache = layer.new_cache(num_slots=4)
    out = layer.forward(x, qsl, cache, slots=[2, 0, 3])
    assert out.shape == (23, layer.hidden_size) and out.dtype == np.float32
    assert np.all(out[20:] == 0.0)
    step = dict(hidden_states=x, query_start_loc=qsl, slots=[2, 0, 3])
    outputs, rust_states = kda._testing.reference_forward(
        ckpt, [step], schedule=schedule, num_slots=4)
    assert np.array_equal(out, outputs[0])
    assert np.array_equal(states(layer, cache), rust_states)


def test_the_partial_outputs_of_two_tp_ranks_sum_to_tp_1(checkpoint):
    x = hidden(9, 256, seed=4)
    qsl = [0, 9]
    full = kda.Layer.load(checkpoint, tp_size=1, tp_rank=0)
    whole = full.forward(x, qsl, full.new_cache(1))
    parts = []
    for rank in range(2):
        layer = kda.Layer.load(checkpoint, tp_size=2, tp_rank=rank)
        assert layer.local_heads == 2
        parts.append(layer.forward(x, qsl, layer.new_cache(1)))
        rust, _ = kda._testing.reference_forward(
            checkpoint, [dict(hidden_states=x, query_start_loc=qsl)], tp_size=2, tp_rank=rank,
            num_slots=1)
        assert np.array_equal(parts[-1], rust[0])
    assert_close(parts[0] + parts[1], whole)


def test_prefill_in_two_calls_equals_one_call(checkpoint):
    layer = kda.Layer.load(checkpoint)
    x = hidden(90, layer.hidden_size, seed=5)
    one = layer.new_cache(num_slots=2)
    whole = layer.forward(x, [0, 90], one, slots=[1])
    two = layer.new_cache(num_slots=2)
    first = layer.forward(x[:70], [0, 70], two, slots=[1])
    second = layer.forward(x[70:], [0, 20], two, slots=[1], num_computed_tokens=[70])
    assert_close(np.concatenate([first, second]), whole)
    assert_close(two.recurrent_state(1), one.recurrent_state(1))
    # And the second call really continued from the cached state.
    fresh = layer.forward(x[70:], [0, 20], layer.new_cache(num_slots=2), slots=[1])
    assert not np.allclose(fresh, second, rtol=1 / 256, atol=np.abs(second).max() / 256)


def test_decode_steps_continue_through_num_computed_tokens(checkpoint):
    layer = kda.Layer.load(checkpoint)
    prompt = [7, 11]
    steps_n = 4
    total = [p + steps_n for p in prompt]
    seqs = [hidden(n, layer.hidden_size, seed=10 + i) for i, n in enumerate(total)]
    cache = layer.new_cache(num_slots=3)
    # Prefill both prompts in one batch (slots 2 and 0), then one token per request per step.
    x0 = np.concatenate([seqs[0][:prompt[0]], seqs[1][:prompt[1]]])
    qsl0 = [0, prompt[0], prompt[0] + prompt[1]]
    steps = [dict(hidden_states=x0, query_start_loc=qsl0, slots=[2, 0])]
    outs = [layer.forward(x0, qsl0, cache, slots=[2, 0])]
    for t in range(steps_n):
        x = np.stack([seqs[0][prompt[0] + t], seqs[1][prompt[1] + t]])
        computed = [prompt[0] + t, prompt[1] + t]
        outs.append(layer.forward(x, [0, 1, 2], cache, slots=[2, 0],
                                  num_computed_tokens=computed))
        steps.append(dict(hidden_states=x, query_start_loc=[0, 1, 2], slots=[2, 0],
                          num_computed_tokens=computed))
    rust, rust_states = kda._testing.reference_forward(checkpoint, steps, num_slots=3)
    for ours, theirs in zip(outs, rust):
        assert np.array_equal(ours, theirs)
    assert np.array_equal(states(layer, cache), rust_states)
    # The decodes equal one prefill of each whole sequence.
    for r, slot in enumerate([2, 0]):
        alone = layer.new_cache(num_slots=3)
        whole = layer.forward(seqs[r], [0, total[r]], alone, slots=[slot])
        decoded = np.stack([o[r] for o in outs[1:]])
        assert_close(decoded, whole[prompt[r]:])
        assert_close(cache.recurrent_state(slot), alone.recurrent_state(slot))


def test_speculative_decode_equals_the_rust_layer(checkpoint):
    layer = kda.Layer.load(checkpoint)
    num_spec = 2
    cache = layer.new_cache(num_slots=8, num_spec=num_spec)
    x0 = hidden(10, layer.hidden_size, seed=20)
    x1 = hidden(3, layer.hidden_size, seed=21)
    x2 = hidden(3, layer.hidden_size, seed=22)
    # A prefill into slot 0, then a speculative step of 3 tokens reading slot 0 (1 accepted),
    # then another reading the state after the previous step's second token (2 accepted).
    steps = [
        dict(hidden_states=x0, query_start_loc=[0, 10], slots=[0]),
        dict(hidden_states=x1, query_start_loc=[0, 3], slots=[[0, 1, 2]],
             num_computed_tokens=[10], num_accepted_tokens=[1]),
        dict(hidden_states=x2, query_start_loc=[0, 3], slots=[[0, 1, 2]],
             num_computed_tokens=[12], num_accepted_tokens=[2]),
    ]
    outs = [layer.forward(x0, [0, 10], cache, slots=[0])]
    for s in steps[1:]:
        outs.append(layer.forward_spec(s["hidden_states"], s["query_start_loc"], cache,
                                       s["slots"], s["num_computed_tokens"],
                                       s["num_accepted_tokens"]))
    rust, rust_states = kda._testing.reference_forward(checkpoint, steps, num_slots=8,
                                                       num_spec=num_spec)
    for ours, theirs in zip(outs, rust):
        assert np.array_equal(ours, theirs)
    assert np.array_equal(states(layer, cache), rust_states)


def test_out_is_written_in_place(checkpoint):
    layer = kda.Layer.load(checkpoint)
    x = hidden(6, layer.hidden_size, seed=6)
    out = np.full((6, layer.hidden_size), np.nan, dtype=np.float32)
    result = layer.forward(x, [0, 6], layer.new_cache(1), out=out)
    assert result is out
    expected = layer.forward(x, [0, 6], layer.new_cache(1))
    assert np.array_equal(out, expected)
