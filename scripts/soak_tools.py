"""Parts of the resume soak (``soak_resume.py``): child processes, the run directory's state as
the files show it, the checks of a finished victim, and the faults planted between kills."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
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


def cleanup() -> None:
    for proc in list(_children):
        if proc.poll() is None:
            _kill_group(proc)
            proc.wait(timeout=30)
        _children.discard(proc)


def exit_on_signal(signum, frame) -> None:
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
    """The command of tests/test_resume.py::test_sigkill_then_resume_is_bitwise_identical (whose cells
    add --fsdp --sp or --pp)."""
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
