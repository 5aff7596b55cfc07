"""``Layout``: the mesh's axis sizes and the parallelism options, one validated value.

Everything that depends on how the computation is laid out over devices takes a ``Layout``: the
rules table (which axes split which parameter dimensions), the parallel context layers compute in
(``parallel()``), the train step, the proof, the planner, generation, and checkpoint metadata. The
divisibility rules a layout imposes on sizes outside the model (the batch over ``dp``, the sequence
over ``mp`` under ``sp``) are stated here, once, as one-line errors; the model's own dimensions are
the rules table's (``sharding.rules``).

A ``Layout`` is built from sizes (``Layout(dp=2, mp=2, fsdp=True)``, validated before any device is
touched) or from an existing mesh (``Layout.of(mesh, ...)``: the one place a mesh's shape is read).
Its ``mesh`` is made from the sizes on first use, or is the one it was built from.

Adding an axis (pipeline, context parallelism) is: a field here and its name in ``axes.MESH_AXES``
(sizes, the mesh, reports and checkpoint meta follow them), its rules-table entries, its
collectives in ``parallel.context``, its proof controls.

This module must not import JAX at module level: the CLI validates layouts before choosing devices.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from meshlm.errors import ConfigError, MeshError, ShardingError
from meshlm.parallel.axes import CP, DP, MESH_AXES, MP

OPTIONS = ("fsdp", "sp")  # the memory options, by their field (and flag) names
CP_STRATEGIES = ("ring", "allgather")  # how attention reaches the other cp shards' keys and values


@dataclass(frozen=True)
class Layout:
    dp: int = 1  # data-parallel shards: the batch's rows (and, with fsdp, weights) split over them
    mp: int = 1  # model-parallel shards: heads, hidden units and the vocabulary split over them
    fsdp: bool = False  # FSDP (ZeRO-3): weights and AdamW moments also split over dp
    sp: bool = False  # sequence parallelism: activations between blocks split over the sequence on mp
    cp: int = 1  # context-parallel shards: the sequence split over them (load-balanced chunks i, 2cp-1-i)
    cp_strategy: str = "ring"  # ring: K/V passed around cp (ppermute); allgather: K/V gathered per layer
    # The mesh this layout was built from (``of``), or made on first use: not part of the value.
    built_mesh: Any = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self):
        for name in (*MESH_AXES, CP):
            size = getattr(self, name)
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise MeshError(f"mesh axis {name} must be a positive integer, got {size!r}")
        for name in OPTIONS:
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        _check_strategy(self.cp_strategy)

    @classmethod
    def of(cls, where, **options) -> Layout:
        """``where`` as a Layout: a Layout (with ``options`` replaced), or a jax Mesh with ``options``
        (the memory options default off)."""
        if isinstance(where, Layout):
            if options.get("cp", where.cp) != where.cp:  # another cp is another mesh (made on first use)
                options = {**options, "built_mesh": None}
            return dataclasses.replace(where, **options) if options else where
        sizes = axis_sizes(where)
        cp = {CP: sizes[CP]} if CP in sizes else {}
        # A cp the mesh lacks: a (dp, cp, mp) mesh of the same dp and mp, made on first use.
        mesh = where if options.get(CP, sizes.get(CP, 1)) == sizes.get(CP, 1) else None
        return cls(**{axis: sizes[axis] for axis in MESH_AXES}, **{**cp, **options}, built_mesh=mesh)

    @property
    def mesh(self):
        """The jax Mesh (dp, mp) of this layout (``parallel.mesh.make_mesh`` on first use)."""
        if self.built_mesh is None:
            from meshlm.parallel.mesh import make_mesh

            shape = self.shape
            object.__setattr__(self, "built_mesh", make_mesh(*shape.values(), axes=tuple(shape)))
        return self.built_mesh

    @property
    def devices(self) -> int:
        return math.prod(self.shape.values())

    @property
    def shape(self) -> dict[str, int]:
        """{axis name: size}, e.g. {"dp": 2, "mp": 2} (what reports and checkpoint meta show); the mesh's
        axes in order: with cp > 1, {"dp", "cp", "mp"} (a cp of 1 is no axis: 2-D meshes are unchanged)."""
        if self.cp == 1:
            return {axis: getattr(self, axis) for axis in MESH_AXES}
        return {DP: self.dp, CP: self.cp, MP: self.mp}

    def replace(self, **changes) -> Layout:
        return dataclasses.replace(self, **changes)

    def parallel(self, par_cls=None):
        """The parallel context layers compute in, inside ``shard_map`` over this layout's mesh."""
        from meshlm.parallel.context import Parallel

        cp = dict(cp=self.cp, cp_strategy=self.cp_strategy) if self.cp > 1 else {}
        return (par_cls or Parallel)(mp=self.mp, dp=self.dp, sharded=True, sp=self.sp, **cp)

    def label(self) -> str:
        """The mesh and the options that are on: "2x2", "2x2 + FSDP + SP", "1x2 + CP2 ring"."""
        cp = f" + CP{self.cp} {self.cp_strategy}" if self.cp > 1 else ""
        return f"{self.dp}x{self.mp}" + cp + "".join(f" + {o.upper()}" for o in OPTIONS if getattr(self, o))

    def to_dict(self) -> dict[str, Any]:
        """What checkpoint metadata records (``from_dict`` reads it back)."""
        cp = {"cp_strategy": self.cp_strategy} if self.cp > 1 else {}
        return {**self.shape, **{o: getattr(self, o) for o in OPTIONS}, **cp}

    @classmethod
    def from_dict(cls, d: dict) -> Layout:
        unknown = sorted(set(d) - {*MESH_AXES, CP, *OPTIONS, "cp_strategy"})
        if unknown:
            valid = ", ".join((*MESH_AXES, CP, *OPTIONS, "cp_strategy"))
            raise ConfigError(f"unknown layout field(s) {unknown}; valid: {valid}")
        return cls(**d)

    # --- the divisibility rules of sizes outside the model ------------------------------------
    def check_seq_len(self, seq_len: int) -> None:
        """With ``sp`` the sequence is split over mp: it must divide (a ShardingError, as for any
        dimension the mesh does not divide: ``verify --matrix`` lists such cells as skipped). With cp
        it is cut into 2 x cp chunks (each shard holds chunks i and 2cp-1-i), then over mp under sp."""
        if self.cp > 1 and seq_len % (2 * self.cp):
            raise ShardingError(
                f"--cp {self.cp} splits the sequence into 2 x cp = {2 * self.cp} load-balanced chunks, but "
                f"--seq-len {seq_len} is not divisible by {2 * self.cp}; use e.g. --seq-len "
                f"{_next_multiple(seq_len, 2 * self.cp)}"
            )
        per = self.cp * self.mp  # under sp each cp shard's part of the sequence splits over mp
        if self.sp and self.mp > 1 and seq_len % per:
            over = f"mp={self.mp}" if self.cp == 1 else f"cp x mp = {per}"
            fix = _next_multiple(seq_len, math.lcm(per, 2 * self.cp if self.cp > 1 else 1))
            raise ShardingError(
                f"--sp splits the sequence over {over}, but --seq-len {seq_len} is not divisible "
                f"by it; use e.g. --seq-len {fix}"
            )

    def check_batch(self, batch_size: int, accum_steps: int | None = None) -> None:
        """The global batch splits into ``accum_steps`` micro-batches, each over dp."""
        rows = self.dp * (accum_steps or 1)
        if batch_size % rows == 0:
            return
        fix = f"use e.g. --batch-size {_next_multiple(batch_size, rows)}"
        if accum_steps is None:
            raise ConfigError(
                f"--batch-size {batch_size} is not a multiple of dp={self.dp} (--mesh {self.dp}x{self.mp} "
                f"is DPxMP); {fix}"
            )
        raise ConfigError(
            f"--batch-size {batch_size} is not a multiple of dp x accum_steps = {self.dp} x "
            f"{accum_steps}; {fix}"
        )


def _check_strategy(strategy: str) -> None:
    if strategy not in CP_STRATEGIES:
        raise ConfigError(f"--cp-strategy {strategy!r} is not one of {', '.join(CP_STRATEGIES)}; pick one")


def _next_multiple(n: int, k: int) -> int:
    return (n // k + 1) * k


def axis_sizes(mesh) -> dict[str, int]:
    """Each axis of a jax ``mesh`` and its size: with ``Layout.of``, the one place a mesh's shape is
    read (a pipeline's mesh, whose ``pp`` axis is not yet a Layout field, is read here too)."""
    return {name: mesh.shape[name] for name in mesh.axis_names}
