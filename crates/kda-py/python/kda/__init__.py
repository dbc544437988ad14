"""kda: Kimi Delta Attention for inference engines.

One KDA layer of an HF-style checkpoint for one tensor-parallel rank, on the engine's arrays::

    import kda
    layer = kda.Layer.load(checkpoint_dir, layer=0, tp_size=1, tp_rank=0,
                           backend="reference", schedule="overlapped")
    cache = layer.new_cache(num_slots=8)
    out = layer.forward(hidden_states, query_start_loc, cache)   # this rank's partial output
    state = cache.recurrent_state(0)                              # [lh, V, K], v-first

From the engine's own memory: ``kda.Layer.from_weights(config, weights, ...)`` builds the layer
from named arrays (the same loader, the same layer), ``layer.wrap_cache(conv_state,
recurrent_state, layout="vllm" | "transformers")`` uses the engine's state tensors in place, and
``layer.forward(..., keep_states=[(request, position, slot)])`` keeps prefix-cache states.
``kda.transformers.patch(model)`` runs transformers' Kimi Linear through kda (it imports torch
and transformers only when called).

See docs/embedding.md in the kda repository for the memory, stream and threading contract.
"""

from ._kda import (
    BackendError,
    CheckpointError,
    Error,
    Layer,
    MetadataError,
    ShapeError,
    StateCache,
    UnsupportedError,
    __version__,
    core,
    quant,
)
from . import _testing

__all__ = [
    "BackendError",
    "CheckpointError",
    "Error",
    "Layer",
    "MetadataError",
    "ShapeError",
    "StateCache",
    "UnsupportedError",
    "__version__",
    "core",
    "quant",
]
