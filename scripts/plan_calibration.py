"""The planner's calibration cases compiled ahead of time, one JSON line each: argument, output, alias,
temporary bytes and the peak (argument + output - alias + temp) of the real train step, as
``meshlm plan`` compiles it (``perf.plan_calibration``: qwen3-0.6b and llama3.2-1b, 2048-token rows,
bf16, remat full/selective/none, batch 1/2/4/8, remat full's batch 8 in 4 and 8 micro-batches, and
llama3.2-1b's batch 2 and 4 with bf16 moments, mesh 1x1: 30 cases). Run the same script on a CPU
host and on the chip: the pairs are what ``plan_calibration.CORRECTIONS`` is fitted on.

    PYTHONPATH=src python scripts/plan_calibration.py                       # this host's compiler
    PYTHONPATH=src python scripts/plan_calibration.py --chip v5e            # on the chip: its compiler
    PYTHONPATH=src python scripts/plan_calibration.py --chip v5e --compiler chip   # libtpu, no chip
    PYTHONPATH=src python scripts/plan_calibration.py --chip v5e --fit cpu.jsonl v5e.jsonl  # the fit
    ... --fit cpu.jsonl v5e.jsonl --held-out llama3.2-1b   # fitted on the rest, its error on these apart

Each case compiles in a process of its own (nothing runs unless --run); one that takes more than
--timeout seconds is skipped with a note line. Measured on a 2-core CPU host shared with other jobs
(load 20): XLA:CPU 20-80 s of compile a case with remat full or selective, 240 s with none; XLA:TPU
for compile-only devices 11 minutes a case (70 s of CPU time). The first line names the machine,
its memory limit, JAX and libtpu; the last the wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
MACHINE = "machine"  # the first line's child: the machine's facts


def run_case(name: str, chip: str | None, compiler: str, run: bool = False) -> dict:
    """One case compiled ahead of time on the target (``plan_target.resolve``) as ``perf.plan.measure``
    compiles it: its figures (bytes); with ``run`` (on the chip), whether one step then runs."""
    from meshlm.errors import is_out_of_memory
    from meshlm.model.config import get_config
    from meshlm.parallel.compile_target import compiling_for
    from meshlm.parallel.layout import Layout
    from meshlm.perf.bench import compiled_memory
    from meshlm.perf.plan import abstract_step, analytic, refused
    from meshlm.perf.plan_calibration import SEQ_LEN, parse_case
    from meshlm.perf.plan_settings import PlanSettings
    from meshlm.perf.plan_target import resolve

    config, remat, batch, accum, opt_dtype = parse_case(name)
    target = resolve(chip, compiler, 1)
    # --attention auto for 2048-token rows without --cp: flash on a TPU, plain elsewhere
    attention = "flash" if target.platform == "tpu" else "plain"
    cfg = get_config(config).replace(attention=attention)
    settings = PlanSettings(
        batch_size=batch,
        seq_len=SEQ_LEN,
        accum_steps=accum,
        compute_dtype="bfloat16",
        remat=remat,
        opt_dtype=opt_dtype,
    )
    layout = target.place(Layout(dp=1, mp=1))
    a = analytic(cfg, layout, settings)  # the state's temporaries: what a correction does not scale
    line = {"case": name, "attention": attention, "compiler": target.describe()}
    line["state_temp"] = a["gradients"] + a["moment_copies"] + a["gathered"]
    with compiling_for(target.platform):
        step, *args = abstract_step(cfg, layout, settings)
        start = time.perf_counter()
        try:
            compiled = step.lower(*args).compile()
        except Exception as e:  # noqa: BLE001 - XLA:TPU refuses a program over the chip's memory
            if not is_out_of_memory(e):
                raise
            return {**line, **refused(e, *args, time.perf_counter() - start)}
    line |= {**compiled_memory(compiled), "compile_s": round(time.perf_counter() - start, 1)}
    return line | ({"ran": runs(compiled, args)} if run else {})


def runs(compiled, args) -> bool | str:
    """One step of ``compiled`` on zeros (the step's donated state, placed by its shardings): True,
    or the device's out-of-memory message: whether the plan's verdict holds on the chip."""
    import jax
    import jax.numpy as jnp

    from meshlm.errors import is_out_of_memory

    try:
        arrays = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype, device=s.sharding), args)
        jax.block_until_ready(compiled(*arrays))
    except Exception as e:  # noqa: BLE001 - only the device's out-of-memory is an answer
        if not is_out_of_memory(e):
            raise
        return str(e).strip().splitlines()[0][:300]
    return True


def one(case: str, chip: str | None, compiler: str, run: bool) -> None:
    """Compile ``case`` here and print its line (a child process: on a chip, the parent never holds
    the TPU, which one process at a time may use)."""
    if case == MACHINE:
        print(json.dumps(machine(chip, compiler)), flush=True)
        return
    os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")  # as `meshlm plan`: the
    # buffer plan is the same without LLVM's optimisation, in half the compile time
    print(json.dumps(run_case(case, chip, compiler, run)), flush=True)


def machine(chip: str | None, compiler: str) -> dict:
    import jax

    from meshlm.perf.plan_target import libtpu_version

    device = jax.devices()[0]
    try:
        limit = (device.memory_stats() or {}).get("bytes_limit")
    except Exception:  # noqa: BLE001 - a CPU reports no memory statistics
        limit = None
    return {
        "machine": device.device_kind,
        "backend": jax.default_backend(),
        "bytes_limit": limit,
        "jax": jax.__version__,
        "libtpu": libtpu_version(),
        "chip": chip,
        "compiler": compiler,
    }


def main() -> int:
    from meshlm.perf.plan_calibration import case_names

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chip", default=None, help="plan for this chip (perf.plan_target.CHIPS), e.g. v5e")
    p.add_argument("--compiler", default="auto", help="auto | chip | host, as `meshlm plan --compiler`")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds one case may compile")
    p.add_argument("--cases", nargs="*", default=None, help="of the cases, these (default: all)")
    p.add_argument(
        "--run", action="store_true", help="on the chip: also run one step of each (ran: true or OOM)"
    )
    p.add_argument("--fit", nargs=2, metavar=("HOST", "CHIP"), help="fit the correction of two runs' lines")
    held = "with --fit: the cases starting so are not fitted on, their error stated apart"
    p.add_argument("--held-out", nargs="*", default=(), help=held)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.fit:
        from meshlm.perf.plan_calibration import fit, read_lines

        fitted = fit(read_lines(a.fit[0]), read_lines(a.fit[1]), a.chip or "v5e", tuple(a.held_out))
        print(json.dumps(fitted.describe(), indent=1))
        print(repr(fitted))
        return 0
    if a.one:
        one(a.one, a.chip, a.compiler, a.run)
        return 0
    start = time.perf_counter()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])),
    }
    for case in [MACHINE, *(a.cases or case_names())]:
        argv = [sys.executable, __file__, "--one", case, "--compiler", a.compiler]
        argv += (["--chip", a.chip] if a.chip else []) + (["--run"] if a.run else [])
        t0 = time.perf_counter()
        try:
            done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=a.timeout)
        except subprocess.TimeoutExpired:
            print(json.dumps({"case": case, "skipped": f"compile over {a.timeout:.0f} s"}), flush=True)
            continue
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode or not lines:
            error = (done.stderr.strip().splitlines() or ["no output"])[-1]
            print(json.dumps({"case": case, "skipped": f"failed: {error}"}), flush=True)
            continue
        wall = {} if case == MACHINE else {"wall_s": round(time.perf_counter() - t0, 1)}
        print(json.dumps({**json.loads(lines[-1]), **wall}), flush=True)
    print(json.dumps({"total_s": round(time.perf_counter() - start, 1)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
