"""The weight matmul of every layer, with its backward written out on 2-D views.

``dense(x, w)``: x [..., K] @ w [K, M] -> [..., M]; per-shard shapes inside ``shard_map``. The forward
is the plain matmul; the backward is the textbook one, with N = x's leading dims flattened:

    dx [N, K] = g [N, M] @ w^T        dw [K, M] = x^T [K, N] @ g [N, M]

Why not JAX's own transpose: it hands XLA a dot contracting over x's *leading* dims ([B, T] of a
[B, T, D] activation), and in the whole train step XLA:CPU kept that form for every weight gradient;
its fast matmul library (YNNPACK) takes only a row-major left operand that contracts its last dim,
so those dots fell back to a slower generic contraction (13 of them in the ``cpu`` preset's step).
Here x^T is made a real array behind an optimisation barrier (else XLA folds the transpose back into
the dot). Measured side by side in one process on 2 CPU cores (``cpu`` preset, batch 32 x 128): the
2x2 sharded step 1.01 -> 0.90 s, the unsharded one 0.94 s without the barrier, 0.91 s with it. Same
maths up to summation order: the float64 proof (``meshlm verify --x64``) checks it.

Only on XLA:CPU (``parallel.compile_target``: the platform compiled for). Elsewhere the matmul is JAX's
own, with its own backward: on XLA:TPU the barrier's x^T of every weight matmul and the dx/dw dots on
2-D views kept more of the step's activations alive at once (llama-100m, float32, batch 8 x 512 on a
v5e: 340 MB more temporaries than JAX's backward, 3.66 GB peak against plain JAX's 3.59 GB with it;
scripts/step_memory.py --chip v5e, docs/benchmarks.md).

``MESHLM_DENSE_BACKWARD`` (``2d`` or ``jax``) overrides the platform's choice, to measure one backward
against the other on the chip, and so that the CPU's float64 proof can run the backward a TPU runs
(tests/test_dense_backward.py: ``meshlm verify`` passes with ``jax``, and its mutant fails).
"""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp

from meshlm.errors import ConfigError
from meshlm.parallel.compile_target import compile_platform

ENV = "MESHLM_DENSE_BACKWARD"  # "2d" | "jax": the weight matmul's backward, whatever the platform
BACKWARDS = ("2d", "jax")

# Rows a TPU's matrix unit takes at once (a sublane tile). XLA:TPU turns a dot of fewer rows (a decode
# step of batch < 8: one token a row) into a multiply-reduce on the vector unit, which reads the weights
# at ~200-300 GB/s of a v5e's 819 (llama-100m's MLP, batch 1: 441 us a step against 138 us for its
# bytes, the compiler's own estimate); padded with zero rows to 8 the dot runs on the matrix unit,
# streaming the weights (405 -> 132 us for 16 such matmuls, ``docs/benchmarks.md``, decode).
MXU_ROWS = 8


def backward_kind() -> str:
    """ "2d" (the module docstring's, XLA:CPU's) or "jax" (JAX's own, every other platform's), or as
    ``MESHLM_DENSE_BACKWARD`` says; decided when traced, for the platform compiled for."""
    kind = os.environ.get(ENV, "")
    if kind and kind not in BACKWARDS:
        raise ConfigError(
            f"{ENV}={kind!r} is not a dense backward; use one of {', '.join(BACKWARDS)} (or unset it)"
        )
    return kind or ("2d" if compile_platform() == "cpu" else "jax")


def dense(x, w):
    """x [..., K] @ w [K, M] -> [..., M], its backward as ``backward_kind`` says; on XLA:TPU a matmul
    of fewer than ``MXU_ROWS`` rows padded to them (each row's result is its own: the zero rows change
    nothing). Decided when traced, for the platform compiled for."""
    if backward_kind() == "2d":
        return _dense_2d(x, w)
    rows = math.prod(x.shape[:-1])
    if compile_platform() == "tpu" and rows < MXU_ROWS:
        padded = jnp.pad(x.reshape(rows, x.shape[-1]), ((0, MXU_ROWS - rows), (0, 0)))  # [8, K]
        return (padded @ w)[:rows].reshape(*x.shape[:-1], w.shape[-1])
    return x @ w


@jax.custom_vjp
def _dense_2d(x, w):
    return x @ w


def _fwd(x, w):
    return x @ w, (x, w)


def _bwd(res, g):
    x, w = res
    k, m = w.shape
    x2, g2 = x.reshape(-1, k), g.reshape(-1, m)  # [N, K], [N, M]
    dx = (g2 @ w.T).reshape(x.shape).astype(x.dtype)
    dw = jax.lax.optimization_barrier(x2.T) @ g2  # [K, N] row-major @ [N, M]
    return dx, dw.astype(w.dtype)


_dense_2d.defvjp(_fwd, _bwd)


def dense_heads_in(x, w, mm=None):
    """Projection to heads: x [B, T, D] @ w [D, H, E] -> [B, T, H, E]; ``mm``: the matmul (``dense``,
    or an int8 one: ``model.quant.matmul``)."""
    d, h, e = w.shape
    return (mm or dense)(x, w.reshape(d, h * e)).reshape(*x.shape[:-1], h, e)


def dense_heads_out(x, w, mm=None):
    """Projection from heads: x [B, T, H, E] @ w [H, E, D] -> [B, T, D] (``mm`` as ``dense_heads_in``)."""
    h, e, d = w.shape
    return (mm or dense)(x.reshape(*x.shape[:-2], h * e), w.reshape(h * e, d))


def add_once(par, partial, bias):
    """A row-parallel partial [.., D] plus a replicated ``bias`` [D] on mp shard 0 only, so the row sum
    that follows holds it once (gpt-oss's attention output bias; ``model.moe``'s down bias alike)."""
    return partial + jnp.where(par.shard_index() == 0, bias, jnp.zeros_like(bias)).astype(partial.dtype)
