"""``Layout``: the mesh's axis sizes and the parallelism options, one validated value.

Everything that depends on how the computation is laid out over devices takes a ``Layout``: the
rules table (which axes split which parameter dimensions), the parallel context layers compute in
(``Parallel.on(layout)``), the train step, the proof, the planner, generation, and checkpoint
metadata. The divisibility rules a layout imposes on sizes outside the model (the batch over
``dp``, the sequence over ``mp`` under ``sp`` and into ``2 x cp`` chunks with ``cp``) are stated
here, once, as one-line errors; the model's own dimensions are the rules table's (``sharding.rules``).

A ``Layout`` is built from sizes (``Layout(dp=2, mp=2, fsdp=True)``, validated before any device is
touched) or from an existing mesh (``Layout.of(mesh, ...)``: the one place a mesh's shape is read).
Its ``mesh`` is made from the sizes on first use, or is the one it was built from.

The pipeline axis ``pp`` (``parallel.pipeline``) is the outermost: with ``pp > 1`` the mesh is
(pp, dp, mp) and ``pipeline`` is the schedule (``--microbatches``, ``--pp-schedule``,
``--virtual-stages``); with ``pp = 1`` nothing changes (the mesh, reports and checkpoint meta are
(dp, mp) as before).

The context-parallel axis ``cp`` (``parallel.cp``) sits between dp and mp: with ``cp > 1`` the mesh
is (dp, cp, mp) (``--cp-strategy`` ring or allgather); with ``cp = 1`` it is no axis. The full order
is (pp, dp, cp, mp), pp and cp each present only when > 1 (a pipeline does not yet combine with cp).

Each axis is declared once (``parallel.axes.AXES``: its place in the mesh, options, checks, label);
``shape``, the mesh, ``label``, ``to_dict`` and validation read the declarations, and code asks the
layout (``pipelined``, ``context_parallel``, ``strategy``: ``axes.AxisFacts``) rather than comparing
sizes. Adding an axis: docs/architecture.md, "Adding an axis".

This module must not import JAX at module level: the CLI validates layouts before choosing devices.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from meshlm.errors import ConfigError, MeshError, ShardingError
from meshlm.parallel.axes import (
    AXES,
    AXIS_NAMES,
    CP,
    CP_STRATEGIES,
    DP,
    EP,
    MESH_AXES,
    PIPELINE_OPTIONS,
    PP,
    AxisFacts,
)
from meshlm.parallel.specs import AxisUses

OPTIONS = ("fsdp", "sp")  # the memory options, by their field (and flag) names
ALL_AXES = AXIS_NAMES  # the mesh's axes in order; pp and cp only when > 1 (``Layout.shape``)
AXIS_OPTIONS = tuple(o for a in AXES for o in a.options)  # each axis's options, in mesh order
__all__ = [
    "ALL_AXES",
    "CP_STRATEGIES",
    "OPTIONS",
    "PIPELINE_OPTIONS",
    "Layout",
    "axis_sizes",
    "devices_layout",
    "early_layout",
]


@dataclass(frozen=True)
class Layout(AxisFacts, AxisUses):
    dp: int = 1  # data-parallel shards: the batch's rows (and, with fsdp, weights) split over them
    mp: int = 1  # model-parallel shards: heads, hidden units and the vocabulary split over them
    fsdp: bool = False  # FSDP (ZeRO-3): weights and AdamW moments also split over dp
    sp: bool = False  # sequence parallelism: activations between blocks split over the sequence on mp
    pp: int = 1  # pipeline stages: consecutive layer chunks over the outermost mesh axis (1: no pp axis)
    microbatches: int = 1  # with pp > 1: each step's (micro-)batch split into M pipeline micro-batches
    pp_schedule: str = "1f1b"  # with pp > 1: gpipe | 1f1b | interleaved
    virtual_stages: int = 1  # with pp > 1 and interleaved: layer chunks per device
    cp: int = 1  # context-parallel shards: the sequence split over them (load-balanced chunks i, 2cp-1-i)
    cp_strategy: str = "ring"  # ring: K/V passed around cp (ppermute); allgather: K/V gathered per layer
    # expert-parallel shards: of the dp data shards, ep hold different experts (ep divides dp; the
    # mesh's DP axis is then dp / ep: ``mesh_shape``)
    ep: int = 1
    # The mesh this layout was built from (``of``), or made on first use: not part of the value.
    built_mesh: Any = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self):
        for name in ALL_AXES:
            size = getattr(self, name)
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise MeshError(f"mesh axis {name} must be a positive integer, got {size!r}")
        for name in OPTIONS:
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        for axis in AXES:
            axis.check(self)

    @property
    def pipeline(self):
        """The schedule (``PipelineConfig``) of a layout with pp > 1, else None."""
        return _pipeline_config(self) if self.pipelined else None

    @classmethod
    def of(cls, where, **options) -> Layout:
        """``where`` as a Layout: a Layout (with ``options`` replaced), or a jax Mesh with ``options``
        (the memory options default off)."""
        if isinstance(where, Layout) and not options:
            return where
        if isinstance(where, Layout):
            # another pp or cp is another mesh (made on first use)
            resized = any(options.get(a, getattr(where, a)) != getattr(where, a) for a in ALL_AXES)
            return dataclasses.replace(where, **options, **({"built_mesh": None} if resized else {}))
        return _from_mesh(cls, where, options)

    @property
    def mesh(self):
        """The jax Mesh (dp, mp), (pp, dp, mp), (dp, cp, mp) or (dp / ep, ep, mp) of this layout
        (``parallel.mesh.make_mesh`` on first use)."""
        if self.built_mesh is None:
            from meshlm.parallel.mesh import make_mesh

            shape = self.mesh_shape
            object.__setattr__(self, "built_mesh", make_mesh(*shape.values(), axes=tuple(shape)))
        return self.built_mesh

    def replace(self, **changes) -> Layout:
        return dataclasses.replace(self, **changes)

    @property
    def flat(self) -> Layout:
        """The same dp (x cp) x mp with every axis that has a bench yardstick folded away (no pipeline,
        no ep: ``Axis.baseline``): what ``baselines`` are timed on."""
        kept = {f: getattr(self, f) for a in AXES if not a.baseline for f in (a.name, *a.options)}
        return Layout(fsdp=self.fsdp, **kept)  # as bench's yardsticks always were: sp off

    @classmethod
    def of_options(cls, options: dict) -> Layout:
        """The options' own layout before any mesh size is known (dp = mp = 1): their own rules (e.g.
        --microbatches without --pp) checked without devices; ep is left out (1: it needs a dp)."""
        return cls(**{**options, EP: 1})

    def label(self) -> str:
        """The mesh and the options that are on: "2x2", "2x2 + FSDP + SP", "1x2 + CP2 ring",
        "pp2x1x2 (1f1b, M=4)", "2x2 + EP2"."""
        return _label(self)

    def to_dict(self) -> dict[str, Any]:
        """What checkpoint metadata records (``from_dict`` reads it back); the pipeline's fields only
        with pp > 1 (a checkpoint's format does not depend on them: pp splits the layer dimension), the
        cp strategy only with cp > 1."""
        axes = {o: getattr(self, o) for a in AXES if self.on(a.name) for o in a.options}
        return {**self.shape, **{o: getattr(self, o) for o in OPTIONS}, **axes}

    @classmethod
    def from_dict(cls, d: dict) -> Layout:
        known = (*ALL_AXES, *OPTIONS, *AXIS_OPTIONS)
        unknown = sorted(set(d) - set(known))
        if unknown:
            valid = ", ".join(known)
            raise ConfigError(f"unknown layout field(s) {unknown}; valid: {valid}")
        return cls(**d)

    # --- the divisibility rules of sizes outside the model ------------------------------------
    def check_seq_len(self, seq_len: int) -> None:
        """With ``sp`` the sequence is split over mp: it must divide (a ShardingError, as for any
        dimension the mesh does not divide: ``verify --matrix`` lists such cells as skipped). With cp
        it is cut into 2 x cp chunks (each shard holds chunks i and 2cp-1-i), then over mp under sp."""
        _check_seq_len(self, seq_len)

    def smallest_batch(self, at_least: int, accum_steps: int = 1) -> int:
        """The fewest global rows, ``at_least`` or more, that ``check_batch`` accepts."""
        rows = self.dp * accum_steps * self.pipeline_microbatches
        return -(-at_least // rows) * rows

    def check_batch(self, batch_size: int, accum_steps: int | None = None) -> None:
        """The global batch splits into ``accum_steps`` micro-batches, each over dp (and with pp into
        the pipeline's ``microbatches``)."""
        _check_batch(self, batch_size, accum_steps)


def early_layout(options: dict) -> Layout | None:
    """What a command checks before the device count is known: with a pipeline the options' own
    layout (``of_options``: the schedule's rules), else None (the mesh depends on the devices)."""
    alone = Layout.of_options(options)
    return alone if alone.pipelined else None


def devices_layout(n_devices: int, options: dict, default_dp: int = 1) -> Layout:
    """``options`` over ``n_devices`` (pp x dp x cp x mp): dp = ``default_dp`` where it divides the
    devices left by pp and cp and there is no pipeline (else 1), made a multiple of ep (ep's shards
    are data shards), mp the rest."""
    alone = Layout.of_options(options)
    n = n_devices // alone.pp
    dp = default_dp if n % (default_dp * alone.cp) == 0 and not alone.pipelined else 1
    dp = math.lcm(dp, options.get(EP, 1))
    return Layout(dp=dp, mp=max(n // (dp * alone.cp), 1), **options)


def _from_mesh(cls, mesh, options: dict) -> Layout:
    sizes = axis_sizes(mesh)
    pp = options.pop("pp", sizes.get(PP, 1))
    if pp != sizes.get(PP, 1):
        raise MeshError(f"pp={pp} but the mesh has {sizes.get(PP, 1)} pipeline stage(s); make them equal")
    cp = {CP: sizes[CP]} if CP in sizes else {}
    # ep borrows devices from the data axis: the layout's dp counts every batch shard, dp x ep here
    ep = sizes.get(EP, 1)
    if (asked := options.pop(EP, ep)) != ep:
        raise MeshError(f"ep={asked} but the mesh has {ep} expert shard(s); make them equal")
    dims = {axis: sizes[axis] * (ep if axis == DP else 1) for axis in MESH_AXES}
    # A cp the mesh lacks: a (dp, cp, mp) mesh of the same dp and mp, made on first use.
    built = mesh if options.get(CP, sizes.get(CP, 1)) == sizes.get(CP, 1) else None
    return cls(**dims, pp=pp, **({EP: ep} if ep > 1 else {}), **{**cp, **options}, built_mesh=built)


def _label(layout: Layout) -> str:
    """Each axis's (before, after, last) pieces around the always-present sizes and the options."""
    before, after, last = ("".join(parts) for parts in zip(*(a.label(layout) for a in AXES), strict=True))
    text = before + "x".join(str(getattr(layout, a.name)) for a in AXES if a.always) + after
    return text + "".join(f" + {o.upper()}" for o in OPTIONS if getattr(layout, o)) + last


def _check_seq_len(layout: Layout, seq_len: int) -> None:
    cp, mp = layout.cp, layout.mp
    if cp > 1 and seq_len % (2 * cp):
        raise ShardingError(
            f"--cp {cp} splits the sequence into 2 x cp = {2 * cp} load-balanced chunks, but "
            f"--seq-len {seq_len} is not divisible by {2 * cp}; use e.g. --seq-len "
            f"{_next_multiple(seq_len, 2 * cp)}"
        )
    per = cp * mp  # under sp each cp shard's part of the sequence splits over mp
    if layout.sp and mp > 1 and seq_len % per:
        over = f"mp={mp}" if cp == 1 else f"cp x mp = {per}"
        fix = _next_multiple(seq_len, math.lcm(per, 2 * cp if cp > 1 else 1))
        raise ShardingError(
            f"--sp splits the sequence over {over}, but --seq-len {seq_len} is not divisible "
            f"by it; use e.g. --seq-len {fix}"
        )


def _check_batch(layout: Layout, batch_size: int, accum_steps: int | None) -> None:
    m = layout.pipeline_microbatches
    rows = layout.dp * (accum_steps or 1) * m
    if batch_size % rows == 0:
        return
    fix = f"use e.g. --batch-size {_next_multiple(batch_size, rows)}"
    if m > 1:
        raise ConfigError(
            f"--batch-size {batch_size} is not a multiple of dp x accum_steps x microbatches = "
            f"{layout.dp} x {accum_steps or 1} x {m}; {fix}"
        )
    if accum_steps is None:
        raise ConfigError(
            f"--batch-size {batch_size} is not a multiple of dp={layout.dp} (--mesh {layout.dp}x{layout.mp} "
            f"is DPxMP); {fix}"
        )
    raise ConfigError(
        f"--batch-size {batch_size} is not a multiple of dp x accum_steps = {layout.dp} x "
        f"{accum_steps}; {fix}"
    )


def _pipeline_config(layout: Layout):
    from meshlm.parallel.pipeline_schedule import PipelineConfig

    return PipelineConfig(layout.pp, layout.microbatches, layout.pp_schedule, layout.virtual_stages)


def _next_multiple(n: int, k: int) -> int:
    return (n // k + 1) * k


def axis_sizes(mesh) -> dict[str, int]:
    """Each axis of a jax ``mesh`` and its size: with ``Layout.of``, the one place a mesh's shape is
    read."""
    return {name: mesh.shape[name] for name in mesh.axis_names}
