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
with D = rowsum(dO * O), dQ += dS K, dK += dS^T Q. Nothing of size [T, T] is stored. With Gemma 2's
soft-cap (``softcap`` c > 0) the scaled scores S become c * tanh(S / c) before the mask and the online
softmax, P is recomputed from the capped scores, and dS is multiplied by the cap's slope 1 - tanh^2.

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

from meshlm.model.blockwise_blocks import _block_inputs, _blocks, _from_tokens, _to_tokens, _unblock
from meshlm.model.layers import upcast

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


def varying_like(tree, *refs):
    """``tree`` typed as varying over every manual mesh axis that one of ``refs`` varies over (inside
    ``shard_map`` a loop carry and both branches of a cond must agree; outside it: unchanged)."""
    varying = lambda x: jax.typeof(x).manual_axis_type.varying
    axes = set().union(*(varying(r) for r in jax.tree.leaves(refs)))

    def cast(x):
        missing = tuple(sorted(axes - varying(x)))
        return lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(cast, tree)


# ---- the per-block pieces (small and separate, so that the tests can plant the classic bugs) ----


def _visible(qp, kp, kvalid, causal: bool, qs=None, *, window=None):
    """[B, bq, bk]: which (query, key) pairs of a block pair count. ``qs`` [B, bq] (``--doc-mask``):
    where each query's document starts; keys before it are not visible. ``window`` (a sliding
    window, a Python int or a traced int32 scalar; None: none): also ``qp - window < kp``."""
    vis = kvalid[:, None, :]
    vis = vis & (kp[:, None, :] <= qp[:, :, None]) if causal else vis
    if window is not None:  # a traced 0 (a global layer's, ``attention.kind_tables``): no window
        w = jnp.asarray(window, qp.dtype)
        vis = vis & ((w == 0) | (kp[:, None, :] > qp[:, :, None] - w))
    return vis if qs is None else vis & (kp[:, None, :] >= qs[:, :, None])


def _needed(qp, kp, kvalid, causal: bool, qs=None, *, window=None):
    """Scalar: whether a block pair has any visible pair (else it is skipped, not computed). With
    document starts ``qs`` (causal only) a K/V block wholly before the query block's documents is
    skipped too; with a ``window``, a K/V block wholly before every query's window (its last key at
    or before ``first query - window``): per query O(window / block) blocks are computed."""
    if not causal:
        return jnp.any(kvalid)
    imax, imin = jnp.iinfo(kp.dtype).max, jnp.iinfo(kp.dtype).min
    first_key = jnp.min(jnp.where(kvalid, kp, imax), axis=-1)  # [B]
    needed = first_key <= jnp.max(qp, axis=-1)
    last_key = jnp.max(jnp.where(kvalid, kp, imin), axis=-1)
    if qs is not None:
        needed = needed & (last_key >= jnp.min(qs, axis=-1))
    if window is not None:  # padded query rows (position imin) left out of the first query
        first_query = jnp.min(jnp.where(qp == imin, imax, qp), axis=-1)
        w = jnp.asarray(window, qp.dtype)  # 0: no window (as in ``_visible``)
        needed = needed & ((w == 0) | (last_key > first_query - w))
    return jnp.any(needed)


def _win(window) -> dict:
    """``window=`` for ``_visible`` / ``_needed`` only when there is one, so that the no-window
    program is unchanged and a planted replacement without the keyword still runs."""
    return {} if window is None else {"window": window}


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


def _cap_scores(s, cap: float):
    """Gemma 2's soft-cap of the scaled scores, cap * tanh(s / cap), taken before the mask and the
    online softmax (transformers' order, as ``attention.soft_cap``); cap 0: s unchanged."""
    return s if not cap else jnp.tanh(s / cap) * cap


def _cap_slope(s, cap: float):
    """d _cap_scores / d s at the uncapped scores s, 1 - tanh(s / cap)^2: the backward's chain rule
    through the cap (dS of the capped scores times this is dS of the scores); cap 0: 1."""
    return 1.0 if not cap else 1.0 - jnp.square(jnp.tanh(s / cap))


