"""Blockwise (flash) attention: no [T, T] tensor in the forward or the backward.

Shapes (as ``attention._attend``): q [B, Tq, H, E]; k, v [B, Tk, K, E] with H a multiple of K (grouped
query attention: query head h reads KV head h // (H / K)); positions q_pos [B, Tq], k_pos [B, Tk] are
absolute token positions (rotary is applied outside, to q and k). Causal: a query sees the keys at or
before its position, so the KV-cache prefill (queries at offset..offset+Tq, keys 0..Tk) and a context-
parallel chunk (any contiguous query and key ranges) are the same call with other positions.
With ``q_start`` [B, Tq] (``--doc-mask``: where each query's document starts) a query sees only keys
from there on, and a K/V block wholly before every document of a query block is skipped as well.

Forward: queries in blocks of ``block`` rows, each visiting the K/V blocks of ``block`` keys with an
online softmax (running max ``m`` and sum ``lsum``; the accumulator and ``lsum`` are rescaled by
exp(m_old - m_new) when the max grows). A block pair with no visible (query, key) pair is skipped by a
``lax.cond``: not computed, not masked. A ragged last block is padded (padded keys are never visible,
padded query rows are dropped), so any block size works with any length.

Backward (the flash-attention one, custom VJP): from the saved q, k, v, the output and its log-sum-exp
L, each visible block pair recomputes P = exp(S - L) and accumulates dV += P^T dO, dS = P (dO V^T - D)
with D = rowsum(dO * O), dQ += dS K, dK += dS^T Q. Nothing of size [T, T] is stored.

What a query sees and what happens to its scores is the ``variant``'s (``attention_variants.Variant``):
the mask hooks ``_visible`` / ``_needed`` take its ``rules()`` through to ``mask_mod`` / ``block_needed``
(the block skip derived from the mask), the scores pass its ``score`` (the backward multiplies dS by its
``score_slope``), and its ``finish`` meets the merged partial once. The kernel never asks which it is.

Context parallelism builds on the pieces: ``attend_partial`` attends one query set to one K/V set and
returns a ``Partial`` (out, m, lsum); ``combine`` merges partials of disjoint K/V sets exactly;
``partial_grads`` is the backward of one K/V set given the final output and log-sum-exp (a ring passes
K/V and their gradients around and sums dQ). ``chunked_attention`` is that composition on one device
over a list of K/V chunks: a ring whose steps are a Python loop.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from meshlm.model.attention_variants import CAUSAL, Variant, block_needed, mask_mod, variant_of
from meshlm.model.blockwise_blocks import _block_inputs, _blocks, _from_tokens, _to_tokens, _unblock
from meshlm.model.layers import upcast, varying_like

DEFAULT_BLOCK = 512  # rows per query block and keys per K/V block


class Partial(NamedTuple):
    """Attention of queries to one K/V set: out normalised by lsum (zero where nothing is visible)."""

    out: jax.Array  # [B, Tq, H, E] in the softmax dtype (float32 or float64)
    m: jax.Array  # [B, Tq, H] running max of the visible scores (-inf: none visible)
    lsum: jax.Array  # [B, Tq, H] sum over the visible keys of exp(score - m)

    @property
    def lse(self) -> jax.Array:
        """log sum exp of the visible scores (-inf where none is visible)."""
        pos = self.lsum > 0
        return jnp.where(pos, self.m + jnp.log(jnp.where(pos, self.lsum, 1.0)), -jnp.inf)


def combine(a: Partial, b: Partial) -> Partial:
    """The partial of the union of two disjoint K/V sets (exact: the online-softmax merge)."""
    m = jnp.maximum(a.m, b.m)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    wa, wb = a.lsum * jnp.exp(a.m - m_safe), b.lsum * jnp.exp(b.m - m_safe)
    lsum = wa + wb
    inv = _safe_inv(lsum)
    out = (wa * inv)[..., None] * a.out + (wb * inv)[..., None] * b.out
    return Partial(out, m, lsum)


def _safe_inv(x):
    """1 / x, and 0 where x == 0 (rows that see no key)."""
    return jnp.where(x > 0, 1.0 / jnp.where(x > 0, x, 1.0), 0.0)


# ---- the per-block pieces (small and separate, so that the tests can plant the classic bugs) ----


def _visible(qp, kp, kvalid, causal: bool, qs=None, **rules):
    """[B, bq, bk]: which (query, key) pairs of a block pair count (``attention_variants.mask_mod``: the
    variant's ``rules``; ``qs`` [B, bq], ``--doc-mask``: where each query's document starts). A hook of
    its own so that the proof's controls can plant a wrong mask here."""
    qs = None if qs is None else qs[:, :, None]
    return kvalid[:, None, :] & mask_mod(qp[:, :, None], kp[:, None, :], causal, qs, **rules)


