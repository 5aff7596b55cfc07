"""Per-layer statistics out of the pipeline's stages (a mixture of experts' routing statistics), and the
loss formed from them over the whole step.

With ``stats_loss`` (``pipeline_value_and_grad``) a chunk returns ``(y, stats)``, ``stats`` [c, ...] one
row per layer of the chunk, of this shard's tokens of one micro-batch. The step's loss gains
``stats_loss(S)``, ``S`` [L, ...] the statistics of every micro-batch, each layer at its place in the
whole stack (chunk ``k``'s layers are rows ``k c .. k c + c - 1``), summed over the stages; the hook sums
them over the batch's shards itself (the model's ``Parallel.moe_sum``), so a nonlinear loss of them (the
load-balancing loss) is the unsharded model's: nothing is formed per micro-batch, stage or shard.

Gradients: GPipe's forward is differentiated by JAX, so ``S`` is accumulated in its scan and the loss
added after it. 1F1B runs a micro-batch's backward before later micro-batches' forwards, when ``S`` is
not yet known, so it runs the forward ticks once first for the statistics alone (no residuals kept:
one more forward of the step, the price of exactness), takes ``g = dstats_loss / dS`` there, and each
backward slot seeds its chunk's VJP with ``g``'s rows of that chunk beside the activations' cotangent.
Per device (inside ``shard_map``) the accumulator is [pp V, c, ...]: every chunk's slot, filled by the
chunks this device holds, summed over ``pp`` at the end. With ``stats_sum`` the engine also returns the
step's statistics summed over the stages and the batch (``step_stats``): the train step's routing metrics,
values the loss computed anyway (1F1B's statistics pass, GPipe's forward).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from meshlm.parallel.axes import PP


def split(job, out):
    """A chunk's output as (y, stats): stats None without ``stats_loss``."""
    return out if job.stats_loss is not None else (out, None)


def empty(job, stats_type, vary, axes):
    """Zeros [pp V, c, ...] typed as the stats of every chunk (varying over ``axes`` too: the pipeline's
    and the batch's, as the accumulations make them)."""
    zeros = jnp.zeros((job.pipe.config.chunks, *stats_type.shape), stats_type.dtype)
    return vary(zeros, axes)


def chunk_of(job, d, j):
    """The chunk device ``d`` holds as virtual stage ``j`` (``Pipeline.chunk_ids``), traced."""
    return jnp.asarray(job.pipe.chunk_ids())[d, j]


def place(job, acc, stats, valid, d, j):
    """``acc`` with a forward slot's ``stats`` added at its chunk's rows (nothing from a bubble)."""
    return acc.at[chunk_of(job, d, j)].add(jnp.where(valid, stats, jnp.zeros_like(stats)))


def total(acc):
    """[L, ...]: the accumulations summed over the stages, in the stack's layer order."""
    summed = lax.psum(acc, PP)
    return summed.reshape(-1, *summed.shape[2:])


def loss(job, acc, vary):
    """``stats_loss`` of the step's statistics, averaged over the batch's shards: the same value on each
    (the hook sums the statistics over them), unless a fault leaves a shard's own, which the mean then
    shows as the value it is, as ``Parallel.batch_mean`` does without pp. (``vary``: the engine's cast
    to varying over axes, so that the mean takes one type.)"""
    value = job.stats_loss(total(acc))
    return lax.pmean(vary(value, job.batch_axes), job.batch_axes) if job.batch_axes else value


def step_stats(job, acc):
    """The step's statistics [L, ...] summed over the stages and, with ``stats_sum`` (the model's
    ``Parallel.moe_sum``), over the batch's shards: the train step's routing metrics (not differentiated:
    the loss holds them through ``stats_loss`` alone). None without ``stats_sum``."""
    return None if job.stats_sum is None else lax.stop_gradient(job.stats_sum(total(acc)))


def value(job, loss, stats, metrics=()):
    """What the engine returns as the step's value: the loss, or with ``stats_sum`` (loss, the step's
    statistics), as ``jax.value_and_grad(..., has_aux=True)`` does; with ``head_aux`` (loss, (the
    step's statistics or None, the head's metrics: their mean over the step))."""
    if job.head_aux:
        return loss, (stats, metrics)
    return loss if job.stats_sum is None else (loss, stats)


def loss_and_seeds(job, acc, vary):
    """(``loss``, its gradient w.r.t. each chunk's stats [pp V, c, ...]): the cotangent 1F1B's backward
    slots seed their chunk's stats output with."""
    return jax.value_and_grad(lambda a: loss(job, a, vary))(acc)


def stats_pass_permutes(cfg) -> int:
    """The ``ppermute``s the statistics pass adds to a step (``cfg``: a ``PipelineConfig``): 1F1B's
    forward-only pass over the V M + pp - 1 ticks, one each; none under GPipe (its one forward)."""
    return 0 if cfg.schedule == "gpipe" else cfg.forward_ticks
