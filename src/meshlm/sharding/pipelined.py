"""The real model through the pipeline (``--pp``): ``fn(params, batch) -> (loss, grads)`` like
``spmd.sharded_value_and_grad``, on a pipelined Layout (``--pp``; ``strategy.Pipelined``).

The model runs as its three pieces (``model.transformer``), all inside the schedule
(``parallel.pipeline``), each stage within its own ``dp x mp`` sub-mesh (the rules table's specs, FSDP
included): the embedding of each micro-batch on the first stage (its lookup in the first chunk's
forward slot, its backward in that chunk's backward slot: no whole-batch activation exists); the layer
stack split into ``pp x V`` chunks run on the stages; the final norm, output projection and loss on the
last stage (with tied embeddings the last stage holds the table too, and its gradient is the sum of the
first stage's and the last stage's). Multi-token prediction's depths (``model.mtp``) run on the last
stage after the head, their parameters stored and passed like the head's (not split over pp); they embed
their tokens by the table, which the last stage then holds as a tied head's, its gradient summed alike;
their losses come out of the engine as the head's metrics (``head_aux``). Parameters are stored as
always, the stacked layer dimension split over ``pp`` (``rules.pp_specs``): a checkpoint's format does
not depend on pp. A stack of two layer kinds (``model.stage_layers``): each kind's stack split alike
when every chunk holds whole periods of the kinds, or a mixture of experts' dense prefix run with the
embedding on the first stage (its stack passed and stored as the embedding's). Uneven stages: the
body's stack arrives padded (``stage_slots``: chunks of S slots, padding slots run as the identity, their
routing statistics dropped before the losses and the returned statistics).
"""

from __future__ import annotations

from functools import partial

import haiku as hk
import jax
import jax.numpy as jnp

from meshlm.errors import ConfigError
from meshlm.model import stage_layers
from meshlm.model.attention import doc_starts
from meshlm.model.config import ModelConfig
from meshlm.model.masked import WEIGHTS
from meshlm.model.moe import aux_loss, moe_losses
from meshlm.model.params import is_stacked
from meshlm.model.pieces import embed_fn, head_loss_fn, layers_fn
from meshlm.model.transformer import check_context, loss_fn
from meshlm.parallel.context import Parallel
from meshlm.parallel.layout import Layout
from meshlm.parallel.pipeline import Pipeline, pipeline_value_and_grad
from meshlm.sharding import stage_slots
from meshlm.sharding.rules import check_uniform_stack, without_pp
from meshlm.sharding.stage_slots import Slots, slots_of


def check_pipelined(cfg: ModelConfig, layout: Layout) -> None:
    """What ``--pp`` cannot split, as one-line errors before any work (with cp also what context
    parallelism cannot run of the model: the pieces run inside the schedule)."""
    check_uniform_stack(cfg, layout)  # the layer kinds each chunk holds: every stage's alike
    check_context(cfg, layout)
    if cfg.arch.moe and cfg.moe_capacity_factor:  # a stage sees one micro-batch, not the batch
        raise ConfigError(
            f"--pp with moe_capacity_factor={cfg.moe_capacity_factor}: the capacity is a rule on the whole "
            "batch and a pipeline stage routes one micro-batch at a time; drop --pp or the capacity factor"
        )
    if cfg.mtp_on and layout.cp_ring:  # the head runs under a cond on the last stage: no ring inside
        raise ConfigError(
            "--pp with --cp ring and multi-token prediction: the MTP depths run with the head on the last "
            "stage, where context parallelism's ring cannot run; pass --cp-strategy allgather (or "
            "--mtp-weight 0, or drop --cp)"
        )
    if cfg.lora_rank and slots_of(cfg, layout):  # its adapters are initialised and saved apart
        raise ConfigError(
            f"--pp {layout.pipeline.pp} with --lora-rank: {cfg.n_layers} layers make uneven pipeline stages "
            "(padding slots), which LoRA's adapters do not take yet; choose a --pp that divides the layers"
        )
    if cfg.lora_dropout:  # its mask is of each layer's index; a stage numbers its chunk's from 0
        raise ConfigError("--pp does not take --lora-dropout yet (its masks number the layers); drop one")


