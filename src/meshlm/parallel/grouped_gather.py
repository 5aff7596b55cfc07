"""The sorted dispatch's two row moves (``parallel.grouped``) as gathers, forward and backward.

A shard's N tokens make M = N x k choices; ``grouped.plan`` gives each kept choice a row of a buffer
[R, D] (``choice`` [R]: the flat choice n x k + j each row holds, M for a padding row). Moving tokens
to rows and rows back to tokens is a gather one way and, written plainly, a scatter-add of [R, D]
rows the other (the combine ``zeros.at[token].add``, and the transpose of the dispatch's gather). On
a TPU v5e such a scatter of bf16 rows ran at about a sixth of HBM bandwidth: ~28 of them, 5.2 of
qwen3-moe-100m's 24 ms step (docs/benchmarks.md, the experts' profile). Here every move is a gather:

* ``inverse`` [N, k]: the row holding each choice, R where none here does (another ep shard's
  expert, a choice the capacity dropped). It is the only scatter left: R int32 indices, no rows.
* ``dispatch_rows``: xs [R, D] = x[token] (a padding row: zeros); its VJP dx[n] = the sum over j of
  dxs[inv[n, j]] (R: zero), a gather by the inverse and a sum over k.
* ``combine_rows``: out[n] = the sum over j of w[n, j] x ys[inv[n, j]]; its VJP dys[r] = w of row r's
  choice x dout[token[r]] and dw[n, j] = <dout[n], ys[inv[n, j]]>: gathers by token and by inverse.

Why the VJPs are written by hand: JAX's transpose of a gather is a scatter-add, it cannot know that
``token`` and ``inverse`` are inverse maps (each row holds one choice, each choice at most one row).

The sums over k (``gather_sum``) run in choice order j = 0 .. k-1 (the router's top-k order), each
term rounded as the scatter-add's row was (w x ys in the rows' dtype), accumulated in float32 at
least and rounded once at the end. The order is the program's, not the sharding's: a token's sum is
the same expression on every shard (under ep each shard sums its own experts' choices, exact zeros
for the rest, and the reduce-scatter adds the shards' sums, as it did the scatter-add's). The
scatter-add added a token's rows in an order XLA chose. ``MESHLM_MOE_COMBINE=scatter``
(``COMBINE_ENV``) runs the scatter-add instead, for a side-by-side measurement (``combine_mode``).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from meshlm.errors import ConfigError

COMBINE_ENV = "MESHLM_MOE_COMBINE"
MODES = ("gather", "scatter")


def combine_mode() -> str:
    """``MESHLM_MOE_COMBINE``: "gather" (unset: the default) or "scatter"; anything else is an error."""
    mode = os.environ.get(COMBINE_ENV, "gather") or "gather"
    if mode not in MODES:
        raise ConfigError(f"{COMBINE_ENV}={mode!r}: use one of {', '.join(MODES)} (or leave it unset)")
    return mode


def inverse(choice, m: int, k: int):
    """choice [R] (the flat choice each row holds, ``m`` for none) -> [m / k, k] int32: the row holding
    each choice, R where no row does (its reads give zeros)."""
    r = choice.shape[0]
    rows = jnp.arange(r, dtype=jnp.int32)
    return jnp.full(m, r, jnp.int32).at[choice].set(rows, mode="drop").reshape(-1, k)


def gather_sum(rows, inv, weights=None):
    """[N, D]: the sum over j = 0 .. k-1, in that order, of weights[n, j] x rows[inv[n, j]] (``rows``
    [R, D]; ``inv`` [N, k], R: a zero term; no ``weights``: 1), accumulated in float32 at least.

    One gather of [N, D] rows per j, its index clamped and the term zeroed by a select the sum's
    fusion takes in: XLA:TPU ran ``take(mode="fill")``'s [N, k, D] gather then a select-and-relayout
    pass over all of it (the compile-only v5e's HLO), one more read and write of N x k x D values."""
    r, acc = rows.shape[0], jnp.promote_types(rows.dtype, jnp.float32)
    out = None
    for j in range(inv.shape[1]):  # a fixed order, whatever the shard's rows (module docstring)
        at = inv[:, j]  # [N]
        term = jnp.take(rows, at, axis=0, mode="clip")  # [N, D]; R read as row R - 1, then zeroed
        if weights is not None:
            term = weights[:, j, None] * term  # rounded in the rows' dtype, as the scatter-add's row was
        term = jnp.where((at < r)[:, None], term, jnp.zeros((), term.dtype)).astype(acc)
        out = term if out is None else out + term
    return out.astype(rows.dtype)


@jax.custom_vjp
def dispatch_rows(x, token, inv):
    """x [N, D] -> xs [R, D]: row r holds token[r]'s vector (N, a padding row's: zeros). ``inv`` [N, k]
    (``inverse``) is the backward's map: dx a gather, not the scatter-add JAX would transpose to."""
    return jnp.take(x, token, axis=0, mode="fill", fill_value=0)


def _dispatch_fwd(x, token, inv):
    return dispatch_rows(x, token, inv), inv


def _dispatch_bwd(inv, dxs):
    return gather_sum(dxs, inv), None, None  # [N, D]: each token's rows' gradients, summed over j


dispatch_rows.defvjp(_dispatch_fwd, _dispatch_bwd)


@jax.custom_vjp
def combine_rows(ys, w, token, choice, inv):
    """ys [R, D] the rows' outputs, w [N, k] the combine weights (ys' dtype) -> [N, D]: each token's
    weighted sum of its rows (``gather_sum``); ``token``, ``choice`` [R] and ``inv`` [N, k] the maps
    both ways (the backward's gathers)."""
    return gather_sum(ys, inv, w)


def _combine_fwd(ys, w, token, choice, inv):
    return combine_rows(ys, w, token, choice, inv), (ys, w, token, choice, inv)


def _combine_bwd(res, dout):
    ys, w, token, choice, inv = res
    douts = jnp.take(dout, token, axis=0, mode="fill", fill_value=0)  # [R, D]: each row's token's
    w_rows = jnp.take(w.reshape(-1), choice, mode="fill", fill_value=0)  # [R]: padding rows 0
    dw_rows = jnp.sum(douts * ys, axis=-1)  # [R]: <dout[token], ys> per row, as JAX's own transpose
    dw = jnp.take(dw_rows, inv, mode="fill", fill_value=0)  # [N, k]: a choice with no row here: 0
    return w_rows[:, None] * douts, dw, None, None, None


combine_rows.defvjp(_combine_fwd, _combine_bwd)