def _attend_qblock(q_i, qp_i, kb, vb, kpb, kvb, causal, scale, qs_i=None, window=None, softcap=0.0):
    """One query block against every K/V block: (acc, m, lsum) with acc [B, K, G, bq, E]; the scores
    soft-capped (``softcap`` > 0) before the mask and the online softmax."""
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
            vis = _visible(qp_i, kpb[j], kvb[j], causal, qs_i, **_win(window))[:, None, None]
            s = _cap_scores(_scores(q_i, kb[j], scale), softcap)
            return _online_update(state, s, vis, vb[j])

        needed = _needed(qp_i, kpb[j], kvb[j], causal, qs_i, **_win(window))
        return lax.cond(needed, compute, lambda st: st, state)

    return lax.fori_loop(0, kb.shape[0], body, init)


# ---- blocking: [B, T, ...] <-> [n, B, b, ...], a ragged end padded ----


def attend_partial(
    q,
    k,
    v,
    q_pos,
    k_pos,
    *,
    block: int = DEFAULT_BLOCK,
    causal: bool = True,
    q_start=None,
    window=None,
    softcap: float = 0.0,
) -> Partial:
    """Attend queries to one K/V set (not differentiable on its own: see ``chunked_attention``).
    ``q_start`` [B, Tq] (``--doc-mask``): where each query's document starts (absolute position).
    ``window``: a sliding window (``_visible``; a Python int or a traced int32 scalar; None: none).
    ``softcap`` > 0: the scaled scores soft-capped (``_cap_scores``) before the mask and the softmax."""
    x = _block_inputs(q, k, v, q_pos, k_pos, block, q_start)
    kw = {**_win(window), **({"softcap": softcap} if softcap else {})}  # by keyword: plants forward them
    row = lambda a: _attend_qblock(a[0], a[1], x.kb, x.vb, x.kpb, x.kvb, causal, x.scale, a[2], **kw)
    acc, m, lsum = lax.map(row, (x.qb, x.qpb, x.qsb))  # [nq, B, K, G, bq, ...]
    out = acc * _safe_inv(lsum)[..., None]
    tq, h = q.shape[1:3]
    return Partial(_to_tokens(out, tq, h), _to_tokens(m, tq, h), _to_tokens(lsum, tq, h))


def partial_grads(
    q,
    k,
    v,
    q_pos,
    k_pos,
    out,
    lse,
    dout,
    *,
    block: int = DEFAULT_BLOCK,
    causal: bool = True,
    q_start=None,
    window=None,
    softcap: float = 0.0,
):
    """The flash-attention backward for one K/V set: (dq, dk, dv) given the final ``out`` [B, Tq, H, E]
    and ``lse`` [B, Tq, H] over all K/V sets (dq is this set's share: sum it over the sets). With
    ``softcap`` P is recomputed from the capped scores and dS carries the cap's slope (d tanh)."""
    x = _block_inputs(q, k, v, q_pos, k_pos, block, q_start)
    qs = (lambda i: None) if x.qsb is None else (lambda i: x.qsb[i])
    bq, kh = x.qb.shape[2], k.shape[2]
    f = x.scale.dtype
    dout = upcast(dout).astype(f)
    dob = _blocks(dout.reshape(*dout.shape[:2], kh, -1, dout.shape[-1]), bq)  # [nq, B, bq, K, G, E]
    lse_b = _from_tokens(jnp.where(jnp.isfinite(lse), lse, 0.0).astype(f), bq, kh)  # [nq, B, K, G, bq]
    d_b = _from_tokens(jnp.sum(dout * upcast(out).astype(f), axis=-1), bq, kh)

    def kv_step(dq, kv):
        k_j, v_j, kp_j, kvalid_j = kv

        def q_step(i, carry):
            def compute(carry):
                dk_j, dv_j, dq = carry
                q_i, do_i = x.qb[i], dob[i]
                vis = _visible(x.qpb[i], kp_j, kvalid_j, causal, qs(i), **_win(window))[:, None, None]
                raw = _scores(q_i, k_j, x.scale)  # before the cap: its slope is taken there
                p = jnp.where(vis, jnp.exp(_cap_scores(raw, softcap) - lse_b[i][..., None]), 0.0)
                dp = jnp.einsum("bqkge,bske->bkgqs", do_i, upcast(v_j).astype(f))
                ds = p * (dp - d_b[i][..., None]) * _cap_slope(raw, softcap) * x.scale
                dq = dq.at[i].add(jnp.einsum("bkgqs,bske->bqkge", ds, upcast(k_j).astype(f)))
                dk_j = dk_j + jnp.einsum("bkgqs,bqkge->bske", ds, upcast(q_i).astype(f))
                return dk_j, dv_j + jnp.einsum("bkgqs,bqkge->bske", p, do_i), dq

            needed = _needed(x.qpb[i], kp_j, kvalid_j, causal, qs(i), **_win(window))
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


