"""JAX's Pallas megablox grouped matmul (``gmm``, ``tgmm``) for the "gmm" dispatch (``parallel.grouped``),
inside ``shard_map`` too, with a reference path of the same contract for float64.

The contract (``grouped_matmul``): lhs [M, K] rows sorted by group, rhs [G, K, N], ``sizes`` [G + 1]
int32 summing to M: group g's rows are sizes[0] + .. + sizes[g - 1] onwards (its offsets, the cumulative
sum), the last entry the rows of no group here (other shards' choices, padding). Out [M, N]: each
group's rows times its matrix, the rows of no group exact zeros. M is a multiple of the row tile.

On a TPU the kernel runs compiled (Mosaic); elsewhere in Pallas interpret mode (slow, the same kernel
code: where its equality with the reference is tested on CPU, ``tests/test_gmm.py``). The kernel takes
bfloat16 and float32 only: in float64 (``verify --x64``) ``grouped_matmul`` computes the same contract
with ``lax.ragged_dot`` on the first G sizes (rows past them: zeros), so the float64 proof runs the
dispatch around the kernel -- the row padding, the group sizes, the offsets a control breaks
(``Parallel.moe_group_sizes``) -- with the kernel's reference path.

Inside ``shard_map(check_vma=True)`` JAX's ``pallas_call`` wants its outputs typed with the mesh axes they
vary over, and megablox declares none; so, as ``model.flash_kernel`` does for splash, the forward and
the two backward kernels are primitives of this module typed here (varying like every operand, cast to
the union of their axes first), and only their lowering traces the kernel, as the per-device program it
is. No collective is added or dropped: the kernel is per shard.

Tiling (``parallel.gmm_tiling``): (tm, tk, tn) the rows, contraction and output columns of one kernel
tile. A group's first and last tiles are partial (computed whole, stored masked), so each of the G - 1
group boundaries costs up to one extra tile, and each tile a fixed cost: tm is the largest of 512,
256, 128 with (G - 1) x tm <= M / 2 (at most half again the row tiles the rows need), else 128. tk and
tn: the largest multiple of 128 up to 512 dividing the dimension (a dimension below 128 whole; else
128, the kernel masking the remainder). ``--gmm-tiling TM,TK,TN`` fixes tm and caps tk, tn.
"""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp
from jax import lax
from jax._src import config as jax_config  # the varying-axes check's switch: see ``_per_device``
from jax._src import core as jax_core  # ManualAxisType: see ``_untyped``
from jax._src import dispatch
from jax.extend.core import Primitive
from jax.interpreters import mlir

from meshlm.parallel.compile_target import compile_platform
from meshlm.parallel.gmm_tiling import tiles as kernel_tiles
from meshlm.parallel.pipeline_ops import varying

# the kernels' module (the package's ``gmm`` attribute is ops.gmm, the function with megablox's own VJP)
megablox = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")
KERNEL_DTYPES = (jnp.bfloat16, jnp.float32)  # what megablox takes; others (float64): the reference path


def interpret_mode() -> bool:
    """Pallas interpret mode everywhere but on a TPU (the compiled kernel is Mosaic, TPU only): the
    platform compiled for (``parallel.compile_target``), which ``meshlm plan --chip`` and
    scripts/moe_hlo.py set to a TPU from any host (else a chip's step would trace the interpreter)."""
    return compile_platform() != "tpu"


# --- the kernels as primitives (typed here; traced per device in their lowering) --------------------


def _gmm_impl(lhs, rhs, sizes, *, tiles, transpose_rhs):
    # the first G groups of sizes' G + 1 computed (rhs has G); the rows of the last: zeros (megablox
    # zeroes the rows outside the groups it computes)
    return megablox.gmm(
        lhs, rhs, sizes, lhs.dtype, tiles, None, None, transpose_rhs=transpose_rhs, interpret=interpret_mode()
    )


def _tgmm_impl(lhs_t, grad, sizes, *, tiles, groups):
    return megablox.tgmm(lhs_t, grad, sizes, lhs_t.dtype, tiles, None, groups, interpret=interpret_mode())


def _untyped(aval):
    """``aval`` without the mesh axes it varies over: a value as a per-device program sees it."""
    return (
        aval.update(manual_axis_type=jax_core.ManualAxisType()) if hasattr(aval, "manual_axis_type") else aval
    )


