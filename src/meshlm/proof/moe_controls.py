"""Planted faults of a mixture-of-experts layer (``model.moe``) that exist without an ``ep`` axis: the
combine weights not renormalised (or renormalised where ``norm_topk_prob`` is off: OLMoE), top-k ties
broken by the higher expert id, the combine weights' gradient not summed over mp (the router's gradient
is then wrong), Qwen2-MoE's shared expert counted on every mp shard or its gate's gradient not summed
over mp, the aux-loss statistics not summed over the data shards, and (with a capacity factor) the
capacity computed per shard: each shard ranks and drops among its own tokens only. The sorted
dispatch's (``parallel.grouped``): a token's rows sent to the wrong expert after sorting, one expert's
weight gradient added to its neighbour's in the block scan, padding rows leaking into the output (the
scatter-add combine's) or a choice with no row here reading a computed one (the gathers').
``proof.controls`` lists them (the router record's: ``proof.router_controls``).

A tie must exist for its control to show: ``plant_router_tie`` makes expert 1's router column a copy
of expert 0's in every layer of the parameters *both* runs start from (``model_problem`` for a MoE
config), so every token ties between the two, and where they tie for the k-th place the rule decides
which one is computed (exact ties: the same column, the same matmul, in each run). With ``ep`` it copies
column 0 to expert E/ep's too (the first expert of ep shard 1): a tie across shards, which a rule
ranking by shard-local index breaks differently (``proof.ep_controls``)."""

from __future__ import annotations

from contextlib import contextmanager

import jax
import jax.numpy as jnp
from jax import lax

from meshlm.model import moe, routers
from meshlm.model.params import param_path
from meshlm.parallel.axes import MP
from meshlm.parallel.context import Parallel
from meshlm.parallel.ep import shard_tie_experts
from meshlm.parallel.grouped import BLOCK
from meshlm.parallel.grouped_gather import combine_mode
from meshlm.proof.control_record import Control, Where
from meshlm.proof.taps import Tapped


def plant_router_tie(params, ep: int = 1):
    """``params`` with every layer's router column 1 (and with ``ep`` > 1 column E / ep) set to column
    0 (shardings kept)."""

    def tie(w):
        cols = shard_tie_experts(w.shape[-1], ep)  # E / ep: the first of ep shard 1
        return w.at[..., jnp.asarray(cols)].set(w[..., :1])

    def plant(path, x):
        if not path.endswith("moe/router/w"):
            return x
        return jax.jit(tie, out_shardings=x.sharding)(x)

    return {m: {n: plant(param_path(m, n), x) for n, x in leaves.items()} for m, leaves in params.items()}


def _top_k_higher_id_first(x, k: int):
    """top-k with equal values in the order of their *higher* expert id (the wrong rule)."""
    values, ids = lax.top_k(jnp.flip(x, axis=-1), k)
    return values, x.shape[-1] - 1 - ids


@contextmanager
def ties_to_higher_id():
    """The routing's top-k breaks ties by the higher expert id while the sharded run traces."""
    old = routers.TOP_K
    routers.TOP_K = _top_k_higher_id_first
    try:
        yield
    finally:
        routers.TOP_K = old


def not_renormalised(cfg):
    """The top-k combine weights left as the softmax's values (norm_topk_prob off) in the sharded run."""
    return cfg.replace(norm_topk_prob=False)


def renormalised(cfg):
    """The top-k combine weights renormalised where the family keeps the softmax's values (OLMoE: the
    bug of a layer ported from Mixtral) in the sharded run."""
    return cfg.replace(norm_topk_prob=True)


class CombineWeightGradOfLastShard(Tapped):
    """The combine weights' gradient taken from the last mp shard's partial expert outputs only, not
    their sum over mp: the router (and the input through it) learns from one shard's hidden units. (The
    last: under ``--quant int8`` mp shard 0 holds the whole output, ``Parallel.int8_out``.)"""

    def combine_weights(self, w):
        keep = self.shard_index() == self.layout.mp - 1
        return lax.stop_gradient(w) + jnp.where(keep, w - lax.stop_gradient(w), jnp.zeros_like(w))


