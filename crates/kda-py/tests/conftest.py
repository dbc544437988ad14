"""Shared fixtures: tiny synthetic checkpoints written once per session."""

import numpy as np
import pytest

import kda


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """Kimi K3 forms (MXFP8 QKV, lower-bound gate), hidden 256, 4 heads of 32."""
    path = tmp_path_factory.mktemp("tiny")
    kda._testing.write_synthetic_checkpoint(str(path), preset="tiny", seed=0)
    return str(path)


@pytest.fixture(scope="session")
def checkpoint_linear(tmp_path_factory):
    """Kimi Linear forms (bf16 QKV, softplus gate), hidden 128, 4 heads of 32."""
    path = tmp_path_factory.mktemp("tiny-linear")
    kda._testing.write_synthetic_checkpoint(str(path), preset="tiny-linear", seed=1)
    return str(path)


def hidden(rows, width, seed=0, scale=1.0):
    """Hidden states [rows, width] f32 whose values are exact in bf16."""
    x = np.random.default_rng(seed).standard_normal((rows, width)).astype(np.float32) * scale
    bits = x.view(np.uint32) & np.uint32(0xFFFF0000)
    return bits.view(np.float32)


def states(layer, cache):
    """Every slot's recurrent state, [slots, lh, V, K]."""
    return np.stack([cache.recurrent_state(s) for s in range(cache.num_slots)])


def assert_close(actual, expected):
    """The conformance suite's layer tolerance: 2^-8 relative plus 2^-8 of the largest
    magnitude (two runs whose chunking differs round differently)."""
    atol = float(np.abs(expected).max()) / 256.0
    np.testing.assert_allclose(actual, expected, rtol=1.0 / 256.0, atol=atol)
