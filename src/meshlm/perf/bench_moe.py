"""``meshlm bench`` on a mixture of experts: the step against the same model without ep (``no-ep``, with
``--ep``) and against a dense model of equal active parameters (``dense-eq``), timed side by side in
the one run (``bench.time_interleaved``), and the all-to-alls of ep.

dense-eq (``dense_equivalent``): the same config with one expert of k x moe_d_ff hidden units, which
every token takes with weight 1 -- a dense gated MLP of d_ff = k x moe_d_ff (n always-on shared experts
folded in: (k + n) x moe_d_ff; Qwen2-MoE's gated one kept as it is), the same attention, embeddings
and head, no aux or z-loss. Its parameters are the MoE's active parameters (``model.accounting``; its
router's D x 1 weight for the MoE's D x E aside), and its model FLOPs the MoE's. It runs on the dp x mp
mesh of the same devices (one expert: nothing to split over ep), by the "dense" dispatch: its one
expert on every token is one [N, D] x [D, k x I] matmul per projection. (By the MoE's own dispatch it
was not a dense MLP: "blocks" ran a scan over N / 16 blocks of 16 rows, each under a ``lax.cond`` --
qwen3-moe-100m at 8 x 512: 8 loops of 256 trips, 28,672 instructions a step against the rest of the
step's ~1,500, scripts/moe_hlo.py -- the baseline the MoE was measured against until 7 December 2026.)
The gap between the two steps is what the mixture costs beyond its model FLOPs: the router, the dispatch
(with ep the all-to-alls), and -- the largest part on these meshes -- the dropless dispatch computing
every expert on every token's slot: E / k times the routed expert FLOPs -- what the "dense" dispatch
(the proof's reference) still costs, and the sorted dispatches (``parallel.grouped``) remove.

``expert_flops_over_routed``: per dispatch (the config's and "dense", today's), the matmul FLOPs of one
MoE layer's experts, forward and backward, read from the compiled HLO (``perf.hlo.dot_flops_per_step``:
XLA's ``cost_analysis`` counts a loop body once) over the routed ones, 18 x D x I per token-choice of
this shard's experts, on this shard's shapes (with ep: the ep x N gathered tokens, E / ep experts).
"dense-dispatch" (``TODAY``): the same model with the "dense" dispatch, timed beside the others.
"""

from __future__ import annotations

import statistics

import jax
import jax.numpy as jnp
import numpy as np

from meshlm.model.accounting import param_counts
from meshlm.model.config import ModelConfig
from meshlm.parallel.layout import Layout
from meshlm.parallel.placement import batch_sharding
from meshlm.perf.bench_settings import DENSE, DISPATCH_IMPLS, NO_EP, TODAY, BenchSettings
from meshlm.train.optim import OptimConfig
from meshlm.train.step import init_model, init_opt_state, sharded_step

__all__ = ["DENSE", "NO_EP", "TODAY", "dense_equivalent", "dense_step", "moe_comparison", "today_step"]


def dense_equivalent(cfg: ModelConfig) -> ModelConfig:
    """The dense model of ``cfg``'s active parameters: one expert of k x moe_d_ff hidden units, chosen
    by every token with weight 1 (a dense gated MLP), no aux or z-loss (module docstring). The router
    is made a softmax over that one expert (weight exactly 1): no groups, scaling or selection bias
    (cpu-moe's groups of 16 cannot split one expert); the experts' biases and activation stay; the
    always-on shared experts (``n_shared_experts``) are folded into the one MLP; the "dense" dispatch."""
    return cfg.replace(
        n_experts=1,
        experts_per_token=1,
        # the always-on shared experts folded in (their width is n x moe_d_ff: kept apart, they would
        # grow with the one expert's moe_d_ff): one MLP of the k routed and n shared experts' units
        moe_d_ff=(cfg.experts_per_token + cfg.n_shared_experts) * cfg.moe_d_ff,
        n_shared_experts=0,
        router_aux_loss_coef=0.0,
        router_z_loss_coef=0.0,
        router_score="softmax",
        n_group=0,
        topk_group=0,
        routed_scaling_factor=1.0,
        balance_bias=False,
        moe_bias_rate=0.0,
        moe_dispatch="dense",  # one expert on every token: the dense MLP itself (module docstring)
    )


