"""Where a training step's time goes on the device: a profile of each implementation ``meshlm bench`` built.

Issues 63 and 64 ask for the time of a step measured, not guessed: XLA:TPU's cost model
(``scripts/remat_cost.py``) misled twice (docs/benchmarks.md). This runs ``meshlm bench ARGS`` as it is
(its JSON line first, unchanged), then, with every implementation compiled and warm, traces ``--steps``
more steps of each implementation alone under ``jax.profiler`` and summarises the device's ops from
the Perfetto JSON (``decode_profile.device_ops``: self times of the "XLA Ops" line on a TPU, the XLA
client's threads on CPU): the device's op time a step against the step's wall time, the ops a step,
the time by XLA's category of op (``hlo_category`` in a TPU trace: convolution = the matmuls, loop
fusion, data formatting, custom-call = the Pallas kernels, ...; on CPU the op's name), and the top ops
with their HLO text. One JSON line a profile: ``{"profile": impl, ...}``.

    PYTHONPATH=src python scripts/step_profile.py [--steps 3] -- --config qwen3-moe-100m --mesh 1x1 \
        --batch-size 8 --seq-len 512 --bf16 --impls ragged_dot-dispatch,dense-eq --steps 3
    PYTHONPATH=src python scripts/step_profile.py --cpu-smoke      # tiny-llama, CPU, seconds

The chip report's ``profile`` group runs it for the MoE and Qwen3-0.6B steps (scripts/chip_report.py).
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

SMOKE = ("--config", "tiny-llama", "--mesh", "1x1", "--batch-size", "2", "--seq-len", "32", "--steps", "5")
SMOKE += ("--impls", "meshlm")


def _decode_profile():
    """scripts/decode_profile.py as a module (its trace reading: one reader for both scripts)."""
    path = Path(__file__).with_name("decode_profile.py")
    spec = importlib.util.spec_from_file_location("decode_profile", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def categories(ops: list[tuple[str, float]], details: dict[str, str], steps: int) -> list[dict]:
    """Milliseconds a step by the ops' category (the trace's ``hlo_category``, else the op's name less
    its number: ``fusion.12`` -> ``fusion``), largest first."""
    total = collections.Counter()
    for name, us in ops:
        total[category(name, details.get(name, ""))] += us
    whole = sum(total.values()) or 1.0
    return [
        {"category": c, "ms_per_step": us / 1e3 / steps, "share": us / whole} for c, us in total.most_common()
    ]


def category(name: str, detail: str) -> str:
    """An op's kind: what XLA:TPU's trace calls it where it does (a category has no '=' or '('), else
    its name less its instance number."""
    if detail and "=" not in detail and "(" not in detail:
        return detail
    return name.split(".")[0].rstrip("0123456789_-") or name


def profile(impl, steps: int, dp) -> dict:
    """``steps`` steps of one warm implementation under ``jax.profiler``: its summary."""
    import time

    import jax

    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            start = time.perf_counter()
            for _ in range(steps):
                impl.step()
            wall = time.perf_counter() - start
        events = dp._perfetto(Path(tmp))
    ops, details = dp.device_ops(events)
    names = {name for name, _ in ops}
    hlo = {n: details[n] for n in names if n in details}
    cats = _categories_of(events, names)
    summary = dp.summarise(ops, steps, hlo)
    for row in summary["top_ops"]:
        row["hlo"] = hlo.get(row["op"], "")[:160]
    return {
        "profile": impl.name,
        "steps": steps,
        "wall_ms_per_step": 1e3 * wall / steps,
        **summary,
        "categories": categories(ops, cats, steps),
    }


def _categories_of(events: list[dict], names: set[str]) -> dict[str, str]:
    """Each op's ``hlo_category`` in the trace (a TPU's; CPU traces have none: ""), in one pass."""
    out = dict.fromkeys(names, "")
    for e in events:
        if e.get("name") in names and not out[e["name"]] and "hlo_category" in (e.get("args") or {}):
            out[e["name"]] = str(e["args"]["hlo_category"])
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="steps traced an implementation (default 3)")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny-llama on CPU: " + " ".join(SMOKE))
    parser.add_argument("bench", nargs="*", help="meshlm bench's arguments (after --)")
    a = parser.parse_args()
    bench_args = list(SMOKE if a.cpu_smoke else a.bench)
    if not bench_args:
        parser.error("give meshlm bench's arguments after --, e.g. -- --config llama-100m --mesh 1x1")
    import meshlm.perf.bench as bench
    from meshlm.cli import main as meshlm

    dp, built, timed = _decode_profile(), [], bench.time_interleaved

    def keep(impls, *args, **kwargs):  # bench's own timing, unchanged; the warm implementations kept
        built.extend(impls)
        return timed(impls, *args, **kwargs)

    bench.time_interleaved = keep
    try:
        code = meshlm(["bench", *bench_args, "--json"])
    finally:
        bench.time_interleaved = timed
    if code:
        return code
    for impl in built:
        report = profile(impl, a.steps, dp)
        _print(report)
        print(json.dumps(report))
    return 0


def _print(r: dict) -> None:
    lines = [
        f"profile {r['profile']}: {r['wall_ms_per_step']:.2f} ms wall a step, "
        f"{r['device_ms_per_step']:.2f} ms of device ops, {r['ops_per_step']:.0f} ops a step",
        *(f"  {c['ms_per_step']:9.3f} ms {c['share']:6.1%}  {c['category']}" for c in r["categories"][:12]),
        "  top ops:",
        *(
            f"  {o['ms_per_step']:9.3f} ms {o['share']:6.1%} x{o['calls']:<5d} {o['op']}  {o['hlo'][:100]}"
            for o in r["top_ops"]
        ),
    ]
    print("\n".join(lines), file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
