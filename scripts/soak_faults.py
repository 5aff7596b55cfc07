"""Soak for the kills of issue 27: `meshlm data prepare` killed at random points, and `meshlm train`
interrupted (SIGINT / SIGTERM) at random points of its start-up.

Not part of the pytest suite or CI: it runs for minutes. Usage::

    python scripts/soak_faults.py --mode prepare [--kills 20] [--seed S] [--out DIR]
    python scripts/soak_faults.py --mode startup [--kills 20] [--seed S] [--out DIR]

prepare: a reference store is prepared first (and timed); then each round starts `data prepare` into
a new --out and kills the prepare process alone (SIGKILL, or SIGINT as a Ctrl-C would) after a random
delay within the reference's time. A round passes when no pool worker outlives the prepare (30 s);
the --out is either a complete store whose token files equal the reference's, or something neither
`train --data` nor a rerun of `data prepare` takes for a store (refused as incomplete, or holding no
visible file); and a SIGINT ends with one line, `meshlm: SIGINT: stopped; ...`, and exit 130.

startup: a reference run first (timing its start-up: the time to its first train row); then rounds
signal one victim directory after a random delay within that start-up (a few land in the loop),
SIGINT or SIGTERM at random. A round passes when the exit status is 128 + the signal; stderr holds no
traceback and ends with the one-line start-up message (and no checkpoint or train row was added) or
with the loop's "saved a checkpoint at step N" (N the newest checkpoint and train row); no run lock
is left. At the end the victim runs to completion and must equal the reference bit for bit.
"""

from __future__ import annotations

import argparse
import atexit
import json
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from soak_tools import (  # noqa: E402 - scripts/ is on sys.path when this script runs
    POLL_S,
    cleanup,
    complete_steps,
    exit_on_signal,
    finish,
    log_tail,
    make_corpus,
    read_rows,
    start,
    train_cmd,
    train_losses,
)

STEPS = 8  # the startup mode's runs: short, the kills aim at start-up
PROGRESS = ("prepare:", "train:", "data: ", "step 0: ")  # stderr lines that are not messages


def _messages(log: Path) -> list[str]:
    text = log.read_text(errors="replace").replace("\r", "\n")
    return [line for line in text.splitlines() if line.strip() and not line.startswith(PROGRESS)]


def _children(pid: int) -> set[int]:
    ps = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return {int(p) for p in ps.stdout.split()}


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (OSError, IndexError):
        return False


# ---------------------------------------------------------------- data prepare


def _prepare_cmd(corpus: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "meshlm", "data", "prepare", "--data", str(corpus), "--out", str(out)]


def _store_problem(out: Path, ref: Path) -> str | None:
    """What is wrong with what a killed prepare left in ``out`` (None: nothing)."""
    from meshlm.data.prepare import check_out
    from meshlm.data.store import is_store, open_store, store_arg
    from meshlm.errors import DataError

    if is_store(out):
        try:
            index = open_store(out).index
        except DataError as e:
            return f"a sealed store that does not open: {e}"
        want = json.loads((ref / "index.json").read_text())
        same = all(index["splits"][s]["crc32"] == want["splits"][s]["crc32"] for s in ("train", "val"))
        return None if same else "a complete store whose tokens differ from the reference's"
    if not out.exists() or not any(not p.name.startswith(".") for p in out.iterdir()):
        return None  # nothing visible: `train --data` finds no files in it, a rerun starts afresh
    for what, check in (("train --data", lambda: store_arg([out])), ("data prepare", lambda: check_out(out))):
        try:
            check()
        except DataError as e:
            if what == "data prepare" or "incomplete token store" in str(e):
                continue
            return f"{what} refused it for another reason: {e}"
        return f"{what} accepts an unfinished store: {sorted(p.name for p in out.iterdir())}"
    return None


