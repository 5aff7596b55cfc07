"""Long context on CPU: the train step's compiled memory per device (and optionally its time) for plain
attention, blockwise attention and context parallelism, at several sequence lengths.

Compiles ``meshlm plan``'s step (``perf.plan.measure``: the real sharded train step, ahead of time, batch
1) for each variant and prints one device's compiled temporaries and peak (XLA's memory analysis);
``--time N`` also runs N steps and prints the median seconds per step. The sequence may exceed the
preset's max_seq_len (rotary: a configuration limit).

    PYTHONPATH=src python scripts/long_context.py --config cpu --seq-lens 1024 4096 16384 --devices 4
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

VARIANTS = {  # name -> (attention, cp, cp strategy)
    "plain": ("plain", 1, "ring"),
    "blockwise": ("blockwise", 1, "ring"),
    "cp ring": ("blockwise", None, "ring"),
    "cp allgather": ("blockwise", None, "allgather"),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="cpu")
    p.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--devices", type=int, default=4, help="fake CPU devices: the cp of the cp variants")
    p.add_argument("--block", type=int, default=512)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--time", type=int, default=0, help="also run this many steps and time them")
    a = p.parse_args()
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={a.devices}"
    from meshlm.model.config import get_config
    from meshlm.parallel.layout import Layout
    from meshlm.perf.plan import measure
    from meshlm.perf.plan_settings import PlanSettings

    cfg = get_config(a.config)
    print(f"{a.config}, batch 1, float32, one device's compiled memory (MiB); cp = {a.devices}")
    print(f"{'variant':<14} {'T':>6} {'temp':>9} {'peak':>9} {'s/step':>8}")
    for name in a.variants:
        attention, cp, strategy = VARIANTS[name]
        layout = Layout(cp=cp or a.devices, cp_strategy=strategy)
        model = cfg.replace(attention=attention, attn_block=a.block)
        for t in a.seq_lens:
            m = measure(model, layout, PlanSettings(batch_size=1, seq_len=t))
            secs = _time(model, layout, t, a.time) if a.time else None
            shown = f"{secs:>8.3f}" if secs is not None else f"{'':>8}"
            print(
                f"{name:<14} {t:>6} {m['temp'] / 2**20:>9.1f} {m['peak'] / 2**20:>9.1f} {shown}", flush=True
            )


def _time(cfg, layout, t: int, steps: int) -> float:
    """Median seconds per train step of ``cfg`` on ``layout``, batch 1 x ``t`` (random tokens)."""
    import jax
    import numpy as np

    from meshlm.parallel.placement import batch_sharding, put_global
    from meshlm.train.optim import OptimConfig
    from meshlm.train.step import init_model, init_opt_state, sharded_step

    params, specs = init_model(cfg, layout, 0)
    step, opt = sharded_step(cfg, OptimConfig(), layout, specs, params)
    state = init_opt_state(opt, params, specs, layout.mesh)
    rng = np.random.default_rng(0)
    batch = {
        k: put_global(rng.integers(0, cfg.vocab_size, (1, t), dtype=np.int32), batch_sharding(layout, 1))
        for k in ("inputs", "targets")
    }
    seconds = []
    for i in range(steps + 1):
        start = time.perf_counter()
        params, state, metrics = step(params, state, batch)
        jax.block_until_ready(metrics)
        if i:  # the first step compiles
            seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


if __name__ == "__main__":
    main()
