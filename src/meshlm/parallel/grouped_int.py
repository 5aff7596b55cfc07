"""Integer grouped matmuls for ``--quant int8``'s experts (``model.quant_experts``): int8 rows, each
times its expert's int8 matrix, int32 out, exact (an int32 sum of int8 products is exact in any order
below 2^31 / 127^2 = 133,000 terms).

``IntGroups`` says how a dispatch's rows [R, ...] are grouped by expert and multiplies them, one layout
per dispatch (``parallel.grouped``), so that the int8 experts run the dispatch that was chosen:

* ``equal_groups(e, c)``: E groups of C rows each, expert-major: the "dense" reference's [E, N, D]
  (every expert on every token) and the capacity slots [E, cap, D]. A batched dot.
* ``ragged_groups(sizes, r)``: "ragged_dot"'s rows, unpadded, ``sizes`` [E] per expert (rows past
  their sum: no expert, zeros out). ``lax.ragged_dot`` takes int8 operands with an int32 result
  (XLA:CPU lowers it to a masked dense dot; on a TPU, XLA's grouped matmul); the weight gradient's
  contraction over each group's rows is ``lax.ragged_dot_general`` with a ragged contracting dim.
* ``block_groups(block_expert, used, e, block)``: "blocks"' rows, each expert's padded to a multiple
  of ``block``; a scan of block dots (the blocks past ``used`` skipped), the weight gradient summed
  per expert in an int32 carry.

No custom VJP here: integers have no gradient; ``model.quant_experts`` writes the backward with these.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from meshlm.parallel.pipeline_ops import varying


@partial(jax.tree_util.register_dataclass, data_fields=["expert", "arrays"], meta_fields=["n_experts", "how"])
@dataclass(frozen=True)
class IntGroups:
    """Rows [R, ...] grouped by expert: ``expert`` [R] int32 each row's (local) expert -- a row of none
    (padding) names a valid one: its values are zeros or carry no gradient --; ``n_experts`` E; ``how``
    and ``arrays`` the layout ("equal" (C,), "ragged" (sizes,), "blocks" (block_expert, used)). A pytree
    (its arrays the leaves): it enters ``model.quant_experts``' custom VJP as an argument, not a closure.

    ``dot(a [R, K] int8, w [E, K, M] int8)`` -> [R, M] int32, each row times its expert's matrix;
    ``dot_t(a [R, K] int8, b [R, M] int8)`` -> [E, K, M] int32, per expert the sum over its rows of
    a^T b (rows of no expert add nothing)."""

    expert: jax.Array
    arrays: tuple
    n_experts: int
    how: str

    def dot(self, a, w):
        return {"equal": _equal_dot, "ragged": _ragged_dot, "blocks": _block_dot}[self.how](self, a, w)

    def dot_t(self, a, b):
        return {"equal": _equal_dot_t, "ragged": _ragged_dot_t, "blocks": _block_dot_t}[self.how](self, a, b)


def _int(a, b, dims):
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.int32)


def equal_groups(e: int, c: int) -> IntGroups:
    """E groups of C consecutive rows (expert-major [E, C, ...] flattened)."""
    return IntGroups(jnp.repeat(jnp.arange(e, dtype=jnp.int32), c), (), e, "equal")


def _equal_dot(groups, a, w):  # [E, C, K] x [E, K, M] -> [E, C, M]
    e = groups.n_experts
    return _int(a.reshape(e, -1, a.shape[-1]), w, (((2,), (1,)), ((0,), (0,)))).reshape(a.shape[0], -1)


def _equal_dot_t(groups, a, b):  # [E, C, K] x [E, C, M] -> [E, K, M]
    e = groups.n_experts
    a, b = a.reshape(e, -1, a.shape[-1]), b.reshape(e, -1, b.shape[-1])
    return _int(a, b, (((1,), (1,)), ((0,), (0,))))


def ragged_groups(sizes, r: int) -> IntGroups:
    """``sizes`` [E] consecutive rows per expert of ``r`` (rows past their sum: no expert)."""
    e = sizes.shape[0]
    expert = jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(r), side="right")
    return IntGroups(jnp.minimum(expert, e - 1).astype(jnp.int32), (sizes,), e, "ragged")


def _ragged_dot(groups, a, w):
    return lax.ragged_dot(a, w, groups.arrays[0], preferred_element_type=jnp.int32)


def _ragged_dot_t(groups, a, b):  # the rows' dim contracted group by group: [E, K, M]
    dims = lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[]
    )
    return lax.ragged_dot_general(a, b, groups.arrays[0], dims, preferred_element_type=jnp.int32)


def block_groups(block_expert, used, e: int, block: int) -> IntGroups:
    """Blocks of ``block`` rows, block i of expert ``block_expert[i]``, the blocks from ``used`` on
    holding no row (skipped: zeros out, nothing added)."""
    expert = jnp.repeat(block_expert, block).astype(jnp.int32)
    return IntGroups(expert, (block_expert, used), e, "blocks")


def _blocks(groups, a):
    """a [R, C] -> (block indices [nb], a's blocks [nb, block, C])."""
    nb = groups.arrays[0].shape[0]
    return jnp.arange(nb), a.reshape(nb, -1, a.shape[-1])


def _block_dot(groups, a, w):
    block_expert, used = groups.arrays

    def body(_, item):
        i, ab, ex = item
        run = lambda: _int(ab, w[ex], (((1,), (0,)), ((), ())))  # [block, M]
        return None, lax.cond(i < used, run, lambda: jnp.zeros_like(run()))

    index, blocks = _blocks(groups, a)
    _, out = lax.scan(body, None, (index, blocks, block_expert))
    return out.reshape(a.shape[0], -1)


def _block_dot_t(groups, a, b):
    block_expert, used = groups.arrays
    zeros = jnp.zeros((groups.n_experts, a.shape[-1], b.shape[-1]), jnp.int32)
    axes = tuple(sorted(varying(a) | varying(b)))
    zeros = lax.pcast(zeros, axes, to="varying") if axes else zeros  # the carry's type, every tick

    def body(acc, item):
        i, ab, bb, ex = item
        add = lambda: acc.at[ex].add(_int(ab, bb, (((0,), (0,)), ((), ()))))  # [K, M] of the block
        return lax.cond(i < used, add, lambda: acc), None

    index, a_blocks = _blocks(groups, a)
    acc, _ = lax.scan(body, zeros, (index, a_blocks, _blocks(groups, b)[1], block_expert))
    return acc
