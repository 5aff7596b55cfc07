"""Linear attention (``model.linear_attention``) over a sequence split across the ``cp`` axis.

Each cp shard holds two of the 2cp chunks of c tokens (``parallel.cp``: chunks i and 2cp-1-i, [B, 2c]
per shard). Two things cross a chunk boundary, and each travels by one all-gather over cp per layer
(``Parallel.conv_tails``, ``Parallel.chunk_states``; JAX's transposes reduce-scatter their gradients):

- the causal conv's history: the last K-1 inputs (before the conv) of every chunk, [B, 2, K-1, C] per
  shard; each chunk is convolved after the tail of the chunk before it in the sequence (zeros for the
  first).
- the delta rule's state. The rule is affine in the state it starts from: a chunk maps an incoming
  state S [dk, dv] to A S + B (A [dk, dk] from its keys, decays and write strengths; B its state from
  zero), and its output is O + Q S (Q [c, dk]). The value columns of the rule never mix, so one run of
  the chunked rule with the values widened by dk zero columns, from the state [0 | I], gives both:
  its output [O | Q] and its final state [B | A]. The maps of every chunk ([B, 2, h, dk, dv + dk] per
  shard) are all-gathered and composed in sequence order, S_0 = 0, S_{j+1} = A_j S_j + B_j (2cp - 1
  small products on every shard); each shard adds Q S_j to its chunks' outputs. No shard waits on
  another's rule: the chunks run in parallel, only the maps are sequential. Costs: the rule's width
  dv + dk instead of dv, and 2cp x [h, dk, dv + dk] values per row gathered per layer.

Shapes per shard: x [B, T/cp, C] (T/cp = 2c), q, k [B, T/cp, h, dk], v [B, T/cp, h, dv], g, beta
[B, T/cp, h]. Documents (``--doc-mask``) are refused with cp before this runs.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

import meshlm.model.deltanet as deltanet
from meshlm.errors import ConfigError


def _mine(par, per_chunk):
    """[2cp, B, ...] a value per chunk in sequence order -> [B, 2, ...] those of this shard's chunks."""
    index, last = par.cp_index(), 2 * par.layout.cp - 1
    pick = lambda j: lax.dynamic_index_in_dim(per_chunk, j, axis=0, keepdims=False)
    return jnp.stack([pick(index), pick(last - index)], axis=1)


def cp_conv(x, w, par):
    """Causal depthwise conv of this shard's two chunks, each after the K-1 inputs before it in the
    sequence: x [B, 2c, C], w [K, C] -> [B, 2c, C]."""
    kernel, (b, t, ch) = w.shape[0], x.shape
    c = t // 2
    if kernel - 1 > c:
        raise ConfigError(
            f"--cp {par.layout.cp}: chunks of {c} tokens are shorter than linear_conv - 1 = {kernel - 1}"
            " (the conv's history comes from one chunk); use a longer sequence or a smaller --cp"
        )
    if kernel == 1:  # no history
        return deltanet.causal_conv(x, w)
    halves = x.reshape(b, 2, c, ch)
    tails = par.conv_tails(halves[:, :, c - kernel + 1 :])  # [2cp, B, K-1, C] in sequence order
    before = jnp.concatenate([jnp.zeros_like(tails[:1]), tails[:-1]])  # before[j]: chunk j-1's tail
    joined = jnp.concatenate([_mine(par, before), halves], axis=2)  # [B, 2, K-1+c, C]
    out = deltanet.causal_conv(joined.reshape(2 * b, kernel - 1 + c, ch), w)[:, kernel - 1 :]
    return out.reshape(b, t, ch)


def cp_rule(q, k, v, g, beta, chunk: int, par):
    """The delta rule over this shard's two chunks, each from the state the chunks before it leave
    (zero before the sequence) -> out [B, 2c, h, dv] (per shard)."""
    b, t, h, dk = k.shape
    dv, c = v.shape[-1], t // 2
    pair = lambda x: x.reshape(2 * b, c, *x.shape[2:])  # [B, 2c, ...] -> [2B, c, ...]: a row per chunk
    wide = jnp.concatenate([v, jnp.zeros((*v.shape[:-1], dk), v.dtype)], axis=-1)
    eye = jnp.broadcast_to(jnp.eye(dk, dtype=v.dtype), (2 * b, h, dk, dk))
    start = jnp.concatenate([jnp.zeros((2 * b, h, dk, dv), v.dtype), eye], axis=-1)
    out, maps = deltanet.chunked_rule(pair(q), pair(k), pair(wide), pair(g), pair(beta), start, chunk)
    maps = par.chunk_states(maps.reshape(b, 2, h, dk, dv + dk))  # [2cp, B, h, dk, dv + dk]
    incoming = [jnp.zeros_like(maps[0, ..., :dv])]
    for j in range(maps.shape[0] - 1):  # the last chunk's map leads nowhere
        incoming.append(jnp.einsum("bhkl,bhlv->bhkv", maps[j, ..., dv:], incoming[-1]) + maps[j, ..., :dv])
    states = _mine(par, jnp.stack(incoming)).reshape(2 * b, h, dk, dv)
    out = out[..., :dv] + jnp.einsum("nthk,nhkv->nthv", out[..., dv:], states)
    return out.reshape(b, t, h, dv)
