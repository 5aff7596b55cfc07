"""What a grouped matmul can cost on XLA:CPU at cpu-moe's shapes, against the dense MLP matmul of equal FLOPs.

The bound behind docs/benchmarks.md's "Why the step time stays above 1.5 on this CPU": cpu-moe's 512
tokens x 8 choices are 4096 rows over 64 experts of [256, 128]; dense-eq's MLP is [512, 256] x [256, 1024],
the same FLOPs. The ideal grouped matmul (perfectly balanced, no padding, no routing) is timed as XLA's
batched dot, as a loop of per-expert dots (``lax.map``), as XLA's ``ragged_dot``, and, for the host's own
BLAS, as numpy's batched matmul. Forward only, float32, medians; XLA's cases round-robin, then numpy's
(OpenBLAS's threads spin after a call and take the cores XLA's threads would use).

    python scripts/grouped_matmul_cpu.py                 # every core
    taskset -c 0 python scripts/grouped_matmul_cpu.py    # one core: the per-core cost
"""

import argparse
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np


def _timer(fn, args, is_jax):
    def once():
        start = time.perf_counter()
        out = fn(*args)
        if is_jax:
            out.block_until_ready()
        return time.perf_counter() - start

    once()  # compile / warm up
    return once


def _dot(pair):
    return pair[0] @ pair[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=30, help="round-robin repetitions (default 30)")
    parser.add_argument("--inner", type=int, default=10, help="calls per timing (default 10)")
    a = parser.parse_args()
    E, T, K, D, H = 64, 512, 8, 256, 128  # cpu-moe: experts, tokens, choices, d_model, expert hidden
    key = jax.random.PRNGKey(0)
    x = jax.random.normal(key, (T, D))  # [T, D] dense-eq's tokens
    w = jax.random.normal(key, (D, K * H))  # [D, k H] dense-eq's up projection
    xe = jax.random.normal(key, (E, T * K // E, D))  # [E, rows, D] the rows, sorted and balanced
    we = jax.random.normal(key, (E, D, H))  # [E, D, H]
    sizes = jnp.full((E,), T * K // E, jnp.int32)
    cases = {
        "xla dense (dense-eq)": (jax.jit(jnp.matmul), (x, w), True),
        "xla batched dot": (jax.jit(lambda a, b: jnp.einsum("erd,edi->eri", a, b)), (xe, we), True),
        "xla per-expert dots": (jax.jit(lambda a, b: jax.lax.map(_dot, (a, b))), (xe, we), True),
        "xla ragged_dot": (jax.jit(jax.lax.ragged_dot), (xe.reshape(-1, D), we, sizes), True),
        "numpy dense": (np.matmul, (np.asarray(x), np.asarray(w)), False),
        "numpy batched": (np.matmul, (np.asarray(xe), np.asarray(we)), False),
    }
    times = {name: [] for name in cases}
    for backend in ("xla", "numpy"):
        chosen = {n: c for n, c in cases.items() if n.startswith(backend)}
        timers = {n: _timer(fn, args, is_jax) for n, (fn, args, is_jax) in chosen.items()}
        for _ in range(a.reps):
            for name, once in timers.items():
                if name == "xla ragged_dot" and len(times[name]) >= 3:
                    continue  # ~100x the others: three timings say enough
                times[name].append(sum(once() for _ in range(a.inner)) / a.inner)
    dense = statistics.median(times["xla dense (dense-eq)"])
    ndense = statistics.median(times["numpy dense"])
    med = {n: statistics.median(t) for n, t in times.items()}
    report = {
        "cores": len(os.sched_getaffinity(0)),
        "ms": {n: round(t * 1e3, 3) for n, t in med.items()},
        "over_xla_dense": {n: round(t / dense, 2) for n, t in med.items() if n.startswith("xla")},
        "over_numpy_dense": {n: round(t / ndense, 2) for n, t in med.items() if n.startswith("numpy")},
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