class StatisticsNotSummedOverData(Parallel):
    """Each data shard forms the aux and z losses from its own tokens' routing statistics (the loss
    then averaged over the shards), not from the whole batch's."""

    def moe_sum(self, stats):
        return lax.psum(stats, MP) if self.layout.sp else stats


class SharedExpertOnEveryShard(Tapped):
    """The shared expert's output summed over mp before it joins the experts' partial output (a full,
    replicated output added on every shard): the row-parallel sum then counts it mp times."""

    def shared_expert(self, y):
        return lax.psum(y, MP)


class SharedGateGradOfLastShard(Tapped):
    """The shared-expert gate's gradient from the last mp shard's hidden units only, not summed over mp
    (a replicated weight whose per-shard gradients are never added up; the last shard: as above)."""

    def shared_gate(self, w):
        keep = self.shard_index() == self.layout.mp - 1
        return lax.stop_gradient(w) + jnp.where(keep, w - lax.stop_gradient(w), jnp.zeros_like(w))


class CapacityPerShard(Parallel):
    """Each shard applies the capacity to its own tokens only (ceil(C x its tokens x k / E), its own
    ranking), not to the whole global batch: ``model.moe.capacity_keep`` without the gather."""

    def moe_gather(self, x):
        return x


class RowsToWrongExpert(Parallel):
    """After sorting, every row's choice one block (``BLOCK`` rows) later: tokens computed by the
    experts of the rows they land in (the next block's: often the next expert's). Where the rows are
    one block or a divisor of one (ragged_dot's R is exactly the choices: 16 of them on the proof's
    shard), a roll by BLOCK is no move at all: there one row later (a group's last choice crosses into
    the next expert's rows)."""

    def moe_rows(self, choice):
        return jnp.roll(choice, BLOCK % choice.shape[0] or 1)


class ExpertGradToNeighbour(Parallel):
    """The block scan's weight gradient of expert 0 also added to expert 1's."""

    def moe_expert_grads(self, grads):
        return tuple(g.at[1].add(g[0]) for g in grads)


class GroupOffsetsOneRowOff(Parallel):
    """ "gmm"'s group offsets one row off: the first expert with rows hands its last row to the next
    expert's group (the last expert's: to the rows of no group, computed as zeros). The kernel's (and
    its reference path's) offsets are the sizes' cumulative sums, so every later offset stays put."""

    def moe_group_sizes(self, sizes):
        j = jnp.argmax(sizes > 0)  # the first expert with rows (none: the sizes as they are)
        moved = sizes.at[j].add(-1).at[j + 1].add(1, mode="drop")
        return jnp.where(sizes[j] > 0, moved, sizes)


class PaddingRowsLeak(Parallel):
    """Padding rows read and add to choice 0 (a clamped index, not an out-of-range one): token 0 gets
    one more copy of its first choice's weight times each padding row's expert."""

    def moe_padding_choice(self, m: int):
        return 0


class AbsentChoicesReadRowZero(Parallel):
    """A choice no row here holds (another ep shard's expert, or dropped by the capacity) reads row 0
    (a sentinel index replaced by a valid one), not the zero row: its token gets its weight times row
    0's output, and row 0's input the token's gradient. The gather combine's twin of the padding leak:
    there padding rows are read by no choice, so the fault that can reach the output is this one."""

    def moe_inverse(self, inv, r: int):
        return jnp.where(inv == r, 0, inv)


def _sorted(w: Where) -> bool:
    return _moe(w) and w.cfg.moe_dispatch != "dense"


def _moe(w: Where) -> bool:
    return w.cfg is not None and w.cfg.arch.moe


def _data_shards(w: Where) -> bool:
    """The batch's tokens are split (over dp, ep's shards among them, or cp): statistics to sum."""
    return w.layout.dp > 1 or w.layout.context_parallel


