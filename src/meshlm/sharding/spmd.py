"""Running one Haiku loss two ways: sharded with ``jax.shard_map`` and as the unsharded reference.

``build_loss(par)`` returns a Haiku function ``loss(batch) -> scalar`` written with meshlm layers;
the *same* builder gives the reference (``Parallel()``: plain arrays, one device) and the sharded
version (inside ``shard_map`` over the (DP, MP) mesh, ``check_vma=True``).

Gradients in the sharded version come out of JAX's transposes alone: the data-parallel sum is the
transpose of the implicit replicated-to-per-shard cast of parameters, the Megatron collectives are
``pcast``/``psum`` (see ``parallel``). No hand-written gradient communication.
"""

from __future__ import annotations

from collections.abc import Callable

import haiku as hk
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from meshlm.parallel.axes import DP
from meshlm.parallel.context import Parallel
from meshlm.parallel.layout import Layout
from meshlm.parallel.placement import batch_spec
from meshlm.sharding.rules import spec_axes

LossBuilder = Callable[[Parallel], Callable]


def with_compute_dtype(apply, dtype):
    """Run ``apply`` on parameters cast to ``dtype`` (e.g. bf16) while gradients stay in the master
    (float32) dtype: the cast is differentiable. None: the master dtype, the widest of the parameters'
    (``compute_params``: a LoRA base stored in bf16 computes in its adapters' float32, or float64)."""
    if dtype is None:
        return lambda params, batch: apply(compute_params(params), batch)
    return lambda params, batch: apply(jax.tree.map(lambda p: p.astype(dtype), params), batch)


def compute_params(params):
    """``params`` with every floating leaf in the widest floating dtype among them; leaves already in
    it pass as they are (a model of one dtype is returned unchanged: no cast in its program)."""
    floats = [p.dtype for p in jax.tree.leaves(params) if jnp.issubdtype(p.dtype, jnp.floating)]
    if len(set(floats)) < 2:
        return params
    wide = jnp.result_type(*floats)
    return jax.tree.map(
        lambda p: p.astype(wide) if jnp.issubdtype(p.dtype, jnp.floating) and p.dtype != wide else p, params
    )


def reference_value_and_grad(
    build_loss: LossBuilder, compute_dtype=None, has_aux: bool = False, microbatches=None
):
    """fn(params, batch) -> (loss, grads) of the unsharded model (run it under jit on one device);
    ``has_aux``: the loss returns (loss, aux) (a mixture of experts' routing statistics);
    ``microbatches`` (S, M): the mean of M micro-batches' (``mean_of_microbatches``)."""
    apply = hk.without_apply_rng(hk.transform(build_loss(Parallel()))).apply
    fn = jax.value_and_grad(with_compute_dtype(apply, compute_dtype), has_aux=has_aux)
    return fn if microbatches is None else mean_of_microbatches(fn, *microbatches)


def mean_of_microbatches(fn, shards: int, m: int):
    """fn(params, batch) -> the mean of ``fn`` over the M micro-batches a pipeline makes of ``batch``:
    its rows are split over S row shards, each shard's rows into M (``parallel.pipeline_engines``), so
    micro-batch j is the j-th M-th of every shard's rows. For a step whose values depend on its
    micro-batches (``--quant int8`` under pp: each micro-batch's weight-gradient scales are its own);
    the pipeline's loss is the mean of its micro-batches' (``Pipeline.loss_scale``)."""

    def split(a):  # [B, ...] -> [M, B / M, ...]
        return a.reshape(shards, m, -1, *a.shape[1:]).swapaxes(0, 1).reshape(m, -1, *a.shape[1:])

    def mean(params, batch):
        each = lax.map(lambda part: fn(params, part), jax.tree.map(split, batch))
        return jax.tree.map(lambda a: jnp.mean(a, 0), each)

    return mean


def _dp_varying(apply, specs, batch_axes: tuple[str, ...] = (DP,)):
    """Cast every parameter to DP-varying once, at entry. Left implicit, JAX casts each weight where
    it meets the (DP-varying) batch -- inside the layer loop -- so the forward saves a stacked copy of
    every layer's weights and the backward all-reduces the DP gradient once per layer. The transpose of
    this one cast is the single data-parallel gradient all-reduce. Parameters stored split over DP
    (FSDP) are DP-varying already: their gradients are reduce-scattered where they are gathered. With
    context parallelism parameters are cast to CP-varying too: one all-reduce over every axis the
    batch's tokens are split over (``batch_axes``: ``Layout.batch_axes``). Experts split over EP are
    EP-varying already: their gradients come home through the all-to-all's transpose, and are summed
    over the data shards outside ep (DP) by this cast's."""

    def cast(p, spec):
        axes = tuple(a for a in batch_axes if a not in spec_axes(spec))
        return lax.pcast(p, axes, to="varying") if axes else p

    def wrapped(params, batch):
        return apply(jax.tree.map(cast, params, specs, is_leaf=lambda x: isinstance(x, P)), batch)

    return wrapped


def sharded_value_and_grad(
    build_loss: LossBuilder, layout: Layout, specs, par_cls=Parallel, compute_dtype=None, has_aux=False
):
    """fn(params, batch) -> (loss, grads) on the layout's mesh: params laid out by ``specs``, batch rows
    over DP (``layout.sp``: activations between blocks split over the sequence on MP).

    Inputs: global arrays. Outputs: the loss (replicated) and gradients in the parameters' layout; with
    ``has_aux`` the loss function returns (loss, aux), aux replicated (e.g. summed over the batch), and
    fn returns ((loss, aux), grads).

    On a mesh of one device every collective is over axes of size 1, an identity, yet XLA keeps the
    all-reduces ``shard_map``'s transposes put in (the gradients' data-parallel sum among them), each
    with a second buffer of what it sums: there the loss runs unsharded (``par_cls()``, no mesh axis),
    the program ``reference_value_and_grad`` runs. scripts/step_memory.py: llama-100m batch 1 x 16 on
    CPU, temporaries 630 MB through ``shard_map``, 490 MB (plain JAX's) without.
    """
    if layout.mesh.size == 1:
        apply = hk.without_apply_rng(hk.transform(build_loss(par_cls()))).apply
        return jax.value_and_grad(with_compute_dtype(apply, compute_dtype), has_aux=has_aux)
    apply = hk.without_apply_rng(hk.transform(build_loss(par_cls.on(layout)))).apply
    loss = _dp_varying(with_compute_dtype(apply, compute_dtype), specs, layout.batch_axes)
    body = jax.value_and_grad(loss, has_aux=has_aux)
    value = (P(), P()) if has_aux else P()
    return jax.shard_map(
        body, mesh=layout.mesh, in_specs=(specs, batch_spec(layout)), out_specs=(value, specs)
    )


def sharded_loss(build_loss: LossBuilder, layout: Layout, specs, compute_dtype=None):
    """fn(params, batch) -> loss on the layout's mesh (evaluation: no gradients)."""
    apply = hk.without_apply_rng(hk.transform(build_loss(Parallel.on(layout)))).apply
    return jax.shard_map(
        with_compute_dtype(apply, compute_dtype),
        mesh=layout.mesh,
        in_specs=(specs, batch_spec(layout)),
        out_specs=P(),
    )