def split_model(tree, cfg: ModelConfig) -> tuple[dict, dict, dict]:
    """A model's tree (params, specs, grads) as (embedding, stacked layers, head) by module name: a
    dense prefix's stack goes with the embedding (``stage_layers.prefix``), every other stack (each
    kind's: ``layer_kinds.stacks``) is the pipelined body."""
    first = tuple(f"{name}/" for name in ("embed", *stage_layers.prefix_stacks(cfg)))
    embed = {k: v for k, v in tree.items() if k == "embed" or k.startswith(first)}
    layers = {k: v for k, v in tree.items() if k not in embed and is_stacked(f"{k}/")}
    head = {k: v for k, v in tree.items() if k not in embed and k not in layers}
    return embed, layers, head


def _table(embed: dict) -> dict:
    """The embedding table's module of the first stage's tree (a tied head reads it on the last stage
    too; a dense prefix's stack stays on the first)."""
    return {k: v for k, v in embed.items() if k == "embed"}


def stage_fn(cfg: ModelConfig, par: Parallel, stats: bool | None = None, slots: Slots | None = None):
    """One chunk of layers: as many as its parameters stack, each kind's stack its count of them
    (``stats``: ``layers_fn``'s), with the kinds every chunk holds (``stage_layers.chunk_config``);
    uneven stages (``slots``): the chunk's slots, padding as the identity (``stage_slots.chunk``)."""

    def run(params, x, starts=None):  # starts: the micro-batch's document starts (``--doc-mask``)
        if slots is not None:
            return stage_slots.chunk(cfg, par, bool(stats), slots, params, x, starts)
        counts = {mod.split("/")[0]: jax.tree.leaves(leaves)[0].shape[0] for mod, leaves in params.items()}
        chunk = stage_layers.chunk_config(cfg, sum(counts.values()))
        return hk.without_apply_rng(hk.transform(layers_fn(chunk, par, stats))).apply(params, x, starts)

    return run


def pipelined_value_and_grad(
    cfg: ModelConfig,
    layout: Layout,
    specs,
    *,
    pipe_cls=Pipeline,
    par_cls=Parallel,
    fill: float = 0.0,
    compute_dtype=None,
    routing: bool = False,
):
    """fn(params, batch) -> (loss, grads) of ``cfg``'s model on ``layout`` (pipelined), grads in the
    parameters' layout and dtype. ``pipe_cls`` / ``par_cls``: the engine's and the stages' hooks (the
    proof's controls override one); ``fill``: what bubbles hold (NaN in the proof). ``routing`` (a
    mixture of experts): -> ((loss, the step's routing statistics [L, 2E + 3]), grads), as without pp;
    with multi-token prediction on -> ((loss, {"mtp": the depths' losses [D], "routing" with a mixture
    of experts}), grads), as ``loss_fn(..., metrics=True)``."""
    check_pipelined(cfg, layout)
    par = par_cls.on(layout)
    embed_apply = hk.without_apply_rng(hk.transform(embed_fn(cfg, par))).apply
    head_apply = hk.without_apply_rng(hk.transform(head_loss_fn(cfg, par))).apply
    embed_specs, layer_specs, head_specs = split_model(without_pp(specs), cfg)
    # the head projects onto the embedding table, or the MTP depths embed by it: the last stage holds it too
    tied = cfg.tie_embeddings or cfg.mtp_on
    head_specs = {**head_specs, **_table(embed_specs)} if tied else head_specs
    pipe = pipe_cls(layout.pipeline, fill=fill)
    aux, routing = routing, routing and cfg.arch.moe  # the caller's aux: routing statistics, MTP's losses
    slots = slots_of(cfg, layout)
    real = (lambda stats: stats) if slots is None else partial(stage_slots.real_statistics, slots)
    stats_loss = _stats_loss(cfg, par, routing, real)
    step = pipeline_value_and_grad(
        stage_fn(cfg, par, stats_loss is not None, slots),
        head_apply,
        layout.mesh,
        pipe,
        specs=layer_specs,
        head_specs=head_specs,
        embed_fn=embed_apply,
        embed_specs=embed_specs,
        with_aux=cfg.doc_mask >= 0,
        stats_loss=stats_loss,
        stats_sum=(lambda stats: par.moe_sum(real(stats))) if routing else None,
        head_aux=cfg.mtp_on,
    )

    def fn(params, batch):
        master = params
        if compute_dtype is not None:  # the cast's VJP is the cast back: grads in the master dtype
            params = jax.tree.map(lambda p: p.astype(compute_dtype), params)
        embed, layers, head = split_model(params, cfg)
        head = {**head, **_table(embed)} if tied else head
        # --doc-mask: each row's document starts from its EOD ids, computed before the pipeline on the
        # whole rows and passed with each micro-batch to every stage (positions stay the global ones)
        starts = {} if cfg.doc_mask < 0 else {"aux": doc_starts(batch["inputs"], cfg.doc_mask)}
        inputs, targets = batch["inputs"], batch["targets"]
        if WEIGHTS in batch:  # the SFT loss: each micro-batch's targets with their weights
            targets = {"targets": targets, WEIGHTS: batch[WEIGHTS]}
        if cfg.mtp_on:  # the MTP depths shift their tokens and labels on the whole rows (``model.mtp``)
            targets = {**(targets if isinstance(targets, dict) else {"targets": targets}), "inputs": inputs}
        value, (g_layers, g_embed, g_head) = step(layers, inputs, targets, head, embed, **starts)
        if tied:  # the table's gradient: the first stage's lookup's plus the last stage's head's (or MTP's)
            g_table = jax.tree.map(jnp.add, _table(g_embed), {k: g_head.pop(k) for k in _table(embed)})
            g_embed = {**g_embed, **g_table}  # a dense prefix's stack (the first stage's) as it came
        grads = {**g_embed, **g_layers, **g_head}
        return _value(value, cfg, aux, routing), jax.tree.map(lambda g, p: g.astype(p.dtype), grads, master)

    return fn


