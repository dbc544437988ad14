"""The peers' side of kda's `gpu-check` comparison (xtask/src/gpu_check/peers.rs).

A measuring server on stdin/stdout: it announces the kinds of case it can measure
(`@ready chunk gemm`), then answers each request `<id> <case> <target ms>` with
`@result <id> <case> <ms per call>` or `@error <id> <case> <message>` (the id lets the asking
side drop a reply that comes after it stopped waiting, e.g. behind Triton's autotuning).
Anything else it prints goes to the run's log.

- `chunk:T:H:D`: flash-linear-attention's Triton `chunk_kda` (the `fla-core` wheel, unpacked
  on PYTHONPATH) on one sequence of T tokens, H heads of D: bf16 q, k, v, fp32 log decay in
  [-0.5, 0], beta in (0, 1), q/k L2 norm in the kernel, the final state returned; the same
  inputs kda's `chunk` case times.
- `gemm:M:N:K`: torch's bf16 matmul `x[M, K] @ w[N, K]^T` (cuBLAS underneath), as kda's
  projection GEMMs.

The first request of a case builds its inputs, warms it up (Triton compiles and autotunes
there) and fixes how many calls fill the target; later requests time that many calls between
two CUDA events.
"""

import sys
import traceback


def reply(text):
    sys.stdout.write("@" + text + "\n")
    sys.stdout.flush()


def main():
    import torch

    if not torch.cuda.is_available():
        reply("ready")
        print("torch sees no CUDA device", file=sys.stderr)
        return
    kinds = ["gemm"]
    chunk_kda = None
    try:
        from fla.ops.kda import chunk_kda  # noqa: F811

        kinds.append("chunk")
    except Exception:  # noqa: BLE001 - any failure only drops the case kind
        print("fla's chunk_kda is unavailable:", file=sys.stderr)
        traceback.print_exc()
    dev = torch.device("cuda")
    print(f"peer: torch {torch.__version__} on {torch.cuda.get_device_name(dev)}", file=sys.stderr)
    gen = torch.Generator(device=dev).manual_seed(0)

    def uniform(shape, lo, hi, dtype):
        x = torch.rand(shape, generator=gen, device=dev, dtype=torch.float32)
        return (lo + (hi - lo) * x).to(dtype)

    def build(case):
        kind, *dims = case.split(":")
        dims = [int(d) for d in dims]
        if kind == "gemm":
            m, n, k = dims
            x = uniform((m, k), -1.0, 1.0, torch.bfloat16)
            w = uniform((n, k), -0.05, 0.05, torch.bfloat16)
            return lambda: torch.matmul(x, w.t())
        if kind == "chunk" and chunk_kda is not None:
            t, h, d = dims
            q, k, v = (uniform((1, t, h, d), -1.0, 1.0, torch.bfloat16) for _ in range(3))
            g = uniform((1, t, h, d), -0.5, 0.0, torch.float32)
            beta = uniform((1, t, h), 0.0, 1.0, torch.bfloat16)
            return lambda: chunk_kda(
                q, k, v, g, beta,
                scale=d ** -0.5,
                output_final_state=True,
                use_qk_l2norm_in_kernel=True,
            )
        raise ValueError(f"cannot measure {case}")

    prepared = {}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reply("ready " + " ".join(kinds))
    for line in sys.stdin:
        words = line.split()
        if len(words) < 2:
            continue
        rid, case = words[0], words[1]
        target = float(words[2]) if len(words) > 2 else 40.0
        try:
            if case not in prepared:
                fn = build(case)
                fn()
                torch.cuda.synchronize()
                start.record()
                fn()
                end.record()
                end.synchronize()
                once = max(start.elapsed_time(end), 1e-3)
                prepared[case] = (fn, max(1, min(1000, int(target / once))))
            fn, calls = prepared[case]
            torch.cuda.synchronize()
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            reply(f"result {rid} {case} {start.elapsed_time(end) / calls:.6f}")
        except Exception as e:  # noqa: BLE001 - reported to the caller, the server goes on
            traceback.print_exc()
            reply(f"error {rid} {case} {type(e).__name__}: {e}".replace("\n", " "))


if __name__ == "__main__":
    main()
