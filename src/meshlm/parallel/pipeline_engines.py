"""The pipeline's two engines, run inside ``jax.shard_map`` by ``meshlm.parallel.pipeline``.

``gpipe``: a scan over the forward ticks, differentiated by JAX. ``one_f_one_b`` (1F1B and interleaved):
three scans -- forward-only warm-up, forward-and-backward ticks, backward-only drain -- each tick running
one forward slot and one backward slot (``pipeline_schedule`` says which) with per-chunk VJPs, the
forward's residuals kept until the backward (``pipeline_stash``). Every buffer starts as ``pipe.fill``
and every bubble slot is masked through ``pipe.mask``; 1F1B's also skip their chunk (``lax.cond``). Per
tick besides the chunk's work: two ``ppermute``s, one ring slot written and read, the gradient's add.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from meshlm.parallel import pipeline_ops as ops
from meshlm.parallel import pipeline_stats as stats_of
from meshlm.parallel.axes import CP, DP, EP, PP
from meshlm.parallel.pipeline_schedule import PipelineConfig, backward_slot, forward_counter, forward_slot
from meshlm.parallel.pipeline_stash import residuals


# --- what both engines run ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Job:
    stage_fn: object
    loss_fn: object
    pipe: object  # a meshlm.parallel.pipeline.Pipeline
    has_dp: bool  # the mesh has a dp axis (the batch's rows are split over it)
    n_dp: int  # dp shards (1 without a dp axis)
    embed_fn: object = None  # embed(embed_params, inputs) -> x on the first stage; None: x is the input
    n_cp: int = 1  # cp shards (context parallelism: each holds its part of every row's sequence)
    with_aux: bool = False  # stage_fn(params, x, aux) with each micro-batch's rows of ``aux``
    n_ep: int = 1  # ep shards (experts split over them; part of the data shards: n_dp counts them)
    stats_loss: object = None  # stats [L, ...] -> scalar: chunks return (y, stats) (``pipeline_stats``)
    stats_sum: object = None  # stats [L, ...] -> summed over the batch's shards: also return the step's
    head_aux: bool = False  # loss_fn returns (loss, metrics): the step's mean of them is returned too

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The axes the batch's tokens are split over: the loss is a mean over them."""
        on = ((DP, self.has_dp), (EP, self.n_ep > 1), (CP, self.n_cp > 1))
        return tuple(axis for axis, split in on if split)

    @property
    def axes(self) -> tuple[str, ...]:
        """The axes activations vary over (parameters are cast to them at entry; the casts' transposes
        sum the gradients over them)."""
        return (PP, *self.batch_axes)

    @property
    def batch_shards(self) -> int:
        """Shards of each micro-batch's tokens: dp x cp."""
        return self.n_dp * self.n_cp

    @property
    def skips_bubbles(self) -> bool:
        """Whether a 1F1B bubble slot skips its chunk (``lax.cond``). Not with cp: its chunks pass K/V
        with ``ppermute``, and XLA:CPU's collective-permute waits for every device of the program, so
        one inside a branch another stage does not take would deadlock; there bubbles run masked."""
        return self.n_cp == 1

    def stage(self, params, x, aux):
        """The chunk on micro-batch activations ``x`` (with ``with_aux`` and its rows of ``aux``)."""
        return self.stage_fn(params, x, aux) if self.with_aux else self.stage_fn(params, x)


def _head_loss(job: Job, with_head: bool):
    """loss_fn as loss(head, y, targets) -> (loss, metrics) either way (metrics: () without
    ``head_aux``)."""
    fn = job.loss_fn if with_head else (lambda head, y, targets: job.loss_fn(y, targets))
    return fn if job.head_aux else (lambda head, y, targets: (fn(head, y, targets), ()))


