"""One device's compiled memory of a train step: meshlm's ``sharded_step`` next to plain JAX's ``plain_step``.

Both steps are compiled ahead of time from ShapeDtypeStructs (nothing of the model is allocated) on the
default backend's first device (a TPU chip where there is one, else host CPU), with the same model,
batch, AdamW settings and compute dtype, and the script prints XLA's ``memory_analysis()`` of each:
argument, output, alias (outputs written into donated inputs), temporaries and the peak (argument +
output + temp - alias, as ``meshlm bench`` and ``meshlm plan`` count it), and meshlm's over plain's.

    PYTHONPATH=src python scripts/step_memory.py --config llama-100m --batch-size 8 --seq-len 512

``--dump DIR``: XLA's dump of both compilations (HLO after optimizations, buffer assignment) into DIR,
to find the buffers that differ. On CPU the temporaries are XLA CPU's plan; on the chip, TPU's.
"""

from __future__ import annotations

import argparse
import os


def compiled_steps(config: str, batch: int, seq: int, compute_dtype: str, remat: str = "none") -> dict:
    """{impl: memory_analysis parts} of meshlm's and plain JAX's step for ``config`` on one device."""
    import jax
    import jax.numpy as jnp

    from meshlm.model.config import get_config
    from meshlm.model.transformer import param_shapes
    from meshlm.parallel.layout import Layout
    from meshlm.parallel.mesh import make_mesh
    from meshlm.parallel.placement import batch_sharding
    from meshlm.perf.bench import compiled_memory
    from meshlm.perf.plain import plain_step
    from meshlm.sharding.rules import model_specs, shardings
    from meshlm.train.config import TrainConfig
    from meshlm.train.step import COMPUTE_DTYPES, abstract_opt_state, sharded_step, step_model

    cfg = step_model(get_config(config), remat=remat, unroll=0, fsdp=False)  # as ``meshlm train`` runs it
    ocfg, dtype = TrainConfig().optim(), COMPUTE_DTYPES[compute_dtype]
    layout = Layout.of(make_mesh(1, 1))
    shapes = param_shapes(cfg)
    specs = model_specs(cfg, shapes, layout)
    sh = shardings(specs, layout.mesh)
    params = jax.tree.map(lambda s, h: jax.ShapeDtypeStruct(s.shape, jnp.float32, sharding=h), shapes, sh)
    rows = batch_sharding(layout, 1)
    tokens = {k: jax.ShapeDtypeStruct((batch, seq), jnp.int32, sharding=rows) for k in ("inputs", "targets")}
    out = {}
    step, opt = sharded_step(cfg, ocfg, layout, specs, params, compute_dtype=dtype)
    state = abstract_opt_state(opt, params, specs, layout.mesh)
    out["meshlm"] = compiled_memory(step.lower(params, state, tokens).compile())
    plain_params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32), shapes)
    hand, hand_opt = plain_step(cfg, ocfg, plain_params, compute_dtype=dtype)
    hand_state = jax.eval_shape(hand_opt.init, plain_params)
    plain_tokens = {k: jax.ShapeDtypeStruct((batch, seq), jnp.int32) for k in tokens}
    out["plain"] = compiled_memory(hand.lower(plain_params, hand_state, plain_tokens).compile())
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="llama-100m")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--compute-dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--dump", default=None, help="a folder for XLA's dump of both compilations")
    a = p.parse_args()
    if a.dump:  # read by XLA when the backend starts: before jax is imported
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={a.dump}".strip()
    import jax

    mem = compiled_steps(a.config, a.batch_size, a.seq_len, a.compute_dtype)
    kind = jax.devices()[0].device_kind
    print(f"{a.config}, batch {a.batch_size} x {a.seq_len}, {a.compute_dtype}, on {kind}")
    parts = ("argument", "output", "alias", "temp", "peak")
    print(f"{'impl':<8}" + "".join(f"{k + ' MB':>14}" for k in parts))
    for impl, m in mem.items():
        print(f"{impl:<8}" + "".join(f"{m[k] / 1e6:>14.1f}" for k in parts))
    ratio = {k: mem["meshlm"][k] / mem["plain"][k] if mem["plain"][k] else float("nan") for k in parts}
    print(f"{'ratio':<8}" + "".join(f"{ratio[k]:>14.3f}" for k in parts))


if __name__ == "__main__":
    main()
