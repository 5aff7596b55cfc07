"""Planted faults of the router record (``model.routers``) beyond softmax top-k (``proof.moe_controls``
has those): the selection bias used in the combine weights (the weights must come from the unbiased
scores), the bias moved by one shard's load instead of the whole global batch's, and the expert groups
chosen per shard (from the shard's tokens together) instead of per token. ``proof.controls`` lists them.

A bias that is 0 hides the first fault: ``plant_balance_bias`` gives every layer's selection bias a
nonzero pattern in the parameters *both* runs start from (``model_problem``), keeping the router tie
``moe_controls.plant_router_tie`` plants (the tied experts get equal biases)."""

from __future__ import annotations

from contextlib import contextmanager

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from meshlm.model import routers
from meshlm.model.params import param_path
from meshlm.parallel.axes import MP
from meshlm.parallel.context import Parallel
from meshlm.parallel.ep import shard_tie_experts
from meshlm.proof.control_record import Control, Where
from meshlm.proof.taps import Tapped


def plant_balance_bias(params, ep: int = 1):
    """``params`` with every layer's selection bias [.., E] set to a fixed pattern of size ~0.02 (a
    sigmoid score's spread at init), experts 1 and E / ep given expert 0's (the planted tie's)."""

    def pattern(b):
        e = b.shape[-1]
        values = 0.02 * (((np.arange(e) * 7) % 11) - 5) / 5
        values[shard_tie_experts(e, ep)] = values[0]
        return jnp.broadcast_to(jnp.asarray(values, b.dtype), b.shape)

    def plant(path, x):
        if not path.endswith(f"moe/router/{routers.BIAS}"):
            return x
        return jax.jit(pattern, out_shardings=x.sharding)(x)

    return {m: {n: plant(param_path(m, n), x) for n, x in leaves.items()} for m, leaves in params.items()}


@contextmanager
def bias_in_combine_weights():
    """The combine weights read from the biased choice scores (score + bias) while the sharded run
    traces: the bias then changes the weights, not only the choice."""
    old = routers.combine_scores
    routers.combine_scores = lambda scores, choice: choice
    try:
        yield
    finally:
        routers.combine_scores = old


def _token_axes(par: Parallel) -> tuple[str, ...]:
    """The mesh axes this shard's routed tokens differ over (``Parallel.moe_sum``'s)."""
    return tuple(par.layout.batch_axes) + ((MP,) if par.layout.sp else ())


class BiasFromOneShard(Parallel):
    """The routing statistics the step returns (and the bias moves by) are the first shard's alone,
    sent to every shard, not the sum over the whole global batch."""

    def moe_sum(self, stats):
        axes = _token_axes(self)
        first = jnp.all(jnp.stack([lax.axis_index(a) == 0 for a in axes]))
        return lax.psum(jnp.where(first, stats, jnp.zeros_like(stats)), axes)


class GroupsPerShard(Tapped):
    """Each shard ranks the expert groups once for all its tokens (their group scores summed), not
    per token: a token's groups then depend on which tokens share its shard."""

    def group_scores(self, s):
        lead = tuple(range(s.ndim - 1))
        return jnp.broadcast_to(jnp.sum(s, axis=lead, keepdims=True), s.shape)


def _balanced(w: Where) -> bool:
    return w.cfg is not None and w.cfg.arch.moe and w.cfg.balance_bias


def _tokens_apart(w: Where) -> bool:
    """Shards route different tokens (data shards, cp's chunks, or mp's sequence slices under sp)."""
    return w.layout.dp > 1 or w.layout.context_parallel or (w.layout.sp and w.layout.mp > 1)


ROUTER_CONTROLS: tuple[Control, ...] = (
    Control(
        name="MoE selection bias used in the combine weights",
        applies=_balanced,
        plant=bias_in_combine_weights,
    ),
    Control(
        name="MoE selection bias moved by one shard's load",
        applies=lambda w: (
            _balanced(w) and routers.balances(w.cfg) and _tokens_apart(w) and not w.layout.pipelined
        ),
        par_cls=BiasFromOneShard,
        train_step=True,
    ),
    Control(
        name="MoE expert groups chosen per shard",
        applies=lambda w: w.cfg is not None and w.cfg.arch.moe and w.cfg.n_group > 0 and _tokens_apart(w),
        par_cls=GroupsPerShard,
    ),
)
