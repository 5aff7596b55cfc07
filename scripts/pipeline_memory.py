"""Compiled per-device memory of one pipelined training step against the number of micro-batches.

Usage: python scripts/pipeline_memory.py [--pp 4] [--microbatches 4,8,16,32] [--rows 64] [--width 256]
         [--hidden 1024] [--layers 8] [--virtual-stages 2]
The micro-batch size is fixed (--rows), so the global batch grows with M. The stage is a residual MLP
(the engine is generic; the figures in docs come from this script). Prints one row per schedule and M:
XLA's temp bytes (activations, stash, buffers; arguments and outputs excluded) and the schedule's facts.
"""

import argparse
import os
import sys

DEVICES = 8


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--microbatches", default="4,8,16,32")
    ap.add_argument("--rows", type=int, default=64, help="rows per micro-batch")
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--virtual-stages", type=int, default=2, help="for the interleaved rows")
    args = ap.parse_args(argv)
    os.environ["XLA_FLAGS"] = (
        f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES}"
    )

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import Mesh

    from meshlm.parallel.axes import PP
    from meshlm.parallel.pipeline import Pipeline, pipeline_value_and_grad
    from meshlm.parallel.pipeline_schedule import PipelineConfig, schedule_facts

    def stage_fn(params, x):
        def layer(x, w):
            return x + jnp.tanh(x @ w["w1"]) @ w["w2"], None

        return lax.scan(layer, x, params)[0]

    def loss_fn(y, targets):
        return jnp.mean((y - targets) ** 2)

    sd = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
    params = {"w1": sd(args.layers, args.width, args.hidden), "w2": sd(args.layers, args.hidden, args.width)}
    mesh = Mesh(np.array(jax.devices()[: args.pp]), (PP,))
    shape = f"layers={args.layers} width={args.width} hidden={args.hidden} rows/micro-batch={args.rows}"
    print(f"pp={args.pp} {shape}")
    print(f"{'schedule':<16}{'M':>4}{'temp MiB':>10}{'bubble':>8}{'permutes':>9}{'stashed':>8}")
    for schedule, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", args.virtual_stages)):
        for m in (int(s) for s in args.microbatches.split(",")):
            cfg = PipelineConfig(args.pp, m, schedule, v)
            fn = jax.jit(pipeline_value_and_grad(stage_fn, loss_fn, mesh, Pipeline(cfg)))
            x = sd(m * args.rows, args.width)
            temp = fn.lower(params, x, x).compile().memory_analysis().temp_size_in_bytes
            f = schedule_facts(cfg)
            name = f"{schedule} V={v}" if v > 1 else schedule
            facts = f"{f.bubble_fraction:>8.3f}{f.permutes_per_step:>9}{f.stashed_inputs:>8}"
            print(f"{name:<16}{m:>4}{temp / 2**20:>10.2f}{facts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
