"""Run outputs: metrics.jsonl (one JSON object a line), TensorBoard events, the loss-curve PNG.

Only process 0 writes. On resume, rows after the restored step (written after the last checkpoint,
before a crash) are dropped, so the file has no duplicated or missing steps.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

OUTPUTS = ("metrics.jsonl", "tensorboard", "loss_curve.png")  # what a run writes besides checkpoints


class MetricsLog:
    def __init__(self, out: Path, enabled: bool = True):
        self.path = out / "metrics.jsonl"
        self.enabled = enabled
        self._tb = None
        if enabled:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(out / "tensorboard"))

    def truncate_after(self, step: int, redo_eval: bool = False) -> None:
        """Keep rows with step <= ``step`` (and drop a torn last line); atomic rewrite. With
        ``redo_eval`` the evaluation at ``step`` itself is dropped too, because the run does it again
        (a fresh start evaluates at step 0; a finished run evaluates at its last step)."""
        if not self.enabled or not self.path.exists():
            return
        rows = []
        for line in self.path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line torn by a crash mid-write
            again = redo_eval and row.get("step") == step and "val_loss" in row
            if row.get("step", 0) <= step and not again:
                rows.append(line)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(r + "\n" for r in rows))
        os.replace(tmp, self.path)

    def write(self, row: dict) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        for key, value in row.items():
            if key != "step" and isinstance(value, int | float):
                self._tb.add_scalar(key, value, row["step"])

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()

    def rows(self) -> list[dict]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]


def plot_loss_curve(rows: list[dict], out: Path) -> Path:
    """loss_curve.png: train loss per step and validation loss at each evaluation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train, strict=True), label="train loss", lw=1)
    if val:
        ax.plot(*zip(*val, strict=True), "o-", label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/byte)")
    ax.legend()
    ax.grid(alpha=0.3)
    path = out / "loss_curve.png"
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path
