"""The flash kernel as the --cp ring's step (``context_parallel``: ``--attention flash --cp N``).

The ring attends this shard's queries, its two chunks [B, T/cp, H, E] (``parallel.cp``: chunks i and
2cp - 1 - i of 2cp, c = T / 2cp tokens each), to one K/V set at a time, also two chunks, and merges the
partials (``blockwise.combine``); its backward takes each K/V set's share given the final output and
log-sum-exp. The splash kernel's masks are static and by index, so each (query chunk, key chunk) pair
runs one of three, chosen by their global positions (traced: the ring's step): the key chunk after the
query chunk, nothing visible (no kernel); the same chunk, causal; an earlier chunk, every key visible
(``FullMask``). The kernel returns the pair's log-sum-exp, which makes its partial (out, m = lse, lsum =
1); its backward (splash's dq and dkv kernels) given the final out and lse is the pair's share of the
gradients, as ``blockwise.partial_grads``'. A chunk is padded to a multiple of 128 tokens; segment ids
(0 real, 1 padding) hide the padded keys from real queries under the full mask too.

What this step cannot express (windows and chunks: their masks by global position differ per pair; the
all-gather strategy: its queries are chunks of a gathered sequence) is refused at config time
(``transformer.check_context``).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

from meshlm.model.attention_variants import Variant
from meshlm.model.blockwise import Partial, combine
from meshlm.model.flash_kernel import LANES, backward, forward, kernel_rule
from meshlm.model.layers import upcast, varying_like


def _causal(t: int, window: int, chunk: int) -> masks.Mask:
    return masks.CausalMask((t, t))


def _full(t: int, window: int, chunk: int) -> masks.Mask:
    return masks.FullMask((t, t))


def _relation(q_pos, k_pos):
    """int32 scalar: 0 the key chunk after the query chunk, 1 the same chunk, 2 an earlier one (the
    chunks' first positions; every row of the batch has the same)."""
    qa, kb = q_pos[0, 0], k_pos[0, 0]
    return jnp.where(qa > kb, 2, jnp.where(qa == kb, 1, 0)).astype(jnp.int32)


def _padded(x, like):
    """A chunk [B, c, heads, E] as the kernel takes it: [B, heads, cp, E], cp the next multiple of 128."""
    c = x.shape[1]
    cp = -(-c // LANES) * LANES
    return jnp.pad(jnp.swapaxes(x, 1, 2), ((0, 0), (0, 0), (0, cp - c), (0, 0)))


def _segments(q):
    """[B, cp] int32: 0 on the chunk's tokens, 1 on its padding (q: a padded chunk [B, h, cp, E])."""
    return varying_like(jnp.zeros(q.shape[0:1] + q.shape[2:3], jnp.int32), q)


def _chunks(x):
    c = x.shape[1] // 2
    return x[:, :c], x[:, c:]


def _pair(q, k, v, rel, variant: Variant, c: int):
    """One (query chunk, key chunk) pair: q [B, h, cp, E] padded and scaled, k, v [B, kv, cp, E] ->
    Partial over the chunk's c queries."""
    seg = _segments(q).at[:, c:].set(1)
    k, v, seg = (varying_like(x, q) for x in (k, v, seg))
    run = lambda mask_of: lambda *a: tuple(forward(kernel_rule(variant, 0, 0, mask_of), *a))

    def none(q, k, v, seg):
        return jnp.zeros_like(q), varying_like(jnp.full(q.shape[:3], -jnp.inf, jnp.float32), q)

    out, lse = lax.switch(rel, [none, run(_causal), run(_full)], q, k, v, seg)
    out, lse = jnp.swapaxes(upcast(out[:, :, :c]), 1, 2), jnp.swapaxes(lse[:, :, :c], 1, 2)
    seen = jnp.isfinite(lse)
    return Partial(out, jnp.where(seen, lse, -jnp.inf), seen.astype(lse.dtype))


def flash_partial(q, k, v, q_pos, k_pos, *, variant: Variant, **_) -> Partial:
    """``blockwise.attend_partial``'s contract for the ring: this shard's two query chunks q [B, 2c, H, E]
    against one K/V set k, v [B, 2c, K, E] (positions q_pos, k_pos [B, 2c]) -> Partial [B, 2c, H, ...].
    ``variant``: the step's, folded (no scalar; the score divided by sqrt(E) here), its score rule."""
    c = q.shape[1] // 2
    scale = jnp.asarray(1.0 / np.sqrt(q.shape[-1]), q.dtype)
    rows = []
    for qi, qp in zip(_chunks(q * scale), _chunks(q_pos), strict=True):
        part = None
        for ki, vi, kp in zip(_chunks(k), _chunks(v), _chunks(k_pos), strict=True):
            p = _pair(_padded(qi, q), _padded(ki, q), _padded(vi, q), _relation(qp, kp), variant, c)
            part = p if part is None else combine(part, p)
        rows.append(part)
    return Partial(*(jnp.concatenate(pair, axis=1) for pair in zip(*rows, strict=True)))


def _pair_grads(q, k, v, out, lse, dout, rel, variant: Variant, c: int):
    """The pair's share of (dq, dk, dv), all padded [B, heads, cp, E], from the final out, lse, dout of
    the query chunk (padded; lse 0 on padding rows, whose dout is 0)."""
    seg = _segments(q).at[:, c:].set(1)
    k, v, seg, out, lse, dout = (varying_like(x, q) for x in (k, v, seg, out, lse, dout))
    run = lambda mask_of: lambda *a: tuple(backward(kernel_rule(variant, 0, 0, mask_of), *a))

    def none(q, k, v, seg, out, lse, dout):
        return jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v)

    return lax.switch(rel, [none, run(_causal), run(_full)], q, k, v, seg, out, lse, dout)


def flash_partial_grads(q, k, v, q_pos, k_pos, out, lse, dout, *, variant: Variant, **_):
    """``blockwise.partial_grads``' contract for the ring: (dq, dk, dv) of one K/V set given the final
    ``out`` [B, 2c, H, E] and ``lse`` [B, 2c, H] over every set (dq: this set's share)."""
    c = q.shape[1] // 2
    scale = jnp.asarray(1.0 / np.sqrt(q.shape[-1]), q.dtype)
    lse = jnp.where(jnp.isfinite(lse), lse, 0.0).astype(jnp.float32)
    cp = -(-c // LANES) * LANES
    pad_rows = lambda x: jnp.pad(jnp.swapaxes(x, 1, 2), ((0, 0), (0, 0), (0, cp - c)))  # lse [B, H, cp]
    dq, dk, dv = [], [None, None], [None, None]
    for qi, qp, oi, li, di in zip(*(_chunks(x) for x in (q * scale, q_pos, out, lse, dout)), strict=True):
        dq_i = None
        for j, (ki, vi, kp) in enumerate(zip(_chunks(k), _chunks(v), _chunks(k_pos), strict=True)):
            args = (
                _padded(qi, q),
                _padded(ki, q),
                _padded(vi, q),
                _padded(oi, q),
                pad_rows(li),
                _padded(di, q),
            )
            g = _pair_grads(*args, _relation(qp, kp), variant, c)
            dq_i = g[0] if dq_i is None else dq_i + g[0]
            dk[j] = g[1] if dk[j] is None else dk[j] + g[1]
            dv[j] = g[2] if dv[j] is None else dv[j] + g[2]
        dq.append(dq_i)
    unpad = lambda parts: jnp.concatenate([jnp.swapaxes(x[:, :, :c], 1, 2) for x in parts], axis=1)
    return (unpad(dq) * scale).astype(q.dtype), unpad(dk).astype(k.dtype), unpad(dv).astype(v.dtype)
