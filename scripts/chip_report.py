"""The chip report: every figure docs/benchmarks.md's chip tables quote, in one process, one call.

Chip time is the scarce resource (a session gets minutes of it, one command at a time, each program
that opens the chip pays ~15 s), so every measurement runs in this one process: each job is a
``meshlm`` command line (``bench``, ``plan``, ...) called in-process through ``meshlm.cli.main`` with
its ``--json`` output captured, or a script's ``main()`` (its arguments' ``{out}`` replaced by the
report's ``--out``, for the small files it writes there: scripts/int8_quality.py's figure). Jobs run in
the order of their groups; a job that would start after ``--budget`` seconds is skipped and said so, so
the report always comes back. It writes ``chip_report.json`` (every job's argv, wall seconds, exit
code, parsed output or error line) and ``chip_report.md`` (one table a group: what docs/benchmarks.md's
tables hold).

On the device machine (the repository root; the set-up line installs what its index lacks, then this):

    PYTHONPATH=src python scripts/chip_report.py --out $OUT [--groups attention,qwen3] [--budget 500]

The jobs and their groups are ``scripts/chip_jobs.py``'s. ``--list`` prints them; ``--cpu-smoke`` runs
every group's first job at a tiny shape on CPU (``tests/test_chip_report.py`` runs it), so the report's
plumbing is tested where CI is.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import io
import json
import os
import re
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path


def _sibling(name: str):
    """scripts/NAME.py as a module (a script's sibling: scripts/ is no package, and the tests load this
    file by its path)."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


_jobs = _sibling("chip_jobs")
Job, GROUPS, ALONE, INT8, OUT = _jobs.Job, _jobs.GROUPS, _jobs.ALONE, _jobs.INT8, _jobs.OUT
_int8_jobs, _kernel_jobs, _profile_jobs = _jobs._int8_jobs, _jobs._kernel_jobs, _jobs._profile_jobs


@dataclass
class Result:
    job: Job
    seconds: float = 0.0
    compile_seconds: float = 0.0  # XLA compilations in the job (jax_log_compiles), the rest is running
    code: int | None = None
    output: dict | None = None
    error: str | None = None
    notes: list[str] = field(default_factory=list)


def _alone_ratios(results: list[Result]) -> list[str]:
    """A row for each job pair "NAME alone: meshlm" and "NAME alone: meshlm-int8" that both ran: the
    int8 step's median over the float one's (two bench runs in one process: unpaired, unlike bench's
    own ratio of an interleaved pair)."""
    medians = {}
    for res in results:
        if ALONE in res.job.name and res.output and res.output.get("results"):
            name, impl = res.job.name.split(ALONE)
            medians.setdefault(name, {})[impl] = res.output["results"][0]["step_s_median"]
    rows = []
    for name, m in medians.items():
        if {"meshlm", INT8} <= set(m):
            ratio = m[INT8] / m["meshlm"]
            speed = f"{ratio:.3f} = {1 / ratio:.2f}x"
            rows.append(f"| {name} | {INT8}/meshlm step time (alone, unpaired) | {speed} | | | | |")
    return rows


def _script_main(path: str):
    """``scripts/NAME.py ARGS...`` as a callable(argv) -> exit code: its ``main()`` with ``sys.argv`` set
    (in this process: the chip admits one program at a time)."""
    spec = importlib.util.spec_from_file_location(Path(path).stem, Path(__file__).parent / Path(path).name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)

    def call(argv: list[str]) -> int:
        saved, sys.argv = sys.argv, [path, *argv]
        try:
            return module.main() or 0
        finally:
            sys.argv = saved

    return call


