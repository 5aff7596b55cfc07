"""Soak test for exact resume: SIGKILL `meshlm train` at random points, resume, compare with a reference.

Not part of the pytest suite or CI: it runs for minutes. Usage::

    python scripts/soak_resume.py [--kills 20] [--steps 40] [--seed S] [--out DIR]

It trains a reference run without interruption, then kills a victim run ``--kills`` times at random
points (during start-up and compilation, in the training loop, during checkpoint saves), restarting
the same command after each kill. When a victim run completes, its metrics.jsonl must match the
reference bit for bit (train losses, steps 1..N exactly once, eval rows) and its newest checkpoint
must be step N; the next kills go to a fresh victim directory. Exit status 0 only if all match.

A share (``--fault-p``) of the kills also damage the victim directory before the restart:
"corrupt" flips a byte in the largest array file of the newest good checkpoint; "empty" creates
the next step the run will save as an empty directory, or empties the newest step. The restart
must then resume from the newest step still good, move the bad one aside as
``<step>.corrupt-<time>`` (never delete it), and still end bit for bit equal to the reference.
The report counts the kills of each kind ("kill": no damage) that ran and passed.
"""

from __future__ import annotations

import argparse
import atexit
import json
import random
import signal
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from soak_tools import (  # noqa: E402 - scripts/ is on sys.path when this script runs
    KINDS,
    MAX_MISSES,
    POLL_S,
    SAVE_EVERY,
    SET_ASIDE_TAG,
    Fault,
    Kill,
    Victim,
    cleanup,
    complete_steps,
    damage,
    exit_on_signal,
    finish,
    last_train_step,
    log_tail,
    make_corpus,
    metrics_lines,
    phase_of,
    plan,
    read_rows,
    resume_problem,
    set_aside_count,
    start,
    strike,
    tmp_dirs,
    train_cmd,
    train_losses,
    verify,
)

# ---------------------------------------------------------------- the soak


