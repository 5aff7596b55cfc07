"""Linear attention's generation cache (``model.linear_attention``): what a Gated DeltaNet layer keeps
between calls, constant in the context length.

Per layer and row (per shard: h = Vh/mp value heads, C = (2 Kh dk + Vh dv)/mp conv channels):
  "state"  [B, h, dk, dv]  the delta rule's state after the tokens seen (at least float32)
  "conv"   [B, K-1, C]     the conv's last K-1 inputs (q, k, v before the conv, side by side)
  "length" [B] int32       tokens the row has: positions at or past it are padding (a prefill's
                           right-padded prompt), which neither decay nor write the state, nor enter
                           the conv's history (``generate.programs`` sets it before every call)
A prefill (T > 1) runs the chunked rule from the cached state, a decode step (T = 1) the recurrence
(``model.deltanet``). Documents (``--doc-mask``): a token at its document's start resets the state,
and the conv reads no input before the start (the cached history included).
"""

from __future__ import annotations

import jax.numpy as jnp

import meshlm.model.deltanet as deltanet

LINEAR_KEYS = ("state", "conv", "length")  # a hybrid's linear layers' cache arrays beside "k", "v"


def _valid(positions, cache):
    """[B, T] bool: the tokens before the row's length (the rest is a prefill's padding)."""
    return positions < cache["length"][:, None]


def cached_conv(x, w, positions, starts, cache):
    """x [B, T, C] (the new tokens' inputs), w [K, C] -> (conv out [B, T, C], history [B, K-1, C]: the
    K-1 inputs before the row's length, the cached ones included)."""
    kernel, t = w.shape[0], x.shape[1]
    joined = jnp.concatenate([cache["conv"].astype(x.dtype), x], axis=1)  # [B, K-1+T, C]
    back = positions[:, :1] - jnp.arange(kernel - 1, 0, -1)  # [B, K-1]: the history's positions
    if starts is not None:  # the outputs kept (the last T) read no input before their document start
        pos = jnp.concatenate([back, positions], 1)  # the history's own outputs are dropped: any starts
        starts = jnp.concatenate([jnp.broadcast_to(starts[:, :1], back.shape), starts], 1)
        out = deltanet.causal_conv(joined, w, pos, starts)[:, kernel - 1 :]
    else:
        out = deltanet.causal_conv(joined, w)[:, kernel - 1 :]
    # the history: joined's entries at positions length-K+1 .. length-1 (joined[i] is position p0-K+1+i)
    first = cache["length"] - positions[:, 0]  # [B]: joined's index of position length-K+1
    index = jnp.clip(first[:, None] + jnp.arange(kernel - 1), 0, kernel - 2 + t)
    return out, jnp.take_along_axis(joined, index[..., None], axis=1)


def cached_rule(q, k, v, g, beta, positions, starts, cache, chunk: int):
    """The rule over the new tokens from the cached state -> (out [B, T, h, dv], state after the
    row's last real token): padding neither decays (g = 0) nor writes (beta = 0) nor resets."""
    valid = _valid(positions, cache)
    g, beta = jnp.where(valid[..., None], g, 0), jnp.where(valid[..., None], beta, 0)
    resets = deltanet.document_resets(positions, starts)
    resets = None if resets is None else resets & valid
    state = cache["state"].astype(v.dtype)
    if q.shape[1] == 1:  # a decode step: the recurrence
        return deltanet.recurrent_rule(q, k, v, g, beta, state, resets)
    return deltanet.chunked_rule(q, k, v, g, beta, state, chunk, resets)