def run_job(job: Job, argv: tuple[str, ...]) -> Result:
    """``meshlm ARGV`` (or ``scripts/NAME.py ARGS``) in this process; its stdout's last JSON line is the
    output (a script's every JSON line, when it prints several)."""
    from meshlm.cli import main

    script = argv[0].startswith("scripts/")
    res, out, err = Result(job), io.StringIO(), io.StringIO()
    start = time.perf_counter()
    try:
        with (
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(err),
            _environ(dict(job.env)),
            _compiles() as compiles,
        ):
            res.code = _script_main(argv[0])(list(argv[1:])) if script else main(list(argv))
    except BaseException as e:  # noqa: BLE001 - a job's failure is a row of the report, not the end of it
        if isinstance(e, KeyboardInterrupt):
            raise
        res.code = getattr(e, "code", None) if isinstance(e, SystemExit) else -1
        res.error = f"{type(e).__name__}: {e}"[:2000]
        res.notes.append(traceback.format_exc()[-1500:])
    res.seconds = time.perf_counter() - start
    res.compile_seconds = sum(t for t, _ in compiles)
    res.notes += [f"compiled {name} in {t:.1f} s" for t, name in sorted(compiles, reverse=True)[:5]]
    lines = [ln for ln in out.getvalue().splitlines() if ln.startswith("{")]
    if lines:
        try:
            res.output = (
                json.loads(lines[-1])
                if not script or len(lines) == 1
                else {"lines": [json.loads(line) for line in lines]}
            )
        except json.JSONDecodeError as e:
            res.error = res.error or f"unparsable JSON output: {e}"
    if res.code and not res.error:
        res.error = (err.getvalue().strip().splitlines() or ["(no message)"])[-1][:2000]
    _release()
    return res


@contextlib.contextmanager
def _environ(values: dict[str, str]):
    """``os.environ`` with ``values`` set inside, restored after."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _compiles():
    """Collect (seconds, program) of every XLA compilation inside: where a job's time goes."""
    import logging

    import jax

    found: list[tuple[float, str]] = []
    pattern = re.compile(r"Finished XLA compilation of (.+) in ([0-9.]+) sec")

    class Collect(logging.Handler):
        def emit(self, record):
            if m := pattern.search(record.getMessage()):
                found.append((float(m.group(2)), m.group(1)[:80]))

    handler, logger = Collect(logging.WARNING), logging.getLogger("jax")
    logger.addHandler(handler)
    was, logger.propagate = logger.propagate, False  # the lines are data here, not the log's
    jax.config.update("jax_log_compiles", True)
    try:
        yield found
    finally:
        jax.config.update("jax_log_compiles", False)
        logger.removeHandler(handler)
        logger.propagate = was


def _persistent_cache() -> None:
    """Jobs share programs (the parameter initialisers of one preset, the peak matmuls): ``_release``
    drops the in-memory caches, so a disk cache makes the second compile of each a read."""
    import jax

    jax.config.update("jax_compilation_cache_dir", "/tmp/meshlm-chip-cache")
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def _release() -> None:
    """Drop the finished job's executables and buffers before the next one compiles."""
    import jax

    jax.clear_caches()
    gc.collect()


# --- the report ---------------------------------------------------------------------------------


def _gb(x) -> str:
    return "" if x is None else f"{x / 1e9:.2f}"


def _bench_rows(res: Result) -> list[str]:
    rows = []
    for r in res.output.get("results", []):
        mem = r.get("bytes_per_device", {}).get("compiled", {})
        mfu = "" if r.get("mfu_spec") is None else f"{r['mfu_spec']:.3f}"
        if r.get("mfu_spec_int8") is not None:  # the int8 step: over the spec int8 peak too
            mfu += f" (int8 peak {r['mfu_spec_int8']:.3f})"
        loss = r.get("loss", float("nan"))
        rows.append(
            f"| {res.job.name} | {r['impl']} | {r['step_s_median'] * 1e3:.2f} | {r['tokens_per_s']:,.0f} | "
            f"{mfu} | {_gb(mem.get('peak'))} | {loss:.4f} |"
        )
    if ratio := res.output.get("step_time_ratios", {}).get(f"{INT8}/meshlm"):  # < 1: int8 the faster
        paired = ratio["paired"]
        speed = f"{paired:.3f} = {1 / paired:.2f}x"
        rows.append(f"| {res.job.name} | {INT8}/meshlm step time (paired) | {speed} | | | | |")
    for key in (
        ("generation_by_batch", "moe") if res.output.get("generation_by_batch") else ("generation", "moe")
    ):
        if res.output.get(key):
            rows.append(f"| {res.job.name} | {key} | {json.dumps(res.output[key])[:600]} | | | | |")
    return rows


def _plan_row(res: Result) -> list[str]:
    """A plan's compiled peak (the compiler of the machine it ran on), its parts, and the analytic one."""
    plan = res.output.get("plan") or {}
    c, a = plan.get("compiled") or {}, plan.get("analytic") or {}
    parts = "/".join(_gb(c.get(k)) for k in ("argument", "output", "alias", "temp"))
    return [
        f"| {res.job.name} | plan ({res.output.get('backend')}) | {c.get('compile_s', 0):.0f} s compile | "
        f"arg/out/alias/temp {parts} | analytic {_gb(a.get('peak'))} | {_gb(c.get('peak'))} | |"
    ]


