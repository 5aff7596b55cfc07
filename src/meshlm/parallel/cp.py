"""Context parallelism's layout of the sequence: causal load balancing over the ``cp`` axis.

The sequence [T] is cut into 2 x cp chunks of c = T / (2 cp) tokens; cp shard i holds chunks i and
2cp-1-i (in that order: [B, 2c] per shard). Why: under the causal mask the work of a query chunk grows
with its position (chunk j sees j + 1 chunks). Contiguous halves would give the last shard ~2cp-1 times
the first one's work and leave the others waiting at every layer; pairing an early chunk with its mirror
gives every shard (i + 1) + (2cp - i) = 2cp + 1 chunk pairs, the same on each. (Striping token by token
balances too, but every chunk then spans the whole sequence, and no block above the diagonal can be
skipped.)

Every cp shard receives the whole [B, T] token batch (rows over dp, replicated over cp and mp: 4 bytes
a token, 64 KiB for a 16k row) and slices its own chunks in the program (``local_chunks``): no
communication, and the host pipeline, the batch shardings and checkpoints know nothing of cp. Positions
are global (``chunk_positions``): rotary and the causal mask see each token where it is in the sequence.
The loss is the mean over each shard's tokens, then over dp x cp: every shard holds as many tokens, so
that is the mean over every token of the global batch.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from meshlm.parallel.axes import CP


def local_chunks(x, index, cp: int):
    """[B, T, ...] -> [B, T/cp, ...]: chunks ``index`` and 2cp-1-``index`` of the 2cp chunks."""
    c = x.shape[1] // (2 * cp)
    first = lax.dynamic_slice_in_dim(x, index * c, c, axis=1)
    second = lax.dynamic_slice_in_dim(x, (2 * cp - 1 - index) * c, c, axis=1)
    return jnp.concatenate([first, second], axis=1)


def chunk_positions(index, cp: int, t_local: int):
    """[t_local]: the global positions of the tokens cp shard ``index`` holds."""
    c = t_local // 2
    r = jnp.arange(c)
    return jnp.concatenate([index * c + r, (2 * cp - 1 - index) * c + r])


def shard_order(cp: int) -> list[int]:
    """The chunks in the order the cp shards hold them, one after another (an all-gather's order)."""
    return [j for i in range(cp) for j in (i, 2 * cp - 1 - i)]


def held_positions(t: int, cp: int) -> np.ndarray:
    """[T] host positions in the order the cp shards hold them (shard i: chunks i, 2cp-1-i), one shard
    after another; the sequence in order without cp (any T)."""
    if cp == 1:
        return np.arange(t)
    c = t // (2 * cp)
    return np.concatenate([np.arange(j * c, (j + 1) * c) for j in shard_order(cp)])


def sequence_order(held, cp: int):
    """[B, T] per-token values with the 2 cp chunks in shard order (``parallel.cp.shard_order``: shard
    i's chunks i and 2cp-1-i, one shard after another) -> the same in sequence order (itself without
    cp: one chunk pair in order)."""
    if cp == 1:
        return held
    chunks = jnp.split(held, 2 * cp, axis=1)
    order = shard_order(cp)
    return jnp.concatenate([chunks[order.index(j)] for j in range(2 * cp)], axis=1)


class ContextParallel:
    """``Parallel``'s context-parallel part (a mixin: ``Parallel`` has the fields ``layout``,
    ``sharded``): the slices and collectives over the ``cp`` axis. Controls override one method each."""

    sharded: bool

    @property
    def context_parallel(self) -> bool:
        return self.sharded and self.layout.context_parallel

    @property
    def cp_ring(self) -> bool:
        """K/V chunks passed around the cp axis (ring), not all-gathered per layer."""
        return self.layout.cp_ring

    def cp_index(self):
        """This shard's position on the context axis."""
        return lax.axis_index(CP)

    def seq_local(self, x):
        """[B, T] (the whole sequence on every cp shard) -> [B, T/cp]: this shard's chunks."""
        return local_chunks(x, self.cp_index(), self.layout.cp) if self.context_parallel else x

    def positions(self, t_local: int):
        """[t_local] global positions of the tokens this shard holds (rotary, causal mask)."""
        if not self.context_parallel:
            return jnp.arange(t_local)
        return self.kv_positions(self.cp_index(), t_local)

    def kv_positions(self, origin, t_local: int):
        """[t_local] global positions of the tokens cp shard ``origin`` holds (its keys' positions)."""
        return chunk_positions(origin, self.layout.cp, t_local)

    def cp_shift(self, x):
        """Pass ``x`` to the next shard around the context axis (a collective-permute)."""
        return lax.ppermute(x, CP, [(i, (i + 1) % self.layout.cp) for i in range(self.layout.cp)])

    def ring_steps(self) -> int:
        """How many K/V chunks each query chunk meets in the ring: all cp of them."""
        return self.layout.cp

    def gather_kv(self, x):
        """[..., T/cp, K, E] -> [..., T, K, E]: every shard's keys and values, in cp-shard order."""
        return lax.all_gather(x, CP, axis=x.ndim - 3, tiled=True)

    def gather_chunks(self, x):
        """[B, 2, ...] a value per chunk this shard holds -> [2cp, B, ...] every chunk's, in sequence
        order (one all-gather over cp; its transpose reduce-scatters the gradients)."""
        held = lax.all_gather(x, CP)  # [cp, B, 2, ...]: shard i's chunks i and 2cp-1-i
        return jnp.concatenate([held[:, :, 0], held[::-1, :, 1]])

    def conv_tails(self, x):
        """Linear attention's conv history: each chunk's last K-1 inputs, every chunk's ([B, 2, K-1, C]
        -> [2cp, B, K-1, C], ``model.linear_context``)."""
        return self.gather_chunks(x)

    def chunk_states(self, x):
        """Linear attention's state maps [B | A] of each chunk, every chunk's ([B, 2, h, dk, dv + dk] ->
        [2cp, B, h, dk, dv + dk], ``model.linear_context``)."""
        return self.gather_chunks(x)

    def cp_sum(self, x):
        """Sum over the context axis (a prefill's cache and last logits: each slot from one shard)."""
        return lax.psum(x, CP)

    def seq_out(self, x):
        """Per-token outputs [B, T/cp, ...] as the loss meets them: in this shard's chunk order."""
        return x
