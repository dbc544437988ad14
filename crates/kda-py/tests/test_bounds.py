"""Counts, indices and batch values around their bounds: each call raises a typed error (a
kda.Error subclass; ValueError for a size no object has; TypeError for an int past int64 in a
batch list; OverflowError for an int past 128 bits) naming the value as given and leaving the
cache as it was, or returns what the plain Rust API returns for the same batch, bit for bit.
Never a crash. A seeded random loop (hypothesis is not a dependency) plus the edge lists."""

import ctypes
import random

import numpy as np
import pytest

import kda
from conftest import hidden, states

SLOTS, SPEC = 4, 2
HUGE = [2**31 - 1, 2**31, 2**40, 2**63 - 1, 2**63, 2**64 - 1, 2**64]
NEGATIVE = [-1, -(2**31), -(2**63)]


@pytest.fixture(scope="module")
def layer(checkpoint):
    return kda.Layer.load(checkpoint)


def near(bound):
    """0, 1, bound - 1, bound, bound + 1."""
    return sorted({0, 1, max(bound - 1, 0), bound, bound + 1})


@pytest.mark.parametrize("num_spec", [0, 1, SPEC, 2**40, 2**64 - 1, 2**64, -1])
@pytest.mark.parametrize("num_slots", near(SLOTS) + [2**40, 2**60, 2**64 - 1, 2**64, -1,
                                                     -(2**63), 2**127, 2**200])
def test_cache_sizes_near_their_bounds(layer, num_slots, num_spec):
    def make():
        return layer.new_cache(num_slots=num_slots, num_spec=num_spec)

    if num_slots >= 2**127:
        with pytest.raises(OverflowError):
            make()
        return
    for name, value in (("num_slots", num_slots), ("num_spec", num_spec)):
        if not 0 <= value < 2**64:
            with pytest.raises(ValueError, match=rf"^{name} = {value}, expected 0\.\.="):
                make()
            return
    if num_slots == 0 or num_slots >= 2**40 or num_spec >= 2**40:
        # No memory holds it (ShapeError) or this host cannot give it (BackendError); the
        # message starts with the sizes as given either way.
        with pytest.raises((kda.ShapeError, kda.BackendError),
                           match=rf"^a cache of num_slots = {num_slots}, num_spec = {num_spec}: "):
            make()
        return
    cache = make()
    assert cache.num_slots == num_slots
    assert not states(layer, cache).any()


@pytest.mark.parametrize("slot", near(SLOTS) + HUGE + NEGATIVE + [2**200])
def test_a_recurrent_state_slot_near_its_bound(layer, slot):
    cache = layer.new_cache(num_slots=SLOTS)
    if 0 <= slot < SLOTS:
        assert cache.recurrent_state(slot).shape == (layer.local_heads, layer.head_dim,
                                                     layer.head_dim)
    elif slot >= 2**127:
        with pytest.raises(OverflowError):
            cache.recurrent_state(slot)
    else:
        with pytest.raises(kda.MetadataError,
                           match=rf"^batch metadata: slot = {slot}, expected < 4 \(the cache's slots\)$"):
            cache.recurrent_state(slot)


def edge(rng, plausible, bound):
    """Now and then a value at an edge of `0..bound` or of the integer types, else the
    plausible value."""
    if rng.random() < 0.06:
        return rng.choice([-1, bound - 1, bound, bound + 1] + HUGE + NEGATIVE)
    return plausible


def count(rng, plausible, bound):
    """A count: mostly the plausible one, else 0, 1, bound - 1, bound or bound + 1."""
    if rng.random() < 0.5:
        return plausible
    return rng.choice(near(bound))


def random_step(rng, layer):
    """A plausible batch (plain and speculative requests), its counts and values moved to their
    bounds now and then: the forward's keyword arguments and the method to call."""
    spec = rng.random() < 0.4
    width = count(rng, rng.randint(1, SPEC + 1), SPEC + 1) if spec else 1
    plan = []  # (tokens, continues, speculative)
    for _ in range(rng.randint(0, 4)):
        speculative = spec and rng.random() < 0.5
        tokens = width if speculative else rng.randint(1, 3)
        plan.append((tokens, speculative or rng.random() < 0.5, speculative))
    rows = sum(t for t, _, _ in plan) + rng.randint(0, 1)
    requests = count(rng, len(plan), rows)
    qsl, at, slots, computed, accepted, next_slot = [0], 0, [], [], [], 0
    for r in range(requests):
        tokens, continues, speculative = plan[r] if r < len(plan) else (1, False, False)
        at += tokens
        qsl.append(edge(rng, at, rows))
        computed.append(edge(rng, 5 if continues else 0, 8))
        if speculative:
            slots.append([edge(rng, next_slot + i, SLOTS) for i in range(width)])
            accepted.append(edge(rng, rng.randint(1, max(width, 1)), width + 1))
            next_slot += width
        else:
            slots.append(edge(rng, next_slot, SLOTS))
            accepted.append(edge(rng, 0, width + 1))
            next_slot += 1
    qsl[0] = edge(rng, 0, rows)
    x = hidden(rows, layer.hidden_size, seed=rng.randint(0, 1000))
    step = dict(hidden_states=x, query_start_loc=qsl, slots=slots,
                num_computed_tokens=computed)
    if spec:
        step["num_accepted_tokens"] = accepted
    else:
        if rng.random() < 0.2:
            step.pop("slots")
        if rng.random() < 0.2:
            step.pop("num_computed_tokens")
    out_rows = rng.choice([None, None, rows, max(rows - 1, 0), rows + 1])
    return spec, step, out_rows


