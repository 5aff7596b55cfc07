"""int8 expert matmuls (``--quant int8`` on a mixture of experts): ``model.quant``'s scheme, grouped.

``int8_grouped(par, kind, x, w, groups)``: x [R, K] rows grouped by expert (``groups``: how, and the
integer grouped dots of the dispatch that runs: ``parallel.grouped_int``) @ w [E, K, M] -> [R, M], each
row times its expert's matrix; a ``jax.custom_vjp`` whose three matmuls are int8 x int8 -> int32.
Dynamic symmetric scales, round to nearest, each a max over the contraction it factors out of:

    forward   y  [R, M] = x [R, K] @ w_e          x per row (its token's max over K), w per expert
                                                  and output channel (max over K): [E, 1, M]
    backward  dx [R, K] = g [R, M] @ w_e^T        g per row (max over M), w per expert and input row
                                                  (max over M): [E, K, 1]
              dw_e [K, M] = x_e^T @ g_e           per expert, x per input channel and g per output
                                                  channel, maxes over the expert's rows (every data
                                                  shard's: ``Parallel.expert_token_max``)

The weight gradient's scales are maxes over the expert's rows *that carry a gradient* (a row whose
gradient is all zero adds nothing to dw_e whatever its x): every dispatch then quantizes alike -- the
"dense" reference's rows of the tokens that did not choose the expert (combine weight 0), a sorted
dispatch's padding rows and a dropped choice's carry none. A row carries a gradient when its max over
the whole M is nonzero: the per-row scale's max, already the exact ``pmax`` where mp splits M.

Sharding (``kind``, as ``int8_dense``'s): "col" (w_gate, w_up [E, D, I/mp]: K whole, M split over
mp) or "row" (w_down [E, I/mp, D]: K split). A max over a dim mp splits is the exact ``pmax``; the
int32 partial sums are all-reduced as integers and rescaled once, held by mp shard 0 (``int8_out``).
The result of every row is then the unsharded one bit for bit, whatever the dispatch and the layout;
the weight gradient's sum over the data shards outside ep is the float gradient all-reduce.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from meshlm.model import quant
from meshlm.model.quant import amax, quantize, step


def int8_grouped(par, kind: str, x, ws: tuple, groups):
    """x [R, K] @ each w [E, K, M_i] of ``ws`` -> ([R, M_i], ...): row r times expert
    ``groups.expert[r]``'s matrices, in int8, the matrices side by side as one [E, K, sum M_i] (module
    docstring); ``kind``: "col" or "row"."""
    if kind not in ("col", "row"):
        raise ValueError(f"int8_grouped kind must be 'col' or 'row', got {kind!r}")
    row, widths = kind == "row", [w.shape[-1] for w in ws]

    @jax.custom_vjp
    def mm(groups, x, *ws):  # ``groups``' arrays an argument: a custom VJP closes over no traced value
        return _split(_forward(par, row, x, ws, groups), widths)

    def fwd(groups, x, *ws):
        return mm(groups, x, *ws), (groups, x, ws)

    def bwd(res, gs):
        groups, x, ws = res
        dx, dw = GRADS["int8"](par, row, x, ws, jnp.concatenate(gs, -1), groups)  # looked up here: a
        return (None, dx, *_split(dw, widths))  # control swaps it; integers have no gradient

    mm.defvjp(fwd, bwd)
    return mm(groups, x, *ws)


def _split(a, widths):
    """[..., sum M_i] -> ([..., M_i], ...)."""
    cuts = [sum(widths[: i + 1]) for i in range(len(widths) - 1)]
    return tuple(jnp.split(a, cuts, axis=-1))


def _forward(par, row: bool, x, ws, groups):
    sx = step(par.int8_max(amax(x, 1), row))  # [R, 1] per row: K split over mp when row-parallel
    sw = [step(par.int8_max(amax(w, 1), row)) for w in ws]  # [E, 1, M_i] per expert and output channel
    qw = jnp.concatenate([quantize(w, s) for w, s in zip(ws, sw, strict=True)], -1)  # [E, K, M] int8
    acc = groups.dot(quantize(x, sx), qw)  # [R, M] int32, partial over mp when row-parallel
    return par.int8_out(acc, sx * jnp.concatenate(sw, -1)[groups.expert, 0], row).astype(x.dtype)


def grouped_grads(par, row: bool, x, ws, g, groups):
    """(dx [R, K], dw [E, K, M]) of the matrices side by side, g [R, M], as int8 grouped matmuls
    (module docstring)."""
    col = not row
    gmax = par.int8_max(amax(g, 1), col)  # [R, 1] each row's max over the whole M
    sg = step(gmax)
    wmax = functools.reduce(jnp.maximum, [amax(w, 2) for w in ws])  # [E, K, 1] per expert and input row
    swt = step(par.int8_max(wmax, col))
    qwt = jnp.concatenate([quantize(w, swt) for w in ws], -1)  # [E, K, M] int8
    acc = groups.dot(quantize(g, sg), jnp.swapaxes(qwt, 1, 2))  # [R, K] = g @ w_e^T
    dx = par.int8_out(acc, sg * swt[groups.expert, :, 0], col)
    live = gmax != 0  # [R, 1] the rows that carry a gradient (a NaN one too: it must reach dw)
    sxe = step(par.expert_token_max(_group_max(x, live, groups)))  # [E, 1, K] per input channel
    sge = step(par.expert_token_max(_group_max(g, live, groups)))  # [E, 1, M] per output channel
    qx, qg = quantize(x, sxe[groups.expert, 0]), quantize(g, sge[groups.expert, 0])
    dw = groups.dot_t(qx, qg).astype(sxe.dtype) * quant.outer_scale(sxe, sge)  # [E, K, M]
    return dx.astype(x.dtype), dw.astype(ws[0].dtype)


def _group_max(a, live, groups):
    """a [R, C] -> [E, 1, C]: each expert's max |a| over its rows that carry a gradient (0: none)."""
    m = jnp.where(live, jnp.abs(a), jnp.zeros((), a.dtype)).astype(jnp.promote_types(a.dtype, jnp.float32))
    return jnp.zeros((groups.n_experts, a.shape[1]), m.dtype).at[groups.expert].max(m)[:, None]


def float_grads(par, row: bool, x, ws, g, groups):
    """(dx, dw) of the float grouped matmul: the dropped-quantizer control's (``proof.quant_controls``)."""
    del par, row
    w = jnp.concatenate(ws, -1)[groups.expert]  # [R, K, M]
    hot = jax.nn.one_hot(groups.expert, groups.n_experts, dtype=x.dtype)  # [R, E]
    return jnp.einsum("rm,rkm->rk", g, w).astype(x.dtype), jnp.einsum("re,rk,rm->ekm", hot, x, g).astype(
        w.dtype
    )


GRADS = {"int8": grouped_grads}  # the backward int8_grouped runs (a table, so that a control can replace it)
