"""What a pipeline stage keeps per micro-batch, and the permutes a step runs, under pp x cp (traced only).

Usage: python scripts/pp_cp_memory.py [--config tiny-deep] [--seq-len 64] [--microbatches 4]
Prints, for --remat none and full and for no cp, cp 2 with the ring and with the all-gather (pp 2 x 1x2,
one row of --seq-len tokens a micro-batch): the bytes of 1F1B's stash per micro-batch per device
(``pipeline_stash.Residuals.kept_bytes``) and the ``ppermute``s over pp and over cp one step runs
(``proof.pipeline_verify.count_permutes``). Nothing is compiled: the figures in docs/pipeline.md.
"""

import argparse
import os


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="tiny-deep")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--microbatches", type=int, default=4)
    args = ap.parse_args(argv)
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8"
    import jax
    import jax.numpy as jnp

    import meshlm.parallel.pipeline_engines as engines
    from meshlm.model.config import get_config
    from meshlm.model.transformer import init_fn
    from meshlm.parallel.layout import Layout
    from meshlm.proof.pipeline_verify import count_permutes
    from meshlm.sharding.pipelined import pipelined_value_and_grad
    from meshlm.sharding.rules import model_specs

    kept, traced = {}, engines.residuals

    def recorded(*a, **kw):  # the stash's structure, as the 1F1B engine traces it
        kept["bytes"] = (found := traced(*a, **kw)).kept_bytes()
        return found

    engines.residuals = recorded
    m, t = args.microbatches, args.seq_len
    for remat in ("none", "full"):
        cfg = get_config(args.config).replace(remat=remat)
        for cp, strategy in ((1, "ring"), (2, "ring"), (2, "allgather")):
            layout = Layout(pp=2, mp=2, cp=cp, cp_strategy=strategy, microbatches=m)
            batch = {k: jnp.zeros((m, t), jnp.int32) for k in ("inputs", "targets")}
            params = jax.eval_shape(init_fn(cfg)[0], jax.random.PRNGKey(0), batch)
            fn = pipelined_value_and_grad(cfg, layout, model_specs(cfg, params, layout))
            jaxpr = jax.make_jaxpr(fn)(params, batch).jaxpr
            pp_n, cp_n = count_permutes(jaxpr), count_permutes(jaxpr, axis="cp")
            size = f"kept {kept['bytes']:>9,} B"
            print(f"remat {remat:4} {layout.label():32} {size}  permutes pp {pp_n} cp {cp_n}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
