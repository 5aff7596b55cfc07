"""The pipeline engines' array helpers (``parallel.pipeline_engines``): varying-axis casts inside
``shard_map``, per-chunk slicing and accumulation, and branches that run a function where a predicate
holds and give zeros of its types elsewhere. Nothing here knows the schedule."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax


def varying(a) -> frozenset:
    """The mesh axes ``a`` varies over (inside shard_map)."""
    aval = jax.typeof(a)
    return frozenset(aval.vma if hasattr(aval, "vma") else aval.mat.varying)  # renamed across JAX versions


def type_axes(s) -> tuple:
    """The axes a ShapeDtypeStruct from ``jax.eval_shape`` inside shard_map varies over."""
    mat = getattr(s, "manual_axis_type", None)
    return tuple(sorted(mat.varying)) if mat is not None else tuple(getattr(s, "vma", ()))


def vary(tree, axes):
    """Mark values varying over ``axes`` (scan carries must keep one type across ticks; for parameters
    the cast's transpose is the gradient's sum over those axes)."""

    def one(a):
        missing = tuple(ax for ax in axes if ax not in varying(a))
        return lax.pcast(a, missing, to="varying") if missing else a

    return jax.tree.map(one, tree)


def sum_where_cast(grads, entry, axes):
    """Sum each gradient over the ``axes`` its parameter was cast to vary over at entry (``entry``: the
    parameters as they came in). A parameter stored split over DP (FSDP) is DP-varying already: its
    gradient came out of the all-gather's transpose, a reduce-scatter, summed."""

    def one(g, a):
        cast = tuple(ax for ax in axes if ax not in varying(a))
        return lax.psum(g, cast) if cast else g

    return jax.tree.map(one, grads, entry)


def chunk(params, j):
    """Virtual stage j's layers [c, ...] of this device's [V, c, ...]. With V = 1 a static index: the
    weights stay loop-invariant, so GPipe's scan does not save a copy of them per tick."""
    if jax.tree.leaves(params)[0].shape[0] == 1:
        return jax.tree.map(lambda a: a[0], params)
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, j, 0, keepdims=False), params)


def only_if(pred, fn, *args):
    """``fn(*args)`` where ``pred`` (the same on every device of a stage) holds, zeros of its types
    elsewhere. Its collectives over dp and mp stay within one stage, which takes one branch."""
    return lax.cond(pred, fn, partial(zeros_of, fn), *args)


def zeros_of(fn, *args):
    """Zeros of ``fn(*args)``'s types (shapes, dtypes and varying axes), without running it."""
    types = jax.eval_shape(fn, *args)
    return jax.tree.map(lambda s: vary(jnp.zeros(s.shape, s.dtype), type_axes(s)), types)


def add_at(acc, j, g):
    """Virtual stage j's gradient added to the [V, ...] accumulator: with V = 1 at a static index (a
    plain add; the scatter-add of a traced index runs as a slow loop on CPU)."""
    return acc + g[None] if acc.shape[0] == 1 else acc.at[j].add(g)