def _drops(cfg) -> bool:
    """A capacity that can drop a choice: 0 < C < E / k (from E / k on every shard's capacity, like the
    batch's, is all its tokens: ``moe.capacity``; ranking per shard would change nothing)."""
    return 0 < cfg.moe_capacity_factor < cfg.n_experts / cfg.experts_per_token


def _routed_apart(w: Where) -> bool:
    """Shards route different tokens (data shards, or mp's sequence slices under sp)."""
    return _data_shards(w) or (w.layout.sp and w.layout.mp > 1)


MOE_CONTROLS: tuple[Control, ...] = (
    Control(
        name="MoE combine weights not renormalised",
        applies=lambda w: _moe(w) and w.cfg.norm_topk_prob and w.cfg.experts_per_token > 1,
        cfg_change=not_renormalised,
    ),
    Control(
        name="MoE combine weights renormalised against norm_topk_prob",
        applies=lambda w: _moe(w) and not w.cfg.norm_topk_prob and w.cfg.experts_per_token > 1,
        cfg_change=renormalised,
    ),
    Control(
        name="MoE top-k ties broken by the higher expert id",
        applies=lambda w: _moe(w) and w.planted_tie and w.cfg.experts_per_token < w.cfg.n_experts,
        plant=ties_to_higher_id,
    ),
    Control(
        name="MoE combine weights' gradient not summed over mp",
        applies=lambda w: _moe(w) and w.layout.mp > 1,
        par_cls=CombineWeightGradOfLastShard,
    ),
    Control(
        name="MoE shared expert's output counted on every mp shard",
        applies=lambda w: _moe(w) and w.cfg.shared_expert_d_ff > 0 and w.layout.mp > 1,
        par_cls=SharedExpertOnEveryShard,
    ),
    Control(
        name="MoE shared expert's gate gradient not summed over mp",
        applies=lambda w: _moe(w) and w.cfg.shared_expert_d_ff > 0 and w.layout.mp > 1,
        par_cls=SharedGateGradOfLastShard,
    ),
    Control(
        name="MoE aux-loss statistics not summed over the data shards",
        applies=lambda w: _moe(w) and _data_shards(w) and moe.moe_losses(w.cfg),
        par_cls=StatisticsNotSummedOverData,
    ),
    Control(
        name="MoE rows sent to the wrong expert after sorting", applies=_sorted, par_cls=RowsToWrongExpert
    ),
    Control(
        name="MoE expert weight gradient added to its neighbour's",
        # the block scan's gradient: dropless "blocks", two experts on the shard
        applies=lambda w: (
            _sorted(w)
            and w.cfg.moe_dispatch == "blocks"
            and not w.cfg.moe_capacity_factor
            and w.cfg.n_experts // w.layout.ep >= 2
        ),
        par_cls=ExpertGradToNeighbour,
    ),
    Control(
        name="MoE gmm group offsets one row off",
        # the kernel's groups: "gmm" dropless (with a capacity the slots are fixed, no groups)
        applies=lambda w: _sorted(w) and w.cfg.moe_dispatch == "gmm" and not w.cfg.moe_capacity_factor,
        par_cls=GroupOffsetsOneRowOff,
    ),
    Control(
        name="MoE padding rows leak into the output",
        # the scatter-add combine's rows that compute (ragged_dot's rows past the groups are zeros: no
        # value to leak); the gathers read no padding row: their twin is the next control
        applies=lambda w: (
            _sorted(w)
            and combine_mode() == "scatter"
            and (w.cfg.moe_dispatch == "blocks" or w.cfg.moe_capacity_factor > 0)
        ),
        par_cls=PaddingRowsLeak,
    ),
    Control(
        name="MoE choices with no row here read a computed row",
        # the gather combine where a choice can have no row on its shard: ep, or a capacity that drops
        applies=lambda w: (
            _sorted(w) and combine_mode() == "gather" and (w.layout.experts_split or _drops(w.cfg))
        ),
        par_cls=AbsentChoicesReadRowZero,
    ),
    Control(
        name="MoE capacity computed per shard",
        applies=lambda w: _moe(w) and _drops(w.cfg) and _routed_apart(w),
        par_cls=CapacityPerShard,
    ),
)
