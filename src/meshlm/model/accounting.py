"""The model's parameter accounting, in one place: how many parameters a config has (total) and how many
of them one token uses (active), and how many layers are mixtures of experts. ``meshlm configs``, the
FLOPs of MFU (``perf.flops``), the planner's activations (``perf.activations``) and the collective
counts (``perf.memory_collectives``) ask here.

Active parameters: a mixture-of-experts layer routes each token to k of its E experts, so of every
expert weight ([E, ...], in a module named ``experts``: ``model.moe``) a token uses k / E; everything
else (attention, the router, Qwen2-MoE's shared expert, dense layers among the MoE ones, embeddings,
norms) it uses whole. Counted from the model's own shapes (``param_shapes``: nothing is allocated), so
a family whose layers differ (dense layers interleaved, a shared expert) is counted as built. For a
dense model active = total. (The dropless dispatch *computes* every expert on every token: E / k times
the routed FLOPs, ``parallel.experts``; the active count is the model's, not that implementation's.)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from meshlm.model.params import flat_params, is_expert_weight
from meshlm.model.per_layer_fields import read_size


@dataclass(frozen=True)
class ParamCounts:
    total: int  # every parameter (a tied head once)
    active: int  # those one token uses: the experts' part counted k of E times (= total when dense)


def moe_layers(cfg) -> int:
    """How many layers have a mixture-of-experts feed-forward: every layer of a MoE family but its
    ``dense_layers`` (``ModelConfig.moe_layers``, the one rule)."""
    return len(cfg.moe_layers)


def active_share(cfg, path: str) -> float:
    """The fraction of parameter ``path`` one token uses: k / E of an expert weight, else all of it."""
    if cfg.arch.moe and is_expert_weight(path):
        return cfg.experts_per_token / cfg.n_experts
    return 1.0


def active_size(cfg, path: str, size: int) -> int:
    """``size`` elements of ``path``, as one token uses them (exact: an expert weight's size has the
    factor E)."""
    if active_share(cfg, path) == 1.0:
        return int(size)
    return int(size) // cfg.n_experts * cfg.experts_per_token


def count_params(cfg, params) -> ParamCounts:
    """Total and active parameters of a parameter tree (arrays or ShapeDtypeStructs) of model ``cfg``."""
    sizes = {path: read_size(cfg, path, int(np.prod(p.shape))) for path, p in flat_params(params).items()}
    return ParamCounts(
        total=sum(sizes.values()), active=sum(active_size(cfg, path, n) for path, n in sizes.items())
    )


def param_counts(cfg) -> ParamCounts:
    """Parameters of the real model (the vocabulary unpadded, a tied head counted once), from the
    model's own shapes: nothing is allocated."""
    from meshlm.model.transformer import param_shapes

    # The shapes traced through the simplest program of the same parameters (the dispatch, attention
    # kind and remat change how a model computes, never its parameters; the proof compares them so):
    # `meshlm configs` traces every preset, and the block dispatch's graph costs several times more.
    simplest = cfg.replace(vocab_multiple=1, moe_dispatch="dense", attention="plain", remat="none")
    return count_params(cfg, param_shapes(simplest))
