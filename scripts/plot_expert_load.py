"""Plot a mixture-of-experts run's expert load per step from its metrics.jsonl (``train.routing``).

    PYTHONPATH=src python scripts/plot_expert_load.py RUN/metrics.jsonl --out docs/images/expert-load.png

Top: each expert's share of the step's token-choices (``expert_load`` over its sum; 1/E is perfect
balance, dashed), the mean over the MoE layers. Bottom: the load's coefficient of variation and the
fraction of token-choices the capacity dropped (``moe_dropped_fraction``; 0 dropless).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def train_rows(path: Path) -> list[dict]:
    """The train rows of ``path`` that carry routing metrics, in step order."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted((r for r in rows if "expert_load" in r), key=lambda r: r["step"])


def plot(rows: list[dict], out: Path) -> Path:
    if not rows:
        raise SystemExit("no train rows with expert_load: train a mixture-of-experts model first")
    steps = [r["step"] for r in rows]
    n_experts = len(rows[0]["expert_load"])
    share = [[x / sum(r["expert_load"]) for x in r["expert_load"]] for r in rows]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True, height_ratios=(2, 1))
    for e in range(n_experts):
        top.plot(steps, [s[e] for s in share], label=f"expert {e}")
    top.axhline(1 / n_experts, color="grey", linestyle="--", linewidth=1, label="balanced (1/E)")
    top.set_ylabel("share of token-choices")
    top.legend(fontsize=8, ncol=min(n_experts + 1, 5))
    bottom.plot(steps, [r["expert_load_cv"] for r in rows], label="load CV (std / mean)")
    dropped = [r["moe_dropped_fraction"] for r in rows]
    bottom.plot(steps, dropped, label="token-choices dropped by the capacity (fraction)")
    bottom.set_xlabel("step")
    bottom.legend(fontsize=8)
    fig.suptitle("expert load per step (mean over the MoE layers)")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("metrics", type=Path, help="a run's metrics.jsonl")
    ap.add_argument("--out", type=Path, default=Path("docs/images/expert-load.png"))
    args = ap.parse_args()
    print(plot(train_rows(args.metrics), args.out))


if __name__ == "__main__":
    main()
