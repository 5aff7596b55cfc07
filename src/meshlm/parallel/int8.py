"""The collectives of int8 weight matmuls (``model.quant``): exact maxes and integer sums over mp.

A mixin of ``Parallel`` (``self.sharded``, ``self.layout`` and ``shard_index`` are its): a quantization
scale that is a max over a contraction split over mp is the exact ``pmax`` of the shards' maxes, and the
int32 partial sums are all-reduced as integers before the one rescale. ``proof.quant_controls``
overrides these to plant its faults.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from meshlm.parallel.axes import EP, MP


class Int8Collectives:
    def int8_max(self, m, split: bool):
        """A quantization scale's max over a contraction dim; ``split``: that dim is split over mp, so
        the max is the exact ``pmax`` of the shards' maxes (the unsharded max, bit for bit)."""
        return lax.pmax(m, MP) if split and self.sharded else m

    def token_max(self, m):
        """A max over every token of the step's batch (the weight gradient's contraction): the exact
        ``pmax`` over the batch axes (dp, and ep and cp when on)."""
        if not self.sharded:
            return m
        axes = self.layout.batch_axes
        return lax.pmax(m, axes if len(axes) > 1 else axes[0])

    def expert_token_max(self, m):
        """A max over the rows of each of this shard's experts (``model.quant_experts``: an expert weight
        gradient's per-channel scales, [E_here, 1, K]): the exact ``pmax`` over the data shards that hold
        other rows of the same experts -- the batch axes less ep, whose shards hold other experts (each
        has its ep group's tokens gathered: ``parallel.ep``)."""
        if not self.sharded:
            return m
        axes = tuple(a for a in self.layout.batch_axes if not (a == EP and self.layout.experts_split))
        return lax.pmax(m, axes) if axes else m

    def int8_out(self, acc, scale, split: bool):
        """An int8 matmul's int32 accumulator [N, M] times its scales. ``split`` (the contraction split
        over mp): the int32 partial sums are all-reduced as integers first (exact), rescaled once, and
        held by shard 0 alone (zeros elsewhere), so the float all-reduce that follows adds zeros."""
        if not (split and self.sharded):
            return acc.astype(scale.dtype) * scale
        total = lax.psum(acc, MP).astype(scale.dtype) * scale
        return jnp.where(self.shard_index() == 0, total, jnp.zeros_like(total))

    def gather_last(self, x):
        """Concatenate per-shard slices of the last axis into the global axis (e.g. logits)."""
        return lax.all_gather(x, MP, axis=x.ndim - 1, tiled=True) if self.sharded else x
