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
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

# Names orbax-checkpoint 0.12 uses (see src/meshlm/io/layout.py). Spelled out here rather than
# imported so that this script does not start JAX and checks the layout independently.
TMP_SUFFIX = ".orbax-checkpoint-tmp"
COMMIT_MARKER = "commit_success.txt"
SET_ASIDE_TAG = ".corrupt-"  # <step>.corrupt-<time>: a bad step a resumed run moved aside
SAVE_EVERY = 3
KINDS = ("kill", "corrupt", "empty")  # what a kill does to the victim directory besides killing
POLL_S = 0.01  # steps take tens of milliseconds here: poll finer than that to aim kills
# Random delay after the target step. Saves take longer than steps here, so a delay spanning several
# steps mostly lands in a save; half the kills use a delay shorter than one step to hit the step itself.
SUB_STEP_MAX_S = (0.03, 0.3)
FINISH_MAX_S = 2.0  # after the last step the run still saves, evaluates and plots: aim there too
# Share of kills aimed by time since start (start-up, compile, restore); higher on a fresh run, the
# only place to kill before the first checkpoint.
TIME_MODE_P = {"fresh": 0.5, "resumed": 0.3}
MAX_MISSES = 8  # consecutive attempts that finish before the kill: the timing is off, give up

_children: set[subprocess.Popen] = set()


# ---------------------------------------------------------------- processes


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the child's process group (its own session), so no helper outlives it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # already gone


def _cleanup() -> None:
    for proc in list(_children):
        if proc.poll() is None:
            _kill_group(proc)
            proc.wait(timeout=30)
        _children.discard(proc)


def _exit_on_signal(signum, frame) -> None:
    raise SystemExit(f"soak: interrupted by {signal.Signals(signum).name}")  # atexit then cleans up


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    """Start ``cmd`` in its own session, stdout and stderr to ``log`` (a pipe could fill and stall it)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    _children.add(proc)
    return proc


def finish(proc: subprocess.Popen, timeout: float) -> int:
    """Wait for ``proc``; kill it if it runs past ``timeout`` (returns -SIGKILL then)."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        return proc.wait(timeout=30)
    finally:
        _children.discard(proc)


def train_cmd(out: Path, corpus: Path, steps: int) -> list[str]:
    """The command of tests/test_train.py::test_sigkill_then_resume_is_bitwise_identical."""
    flags = (
        "--config tiny-lm --batch-size 8 --seq-len 32 --warmup-steps 2 --eval-every 0 "
        f"--save-every {SAVE_EVERY} --sample-tokens 0 --mesh 2x2 --devices 4"
    ).split()
    data = ["--data", str(corpus), "--steps", str(steps), "--out", str(out)]
    return [sys.executable, "-m", "meshlm", "train", *flags, *data]


# ---------------------------------------------------------------- run directory state


def make_corpus(corpus: Path, seed: int, files: int = 8) -> None:
    """Deterministic .py-like text, different per file so the split and batches are non-trivial."""
    rng = random.Random(seed)
    corpus.mkdir(parents=True)
    for i in range(files):
        lines = []
        for j in range(150):
            a, b = rng.randint(1, 99), rng.choice("+-*")
            lines.append(f"def f{i}_{j}(x, y={a}):\n    return x {b} y  # case {rng.randint(0, 9999)}\n")
        (corpus / f"mod{i}.py").write_text("".join(lines))


def read_rows(out: Path) -> list[dict]:
    """metrics.jsonl rows; a line torn by a kill mid-write is skipped (the resume drops it too)."""
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def metrics_lines(out: Path) -> frozenset[str]:
    path = out / "metrics.jsonl"
    return frozenset(path.read_text().splitlines()) if path.exists() else frozenset()


def train_losses(rows: list[dict]) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in rows if "loss" in r]


def last_train_step(out: Path, old_lines: frozenset[str] = frozenset()) -> int:
    """Newest train step in metrics.jsonl, ignoring ``old_lines``: rows an earlier attempt wrote past
    its last checkpoint stay until the resume truncates them, and must not trigger a kill."""
    path = out / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    new = [line for line in lines if line not in old_lines]
    return max((s for s, _ in train_losses(_rows_of(new))), default=0)


def complete_steps(out: Path) -> list[int]:
    if not out.is_dir():
        return []
    return sorted(int(p.name) for p in out.iterdir() if p.name.isdigit() and (p / COMMIT_MARKER).is_file())


