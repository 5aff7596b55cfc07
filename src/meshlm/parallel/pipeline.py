"""Pipeline parallelism over the ``pp`` mesh axis: GPipe, 1F1B and interleaved 1F1B, generic over a stage.

The caller supplies
  ``stage_fn(stage_params, x) -> y``: one chunk of consecutive layers, its parameters stacked on a leading
      layer dimension (any chunk length: the sequential reference runs all layers as one chunk); ``y`` has
      ``x``'s shape and dtype;
  ``loss_fn(y, targets) -> scalar``: the last stage's loss of one micro-batch, a mean over its rows (so the
      mean of the M micro-batch losses is the batch's loss).
``pipeline_value_and_grad(...)(params, x, targets)`` returns ``(loss, (param_grads, x_grad))`` like
``jax.value_and_grad`` of the sequential model; ``x_grad`` lets a first-stage embedding be chained (its
VJP applied to ``x_grad``), and a head can be folded into ``loss_fn``.

Everything runs in one ``jax.shard_map(check_vma=True)`` over ``pp`` (optionally ``pp x dp``, the batch
split over ``dp``). Chunk ``k = j * pp + d`` of the layer stack lives on device ``d`` as virtual stage
``j`` (``pipeline_schedule`` has the tick formulas). Activations go one stage on and cotangents one back
with ``lax.ppermute`` once per tick.

* GPipe: a scan over the forward ticks, differentiated by JAX: its residuals, all M micro-batches', live
  until the backward.
* 1F1B and interleaved: an explicit schedule. Each tick runs one forward slot and one backward slot; the
  backward re-runs the chunk from its stashed input under ``jax.vjp`` (so only stage inputs are kept,
  a ring of ``2 pp V - 1``: memory flat in M), seeded on the last chunk by the loss's gradient.

Bubbles: every device computes every tick (SPMD). A slot with no micro-batch is *masked*: its input is
zeroed before the chunk runs, its gradient contributions are zeroed, and what it sends on is ``fill``.
Tests set ``fill`` to NaN: a result that is finite and exact shows that no bubble reaches it.
Controls (``meshlm.proof.pipeline_controls``) override one hook of ``Pipeline`` each.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from meshlm.errors import ConfigError, MeshError
from meshlm.parallel.axes import DP, PP
from meshlm.parallel.pipeline_schedule import (
    PipelineConfig,
    backward_slot,
    check_batch,
    check_layers,
    forward_counter,
    forward_slot,
)


@dataclass(frozen=True)
class Pipeline:
    """A schedule and the engine's hooks (each control overrides one)."""

    config: PipelineConfig
    fill: float = 0.0  # what bubbles send and buffers start as (NaN in tests: it must never leak)

    def hops(self) -> list[tuple[int, int]]:
        """(source, destination) device pairs one stage on: d -> d + 1, and with virtual stages also
        pp - 1 -> 0 (into the next virtual stage)."""
        p = self.config.pp
        ring = self.config.virtual_stages > 1
        return [(i, (i + 1) % p) for i in range(p if ring else p - 1)]

    def send_forward(self, x):
        """Activations one stage on (a device no one sends to receives zeros: device 0, which reads its
        micro-batches from the input instead)."""
        return lax.ppermute(x, PP, self.hops())

    def send_backward(self, ct):
        """Cotangents one stage back: the forward hops reversed."""
        return lax.ppermute(ct, PP, [(b, a) for a, b in self.hops()])

    def mask(self, valid, x):
        """A bubble's value replaced by zeros (stage inputs, cotangents, gradient contributions)."""
        return jnp.where(valid, x, jnp.zeros_like(x))

    def loss_scale(self):
        """The step's loss is the mean of the micro-batch losses."""
        return 1.0 / self.config.microbatches

    def keeps_grad(self, m):
        """Whether micro-batch ``m``'s loss contributes gradients (always)."""
        return jnp.ones_like(m, dtype=bool)

    def chunk_ids(self) -> np.ndarray:
        """[pp, V]: the chunk of layers device d holds as virtual stage j: j * pp + d."""
        c = self.config
        return np.arange(c.chunks).reshape(c.virtual_stages, c.pp).T