def _value(value, cfg: ModelConfig, aux: bool, routing: bool):
    """The engine's value as ``loss_fn``'s: with MTP on it is (loss, (statistics, the depths' losses)),
    returned as (loss, {"mtp", "routing"}) where the caller asked for aux, else the loss alone."""
    if not cfg.mtp_on:
        return value
    loss, (stats, per_depth) = value
    return (loss, {"mtp": per_depth} | ({"routing": stats} if routing else {})) if aux else loss


def _stats_loss(cfg: ModelConfig, par: Parallel, routing: bool = False, real=lambda stats: stats):
    """A mixture of experts' aux and z losses for the pipeline: of the routing statistics every stage's
    layers returned for every micro-batch (summed by the engine over them and the stages), summed over
    the batch's shards (``Parallel.moe_sum``); None without those losses, unless ``routing`` asks for
    the statistics (the routing metrics): then a loss of 0 (under 1F1B their pass still runs: one more
    forward of the step for metrics of a model trained without the losses). ``real``: the statistics
    of the real layers (uneven stages: the padding's rows dropped)."""
    if not moe_losses(cfg) and not routing:
        return None
    return lambda stats: aux_loss(cfg, par.moe_sum(real(stats)))


def pipelined_loss(cfg: ModelConfig, compute_dtype=None, layout: Layout | None = None):
    """fn(params, batch) -> loss for evaluation under pp: the unsharded model under ``jit``, partitioned
    by XLA from the arrays' shardings (no schedule: nothing to differentiate); uneven stages' padded
    stack read at its real layers (``stage_slots``)."""
    slots = None if layout is None else slots_of(cfg, layout)
    cfg = cfg.replace(mtp_weight=0.0) if cfg.mtp_on else cfg  # evaluation: the next token's loss alone
    apply = hk.without_apply_rng(hk.transform(loss_fn(cfg, Parallel()))).apply
    real = (lambda params: params) if slots is None else slots.unpad
    cast = (lambda p: p) if compute_dtype is None else (lambda p: p.astype(compute_dtype))
    return lambda params, batch: apply(jax.tree.map(cast, real(params)), batch)
