"""A mixture of experts' router as one record (torchtitan's router config): ``Router.of(cfg)`` from the
config's ``RouterFields`` (``model.router_fields``) and ``norm_topk_prob``; ``Router.__call__`` turns
router logits into the scores, the combine weights and the chosen expert ids. The MoE layer
(``model.moe``) calls it and names no router.

The parts, in the order they apply (logits [.., E], at least float32: float64 under --x64):
  score     "softmax" over the E experts (Mixtral, Qwen-MoE, OLMoE, gpt-oss) or "sigmoid" of each
            logit (DeepSeek-V3, Kimi K2, GLM-4.5)
  choice    the scores, plus the per-expert selection bias where the family balances by one
            (aux-loss-free balancing): the bias changes which experts are chosen, never their weights
  groups    with ``n_group``: the experts in n_group equal groups; each token keeps its ``topk_group``
            best groups by the sum of their top-2 choice scores, the other groups' experts -inf
  top-k     ``TOP_K`` of the choice scores: equal values in the order of their expert ids (the lowest
            first: ``lax.top_k``'s rule), in the groups' ranking, the bias-shifted choice and the top-k
  weights   the chosen experts' *unbiased* scores, renormalised to sum to 1 where the family says
            (``norm_topk_prob``; a sigmoid's sum gets DeepSeek-V3's + 1e-20), times
            ``routed_scaling_factor``, times the chosen experts' learned scales where the family has
            them (Gemma 4's ``per_expert_scale``: ``expert_scale``)

The selection bias's update (after each step, from the load of the whole global batch) is
``balance_update``: it is state outside AdamW (its gradient is zero: the bias reaches the loss only
through which experts are chosen), saved with the parameters and resumed with them.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax

from meshlm.model.params import is_mtp, param_path

# The top-k: [.., n] -> (values, ids) [.., k], equal values in the order of their ids (lax.top_k keeps
# the lower index first). A module attribute: the proof plants another tie rule (``proof.moe_controls``).
TOP_K = lax.top_k
SCORE = {"softmax": lambda x: jax.nn.softmax(x, axis=-1), "sigmoid": jax.nn.sigmoid}
# The selection bias's parameter (``moe/router/<BIAS>`` [E] per layer; [L, E] stacked).
BIAS = "balance_bias"
# A sigmoid's renormalisation denominator gets this (DeepSeek-V3's; a softmax's sum is at least its
# largest score, so it needs none).
SIGMOID_EPS = 1e-20


def combine_scores(scores, choice):
    """The scores the combine weights are read from: the unbiased ones (a module attribute: the proof
    plants the biased ``choice`` instead, ``proof.moe_controls``)."""
    del choice
    return scores


@dataclass(frozen=True)
class Router:
    """How a token's experts are chosen and weighted (module docstring)."""

    score: str = "softmax"
    n_group: int = 0
    topk_group: int = 0
    renormalise: bool = True
    scaling: float = 1.0
    expert_scale: bool = False

    @classmethod
    def of(cls, cfg) -> Router:
        return cls(
            score=cfg.router_score,
            n_group=cfg.n_group,
            topk_group=cfg.topk_group,
            renormalise=cfg.norm_topk_prob,
            scaling=cfg.routed_scaling_factor,
            expert_scale=cfg.expert_scale,
        )

    def __call__(self, logits, k: int, bias=None, tap=lambda name, x: x, scale=None):
        """logits [.., E] -> (scores [.., E], combine weights [.., k], ids [.., k] int32). ``bias`` [E]:
        the selection bias (None: none); ``tap``: ``Parallel.tap`` (where the proof plants a fault);
        ``scale`` [E]: the experts' learned scales (``expert_scale``; None: none)."""
        scores = SCORE[self.score](logits)
        choice = scores if bias is None else scores + bias.astype(scores.dtype)
        if self.n_group:
            choice = jnp.where(self.group_mask(choice, tap), choice, jnp.array(-jnp.inf, choice.dtype))
        weights, ids = TOP_K(choice, k)
        if bias is not None or self.n_group:  # the chosen experts' unbiased scores
            weights = jnp.take_along_axis(combine_scores(scores, choice), ids, axis=-1)
        if self.renormalise:
            total = jnp.sum(weights, axis=-1, keepdims=True)
            weights = weights / (total + SIGMOID_EPS if self.score == "sigmoid" else total)
        if self.scaling != 1.0:
            weights = weights * jnp.asarray(self.scaling, weights.dtype)
        if self.expert_scale:
            weights = weights * scale.astype(weights.dtype)[ids]
        return scores, weights, ids.astype(jnp.int32)

    def group_mask(self, choice, tap=lambda name, x: x):
        """choice [.., E] -> [.., E] bool: the experts of each token's ``topk_group`` best groups, ranked
        by the sum of each group's top-2 choice scores (ties: the lower group id)."""
        *lead, e = choice.shape
        grouped = choice.reshape(*lead, self.n_group, e // self.n_group)
        ranks = tap("group_scores", jnp.sum(TOP_K(grouped, 2)[0], axis=-1))  # [.., n_group]
        best = TOP_K(ranks, self.topk_group)[1]  # [.., topk_group]
        keep = jnp.any(best[..., :, None] == jnp.arange(self.n_group), axis=-2)  # [.., n_group]
        return jnp.repeat(keep, e // self.n_group, axis=-1)


def balances(cfg) -> bool:
    """Whether ``cfg``'s train step moves the selection bias (``balance_update``)."""
    return bool(cfg.arch.moe and cfg.balance_bias and cfg.moe_bias_rate)


def bias_step(rate: float, counts):
    """counts [L, E], the tokens each layer sent to each expert over the whole global batch -> the
    bias's change [L, E]: ``rate`` x sign(mean load - load) (DeepSeek-V3's aux-loss-free update; an
    expert at the mean load keeps its bias)."""
    mean = jnp.mean(counts, axis=-1, keepdims=True)
    return jnp.asarray(rate, counts.dtype) * jnp.sign(mean - counts)


def balance_update(cfg):
    """(params, routing statistics [L, 2E + 3] of the step's global batch) -> params with every MoE
    layer's selection bias moved by ``bias_step``; None where ``cfg`` does not balance. The MoE layers'
    stack (``layers/``, [L_moe, E]) is in the statistics' layer order (``model.stack``)."""
    if not balances(cfg):
        return None
    suffix = f"moe/router/{BIAS}"

    def update(params, stats):
        step = bias_step(cfg.moe_bias_rate, stats[:, : cfg.n_experts])
        # the main stack's biases; an MTP depth's block (``model.mtp``) keeps its bias: its routing is
        # not in the statistics
        move = lambda path, b: b + step.astype(b.dtype) if path.endswith(suffix) and not is_mtp(path) else b
        return {m: {n: move(param_path(m, n), b) for n, b in leaves.items()} for m, leaves in params.items()}

    return update