def dense_step(
    cfg: ModelConfig, ocfg: OptimConfig, layout: Layout, settings: BenchSettings, host: dict, dtype=None
):
    """dense-eq's (jitted step, params, opt_state, batch) for ``bench._compiled``: its own parameters
    (seed ``settings.seed``) on the dp x mp mesh, the same host batch ``host``; ``dtype``: the compute
    dtype (``train.step.COMPUTE_DTYPES``)."""
    dense, flat = dense_equivalent(cfg), layout.flat
    params, specs = init_model(dense, flat, settings.seed)
    step, opt = sharded_step(dense, ocfg, flat, specs, params, compute_dtype=dtype)
    batch = jax.device_put(host, batch_sharding(flat, 1))
    return step, params, init_opt_state(opt, params, specs, flat.mesh), batch


def today_step(
    cfg: ModelConfig, ocfg: OptimConfig, layout: Layout, host_params, host, dtype=None, dispatch="dense"
):
    """``TODAY``'s (jitted step, params, opt_state, batch): the same parameters and batch, the "dense"
    dispatch (or ``dispatch``: a ``DISPATCH_IMPLS``' one), on the same mesh, in compute dtype ``dtype``."""
    from meshlm.sharding.rules import model_specs, shardings

    today = cfg.replace(moe_dispatch=dispatch)
    specs = model_specs(today, host_params, layout)
    params = jax.device_put(host_params, shardings(specs, layout.mesh))
    step, opt = sharded_step(today, ocfg, layout, specs, params, compute_dtype=dtype)
    batch = jax.device_put(host, batch_sharding(layout, 1))
    return step, params, init_opt_state(opt, params, specs, layout.mesh), batch


def _routing(cfg: ModelConfig, layout: Layout, tokens: int, seed: int):
    """(ids [N, k], E_here): one shard's routing of ``tokens`` global (N = tokens / (dp x cp), ep x N
    gathered with ep) by random router logits, the top k of them; its experts are 0 .. E_here - 1."""
    n = tokens // (layout.dp * layout.cp) * layout.ep
    rng = np.random.default_rng(seed)
    ids = jax.lax.top_k(jnp.asarray(rng.normal(size=(n, cfg.n_experts)), jnp.float32), cfg.experts_per_token)
    return ids[1], cfg.n_experts // layout.ep


def expert_flops_over_routed(cfg: ModelConfig, layout: Layout, tokens: int, seed: int = 0) -> dict:
    """{dispatch: compiled expert matmul FLOPs / routed ones} for the config's dispatch and "dense", on
    one shard's shapes: ``tokens`` global, N = tokens / (dp x cp) per shard, ep x N gathered with ep
    (module docstring). Random router logits, the top k of them."""
    from meshlm.model.moe import Experts
    from meshlm.parallel.context import Parallel
    from meshlm.perf.hlo import dot_flops_per_step

    ids, e = _routing(cfg, layout, tokens, seed)
    (n, k), d, i = ids.shape, cfg.d_model, cfg.moe_d_ff // layout.mp
    routed = 18 * d * i * int(jnp.sum(ids < e))
    args = [jnp.ones((n, d)), jnp.ones((n, k)), jnp.ones((e, d, i)), jnp.ones((e, d, i)), jnp.ones((e, i, d))]
    out = {}
    for how in dict.fromkeys((cfg.moe_dispatch, "dense")):
        if how == "gmm":  # the kernel's matmuls are a custom call, not HLO dots: nothing to count
            out[how] = None
            continue
        loss = lambda x, w, *ws, how=how: jnp.sum(Parallel().experts(x, ids, w, Experts(*ws, how)))
        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).lower(*args).compile().as_text()
        out[how] = dot_flops_per_step(text) / routed
    return out


