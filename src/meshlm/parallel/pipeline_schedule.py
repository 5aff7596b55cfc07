"""Pipeline schedules as data: which micro-batch each stage runs forward and backward at each tick.

The engine (``meshlm.parallel.pipeline``) runs in lock step: at every *tick* each device runs at most one
forward slot and one backward slot, then passes activations one stage on and cotangents one stage back
with ``lax.ppermute``. The same integer formulas below drive the engine (on traced ``jnp`` ints) and the
tables, facts and pictures here (on Python ints), so the table is the schedule the engine runs.

Layers are split into ``pp * V`` chunks of consecutive layers; chunk ``k = j * pp + d`` lives on device
``d`` as its virtual stage ``j`` (``V = 1``: one chunk per device). A micro-batch visits chunks 0, 1, ...
in order, one tick per hop; the hop from device ``pp - 1`` to device 0 (``V > 1``) is the circular one.
Micro-batches enter in groups of ``pp``: device ``d`` forwards its ``u``-th slot (``u = t - d``) for
micro-batch ``(u // (pp V)) pp + u % pp`` at virtual stage ``(u % (pp V)) // pp`` -- Megatron's
interleaved order; for ``V = 1`` simply micro-batch ``t - d``. Backward is the mirror image, offset by
``pp V - 1`` ticks so that the last chunk runs a micro-batch's backward in the tick of its forward.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshlm.errors import ConfigError

SCHEDULES = ("gpipe", "1f1b", "interleaved")


@dataclass(frozen=True)
class PipelineConfig:
    pp: int  # pipeline stages (devices on the pp axis)
    microbatches: int  # M: each step's batch is split into M micro-batches
    schedule: str = "1f1b"  # gpipe | 1f1b | interleaved
    virtual_stages: int = 1  # V: chunks of layers per device (interleaved only; non-adjacent chunks)

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            names = ", ".join(SCHEDULES)
            raise ConfigError(f"unknown pipeline schedule {self.schedule!r}; use one of {names}")
        if self.pp < 1 or self.microbatches < 1 or self.virtual_stages < 1:
            raise ConfigError(
                f"pp={self.pp}, microbatches={self.microbatches} and virtual stages="
                f"{self.virtual_stages} must each be at least 1"
            )
        interleaved = self.schedule == "interleaved"
        if interleaved and self.virtual_stages < 2:
            raise ConfigError("the interleaved schedule needs --virtual-stages 2 or more; use 1f1b for 1")
        if not interleaved and self.virtual_stages != 1:
            raise ConfigError(f"--virtual-stages {self.virtual_stages} needs --pp-schedule interleaved")
        if interleaved and self.microbatches % self.pp:
            raise ConfigError(
                f"the interleaved schedule runs micro-batches in groups of pp={self.pp}, but microbatches="
                f"{self.microbatches}; use a multiple of {self.pp} (at least {self.pp})"
            )

    @property
    def staged(self) -> bool:
        """More than one stage: activations pass between neighbours, and bubbles exist."""
        return self.pp > 1

    @property
    def chunks(self) -> int:
        """Chunks of consecutive layers along the pipeline: pp * V."""
        return self.pp * self.virtual_stages

    @property
    def forward_ticks(self) -> int:
        """Ticks from the first forward to the last: V M + pp - 1."""
        return self.virtual_stages * self.microbatches + self.pp - 1

    @property
    def stash_slots(self) -> int:
        """Micro-batches whose chunk residuals 1F1B keeps per device: a ring of 2 pp V - 1 (or all V M,
        if fewer)."""
        return min(2 * self.chunks - 1, self.virtual_stages * self.microbatches)


def check_layers(cfg: PipelineConfig, n_layers: int) -> None:
    if n_layers % cfg.chunks:
        raise ConfigError(
            f"{n_layers} layers cannot be split into pp x virtual stages = {cfg.pp} x {cfg.virtual_stages} "
            f"chunks of equal size; use a pp (and --virtual-stages) whose product divides {n_layers}"
        )


def check_batch(cfg: PipelineConfig, batch: int, dp: int = 1) -> None:
    if batch % (dp * cfg.microbatches):
        raise ConfigError(
            f"batch size {batch} is not divisible by dp x microbatches = {dp} x {cfg.microbatches}; "
            f"use a batch size that is a multiple of {dp * cfg.microbatches}"
        )


# --- the tick formulas (Python ints or traced jnp ints alike) ---------------------------------------
def _decode(cfg: PipelineConfig, u):
    """Slot counter u -> (valid, micro-batch, virtual stage in visiting order)."""
    group = cfg.pp * cfg.virtual_stages
    valid = (u >= 0) & (u < cfg.virtual_stages * cfg.microbatches)
    return valid, (u // group) * cfg.pp + u % cfg.pp, (u % group) // cfg.pp


def forward_slot(cfg: PipelineConfig, t, d):
    """(valid, micro-batch, virtual stage) device ``d`` runs forward at tick ``t``."""
    return _decode(cfg, t - d)


def backward_slot(cfg: PipelineConfig, t, d):
    """(valid, micro-batch, virtual stage) device ``d`` runs backward at tick ``t`` (1F1B/interleaved)."""
    valid, m, j = _decode(cfg, t - (cfg.chunks - 1) - (cfg.pp - 1 - d))
    return valid, m, cfg.virtual_stages - 1 - j


def forward_counter(cfg: PipelineConfig, m, j):
    """The forward slot counter (``t - d``) at which micro-batch ``m`` ran virtual stage ``j``."""
    return (m // cfg.pp) * cfg.chunks + j * cfg.pp + m % cfg.pp


# --- facts for the planner and bench ------------------------------------------------------------------
@dataclass(frozen=True)
class ScheduleFacts:
    bubble_fraction: float  # ideal idle share of each device's time: (pp-1) / (V M + pp - 1)
    permutes_per_step: int  # lax.ppermute calls a training step executes: 2 (V M + pp - 1)
    ticks: int  # lock-step ticks per step
    stashed_inputs: int  # micro-batches whose chunk residuals a device keeps at most (1F1B ring; GPipe: V M)


def schedule_facts(cfg: PipelineConfig) -> ScheduleFacts:
    """Ideal bubble and communication of one step. Each permute moves one micro-batch activation (or its
    cotangent) one stage; GPipe's backward permutes are the transposes of its forward ones.

    The bubble is the same for GPipe and 1F1B, (pp-1)/(M+pp-1); interleaving divides the fill and drain by
    V: (pp-1)/(V M+pp-1). 1F1B's gain is memory: ``stashed_inputs`` does not grow with M."""
    p, v, m = cfg.pp, cfg.virtual_stages, cfg.microbatches
    if cfg.schedule == "gpipe":
        ticks, stashed = 2 * cfg.forward_ticks, v * m
    else:
        ticks, stashed = cfg.forward_ticks + cfg.chunks - 1, cfg.stash_slots
    return ScheduleFacts(
        bubble_fraction=(p - 1) / (v * m + p - 1),
        permutes_per_step=2 * cfg.forward_ticks,
        ticks=ticks,
        stashed_inputs=stashed,
    )


