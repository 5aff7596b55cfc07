"""The experts alone on one chip: each sorted dispatch's grouped matmul against the dense MLP of equal FLOPs.

Issue 64: a mixture of experts within 1.3x of its dense equivalent. The bench's whole-model step
(``meshlm bench --impls meshlm,gmm-dispatch,dense-eq``) dilutes the experts with attention and the head;
this times one MoE layer's experts, forward and backward (the gradients of the tokens, the combine
weights and the three expert matrices), on random top-k routing, through meshlm's own dispatch
(``Parallel().experts``: the sort, the gathers, the combine's scatter-add and the grouped matmuls) by
``ragged_dot`` and by ``gmm`` at several tilings, against dense-eq's gated MLP ([N, D] x [D, k x I], the
same FLOPs as the routed rows), round-robin, medians. The shapes: qwen3-30b-a3b's experts whole (D 2048,
I 768, 128 experts, top 8), and qwen3-moe-100m's (D 768, I 256, 32, top 4), at 4096 tokens (batch 8 x
512). One JSON line per shape: ms per case, each over the dense MLP's, and any case that failed (e.g. a
tiling past the chip's VMEM) with its error's first line.

    PYTHONPATH=src python scripts/moe_kernels.py              # on the chip, bf16, < 90 s
    PYTHONPATH=src python scripts/moe_kernels.py --shape qwen3-30b-a3b   # one shape
    PYTHONPATH=src python scripts/moe_kernels.py --cpu-smoke  # tiny shapes, CPU (interpret mode)
"""

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

# name: (d_model, expert width I, experts E, per token k)
SHAPES = {"qwen3-30b-a3b": (2048, 768, 128, 8), "qwen3-moe-100m": (768, 256, 32, 4)}
SMOKE = {"smoke": (64, 32, 8, 2)}
# gmm's tilings tried beside "auto" (``parallel.gmm_tiling``): small and large row tiles, and tokamax's
# tuned tiles for qwen3-30b-a3b's shape (full K and N: its GMM_TILING_TUNED_LUT)
TILINGS = ("128,512,512", "512,512,512", "512,2048,768")


def _inputs(d, i, e, k, n, dtype, seed=0):
    rng = np.random.default_rng(seed)
    logits = jnp.asarray(rng.normal(size=(n, e)), jnp.float32)
    weights, ids = jax.lax.top_k(jax.nn.softmax(logits), k)
    x = jnp.asarray(rng.normal(size=(n, d)), dtype)
    experts = [jnp.asarray(rng.normal(size=s) * 0.02, dtype) for s in ((e, d, i), (e, d, i), (e, i, d))]
    dense = [jnp.asarray(rng.normal(size=s) * 0.02, dtype) for s in ((d, k * i), (d, k * i), (k * i, d))]
    return x, ids.astype(jnp.int32), weights.astype(dtype), experts, dense


def _moe_case(how, tiling, ids):
    from meshlm.model.moe import Experts
    from meshlm.parallel.context import Parallel
    from meshlm.parallel.gmm_tiling import parse_tiling

    def loss(x, cw, *ws):
        experts = Experts(*ws, how, tiling=parse_tiling(tiling))
        return jnp.sum(Parallel().experts(x, ids, cw, experts).astype(jnp.float32))

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))


def _dense_case():
    def loss(x, wg, wu, wd):
        return jnp.sum(((jax.nn.silu(x @ wg) * (x @ wu)) @ wd).astype(jnp.float32))

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))


def _cases(shape, n, dtype, tilings):
    """{name: (jitted, args)} for one shape; ragged_dot and gmm through meshlm's dispatch."""
    d, i, e, k = shape
    x, ids, cw, experts, dense = _inputs(d, i, e, k, n, dtype)
    cases = {"dense MLP (dense-eq)": (_dense_case(), (x, *dense))}
    cases["ragged_dot"] = (_moe_case("ragged_dot", "auto", ids), (x, cw, *experts))
    for tiling in ("auto", *tilings):
        cases[f"gmm {tiling}"] = (_moe_case("gmm", tiling, ids), (x, cw, *experts))
    return cases


def _compiled(cases):
    """Each case compiled and run once; a failure (a tiling the chip cannot hold) kept as its message."""
    ready, failed = {}, {}
    for name, (fn, args) in cases.items():
        try:
            jax.block_until_ready(fn(*args))
            ready[name] = (fn, args)
        except Exception as e:  # noqa: BLE001 -- reported per case, the others still run
            failed[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return ready, failed


def _time(ready, reps):
    """ms per case, round-robin (each repetition starts one case later), medians."""
    seconds = {name: [] for name in ready}
    names = list(ready)
    for rep in range(reps):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            fn, args = ready[name]
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            seconds[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(s) for name, s in seconds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per step (default 4096: 8 x 512)")
    parser.add_argument("--reps", type=int, default=10, help="round-robin repetitions (default 10)")
    parser.add_argument("--float32", action="store_true", help="float32 instead of bfloat16")
    parser.add_argument("--shape", choices=tuple(SHAPES), default=None, help="one shape only (default: both)")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU (interpret mode)")
    a = parser.parse_args()
    shapes = SMOKE if a.cpu_smoke else {k: v for k, v in SHAPES.items() if a.shape in (None, k)}
    tokens, reps = (32, 1) if a.cpu_smoke else (a.tokens, a.reps)
    tilings = ("128,128,128",) if a.cpu_smoke else TILINGS
    dtype = jnp.float32 if a.float32 else jnp.bfloat16
    for name, shape in shapes.items():
        ready, failed = _compiled(_cases(shape, tokens, dtype, tilings))
        ms = _time(ready, reps)
        base = ms.get("dense MLP (dense-eq)")
        row = {
            "shape": name,
            "d_model_expert_width_experts_top_k": shape,
            "tokens": tokens,
            "dtype": jnp.dtype(dtype).name,
            "device_kind": jax.devices()[0].device_kind,
            "ms": ms,
            "over_dense": {n: v / base for n, v in ms.items()} if base else None,
            "failed": failed,
        }
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