# --- layout: the stacked layer dimension <-> [pp, V, layers per chunk] ------------------------------------
def to_stages(pipe: Pipeline, params):
    """Leaves [L, ...] -> [pp, V, L / (pp V), ...] by ``chunk_ids`` (a reshape when V = 1)."""
    ids, n = pipe.chunk_ids(), pipe.config.chunks

    def one(a):
        chunks = a.reshape(n, a.shape[0] // n, *a.shape[1:])
        if np.array_equal(ids.ravel(), np.arange(n)):
            return chunks.reshape(*ids.shape, *chunks.shape[1:])
        return chunks[ids]

    return jax.tree.map(one, params)


def from_stages(pipe: Pipeline, staged):
    """The inverse of ``to_stages``: [pp, V, c, ...] -> [L, ...]."""
    ids = pipe.chunk_ids().ravel()
    order = np.argsort(ids)

    def one(a):
        flat = a.reshape(ids.size, *a.shape[2:])
        flat = flat if np.array_equal(order, np.arange(ids.size)) else flat[order]
        return flat.reshape(-1, *flat.shape[2:])

    return jax.tree.map(one, staged)


def sequential_value_and_grad(stage_fn, loss_fn):
    """The reference: fn(params, x, targets) -> (loss, (param_grads, x_grad)), all layers as one chunk on
    the whole batch."""

    def loss(params, x, targets):
        return loss_fn(stage_fn(params, x), targets)

    return jax.value_and_grad(loss, argnums=(0, 1))


# --- the engine -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Job:
    stage_fn: object
    loss_fn: object
    pipe: Pipeline
    has_dp: bool  # the mesh has a dp axis (the batch's rows are split over it)
    n_dp: int  # dp shards (1 without a dp axis)

    @property
    def axes(self) -> tuple[str, ...]:
        """The axes activations vary over."""
        return (PP, DP) if self.has_dp else (PP,)


def pipeline_value_and_grad(stage_fn, loss_fn, mesh, pipe: Pipeline):
    """fn(params, x, targets) -> (loss, (param_grads, x_grad)) on ``mesh`` (axes pp, or pp and dp), with
    params' leaves stacked [L, ...] and x, targets' leaves [B, ...] (rows split over dp). Jit it."""
    cfg = pipe.config
    names = tuple(mesh.axis_names)
    if PP not in names or set(names) - {PP, DP}:
        raise MeshError(f"the pipeline needs a mesh with axes ('{PP}',) or ('{PP}', '{DP}'), got {names}")
    if mesh.shape[PP] != cfg.pp:
        raise MeshError(f"the mesh's {PP} axis has {mesh.shape[PP]} devices but pp={cfg.pp}; make them equal")
    has_dp = DP in names
    job = _Job(stage_fn, loss_fn, pipe, has_dp, mesh.shape[DP] if has_dp else 1)
    data = P(DP) if has_dp else P()
    body = partial(_gpipe if cfg.schedule == "gpipe" else _one_f_one_b, job)

    def run(params, x, targets):
        layers = {a.shape[0] for a in jax.tree.leaves(params)}
        if len(layers) != 1:
            raise ConfigError(f"stacked layer parameters disagree on the layer count: {sorted(layers)}")
        check_layers(cfg, layers.pop())
        check_batch(cfg, x.shape[0], job.n_dp)
        staged = to_stages(pipe, params)
        specs = jax.tree.map(lambda _: P(PP), staged)
        fn = jax.shard_map(
            body, mesh=mesh, in_specs=(specs, data, data), out_specs=(P(), (specs, data)), check_vma=True
        )
        loss, (grads, dx) = fn(staged, x, targets)
        return loss, (from_stages(pipe, grads), dx)

    return run


def _vary(tree, axes):
    """Mark values varying over ``axes`` (scan carries must keep one type across ticks)."""

    def one(a):
        aval = jax.typeof(a)
        varying = aval.vma if hasattr(aval, "vma") else aval.mat.varying  # the name moved across JAX versions
        missing = tuple(ax for ax in axes if ax not in varying)
        return lax.pcast(a, missing, to="varying") if missing else a

    return jax.tree.map(one, tree)


def _split(job: _Job, params, x, targets):
    """This device's chunks [V, c, ...] and its rows as [M, rows / M, ...] micro-batches."""
    m = job.pipe.config.microbatches
    split = lambda a: a.reshape(m, a.shape[0] // m, *a.shape[1:])
    return jax.tree.map(lambda a: a[0], params), split(x), jax.tree.map(split, targets)


def _chunk(params, j):
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, j, 0, keepdims=False), params)


