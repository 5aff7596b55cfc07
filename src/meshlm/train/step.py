"""The jitted training step of a meshlm model on a mesh, and of the same model unsharded.

Both use ``optim.make_step`` (accumulate -> clip by global norm -> AdamW); only the gradient
function differs. Parameters and optimizer state are donated: the step updates them in place.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshlm.errors import ShardingError
from meshlm.model import family
from meshlm.model.config import ModelConfig
from meshlm.model.routers import balance_update
from meshlm.model.transformer import loss_fn
from meshlm.parallel.layout import Layout
from meshlm.sharding.rules import dp_sharded, model_specs, shardings
from meshlm.sharding.spmd import reference_value_and_grad
from meshlm.sharding.stage_slots import slot_balance, slots_of
from meshlm.sharding.strategy import strategy
from meshlm.train.optim import OptimConfig, adamw, dropout_seed, make_step, trainable

# The compute dtypes (``model.family.COMPUTE_DTYPES``) as arrays' dtypes; float32: the master weights'.
COMPUTE_DTYPES = dict(zip(family.COMPUTE_DTYPES, (None, jnp.bfloat16), strict=True))


def step_model(cfg: ModelConfig, *, remat: str, unroll: int, fsdp: bool) -> ModelConfig:
    """The model a train step runs: ``cfg`` with ``remat`` and the layer loop's ``unroll``, where 0 is
    every layer (straight-line code, ~1.2x faster on CPU) unless FSDP or remat is on: their memory
    saving needs the rolled loop (1), since XLA schedules straight-line code to hold every layer's
    gathered weights or recomputed activations at once (``meshlm plan``, tiny-llama on 2x4: full remat
    peak 8.6 MiB unrolled, 5.4 MiB rolled; ``small`` on 8x1 with FSDP: temporaries 153 MiB, 56 MiB)."""
    if not unroll:
        unroll = 1 if fsdp or remat != "none" else cfg.n_layers
    return cfg.replace(remat=remat, unroll=unroll)


def init_model(cfg: ModelConfig, where, seed: int, dtype=None, specs: dict | None = None):
    """Parameters created already sharded on ``where``, a Layout (with ``fsdp``, weights also split
    over DP) or a jax Mesh: returns (params, specs). ``specs``: the layout's, computed already."""
    from meshlm.model.transformer import init_fn
    from meshlm.sharding.rules import init_sharded

    layout = Layout.of(where)
    init, example = init_fn(cfg)
    slots = slots_of(cfg, layout)  # uneven pp stages: the body's stack padded (``stage_slots``)
    return init_sharded(
        init,
        jax.random.PRNGKey(seed),
        example,
        specs_fn=lambda a: model_specs(cfg, a, layout) if specs is None else specs,
        mesh=layout.mesh,
        dtype=dtype,
        pad=None if slots is None else slots.pad,
    )


def sharded_step(
    cfg: ModelConfig, ocfg: OptimConfig, layout: Layout, specs, params, compute_dtype=None, dpo=None, seed=0
):
    """(step_fn, optimizer): step_fn(params, opt_state, batch) -> (params, opt_state, metrics) (a
    mixture of experts' metrics: also "routing", the step's routing statistics, ``train.routing``).

    ``params`` may be arrays or ShapeDtypeStructs (ahead-of-time compilation). With ``layout.fsdp``
    ``specs`` must split weights over DP (``model_specs`` on that layout; checked). ``dpo``: (beta,
    loss): DPO's step instead (``train.dpo``; its metrics also "dpo", the reward statistics)."""
    check_fsdp_specs(specs, layout.fsdp)
    part = trainable(cfg)  # LoRA: the adapters alone (no AdamW state for the frozen base)
    opt = adamw(ocfg, part.select(params))
    if dpo is not None:
        from meshlm.train.dpo import dpo_value_and_grad

        grad = dpo_value_and_grad(
            cfg, layout, specs, beta=dpo[0], loss=dpo[1], compute_dtype=compute_dtype, accum=ocfg.accum_steps
        )
        return jax.jit(make_step(grad, opt, ocfg, aux_key="dpo", part=part), donate_argnums=(0, 1)), opt
    # sharded (one shard_map) or, with a pipeline, through its schedule: the layout's strategy; either
    # way a mixture of experts also returns its routing statistics (``make_step``: metrics)
    routing = cfg.arch.moe
    # with multi-token prediction on, the loss also returns its depths' losses (``loss_fn``'s metrics)
    build = (lambda par: loss_fn(cfg, par, routing, metrics=True)) if cfg.mtp_on else None
    grad = strategy(layout).value_and_grad(
        cfg, layout, specs, compute_dtype=compute_dtype, routing=routing or cfg.mtp_on, build_loss=build
    )
    step = make_step(
        grad,
        opt,
        ocfg,
        balance=slot_balance(balance_update(cfg), slots_of(cfg, layout)),
        part=part,
        dropout_seed=dropout_seed(cfg, seed),
    )
    return jax.jit(step, donate_argnums=(0, 1)), opt


