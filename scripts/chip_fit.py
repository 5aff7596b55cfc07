"""Which real-size runs fit one chip as planned, without the chip's compiler rematerialising on its own.

XLA:TPU plans its buffers against the chip's memory: a step over it is refused ("Ran out of memory
on HBM"), and one near it is first *rematerialised by the compiler* (instructions cloned as
``NAME.remat`` in the compiled HLO), which fits it but recomputes what the remat policy meant to keep:
qwen3-0.6b, batch 4 x 2048, ``--remat selective`` planned 18.4 GB and ran slower a token than
``--remat full`` (docs/benchmarks.md). This script compiles each case ahead of time for a compile-only
chip (libtpu: ``perf.plan_target``; no chip needed) as ``meshlm plan --chip v5e`` does, and prints one
JSON line a case: XLA's memory analysis (argument, output, alias, temp and ``peak``, argument + output
- alias + temp: ``meshlm plan``'s and ``meshlm bench``'s figure), the compiler's own peak
(``peak_memory``, ``memory_analysis().peak_memory_in_bytes``) and the chip's memory heap from XLA's
memory-usage report (``hbm``: the arguments and the temporaries' allocation in the chip's main
memory), the instructions the compiler rematerialised (``remat_clones``, their shapes
``remat_shapes``), or the refusal. On XLA:TPU the memory analysis's temp counts more than the heap
holds (the real-size runs here: 0.5-2.7 GiB more), so ``peak`` can exceed the chip's memory where the step
runs (the selective batch-4 run above: 18.4 GB planned, 16.0 GB of heap). A case ``fits`` where it
compiled, its ``peak_memory`` is within the chip's usable memory and nothing was rematerialised;
``plan_fits``: the plan's verdict (``peak`` within it).

    PYTHONPATH=src python scripts/chip_fit.py --chip v5e > fit.jsonl                # the default grid
    PYTHONPATH=src python scripts/chip_fit.py --cases qwen3-0.6b/b4/selective/float32

A case is CONFIG/bBATCH/REMAT/OPT_DTYPE (2048-token rows, bf16 compute, ``--loss-chunk 512``, mesh 1x1).
Over the default grid each CONFIG/REMAT/OPT_DTYPE tries batch 8, 4, 2 and stops at the first that fits
(the largest batch that does; ``--no-descend``: every batch). Each case compiles in a process of its own.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
SEQ_LEN, LOSS_CHUNK = 2048, 512
BATCHES = (8, 4, 2)
REMATS = ("full", "selective", "save_qkv_proj", "save_qkv_mlp_in")
# llama3.2-1b's float32 AdamW state alone (1.24B parameters x 12 bytes, + 4 of gradients) is over a
# v5e's 15.75 GiB: its grid is the bf16 moments' (``--opt-dtype bf16``)
GRID = [("qwen3-0.6b", o) for o in ("float32", "bf16")] + [("llama3.2-1b", "bf16")]


def run_case(name: str, chip: str) -> dict:
    """Compile case ``name`` for a compile-only ``chip`` and return its line (see the docstring)."""
    from meshlm.errors import is_out_of_memory
    from meshlm.model.config import get_config
    from meshlm.parallel.compile_target import compiling_for
    from meshlm.parallel.layout import Layout
    from meshlm.perf.bench import compiled_memory
    from meshlm.perf.plan import abstract_step, refused
    from meshlm.perf.plan_settings import PlanSettings
    from meshlm.perf.plan_target import resolve

    config, rows, remat, opt_dtype = name.split("/")
    target = resolve(chip, "chip", 1)
    cfg = get_config(config).replace(attention="flash", loss_chunk=LOSS_CHUNK)  # --attention auto at 2048
    settings = PlanSettings(
        batch_size=int(rows[1:]), seq_len=SEQ_LEN, compute_dtype="bfloat16", remat=remat, opt_dtype=opt_dtype
    )
    line = {"case": name, "usable": target.chip.usable_bytes}
    dump = tempfile.mkdtemp(prefix="chip_fit_")
    with compiling_for(target.platform):
        step, *args = abstract_step(cfg, target.place(Layout(dp=1, mp=1)), settings)
        start = time.perf_counter()
        try:
            compiled = step.lower(*args).compile({"xla_dump_to": dump})
        except Exception as e:  # noqa: BLE001 - XLA:TPU refuses a program over the chip's memory
            if not is_out_of_memory(e):
                raise
            return {**line, **refused(e, *args, time.perf_counter() - start), "fits": False}
    line |= {**compiled_memory(compiled), "compile_s": round(time.perf_counter() - start, 1)}
    line["peak_memory"] = compiled.memory_analysis().peak_memory_in_bytes
    line["hbm"] = heap_bytes(dump)
    clones = dict(re.findall(r"%([\w.-]+\.remat\d*) = (\S+) ", compiled.as_text()))  # name -> shape
    line["remat_clones"] = len(clones)
    line["remat_shapes"] = sorted({s.split("{")[0] for s in clones.values()})  # what was recomputed
    # the compiler's own peak (its buffer heap: arguments and temporaries as placed) is what the chip
    # holds; the memory analysis's argument + temp counts more on XLA:TPU (``plan_fits``: that rule's)
    line["plan_fits"] = line["peak"] <= line["usable"]
    line["fits"] = line["peak_memory"] <= line["usable"] and line["remat_clones"] == 0
    return line


def heap_bytes(dump: str) -> int | None:
    """The chip's main-memory heap of the step from XLA's dump: its memory-usage report's default
    memory space (arguments and the temporaries' allocation; the on-chip VMEM apart)."""
    found = glob.glob(os.path.join(dump, "*jit_step*memory-usage-report.txt"))
    if not found:
        return None
    text = open(found[0]).read()
    total = re.search(r"Memory Space: default \(color=0\)\nTotal bytes: (\d+)", text)
    return int(total.group(1)) if total else None


def grid() -> list[list[str]]:
    """The default cases as runs of one CONFIG/REMAT/OPT_DTYPE, largest batch first."""
    return [[f"{c}/b{b}/{r}/{o}" for b in BATCHES] for c, o in GRID for r in REMATS]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chip", default="v5e", help="the chip compiled for (perf.plan_target.CHIPS)")
    p.add_argument(
        "--cases", nargs="*", default=None, help="CONFIG/bBATCH/REMAT/OPT_DTYPE (default: the grid)"
    )
    p.add_argument("--no-descend", dest="descend", action="store_false", help="every batch of the grid")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds one case may compile")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        print(json.dumps(run_case(a.one, a.chip)), flush=True)
        return 0
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])),
    }
    for run in [[c] for c in a.cases] if a.cases else grid():
        for case in run:
            argv = [sys.executable, __file__, "--one", case, "--chip", a.chip]
            try:
                done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=a.timeout)
                lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
                line = json.loads(lines[-1]) if lines else {"case": case, "failed": done.stderr[-300:]}
            except subprocess.TimeoutExpired:
                line = {"case": case, "skipped": f"compile over {a.timeout:.0f} s"}
            print(json.dumps(line), flush=True)
            if a.descend and line.get("fits"):
                break  # the largest batch that fits as planned
    return 0


if __name__ == "__main__":
    sys.exit(main())