def _needed(qp, kp, kvalid, causal: bool, qs=None, **rules):
    """Scalar: whether a block pair has any visible pair, else it is skipped, not computed (the block
    mask derived from the mask rules: ``attention_variants.block_needed``). A hook for the controls."""
    return block_needed(qp, kp, kvalid, causal, qs, **rules)


def _rescale(m_old, m_new):
    """The factor that moves sums taken relative to ``m_old`` to ``m_new``."""
    return jnp.exp(m_old - m_new)


def _online_update(state, s, vis, v):
    """One K/V block into the running (acc, m, lsum). s: scores [B, K, G, bq, bk]; v [B, bk, K, E]."""
    acc, m, lsum = state
    s = jnp.where(vis, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # nothing visible yet: everything stays 0
    alpha = _rescale(m, m_safe)
    p = jnp.exp(s - m_safe[..., None])
    pv = jnp.einsum("bkgqs,bske->bkgqe", p.astype(v.dtype), v, preferred_element_type=acc.dtype)
    return alpha[..., None] * acc + pv, m_new, alpha * lsum + jnp.sum(p, axis=-1)


def _scores(q_i, k_j, scale):  # q_i [B, bq, K, G, E], k_j [B, bk, K, E] -> [B, K, G, bq, bk]
    return upcast(jnp.einsum("bqkge,bske->bkgqs", q_i, k_j)) * scale


def _attend_qblock(q_i, qp_i, kb, vb, kpb, kvb, causal, scale, qs_i=None, variant: Variant = CAUSAL):
    """One query block against every K/V block: (acc, m, lsum) with acc [B, K, G, bq, E]; the scores
    through the variant's score rule before the mask and the online softmax."""
    b, bq, kh, g, e = q_i.shape
    f = upcast(q_i[:0]).dtype
    init = (
        jnp.zeros((b, kh, g, bq, e), f),
        jnp.full((b, kh, g, bq), -jnp.inf, f),
        jnp.zeros((b, kh, g, bq), f),
    )
    init = varying_like(init, q_i, qp_i, kb, vb, kpb, kvb, qs_i)

    def body(j, state):
        def compute(state):
            vis = _visible(qp_i, kpb[j], kvb[j], causal, qs_i, **variant.rules())[:, None, None]
            s = variant.score(_scores(q_i, kb[j], scale))
            return _online_update(state, s, vis, vb[j])

        needed = _needed(qp_i, kpb[j], kvb[j], causal, qs_i, **variant.rules())
        return lax.cond(needed, compute, lambda st: st, state)

    return lax.fori_loop(0, kb.shape[0], body, init)


# ---- blocking: [B, T, ...] <-> [n, B, b, ...], a ragged end padded ----


def attend_partial(
    q, k, v, q_pos, k_pos, *, block: int = DEFAULT_BLOCK, q_start=None, variant=None, **fields
) -> Partial:
    """Attend queries to one K/V set (not differentiable on its own: see ``chunked_attention``).
    ``q_start`` [B, Tq] (``--doc-mask``): where each query's document starts (absolute position).
    ``variant`` (or its ``fields``: ``window=``, ``causal=``, ...): the mask and score rules; q has
    been through ``variant.query`` (the kernel divides the scores by sqrt(E))."""
    variant = variant_of(variant, **fields)
    x = _block_inputs(q, k, v, q_pos, k_pos, block, q_start)
    kw = dict(variant=variant)  # by keyword: plants forward it
    row = lambda a: _attend_qblock(a[0], a[1], x.kb, x.vb, x.kpb, x.kvb, variant.causal, x.scale, a[2], **kw)
    acc, m, lsum = lax.map(row, (x.qb, x.qpb, x.qsb))  # [nq, B, K, G, bq, ...]
    out = acc * _safe_inv(lsum)[..., None]
    tq, h = q.shape[1:3]
    return Partial(_to_tokens(out, tq, h), _to_tokens(m, tq, h), _to_tokens(lsum, tq, h))


def partial_grads(
    q, k, v, q_pos, k_pos, out, lse, dout, *, block=DEFAULT_BLOCK, q_start=None, variant=None, **fields
):
    """The flash-attention backward for one K/V set: (dq, dk, dv) given the final ``out`` [B, Tq, H, E]
    and ``lse`` [B, Tq, H] over all K/V sets (dq is this set's share: sum it over the sets). P is
    recomputed from the variant's scores, and dS carries its score rule's slope."""
    variant = variant_of(variant, **fields)
    x = _block_inputs(q, k, v, q_pos, k_pos, block, q_start)
    qs = (lambda i: None) if x.qsb is None else (lambda i: x.qsb[i])
    bq, kh = x.qb.shape[2], k.shape[2]
    f = x.scale.dtype
    dout = upcast(dout).astype(f)
    dob = _blocks(dout.reshape(*dout.shape[:2], kh, -1, dout.shape[-1]), bq)  # [nq, B, bq, K, G, E]
    lse_b = _from_tokens(jnp.where(jnp.isfinite(lse), lse, 0.0).astype(f), bq, kh)  # [nq, B, K, G, bq]
    d_b = _from_tokens(jnp.sum(dout * upcast(out).astype(f), axis=-1), bq, kh)
    causal, rules = variant.causal, variant.rules()

    def kv_step(dq, kv):
        k_j, v_j, kp_j, kvalid_j = kv

        def q_step(i, carry):
            def compute(carry):
                dk_j, dv_j, dq = carry
                q_i, do_i = x.qb[i], dob[i]
                vis = _visible(x.qpb[i], kp_j, kvalid_j, causal, qs(i), **rules)[:, None, None]
                raw = _scores(q_i, k_j, x.scale)  # before the score rule: its slope is taken there
                p = jnp.where(vis, jnp.exp(variant.score(raw) - lse_b[i][..., None]), 0.0)
                dp = jnp.einsum("bqkge,bske->bkgqs", do_i, upcast(v_j).astype(f))
                ds = p * (dp - d_b[i][..., None]) * variant.score_slope(raw) * x.scale
                dq = dq.at[i].add(jnp.einsum("bkgqs,bske->bqkge", ds, upcast(k_j).astype(f)))
                dk_j = dk_j + jnp.einsum("bkgqs,bqkge->bske", ds, upcast(q_i).astype(f))
                return dk_j, dv_j + jnp.einsum("bkgqs,bqkge->bske", p, do_i), dq

            needed = _needed(x.qpb[i], kp_j, kvalid_j, causal, qs(i), **rules)
            return lax.cond(needed, compute, lambda c: c, carry)

        zeros = varying_like(jnp.zeros(k_j.shape, f), x, dob, lse_b, d_b)
        dk_j, dv_j, dq = lax.fori_loop(0, x.qb.shape[0], q_step, (zeros, zeros, dq))
        return dq, (dk_j, dv_j)

    dq0 = varying_like(jnp.zeros(x.qb.shape, f), x, dob, lse_b, d_b)
    dq, (dkb, dvb) = lax.scan(kv_step, dq0, (x.kb, x.vb, x.kpb, x.kvb))
    tq, tk = q.shape[1], k.shape[1]
    dq = _unblock(dq, tq).reshape(q.shape)
    return dq.astype(q.dtype), _unblock(dkb, tk).astype(k.dtype), _unblock(dvb, tk).astype(v.dtype)


# ---- the differentiable entry points ----


def _chunked_fwd(q, ks, vs, q_pos, k_poss, q_start, block, variant):
    part = None
    for k, v, kp in zip(ks, vs, k_poss, strict=True):  # a ring's steps
        p = attend_partial(q, k, v, q_pos, kp, block=block, q_start=q_start, variant=variant)
        part = p if part is None else combine(part, p)
    part = variant.finish(part)  # once, after the last merge
    out = part.out.astype(q.dtype)
    return out, (q, ks, vs, q_pos, k_poss, q_start, variant, out, part.lse)


def _chunked_bwd(block, res, dout):
    q, ks, vs, q_pos, k_poss, q_start, variant, out, lse = res
    dq, dks, dvs = jnp.zeros(q.shape, upcast(q[:0]).dtype), [], []
    extra = dict(block=block, q_start=q_start, variant=variant)
    for k, v, kp in zip(ks, vs, k_poss, strict=True):
        grads = partial_grads(q, k, v, q_pos, kp, out, lse, dout, **extra)
        dq, dks, dvs = dq + grads[0], dks + [grads[1]], dvs + [grads[2]]
    return dq.astype(q.dtype), tuple(dks), tuple(dvs), None, None, None, variant.cotangent(out, lse, dout)


def _chunked(q, ks, vs, q_pos, k_poss, q_start, block, variant):
    """Every argument positional (a custom VJP): ``block`` static; ``variant`` a primal (its traced
    window's cotangent None) from ``Variant.for_kernel``."""
    return _chunked_fwd(q, ks, vs, q_pos, k_poss, q_start, block, variant)[0]


_chunked = jax.custom_vjp(_chunked, nondiff_argnums=(6,))
_chunked.defvjp(_chunked_fwd, _chunked_bwd)


def chunked_attention(q, ks, vs, q_pos, k_poss, *, block: int = DEFAULT_BLOCK, variant=None, **fields):
    """Attention of q to the concatenation of K/V chunks, computed chunk by chunk (partials merged by
    ``combine``; backward per chunk by ``partial_grads``): the single-device form of a ring.
    ``variant`` (or its ``fields``): the mask and score rules."""
    variant = variant_of(variant, **fields)
    chunks = (tuple(ks), tuple(vs), q_pos, tuple(k_poss), None)
    return _chunked(variant.query(q), *chunks, int(block), variant.folded().for_kernel(q))


def blockwise_attention(
    q, k, v, q_pos, k_pos, *, block: int = DEFAULT_BLOCK, q_start=None, variant=None, **fields
):
    """Softmax attention [B, Tq, H, E] (in q's dtype; softmax in at least float32), memory O(T).
    ``q_start`` [B, Tq] (``--doc-mask``): where each query's document starts; keys before it are masked.
    ``variant`` (or its ``fields``: ``window=``, ``causal=``, ...): what a query sees and what happens to
    its scores. A window (a query at i sees keys j with i - window < j <= i; a Python int, or a traced
    int32 scalar, as a per-layer window in a layer loop): a K/V block wholly outside every query's
    window is skipped, forward and backward."""
    variant = variant_of(variant, **fields)
    args = (variant.query(q), (k,), (v,), q_pos, (k_pos,), q_start, int(block))
    return _chunked(*args, variant.folded().for_kernel(q))