def _ends(cfg: PipelineConfig, d, j):
    """(first chunk, last chunk) of the pipeline: device 0's j = 0, device pp-1's j = V-1."""
    return (d == 0) & (j == 0), (d == cfg.pp - 1) & (j == cfg.virtual_stages - 1)


def _at(tree, m):
    return jax.tree.map(lambda a: a[m], tree)


def _reduce_loss(job: _Job, local):
    loss = lax.psum(local, PP)
    return lax.pmean(loss, DP) if job.has_dp else loss


def _forward_input(job: _Job, xs, recv, t, d):
    """The forward slot at tick t: (valid, micro-batch (clipped), virtual stage, masked chunk input)."""
    cfg = job.pipe.config
    valid, m, j = forward_slot(cfg, t, d)
    m = jnp.clip(m, 0, cfg.microbatches - 1)
    first, _ = _ends(cfg, d, j)
    return valid, m, j, job.pipe.mask(valid, jnp.where(first, xs[m], recv))


# --- GPipe: the forward loop, differentiated by JAX ---------------------------------------------------------
def _gpipe(job: _Job, params, x, targets):
    params, xs, tgs = _split(job, params, x, targets)
    (loss, (gp, gx)) = jax.value_and_grad(partial(_gpipe_loss, job, tgs), argnums=(0, 1))(params, xs)
    return loss, (jax.tree.map(lambda g: g[None], gp), gx.reshape(-1, *gx.shape[2:]))


def _gpipe_loss(job: _Job, tgs, params, xs):
    pipe, cfg = job.pipe, job.pipe.config
    if job.has_dp:  # one cast at entry: its transpose is the one data-parallel gradient sum
        params = jax.tree.map(lambda a: lax.pcast(a, DP, to="varying"), params)
    d = lax.axis_index(PP)
    fill = _vary(jnp.full(xs.shape[1:], pipe.fill, xs.dtype), job.axes)

    def tick(carry, t):
        recv, outputs = carry
        valid, m, j, inp = _forward_input(job, xs, recv, t, d)
        y = job.stage_fn(_chunk(params, j), inp)
        _, last = _ends(cfg, d, j)
        outputs = outputs.at[m].set(jnp.where(valid & last, y, outputs[m]))
        return (pipe.send_forward(jnp.where(valid, y, fill)), outputs), None

    outputs = _vary(jnp.zeros(xs.shape, xs.dtype), job.axes)
    (_, outputs), _ = lax.scan(tick, (fill, outputs), jnp.arange(cfg.forward_ticks))
    losses = jax.vmap(job.loss_fn)(outputs, tgs)  # [M]; meaningful on the last device only
    losses = jnp.where(pipe.keeps_grad(jnp.arange(cfg.microbatches)), losses, lax.stop_gradient(losses))
    local = jnp.where(d == cfg.pp - 1, pipe.loss_scale() * jnp.sum(losses), 0.0)
    return _reduce_loss(job, local)


