"""Run outputs: metrics.jsonl (one JSON object a line), TensorBoard events, the loss-curve PNG.

Only process 0 writes. On resume, rows after the restored step (written after the last checkpoint,
before a crash) are dropped, so the file has no duplicated or missing steps.

Nothing is written through a symbolic link: opening the log first refuses outputs that are links
or special files, and every write goes through ``meshlm.train.outputs`` (see its doc for the rule).
"""

from __future__ import annotations

import json
import os
import secrets
import time
import warnings
from pathlib import Path

from meshlm.train import outputs
from meshlm.train.config import METRICS

TENSORBOARD, LOSS_CURVE = "tensorboard", "loss_curve.png"
SETTINGS = "settings.toml"  # the run's resolved settings (``meshlm train --settings`` reads it)
OUTPUTS = (METRICS, TENSORBOARD, LOSS_CURVE, SETTINGS)  # what a run writes besides checkpoints


def check_run_outputs(out: Path) -> None:
    """Refuse outputs of ``out`` that are links or special files (``outputs.check_outputs``). A
    collective; opening a MetricsLog calls it, before anything is written."""
    outputs.check_outputs(out, files=(METRICS, LOSS_CURVE, SETTINGS), dirs=(TENSORBOARD,))


def _summary_writer_class():
    """tensorboardX's SummaryWriter, imported without torch. tensorboardX imports torch whenever it is
    installed (the test extra has it), only to accept torch tensors: ~1.7 s of CPU at every ``meshlm
    train`` start, more than JAX's import; the values written here are Python numbers. With ``None`` in
    ``sys.modules`` an ``import torch`` raises ImportError, which tensorboardX's import catches (its
    code path without torch). A process that has torch already (or tensorboardX) imports as usual."""
    import sys

    if "torch" in sys.modules or "tensorboardX" in sys.modules:
        from tensorboardX import SummaryWriter

        return SummaryWriter
    sys.modules["torch"] = None
    try:
        from tensorboardX import SummaryWriter
    finally:
        if sys.modules.get("torch", 0) is None:  # our marker, not a torch imported meanwhile
            del sys.modules["torch"]
    return SummaryWriter


class MetricsLog:
    def __init__(self, out: Path, enabled: bool = True):
        """A collective (the output check): construct it on every process, enabled on process 0."""
        self.path = out / METRICS
        self.enabled = enabled
        self._tb = None
        check_run_outputs(out)
        if enabled:
            SummaryWriter = _summary_writer_class()
            # A random suffix: the default event file name (second and host) is guessable, so a
            # link planted under it could be written through.
            suffix = f".{secrets.token_hex(4)}"
            self._tb = SummaryWriter(str(out / TENSORBOARD), filename_suffix=suffix)

    def truncate_after(self, step: int, redo_eval: bool = False) -> None:
        """Keep rows with step <= ``step`` (and drop a torn last line); atomic rewrite. With
        ``redo_eval`` the evaluation at ``step`` itself is dropped too, because the run does it again
        (a fresh start evaluates at step 0; a finished run evaluates at its last step)."""
        text = outputs.read_text(self.path) if self.enabled else None
        if text is None:
            return
        rows = []
        for line in text.splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line torn by a crash mid-write
            again = redo_eval and row.get("step") == step and "val_loss" in row
            if row.get("step", 0) <= step and not again:
                rows.append(line)
        # A new file even when nothing is dropped: this also breaks a hard link to a copy elsewhere.
        outputs.replace_text(self.path, "".join(r + "\n" for r in rows))

    def set_aside_earlier(self) -> None:
        """A run starting at step 0 (no checkpoint to resume from) in a directory whose metrics.jsonl
        holds rows: an earlier run's, which rewriting would lose. Rename the file aside, with a
        warning, as resume moves a bad step aside: nothing is lost and the run does not dead-end."""
        text = outputs.read_text(self.path) if self.enabled else None
        rows = sum(1 for line in (text or "").splitlines() if line.strip())
        if not rows:
            return
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        target, n = self.path.with_name(f"{METRICS}.earlier-{stamp}"), 1
        while target.exists():
            n += 1
            target = self.path.with_name(f"{METRICS}.earlier-{stamp}-{n}")
        os.rename(self.path, target)
        warnings.warn(
            f"{self.path} holds {rows} rows of an earlier run, but {self.path.parent} has no checkpoint "
            f"to resume from; moved it aside to {target.name} and starting at step 0",
            stacklevel=2,
        )

    def write(self, row: dict) -> None:
        if not self.enabled:
            return
        outputs.append_text(self.path, json.dumps(row) + "\n")
        for key, value in row.items():
            if key != "step" and isinstance(value, int | float):
                self._tb.add_scalar(key, value, row["step"])

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()

    def rows(self) -> list[dict]:
        return [json.loads(line) for line in outputs.lines(self.path) if line.strip()]


