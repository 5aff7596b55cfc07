"""The pipeline schedule as a picture: stage x time, forward / backward / idle (for ``plan --schedule-png``).

Time is in units of one chunk's forward or backward (both drawn the same length). A lock-step tick takes
one unit for each kind of slot some stage runs in it: the forward half first, then the backward half, so
the idle area of the picture is the schedule's bubble (``schedule_facts(cfg).bubble_fraction``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from meshlm.parallel.pipeline_schedule import ScheduleTable

COLORS = {"F": ("#4C72B0", "#A1C4E8"), "B": ("#55A868", "#A8DBB4")}  # per kind: even / odd virtual stage


@dataclass(frozen=True)
class Box:
    stage: int
    start: int  # in units
    kind: str  # "F" or "B"
    microbatch: int
    chunk: int


def schedule_boxes(table: ScheduleTable) -> tuple[list[Box], int]:
    """(one box per slot, the step's length in units)."""
    boxes, start = [], 0
    for t in range(len(table.cells[0])):
        kinds = [k for k in "FB" if any(s.kind == k for row in table.cells for s in row[t])]
        for offset, kind in enumerate(kinds):
            for d, row in enumerate(table.cells):
                boxes += [
                    Box(d, start + offset, s.kind, s.microbatch, s.chunk) for s in row[t] if s.kind == kind
                ]
        start += len(kinds)
    return boxes, start


def draw_schedule(table: ScheduleTable, path: Path) -> Path:
    """Write the schedule's picture to ``path`` (PNG), replacing it whole."""
    from meshlm.train.outputs import isolate_matplotlib

    isolate_matplotlib()  # nothing written under $HOME
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from meshlm.train.outputs import replace_file

    cfg = table.config
    boxes, units = schedule_boxes(table)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.32 * units), 0.55 * cfg.pp + 1.2))
    for b in boxes:
        virtual = b.chunk // cfg.pp
        ax.broken_barh(
            [(b.start, 1)], (b.stage - 0.4, 0.8), facecolors=COLORS[b.kind][virtual % 2], edgecolor="white"
        )
        ax.text(b.start + 0.5, b.stage, str(b.microbatch), ha="center", va="center", fontsize=7)
    ax.set_xlim(0, units)
    ax.set_ylim(cfg.pp - 0.5, -0.5)
    ax.set_yticks(range(cfg.pp), [f"stage {d}" for d in range(cfg.pp)])
    ax.set_xlabel("time (one unit: a chunk's forward or backward); white: idle")
    v = f", V={cfg.virtual_stages}" if cfg.virtual_stages > 1 else ""
    bubble = 1 - len(boxes) / (units * cfg.pp)
    ax.set_title(f"{cfg.schedule}: pp={cfg.pp}, M={cfg.microbatches}{v}; bubble {bubble:.1%}", fontsize=10)
    try:
        return replace_file(Path(path), lambda f: fig.savefig(f, format="png", dpi=100, bbox_inches="tight"))
    finally:
        plt.close(fig)
