"""The decode step's KV-cache write alone on the chip: XLA's scatter against the Pallas kernel, side by side.

Issue 64: a chip profile of the llama-100m batch-8 bf16 decode step put its 16 cache writes (K and V, 8
layers: XLA:TPU's scatter fusions) at ~22 us each, a third of the step, for B x 768 values each
(docs/benchmarks.md, "Decode"). ``model.cache_kernel`` writes the same values by a Pallas kernel. This
times both on one device in one process: for each batch size, a program of ``--steps`` decode steps,
each writing one token a row into every layer of the K and the V cache ([L, B, S, Kc * E] as generation
holds them, donated: written in place) at the row's next position, by each way in turn; the time a
write (the program's wall time over its writes, the loop's own cost included in both) and whether the
two ways left the same cache (they must: the same values, bit for bit).

    PYTHONPATH=src python scripts/kv_write.py                      # on the chip, ~30 s
    PYTHONPATH=src python scripts/kv_write.py --batch 1,8,64 --steps 64 --f32
    PYTHONPATH=src python scripts/kv_write.py --cpu-smoke          # tiny-llama, interpret mode, CPU

One JSON line last: {"config", "dtype", "rows": [{"batch", "slots", "width", "scatter_us", "kernel_us",
"equal"}]}.
"""

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from meshlm.generate.cache import cache_shapes
from meshlm.generate.programs import slots_for
from meshlm.model.cache_kernel import kernel_fits, kernel_write, scatter_write
from meshlm.model.config import get_config

WAYS = {"scatter": scatter_write, "kernel": kernel_write}


def program(write, steps: int, prompt: int):
    """jit(stacks (k, v) [L, B, S, F], x [2, B, 1, F]) -> stacks after ``steps`` decode steps' writes:
    step i writes x (varied by i) at position prompt + i of row b (less (5 b) % 16: rows of different
    lengths), into every layer of both."""

    def run(stacks, x):
        layers, rows = stacks[0].shape[:2]

        def step(i, stacks):
            # rows of different lengths, as a batch of prompts: each row's own slot, its own tile block
            at = jnp.maximum(prompt + i - (jnp.arange(rows, dtype=jnp.int32) * 5) % 16, 0)[:, None]
            new = (x + i.astype(x.dtype)).astype(stacks[0].dtype)  # a new token a step

            def layer(j, stacks):
                return tuple(write(c, j, at, new[n]) for n, c in enumerate(stacks))

            return lax.fori_loop(0, layers, layer, stacks)

        return lax.fori_loop(0, steps, step, stacks)

    return jax.jit(run, donate_argnums=0)


def measure(shape, dtype, steps: int, prompt: int, reps: int) -> dict:
    """One batch size: each way's time a write (µs, median of ``reps`` runs) and whether they agree."""
    layers, rows, slots, width = shape
    key = jax.random.PRNGKey(0)
    x = jax.random.normal(key, (2, rows, 1, width), jnp.float32).astype(dtype)
    fresh = lambda: tuple(jnp.zeros(shape, dtype) + jnp.asarray(n, dtype) for n in range(2))
    out, times = {}, {}
    for name, write in WAYS.items():
        run = program(write, steps, prompt)
        out[name] = np.asarray(run(fresh(), x)[0].astype(jnp.float32))  # compiled, and the result kept
        runs = []
        for _ in range(reps):
            stacks = fresh()
            jax.block_until_ready(stacks)
            t0 = time.perf_counter()
            jax.block_until_ready(run(stacks, x))
            runs.append(time.perf_counter() - t0)
        times[name] = 1e6 * float(np.median(runs)) / (steps * layers * 2)
    equal = bool(np.array_equal(out["scatter"], out["kernel"]))
    row = {"batch": rows, "slots": slots, "width": width, "equal": equal}
    return row | {f"{name}_us": round(t, 3) for name, t in times.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="llama-100m")
    p.add_argument("--batch", default="1,8,32,64", help="comma list of batch sizes")
    p.add_argument("--prompt", type=int, default=512, help="the first position written")
    p.add_argument("--new", type=int, default=65, help="new tokens: the cache holds prompt + new slots")
    p.add_argument("--steps", type=int, default=64, help="decode steps a program (each: 2 x L writes)")
    p.add_argument("--reps", type=int, default=5, help="timed runs a way and batch (the median)")
    p.add_argument("--f32", action="store_true", help="a float32 cache (default bf16, generate --bf16)")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny-llama, batch 2, a few steps, on CPU")
    a = p.parse_args()
    if a.cpu_smoke:
        a.config, a.batch, a.prompt, a.new, a.steps, a.reps = "tiny-llama", "2", 8, 8, 3, 1
    cfg = get_config(a.config)
    dtype = jnp.float32 if a.f32 else jnp.bfloat16
    slots = slots_for(cfg, a.prompt + a.new)
    rows = []
    for b in (int(v) for v in a.batch.split(",")):
        shape = cache_shapes(cfg, 1, b, slots)["k"]
        if not kernel_fits(jax.ShapeDtypeStruct(shape, dtype)):
            rows.append({"batch": b, "slots": shape[2], "error": "the kernel does not apply (kernel_fits)"})
            continue
        rows.append(measure(shape, dtype, min(a.steps, a.new), a.prompt, a.reps))
        r = rows[-1]
        print(
            f"batch {b:3d}: [L, B, S, F] {shape}: scatter {r['scatter_us']:.2f} us a write, kernel "
            f"{r['kernel_us']:.2f} us ({r['scatter_us'] / r['kernel_us']:.2f}x); same cache: {r['equal']}"
        )
    what = {"config": a.config, "dtype": jnp.dtype(dtype).name, "backend": jax.default_backend()}
    print(json.dumps(what | {"rows": rows}))
    return 0 if all(r.get("equal", True) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