def soak_prepare(args, work: Path, rng: random.Random) -> list[str]:
    corpus = work / "corpus"
    make_corpus(corpus, args.seed, files=48)
    t0 = time.monotonic()
    if finish(start(_prepare_cmd(corpus, work / "ref"), work / "logs" / "ref.log"), args.timeout):
        raise SystemExit("soak: the reference prepare failed:\n" + log_tail(work / "logs" / "ref.log"))
    ref_s = time.monotonic() - t0
    print(f"soak: reference prepare in {ref_s:.1f} s", flush=True)
    problems, stats = [], {"SIGKILL": 0, "SIGINT": 0, "complete": 0, "incomplete": 0, "empty": 0}
    for k in range(1, args.kills + 1):
        sig = rng.choice((signal.SIGKILL, signal.SIGINT))
        out, log, delay = work / f"s{k:02d}", work / "logs" / f"s{k:02d}.log", rng.uniform(0, ref_s * 1.5)
        proc = subprocess.Popen(_prepare_cmd(corpus, out), stdout=subprocess.DEVNULL, stderr=log.open("w"))
        workers: set[int] = set()
        end = time.monotonic() + delay
        while time.monotonic() < end and proc.poll() is None:
            workers |= _children(proc.pid)
            time.sleep(POLL_S)
        workers |= _children(proc.pid)
        proc.send_signal(sig)
        rc = proc.wait(timeout=args.timeout)
        deadline = time.monotonic() + 30
        while any(map(_alive, workers)) and time.monotonic() < deadline:
            time.sleep(0.1)
        found = []
        if left := sorted(filter(_alive, workers)):
            found.append(f"pool workers {left} outlived the prepare")
        lines = _messages(log)
        one_line = len(lines) == 1 and lines[0].startswith("meshlm: SIGINT: stopped")
        if sig == signal.SIGINT and rc != 0 and (rc != 130 or not one_line):
            found.append(f"SIGINT: exit {rc}, stderr {lines[-3:]}")
        if "Traceback" in log.read_text(errors="replace") and sig != signal.SIGKILL:
            found.append("a traceback on stderr")
        if problem := _store_problem(out, work / "ref"):
            found.append(problem)
        state = "complete" if (out / "index.json").exists() else "incomplete" if out.exists() else "empty"
        stats[signal.Signals(sig).name] += 1
        stats[state] += 1
        verdict = "ok" if not found else "FAIL: " + "; ".join(found)
        print(f"soak: kill {k:2d}/{args.kills} {signal.Signals(sig).name} after {delay:.2f} s "
              f"(rc {rc}, {len(workers)} workers, {state}): {verdict}", flush=True)  # fmt: skip
        problems += [f"kill {k}: {p}" for p in found]
        for pid in filter(_alive, workers):  # never leave one behind, even after a failure
            subprocess.run(["kill", "-9", str(pid)], check=False)
    print(f"soak: {json.dumps(stats)}")
    return problems


# ---------------------------------------------------------------- train start-up


def _round_problem(
    sig: int, rc: int, log: Path, out: Path, before: list[int], rows_before: int
) -> str | None:
    name, lines = signal.Signals(sig).name, _messages(log)
    ckpts, rows = complete_steps(out), train_losses(read_rows(out))
    if rc != 128 + sig:
        return f"exit {rc}, not {128 + sig}: {lines[-3:]}"
    if "Traceback" in log.read_text(errors="replace") or not lines:
        return f"stderr is not one line: {lines[-6:]}"
    if (out / ".lock").exists():
        return "the run lock was left behind"
    if lines[-1].startswith(f"meshlm: {name} during start-up: stopped before the first step"):
        if ckpts != before or len(rows) > rows_before:
            return f"stopped 'during start-up' but wrote: checkpoints {before} -> {ckpts}"
        return None
    if lines[-1].startswith(f"{name}: saved a checkpoint at step"):
        step = int(lines[-1].split("at step ")[1].split()[0])
        if not ckpts or ckpts[-1] != step or rows[-1][0] != step:
            return f"said step {step}; checkpoints {ckpts}, last row {rows[-1:]}"
        return None
    return f"unexpected last line: {lines[-1]!r}"


