"""Planted faults of expert parallelism (``verify --ep N``): each must be detected by the comparison
with the unsharded reference, by JAX's varying-axis type check, or by the communication check.

  tokens sent to the neighbouring ep shard   the gathered tokens one shard around (the sorted
                                             dispatches), or the send buffer's slot for shard s to
                                             shard s + 1 (the "dense" reference): every token's
                                             outputs reach the wrong shard or the wrong experts
  an expert's gradient not summed over the   each expert weight keeps the gradient of the data shards
  data shards outside ep                     at DP index 0 (the sum over the rest of dp lost)
  aux-loss statistics not summed over ep      the routing statistics summed over the batch axes but
                                             ep: each ep group forms the aux and z losses of its own
                                             tokens
  all-to-all sent three times                the send there, back and there again: the same values,
                                             three times the all-to-alls (communication check; the
                                             "dense" reference's dispatch)
  ep tokens gathered twice                   the sorted dispatch's all-gather, its own slice taken
                                             and gathered again (communication check)
  top-k ties broken by shard-local index     each ep shard ranks tied experts its own first (then by
                                             local index): a token on shard 1 tied between experts 0
                                             and E/ep takes E/ep (the proof plants that tie:
                                             ``moe_controls.plant_router_tie``)

Each is a ``Parallel`` subclass overriding one method (``parallel.ep.ExpertAxis``) or one tap
(``proof.taps``), or the routing's top-k replaced while the sharded run traces; layers are unchanged.
"""

from __future__ import annotations

from contextlib import contextmanager

import jax.numpy as jnp
from jax import lax

from meshlm.model import routers
from meshlm.model.moe import moe_losses
from meshlm.parallel.axes import DP, EP, MP
from meshlm.parallel.context import Parallel
from meshlm.proof.control_record import Control, Where
from meshlm.proof.taps import Tapped


class TokensToNeighbour(Parallel):
    """The ep group's tokens gathered one shard around (their outputs go back to the neighbour), or
    with the "dense" reference's all-to-all, tokens for ep shard s sent to shard s + 1."""

    def ep_gather(self, x):
        return jnp.roll(super().ep_gather(x), x.shape[0], axis=0)

    def ep_send(self, buf):
        return super().ep_send(jnp.roll(buf, 1, axis=0))


class ExpertGradOneDataShard(Tapped):
    """Each expert weight's gradient is the one of the data shards at DP index 0 only: the weight is
    used as is, but its gradient passes only where ``axis_index(DP) == 0`` (so the sum over the data
    shards outside ep sums one shard's part)."""

    def expert_weight(self, w):
        keep = lax.axis_index(DP) == 0
        return lax.stop_gradient(w) + jnp.where(keep, w - lax.stop_gradient(w), jnp.zeros_like(w))


class StatisticsNotSummedOverEp(Parallel):
    """The routing statistics summed over every batch axis but ep (and mp under sp)."""

    def moe_sum(self, stats):
        axes = tuple(a for a in self.layout.batch_axes if a != EP) + ((MP,) if self.layout.sp else ())
        return lax.psum(stats, axes) if axes else stats


class GatherTwice(Parallel):
    """The ep group's tokens gathered, this shard's slice taken back and gathered again: the same
    values, twice the all-gathers and their bytes (detected by the communication check only)."""

    def ep_gather(self, x):
        once = super().ep_gather(x)
        own = lax.dynamic_slice_in_dim(once, self.ep_index() * x.shape[0], x.shape[0])
        return super().ep_gather(own)


class AllToAllThrice(Parallel):
    """Each dispatch's all-to-all travels there, back and there again: same values, three times the
    all-to-alls (detected by the communication check only)."""

    def ep_send(self, buf):
        there = super().ep_send(buf)
        return super().ep_send(super().ep_return(there))


def _top_k_own_shard_first(x, k: int):
    """top-k as a shard that merges its own experts' candidates first: the experts in the order of
    this ep shard's (by local index), then the next shards'; equal values in that order (the wrong
    rule: ties across shards go to the shard's own expert, so routing depends on where a token is)."""
    e = x.shape[-1]
    order = jnp.roll(jnp.arange(e), -lax.axis_index(EP) * (e // lax.axis_size(EP)))
    values, ids = lax.top_k(x[..., order], k)
    return values, order[ids]


@contextmanager
def ties_to_own_shard():
    """The routing's top-k breaks ties by shard-local index while the sharded run traces."""
    old = routers.TOP_K
    routers.TOP_K = _top_k_own_shard_first
    try:
        yield
    finally:
        routers.TOP_K = old


def _ep(w: Where) -> bool:
    return w.layout.experts_split


EP_CONTROLS: tuple[Control, ...] = (
    Control(name="tokens sent to the neighbouring ep shard", applies=_ep, par_cls=TokensToNeighbour),
    Control(
        name="an expert's gradient not summed over the data shards outside ep",
        applies=lambda w: _ep(w) and w.layout.mesh_shape[DP] > 1,
        par_cls=ExpertGradOneDataShard,
    ),
    Control(
        name="aux-loss statistics not summed over ep",
        applies=lambda w: _ep(w) and moe_losses(w.cfg),
        par_cls=StatisticsNotSummedOverEp,
    ),
    Control(
        name="top-k ties broken by shard-local index",
        # a tie must exist to be broken: the proof's own parameters carry one, a checkpoint's do not
        applies=lambda w: _ep(w) and w.planted_tie and w.cfg.experts_per_token < w.cfg.n_experts,
        plant=ties_to_own_shard,
    ),
    Control(
        name="all-to-all sent three times",
        applies=lambda w: _ep(w) and w.collectives and w.cfg.moe_dispatch == "dense",
        par_cls=AllToAllThrice,
        by_collectives=True,
    ),
    Control(
        name="ep tokens gathered twice",
        applies=lambda w: _ep(w) and w.collectives and w.cfg.moe_dispatch != "dense",
        par_cls=GatherTwice,
        by_collectives=True,
    ),
)
