"""``--quant int8``'s planted faults (``model.quant``), each in the sharded program only; the first four
must fail the int8 block's bit-for-bit check (``proof.quant_exact``), the fifth the step's values.

* a scale from the local shard: the per-token max over a contraction dim split over mp taken on this
  shard's slice, not the exact ``pmax`` (each shard quantizes on its own grid);
* an int32 partial sum rescaled before the all-reduce: the float partials summed instead of the integers
  (within the float tolerance of the values: only the bit-for-bit check sees it);
* a dropped gradient quantizer: the backward's matmuls in float (the straight-through forward kept);
* a transposed scale: the weight gradient's [K, M] scales laid out from their [M, K] transpose (a reshape
  where a transpose was meant);
* a weight gradient's scales from this shard's tokens (no ``pmax`` over the batch axes): detected by the
  whole step's values (under pp through the pipeline, against the reference of its micro-batches).

The experts' (``model.quant_experts``), each failing the int8 experts' check (``proof.quant_experts_exact``):

* an expert's weight-gradient scale from this shard's rows: the max over the expert's rows without the
  ``pmax`` over the data shards that hold its other rows (dp outside ep, cp);
* an expert's scale over other shards' experts: that ``pmax`` taken over ep too, whose shards hold other
  experts (the dense weights' token max, where each ep shard's local expert i is another expert).
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import jax.numpy as jnp
from jax import lax

from meshlm.model import quant, quant_experts
from meshlm.parallel.axes import MP
from meshlm.parallel.context import Parallel
from meshlm.proof.control_record import Control, Where, replaced
from meshlm.proof.quant_experts_exact import expert_axes


class LocalInt8Scale(Parallel):
    """The scale of a contraction split over mp from this shard's slice alone (no ``pmax``)."""

    def int8_max(self, m, split: bool):
        return m


class Int8RescaledBeforeSum(Parallel):
    """The row-parallel int32 partial sums rescaled to float on each shard, then all-reduced as floats."""

    def int8_out(self, acc, scale, split: bool):
        if not (split and self.sharded):
            return super().int8_out(acc, scale, split)
        total = lax.psum(acc.astype(scale.dtype) * scale, MP)
        return jnp.where(self.shard_index() == 0, total, jnp.zeros_like(total))


class LocalTokenMax(Parallel):
    """A weight gradient's per-channel scales from this shard's tokens alone, not the ``pmax`` over the
    batch axes (under pp: over the pipeline micro-batch's rows on the other data shards)."""

    def token_max(self, m):
        return m


class ExpertScaleLocalRows(Parallel):
    """An expert weight gradient's per-channel scales from this shard's rows of the expert alone."""

    def expert_token_max(self, m):
        return m


class ExpertScaleOverEp(Parallel):
    """An expert weight gradient's per-channel scales a ``pmax`` over every batch axis, ep included."""

    def expert_token_max(self, m):
        axes = self.layout.batch_axes
        return lax.pmax(m, axes if len(axes) > 1 else axes[0])


@contextmanager
def _floats():
    """Both backwards in float: the dense matmuls' and the experts'."""
    with replaced(quant.GRADS, "int8", quant.float_grads):
        with replaced(quant_experts.GRADS, "int8", quant_experts.float_grads):
            yield


def _transposed(sa, sb):
    k, m = sa.shape[-1], sb.shape[-1]
    return (jnp.swapaxes(sb, -1, -2) * sa).reshape(
        *sa.shape[:-2], k, m
    )  # [.., M, K] reshaped, not transposed


def _quantized(where: Where) -> bool:
    return where.cfg is not None and getattr(where.cfg, "quant", "none") == "int8"


def _split(where: Where) -> bool:
    return _quantized(where) and where.layout.mp > 1


def _batch_split(where: Where) -> bool:
    return _quantized(where) and math.prod(where.layout.mesh_shape[a] for a in where.layout.batch_axes) > 1


def _experts_rows_split(where: Where) -> bool:
    """int8 experts whose rows lie on several data shards (dp outside ep, cp)."""
    if not (_quantized(where) and where.cfg.arch.moe):
        return False
    return math.prod(where.layout.mesh_shape[a] for a in expert_axes(where.layout)) > 1


def _experts_split(where: Where) -> bool:
    return _quantized(where) and where.cfg.arch.moe and where.layout.experts_split


QUANT_CONTROLS = (
    Control(
        name="int8 scale from the local shard", applies=_split, par_cls=LocalInt8Scale, by_int8_block=True
    ),
    Control(
        name="int8 partial sum rescaled before the all-reduce",
        applies=_split,
        par_cls=Int8RescaledBeforeSum,
        by_int8_block=True,
    ),
    Control(
        name="int8 gradient quantizer dropped",
        applies=_quantized,
        plant=_floats,
        by_int8_block=True,
    ),
    Control(
        name="int8 weight-gradient scale transposed",
        applies=_quantized,
        plant=lambda: replaced(vars(quant), "outer_scale", _transposed),
        by_int8_block=True,
    ),
    Control(  # by values: the whole step's (under pp through the pipeline, against its micro-batches)
        name="int8 weight-gradient scale from this shard's tokens",
        applies=_batch_split,
        par_cls=LocalTokenMax,
    ),
    Control(
        name="int8 expert scale from this shard's rows",
        applies=_experts_rows_split,
        par_cls=ExpertScaleLocalRows,
        by_int8_block=True,
    ),
    Control(
        name="int8 expert scale over other shards' experts",
        applies=_experts_split,
        par_cls=ExpertScaleOverEp,
        by_int8_block=True,
    ),
)
