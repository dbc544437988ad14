"""kda.core against llama.cpp's ggml (`ggml_gated_delta_net`, per-channel gate) on the same
inputs, in one process: `cargo xtask bench` runs it (xtask/src/peer.rs builds the ggml library
and the small C wrapper, ggml_kda.c, it loads).

For each case, both are warmed up, then timed alternately for `--rounds` rounds (five times
as many for a decode step; the order swapped every round): kda's whole call (`kda.core`
in-process, conversions included, as an engine would see it) against ggml's
`ggml_graph_compute` alone. Printed: the ratio ggml time / kda time
per round (median and min-max; above 1 kda is faster), both times, kda's distance to ggml
(at most 1e-4 relative to the output's magnitude) and to the f64 recurrence (under the suite's
recurrence tolerance) on the first request's first heads.
"""

import argparse
import ctypes
import statistics
import sys
import time

import numpy as np

import kda

# (name, B, T, H, D, threads, kda algo, kda updates the state in place). In place is how an
# engine runs a decode step (vLLM's `inplace_final_state`); otherwise `kda.core` leaves the
# caller's initial state as it is and writes the final one to a new array.
CASES = [
    ("prefill", 1, 2048, 4, 128, 1, "chunk", False),
    ("prefill", 1, 2048, 4, 128, 1, "recurrent", False),
    ("prefill", 2, 4096, 8, 128, 2, "chunk", False),
    ("decode", 32, 1, 12, 128, 1, "recurrent", False),
    ("decode", 32, 1, 12, 128, 1, "recurrent", True),
    ("decode", 32, 1, 12, 128, 2, "recurrent", False),
    ("decode", 32, 1, 12, 128, 2, "recurrent", True),
]


def l2norm(x):
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)


def inputs(b, t, h, d, seed):
    """L2-normalised q and k (ggml's kernel takes them normalised), gates in [-1, 0), beta in
    (0, 1), an initial state: f32, flash-linear-attention's layouts."""
    rng = np.random.default_rng(seed)
    q = l2norm(rng.standard_normal((b, t, h, d))).astype(np.float32)
    k = l2norm(rng.standard_normal((b, t, h, d))).astype(np.float32)
    v = rng.standard_normal((b, t, h, d)).astype(np.float32)
    g = rng.uniform(-1.0, 0.0, (b, t, h, d)).astype(np.float32)
    beta = rng.uniform(0.05, 0.95, (b, t, h)).astype(np.float32)
    s0 = (0.1 * rng.standard_normal((b, h, d, d))).astype(np.float32)
    return q, k, v, g, beta, s0


def recurrence_f64(q, k, v, g, beta, scale, s0):
    """The recurrence token by token in f64 (q and k already normalised)."""
    q, k, v, g, beta, s = (a.astype(np.float64) for a in (q, k, v, g, beta, s0))
    o = np.zeros(v.shape)
    for i in range(q.shape[1]):
        s = s * np.exp(g[:, i])[..., None]
        kv = np.einsum("bhk,bhkv->bhv", k[:, i], s)
        s = s + np.einsum("bhk,bhv->bhkv", k[:, i], beta[:, i][..., None] * (v[:, i] - kv))
        o[:, i] = np.einsum("bhk,bhkv->bhv", q[:, i] * scale, s)
    return o, s


def recurrence_tolerance(tokens, kd, chunk, expected):
    """kda_testkit::oracle_kda::recurrence_tolerance."""
    n = kd + tokens + (2 * (kd + chunk) if chunk else 0)
    ku = n * 2.0**-24
    return 1e-6 + ku / (1 - ku) * float(np.abs(expected).max()), 1e-5