def _split(job: Job, params, x, targets, aux=()):
    """This device's chunks [V, c, ...] and its rows (inputs, targets, aux) as [M, rows/M, ...]."""
    m = job.pipe.config.microbatches
    split = lambda a: a.reshape(m, a.shape[0] // m, *a.shape[1:])
    rows = (split(x), *(jax.tree.map(split, t) for t in (targets, aux)))
    return jax.tree.map(lambda a: a[0], params), *rows


def _on_last_stage(job: Job, fn, *args, where=True):
    """``fn(*args)`` on the last stage (and ``where``), zeros of its types elsewhere: the head (final
    norm, output projection, loss) runs where it counts instead of masked on every stage and tick."""
    return ops.only_if((lax.axis_index(PP) == job.pipe.config.pp - 1) & where, fn, *args)


def _unless_bubble(job: Job, valid, fn, skipped, *args):
    """``fn(*args)``, or ``skipped(*args)`` in a bubble slot (``pipe.runs``) where ``skips_bubbles``."""
    return lax.cond(job.pipe.runs(valid), fn, skipped, *args) if job.skips_bubbles else fn(*args)


def _enter(job: Job, embed, xs, m):
    """Micro-batch m as the first chunk takes it: the input's rows, or with ``embed_fn`` their embedding
    (computed on the first chunk's forward slot only, so no whole-batch activation exists)."""
    if job.embed_fn is None:
        return xs[m]
    return job.embed_fn(embed, xs[m])


def _activation(job: Job, embed, xs, fill):
    """A micro-batch activation's buffer filled with ``fill``, typed as the chunks pass it (with sequence
    parallelism varying over mp too)."""
    s = jax.eval_shape(partial(_enter, job), embed, xs, 0)
    return ops.vary(jnp.full(s.shape, fill, s.dtype), tuple(sorted(set(job.axes) | set(ops.type_axes(s)))))


def _ends(cfg: PipelineConfig, d, j):
    """(first chunk, last chunk) of the pipeline: device 0's j = 0, device pp-1's j = V-1."""
    return (d == 0) & (j == 0), (d == cfg.pp - 1) & (j == cfg.virtual_stages - 1)


def _at(tree, m):
    return jax.tree.map(lambda a: a[m], tree)


def _reduce_loss(job: Job, local):
    """The step's loss (or a tree of head metrics): the last stage's, a mean over the batch's shards (dp,
    and cp: each shard holds as many tokens, so the mean over every token)."""
    loss = jax.tree.map(lambda a: lax.psum(a, PP), local)
    return jax.tree.map(lambda a: lax.pmean(a, job.batch_axes), loss) if job.batch_axes else loss


def _metric_mean(job: Job, metrics):
    """One micro-batch's head metrics as their share of the step's mean (1/M: not the loss's scale, a
    hook the controls change), outside the gradient."""
    return jax.tree.map(lambda a: lax.stop_gradient(a) / job.pipe.config.microbatches, metrics)


def _forward_input(job: Job, embed, xs, recv, t, d):
    """The forward slot at tick t: (valid, micro-batch (clipped), virtual stage, masked chunk input)."""
    cfg = job.pipe.config
    valid, m, j = forward_slot(cfg, t, d)
    m = jnp.clip(m, 0, cfg.microbatches - 1)
    first, _ = _ends(cfg, d, j)
    entered = ops.only_if(first & valid, partial(_enter, job), embed, xs, m) if job.embed_fn else xs[m]
    return valid, m, j, job.pipe.mask(valid, jnp.where(first, entered, recv))


# --- GPipe: the forward loop, differentiated by JAX ---------------------------------------------------------
def gpipe(job: Job, params, head, embed, x, targets, aux, *, with_head: bool):
    """(loss, (param grads, the input's gradient -- with ``embed_fn`` the embedding's --, head grads))."""
    params, xs, tgs, auxs = _split(job, params, x, targets, aux)
    loss_fn = partial(_gpipe_loss, job, _head_loss(job, with_head), tgs, auxs)
    grad_fn = partial(jax.value_and_grad, argnums=(0, 1, 2), has_aux=True)  # aux: the step's statistics
    if job.embed_fn is not None:
        (loss, aux), (gp, gh, ge) = grad_fn(loss_fn)(params, head, embed, xs)
        return stats_of.value(job, loss, *aux), (jax.tree.map(lambda g: g[None], gp), ge, gh)
    run = lambda params, head, xs: loss_fn(params, head, (), xs)
    (loss, aux), (gp, gh, gx) = grad_fn(run)(params, head, xs)
    grads = (jax.tree.map(lambda g: g[None], gp), gx.reshape(-1, *gx.shape[2:]), gh)
    return stats_of.value(job, loss, *aux), grads


def _gpipe_loss(job: Job, head_loss, tgs, auxs, params, head, embed, xs):
    pipe, cfg = job.pipe, job.pipe.config
    # One cast at entry each: the transposes are the one data-parallel sum of the gradients (and for the
    # replicated head and embedding, the sum over stages, all zero but one).
    params, head, embed = (ops.vary(tree, job.axes) for tree in (params, head, embed))
    outputs, acc = _forward_ticks(job, params, embed, xs, auxs, keep_outputs=True)

    def losses(head, outputs):
        each, metrics = jax.vmap(head_loss, in_axes=(None, 0, 0))(head, outputs, tgs)  # [M], [M, ...]
        each = jnp.where(pipe.keeps_grad(jnp.arange(cfg.microbatches)), each, lax.stop_gradient(each))
        return pipe.loss_scale() * jnp.sum(each), jax.tree.map(lambda a: a.sum(0), _metric_mean(job, metrics))

    loss, metrics = _reduce_loss(job, _on_last_stage(job, losses, head, outputs))
    if acc is None:
        return loss, (None, metrics)
    return loss + stats_of.loss(job, acc, ops.vary), (stats_of.step_stats(job, acc), metrics)


def _forward_ticks(job: Job, params, embed, xs, auxs, *, keep_outputs: bool):
    """The forward ticks: (the last chunk's output of each micro-batch [M, ...] (None unless
    ``keep_outputs``), the chunks' statistics accumulated (``pipeline_stats``; None without))."""
    pipe, cfg = job.pipe, job.pipe.config
    d = lax.axis_index(PP)
    fill = _activation(job, embed, xs, pipe.fill)

    def tick(carry, t):
        recv, outputs, acc = carry
        valid, m, j, inp = _forward_input(job, embed, xs, recv, t, d)
        y, stats = stats_of.split(job, job.stage(ops.chunk(params, j), inp, _at(auxs, m)))
        if keep_outputs:
            _, last = _ends(cfg, d, j)
            outputs = outputs.at[m].set(jnp.where(valid & last, y, outputs[m]))
        if acc is not None:
            acc = stats_of.place(job, acc, stats, valid, d, j)
        return (pipe.send_forward(jnp.where(valid, y, fill)), outputs, acc), None

    outputs = None
    if keep_outputs:
        outputs = ops.vary(jnp.zeros((cfg.microbatches, *fill.shape), fill.dtype), tuple(ops.varying(fill)))
    acc = None
    if job.stats_loss is not None:  # typed as the chunks' statistics (and the accumulation makes it)
        _, s = jax.eval_shape(job.stage, ops.chunk(params, 0), fill, ops.vary(_at(auxs, 0), (PP,)))
        acc = stats_of.empty(job, s, ops.vary, tuple(sorted(set(job.axes) | set(ops.type_axes(s)))))
    (_, outputs, acc), _ = lax.scan(tick, (fill, outputs, acc), jnp.arange(cfg.forward_ticks))
    return outputs, acc


# --- 1F1B and interleaved: an explicit schedule with per-chunk VJPs ----------------------------------------
def one_f_one_b(job: Job, params, head, embed, x, targets, aux, *, with_head: bool):
    """(loss, (param grads, the input's gradient -- with ``embed_fn`` the embedding's --, head grads))."""
    pipe, cfg = job.pipe, job.pipe.config
    params, xs, tgs, auxs = _split(job, params, x, targets, aux)
    entry = params, head, embed
    params, head, embed = (ops.vary(tree, job.axes) for tree in entry)
    head_loss = _head_loss(job, with_head)
    fill = _activation(job, embed, xs, pipe.fill)
    loss_type, metrics_type = jax.eval_shape(head_loss, head, fill, _at(tgs, 0))
    # aux rows typed as a forward slot reads them (indexed by a micro-batch that depends on the stage): a
    # fault varying them over mp (a control) must give the traced VJP the schedule's structure
    kept = residuals(job.stage, ops.chunk, params, fill, ops.vary(_at(auxs, 0), (PP,)))
    state = {
        "recv_x": fill,
        "recv_ct": fill,
        "stash": kept.empty(cfg.stash_slots, pipe.fill, lambda a, s: ops.vary(a, ops.type_axes(s))),
        **ops.vary(
            {
                "grads": jax.tree.map(jnp.zeros_like, params),
                "head_grads": jax.tree.map(jnp.zeros_like, head),
                "entry_grads": jax.tree.map(jnp.zeros_like, embed if job.embed_fn else xs),
                "loss": jnp.zeros((), loss_type.dtype),
                "metrics": jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), metrics_type),
            },
            job.axes,
        ),
    }
    stats_loss, seeds, acc = 0.0, None, None
    if job.stats_loss is not None:  # the step's statistics first: their loss and each chunk's cotangent
        acc = _forward_ticks(job, params, embed, xs, auxs, keep_outputs=False)[1]
        stats_loss, seeds = stats_of.loss_and_seeds(job, acc, ops.vary)
    warm, both = cfg.chunks - 1, cfg.forward_ticks  # ticks [0, warm) forward only, [both, end) backward only
    phases = ((0, warm, True, False), (warm, both, True, True), (both, both + warm, False, True))
    for lo, hi, do_f, do_b in phases:
        model = (params, head, embed, head_loss, kept, seeds)
        tick = partial(_tick, job, model, xs, (tgs, auxs), do_f, do_b)
        state, _ = lax.scan(tick, state, jnp.arange(lo, hi))
    grads = ops.sum_where_cast(state["grads"], entry[0], job.axes)
    head_grads = ops.sum_where_cast(state["head_grads"], entry[1], job.axes)  # from the last stage
    if job.embed_fn is None:
        entry_grads = lax.psum(state["entry_grads"], PP).reshape(x.shape)  # written on device 0 only
    else:
        entry_grads = ops.sum_where_cast(state["entry_grads"], entry[2], job.axes)  # from the first stage
    loss = _reduce_loss(job, state["loss"]) + stats_loss
    stats = None if acc is None else stats_of.step_stats(job, acc)
    value = stats_of.value(job, loss, stats, _reduce_loss(job, state["metrics"]))
    return value, (jax.tree.map(lambda g: g[None], grads), entry_grads, head_grads)