# --- the table: stage x tick ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Slot:
    kind: str  # "F" forward or "B" backward
    microbatch: int
    chunk: int  # global chunk index j * pp + d (the layers it runs: chunk * n_layers / (pp V) onwards)


@dataclass(frozen=True)
class ScheduleTable:
    config: PipelineConfig
    cells: tuple[tuple[tuple[Slot, ...], ...], ...]  # [stage][tick] -> the slots run then (0, 1 or 2)

    def live_activations(self) -> tuple[int, ...]:
        """Per stage: the most micro-batch activations forwarded and not yet backwarded at once."""
        peaks = []
        for row in self.cells:
            live = peak = 0
            for cell in row:
                live += sum(s.kind == "F" for s in cell)
                peak = max(peak, live)
                live -= sum(s.kind == "B" for s in cell)
            peaks.append(peak)
        return tuple(peaks)

    def text(self) -> str:
        """One line per stage, one column per tick: F3 / B3 / F3B1 (both in one tick) / . (idle); with
        virtual stages each slot names its chunk too (F3c2: micro-batch 3 forward through chunk 2)."""
        chunks = self.config.virtual_stages > 1
        cells = [[_cell_text(c, chunks) for c in row] for row in self.cells]
        width = max(len(c) for row in cells for c in row)
        lines = [f"stage {d}: " + " ".join(c.ljust(width) for c in row) for d, row in enumerate(cells)]
        return "\n".join(line.rstrip() for line in lines)


def _cell_text(cell, chunks: bool) -> str:
    return "".join(f"{s.kind}{s.microbatch}" + (f"c{s.chunk}" if chunks else "") for s in cell) or "."


def schedule_table(cfg: PipelineConfig) -> ScheduleTable:
    """The schedule as a stage x tick table (what ``--schedule-png`` will draw)."""
    f_ticks = cfg.forward_ticks
    ticks = schedule_facts(cfg).ticks
    rows = []
    for d in range(cfg.pp):
        row = [[] for _ in range(ticks)]
        for t in range(f_ticks):
            valid, m, j = forward_slot(cfg, t, d)
            if valid:
                row[t].append(Slot("F", m, j * cfg.pp + d))
                if cfg.schedule == "gpipe":  # autodiff runs the forward ticks again in reverse
                    row[2 * f_ticks - 1 - t].append(Slot("B", m, j * cfg.pp + d))
        if cfg.schedule != "gpipe":
            for t in range(ticks):
                valid, m, j = backward_slot(cfg, t, d)
                if valid:
                    row[t].append(Slot("B", m, j * cfg.pp + d))
        rows.append(tuple(tuple(c) for c in row))
    return ScheduleTable(cfg, tuple(rows))
