"""Step time of model/mesh variants, timed side by side in one process: the speed half of the sweep
that chose the main job's defaults (docs/training.md, "Choosing the main job's defaults").

Each variant is compiled once; then every repetition runs one step of each variant (rotating the order),
recording wall time and this process's CPU time. On a shared machine the CPU time and the per-repetition
ratios to the first variant are the steadier figures.

    python scripts/sweep_step.py --config cpu --batch-size 32 --seq-len 128 --reps 5 \\
        plain ref:0 ref:1 mesh:1x4 mesh:2x2 mesh:4x1

Variants: ``plain`` (perf/plain.py, one device), ``ref:U`` (meshlm unsharded, unroll U),
``mesh:DPxMP[/U]`` (meshlm sharded on a DP x MP mesh, unroll U; default 0: every layer). A suffix ``@V``
sets the vocabulary (embedding and head) to V ids, e.g. ``mesh:2x2@1024 mesh:2x2@2048`` for BPE sizes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def build(variant: str, cfg, host_params, host_batch):
    """(compiled step, params, opt_state, batch) of one variant."""
    import jax

    from meshlm.parallel.layout import Layout
    from meshlm.parallel.placement import batch_sharding
    from meshlm.perf.plain import plain_step
    from meshlm.train.optim import OptimConfig
    from meshlm.train.step import init_model, init_opt_state, reference_step, sharded_step

    kind, _, arg = variant.partition(":")
    dev = jax.devices()[0]
    if kind in ("plain", "ref"):
        params = jax.device_put(host_params, dev)
        if kind == "plain":
            step, opt = plain_step(cfg, OptimConfig(), params)
        else:
            step, opt = reference_step(cfg.replace(unroll=int(arg or 0)), OptimConfig(), params)
        opt_state, batch = jax.jit(opt.init)(params), jax.device_put(host_batch, dev)
    elif kind == "mesh":
        shape, _, unroll = arg.partition("/")
        dp, mp = map(int, shape.split("x"))
        layout, mcfg = Layout(dp=dp, mp=mp), cfg.replace(unroll=int(unroll or 0))
        params, specs = init_model(mcfg, layout, 0)
        step, opt = sharded_step(mcfg, OptimConfig(), layout, specs, params)
        opt_state = init_opt_state(opt, params, specs, layout.mesh)
        batch = jax.device_put(host_batch, batch_sharding(layout, 1))
    else:
        raise SystemExit(f"unknown variant {variant!r}: plain, ref:U or mesh:DPxMP[/U]")
    return step.lower(params, opt_state, batch).compile(), params, opt_state, batch


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("variants", nargs="+")
    p.add_argument("--config", default="cpu")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--devices", type=int, default=4)
    args = p.parse_args()
    os.environ["XLA_FLAGS"] = (
        f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={args.devices}"
    )
    import jax
    import numpy as np

    from meshlm.model.config import get_config
    from meshlm.model.transformer import param_shapes

    def inputs(variant: str):
        """(variant without its @V, model config, host params, host batch)."""
        name, _, vocab = variant.partition("@")
        cfg = get_config(args.config)
        cfg = cfg.replace(vocab_size=int(vocab)) if vocab else cfg
        rng = np.random.default_rng(0)
        params = jax.tree.map(
            lambda s: (0.02 * rng.standard_normal(s.shape)).astype(s.dtype), param_shapes(cfg)
        )
        shape = (args.batch_size, args.seq_len)
        batch = {k: rng.integers(0, cfg.vocab_size, shape, dtype=np.int32) for k in ("inputs", "targets")}
        return name, cfg, params, batch

    runs = {v: [*build(*inputs(v)), []] for v in args.variants}
    for rep in range(args.reps + 1):  # the first repetition is a warm-up
        k = rep % len(runs)
        for name in list(runs)[k:] + list(runs)[:k]:
            compiled, params, opt_state, batch, times = runs[name]
            wall, cpu = time.perf_counter(), time.process_time()
            params, opt_state, metrics = compiled(params, opt_state, batch)
            jax.block_until_ready((params, opt_state, metrics))
            if rep:
                times.append((time.perf_counter() - wall, time.process_time() - cpu))
            runs[name][1:3] = params, opt_state
    first, tokens = runs[args.variants[0]][4], args.batch_size * args.seq_len
    for name, run in runs.items():
        times = run[4]
        wall, cpu = (statistics.median(t[i] for t in times) for i in (0, 1))
        ratio = [statistics.median(a[i] / b[i] for a, b in zip(times, first, strict=True)) for i in (0, 1)]
        print(
            f"{name:14s} wall {wall:.3f} s  cpu {cpu:.3f} s  tokens/s {tokens / wall:7.0f}"
            f"  / {args.variants[0]}: wall {ratio[0]:.3f}x cpu {ratio[1]:.3f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
