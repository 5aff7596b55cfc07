"""Compare mixture-of-experts runs' expert-load balance from their metrics.jsonl: a table and an SVG.

    PYTHONPATH=src python scripts/expert_load_cv.py "bias 1e-2=RUN_A/metrics.jsonl" \\
        "bias frozen=RUN_B/metrics.jsonl" --every 5 --svg docs/images/expert-load-cv.svg

Each run's train rows carry ``expert_load_cv`` (the load's coefficient of variation, std / mean over the
experts, the mean over the MoE layers; 0 is perfect balance) and ``expert_load`` (token-choices per
expert in the step's global batch; ``train.routing``). Prints a Markdown table of the means over
``--every`` steps (the CV, the smallest expert's load, the loss) per run, and writes a line plot of the
CV per step, one line per run: plain SVG text (no plotting library), so the same metrics give the same
file byte for byte.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd")
W, H, PAD = 640, 320, 48  # the SVG's size and the margin around the plot area, in pixels


def series(path: Path) -> list[dict]:
    """{step, cv, min_load, loss} per train row of ``path`` that carries the routing metrics."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = sorted((r for r in rows if "expert_load_cv" in r), key=lambda r: r["step"])
    if not rows:
        raise SystemExit(f"{path}: no train rows with expert_load_cv: train a mixture-of-experts model")
    return [
        dict(step=r["step"], cv=r["expert_load_cv"], min_load=min(r["expert_load"]), loss=r["loss"])
        for r in rows
    ]


def windows(rows: list[dict], every: int) -> list[dict]:
    """Means over consecutive groups of ``every`` steps: {steps: "a–b", cv, min_load, loss}."""
    out = []
    for i in range(0, len(rows), every):
        group = rows[i : i + every]
        mean = lambda k, g=group: sum(r[k] for r in g) / len(g)
        out.append(
            dict(
                steps=f"{group[0]['step']}–{group[-1]['step']}",
                **{k: mean(k) for k in ("cv", "min_load", "loss")},
            )
        )
    return out


def table(runs: dict[str, list[dict]], every: int) -> str:
    """A Markdown table: one row per window, per run its mean CV, smallest load and loss."""
    names = list(runs)
    cols = [f"CV, {n}" for n in names] + [f"min load, {n}" for n in names] + [f"loss, {n}" for n in names]
    lines = ["| steps | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    per_run = [windows(runs[n], every) for n in names]
    for row in zip(*per_run, strict=False):
        cells = [f"{w['cv']:.2f}" for w in row] + [f"{w['min_load']:.1f}" for w in row]
        cells += [f"{w['loss']:.3f}" for w in row]
        lines.append(f"| {row[0]['steps']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def svg(runs: dict[str, list[dict]], title: str) -> str:
    """The CV per step of each run as SVG polylines, with axes, ticks and a legend."""
    steps = [r["step"] for rows in runs.values() for r in rows]
    x0, x1 = min(steps), max(max(steps), min(steps) + 1)
    top = max(r["cv"] for rows in runs.values() for r in rows) * 1.1 or 1.0
    x = lambda s: PAD + (s - x0) / (x1 - x0) * (W - 2 * PAD)
    y = lambda v: H - PAD - v / top * (H - 2 * PAD)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
        'font-family="sans-serif" font-size="11">',
        f'<rect width="{W}" height="{H}" fill="white"/>',
        f'<text x="{W / 2}" y="18" text-anchor="middle" font-size="13">{title}</text>',
        f'<line x1="{PAD}" y1="{H - PAD}" x2="{W - PAD}" y2="{H - PAD}" stroke="black"/>',
        f'<line x1="{PAD}" y1="{PAD}" x2="{PAD}" y2="{H - PAD}" stroke="black"/>',
        f'<text x="{W / 2}" y="{H - 12}" text-anchor="middle">step</text>',
        f'<text x="14" y="{H / 2}" text-anchor="middle" transform="rotate(-90 14 {H / 2})">'
        "load CV (std / mean)</text>",
    ]
    for k in range(5):  # y ticks at fifths of the range, x ticks at the ends and between
        v, s = top * k / 4, x0 + (x1 - x0) * k / 4
        parts.append(f'<text x="{PAD - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:.2f}</text>')
        parts.append(f'<text x="{x(s):.1f}" y="{H - PAD + 16}" text-anchor="middle">{s:.0f}</text>')
    for i, (name, rows) in enumerate(runs.items()):
        colour = COLOURS[i % len(COLOURS)]
        points = " ".join(f"{x(r['step']):.1f},{y(r['cv']):.1f}" for r in rows)
        parts.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{points}"/>')
        ly = PAD + 14 * i
        parts.append(
            f'<line x1="{W - PAD - 120}" y1="{ly}" x2="{W - PAD - 100}" y2="{ly}" '
            f'stroke="{colour}" stroke-width="2"/>'
        )
        parts.append(f'<text x="{W - PAD - 95}" y="{ly + 4}">{name}</text>')
    return "\n".join([*parts, "</svg>", ""])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="LABEL=PATH/metrics.jsonl, one per run")
    ap.add_argument("--every", type=int, default=5, help="steps per row of the table")
    ap.add_argument("--svg", type=Path, help="write the CV per step here")
    ap.add_argument("--title", default="expert load's coefficient of variation per step")
    args = ap.parse_args()
    if any("=" not in r for r in args.runs):
        raise SystemExit("each run is LABEL=PATH/metrics.jsonl, e.g. 'bias 1e-2=runs/a/metrics.jsonl'")
    runs = {label: series(Path(path)) for label, path in (r.split("=", 1) for r in args.runs)}
    print(table(runs, args.every))
    if args.svg:
        args.svg.parent.mkdir(parents=True, exist_ok=True)
        args.svg.write_text(svg(runs, args.title))
        print(args.svg)


if __name__ == "__main__":
    main()
