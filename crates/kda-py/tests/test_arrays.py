"""Arrays in: numpy (f32, ml_dtypes bf16), DLPack, the buffer protocol, torch where installed;
read without a copy wherever the layout allows."""

import threading
import time

import numpy as np
import pytest

import kda
from conftest import hidden


class DlpackOnly:
    """An array that offers nothing but DLPack (as a framework's tensor does)."""

    def __init__(self, array):
        self._array = array

    def __dlpack__(self, stream=None):
        return self._array.__dlpack__()

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()


@pytest.fixture(scope="module")
def layer(checkpoint):
    return kda.Layer.load(checkpoint)


def run(layer, x, qsl):
    return layer.forward(x, qsl, layer.new_cache(num_slots=2))


def test_a_contiguous_bf16_numpy_array_is_read_without_a_copy(layer):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = hidden(12, layer.hidden_size, seed=1).astype(ml_dtypes.bfloat16)
    before = kda._testing.input_copies()
    out = run(layer, x, [0, 12])
    assert kda._testing.input_copies() == before, "a contiguous bf16 array was copied"
    # A layout kda cannot read in place (column-major) is copied, with the same result.
    out_f = run(layer, np.asfortranarray(x), [0, 12])
    assert kda._testing.input_copies() == before + 1
    assert np.array_equal(out, out_f)
    # So is a reversed view (negative strides).
    flipped = x[::-1]
    out_r = run(layer, flipped[::-1], [0, 12])
    assert np.array_equal(out, out_r)


def test_f32_numpy_dlpack_and_buffer_protocol_inputs_agree(layer):
    x = hidden(10, layer.hidden_size, seed=2)
    before = kda._testing.input_copies()
    expected = run(layer, x, [0, 4, 10])
    assert np.array_equal(run(layer, DlpackOnly(x), [0, 4, 10]), expected)
    assert np.array_equal(run(layer, memoryview(x), [0, 4, 10]), expected)
    assert kda._testing.input_copies() == before
    # A row slice of a larger array is contiguous: still read in place.
    big = np.zeros((14, layer.hidden_size), dtype=np.float32)
    big[2:12] = x
    assert np.array_equal(run(layer, big[2:12], [0, 4, 10]), expected)
    assert kda._testing.input_copies() == before
    # Metadata as numpy int arrays.
    qsl = np.array([0, 4, 10], dtype=np.int32)
    assert np.array_equal(run(layer, x, qsl), expected)


def test_torch_bf16_tensors_through_dlpack_without_a_copy(layer):
    torch = pytest.importorskip("torch")
    x = torch.from_numpy(hidden(8, layer.hidden_size, seed=3)).to(torch.bfloat16)
    before = kda._testing.input_copies()
    out = layer.forward(x, torch.tensor([0, 8], dtype=torch.int32), layer.new_cache(1))
    assert kda._testing.input_copies() == before
    expected = run(layer, x.float().numpy(), [0, 8])
    ours_f32 = layer.forward(x.float(), [0, 8], layer.new_cache(1))
    assert np.array_equal(ours_f32, expected)
    assert out.shape == expected.shape


def test_another_thread_runs_while_forward_computes(checkpoint):
    """The GIL is released: a Python thread keeps making progress during a long forward."""
    layer = kda.Layer.load(checkpoint, schedule="serial")
    x = hidden(4096, layer.hidden_size, seed=4)
    cache = layer.new_cache(num_slots=1)
    layer.forward(x[:64], [0, 64], cache)  # warm up
    window = {}

    def work():
        window["start"] = time.perf_counter()
        layer.forward(x, [0, 4096], cache)
        window["end"] = time.perf_counter()

    worker = threading.Thread(target=work)
    ticks = []
    worker.start()
    while worker.is_alive():
        ticks.append(time.perf_counter())
    worker.join()
    start, end = window["start"], window["end"]
    during = [t for t in ticks if start <= t <= end]
    duration = end - start
    # With the GIL held through the call, this thread could not run at all inside the window.
    assert len(during) > 100, f"{len(during)} ticks in a {duration:.3f} s forward"
    gaps = np.diff([start] + during + [end])
    assert gaps.max() < max(0.5 * duration, 0.05) or duration < 0.05, (
        f"this thread stalled {gaps.max():.3f} s of a {duration:.3f} s forward")
