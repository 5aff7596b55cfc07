"""Mesh axes: the only place these strings are spelled as axes (JSON reports reuse the words
"dp"/"mp" as keys, which are output names, not axis lookups), and each axis's declaration.

``DP`` splits the batch (data parallel), ``MP`` splits weights Megatron-style (model / tensor
parallel); with a pipeline (``--pp``) ``PP`` is the outermost axis, over which the stacked layers are
split into stages; with context parallelism (``--cp``) ``CP`` splits the sequence, between DP and MP.
Layers never name axes; they call methods of ``meshlm.parallel.context.Parallel``.

``AXES`` declares each axis once, in mesh order: what it splits, whether a mesh has it at size 1,
its options (``Layout`` fields, with flags of the same names), its checks, its piece of the label,
the uses it serves (``parallel.specs.USES``: the batch's rows, the loss mean, dense and expert FSDP,
the sequence, a per-model-shard copy), the logical parameter dims it splits, and which step strategy
it needs.
``parallel.layout.Layout`` reads it for its sizes, mesh, label, checkpoint record and validation, and
(``parallel.specs``) for every PartitionSpec outside the rules table's rows: ``Layout.spec`` turns
logical names (a use or a parameter dim) into the spec of a batch, an activation, a cache or a
statistic, and ``Layout.fsdp_axes`` is FSDP's one decision.
Adding an axis (experts, ``ep``) starts with an entry here: docs/architecture.md, "Adding an axis".
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

DP = "dp"  # data-parallel axis: the global batch is split over it
MP = "mp"  # model-parallel axis: heads, hidden units and the vocabulary are split over it
MESH_AXES = (DP, MP)  # the axes every mesh has (a (dp, mp) mesh: ``make_mesh``'s default)
CP = "cp"  # context-parallel axis: the sequence split over it (a mesh has it only when cp > 1: ``Layout``)
PP = "pp"  # pipeline axis: consecutive layer chunks over it (``parallel.pipeline``); outermost when present
EP = "ep"  # expert-parallel axis: the experts split over it; its devices are data shards (``Layout.ep``)
# A layout with pp > 1 has the mesh (pp, dp, mp); without, (dp, mp) as always (``Layout.shape``);
# cp > 1 adds CP between DP and MP: (pp, dp, cp, mp), each axis present only when its size > 1.
# ep > 1 adds EP after DP: (dp, ep, cp, mp). ep borrows devices from the data axis: ``Layout.dp`` stays
# the number of batch shards and the mesh's DP axis holds the rest, dp / ep (``AxisFacts.mesh_shape``).
PIPELINE_MESH_AXES = (PP, DP, MP)

CP_STRATEGIES = ("ring", "allgather")  # how attention reaches the other cp shards' keys and values
PIPELINE_OPTIONS = ("microbatches", "pp_schedule", "virtual_stages")
PIPELINE_DEFAULTS = {"microbatches": 1, "pp_schedule": "1f1b", "virtual_stages": 1}
# The logical dimensions of parameters (``sharding.rules``' rows name them); ``Axis.dims`` maps them.
# "experts": a mixture-of-experts weight's leading [E] dim (no axis splits it without ``ep``; mp never).
LOGICAL_DIMS = ("vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "layers", "experts")


def _nothing(layout) -> None:
    return None


def _no_label(layout) -> tuple[str, str, str]:
    return "", "", ""


def _no_prose(layout, cfg) -> str:
    return ""


@dataclass(frozen=True)
class Axis:
    """One mesh axis. Its size is the ``Layout`` field ``name`` (flag ``--name``); callables take the
    layout (duck-typed: this module imports nothing of meshlm)."""

    name: str  # the mesh axis, the Layout field holding its size, its flag (--pp, --cp)
    splits: str  # what it splits (reports and docs)
    always: bool = False  # in every mesh (dp, mp), or only when its size is > 1 (so older meshes stay)
    options: tuple[str, ...] = ()  # Layout fields configuring it (same-named flags); recorded when on
    check: Callable[[Any], None] = _nothing  # its own one-line errors (ConfigError), given the layout
    label: Callable[[Any], tuple[str, str, str]] = _no_label  # (before the sizes, after, after options)
    uses: tuple[str, ...] = ()  # what it splits by role (``specs.USES``): "batch", "loss", "fsdp", ...
    step: str = ""  # the step strategy it needs when on ("pipelined"); "" the sharded step
    dims: tuple[str, ...] = ()  # the logical parameter dims it splits (``LOGICAL_DIMS``)
    option_dims: tuple[tuple[str, str], ...] = ()  # (option, logical dim) it also splits with that on
    # what a run's start line says it splits of model ``cfg`` when on ("; the 8 experts split over ...")
    explain: Callable[[Any, Any], str] = _no_prose
    kernel: str = ""  # the attention kernel its shards run ("blockwise": cp's chunks), "" the model's
    # bench's yardstick when on: the same model and batch on ``Layout.flat`` (the axis folded away)
    baseline: str = ""

    @property
    def flags(self) -> tuple[str, ...]:
        return tuple("--" + f.replace("_", "-") for f in (self.name, *self.options))


def _check_pipeline(layout) -> None:
    """Schedule options without a pipeline, and the schedule's own errors (``PipelineConfig``)."""
    from meshlm.errors import ConfigError

    if layout.pp == 1:
        given = [
            f"--{o.replace('_', '-')}" for o in PIPELINE_OPTIONS if getattr(layout, o) != PIPELINE_DEFAULTS[o]
        ]
        if given:
            raise ConfigError(f"{', '.join(given)} needs a pipeline; add --pp 2 (or more) or drop it")
        return
    layout.pipeline  # noqa: B018 -- validates the schedule (PipelineConfig raises one-line errors)


