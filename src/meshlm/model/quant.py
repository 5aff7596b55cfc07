"""int8 weight matmuls (``--quant int8``): int8 x int8 -> int32 forward and backward, exact under sharding.

``int8_dense(par, kind, x, w)``: x [..., K] @ w [K, M] -> [..., M] (per-shard shapes), as ``dense``, with
each of its three matmuls on int8 operands and an int32 accumulator (``lax.dot_general`` with
``preferred_element_type=int32``: the TPU's int8 unit). Dynamic symmetric scales, recomputed every call,
round to nearest, each a max over the contraction dim it must factor out of:

    forward   y  [N, M] = x [N, K] @ w [K, M]    x per token (max over K), w per output channel (over K)
    backward  dx [N, K] = g [N, M] @ w^T         g per token (max over M),  w per input row (over M)
              dw [K, M] = x^T [K, N] @ g [N, M]  x per input channel, g per output channel (max over
                                                 the N tokens of the step's whole batch)

The quantizer's gradient is the identity (straight-through): the backward quantizes the incoming
gradient ``g`` and the saved float ``x`` and ``w`` afresh along its own contraction dims (as AQT/Qwix's
"fully quantized" training). No stochastic rounding: round to nearest keeps the computation a function
of the values alone, so the sharded and unsharded steps can be compared bit for bit.

Sharding (``kind``): "col" (column-parallel: K whole, M split over mp: q/k/v, w_in/w_gate/w_up) or
"row" (row-parallel: K split over mp: the attention output, w_out/w_down). Where a contraction dim is
split over mp, its max is an exact ``pmax`` over mp and the int32 partial sums are all-reduced *as
integers* before the one rescale (``Parallel.int8_out``): the result equals the unsharded one bit for
bit, and is then held by mp shard 0 alone (the others hold zeros) so that the block's float all-reduce
that follows (``row_out``, or ``f``'s transpose for dx) adds exact zeros. The tokens' max is a ``pmax``
over the batch axes (dp, cp, ep), so the weight gradient's quantization does not depend on the data
split either; its sum over data shards is the float gradient all-reduce of the float model.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from meshlm.model.dense import dense
from meshlm.model.quant_fields import QUANTS  # noqa: F401 (re-exported)

QMAX = 127.0  # symmetric int8: -127 .. 127 (-128 unused, so negation is exact)


def amax(x, axis):
    """max |x| over ``axis`` (kept), in at least float32: exact (a max rounds nothing)."""
    return jnp.max(jnp.abs(x), axis=axis, keepdims=True).astype(jnp.promote_types(x.dtype, jnp.float32))


def step(m):
    """The quantum of a row whose max |value| is ``m``: m / 127; 1 for an all-zero row (quantizes to 0).
    A NaN or inf max gives a NaN or inf quantum, so a non-finite value reaches the rescaled result (an
    int8 cast would make it a finite integer: a NaN in a pipeline's bubble, say, would vanish)."""
    return jnp.where(m == 0, jnp.ones_like(m), m / QMAX)


def quantize(x, scale):
    """round(x / scale) as int8 (clipped to +-127: x / (m / 127) may round to 127 + 1 ulp)."""
    q = jnp.round(x.astype(scale.dtype) / scale)
    return jnp.clip(q, -QMAX, QMAX).astype(jnp.int8)


def int_dot(a, b, contract=((1,), (0,))):
    """int8 [.., n] x int8 [n, ..] -> int32: the chip's int8 matmul (exact: |sum| < 2^31 for n < 2^17)."""
    return lax.dot_general(a, b, (contract, ((), ())), preferred_element_type=jnp.int32)


def outer_scale(sa, sb):
    """sa [..., 1, K], sb [..., 1, M] -> the [..., K, M] scales of a weight gradient (one per expert
    with a leading [E]: ``model.quant_experts``); a tap for the transposed-scale control
    (``proof.quant_controls``)."""
    return jnp.swapaxes(sa, -1, -2) * sb


def int8_dense(par, kind: str, x, w):
    """x [..., K] @ w [K, M] -> [..., M] with int8 matmuls (module docstring); ``kind``: "col" or "row"."""
    if kind not in ("col", "row"):
        raise ValueError(f"int8_dense kind must be 'col' or 'row', got {kind!r}")
    row = kind == "row"

    @jax.custom_vjp
    def mm(x, w):
        return _forward(par, row, x, w)

    def fwd(x, w):
        return _forward(par, row, x, w), (x, w)

    def bwd(res, g):
        x, w = res
        return GRADS["int8"](par, row, x, w, g)  # looked up here: the dropped-quantizer control swaps it

    mm.defvjp(fwd, bwd)
    return mm(x, w)


def _forward(par, row: bool, x, w):
    k, m = w.shape
    x2 = x.reshape(-1, k)  # [N, K]
    sx = step(par.int8_max(amax(x2, 1), row))  # [N, 1] per token: K split over mp when row-parallel
    sw = step(par.int8_max(amax(w, 0), row))  # [1, M] per output channel
    acc = int_dot(quantize(x2, sx), quantize(w, sw))  # [N, M] int32, partial over mp when row-parallel
    y = par.int8_out(acc, sx * sw, row)
    return y.reshape(*x.shape[:-1], m).astype(x.dtype)


def grad_dots(par, row: bool, x, w, g):
    """(dx, dw) as int8 matmuls. dx contracts over M (split over mp when column-parallel), dw over the
    batch's tokens (split over the batch axes: exact ``pmax`` scales, float sum by the gradient
    all-reduce)."""
    k, m = w.shape
    x2, g2 = x.reshape(-1, k), g.reshape(-1, m)  # [N, K], [N, M]
    col = not row
    sg = step(par.int8_max(amax(g2, 1), col))  # [N, 1] per token (over M)
    swt = step(par.int8_max(amax(w, 1), col))  # [K, 1] per input row (over M)
    acc = int_dot(quantize(g2, sg), quantize(w, swt), ((1,), (1,)))  # [N, K] = g @ w^T
    dx = par.int8_out(acc, sg * swt.T, col)
    sxt = step(par.token_max(amax(x2, 0)))  # [1, K] per input channel, over every token
    sgt = step(par.token_max(amax(g2, 0)))  # [1, M] per output channel
    qxt = lax.optimization_barrier(quantize(x2, sxt).T)  # [K, N] row-major (``model.dense``'s reason)
    dw = int_dot(qxt, quantize(g2, sgt)).astype(sxt.dtype) * outer_scale(sxt, sgt)  # [K, M]
    return dx.reshape(x.shape).astype(x.dtype), dw.astype(w.dtype)


def matmul(par, quant: str, kind: str, x, w):
    """The weight matmul of a layer: ``dense`` in float, ``int8_dense`` under ``quant == "int8"``."""
    return dense(x, w) if quant == "none" else int8_dense(par, kind, x, w)


def float_grads(par, row: bool, x, w, g):
    """(dx, dw) of the float matmul (``model.dense``'s backward): the dropped-quantizer control's."""
    del par, row
    k, m = w.shape
    x2, g2 = x.reshape(-1, k), g.reshape(-1, m)
    return (g2 @ w.T).reshape(x.shape).astype(x.dtype), (x2.T @ g2).astype(w.dtype)


GRADS = {"int8": grad_dots}  # the backward int8_dense runs (a table, so that a control can replace it)