def soak_startup(args, work: Path, rng: random.Random) -> list[str]:
    corpus, ref = work / "corpus", work / "ref"
    make_corpus(corpus, args.seed)
    t0 = time.monotonic()
    proc = start(train_cmd(ref, corpus, STEPS), work / "logs" / "ref.log")
    while proc.poll() is None and not train_losses(read_rows(ref)):
        time.sleep(POLL_S)
    startup_s = time.monotonic() - t0
    if finish(proc, args.timeout) != 0:
        raise SystemExit("soak: the reference run failed:\n" + log_tail(work / "logs" / "ref.log"))
    print(f"soak: reference run, first step after {startup_s:.1f} s", flush=True)
    problems, stats = [], {"start-up": 0, "saved": 0, "SIGINT": 0, "SIGTERM": 0, "missed": 0}
    victims, k = [work / "victim-1"], 0
    while k < args.kills:
        sig, victim = rng.choice((signal.SIGINT, signal.SIGTERM)), victims[-1]
        delay, log = rng.uniform(0, startup_s * 1.15), work / "logs" / f"{victim.name}-{k + 1:02d}.log"
        before, rows_before = complete_steps(victim), len(train_losses(read_rows(victim)))
        proc = start(train_cmd(victim, corpus, STEPS), log)
        time.sleep(delay)
        proc.send_signal(sig)
        rc = finish(proc, args.timeout)
        if rc == 0:  # it finished before the signal: no kill; aim at a fresh directory (start-up is
            stats["missed"] += 1  # shorter than the reference's, measured under other load)
            startup_s *= 0.8
            victims.append(work / f"victim-{len(victims) + 1}")
            continue
        k += 1
        problem = _round_problem(sig, rc, log, victim, before, rows_before)
        where = "start-up" if "during start-up" in (_messages(log) or [""])[-1] else "saved"
        stats[where] += 1
        stats[signal.Signals(sig).name] += 1
        print(f"soak: signal {k:2d}/{args.kills} {signal.Signals(sig).name} after {delay:.2f} s: rc {rc}, "
              f"{where}, checkpoints {complete_steps(victim)}: {problem or 'ok'}", flush=True)  # fmt: skip
        problems += [f"signal {k}: {problem}"] if problem else []
    want = train_losses(read_rows(ref))
    for victim in victims:  # each directory a signal hit, run to the end: bit for bit the reference
        rc = finish(
            start(train_cmd(victim, corpus, STEPS), work / "logs" / f"{victim.name}-final.log"), args.timeout
        )
        got = train_losses(read_rows(victim))
        exact = rc == 0 and got == want and [s for s, _ in got] == list(range(1, STEPS + 1))
        print(f"soak: {victim.name} completed (rc {rc}): {'exact' if exact else 'MISMATCH'}", flush=True)
        problems += [] if exact else [f"final run: {victim.name}: rc {rc}, losses {got} != {want}"]
    print(f"soak: {json.dumps(stats)}")
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("prepare", "startup"), required=True)
    p.add_argument("--kills", type=int, default=20, help="kills (prepare) or signals (startup) (default 20)")
    p.add_argument("--seed", type=int, default=0, help="seed of the corpus and the schedule")
    p.add_argument("--out", default=None, help="work directory (new; default: a new temp dir)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds any one process may run")
    args = p.parse_args(argv)
    work = Path(args.out).absolute() if args.out else Path(tempfile.mkdtemp(prefix="meshlm-soak-faults-"))
    work.mkdir(parents=True, exist_ok=True)
    (work / "logs").mkdir(exist_ok=True)
    atexit.register(cleanup)
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, exit_on_signal)
    t0 = time.monotonic()
    soak = soak_prepare if args.mode == "prepare" else soak_startup
    problems = soak(args, work, random.Random(args.seed))
    for problem in problems:
        print(f"soak: FAIL {problem}")
    failed = {p.split(":")[0] for p in problems}
    print(f"soak: {args.mode}: {args.kills - len(failed - {'final run'})}/{args.kills} passed"
          f"{'' if 'final run' not in failed else ', the final run FAILED'} in {time.monotonic() - t0:.0f} s"
          f"; work dir {work}")  # fmt: skip
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