def _profile_rows(res: Result) -> list[str]:
    """scripts/step_profile.py's profiles: wall and device ms a step, and the three largest categories."""
    rows = []
    for p in (line for line in res.output["lines"] if "profile" in line):
        top = ", ".join(f"{c['category']} {c['ms_per_step']:.1f}" for c in p["categories"][:3])
        rows.append(
            f"| {res.job.name} | {p['profile']} profile | {p['wall_ms_per_step']:.2f} | "
            f"device {p['device_ms_per_step']:.2f} ms, {p['ops_per_step']:.0f} ops | {top} | | |"
        )
    return rows


def _quality_rows(res: Result) -> list[str]:
    """scripts/int8_quality.py's two runs (step time, MFU, last validation loss) and their ratio."""
    q, runs = res.output["quality"], res.output["runs"]
    rows = []
    for name, r in runs.items():
        ms, mfu = r.get("step_ms_median"), r.get("mfu_median")
        cells = (
            res.job.name,
            name,
            "" if ms is None else f"{ms:.2f}",
            "",
            "" if mfu is None else f"{mfu:.3f}",
        )
        cells += ("", f"{r['val_loss'][str(q['step'])]:.4f}")  # the keys of parsed JSON: strings
        rows.append("|" + "|".join(f" {c} " if c else " " for c in cells) + "|")
    ratio = f"{q['val_loss_ratio']:.4f} (train, last steps: {q['train_loss_tail_ratio']:.4f})"
    ok = "within" if q["within_target"] else "NOT within"
    rows.append(f"| {res.job.name} | int8/bf16 val loss, step {q['step']} | {ratio}, {ok} 2% | | | | |")
    return rows


def _write_rows(res: Result) -> list[str]:
    """scripts/kv_write.py's rows: us a cache write by XLA's scatter and by the kernel, same cache or not."""
    return [
        f"| {res.job.name} | batch {r['batch']} {res.output['dtype']}: scatter / kernel us a write | "
        f"{r.get('scatter_us', '')} / {r.get('kernel_us', '')} | "
        f"same cache: {r.get('equal', r.get('error'))} | | | |"
        for r in res.output["rows"]
    ]


def _decode_row(res: Result) -> list[str]:
    """scripts/decode_profile.py's step: wall, device ops and inside programs a step, against the roofline."""
    o, t = res.output, res.output["trace"]
    roof = o["roofline"]["ms"]
    over = f", {t['wall_ms_per_step'] / roof:.2f}x roofline {roof:.3f} ms" if roof else ""
    inside = t.get("program_ms_per_step")
    inside = "" if inside is None else f", {inside:.3f} ms inside programs"
    return [
        f"| {res.job.name} | decode {o['config']} batch {o['batch']} {o['dtype']} | "
        f"{t['wall_ms_per_step']:.3f} | device ops {t['device_ms_per_step']:.3f} ms{inside}, "
        f"{t['ops_per_step']:.0f} ops{over} | | | |"
    ]


def _chunks_row(res: Result) -> list[str]:
    """scripts/decode_chunks.py's ms a decode step at each chunk length and single steps."""
    o = res.output
    steps = ", ".join(f"{k} {v:.3f} ms" for k, v in o["ms_per_step"].items())
    roof = "" if o.get("roofline_ms") is None else f"roofline {o['roofline_ms']:.3f} ms"
    return [
        f"| {res.job.name} | decode batch {o['batch']} {o['dtype']}: {steps} | same tokens: "
        f"{o['same_tokens']} | {roof} | | | |"
    ]


def markdown(results: list[Result], header: str) -> str:
    out = [header, ""]
    for group in dict.fromkeys(r.job.group for r in results):
        out += [f"## {group}", "", "| job | impl | step ms | tokens/s | MFU (spec) | peak GB | loss |"]
        out.append("|---|---|---|---|---|---|---|")
        for res in (r for r in results if r.job.group == group):
            if res.output is None:
                out.append(f"| {res.job.name} | {res.error or 'skipped'} | {res.seconds:.0f} s | | | | |")
            elif "results" in res.output:
                out += _bench_rows(res)
            elif "quality" in res.output:
                out += _quality_rows(res)
            elif "rows" in res.output:  # scripts/kv_write.py: a write's time each way, by batch
                out += _write_rows(res)
            elif "lines" in res.output:  # scripts/step_profile.py: bench's line, then a profile an impl
                out += _profile_rows(res)
            elif "trace" in res.output:  # scripts/decode_profile.py: a decode step's trace
                out += _decode_row(res)
            elif "ms_per_step" in res.output:  # scripts/decode_chunks.py: chunk lengths side by side
                out += _chunks_row(res)
            else:
                out += _plan_row(res)
        out += _alone_ratios([r for r in results if r.job.group == group])
        out.append("")
    return "\n".join(out)


