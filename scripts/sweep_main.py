"""The sweep that chose the main job's defaults (`meshlm train` without flags): preset, mesh, batch,
learning rate, warm-up and steps, each run as the real command, from start-up to the sample.

Each candidate is one `meshlm train --fresh --json` subprocess; we record its wall time (everything:
imports, data, compile, evaluations, checkpoints, the sample), the final val_bpb, the median train
tokens/s from its metrics.jsonl, and the sample's first line. On a shared machine absolute times are
inflated: compare candidates run side by side (--parallel runs several at once, so they share the
load alike) and against the `today` row, the defaults before the sweep, run in the same batch.

    python scripts/sweep_main.py --out runs/sweep                     # every candidate, one at a time
    python scripts/sweep_main.py --out runs/sweep --only today,default --parallel 2

Prints a Markdown table (also written to OUT/sweep.md, with every summary in OUT/sweep.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def flags(mesh: str, batch: int, steps: int, lr: float, warmup: int = 20, *extra: str) -> list[str]:
    return ["--mesh", mesh, "--batch-size", str(batch), "--steps", str(steps), "--lr", str(lr),
            "--warmup-steps", str(warmup), *extra]  # fmt: skip


_END = ("--eval-every", "140", "--save-every", "280")  # evaluations at 0, 140, 280; a checkpoint at 280

# name -> `meshlm train` flags. `today`: the defaults before this sweep (1x4, rolled layer loop, evaluations
# every 50 steps, checkpoints every 100); `default`: no flags, the defaults it chose.
CANDIDATES: dict[str, list[str]] = {
    "today": flags("1x4", 32, 200, 3e-3, 20, "--unroll", "1", "--eval-every", "50", "--save-every", "100"),
    "default": [],
    "2x2-lr3e-3": flags("2x2", 32, 240, 3e-3),
    "2x2-lr6e-3": flags("2x2", 32, 240, 6e-3),
    "b16-lr6e-3": flags("2x2", 16, 480, 6e-3),
    "b16-lr1e-2": flags("2x2", 16, 480, 1e-2),
    "b16-lr2e-2": flags("2x2", 16, 480, 2e-2),
    "4x1-b16-lr1e-2": flags("4x1", 16, 480, 1e-2),
    # Issue 26's re-sweep (the step got faster: ~280 steps fit 5 minutes all in). Batch 32 on 2x2, an
    # evaluation half-way and at the end, one checkpoint at the end; val_bpb is compared at equal steps.
    **{
        f"s280-lr{lr}": flags("2x2", 32, 280, float(lr), 20, *_END)
        for lr in ("3e-3", "5e-3", "8e-3", "1.2e-2")
    },
    # Against s280-lr3e-3: a 2048-id BPE (more bytes per token, a larger embedding and head); the schedule's
    # ends (a 10-step warm-up, decay to 0 instead of lr * 0.1); no weight decay.
    "s280-bpe2048": flags("2x2", 32, 280, 3e-3, 20, *_END, "--tokenizer", "bpe-2048"),
    "s280-warm10-floor0": flags("2x2", 32, 280, 3e-3, 10, *_END, "--min-lr-ratio", "0"),
    "s280-wd0": flags("2x2", 32, 280, 3e-3, 20, *_END, "--weight-decay", "0"),
}


def run_one(name: str, flags: list[str], out: Path, python: str, devices: int) -> dict:
    run_dir = out / name
    cmd = [python, "-m", "meshlm", "train", "--devices", str(devices), "--fresh", "--json"]
    cmd += ["--out", str(run_dir), *flags]
    if run_dir.exists():
        raise SystemExit(f"{run_dir} exists; choose a new --out or delete it")
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode:
        return {"name": name, "flags": flags, "error": proc.stderr[-2000:], "wall_s": wall}
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    tok_s = statistics.median(r["tokens_per_s"] for r in rows if "tokens_per_s" in r)
    evals = [(r["step"], round(r["val_bpb"], 3)) for r in rows if "val_bpb" in r]
    return {"name": name, "flags": flags, "wall_s": wall, "tokens_per_s": tok_s, "evals": evals, **summary}


def table(results: list[dict]) -> str:
    lines = [
        "| candidate | flags | wall s (all) | train tok/s | val_bpb | sample (first line) |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['name']} | `{' '.join(r['flags'])}` | {r['wall_s']:.0f} | - | error | |")
            continue
        first = (r.get("sample") or "").splitlines()[0][:40].replace("|", "\\|")
        lines.append(
            f"| {r['name']} | `{' '.join(r['flags'])}` | {r['wall_s']:.0f} | {r['tokens_per_s']:.0f} "
            f"| {r['val_bpb_end']:.3f} | `{first}` |"
        )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="a new directory: one run directory per candidate")
    p.add_argument("--only", default="", help="comma-separated candidate names (default: all)")
    p.add_argument("--parallel", type=int, default=1, help="candidates run at once")
    p.add_argument("--devices", type=int, default=4, help="fake CPU devices per run")
    p.add_argument("--python", default=sys.executable, help="interpreter with meshlm installed")
    args = p.parse_args()
    names = [n for n in args.only.split(",") if n] or list(CANDIDATES)
    unknown = sorted(set(names) - set(CANDIDATES))
    if unknown:
        p.error(f"unknown candidate(s) {unknown}; valid: {', '.join(CANDIDATES)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        jobs = [pool.submit(run_one, n, CANDIDATES[n], out, args.python, args.devices) for n in names]
        results = [j.result() for j in jobs]
    (out / "sweep.json").write_text(json.dumps(results, indent=2) + "\n")
    text = table(results)
    (out / "sweep.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