def _chunked_fwd(q, ks, vs, q_pos, k_poss, q_start, block, causal, softcap, window):
    part = None
    kw = dict(block=block, causal=causal, q_start=q_start, window=window, softcap=softcap)
    for k, v, kp in zip(ks, vs, k_poss, strict=True):  # a ring's steps
        p = attend_partial(q, k, v, q_pos, kp, **kw)
        part = p if part is None else combine(part, p)
    out = part.out.astype(q.dtype)
    return out, (q, ks, vs, q_pos, k_poss, q_start, window, out, part.lse)


def _chunked_bwd(block, causal, softcap, res, dout):
    q, ks, vs, q_pos, k_poss, q_start, window, out, lse = res
    dq, dks, dvs = jnp.zeros(q.shape, upcast(q[:0]).dtype), [], []
    extra = dict(block=block, causal=causal, q_start=q_start, window=window, softcap=softcap)
    for k, v, kp in zip(ks, vs, k_poss, strict=True):
        grads = partial_grads(q, k, v, q_pos, kp, out, lse, dout, **extra)
        dq, dks, dvs = dq + grads[0], dks + [grads[1]], dvs + [grads[2]]
    return dq.astype(q.dtype), tuple(dks), tuple(dvs), None, None, None, None


def _chunked(q, ks, vs, q_pos, k_poss, q_start, block, causal, softcap, window):
    """Every argument positional (a custom VJP): ``block``, ``causal``, ``softcap`` static; ``window``
    None or an int32 scalar (a primal whose cotangent is None)."""
    return _chunked_fwd(q, ks, vs, q_pos, k_poss, q_start, block, causal, softcap, window)[0]


_chunked = jax.custom_vjp(_chunked, nondiff_argnums=(6, 7, 8))
_chunked.defvjp(_chunked_fwd, _chunked_bwd)


def chunked_attention(
    q, ks, vs, q_pos, k_poss, *, block: int = DEFAULT_BLOCK, causal: bool = True, softcap: float = 0.0
):
    """Attention of q to the concatenation of K/V chunks, computed chunk by chunk (partials merged by
    ``combine``; backward per chunk by ``partial_grads``): the single-device form of a ring."""
    chunks = (tuple(ks), tuple(vs), q_pos, tuple(k_poss), None)
    return _chunked(q, *chunks, int(block), bool(causal), float(softcap), None)


def blockwise_attention(
    q,
    k,
    v,
    q_pos,
    k_pos,
    *,
    block: int = DEFAULT_BLOCK,
    causal: bool = True,
    q_start=None,
    window=0,
    softcap: float = 0.0,
):
    """Softmax attention [B, Tq, H, E] (in q's dtype; softmax in at least float32), memory O(T).
    ``q_start`` [B, Tq] (``--doc-mask``): where each query's document starts; keys before it are masked.
    ``window``: a sliding window (a query at i sees keys j with i - window < j <= i; a Python int, 0:
    none, or a traced int32 scalar, as a per-layer window in a layer loop): a K/V block wholly outside
    every query's window is skipped, forward and backward. ``softcap`` > 0 (Gemma 2): the scaled scores
    capped, cap * tanh(s / cap), before mask and softmax."""
    args = (q, (k,), (v,), q_pos, (k_pos,), q_start, int(block), bool(causal), float(softcap))
    return _chunked(*args, window_arg(window))


def window_arg(window):
    """The kernel's ``window``: None for a Python 0 (no window: the program is as without one), else
    an int32 scalar (a Python int or a traced per-layer value: a primal of the VJP, cotangent None)."""
    if isinstance(window, int) and not window:
        return None
    return jnp.asarray(window, jnp.int32)