class Ggml:
    def __init__(self, path, b, t, h, d, threads):
        lib = ctypes.CDLL(path)
        lib.peer_new.restype = ctypes.c_void_p
        lib.peer_new.argtypes = [ctypes.c_int64] * 4 + [ctypes.c_int]
        lib.peer_run.restype = ctypes.c_double
        lib.peer_run.argtypes = [ctypes.c_void_p] + [ctypes.c_void_p] * 8
        lib.peer_free.argtypes = [ctypes.c_void_p]
        self.lib, self.shape = lib, (b, t, h, d)
        self.p = lib.peer_new(b, t, h, d, threads)
        if not self.p:
            raise RuntimeError("ggml: peer_new failed")

    def run(self, q, k, v, g, beta, s0_vfirst):
        b, t, h, d = self.shape
        o = np.empty((b, t, h, d), np.float32)
        s = np.empty((b, h, d, d), np.float32)
        ptr = lambda a: a.ctypes.data_as(ctypes.c_void_p)
        seconds = self.lib.peer_run(self.p, *map(ptr, (q, k, v, g, beta, s0_vfirst, o, s)))
        if seconds < 0:
            raise RuntimeError("ggml: graph compute failed")
        # ggml's state is v-first: back to K-first.
        return seconds, o, np.ascontiguousarray(s.transpose(0, 1, 3, 2))

    def close(self):
        self.lib.peer_free(self.p)


def case(lib, name, b, t, h, d, threads, algo, in_place, rounds):
    q, k, v, g, beta, s0 = inputs(b, t, h, d, seed=b * t + h)
    s0_vfirst = np.ascontiguousarray(s0.transpose(0, 1, 3, 2))
    ggml = Ggml(lib, b, t, h, d, threads)
    # In place, the state advances call after call; the first call, the one checked, starts
    # from s0.
    state = s0.copy() if in_place else s0

    def run_kda():
        start = time.perf_counter()
        out = kda.core(q, k, v, g, beta, initial_state=state, algo=algo, threads=threads,
                       inplace_final_state=in_place)
        return time.perf_counter() - start, *out

    def run_ggml():
        return ggml.run(q, k, v, g, beta, s0_vfirst)

    _, o_ggml, s_ggml = run_ggml()
    _, o_kda, s_kda = run_kda()
    s_kda = s_kda.copy()
    ratios, t_ggml, t_kda = [], [], []
    # A decode step takes milliseconds: five times the rounds, so that a busy machine's
    # spikes do not make the median.
    rounds = rounds * 5 if t == 1 else rounds
    for r in range(rounds):
        if r % 2 == 0:
            tg, tk = run_ggml()[0], run_kda()[0]
        else:
            tk, tg = run_kda()[0], run_ggml()[0]
        t_ggml.append(tg)
        t_kda.append(tk)
        ratios.append(tg / tk)
    ggml.close()

    worst = 0.0
    for got, ref in ((o_kda, o_ggml), (s_kda, s_ggml)):
        worst = max(worst, float(np.abs(got - ref).max()) / max(float(np.abs(ref).max()), 1e-30))
    # The oracle on the first request's first two heads (the largest cases take long in f64).
    hh = min(h, 2)
    sl = lambda a: a[:1, :, :hh]
    o_ref, s_ref = recurrence_f64(sl(q), sl(k), sl(v), sl(g), sl(beta), d**-0.5, s0[:1, :hh])
    chunk = 64 if algo == "chunk" else 0
    oracle_ok = True
    for got, ref in ((o_kda[:1, :, :hh], o_ref), (s_kda[:1, :hh], s_ref)):
        atol, rtol = recurrence_tolerance(t, d, chunk, ref)
        oracle_ok &= bool(np.all(np.abs(got - ref) <= atol + rtol * np.abs(ref)))
    ms = lambda xs: "{:.2f}-{:.2f} ms (median {:.2f})".format(
        1e3 * min(xs), 1e3 * max(xs), 1e3 * statistics.median(xs)
    )
    print(
        f"{name} B={b} T={t} H={h} D={d} threads={threads} kda {algo}{', state in place' if in_place else ''}: "
        f"ggml/kda {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) over {rounds} rounds; "
        f"ggml {ms(t_ggml)}, kda {ms(t_kda)}; "
        f"|kda - ggml| / max|ggml| = {worst:.1e}; f64 oracle {'within' if oracle_ok else 'OUTSIDE'} tolerance"
    )
    sys.stdout.flush()
    return worst <= 1e-4 and oracle_ok


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lib", required=True, help="the ggml_kda shared library")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    ok = True
    for c in CASES:
        ok &= case(args.lib, *c, args.rounds)
    if not ok:
        print("peer comparison: numerics outside their bounds (see above)", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