def compare_curves(compare: str, out: str) -> tuple[tuple[str, str], list[dict]] | None:
    """((this run's label, the other's), the other run's rows) for ``plot_loss_curve``; None without
    --compare. Labels: the directories' names, or their paths where the names are the same."""
    if not compare:
        return None
    rows = [json.loads(line) for line in outputs.lines(Path(compare) / METRICS) if line.strip()]
    names = (Path(out).name, Path(compare).name)
    return (names if names[0] != names[1] else (out, compare)), rows


def plot_loss_curve(rows: list[dict], out: Path, unit: str = "nats/token", compare=None) -> Path:
    """loss_curve.png: train and validation loss per token (``unit``) on the left axis, validation bits
    per byte (comparable across tokenizers) on its own right axis; with ``compare``
    (``compare_curves``) another run's the same, dashed, each series labelled with its run."""
    fig = loss_figure(rows, unit, compare)  # selects the Agg backend before pyplot is imported here
    import matplotlib.pyplot as plt

    try:
        return outputs.replace_file(
            out / LOSS_CURVE, lambda f: fig.savefig(f, format="png", dpi=100, bbox_inches="tight")
        )
    finally:
        plt.close(fig)


# A curve: (metrics.jsonl key, label, marker, line style, color, on the right axis)
CURVES = (
    ("loss", "train loss", "", "-", "tab:blue", False),
    ("val_loss", "validation loss", "o", "-", "tab:orange", False),
    ("val_bpb", "val_bpb (right)", "s", "--", "tab:green", True),
)


def loss_figure(rows: list[dict], unit: str, compare=None):
    """The loss curve's matplotlib figure (see ``plot_loss_curve``)."""
    outputs.isolate_matplotlib()  # first: nothing written under $HOME
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    runs = [("", rows, None)]
    if compare is not None:  # each series labelled with its run; the other run's dotted and lighter
        (mine, theirs), other = compare
        runs = [(f" ({mine})", rows, None), (f" ({theirs})", other, ":")]
    right = ax.twinx() if any("val_bpb" in r for _, rs, _ in runs for r in rs) else None
    lines = []
    for suffix, rs, dotted in runs:
        for key, label, marker, ls, color, on_right in CURVES:
            points = [(r["step"], r[key]) for r in rs if key in r]
            if points:
                style = dict(marker=marker, ls=dotted or ls, color=color, alpha=0.6 if dotted else 1.0)
                style.update(lw=1) if key == "loss" else None
                axis = right if on_right else ax
                lines += axis.plot(*zip(*points, strict=True), label=label + suffix, **style)
    ax.set_xlabel("step")
    ax.set_ylabel(f"loss ({unit})")
    if right is not None:
        right.set_ylabel("validation bits per byte")
    if lines:
        ax.legend(lines, [line.get_label() for line in lines], fontsize="small")
    ax.grid(alpha=0.3)
    return fig