class Soak:
    def __init__(self, args: argparse.Namespace, out: Path):
        self.args = args
        self.out = out
        self.corpus = out / "corpus"
        self.rng = random.Random(args.seed)
        self.kills: list[Kill] = []
        self.victims: list[Victim] = []
        self.ref_rows: list[dict] = []
        self.startup_s = 0.0

    def cmd(self, path: Path) -> list[str]:
        return train_cmd(path, self.corpus, self.args.steps)

    def reference(self) -> None:
        """The uninterrupted run; also measures the start-up time (to the first train row)."""
        ref = self.out / "ref"
        t0 = time.monotonic()
        proc = start(self.cmd(ref), self.out / "logs" / "ref.log")
        while proc.poll() is None and last_train_step(ref) < 1 and time.monotonic() - t0 < self.args.timeout:
            time.sleep(POLL_S)
        self.startup_s = time.monotonic() - t0
        rc = finish(proc, timeout=self.args.timeout)
        self.ref_rows = read_rows(ref)
        got = [s for s, _ in train_losses(self.ref_rows)]
        if rc != 0 or got != list(range(1, self.args.steps + 1)):
            raise SystemExit(
                f"soak: reference run failed (rc {rc}, train steps {got[:3]}...{got[-3:]}):\n"
                + log_tail(self.out / "logs" / "ref.log")
            )
        print(
            f"soak: reference done in {time.monotonic() - t0:.1f} s (first step after {self.startup_s:.1f} s)"
        )

    def new_victim(self) -> Victim:
        name = "victim" if not self.victims else f"victim-{len(self.victims) + 1}"
        self.victims.append(Victim(self.out / name))
        return self.victims[-1]

    def attempt_log(self, v: Victim) -> Path:
        v.attempts += 1
        return self.out / "logs" / f"{v.path.name}-{v.attempts:02d}.log"

    def conclude(self, v: Victim, rc: int, log: Path, resume_from: int | None) -> None:
        """An attempt that ran to its end: check its resume and, if it succeeded, the directory."""
        v.note_set_aside()
        if rc != 0:
            v.problems.append(f"{log.name}: exited with {rc} instead of completing:\n{log_tail(log)}")
            return
        if problem := resume_problem(log, resume_from):
            v.other.append(problem)
        train, other = verify(v.path, self.ref_rows, self.args.steps)
        other += [
            f"after kill {f.kill} ({f.how}) the run completed without moving step {f.step} "
            f"aside as {f.step}{SET_ASIDE_TAG}<time>"
            for f in v.pending()
        ]
        v.problems += train
        v.other += other
        state = "exact" if not train else "MISMATCH"
        print(
            f"soak: {v.path.name} completed after {len(v.kills)} kills: {state}{'; ' if other else ''}"
            + "; ".join(other)
        )

    def kill_round(self, v: Victim) -> bool:
        """One attempt on ``v``; True if the kill hit a live run."""
        resume_from = v.good_step()
        before_lines, before_tmp = metrics_lines(v.path), tmp_dirs(v.path)
        mode, target, delay = aim = plan(self.rng, resume_from, self.args.steps, self.startup_s)
        log = self.attempt_log(v)
        proc = start(self.cmd(v.path), log)
        rc, at, hung = strike(proc, v.path, before_lines, aim, self.args.timeout)
        if rc != -signal.SIGKILL:
            self.conclude(v, rc, log, resume_from)
            return False
        v.note_set_aside()
        if hung:
            v.other.append(f"{log.name}: no train step {target} within {self.args.timeout:.0f} s (hung?)")
        if "resuming from" in log.read_text(errors="replace"):  # only checkable if it got that far
            if problem := resume_problem(log, resume_from):
                v.other.append(problem)
        after_tmp = tmp_dirs(v.path)
        new_tmp = sorted(n for n, ident in after_tmp.items() if before_tmp.get(n) != ident)
        ckpts = complete_steps(v.path)
        kill = Kill(
            number=len(self.kills) + 1,
            victim=v.path.name,
            attempt=v.attempts,
            mode=mode,
            target_step=target,
            delay_s=round(delay, 3),
            resume_from=resume_from,
            killed_after_s=round(at, 2),
            last_row_step=last_train_step(v.path),
            checkpoints=ckpts,
            new_tmp=new_tmp,
            phase=phase_of(v.path, before_lines, new_tmp, self.args.steps),
            before_first_checkpoint=not ckpts,
        )
        self.kills.append(kill)
        v.kills.append(kill.number)
        self.inject(v, kill)
        print(
            f"soak: kill {kill.number:2d}/{self.args.kills} {v.path.name} attempt {v.attempts}: {mode} "
            f"target={target} delay={delay:.2f}s at {at:.1f}s; resume_from={resume_from} last_row="
            f"{kill.last_row_step} ckpts={ckpts} phase={kill.phase} new_tmp={new_tmp}"
            + (f"; then {kill.fault}" if kill.fault else ""),
            flush=True,
        )
        return True

    def choose_kind(self) -> str:
        """A random kind; the last kills go to fault kinds not applied yet, so that a short soak
        still tries each."""
        done = {k.kind for k in self.kills}
        missing = [k for k in KINDS[1:] if k not in done]
        if missing and self.args.fault_p > 0 and self.args.kills - len(self.kills) <= len(missing):
            return missing[0]
        p = self.args.fault_p
        return self.rng.choices(KINDS, weights=(1 - p, p / 2, p / 2))[0]

    def inject(self, v: Victim, kill: Kill) -> None:
        """Damage ``v`` after ``kill`` (recorded in it) per a randomly chosen kind."""
        kind = self.choose_kind()
        if kind == "kill":
            return
        done = damage(v.path, kind, v.good_step(), self.args.steps, self.rng)
        if done is None:
            return  # nothing to corrupt yet: a plain kill
        step, how = done
        v.faults.append(Fault(kill.number, kind, step, how, set_aside_count(v.path, step)))
        kill.kind, kill.fault = kind, how

    def run(self) -> None:
        self.reference()
        v, misses = self.new_victim(), 0
        while len(self.kills) < self.args.kills:
            if max(complete_steps(v.path), default=0) >= self.args.steps:
                # Killed after its final save: the rest is only an evaluation, so more kills here
                # would all land in start-up. Finish it and aim at a fresh run instead.
                self.complete(v)
                v = self.new_victim()
                continue
            if self.kill_round(v):
                misses = 0
                continue
            misses += 1
            if misses > MAX_MISSES:
                raise SystemExit(f"soak: {MAX_MISSES} attempts in a row ended before their kill; giving up")
            v = self.new_victim()
        self.complete(v)

    def complete(self, v: Victim) -> None:
        """Run the last victim to completion after the final kill."""
        resume_from = v.good_step()
        log = self.attempt_log(v)
        rc = finish(start(self.cmd(v.path), log), timeout=self.args.timeout)
        self.conclude(v, rc, log, resume_from)

    def summary(self, wall_s: float) -> dict:
        exact = sum(1 for k in self.kills if not self._victim(k.victim).problems)
        kinds = {kind: {"ran": 0, "passed": 0} for kind in KINDS}
        for k in self.kills:
            kinds[k.kind]["ran"] += 1
            kinds[k.kind]["passed"] += self._passed(k)
        phases = {p: sum(k.phase == p for k in self.kills) for p in ("startup", "mid_step", "save", "finish")}
        return {
            "kills": len(self.kills),
            "exact_resumes": exact,
            "during_save": phases["save"],
            "before_first_checkpoint": sum(k.before_first_checkpoint for k in self.kills),
            "phases": phases,
            "modes": {m: sum(k.mode == m for k in self.kills) for m in ("time", "step")},
            "kinds": kinds,
            "victim_dirs": [
                {
                    "dir": v.path.name,
                    "attempts": v.attempts,
                    "kills": v.kills,
                    "problems": v.problems,
                    "other_problems": v.other,
                    "faults": [asdict(f) for f in v.faults],
                }
                for v in self.victims
            ],
            "steps": self.args.steps,
            "seed": self.args.seed,
            "startup_s": round(self.startup_s, 2),
            "wall_s": round(wall_s, 1),
            "out": str(self.out),
            "kill_log": [asdict(k) for k in self.kills],
        }

    def _victim(self, name: str) -> Victim:
        return next(v for v in self.victims if v.path.name == name)

    def _passed(self, k: Kill) -> bool:
        """The victim it hit ended exact and clean, and its fault (if any) was set aside."""
        v = self._victim(k.victim)
        faults = [f for f in v.faults if f.kill == k.number]
        return not (v.problems or v.other) and all(f.set_aside for f in faults)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=20, help="SIGKILLs to deliver to live runs (default 20)")
    p.add_argument("--steps", type=int, default=40, help="training steps per run (default 40)")
    p.add_argument("--seed", type=int, default=0, help="seed of the corpus and the kill schedule")
    p.add_argument("--out", default=None, help="work directory (must not exist; default: a new temp dir)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds any one training process may run")
    p.add_argument(
        "--fault-p",
        type=float,
        default=0.5,
        help="share of kills that also corrupt or empty a step directory (default 0.5; 0: plain kills)",
    )
    args = p.parse_args(argv)
    if args.kills < 1 or args.steps < 4:
        p.error(f"--kills must be >= 1 and --steps >= 4 (the runs save every {SAVE_EVERY} steps)")
    if not 0.0 <= args.fault_p <= 1.0:
        p.error(f"--fault-p must be in [0, 1], got {args.fault_p}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.out is None:
        out = Path(tempfile.mkdtemp(prefix="meshlm-soak-"))
    else:
        out = Path(args.out).absolute()
        if out.exists() and any(out.iterdir()):
            raise SystemExit(f"soak: --out {out} is not empty; pass a new directory")
        out.mkdir(parents=True, exist_ok=True)
    atexit.register(cleanup)
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, exit_on_signal)
    t0 = time.monotonic()
    soak = Soak(args, out)
    make_corpus(soak.corpus, args.seed)
    print(f"soak: {args.kills} kills, {args.steps} steps, seed {args.seed}, work dir {out}", flush=True)
    soak.run()
    summary = soak.summary(time.monotonic() - t0)
    return report(summary)


def report(summary: dict) -> int:
    bad = [v for v in summary["victim_dirs"] if v["problems"] or v["other_problems"]]
    k = summary["kills"]
    print(f"soak: {summary['exact_resumes']}/{k} exact resumes")
    by_kind = (f"{n} {c['passed']}/{c['ran']} passed" for n, c in summary["kinds"].items())
    print("soak: kills by kind: " + ", ".join(by_kind))
    print(
        f"soak: {summary['during_save']} kills during a save, {summary['before_first_checkpoint']} "
        f"before the first checkpoint, phases {summary['phases']}, {summary['wall_s']:.0f} s"
    )
    for v in bad:
        for problem in v["problems"] + v["other_problems"]:
            print(f"soak: FAIL {v['dir']} (kills {v['kills']}): {problem}")
    print(json.dumps({key: val for key, val in summary.items() if key != "kill_log"}))
    Path(summary["out"], "summary.json").write_text(json.dumps(summary, indent=1))
    passed = sum(c["passed"] for c in summary["kinds"].values())
    return 0 if not bad and summary["exact_resumes"] == k and passed == k else 1


if __name__ == "__main__":
    sys.exit(main())