def tmp_dirs(out: Path) -> dict[str, tuple[int, int]]:
    """Interrupted or in-progress saves, by name -> (inode, mtime): orbax may reuse a name, so a
    changed identity tells a save of this attempt from debris of an earlier kill."""
    if not out.is_dir():
        return {}
    found = {}
    for p in out.iterdir():
        if TMP_SUFFIX in p.name:
            try:
                st = p.stat()
            except FileNotFoundError:
                continue  # renamed or removed while we looked
            found[p.name] = (st.st_ino, st.st_mtime_ns)
    return found


def uncommitted_numeric(out: Path) -> list[str]:
    if not out.is_dir():
        return []
    return sorted(p.name for p in out.iterdir() if p.name.isdigit() and not (p / COMMIT_MARKER).exists())


# ---------------------------------------------------------------- checks


def verify(out: Path, ref_rows: list[dict], steps: int) -> tuple[list[str], list[str]]:
    """(train problems, other problems) of a completed run directory against the reference."""
    rows = read_rows(out)
    got, want = train_losses(rows), train_losses(ref_rows)
    train = []
    step_list = [s for s, _ in got]
    if step_list != list(range(1, steps + 1)):
        dup = sorted({s for s in step_list if step_list.count(s) > 1})
        missing = sorted(set(range(1, steps + 1)) - set(step_list))
        train.append(f"train steps not 1..{steps} once: duplicated {dup}, missing {missing}")
    diffs = [(s, g, w) for (s, g), (_, w) in zip(got, want, strict=False) if g != w]
    if diffs:
        s, g, w = diffs[0]
        train.append(
            f"{len(diffs)} train losses differ from the reference; first at step {s}: {g!r} != {w!r}"
        )
    if (latest := max(complete_steps(out), default=None)) != steps:
        train.append(f"newest complete checkpoint is {latest}, expected {steps}")
    other = []
    evals = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    ref_evals = [(r["step"], r["val_loss"]) for r in ref_rows if "val_loss" in r]
    if evals != ref_evals:
        other.append(f"eval rows (step, val_loss) {evals} != reference {ref_evals}")
    if debris := sorted(tmp_dirs(out)) + uncommitted_numeric(out):
        other.append(f"interrupted-save debris left after completion: {debris}")
    return train, other


def resume_problem(log: Path, resume_from: int | None) -> str | None:
    """The attempt must resume from the newest complete checkpoint there was when it started."""
    text = log.read_text(errors="replace")
    if resume_from is None:
        return f"{log.name}: resumed although there was no checkpoint" if "resuming from" in text else None
    if f"(step {resume_from})" not in text:
        said = [line for line in text.splitlines() if "resuming from" in line]
        return f"{log.name}: expected to resume from step {resume_from}; log says {said or 'nothing'}"
    return None


def log_tail(log: Path, lines: int = 15) -> str:
    text = log.read_text(errors="replace").replace("\r", "\n")
    return "\n".join(line for line in text.splitlines()[-lines:])


# ---------------------------------------------------------------- faults


@dataclass
class Fault:
    kill: int  # the kill after which it was applied
    kind: str  # "corrupt" or "empty"
    step: int  # the step directory damaged or created
    how: str  # what was done, for the log
    asides_before: int  # <step>.corrupt-* directories before: one more means the run set it aside
    set_aside: bool = False


def set_aside_count(out: Path, step: int) -> int:
    return sum(p.name.startswith(f"{step}{SET_ASIDE_TAG}") for p in out.iterdir()) if out.is_dir() else 0


