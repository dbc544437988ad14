"""kda.quant and kda.core."""

import numpy as np
import pytest

import kda


def test_quant_shapes_and_known_bytes():
    x = np.ones((2, 40), dtype=np.float32)
    data, scale = kda.quant(x)
    assert data.dtype == np.uint8 and scale.dtype == np.uint8
    assert data.shape == (2, 40) and scale.shape == (2, 2)
    # 1.0 in a block whose largest magnitude is 1.0: OCP floor scale 2^(0 - 8), element 256.
    assert np.all(scale == 127 - 8)
    assert np.all(data == 0x78)
    data1, scale1 = kda.quant(x[0])
    assert data1.shape == (40,) and scale1.shape == (2,)
    assert np.array_equal(data1, data[0]) and np.array_equal(scale1, scale[0])


def test_quant_bf16_equals_f32_and_scale_algs_differ():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = np.random.default_rng(0).standard_normal((4, 64)).astype(ml_dtypes.bfloat16)
    a = kda.quant(x)
    b = kda.quant(x.astype(np.float32))
    assert all(np.array_equal(p, q) for p, q in zip(a, b))
    up = kda.quant(x, scale_alg=1)
    assert not np.array_equal(a[1], up[1])
    with pytest.raises(ValueError, match="scale_alg"):
        kda.quant(x, scale_alg=2)
    with pytest.raises(kda.ShapeError, match=r"expected \[K\] or \[N, K\]"):
        kda.quant(np.zeros((2, 2, 32), dtype=np.float32))


def naive_recurrent_kda(q, k, v, g, beta, scale, initial_state=None):
    """flash-linear-attention's naive_recurrent_kda, in f64."""
    b, t, h, kd = q.shape
    vd = v.shape[-1]
    s = np.zeros((b, h, kd, vd)) if initial_state is None else initial_state.astype(np.float64)
    o = np.zeros((b, t, h, vd))
    for i in range(t):
        s = s * np.exp(g[:, i])[..., None]
        kv = np.einsum("bhk,bhkv->bhv", k[:, i], s)
        s = s + np.einsum("bhk,bhv->bhkv", k[:, i], beta[:, i][..., None] * (v[:, i] - kv))
        o[:, i] = np.einsum("bhk,bhkv->bhv", q[:, i] * scale, s)
    return o, s


@pytest.mark.parametrize("algo", ["chunk", "recurrent"])
def test_core_matches_the_naive_recurrence(algo):
    b, t, h, kd, vd = 2, 70, 2, 16, 8
    q, k, v, g, beta, s0 = _core_inputs(b, t, h, kd, vd, seed=1)
    o, state = kda.core(q, k, v, g, beta, initial_state=s0, algo=algo)
    assert o.shape == (b, t, h, vd) and state.shape == (b, h, kd, vd)
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, kd ** -0.5, s0)
    np.testing.assert_allclose(o, o_ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(state, s_ref, rtol=1e-4, atol=1e-4)


def test_core_rejects_mismatched_shapes():
    x = np.zeros((1, 4, 2, 8), dtype=np.float32)
    with pytest.raises(kda.ShapeError, match=r"beta: f32, shape \[1, 4\]: expected \[B, T, H\] = \[1, 4, 2\]"):
        kda.core(x, x, x, x, np.zeros((1, 4), dtype=np.float32))
    # The checks the CLI's `kda core` makes too (one implementation): no zero-size dimension
    # sizes a state the data does not back.
    empty = np.zeros((1, 0, 2, 8), dtype=np.float32)
    with pytest.raises(kda.ShapeError, match="T must be at least 1"):
        kda.core(empty, empty, empty, empty, np.zeros((1, 0, 2), dtype=np.float32))
    with pytest.raises(ValueError, match="algo"):
        kda.core(x, x, x, x, np.zeros((1, 4, 2), dtype=np.float32), algo="parallel")


def _core_inputs(b, t, h, kd, vd, seed):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, t, h, kd)).astype(np.float32) * 0.3
    k = rng.standard_normal((b, t, h, kd)).astype(np.float32) * 0.3
    v = rng.standard_normal((b, t, h, vd)).astype(np.float32)
    g = -rng.uniform(0.01, 0.2, (b, t, h, kd)).astype(np.float32)
    beta = rng.uniform(0.1, 0.9, (b, t, h)).astype(np.float32)
    s0 = rng.standard_normal((b, h, kd, vd)).astype(np.float32) * 0.1
    return q, k, v, g, beta, s0


@pytest.mark.parametrize("algo", ["chunk", "recurrent"])
@pytest.mark.parametrize("t", [1, 3, 70])
def test_core_state_in_and_out(algo, t):
    """By default `initial_state` is left as it was and `final_state` is a new array; with
    `inplace_final_state` the initial state is updated in place, returned as `final_state`, with
    the same bits. A K-first view of a v-first array is updated where it lies."""
    q, k, v, g, beta, s0 = _core_inputs(3, t, 2, 24, 20, seed=t)
    before = s0.copy()
    o, final = kda.core(q, k, v, g, beta, initial_state=s0, algo=algo)
    assert np.array_equal(s0, before), "the caller's initial state changed"
    assert final is not s0 and not np.shares_memory(final, s0)
    state = s0.copy()
    o_in, final_in = kda.core(q, k, v, g, beta, initial_state=state, algo=algo,
                              inplace_final_state=True)
    assert final_in is state
    assert np.array_equal(o_in, o) and np.array_equal(state, final)
    vfirst = np.ascontiguousarray(s0.transpose(0, 1, 3, 2))
    o_t, final_t = kda.core(q, k, v, g, beta, initial_state=vfirst.transpose(0, 1, 3, 2),
                            algo=algo, inplace_final_state=True)
    assert np.array_equal(o_t, o) and np.array_equal(vfirst.transpose(0, 1, 3, 2), final)
    assert final_t.base is vfirst


def test_core_in_place_needs_a_writable_f32_state():
    q, k, v, g, beta, s0 = _core_inputs(1, 2, 1, 8, 8, seed=0)
    with pytest.raises(kda.ShapeError, match="initial_state: none given"):
        kda.core(q, k, v, g, beta, inplace_final_state=True)
    ro = s0.copy()
    ro.flags.writeable = False
    with pytest.raises(kda.ShapeError, match="read-only"):
        kda.core(q, k, v, g, beta, initial_state=ro, inplace_final_state=True)
    ml_dtypes = pytest.importorskip("ml_dtypes")
    with pytest.raises(kda.ShapeError, match="initial_state: dtype bf16, expected f32"):
        kda.core(q, k, v, g, beta, initial_state=s0.astype(ml_dtypes.bfloat16),
                 inplace_final_state=True)
    # Without in place, a bf16 state is read as its values.
    want = kda.core(q, k, v, g, beta, initial_state=s0.astype(ml_dtypes.bfloat16).astype(np.float32))
    got = kda.core(q, k, v, g, beta, initial_state=s0.astype(ml_dtypes.bfloat16))
    assert all(np.array_equal(x, y) for x, y in zip(got, want))