def _environment() -> dict:
    import jax

    dev = jax.devices()[0]
    stats = getattr(dev, "memory_stats", lambda: None)() or {}
    return {
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "device_kind": dev.device_kind,
        "device_count": jax.device_count(),
        "bytes_limit": stats.get("bytes_limit"),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="chip-report", help="directory for chip_report.json and chip_report.md")
    p.add_argument("--groups", default=",".join(GROUPS), help=f"comma list of {', '.join(GROUPS)}")
    p.add_argument(
        "--only",
        default=None,
        help="comma list: run only the jobs whose name contains one of these, in this list's order",
    )
    p.add_argument("--budget", type=float, default=500.0, help="start no job after this many seconds")
    p.add_argument("--cpu-smoke", action="store_true", help="each group's smoke jobs on CPU, tiny shapes")
    p.add_argument("--list", action="store_true", help="print the jobs and exit")
    args = p.parse_args(argv)
    unknown = [g for g in args.groups.split(",") if g not in GROUPS]
    if unknown:
        p.error(f"--groups: unknown {', '.join(unknown)}; known: {', '.join(GROUPS)}")
    jobs = [j for g in args.groups.split(",") for j in GROUPS[g]()]
    if args.only:  # the jobs matching, in the order of the texts that name them (the priority)
        parts = args.only.split(",")
        first = lambda j: min((i for i, part in enumerate(parts) if part in j.name), default=None)
        jobs = sorted((j for j in jobs if first(j) is not None), key=first)
    if args.cpu_smoke:
        jobs = [j for j in jobs if j.smoke]
    if args.list:
        for j in jobs:
            env = "".join(f"{k}={v} " for k, v in j.env)
            print(f"{j.group:10s} {j.name:40s} {env}meshlm {' '.join(j.smoke if args.cpu_smoke else j.argv)}")
        return 0
    return _run(jobs, args)


def _run(jobs: list[Job], args) -> int:
    t0 = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = _environment()
    if not args.cpu_smoke and env["backend"] == "cpu":
        print("chip_report: no accelerator here (JAX's backend is cpu); run it on the chip, or --cpu-smoke")
        return 2
    if not args.cpu_smoke:
        _persistent_cache()
    results: list[Result] = []
    for job in jobs:
        if time.perf_counter() - t0 > args.budget:
            results.append(Result(job, error=f"skipped: past the {args.budget:.0f} s budget"))
            continue
        argv = tuple(a.replace(OUT, str(out)) for a in (job.smoke if args.cpu_smoke else job.argv))
        res = run_job(job, argv)
        results.append(res)
        line = {"job": job.name, "s": round(res.seconds, 1), "compile_s": round(res.compile_seconds, 1)}
        print(json.dumps({**line, "code": res.code, "error": res.error}), flush=True)
        _write(out, env, results, time.perf_counter() - t0)
    _write(out, env, results, time.perf_counter() - t0)
    return 0


def _write(out: Path, env: dict, results: list[Result], seconds: float) -> None:
    doc = {
        "environment": env,
        "seconds": round(seconds, 1),
        "jobs": [
            {
                "group": r.job.group,
                "name": r.job.name,
                "argv": ["meshlm", *r.job.argv],
                "env": dict(r.job.env),
                "seconds": round(r.seconds, 2),
                "compile_seconds": round(r.compile_seconds, 2),
                "code": r.code,
                "error": r.error,
                "output": r.output,
                "notes": r.notes,
            }
            for r in results
        ],
    }
    (out / "chip_report.json").write_text(json.dumps(doc, indent=1))
    header = f"# Chip report: {env['device_kind']}, {env['date_utc']} UTC, JAX {env['jax']}, {seconds:.0f} s"
    (out / "chip_report.md").write_text(markdown(results, header))


if __name__ == "__main__":
    sys.exit(main())
