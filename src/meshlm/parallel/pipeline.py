"""Pipeline parallelism over the ``pp`` mesh axis: GPipe, 1F1B and interleaved 1F1B, generic over a stage.

The caller supplies
  ``stage_fn(stage_params, x) -> y``: one chunk of consecutive layers, its parameters stacked on a leading
      layer dimension (any chunk length: the sequential reference runs all layers as one chunk; stacks of
      several lengths -- a model's layer kinds, ``model.stage_layers`` -- each split into the chunks
      alike); ``y`` has ``x``'s shape and dtype;
  ``loss_fn(y, targets) -> scalar``: the last stage's loss of one micro-batch, a mean over its rows (so the
      mean of the M micro-batch losses is the batch's loss).
``pipeline_value_and_grad(...)(params, x, targets)`` returns ``(loss, (param_grads, x_grad))`` like
``jax.value_and_grad`` of the sequential model; a head's parameters can be passed too (``loss_fn(head,
y, targets)``), and a first-stage embedding (``embed_fn(embed, inputs) -> x``), which then runs inside
the schedule on each micro-batch, its gradients returned in place of ``x_grad``.

Everything runs in one ``jax.shard_map(check_vma=True)`` over ``pp``, ``pp x dp`` (the batch split over
``dp``) or ``pp x dp x mp`` (stages run their own Megatron collectives over ``mp``; parameters placed by
the rules table within each stage, FSDP included). Chunk ``k = j * pp + d`` of the layer stack lives on
device ``d`` as virtual stage ``j`` (``pipeline_schedule`` has the tick formulas). Activations go one
stage on and cotangents one back with ``lax.ppermute`` once per tick.

* GPipe: a scan over the forward ticks, differentiated by JAX: its residuals, all M micro-batches', live
  until the backward.
* 1F1B and interleaved: an explicit schedule. Each tick runs one forward slot and one backward slot; the
  forward runs the chunk under ``jax.vjp`` and keeps its residuals (``pipeline_stash``: what the stage's
  remat policy saves) in a ring of ``2 pp V - 1`` micro-batches (memory flat in M); the backward runs
  that VJP, seeded on the last chunk by the loss's gradient. No chunk forward runs twice.

Bubbles: every device takes part in every tick (SPMD). A slot with no micro-batch is *masked*: its input
is zeroed, its gradient contributions are zeroed, and what it sends on is ``fill``; under 1F1B and
interleaved without cp its chunk forward and backward are also skipped (``lax.cond`` on the slot's
validity, the same on every device of a stage, so the stage's all-reduces over dp and mp stay matched;
``Job.skips_bubbles`` says why not with cp; GPipe's forward, differentiated by JAX, runs them masked).
The head (``loss_fn``) runs only where the last chunk has a micro-batch (``lax.cond``), the embedding
only where the first chunk has one.
Tests set ``fill`` to NaN: a result that is finite and exact shows that no bubble reaches it.
Controls (``meshlm.proof.pipeline_proof``) override one hook of ``Pipeline`` each.
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
from meshlm.parallel.axes import CP, DP, EP, MP, PP
from meshlm.parallel.layout import axis_sizes
from meshlm.parallel.pipeline_engines import Job, gpipe, one_f_one_b
from meshlm.parallel.pipeline_schedule import PipelineConfig, check_batch, check_layers


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

    def runs(self, valid):
        """Whether a 1F1B slot runs its chunk (``lax.cond``; not with cp): a bubble's is skipped, not
        computed and masked -- on devices that share cores (fake CPU devices) masked work costs time."""
        return valid

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


def pipeline_value_and_grad(
    stage_fn,
    loss_fn,
    mesh,
    pipe: Pipeline,
    *,
    specs=None,
    head_specs=None,
    embed_fn=None,
    embed_specs=None,
    with_aux=False,
    stats_loss=None,
    stats_sum=None,
    head_aux=False,
):
    """fn(params, x, targets, head=None) -> (loss, (param_grads, x_grad)) on ``mesh``, with params' leaves
    stacked [L, ...] and x, targets' leaves [B, ...] (rows split over dp, replicated over mp). Jit it.

    The mesh has the ``pp`` axis and optionally ``dp`` and ``mp``. ``specs`` (a tree like params, of
    PartitionSpecs of the [L, ...] leaves, the layer dimension unsplit: the rules table's) places each
    parameter within a stage; the default replicates it. Stages then call their own collectives over mp
    (``Parallel``); a parameter split over dp (FSDP) is gathered by the stage and its gradient comes back
    reduce-scattered. With ``head`` (the last stage's parameters, replicated over pp, placed by
    ``head_specs``): ``loss_fn(head, y, targets)``, and the result is (loss, (param_grads, x_grad,
    head_grads)). With ``embed_fn(embed, inputs) -> x`` (``embed``: its parameters, replicated over pp,
    placed by ``embed_specs``): ``fn(params, inputs, targets, head, embed)`` with ``inputs`` [B, ...] (token
    ids) embedded per micro-batch on the first stage inside the schedule, and the embedding's gradients
    in place of ``x_grad``.

    With a ``cp`` axis (context parallelism) the rows arrive whole on every cp shard (replicated over cp,
    as over mp); ``embed_fn`` and ``loss_fn`` take each shard's part of the sequence (``Parallel``'s
    ``seq_local``), the stages attend across cp, and the loss is a mean over dp and cp. With
    ``with_aux``: ``fn(..., aux=)`` takes rows [B, ...] the stages read (not differentiated: document
    starts), split into micro-batches like ``targets``, and calls ``stage_fn(params, x, aux_rows)``. With
    an ``ep`` axis the rows are split over (dp, ep) and the loss is a mean over both (the experts' own
    all-to-alls run inside the stages). With ``stats_loss``: ``stage_fn`` returns ``(y, stats)`` and the
    loss gains ``stats_loss`` of the step's statistics (``pipeline_stats``); with ``stats_sum`` too (the
    statistics summed over the batch's shards, replicated) fn's value is (loss, those statistics). With
    ``head_aux``: ``loss_fn`` returns (loss, metrics: a tree of one micro-batch's values, each a mean over
    this shard's rows like the loss) and fn's value is (loss, (the statistics or None, the metrics' mean
    over the step: over the micro-batches and the batch's shards))."""
    cfg = pipe.config
    names = tuple(mesh.axis_names)
    if PP not in names or set(names) - {PP, DP, EP, CP, MP}:
        raise MeshError(
            f"the pipeline needs a mesh with the axis '{PP}' and at most '{DP}', '{EP}', '{CP}', '{MP}'; "
            f"got {names}"
        )
    sizes = axis_sizes(mesh)
    if sizes[PP] != cfg.pp:
        raise MeshError(f"the mesh's {PP} axis has {sizes[PP]} devices but pp={cfg.pp}; make them equal")
    has_dp, n_ep = DP in names, sizes.get(EP, 1)
    n_dp = sizes.get(DP, 1) * n_ep  # the batch's shards: ep's devices are data shards too
    if stats_sum is not None and stats_loss is None:
        raise ConfigError("stats_sum returns the statistics stats_loss makes the chunks return; pass both")
    n_cp = sizes.get(CP, 1)
    job = Job(
        stage_fn, loss_fn, pipe, has_dp, n_dp, embed_fn, n_cp, with_aux, n_ep, stats_loss, stats_sum, head_aux
    )
    rows = (DP, EP) if EP in names else DP
    data = P(rows) if has_dp else P()  # replicated over cp and mp: each cp shard slices its own chunks
    body = partial(gpipe if cfg.schedule == "gpipe" else one_f_one_b, job)
    value_spec = P() if stats_sum is None or head_aux else (P(), P())  # the loss (and statistics, metrics)

    def run(params, x, targets, head=None, embed=None, aux=None):
        for count in sorted({a.shape[0] for a in jax.tree.leaves(params)}):  # each kind's stack apart
            check_layers(cfg, count)
        check_batch(cfg, x.shape[0], job.n_dp)
        rows = {a.shape[0] for a in jax.tree.leaves(targets)}
        if rows - {x.shape[0]}:
            raise ConfigError(
                f"targets have {sorted(rows)} rows but the input has {x.shape[0]}; pass one per row"
            )
        with_head, head = head is not None, () if head is None else head
        staged_specs = _staged_specs(params, specs)
        h_specs = jax.tree.map(lambda _: P(), head) if head_specs is None else head_specs
        embed = () if embed_fn is None else embed
        e_specs = jax.tree.map(lambda _: P(), embed) if embed_specs is None else embed_specs
        aux = _check_aux(with_aux, aux, x.shape[0])
        fn = jax.shard_map(
            partial(body, with_head=with_head),
            mesh=mesh,
            in_specs=(staged_specs, h_specs, e_specs, data, data, jax.tree.map(lambda _: data, aux)),
            out_specs=(value_spec, (staged_specs, data if embed_fn is None else e_specs, h_specs)),
            check_vma=True,
        )
        value, (grads, dx, head_grads) = fn(to_stages(pipe, params), head, embed, x, targets, aux)
        grads = from_stages(pipe, grads)
        return value, (grads, dx, head_grads) if with_head else (grads, dx)

    return run


def _check_aux(with_aux: bool, aux, rows: int):
    """``aux`` as the engine takes it: () without ``with_aux``; with it, a tree of [rows, ...] leaves."""
    if not with_aux:
        if aux is not None:
            raise ConfigError("aux rows were passed to a pipeline built without with_aux=True; build it so")
        return ()
    got = {a.shape[0] for a in jax.tree.leaves(aux)}
    if not got or got - {rows}:
        raise ConfigError(f"aux has {sorted(got)} rows but the input has {rows}; pass one per row")
    return aux


def _staged_specs(params, specs):
    """Specs of the [pp, V, c, ...] staged leaves: pp-split, then the leaf's own spec."""
    if specs is None:
        return jax.tree.map(lambda _: P(PP), params)

    def one(spec):
        if len(spec) and spec[0] is not None:
            raise ConfigError(
                f"a stacked parameter's spec {spec} splits the layer dimension; the pipeline does"
            )
        return P(PP, None, *spec)

    return jax.tree.map(one, specs, is_leaf=lambda x: isinstance(x, P))