# --- 1F1B and interleaved: an explicit schedule with per-chunk VJPs ----------------------------------------
def _one_f_one_b(job: _Job, params, x, targets):
    pipe, cfg = job.pipe, job.pipe.config
    params, xs, tgs = _split(job, params, x, targets)
    if job.has_dp:
        params = jax.tree.map(lambda a: lax.pcast(a, DP, to="varying"), params)
    loss_type = jax.eval_shape(job.loss_fn, xs[0], _at(tgs, 0))
    fill = jnp.full(xs.shape[1:], pipe.fill, xs.dtype)
    state = _vary(
        {
            "recv_x": fill,
            "recv_ct": fill,
            "stash": jnp.full((cfg.stash_slots, *xs.shape[1:]), pipe.fill, xs.dtype),
            "grads": jax.tree.map(jnp.zeros_like, params),
            "dxs": jnp.zeros_like(xs),
            "loss": jnp.zeros((), loss_type.dtype),
        },
        job.axes,
    )
    warm, both = cfg.chunks - 1, cfg.forward_ticks  # ticks [0, warm) forward only, [both, end) backward only
    phases = ((0, warm, True, False), (warm, both, True, True), (both, both + warm, False, True))
    for lo, hi, do_f, do_b in phases:
        tick = partial(_tick, job, params, xs, tgs, do_f, do_b)
        state, _ = lax.scan(tick, state, jnp.arange(lo, hi))
    grads = jax.tree.map(lambda g: lax.psum(g, DP), state["grads"]) if job.has_dp else state["grads"]
    dx = lax.psum(state["dxs"], PP)  # written on device 0 only
    return _reduce_loss(job, state["loss"]), (jax.tree.map(lambda g: g[None], grads), dx.reshape(x.shape))


def _tick(job: _Job, params, xs, tgs, do_f: bool, do_b: bool, state, t):
    pipe = job.pipe
    d = lax.axis_index(PP)
    state = dict(state)
    ct_loss = jnp.zeros_like(state["recv_ct"])
    if do_f:
        valid, m, j, inp = _forward_input(job, xs, state["recv_x"], t, d)
        slot = (t - d) % pipe.config.stash_slots
        state["stash"] = state["stash"].at[slot].set(jnp.where(valid, inp, state["stash"][slot]))
        y = job.stage_fn(_chunk(params, j), inp)
        if do_b:  # the last chunk runs a micro-batch's backward in the tick of its forward
            ct_loss = _loss_grad(job, state, y, _at(tgs, m), valid & _ends(pipe.config, d, j)[1], m)
        send_x = jnp.where(valid, y, pipe.fill)
    if do_b:
        send_ct = _backward(job, params, state, t, d, ct_loss)
    if do_f:
        state["recv_x"] = pipe.send_forward(send_x)
    if do_b:
        state["recv_ct"] = pipe.send_backward(send_ct)
    return state, None


def _loss_grad(job: _Job, state, y, targets, last, m):
    """Add micro-batch m's loss (on the last chunk) to the state; return the cotangent it seeds."""
    pipe = job.pipe
    value, ct = jax.value_and_grad(job.loss_fn)(y, targets)
    state["loss"] = state["loss"] + jnp.where(last, pipe.loss_scale() * value, 0.0)
    scale = pipe.loss_scale() / job.n_dp  # the gradient of the mean over micro-batches and dp shards
    return jnp.where(last & pipe.keeps_grad(m), scale * ct, jnp.zeros_like(ct))


def _backward(job: _Job, params, state, t, d, ct_loss):
    """The backward slot at tick t: the chunk's VJP from its stashed input; returns what to send back."""
    pipe, cfg = job.pipe, job.pipe.config
    valid, m, j = backward_slot(cfg, t, d)
    m = jnp.clip(m, 0, cfg.microbatches - 1)
    first, last = _ends(cfg, d, j)
    x_in = pipe.mask(valid, state["stash"][forward_counter(cfg, m, j) % cfg.stash_slots])
    ct = pipe.mask(valid, jnp.where(last, ct_loss, state["recv_ct"]))
    _, vjp = jax.vjp(job.stage_fn, _chunk(params, j), x_in)
    gp, gx = vjp(ct)
    state["grads"] = jax.tree.map(lambda acc, g: acc.at[j].add(pipe.mask(valid, g)), state["grads"], gp)
    state["dxs"] = state["dxs"].at[m].set(jnp.where(valid & first, gx, state["dxs"][m]))
    return jnp.where(valid, gx, pipe.fill)
