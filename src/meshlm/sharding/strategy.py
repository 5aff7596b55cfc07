"""The step's strategy, picked once by the layout (``Layout.strategy``, from the axes' declarations):
how the model's loss and gradients, its evaluation loss and its generation run on that layout.

* ``sharded``: the model inside one ``shard_map`` over the layout's mesh (``spmd``).
* ``pipelined`` (``--pp``): the model's pieces through the pipeline's schedule (``pipelined``); its
  evaluation is the plain model partitioned by XLA, and it has no generation.

Callers (the train step, start-up's checks, evaluation, the proof's runs, bench) ask
``strategy(layout)`` instead of comparing axis sizes: a new strategy is one class and one entry.
"""

from __future__ import annotations

from meshlm.model.config import ModelConfig
from meshlm.model.transformer import loss_fn
from meshlm.parallel.context import Parallel
from meshlm.parallel.layout import Layout


class Sharded:
    """Every axis inside one ``shard_map`` (``spmd.sharded_value_and_grad``)."""

    name = "sharded"
    generates = True  # generation (``generate.programs``) runs on this layout
    # What the proof's communication check counts: the compiled step's all-reduces (``proof.communication``)
    proof_collectives = "all-reduces"
    probes_routing = True  # the proof's routing probe (``proof.routing``) runs this strategy's model
    engine_faults = False  # the proof's controls run as they are (no engine of its own to plant faults in)

    def check(self, cfg: ModelConfig, layout: Layout) -> None:
        """What the layout cannot run of ``cfg``, as one-line errors before any work (``--quant``'s)."""
        from meshlm.model.quant_fields import check_quant

        check_quant(cfg, layout)

    def value_and_grad(
        self, cfg, layout: Layout, specs, *, build_loss=None, par_cls=Parallel, compute_dtype=None, **kw
    ):
        """fn(params, batch) -> (loss, grads); ``build_loss``: par -> Haiku loss (default ``cfg``'s).
        ``routing=True`` (a mixture of experts): -> ((loss, routing statistics), grads)."""
        from meshlm.sharding.spmd import sharded_value_and_grad

        routing = bool(kw.get("routing"))
        build = build_loss or (lambda par: loss_fn(cfg, par, routing=routing))
        return sharded_value_and_grad(
            build, layout, specs, par_cls, compute_dtype=compute_dtype, has_aux=routing
        )

    def loss(self, cfg: ModelConfig, layout: Layout, specs, compute_dtype=None):
        """fn(params, batch) -> loss (evaluation: no gradients)."""
        from meshlm.sharding.spmd import sharded_loss

        cfg = cfg.replace(mtp_weight=0.0) if cfg.mtp_on else cfg  # evaluation: the next token's loss alone
        return sharded_loss(lambda par: loss_fn(cfg, par), layout, specs, compute_dtype)


class Pipelined:
    """The layer stack over ``pp`` through the schedule (``pipelined.pipelined_value_and_grad``)."""

    name = "pipelined"
    generates = False  # generation has no pipeline
    proof_collectives = "permutes"  # the schedule's permutes (``proof.pipeline_verify.permute_rows``)
    probes_routing = False  # the stages run the model's pieces, not the probe's unpipelined model
    engine_faults = True  # every control through the engine, and its own faults (``proof.pipeline_verify``)

    def check(self, cfg: ModelConfig, layout: Layout) -> None:
        from meshlm.model.quant_fields import check_quant
        from meshlm.sharding.pipelined import check_pipelined

        check_quant(cfg, layout)
        check_pipelined(cfg, layout)

    def value_and_grad(self, cfg, layout: Layout, specs, *, par_cls=Parallel, compute_dtype=None, **kw):
        """As ``Sharded.value_and_grad``, for ``cfg``'s model (``build_loss`` is not used: the pipeline
        runs the model's own pieces); ``pipe_cls``, ``fill``: the engine's hooks (the proof's)."""
        from meshlm.sharding.pipelined import pipelined_value_and_grad

        engine = {k: v for k, v in kw.items() if k in ("pipe_cls", "fill", "routing") and v is not None}
        return pipelined_value_and_grad(
            cfg, layout, specs, par_cls=par_cls, compute_dtype=compute_dtype, **engine
        )

    def loss(self, cfg: ModelConfig, layout: Layout, specs, compute_dtype=None):
        from meshlm.sharding.pipelined import pipelined_loss

        return pipelined_loss(cfg, compute_dtype, layout)


STRATEGIES = {s.name: s for s in (Sharded(), Pipelined())}


def strategy(layout: Layout) -> Sharded | Pipelined:
    """The strategy ``layout`` runs its step with (``Layout.strategy``)."""
    return STRATEGIES[layout.strategy]