def _per_device(impl):
    """The lowering of ``impl``: the per-device program, traced on shapes and dtypes alone, without the
    varying-axes check (``model.flash_kernel._per_device``: the same reason)."""
    lowered = mlir.lower_fun(impl, multiple_results=False)

    def rule(ctx, *args, **params):
        ctx = ctx.replace(
            avals_in=[_untyped(a) for a in ctx.avals_in], avals_out=[_untyped(a) for a in ctx.avals_out]
        )
        with jax_config._check_vma(False):
            return lowered(ctx, *args, **params)

    return rule


def _primitive(name, impl, abstract):
    p = Primitive(name)
    p.def_impl(functools.partial(dispatch.apply_primitive, p))
    p.def_abstract_eval(abstract)
    mlir.register_lowering(p, _per_device(impl))
    return p


def _gmm_aval(lhs, rhs, sizes, *, tiles, transpose_rhs):  # [M, N], typed as lhs (every operand alike)
    return lhs.update(shape=(lhs.shape[0], rhs.shape[1] if transpose_rhs else rhs.shape[2]))


def _tgmm_aval(lhs_t, grad, sizes, *, tiles, groups):  # [G, K, N], typed as lhs_t
    return lhs_t.update(shape=(groups, lhs_t.shape[0], grad.shape[1]))


_gmm_p = _primitive("meshlm_gmm", _gmm_impl, _gmm_aval)
_tgmm_p = _primitive("meshlm_tgmm", _tgmm_impl, _tgmm_aval)


def _kernel_gmm(lhs, rhs, sizes, tm, tiling, transpose_rhs=False):
    k = lhs.shape[1]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    return _gmm_p.bind(lhs, rhs, sizes, tiles=kernel_tiles(tm, k, n, tiling), transpose_rhs=transpose_rhs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _kernel(lhs, rhs, sizes, tm, tiling):
    return _kernel_gmm(lhs, rhs, sizes, tm, tiling)


def _kernel_fwd(lhs, rhs, sizes, tm, tiling):
    return _kernel_gmm(lhs, rhs, sizes, tm, tiling), (lhs, rhs, sizes)


def _kernel_bwd(tm, tiling, res, grad):
    """d lhs = grad x rhs^T per group (gmm, rhs transposed in the kernel); d rhs [G, K, N] = lhs^T x grad
    per group (tgmm: each group's rows only; a group with none, zeros); the sizes: no gradient."""
    lhs, rhs, sizes = res
    grad = grad.astype(lhs.dtype)
    d_lhs = _kernel_gmm(grad, rhs, sizes, tm, tiling, transpose_rhs=True)
    tiles = kernel_tiles(tm, lhs.shape[1], grad.shape[1], tiling)
    d_rhs = _tgmm_p.bind(lhs.T, grad, sizes, tiles=tiles, groups=rhs.shape[0])
    return d_lhs, d_rhs.astype(rhs.dtype), None


_kernel.defvjp(_kernel_fwd, _kernel_bwd)


def _same_axes(*xs):
    """``xs`` each cast to vary over the union of their mesh axes (inside ``shard_map``; outside, as
    they are): the primitives type their results like their first operand. The casts' transposes sum
    each gradient over the axes its operand did not vary over."""
    union = frozenset().union(*(varying(x) for x in xs))
    return tuple(lax.pcast(x, tuple(sorted(union - varying(x))), to="varying") if union - varying(x) else x
                 for x in xs)  # fmt: skip


def grouped_matmul(lhs, rhs, sizes, tm: int, tiling=None):
    """lhs [M, K] @ rhs [G, K, N] per group (module docstring's contract; ``sizes`` [G + 1] int32 summing
    to M, M a multiple of ``tm``) -> [M, N] in lhs's dtype: the megablox kernel for bfloat16 and float32,
    the reference (``lax.ragged_dot`` on the first G sizes) for any other dtype (float64)."""
    if lhs.shape[0] % tm:
        raise ValueError(f"grouped_matmul: {lhs.shape[0]} rows are not a multiple of the row tile {tm}")
    if lhs.dtype not in KERNEL_DTYPES or rhs.dtype != lhs.dtype:
        return lax.ragged_dot(lhs, rhs, sizes[:-1], preferred_element_type=lhs.dtype)
    lhs, rhs, sizes = _same_axes(lhs, rhs, sizes)
    return _kernel(lhs, rhs, sizes, tm, tiling)