def expert_flops_run_over_routed(
    cfg: ModelConfig, layout: Layout, tokens: int, seed: int = 0
) -> float | None:
    """The expert matmul FLOPs the block scans run over the routed ones ("blocks" only; else None), on
    the routing of ``expert_flops_over_routed``. The compiled count holds the scans' static bound
    (R / BLOCK blocks: under ep a shard's experts could take every one of the group's choices); the
    blocks past the used ones are skipped at run time (``lax.cond``), so a run multiplies 18 x BLOCK
    x D x I FLOPs (the 9 matmuls of a block, forward and backward) by the used blocks only."""
    from meshlm.parallel.grouped import BLOCK, plan

    if cfg.moe_dispatch != "blocks":
        return None
    ids, e = _routing(cfg, layout, tokens, seed)
    return int(plan(ids, e, 0, "blocks").used) * BLOCK / int(jnp.sum(ids < e))


def gmm_tiles(cfg: ModelConfig, layout: Layout, tokens: int) -> dict:
    """The gmm kernel's tiles (tm, tk, tn) at this shape, per forward matmul (``parallel.gmm_tiling``;
    --gmm-tiling's or chosen): "gate_up" ([R, D] x [D, I/mp] per expert) and "down" ([R, I/mp] x [I/mp,
    D]); the backward's: the same tm, tk and tn per its own dimensions."""
    from meshlm.parallel.gmm_tiling import parse_tiling, row_tile, tiles

    n = tokens // (layout.dp * layout.cp) * layout.ep
    e, d, i = cfg.n_experts // layout.ep, cfg.d_model, cfg.moe_d_ff // layout.mp
    tiling = parse_tiling(cfg.moe_gmm_tiling)
    tm = row_tile(n * min(cfg.experts_per_token, e), e, tiling)
    return {"tiling": cfg.moe_gmm_tiling, "gate_up": tiles(tm, d, i, tiling), "down": tiles(tm, i, d, tiling)}


def _paired(a: list[float], b: list[float]) -> float:
    """The median of the per-repetition ratios a / b (repetition i of each ran together)."""
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def moe_comparison(
    cfg: ModelConfig, seconds: dict[str, list[float]], layout: Layout, tokens: int
) -> dict | None:
    """A MoE model's step against dense-eq: parameters, the compute factor of the dropless dispatch,
    and each mesh implementation's step time over dense-eq's (``step_time_over_dense``, paired) and
    overhead, 1 - t(dense-eq) / t(impl): the share of the MoE step the dense model does not need."""
    if not cfg.arch.moe or DENSE not in seconds:
        return None
    moe, dense = param_counts(cfg), param_counts(dense_equivalent(cfg))
    names = ("meshlm", TODAY, NO_EP, *DISPATCH_IMPLS)
    ratios = {name: _paired(seconds[name], seconds[DENSE]) for name in names if name in seconds}
    return {
        "n_experts": cfg.n_experts,
        "experts_per_token": cfg.experts_per_token,
        "params": moe.total,
        "active_params": moe.active,
        "dense_equivalent": {
            "impl": DENSE,
            "d_ff": dense_equivalent(cfg).moe_d_ff,
            "shared_expert_d_ff": cfg.shared_expert_d_ff,
            "params": dense.total,
        },
        "dispatch": cfg.moe_dispatch,
        "gmm_tiles": gmm_tiles(cfg, layout, tokens),
        "expert_compute_factor": cfg.n_experts / cfg.experts_per_token,  # the "dense" dispatch's
        "expert_flops_over_routed": expert_flops_over_routed(cfg, layout, tokens),
        "expert_flops_run_over_routed": expert_flops_run_over_routed(cfg, layout, tokens),
        "step_time_over_dense": ratios,
        "overhead_vs_dense": {name: 1 - 1 / r for name, r in ratios.items()},
    }