@pytest.mark.parametrize("seed", range(6))
def test_forward_counts_and_values_near_their_bounds(layer, checkpoint, seed):
    rng = random.Random(seed)
    accepted_calls = 0
    for _ in range(40):
        spec, step, out_rows = random_step(rng, layer)
        cache = layer.new_cache(num_slots=SLOTS, num_spec=SPEC)
        out = None
        if out_rows is not None:
            out = np.zeros((out_rows, layer.hidden_size), dtype=np.float32)
        call = layer.forward_spec if spec else layer.forward
        args = dict(step)
        x, qsl = args.pop("hidden_states"), args.pop("query_start_loc")
        try:
            result = call(x, qsl, cache, out=out, **args)
        except (kda.Error, TypeError) as e:
            # A kda error, or (TypeError) an int past int64 in a list: nothing changed.
            # Never kda.Error itself (a panic caught at the boundary) nor a device failure.
            assert type(e) not in (kda.Error, kda.BackendError), f"{type(e).__name__}: {e}"
            assert str(e)
            assert not states(layer, cache).any(), "a rejected call changed the cache"
            if out is not None:
                assert not out.any(), "a rejected call wrote out"
            continue
        accepted_calls += 1
        if out is not None:
            assert result is out
        outputs, rust_states = kda._testing.reference_forward(
            checkpoint, [step], num_slots=SLOTS, num_spec=SPEC)
        assert np.array_equal(result, outputs[0])
        assert np.array_equal(states(layer, cache), rust_states)
    print(f"seed {seed}: {accepted_calls} of 40 calls accepted")
    assert accepted_calls > 0, "the loop drew no valid batch"


def test_arrays_that_describe_more_than_memory_holds(layer):
    """A strided view (numpy's broadcast_to) can describe more elements than any memory holds:
    kda's copies of such arrays check their size and reserve fallibly."""
    # 2^50 bytes (past any host's address space): out of memory, not an abort.
    big = np.broadcast_to(np.zeros((1, 1), dtype=np.float32), (2**24, 2**24))
    with pytest.raises(kda.BackendError, match="out of memory: could not allocate"):
        kda.quant(big)
    q = np.broadcast_to(np.zeros((1, 1, 1, 32), dtype=np.float32), (2**20, 2**20, 2**10, 32))
    with pytest.raises((kda.ShapeError, kda.BackendError)):
        kda.core(q, q, q, q, np.broadcast_to(np.zeros((1, 1, 1), np.float32), q.shape[:3]))
    x = np.broadcast_to(np.zeros((1, layer.hidden_size), dtype=np.float32),
                        (2**40, layer.hidden_size))
    out = np.zeros((4, layer.hidden_size), dtype=np.float32)
    with pytest.raises((kda.ShapeError, kda.BackendError)):
        layer.forward(x, [0, 4], layer.new_cache(1), out=out)


class _DlDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DlDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DlTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DlDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DlDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DlManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DlTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


_CAPSULE_NAME = ctypes.create_string_buffer(b"dltensor")


class HandMadeDlpack:
    """A CPU f32 tensor exported through a DLPack capsule whose `ndim` may lie about its
    `shape` array (which holds `len(shape)` entries)."""

    def __init__(self, ndim, shape):
        self.values = np.arange(64, dtype=np.float32)
        self.shape = (ctypes.c_int64 * len(shape))(*shape)
        self.managed = _DlManagedTensor()
        t = self.managed.dl_tensor
        t.data, t.device, t.ndim = self.values.ctypes.data, _DlDevice(1, 0), ndim
        t.dtype, t.shape = _DlDataType(2, 32, 1), self.shape

    def __dlpack__(self, stream=None):
        new = ctypes.pythonapi.PyCapsule_New
        new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p,
                                                       ctypes.c_void_p]
        return new(ctypes.addressof(self.managed), _CAPSULE_NAME, None)


@pytest.mark.parametrize("ndim", [-1, -(2**31), 65, 2**20, 2**31 - 1])
def test_a_dlpack_ndim_past_its_bound_is_refused_before_its_shape_is_read(ndim):
    with pytest.raises(kda.ShapeError, match=rf"^x: DLPack ndim = {ndim}, expected 0\.\.=64$"):
        kda.quant(HandMadeDlpack(ndim, [64]))


def test_a_dlpack_tensor_within_its_bounds_is_read():
    data, scale = kda.quant(HandMadeDlpack(1, [64]))
    expected = kda.quant(np.arange(64, dtype=np.float32))
    assert np.array_equal(data, expected[0]) and np.array_equal(scale, expected[1])
    with pytest.raises(kda.ShapeError, match=r"^x: dimension -5$"):
        kda.quant(HandMadeDlpack(1, [-5]))