def check_fsdp_specs(specs, fsdp: bool) -> None:
    """``fsdp`` must agree with the specs: FSDP specs split weights over DP, plain ones do not."""
    split = any(dp_sharded(s) for s in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P)))
    if split != fsdp:
        have = "split weights over dp" if split else "do not split weights over dp"
        raise ShardingError(
            f"fsdp={fsdp} but the parameter specs {have}; build them with model_specs (or "
            f"init_model) on a Layout with fsdp={fsdp}"
        )


def reference_step(cfg: ModelConfig, ocfg: OptimConfig, params, compute_dtype=None, seed=0):
    """The same step for the unsharded model (plain arrays; GSPMD partitions it if they're sharded)."""
    part = trainable(cfg)
    opt = adamw(ocfg, part.select(params))
    balance = balance_update(cfg)  # it needs the routing statistics: the loss then returns them
    routing = balance is not None
    grad = reference_value_and_grad(lambda par: loss_fn(cfg, par, routing), compute_dtype, has_aux=routing)
    step = make_step(grad, opt, ocfg, balance=balance, part=part, dropout_seed=dropout_seed(cfg, seed))
    return jax.jit(step, donate_argnums=(0, 1)), opt


def init_opt_state(opt, params, specs, mesh):
    """Optimizer state laid out like the parameters (moments) and replicated (counters); ``params``
    and ``specs``: the trained part (``optim.trainable``'s ``select``)."""
    param_sh = shardings(specs, mesh)
    abstract = jax.eval_shape(opt.init, params)
    out = _like_params(abstract, param_sh, NamedSharding(mesh, P()))
    return jax.jit(opt.init, out_shardings=out)(params)


def _like_params(tree, param_sh, replicated):
    """Map each optimizer-state leaf to its parameter's sharding (found by structure), else replicated."""
    flat_sh = jax.tree.leaves(param_sh)
    n = len(flat_sh)

    def visit(node):
        leaves, treedef = jax.tree.flatten(node)
        if len(leaves) == n and treedef == jax.tree.structure(param_sh):
            return jax.tree.unflatten(treedef, flat_sh)
        return None

    def walk(node):
        got = visit(node)
        if got is not None:
            return got
        if isinstance(node, tuple | list) or hasattr(node, "_fields"):
            children = [walk(c) for c in node]
            return type(node)(*children) if hasattr(node, "_fields") else type(node)(children)
        if isinstance(node, dict):
            return {k: walk(v) for k, v in node.items()}
        return replicated

    return walk(tree)


def abstract_opt_state(opt, params, specs, mesh):
    """``init_opt_state``'s result as ShapeDtypeStructs with its shardings: nothing is allocated
    (``params`` may be ShapeDtypeStructs; the memory planner compiles a step from these)."""
    abstract = jax.eval_shape(opt.init, params)
    layout = _like_params(abstract, shardings(specs, mesh), NamedSharding(mesh, P()))
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, layout)
