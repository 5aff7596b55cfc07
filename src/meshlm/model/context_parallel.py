"""Attention over a sequence split across the ``cp`` axis (``parallel.cp``: the load-balanced chunks).

Each cp shard holds queries, keys and values of its own two chunks ([B, T/cp, ...]) and their global
positions; the causal mask is by position, so the order in which key chunks arrive does not matter.

- ``ring`` (``Layout.cp_ring``): the K/V chunk travels around the cp axis (a collective-permute
  per step, keys and values stacked into one array) and each step's ``attend_partial`` is merged into
  the running result with ``combine`` (the online softmax). cp - 1 permutes forward. The backward (a
  custom VJP) recomputes each step from the saved queries, output and log-sum-exp: the K/V chunk goes
  around again, and with it its gradient accumulator dK/dV, which after the last step takes one more
  step home (cp - 1 + cp permutes). Memory: one extra K/V chunk, never the whole sequence.
- ``allgather``: K and V are all-gathered once per layer ([B, T, K, E] on every shard) and attended to
  with the configured attention (blockwise or plain); JAX's transpose reduce-scatters dK/dV.

Only the collectives are ``Parallel``'s (``cp_shift``, ``gather_kv``): the controls plant faults there.
What a query sees and what happens to its scores is the ``variant``'s (``attention_variants.Variant``),
taken as the kernel takes it; the ring asks ``_step_variant`` for every step's, forward and backward (the
controls plant a step that forgets a rule there), and the variant's ``finish`` meets the merged partial
once, after the last step (never once per step).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from meshlm.model.attention_variants import Variant
from meshlm.model.blockwise import attend_partial, blockwise_attention, combine, partial_grads
from meshlm.model.flash_ring import flash_partial, flash_partial_grads
from meshlm.model.layers import upcast


def context_attention(
    q, k, v, q_pos, par, *, block: int, blockwise: bool, plain_attend, variant: Variant, flash: bool = False
):
    """q [B, T/cp, H, E], k, v [B, T/cp, K, E] this shard's chunks; q_pos [B, T/cp] global positions.
    ``variant``: the mask (a window by global position) and score rules. ``flash``: the ring's steps by
    the flash kernel (``flash_ring``), else by the blockwise pieces."""
    if par.cp_ring:
        return _ring(variant.query(q), k, v, q_pos, par, block, flash, variant.folded().for_kernel(q))
    t = k.shape[1]
    k_pos = jnp.concatenate([par.kv_positions(o, t) for o in range(par.layout.cp)])
    k_pos = jnp.broadcast_to(k_pos, (k.shape[0], k_pos.shape[0]))
    k_all, v_all = par.gather_kv(jnp.stack([k, v]))  # one all-gather: [2, B, T/cp, K, E] -> [2, B, T, K, E]
    if blockwise:
        return blockwise_attention(q, k_all, v_all, q_pos, k_pos, block=block, variant=variant)
    return plain_attend(variant.query(q), k_all, v_all, q_pos, k_pos, variant=variant.folded())


def _origin(par, step: int):
    """The cp shard whose K/V chunk this shard holds at ring step ``step``."""
    return (par.cp_index() - step) % par.layout.cp


def _kv_pos(par, step, like):
    pos = par.kv_positions(_origin(par, step), like.shape[1])
    return jnp.broadcast_to(pos, like.shape[:2])


def _step_variant(variant: Variant, step: int) -> Variant:
    """The variant ring step ``step`` applies to its K/V chunk: the same on every step, the shard's
    own chunk (step 0) and the ones from the other shards alike."""
    return variant


def _ring_fwd(q, k, v, q_pos, par, block, flash, variant):
    kv, part = jnp.stack([k, v]), None
    step = flash_partial if flash else attend_partial
    for s in range(par.ring_steps()):
        if s:
            kv = par.cp_shift(kv)
        kw = dict(block=block, variant=_step_variant(variant, s))
        p = step(q, kv[0], kv[1], q_pos, _kv_pos(par, s, k), **kw)
        part = p if part is None else combine(part, p)
    part = variant.finish(part)  # once, after the ring's last merge
    out = part.out.astype(q.dtype)
    return out, (q, k, v, q_pos, variant, out, part.lse)


def _ring_bwd(par, block, flash, res, dout):
    q, k, v, q_pos, variant, out, lse = res
    grads = flash_partial_grads if flash else partial_grads
    f = upcast(q[:0]).dtype
    kv, dkv, dq = jnp.stack([k, v]), jnp.zeros((2, *k.shape), f), jnp.zeros(q.shape, f)
    steps = par.ring_steps()
    for s in range(steps):
        if s:
            kv, dkv = par.cp_shift(kv), par.cp_shift(dkv)
        kp = _kv_pos(par, s, k)
        kw = dict(block=block, variant=_step_variant(variant, s))
        dq_s, dk_s, dv_s = grads(q, kv[0], kv[1], q_pos, kp, out, lse, dout, **kw)
        dq, dkv = dq + dq_s, dkv + jnp.stack([dk_s, dv_s]).astype(f)
    for _ in range(par.layout.cp - steps + 1):  # the accumulators' way home to the shard of their chunk
        dkv = par.cp_shift(dkv)
    dk, dv = dkv[0].astype(k.dtype), dkv[1].astype(v.dtype)
    return dq.astype(q.dtype), dk, dv, None, variant.cotangent(out, lse, dout)  # the variant's: once


def _ring_impl(q, k, v, q_pos, par, block, flash, variant):
    return _ring_fwd(q, k, v, q_pos, par, block, flash, variant)[0]


_ring = jax.custom_vjp(_ring_impl, nondiff_argnums=(4, 5, 6))
_ring.defvjp(_ring_fwd, _ring_bwd)
