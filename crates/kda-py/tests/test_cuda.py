"""backend="cuda": torch CUDA tensors through DLPack (kDLCUDA) and the engine's stream
(`stream=`), eager and captured by torch into a CUDA graph. The device tests need a GPU, torch
with CUDA and a kda built with `--features cuda`; elsewhere they are skipped with the reason.
The host-side routing of a kDLCUDA array is tested everywhere."""

import ctypes

import numpy as np
import pytest

import kda
from conftest import assert_close, hidden

# DLPack's device type of CUDA device memory, and where it sits in a DLTensor
# (`void *data; DLDevice device {int32 device_type; int32 device_id}; ...`).
KDL_CUDA = 2
DEVICE_TYPE_OFFSET = ctypes.sizeof(ctypes.c_void_p)


class ClaimsCuda:
    """A host array whose DLPack capsule says kDLCUDA: what the reference backend must refuse
    (it cannot read device memory) rather than read as host memory."""

    def __init__(self, array):
        self._array = array

    def __dlpack__(self, stream=None):
        capsule = self._array.__dlpack__()
        get = ctypes.pythonapi.PyCapsule_GetPointer
        get.restype = ctypes.c_void_p
        get.argtypes = [ctypes.py_object, ctypes.c_char_p]
        managed = get(capsule, b"dltensor")
        ctypes.c_int32.from_address(managed + DEVICE_TYPE_OFFSET).value = KDL_CUDA
        return capsule

    def __dlpack_device__(self):
        return (KDL_CUDA, 0)


def test_cuda_device_arrays_are_refused_by_the_reference_backend(checkpoint):
    layer = kda.Layer.load(checkpoint)
    cache = layer.new_cache(1)
    before = cache.recurrent_state(0).copy()
    x = hidden(2, 256)
    out = np.zeros((2, 256), dtype=np.float32)
    with pytest.raises(kda.ShapeError, match="cuda device 0 memory cannot be used by the reference"):
        layer.forward(ClaimsCuda(x), [0, 2], cache, out=out)
    # Device inputs want a device output: a numpy one would be host memory.
    with pytest.raises(kda.ShapeError, match=r"out: not given, for hidden_states in cuda device 0 memory: pass out="):
        layer.forward(ClaimsCuda(x), [0, 2], cache)
    np.testing.assert_array_equal(cache.recurrent_state(0), before)
    np.testing.assert_array_equal(out, 0.0)


def cuda_layer(checkpoint):
    """The layer on backend "cuda", or a skip saying why it cannot run here."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    try:
        return torch, kda.Layer.load(checkpoint, backend="cuda")
    except kda.UnsupportedError as e:
        pytest.skip(f"kda built without the CUDA backend: {e}")


def test_cuda_tensors_on_the_engines_stream_equal_the_reference(checkpoint):
    torch, layer = cuda_layer(checkpoint)
    reference = kda.Layer.load(checkpoint)
    x = hidden(6, 256)
    want = reference.forward(x, [0, 4, 6], reference.new_cache(2))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        xd = torch.from_numpy(x).to("cuda", dtype=torch.bfloat16)
        out = torch.zeros((6, 256), dtype=torch.float32, device="cuda")
        cache = layer.new_cache(2)
        layer.forward(xd, [0, 4, 6], cache, out=out, stream=stream.cuda_stream)
    stream.synchronize()
    assert_close(out.cpu().numpy(), want)


def test_a_torch_cuda_graph_of_a_decode_step_replays_as_eager(checkpoint):
    torch, layer = cuda_layer(checkpoint)
    prompt = torch.from_numpy(hidden(8, 256, seed=1)).to("cuda", dtype=torch.bfloat16)
    step = torch.from_numpy(hidden(2, 256, seed=2)).to("cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    eager_cache, graph_cache = layer.new_cache(2), layer.new_cache(2)
    eager_out = torch.zeros((2, 256), dtype=torch.float32, device="cuda")
    graph_out = torch.zeros((2, 256), dtype=torch.float32, device="cuda")
    warm = torch.zeros((8, 256), dtype=torch.float32, device="cuda")
    with torch.cuda.stream(stream):
        for c in (eager_cache, graph_cache):
            layer.forward(prompt, [0, 4, 8], c, out=warm, stream=stream.cuda_stream)
    stream.synchronize()
    decode = dict(num_computed_tokens=[4, 4])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        layer.forward(step, [0, 1, 2], graph_cache, out=graph_out, stream=stream.cuda_stream, **decode)
    for _ in range(2):
        with torch.cuda.stream(stream):
            layer.forward(step, [0, 1, 2], eager_cache, out=eager_out, stream=stream.cuda_stream, **decode)
            graph.replay()
        stream.synchronize()
        assert torch.equal(eager_out, graph_out)
        for slot in range(2):
            np.testing.assert_array_equal(
                eager_cache.recurrent_state(slot), graph_cache.recurrent_state(slot)
            )
