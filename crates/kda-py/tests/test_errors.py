"""Every class of bad input raises its kda.Error subclass, with the Rust error's message, and
leaves the cache as it was."""

import numpy as np
import pytest

import kda
from conftest import hidden, states


@pytest.fixture(scope="module")
def layer(checkpoint):
    return kda.Layer.load(checkpoint)


@pytest.fixture
def primed(layer):
    """A cache whose slots hold state, and a valid step's inputs."""
    cache = layer.new_cache(num_slots=4, num_spec=1)
    x = hidden(8, layer.hidden_size, seed=9)
    layer.forward(x, [0, 3, 8], cache, slots=[1, 2])
    return cache, x


def rejected(layer, cache, error, match, call):
    before = states(layer, cache)
    with pytest.raises(error, match=match):
        call()
    assert np.array_equal(states(layer, cache), before), "a rejected call changed the cache"


BAD_SHAPES = [
    ("wrong hidden size", lambda x: x[:, :100],
     r"^kda_layer: hidden_states has shape \[8, 100\], expected \[T, 256\] \(hidden_size of the config\)$"),
    ("rank 3", lambda x: x.reshape(2, 4, -1), r"hidden_states: shape \[2, 4, 256\]"),
    ("int32", lambda x: x.view(np.int32), r"hidden_states: dtype i32, expected bf16 or f32"),
    ("float16", lambda x: x.astype(np.float16), r"hidden_states: dtype f16, expected bf16 or f32"),
    ("float64", lambda x: x.astype(np.float64), r"numpy dtype <f8 is not one kda reads"),
]


@pytest.mark.parametrize("name,make,match", BAD_SHAPES, ids=[b[0] for b in BAD_SHAPES])
def test_bad_hidden_states_raise_shape_error(layer, primed, name, make, match):
    cache, x = primed
    rejected(layer, cache, kda.ShapeError,
             match, lambda: layer.forward(make(x), [0, 3, 8], cache, slots=[1, 2]))


BAD_METADATA = [
    ("not increasing", dict(query_start_loc=[0, 5, 5]), r"not strictly increasing at request 1"),
    ("first offset", dict(query_start_loc=[1, 8]), r"query_start_loc\[0\] = 1, expected 0"),
    ("past the rows", dict(query_start_loc=[0, 9]), r"9 live tokens but the hidden states have only 8 rows"),
    ("negative", dict(query_start_loc=[0, -3, 8]), r"query_start_loc\[1\] = -3, expected >= 0"),
    ("slot out of range", dict(query_start_loc=[0, 8], slots=[4]), r"request 0 uses slot 4, but the cache has 4 slots"),
    ("duplicate slot", dict(query_start_loc=[0, 3, 8], slots=[2, 2]), r"slot 2 is used twice"),
    ("slots length", dict(query_start_loc=[0, 3, 8], slots=[1]), r"slots has 1 entries, expected 2"),
    ("computed length", dict(query_start_loc=[0, 8], num_computed_tokens=[0, 0]), r"num_computed_tokens has 2 entries, expected 1"),
]


@pytest.mark.parametrize("name,kwargs,match", BAD_METADATA, ids=[b[0] for b in BAD_METADATA])
def test_bad_metadata_raises_metadata_error(layer, primed, name, kwargs, match):
    cache, x = primed
    kwargs = dict(kwargs)
    qsl = kwargs.pop("query_start_loc")
    rejected(layer, cache, kda.MetadataError, match,
             lambda: layer.forward(x, qsl, cache, **kwargs))


def test_a_bad_out_raises_shape_error(layer, primed):
    cache, x = primed
    readonly = np.zeros((8, layer.hidden_size), dtype=np.float32)
    readonly.flags.writeable = False
    rejected(layer, cache, kda.ShapeError, r"^out: is read-only, but kda writes it in place$",
             lambda: layer.forward(x, [0, 8], cache, out=readonly))
    small = np.zeros((7, layer.hidden_size), dtype=np.float32)
    rejected(layer, cache, kda.ShapeError, r"out has shape \[7, 256\], expected \[8, 256\]",
             lambda: layer.forward(x, [0, 8], cache, out=small))
    assert np.all(small == 0.0)


def test_bad_speculative_metadata_raises_metadata_error(layer, primed):
    cache, x = primed
    rejected(layer, cache, kda.MetadataError, r"num_accepted_tokens = 3, expected 1..=2",
             lambda: layer.forward_spec(x[:2], [0, 2], cache, [[1, 3]], [3], [3]))
    rejected(layer, cache, kda.MetadataError, r"num_computed_tokens = 0",
             lambda: layer.forward_spec(x[:2], [0, 2], cache, [[1, 3]], [0], [1]))


def test_a_cache_of_another_layer_raises_shape_error(layer, checkpoint, primed):
    cache, x = primed
    other = kda.Layer.load(checkpoint)
    foreign = other.new_cache(num_slots=4)
    with pytest.raises(kda.ShapeError, match="cache belongs to backend instance"):
        layer.forward(x, [0, 8], foreign)


def test_checkpoint_errors(tmp_path, checkpoint):
    with pytest.raises(kda.CheckpointError, match="config.json"):
        kda.Layer.load(str(tmp_path))
    with pytest.raises(kda.CheckpointError):
        kda.Layer.load(checkpoint, layer=7)
    with pytest.raises(kda.CheckpointError, match="rank"):
        kda.Layer.load(checkpoint, tp_size=2, tp_rank=2)


def test_options_and_backends(checkpoint):
    with pytest.raises(ValueError, match=r'schedule: "diagonal" is not one of "serial" or "overlapped"'):
        kda.Layer.load(checkpoint, schedule="diagonal")
    with pytest.raises(ValueError, match="backend"):
        kda.Layer.load(checkpoint, backend="tpu")
    for name in ["cuda", "ascend"]:
        try:
            kda.Layer.load(checkpoint, backend=name)
        except kda.BackendError:
            pass  # not compiled in (UnsupportedError), or no device here
    with pytest.raises(kda.UnsupportedError, match="stream"):
        layer = kda.Layer.load(checkpoint)
        layer.forward(hidden(2, 256), [0, 2], layer.new_cache(1), stream=1234)
    assert issubclass(kda.UnsupportedError, kda.BackendError)
    for cls in [kda.ShapeError, kda.MetadataError, kda.CheckpointError, kda.BackendError]:
        assert issubclass(cls, kda.Error)
