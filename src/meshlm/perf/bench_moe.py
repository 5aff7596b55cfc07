"""``meshlm bench`` on a mixture of experts: the step against the same model without ep (``no-ep``, with
``--ep``) and against a dense model of equal active parameters (``dense-eq``), timed side by side in
the one run (``bench.time_interleaved``), and the all-to-alls of ep.

dense-eq (``dense_equivalent``): the same config with one expert of k x moe_d_ff hidden units, which
every token takes with weight 1 -- a dense gated MLP of d_ff = k x moe_d_ff (a shared expert kept as it
is), the same attention, embeddings and head, no aux or z-loss. Its parameters are the MoE's active
parameters (``model.accounting``; its router's D x 1 weight for the MoE's D x E aside), and its model
FLOPs the MoE's. It runs on the dp x mp mesh of the same devices (one expert: nothing to split over ep).
The gap between the two steps is what the mixture costs beyond its model FLOPs: the router, the dispatch
(with ep the all-to-alls), and -- the largest part on these meshes -- the dropless dispatch computing
every expert on every token's slot: E / k times the routed expert FLOPs (``parallel.experts``; with ep
each shard's E / ep experts compute on the ep x N tokens of its group: the same E / k). Reported as
``expert_compute_factor``: a grouped (ragged) matmul would remove it where XLA has one.
"""

from __future__ import annotations

import statistics

import jax

from meshlm.model.accounting import param_counts
from meshlm.model.config import ModelConfig
from meshlm.parallel.axes import AXIS, EP
from meshlm.parallel.layout import Layout
from meshlm.parallel.placement import batch_sharding
from meshlm.perf.bench_settings import BenchSettings
from meshlm.train.optim import OptimConfig
from meshlm.train.step import init_model, init_opt_state, sharded_step

NO_EP = AXIS[EP].baseline  # "no-ep": the same model on the same devices, every expert on every data shard
DENSE = "dense-eq"  # a MoE model: the dense model of equal active parameters (``dense_equivalent``)


def dense_equivalent(cfg: ModelConfig) -> ModelConfig:
    """The dense model of ``cfg``'s active parameters: one expert of k x moe_d_ff hidden units, chosen
    by every token with weight 1 (a dense gated MLP), no aux or z-loss (module docstring)."""
    return cfg.replace(
        n_experts=1,
        experts_per_token=1,
        moe_d_ff=cfg.experts_per_token * cfg.moe_d_ff,
        router_aux_loss_coef=0.0,
        router_z_loss_coef=0.0,
    )


def dense_step(cfg: ModelConfig, ocfg: OptimConfig, layout: Layout, settings: BenchSettings, host: dict):
    """dense-eq's (jitted step, params, opt_state, batch) for ``bench._compiled``: its own parameters
    (seed ``settings.seed``) on the dp x mp mesh, the same host batch ``host``."""
    dense, flat = dense_equivalent(cfg), layout.flat
    params, specs = init_model(dense, flat, settings.seed)
    step, opt = sharded_step(dense, ocfg, flat, specs, params)
    batch = jax.device_put(host, batch_sharding(flat, 1))
    return step, params, init_opt_state(opt, params, specs, flat.mesh), batch


def _paired(a: list[float], b: list[float]) -> float:
    """The median of the per-repetition ratios a / b (repetition i of each ran together)."""
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def moe_comparison(cfg: ModelConfig, seconds: dict[str, list[float]]) -> dict | None:
    """A MoE model's step against dense-eq: parameters, the compute factor of the dropless dispatch,
    and each mesh implementation's step time over dense-eq's (``step_time_over_dense``, paired) and
    overhead, 1 - t(dense-eq) / t(impl): the share of the MoE step the dense model does not need."""
    if not cfg.arch.moe or DENSE not in seconds:
        return None
    moe, dense = param_counts(cfg), param_counts(dense_equivalent(cfg))
    ratios = {name: _paired(seconds[name], seconds[DENSE]) for name in ("meshlm", NO_EP) if name in seconds}
    return {
        "n_experts": cfg.n_experts,
        "experts_per_token": cfg.experts_per_token,
        "params": moe.total,
        "active_params": moe.active,
        "dense_equivalent": {
            "impl": DENSE,
            "d_ff": cfg.experts_per_token * cfg.moe_d_ff,
            "shared_expert_d_ff": cfg.shared_expert_d_ff,
            "params": dense.total,
        },
        "expert_compute_factor": cfg.n_experts / cfg.experts_per_token,
        "step_time_over_dense": ratios,
        "overhead_vs_dense": {name: 1 - 1 / r for name, r in ratios.items()},
    }