def _check_context(layout) -> None:
    """The strategy's name, and the strategy without cp. (With pp the stages run context-parallel
    attention: each passes its cp shard's chunks on, ``sharding.pipelined``.)"""
    from meshlm.errors import ConfigError

    if layout.cp_strategy not in CP_STRATEGIES:
        raise ConfigError(
            f"--cp-strategy {layout.cp_strategy!r} is not one of {', '.join(CP_STRATEGIES)}; pick one"
        )
    if layout.cp == 1 and layout.cp_strategy != CP_STRATEGIES[0]:  # as the pipeline's options without pp
        raise ConfigError(
            f"--cp-strategy {layout.cp_strategy} needs context parallelism; add --cp 2 (or more) or drop it"
        )


def _check_experts(layout) -> None:
    """ep borrows devices from the data axis: it must divide dp; what it does not combine with."""
    from meshlm.errors import ConfigError

    if layout.dp % layout.ep:
        raise ConfigError(
            f"--ep {layout.ep} must divide dp={layout.dp}: ep borrows its devices from the data axis "
            f"(--mesh {layout.dp}x{layout.mp} --ep {layout.ep}); use an --ep that divides {layout.dp}"
        )
    # --fsdp splits dense weights over (DP, EP), every data shard, and expert weights (their experts over
    # EP) over the mesh's DP axis, the data shards outside ep (``sharding.rules``; docs/proof.md, "Expert
    # parallelism"). ep with pp: the stages dispatch over ep (``parallel.pipeline_stats``).


def _expert_label(layout) -> tuple[str, str, str]:
    return ("", f" + EP{layout.ep}", "") if layout.ep > 1 else ("", "", "")


def _pipeline_label(layout) -> tuple[str, str, str]:
    if layout.pp == 1:
        return "", "", ""
    v = f", V={layout.virtual_stages}" if layout.virtual_stages > 1 else ""
    return f"pp{layout.pp}x", "", f" ({layout.pp_schedule}, M={layout.microbatches}{v})"


def _expert_prose(layout, cfg) -> str:
    return f"; the {cfg.n_experts} experts split over ep={layout.ep} of the dp data shards (expert parallel)"


def _pipeline_prose(layout, cfg) -> str:
    return (
        f"; the {cfg.n_layers} layers in {layout.pp} pipeline stages over pp (schedule "
        f"{layout.pp_schedule}, {layout.microbatches} micro-batches per step)"
    )


def _context_prose(layout, cfg) -> str:
    return f"; each sequence split over cp={layout.cp} ({layout.cp_strategy}; chunks i and 2cp-1-i)"


def _context_label(layout) -> tuple[str, str, str]:
    return ("", f" + CP{layout.cp} {layout.cp_strategy}", "") if layout.cp > 1 else ("", "", "")


AXES: tuple[Axis, ...] = (  # in mesh order
    Axis(
        PP,
        "consecutive layer chunks (the stacked layer dimension): pipeline stages",
        options=PIPELINE_OPTIONS,
        check=_check_pipeline,
        label=_pipeline_label,
        explain=_pipeline_prose,
        baseline="no-pp",  # the dp (x cp) x mp mesh without the pipeline
        step="pipelined",
        dims=("layers",),
    ),
    Axis(
        DP,
        "the batch's rows (with --fsdp also weights and AdamW moments)",
        always=True,
        uses=("batch", "loss", "fsdp", "expert_fsdp"),
        option_dims=(("fsdp", "embed"),),  # FSDP: each weight's model-width dim, never one mp splits
    ),
    Axis(
        EP,
        "the experts (MoE layers' expert weights); its devices are data shards: dp = (dp / ep) x ep",
        check=_check_experts,
        label=_expert_label,
        explain=_expert_prose,
        baseline="no-ep",  # the same devices, every expert on every data shard
        uses=("batch", "loss", "fsdp"),  # a dense weight's FSDP slice: every data shard, dp x ep
        dims=("experts",),
    ),
    Axis(
        CP,
        "the sequence, in 2 x cp load-balanced chunks (each shard holds chunks i and 2cp-1-i)",
        options=("cp_strategy",),
        check=_check_context,
        label=_context_label,
        explain=_context_prose,
        kernel="blockwise",  # each shard's chunks against the others' K/V blocks (``model.context_parallel``)
        uses=("loss", "length"),  # cp shards each get whole rows
    ),
    Axis(
        MP,
        "heads, hidden units and the vocabulary (with --sp also the sequence between blocks)",
        always=True,
        uses=("model",),
        dims=("vocab", "heads", "kv_heads", "mlp"),
    ),
)
AXIS_NAMES = tuple(a.name for a in AXES)  # the mesh's axes in order; pp and cp only when > 1
AXIS = {a.name: a for a in AXES}  # each axis's entry by name