def flip_byte(step_dir: Path) -> Path:
    """Flip one byte in the middle of the largest array file (chunk data under ``state/**/d/``)."""
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file()]
    victim = max([p for p in files if p.parent.name == "d"] or files, key=lambda p: p.stat().st_size)
    with victim.open("r+b") as f:
        f.seek(victim.stat().st_size // 2)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0xFF]))
    return victim


def next_save(good: int | None, steps: int) -> int:
    return min(((good or 0) // SAVE_EVERY + 1) * SAVE_EVERY, steps)


def damage(out: Path, kind: str, good: int | None, steps: int, rng: random.Random) -> tuple | None:
    """Apply ``kind`` to ``out``, whose newest good step is ``good``: (step, what was done), or None
    if it does not apply (nothing to corrupt yet)."""
    if kind == "corrupt":
        if good is None:
            return None
        return good, f"flipped a byte of {flip_byte(out / str(good)).relative_to(out)}"
    nxt = next_save(good, steps)
    if nxt > (good or 0) and not (out / str(nxt)).exists() and (good is None or rng.random() < 0.5):
        (out / str(nxt)).mkdir(parents=True)
        return nxt, f"created the next save step {nxt}/ empty"
    if good is None:
        return None
    for entry in (out / str(good)).iterdir():  # our own victim directory: its files are ours
        if entry.is_dir():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    return good, f"emptied the newest step {good}/"


# ---------------------------------------------------------------- one victim directory


@dataclass
class Victim:
    path: Path
    attempts: int = 0
    kills: list[int] = field(default_factory=list)  # kill numbers that hit this directory
    problems: list[str] = field(default_factory=list)  # train-loss / step / checkpoint problems
    other: list[str] = field(default_factory=list)  # eval rows, debris, resume lines, crashes
    faults: list[Fault] = field(default_factory=list)

    def pending(self) -> list[Fault]:
        return [f for f in self.faults if not f.set_aside]

    def good_step(self) -> int | None:
        """The step a restart must resume from: the newest complete one not corrupted by us."""
        bad = {f.step for f in self.pending() if f.kind == "corrupt"}
        return max((s for s in complete_steps(self.path) if s not in bad), default=None)

    def note_set_aside(self) -> None:
        for f in self.pending():
            f.set_aside = set_aside_count(self.path, f.step) > f.asides_before


@dataclass
class Kill:
    number: int
    victim: str
    attempt: int
    mode: str  # "time": after a delay since start; "step": after a target train step and a delay
    target_step: int | None
    delay_s: float
    resume_from: int | None  # newest complete checkpoint when the attempt started
    killed_after_s: float
    last_row_step: int  # newest train row in metrics.jsonl right after the kill
    checkpoints: list[int]  # complete checkpoints right after the kill
    new_tmp: list[str]  # save directories this attempt created or touched (killed mid-save)
    phase: str  # "save"; "startup" (no train row yet); "mid_step" (in the step loop); "finish"
    before_first_checkpoint: bool
    kind: str = "kill"  # one of KINDS: the damage done after the kill
    fault: str = ""  # what the damage was


def plan(rng: random.Random, resume_from: int | None, steps: int, startup_s: float) -> tuple:
    """(mode, target step, delay): a random time since start, or a random step plus a sub-step delay."""
    if rng.random() < TIME_MODE_P["fresh" if resume_from is None else "resumed"]:
        return "time", None, rng.uniform(0.0, max(5.0, 1.2 * startup_s))
    target = rng.randint((resume_from or 0) + 1, steps)
    longest = FINISH_MAX_S if target == steps else rng.choice(SUB_STEP_MAX_S)
    return "step", target, rng.uniform(0.0, longest)


def strike(proc: subprocess.Popen, out: Path, old_lines: frozenset[str], aim: tuple, limit: float):
    """Wait per the plan, SIGKILL, reap. Returns (return code, seconds since start at the kill, hung):
    hung if the target step did not come within ``limit`` seconds (the kill then ends the run)."""
    (mode, target, delay), t0, hung = aim, time.monotonic(), False
    if mode == "step":
        while last_train_step(out, old_lines) < target and proc.poll() is None:
            if hung := time.monotonic() - t0 > limit:
                break
            time.sleep(POLL_S)
    end = time.monotonic() + delay
    while proc.poll() is None and time.monotonic() < end:
        time.sleep(min(POLL_S, max(0.0, end - time.monotonic())))
    killed_at = time.monotonic() - t0
    if proc.poll() is None:
        _kill_group(proc)
    return finish(proc, timeout=60), killed_at, hung


def phase_of(out: Path, before_lines: frozenset[str], new_tmp: list, steps: int) -> str:
    """Where the kill landed, from what the attempt left behind."""
    if new_tmp:
        return "save"
    newest = last_train_step(out, before_lines)  # rows this attempt wrote (all past its resume step)
    if not newest:
        return "startup"
    return "finish" if newest == steps else "mid_step"


def _rows_of(lines: Iterable[str]) -> list[dict]:
    rows = []
    for line in lines:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


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
    atexit.register(_cleanup)
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, _exit_on_signal)
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
