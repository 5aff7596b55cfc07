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
[B, T/cp, h]. Documents (``--doc-mask``) are refused with cp before this runs. A prefill over cp
(``generate.programs``) runs the same chunks and gathers, and leaves every cp shard the cache of the
whole prompt: the final state composed from all the maps, the conv's last inputs (``cp_history``).
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
    (zero before the sequence) -> (out [B, 2c, h, dv] per shard, the state after the whole sequence
    [B, h, dk, dv], the same on every shard: a prefill's cache)."""
    b, t, h, dk = k.shape
    dv, c = v.shape[-1], t // 2
    pair = lambda x: x.reshape(2 * b, c, *x.shape[2:])  # [B, 2c, ...] -> [2B, c, ...]: a row per chunk
    wide = jnp.concatenate([v, jnp.zeros((*v.shape[:-1], dk), v.dtype)], axis=-1)
    eye = jnp.broadcast_to(jnp.eye(dk, dtype=v.dtype), (2 * b, h, dk, dk))
    start = jnp.concatenate([jnp.zeros((2 * b, h, dk, dv), v.dtype), eye], axis=-1)
    out, maps = deltanet.chunked_rule(pair(q), pair(k), pair(wide), pair(g), pair(beta), start, chunk)
    maps = par.chunk_states(maps.reshape(b, 2, h, dk, dv + dk))  # [2cp, B, h, dk, dv + dk]
    incoming = [jnp.zeros_like(maps[0, ..., :dv])]
    for j in range(maps.shape[0]):  # the last chunk's map gives the final state (unused in training)
        incoming.append(jnp.einsum("bhkl,bhlv->bhkv", maps[j, ..., dv:], incoming[-1]) + maps[j, ..., :dv])
    states = _mine(par, jnp.stack(incoming[:-1])).reshape(2 * b, h, dk, dv)
    out = out[..., :dv] + jnp.einsum("nthk,nhkv->nthv", out[..., dv:], states)
    return out.reshape(b, t, h, dv), incoming[-1]


def cp_prefill_rule(q, k, v, g, beta, positions, lengths, chunk: int, par):
    """A prefill over cp (``generate.programs``): the rule over this shard's chunks of the right-padded
    prompts (positions [B, 2c] global, lengths [B]) -> (out [B, 2c, h, dv], the state after each row's
    last real token [B, h, dk, dv]). Padding neither decays (g = 0) nor writes (beta = 0): its maps are
    the identity, so the composed final state is the one after the row's length. Every shard composes
    the same state; it is taken from shard 0 and summed over cp (adding zeros: exact) so that it is
    typed as the same on every cp shard, as the K/V cache is (``attention.cp_prefill_cache``)."""
    valid = (positions < lengths[:, None])[..., None]  # [B, 2c, 1]
    g, beta = jnp.where(valid, g, 0), jnp.where(valid, beta, 0)
    out, final = cp_rule(q, k, v, g, beta, chunk, par)
    return out, par.cp_sum(jnp.where(par.cp_index() == 0, final, jnp.zeros_like(final)))


def cp_history(x, positions, lengths, kernel: int, par):
    """A prefill over cp: the conv's cached history, the inputs x [B, 2c, C] (this shard's) at positions
    length-K+1 .. length-1 (zeros before position 0, as ``linear_cache.cached_conv``) -> [B, K-1, C]
    on every cp shard: each input is on one shard, zeros on the others, summed over cp (exact)."""
    want = lengths[:, None] - jnp.arange(kernel - 1, 0, -1)  # [B, K-1] the history's positions
    hit = (positions[:, None, :] == want[:, :, None]).astype(x.dtype)  # [B, K-1, 2c]: one 1 or none
    return par.cp_sum(jnp.einsum("bjt,btc->bjc", hit, x))