def sizes_on(sizes: dict[str, int], axis: str) -> bool:
    """Whether a layout of these ``sizes`` (by axis name; one absent is 1) splits over ``axis``: the one
    rule every "is this axis on" asks (``AxisFacts.on``), also of a layout not built (a refused cell)."""
    return sizes.get(axis, 1) > 1


class AxisFacts:
    """What the declarations say about a layout's sizes (``Layout``'s base: it has a field per axis and
    option); code asks these instead of comparing sizes with 1."""

    @property
    def devices(self) -> int:
        return math.prod(self.mesh_shape.values())

    @property
    def shape(self) -> dict[str, int]:
        """{axis name: size}, the mesh's axes in order (what reports and checkpoint meta show): e.g.
        {"dp": 2, "mp": 2}; pp and cp only when > 1: {"pp": 2, "dp": 2, "mp": 2}, {"dp": 1, "cp": 2,
        "mp": 2} (so 2-D meshes are unchanged)."""
        return {a.name: getattr(self, a.name) for a in AXES if a.always or self.on(a.name)}

    @property
    def mesh_shape(self) -> dict[str, int]:
        """{axis name: size} of the jax mesh: ``shape`` but the DP axis holds the data shards outside
        ep, dp / ep (ep borrows devices from the data axis): --mesh 4x2 --ep 2 is the mesh
        {"dp": 2, "ep": 2, "mp": 2} of 8 devices, 4 batch shards."""
        return {a: s // self.ep if a == DP else s for a, s in self.shape.items()}

    @property
    def data_axis_split(self) -> bool:
        """The mesh's DP axis (the data shards outside ep: ``mesh_shape``) has more than one shard."""
        return self.mesh_shape[DP] > 1

    @property
    def experts_split(self) -> bool:
        """The experts are split over an ep axis (ep > 1)."""
        return self.on(EP)

    def explain(self, cfg) -> str:
        """What the axes on beyond (dp, mp) split of model ``cfg``, in mesh order (``Axis.explain``)."""
        return "".join(a.explain(self, cfg) for a in AXES if self.on(a.name))

    @property
    def blockwise(self) -> bool:
        """An axis on runs attention by the blockwise kernel whatever the model's ``attention`` says."""
        return any(a.kernel == "blockwise" for a in AXES if self.on(a.name))

    def baselines(self) -> tuple[str, ...]:
        """Bench's yardsticks of the axes on (``Axis.baseline``), in mesh order: ("no-pp",), ..."""
        return tuple(a.baseline for a in AXES if a.baseline and self.on(a.name))

    def on(self, axis: str) -> bool:
        """Whether ``axis`` splits anything here (its size is > 1)."""
        return sizes_on({axis: getattr(self, axis)}, axis)

    @property
    def pipelined(self) -> bool:
        """The step runs through the pipeline's schedule (pp > 1): the one strategy an axis picks
        (``Axis.step``); ``sharding.strategy`` maps it to the value-and-grad, loss and generation."""
        return self.strategy == "pipelined"

    @property
    def strategy(self) -> str:
        """The step strategy the axes that are on need: "pipelined" or "sharded"."""
        picked = sorted({a.step for a in AXES if a.step and self.on(a.name)})
        if len(picked) > 1:
            from meshlm.errors import ConfigError

            raise ConfigError(f"the axes on need different step strategies ({', '.join(picked)}); drop one")
        return picked[0] if picked else "sharded"

    @property
    def extra_axes(self) -> tuple[str, ...]:
        """The axes on beyond the (dp, mp) every mesh has: ("pp",), ("cp",) or ()."""
        return tuple(a.name for a in AXES if not a.always and self.on(a.name))

    @property
    def context_parallel(self) -> bool:
        """The sequence is split over cp (cp > 1)."""
        return self.on(CP)

    @property
    def cp_ring(self) -> bool:
        """Context parallelism by the ring (K/V chunks passed around cp), not by all-gathers."""
        return self.context_parallel and self.cp_strategy == "ring"

    @property
    def pipeline_microbatches(self) -> int:
        """Micro-batches each (accumulation) batch is cut into by the pipeline: 1 without one."""
        return self.microbatches if self.pipelined else 1

    def logical_axes(self) -> dict[str, str]:
        """Logical parameter dim -> the mesh axis splitting it on this layout (``Axis.dims`` of the
        axes in the mesh): {"vocab": "mp", ...}, with a pipeline also {"layers": "pp"}."""
        return {d: a.name for a in AXES if a.name in self.shape for d in a.dims}

    def option_axes(self) -> dict[str, str]:
        """Logical dim -> the mesh axis an option that is on adds to it (``--fsdp``: {"embed": "dp"})."""
        return {d: a.name for a in AXES if a.name in self.shape for o, d in a.option_dims if getattr(self, o)}