def _tick(job: Job, model, xs, rows, do_f: bool, do_b: bool, state, t):
    pipe, (tgs, auxs) = job.pipe, rows
    params, head, embed, head_loss, kept, seeds = model
    d = lax.axis_index(PP)
    state = dict(state)
    ct_loss = jnp.zeros_like(state["recv_ct"])
    if do_f:
        valid, m, j, inp = _forward_input(job, embed, xs, state["recv_x"], t, d)
        stage = lambda p, x: job.stage(p, x, _at(auxs, m))  # this micro-batch's aux rows

        def forward(params, inp):  # its residuals kept until the backward; the chunk sliced in the branch
            y, vjp = jax.vjp(stage, ops.chunk(params, j), inp)
            return y, kept.split(vjp)

        y, leaves = _unless_bubble(job, valid, forward, partial(ops.zeros_of, forward), params, inp)
        y, _ = stats_of.split(job, y)  # the statistics' value came from the statistics pass
        slot = (t - d) % pipe.config.stash_slots
        new = zip(state["stash"], leaves, strict=True)
        state["stash"] = [buf.at[slot].set(jnp.where(valid, r, buf[slot])) for buf, r in new]
        if do_b:  # the last chunk runs a micro-batch's backward in the tick of its forward
            last = valid & _ends(pipe.config, d, j)[1]
            ct_loss = _loss_grad(job, state, (head, head_loss), y, _at(tgs, m), last, m)
        send_x = jnp.where(valid, y, pipe.fill)
    if do_b:
        send_ct = _backward(job, (params, embed, kept, seeds), xs, state, t, d, ct_loss)
    if do_f:
        state["recv_x"] = pipe.send_forward(send_x)
    if do_b:
        state["recv_ct"] = pipe.send_backward(send_ct)
    return state, None


