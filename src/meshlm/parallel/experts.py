"""``Parallel``'s expert part (a mixin, as ``parallel.cp``'s): how a mixture-of-experts layer
(``model.moe``) reaches its experts, and how its routing statistics are summed over the batch.

The seam is ``experts(x, ids, weights, expert_fn)``: x [N, D] this shard's tokens (flattened, the
column-parallel view), ids [N, k] int32 global expert ids (-1: a choice the capacity dropped), weights
[N, k] their combine weights, and ``expert_fn`` (``model.moe.Experts``) mapping per-expert token
buffers [E_here, C, D] -> [E_here, C, D] (partial sums over mp, as the dense MLP's row-parallel output;
``n_local`` is E_here, the leading dim of this shard's expert weights; ``dispatch`` the
implementation, ``capacity`` the per-expert bound of the global batch or 0; ``weights`` and
``hidden`` for the grouped matmuls). It returns [N, D], partial over mp; the block then sums it with
``row_out``. The default is the sorted dispatch (``parallel.grouped``); "dense" is the reference, every
expert on every token. An expert-parallel axis overrides ``experts`` (and ``local_experts``) to bring
each expert its tokens.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from meshlm.parallel.axes import DP, EP, MP
from meshlm.parallel.grouped import sorted_experts


def combine_matrix(ids, weights, n_experts: int, first: int = 0):
    """ids, weights [N, k] -> [N, n_experts]: each token's combine weight of experts first ..
    first + n_experts - 1 (0 where it did not choose one; top-k ids are distinct per token)."""
    hot = jax.nn.one_hot(ids - first, n_experts, dtype=weights.dtype)  # [N, k, n]; out of range: 0
    return jnp.einsum("nk,nke->ne", weights, hot)


class ExpertParallel:
    """The experts all on this shard (no ``ep`` axis); the statistics summed over the batch axes.
    ``Parallel`` has the fields ``layout`` and ``sharded``; controls override one method each."""

    sharded: bool

    def local_experts(self, n_experts: int) -> int:
        """How many of the ``n_experts`` experts this shard holds (the leading dim of its expert
        weights): all of them."""
        return n_experts

    def experts(self, x, ids, weights, expert_fn):
        """The combine-weighted sum of each token's k experts, [N, D] partial over mp: the sorted
        dispatch (``parallel.grouped``: each expert on its routed rows), or "dense" (``dense_experts``)."""
        if expert_fn.dispatch == "dense":
            return self.dense_experts(x, ids, weights, expert_fn)
        cap = min(x.shape[0], expert_fn.capacity)  # no expert takes more than this shard's N tokens
        return sorted_experts(self, x, ids, weights, expert_fn, cap=cap)

    def dense_experts(self, x, ids, weights, expert_fn):
        """The reference dispatch, [N, D] partial over mp.

        Dispatch: every expert runs on every token, and each output is multiplied by the token's
        combine weight of that expert (0 where the token did not choose it). Why this: it is exact and
        dropless (no capacity: a token's k experts are always computed), its shapes are static, and the
        unchosen products are exact zeros in the value and in every gradient (0 * finite), so the sum
        is the one the routing defines (a dropped choice, id -1, has none). The price is E / k times
        the routed FLOPs: the plainest program, the one the proof compares the sorted dispatch with."""
        n = expert_fn.n_local
        ys = expert_fn(jnp.broadcast_to(x[None], (n, *x.shape)))  # [E, N, D] partial over mp
        cw = combine_matrix(ids, weights, n).astype(ys.dtype)  # [N, E]
        return jnp.einsum("ne,end->nd", cw, ys)

    def moe_rows(self, choice):
        """[R] the flat choice each row of the sorted dispatch holds (``parallel.grouped.plan``), as the
        rows are filled: where a control sends a token's rows to another expert."""
        return choice

    def moe_group_sizes(self, sizes):
        """[E_here] the rows of each expert as "gmm"'s kernel takes them (their cumulative sums its group
        offsets: ``parallel.grouped.gmm_mlp``): where a control breaks the offsets."""
        return sizes

    def moe_padding_choice(self, m: int):
        """What a padding row of the sorted dispatch reads and adds to: the choice ``m`` (none). The
        scatter-add combine's only (``MESHLM_MOE_COMBINE=scatter``): the gathers never read a padding row."""
        return m

    def moe_inverse(self, inv, r: int):
        """[N, k] the row each choice's output is gathered from (and its input's gradient), ``r`` (a zero
        row) where none here holds it (``parallel.grouped_gather.inverse``): where a control points a
        choice at the wrong row."""
        return inv

    def moe_expert_grads(self, grads):
        """The expert weights' gradients (w_gate, w_up, w_down) [E_here, ...] the block scan summed per
        expert (``parallel.grouped.block_mlp``)."""
        return grads

    def moe_token_keys(self, b: int, t: int):
        """[b, t] int32: each of this shard's routed tokens' place in the global batch, row x T +
        position (T the global sequence length): the order the capacity rule drops in
        (``model.moe.capacity_keep``). The rows: this batch shard's (over dp, and ep: ``Layout.rows``);
        the positions: this cp shard's chunks (``positions``), under sp this mp shard's slice of them."""
        if not self.sharded:
            return jnp.arange(b, dtype=jnp.int32)[:, None] * t + jnp.arange(t, dtype=jnp.int32)[None]
        shard = lax.axis_index(DP)
        if self.layout.experts_split:  # batch shard d x ep + e on mesh position (d, e)
            shard = shard * self.layout.ep + lax.axis_index(EP)
        mp = self.layout.mp if self.layout.sp else 1
        pos = self.positions(t * mp)  # [T/cp]: this cp shard's global positions
        if mp > 1:
            pos = lax.dynamic_slice_in_dim(pos, self.shard_index() * t, t)
        rows = shard * b + jnp.arange(b)
        return (rows[:, None] * (t * mp * self.layout.cp) + pos[None]).astype(jnp.int32)

    def moe_gather(self, x):
        """[n, ...] this shard's routed tokens -> [S x n, ...] every shard's (the global batch, in no
        particular order: ``moe_token_keys`` orders them): all-gathered over the batch axes, and over mp
        under sp (each mp shard routes its own sequence slice)."""
        if not self.sharded:
            return x
        axes = tuple(self.layout.batch_axes) + ((MP,) if self.layout.sp else ())
        return lax.all_gather(x, axes, axis=0, tiled=True)

    def moe_shards(self) -> int:
        """How many shards' routed tokens ``moe_gather`` joins (its factor: a static int)."""
        if not self.sharded:
            return 1
        axes = tuple(self.layout.batch_axes) + ((MP,) if self.layout.sp else ())
        return math.prod(self.layout.mesh_shape[a] for a in axes)

    def moe_sum(self, stats):
        """Per-layer routing statistics of this shard's tokens -> those of the whole global batch:
        summed over the batch axes (dp, cp), and over mp under sp (each mp shard routes its own
        sequence slice; without sp every mp shard holds the same tokens and the sum is not taken)."""
        if not self.sharded:
            return stats
        axes = tuple(self.layout.batch_axes) + ((MP,) if self.layout.sp else ())
        return lax.psum(stats, axes)
