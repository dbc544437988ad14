"""kda.core on a sample of the small shapes the conformance suite's property bodies draw
(kda_testkit::conformance::kda_props): a decode step (T = 1, which once failed with
algo="recurrent"), two tokens and both sides of the chunk boundaries, one or three requests and
heads, K != V, with and without an initial state, both algorithms, against the f64 recurrence
under the suite's recurrence tolerance."""

import numpy as np
import pytest

import kda

# (B, T, H, K, V): every T of the property bodies once.
SAMPLE = [
    (1, 1, 1, 16, 16),
    (3, 1, 3, 32, 128),
    (3, 2, 1, 128, 16),
    (1, 63, 3, 16, 32),
    (3, 64, 1, 32, 32),
    (1, 65, 3, 128, 128),
    (3, 129, 3, 16, 32),
]


def l2norm(x):
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)


def recurrence_f64(q, k, v, g, beta, scale, initial_state):
    """The KDA recurrence token by token in f64, q and k L2-normalised (kda_testkit's oracle)."""
    q, k, v, g, beta = (a.astype(np.float64) for a in (q, k, v, g, beta))
    q, k = l2norm(q) * scale, l2norm(k)
    b, t, h, kd = q.shape
    s = np.zeros((b, h, kd, v.shape[-1])) if initial_state is None else initial_state.astype(np.float64)
    o = np.zeros(v.shape)
    for i in range(t):
        s = s * np.exp(g[:, i])[..., None]
        kv = np.einsum("bhk,bhkv->bhv", k[:, i], s)
        s = s + np.einsum("bhk,bhv->bhkv", k[:, i], beta[:, i][..., None] * (v[:, i] - kv))
        o[:, i] = np.einsum("bhk,bhkv->bhv", q[:, i], s)
    return o, s


def recurrence_tolerance(tokens, kd, chunk, expected):
    """kda_testkit::oracle_kda::recurrence_tolerance: f32's (1e-5 relative, 1e-6 absolute) plus
    the worst-case error of a chain of n = K + T (+ 2(K + C) chunked) fp32 roundings."""
    n = kd + tokens + (2 * (kd + chunk) if chunk else 0)
    ku = n * 2.0**-24
    return dict(rtol=1e-5, atol=1e-6 + ku / (1 - ku) * float(np.abs(expected).max()))


@pytest.mark.parametrize("algo", ["chunk", "recurrent"])
@pytest.mark.parametrize("initial", [False, True])
@pytest.mark.parametrize("shape", SAMPLE, ids=lambda s: "B{}-T{}-H{}-K{}-V{}".format(*s))
def test_core_on_small_shapes_matches_the_f64_recurrence(shape, initial, algo):
    b, t, h, kd, vd = shape
    rng = np.random.default_rng(sum(shape))
    q = rng.uniform(-1, 1, (b, t, h, kd)).astype(np.float32)
    k = rng.uniform(-1, 1, (b, t, h, kd)).astype(np.float32)
    v = rng.uniform(-1, 1, (b, t, h, vd)).astype(np.float32)
    g = rng.uniform(-2, 0, (b, t, h, kd)).astype(np.float32)
    beta = rng.uniform(0, 1, (b, t, h)).astype(np.float32)
    s0 = rng.uniform(-1, 1, (b, h, kd, vd)).astype(np.float32) if initial else None
    o, state = kda.core(q, k, v, g, beta, initial_state=s0, algo=algo, l2norm=True)
    assert o.shape == (b, t, h, vd) and state.shape == (b, h, kd, vd)
    o_ref, s_ref = recurrence_f64(q, k, v, g, beta, kd**-0.5, s0)
    chunk = 64 if algo == "chunk" else 0
    for r in range(b):
        np.testing.assert_allclose(o[r], o_ref[r], **recurrence_tolerance(t, kd, chunk, o_ref[r]))
        np.testing.assert_allclose(state[r], s_ref[r], **recurrence_tolerance(t, kd, chunk, s_ref[r]))


@pytest.mark.parametrize("algo", ["chunk", "recurrent"])
def test_core_threads_give_the_same_bits(algo):
    b, t, h, kd, vd = 3, 65, 3, 32, 16
    rng = np.random.default_rng(7)
    q, k, g = (rng.uniform(-1, 0, (b, t, h, kd)).astype(np.float32) for _ in range(3))
    v = rng.uniform(-1, 1, (b, t, h, vd)).astype(np.float32)
    beta = rng.uniform(0, 1, (b, t, h)).astype(np.float32)
    one = kda.core(q, k, v, g, beta, algo=algo, l2norm=True)
    two = kda.core(q, k, v, g, beta, algo=algo, l2norm=True, threads=2)
    assert all(np.array_equal(x, y) for x, y in zip(one, two))
    with pytest.raises(ValueError, match="threads"):
        kda.core(q, k, v, g, beta, threads=0)


def test_core_reads_strided_arrays_as_their_values():
    """Sliced, Fortran-ordered and reversed arrays give the bits of their contiguous copies."""
    b, t, h, kd, vd = 2, 5, 3, 16, 8
    rng = np.random.default_rng(11)
    wide = rng.uniform(-1, 1, (b, t, h, kd + 3)).astype(np.float32)
    q = wide[..., :kd]  # rows apart
    k = np.asfortranarray(rng.uniform(-1, 1, (b, t, h, kd)).astype(np.float32))
    v = rng.uniform(-1, 1, (b, t, h, vd)).astype(np.float32)[:, ::-1]  # reversed tokens
    g = rng.uniform(-1, 0, (b, t, h, kd)).astype(np.float32)
    beta = rng.uniform(0, 1, (b, t, h)).astype(np.float32)
    s0 = rng.uniform(-1, 1, (b, h, vd, kd)).astype(np.float32).transpose(0, 1, 3, 2)
    for algo in ["chunk", "recurrent"]:
        got = kda.core(q, k, v, g, beta, initial_state=s0, algo=algo, l2norm=True)
        want = kda.core(*(np.ascontiguousarray(a) for a in (q, k, v, g, beta, s0)), algo=algo, l2norm=True)
        assert all(np.array_equal(x, y) for x, y in zip(got, want)), algo