def _loss_grad(job: Job, state, head, y, targets, last, m):
    """Add micro-batch m's loss (on the last chunk) to the state, and its gradient w.r.t. the head; return
    the cotangent it seeds."""
    pipe, (head, head_loss) = job.pipe, head
    value_and_grad = jax.value_and_grad(head_loss, argnums=(0, 1), has_aux=True)
    (value, metrics), (gh, ct) = _on_last_stage(job, value_and_grad, head, y, targets, where=last)
    state["loss"] = state["loss"] + jnp.where(last, pipe.loss_scale() * value, 0.0)
    add = lambda acc, v: acc + jnp.where(last, v, jnp.zeros_like(v))
    state["metrics"] = jax.tree.map(add, state["metrics"], _metric_mean(job, metrics))
    keep = last & pipe.keeps_grad(m)
    scale = pipe.loss_scale() / job.batch_shards  # the gradient of the mean over micro-batches, dp and cp
    state["head_grads"] = jax.tree.map(
        lambda acc, g: acc + jnp.where(keep, scale * g, jnp.zeros_like(g)), state["head_grads"], gh
    )
    return jnp.where(keep, scale * ct, jnp.zeros_like(ct))


def _backward(job: Job, model, xs, state, t, d, ct_loss):
    """The backward slot at tick t: the chunk's VJP rebuilt from the residuals its forward slot kept (on
    the first chunk also the embedding's), its gradients added to the accumulators; returns what to send
    back. A bubble's is skipped (its residuals are ``fill``, NaN in the proof; with ``runs`` overridden
    every value derived from them is still masked)."""
    pipe, cfg = job.pipe, job.pipe.config
    params, embed, kept, seeds = model
    valid, m, j = backward_slot(cfg, t, d)
    m = jnp.clip(m, 0, cfg.microbatches - 1)
    first, last = _ends(cfg, d, j)
    slot = forward_counter(cfg, m, j) % cfg.stash_slots
    ct = pipe.mask(valid, jnp.where(last, ct_loss, state["recv_ct"]))
    if seeds is not None:  # the chunk's statistics' cotangent beside its output's
        ct = (ct, pipe.mask(valid, seeds[stats_of.chunk_of(job, d, j)]))

    def backward(params, stash, ct, grads):  # the chunk, its residuals and accumulators taken in the branch
        gp, gx = kept.rebuild(params, j, ops.chunk(params, j), [buf[slot] for buf in stash])(ct)
        return jax.tree.map(lambda acc, g: ops.add_at(acc, j, pipe.mask(valid, g)), grads, gp), gx

    # a bubble: nothing computed or added
    skipped = lambda *args: (args[-1], ops.zeros_of(backward, *args)[1])
    operands = params, state["stash"], ct, state["grads"]
    state["grads"], gx = _unless_bubble(job, valid, backward, skipped, *operands)
    if job.embed_fn is None:
        acc = state["entry_grads"]
        state["entry_grads"] = acc.at[m].set(jnp.where(valid & first, gx, acc[m]))
    else:
        ge = ops.only_if(valid & first, partial(_embed_grad, job), embed, xs, m, gx)
        state["entry_grads"] = jax.tree.map(jnp.add, state["entry_grads"], ge)
    return jnp.where(valid, gx, pipe.fill)


def _embed_grad(job: Job, embed, xs, m, ct):
    """The embedding's gradient from micro-batch m's first-chunk input cotangent."""
    _, vjp = jax.vjp(lambda e: _enter(job, e, xs, m), embed)
    return vjp(ct)[0]
