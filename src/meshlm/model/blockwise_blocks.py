"""The blockwise kernel's layout: rows and keys cut into blocks, heads grouped by their KV head.

``_block_inputs`` turns the kernel's token-major inputs (q [B, Tq, H, E], k, v [B, Tk, K, E] and
their positions) into block-major ones ([n, B, b, ...], the query heads grouped [.., K, G, ..]); a
ragged last block is padded (padded keys never visible, padded query rows dropped by ``_to_tokens``).
Nothing here is planted by the proof's controls (those patch ``model.blockwise``'s per-block pieces).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from meshlm.model.layers import upcast


def _blocks(x, b: int, fill=0):
    t = x.shape[1]
    n = -(-t // b)
    x = jnp.pad(x, [(0, 0), (0, n * b - t)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
    return jnp.moveaxis(x.reshape(x.shape[0], n, b, *x.shape[2:]), 1, 0)


def _unblock(x, t: int):  # [n, B, b, ...] -> [B, t, ...]
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], -1, *x.shape[3:])[:, :t]


class _Blocked(NamedTuple):
    qb: jax.Array  # [nq, B, bq, K, G, E]
    qpb: jax.Array  # [nq, B, bq]
    kb: jax.Array  # [nk, B, bk, K, E]
    vb: jax.Array
    kpb: jax.Array  # [nk, B, bk]
    kvb: jax.Array  # [nk, B, bk] real (not padding) keys
    scale: jax.Array
    qsb: jax.Array | None = None  # [nq, B, bq] where each query's document starts (None: no mask)


def _tied(q, *positions):
    """The positions made to depend on ``q`` (an optimization barrier over all of them). Positions are
    the same in every layer: left apart, JAX's scan partial evaluation hoists what depends on them
    alone out of the layer loop -- the causal mask of every block pair, [nq, nk, ..., bq, bk], O(T^2)
    bytes kept for the backward -- instead of computing each block's mask where it is used."""
    return lax.optimization_barrier((q, *positions))


def _block_inputs(q, k, v, q_pos, k_pos, block: int, q_start=None) -> _Blocked:
    (b, tq, h, e), (tk, kh) = q.shape, k.shape[1:3]
    bq, bk = min(block, tq), min(block, tk)
    ipos = jnp.iinfo(q_pos.dtype)
    q, q_pos, k_pos, q_start = _tied(q, q_pos, k_pos, q_start)
    return _Blocked(
        qb=_blocks(q.reshape(b, tq, kh, h // kh, e), bq),
        qpb=_blocks(q_pos, bq, fill=ipos.min),  # padded query rows see nothing (and are dropped)
        kb=_blocks(k, bk),
        vb=_blocks(v, bk),
        kpb=_blocks(k_pos, bk, fill=ipos.max),
        kvb=_blocks(jnp.ones((b, tk), bool), bk, fill=False),
        scale=1.0 / jnp.sqrt(jnp.asarray(e, upcast(q[:0]).dtype)),
        qsb=None if q_start is None else _blocks(q_start, bq, fill=ipos.max),  # padding: sees nothing
    )


def _to_tokens(x, t: int, h: int):  # [n, B, K, G, b, ...] -> [B, t, H, ...]
    x = jnp.moveaxis(x, 4, 2)  # [n, B, b, K, G, ...]
    x = x.reshape(*x.shape[:3], h, *x.shape[5:])
    return _unblock(x, t)


def _from_tokens(x, b: int, kh: int):  # [B, T, H, ...] -> [n, B, K, G, b, ...]
    x = _blocks(x.reshape(x.shape[0], x.shape[1], kh, -1, *x.shape[3:]), b)
    return jnp.moveaxis(x, 2, 4)
