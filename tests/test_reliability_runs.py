"""Run directories that must not get stuck or mixed up: a bad newest step is moved aside on resume and
saved again; one run at a time per --out (the lock); --fresh refuses what a previous run left."""

import re
import signal
import subprocess
import sys
import warnings

import pytest
from helpers import run_cli, run_meshlm, tiny_lm_config, train_args, train_rows, write_corpus

from meshlm.errors import CheckpointError
from meshlm.io.checkpoint import Checkpointer
from meshlm.io.layout import COMMIT_MARKER, complete_steps, resolve
from meshlm.io.run_lock import LOCK_FILE
from meshlm.io.set_aside import set_aside_newer
from meshlm.parallel.mesh import make_mesh
from meshlm.train.loop import train
from meshlm.train.run import build_run

STAMP = r"\.corrupt-\d{8}T\d{6}Z"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def _tcfg(corpus, out, steps, **kw):
    return tiny_lm_config(corpus, out, steps=steps, **{"warmup_steps": 2, "save_every": 2, **kw})


def _train(corpus, out, steps, **kw):
    return train(_tcfg(corpus, out, steps, **kw), make_mesh(1, 2))


def _moved_aside(out):
    return sorted(p.name for p in out.iterdir() if ".corrupt-" in p.name)


def _flip_byte(step_dir):
    """One flipped byte in the largest array file: orbax decodes it silently, the fingerprint does not."""
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
    victim = max(files, key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))


# ---------------------------------------------------------------- a bad newest step


# corrupt quick; empty and unreadable slow: the same move-aside for another damage, whose detection
# tests/test_checkpoint.py proves quick
@pytest.mark.parametrize(
    "damage",
    [
        pytest.param("empty", marks=pytest.mark.slow),
        "corrupt",
        pytest.param("unreadable", marks=pytest.mark.slow),
    ],
)
def test_bad_newest_step_is_moved_aside_and_saved_again(corpus, tmp_path, damage):
    out = tmp_path / "run"
    if damage == "empty":  # `mkdir RUN/6` next to complete 2/ and 4/
        _train(corpus, out, 4)
        (out / "6").mkdir()
        why = "an empty directory"
    elif damage == "corrupt":
        _train(corpus, out, 6)
        _flip_byte(out / "6")
        why = r"corrupt \(.*fingerprint mismatch"
    else:
        _train(corpus, out, 6)
        (out / "6" / "meta" / "metadata").write_text('{"model_con')  # torn JSON
        why = r"corrupt \(cannot read .*6/meta/metadata"
    moved = rf"moved {re.escape(str(out / '6'))} aside to 6{STAMP}: {why}.*continues from step 4"
    with pytest.warns(UserWarning, match=moved):
        summary = _train(corpus, out, 6)
    assert (summary["step"], summary["steps_run"]) == (6, 2)  # resumed from 4, saved 6 again
    (aside,) = _moved_aside(out)
    assert (out / aside).is_dir()  # renamed, never deleted
    if damage != "empty":
        assert (out / aside / COMMIT_MARKER).is_file()  # the damaged data is kept for a look
    assert Checkpointer(out).all_steps() == [2, 4, 6]
    assert [r["step"] for r in train_rows(out)] == [1, 2, 3, 4, 5, 6]
    with warnings.catch_warnings(record=True) as caught:  # a rerun resumes from the new 6
        warnings.simplefilter("always")
        again = _train(corpus, out, 6)
    assert (again["step"], again["steps_run"]) == (6, 0)
    assert not [w for w in caught if "moved" in str(w.message)]
    assert _moved_aside(out) == [aside]


# slow: its cost (two training processes on one run directory); moving a bad step aside and saving it again:
# the quick cells above
@pytest.mark.slow
def test_two_processes_move_aside_together(corpus, tmp_path):
    """Process 0 renames, the other waits for it: both then save step 6 (a collective) again. (The run
    that leaves steps 2 and 4 is one process on the same 2x2 mesh: a checkpoint restores onto any
    process count, and only the resumed run's two processes move aside.)"""
    launch = ["launch", "-n", "2", "--devices-per-process", "2", "--"]
    first = run_meshlm(*train_args(corpus, tmp_path, 4, save_every=2), "--devices", "4")
    assert first.returncode == 0, first.stderr[-2000:]
    (tmp_path / "6").mkdir()
    second = run_meshlm(*launch, *train_args(corpus, tmp_path, 6, save_every=2))
    assert second.returncode == 0, second.stderr[-2000:]
    assert re.search(rf"moved .*6 aside to 6{STAMP}: an empty directory", second.stderr)
    assert Checkpointer(tmp_path).all_steps() == [2, 4, 6] and len(_moved_aside(tmp_path)) == 1


def test_moved_aside_directories_are_never_steps(tmp_path):
    aside = tmp_path / "6.corrupt-20260101T000000Z"
    aside.mkdir()
    (aside / COMMIT_MARKER).write_text("")
    assert complete_steps(tmp_path) == []
    with pytest.raises(CheckpointError, match="moved aside by a resumed run.*pass"):
        resolve(aside)
    set_aside_newer(tmp_path, 0, {})  # not a step: not moved again
    assert [p.name for p in tmp_path.iterdir()] == [aside.name]


def test_fresh_start_moves_aside_step_entries(tmp_path):
    """With no complete step the run starts at 0: every step-named entry would block a save."""
    (tmp_path / "3").write_text("")
    (tmp_path / "5").mkdir()
    (tmp_path / "5" / "junk").write_text("")
    with pytest.warns(UserWarning) as record:
        set_aside_newer(tmp_path, 0, {})
    messages = " | ".join(str(w.message) for w in record)
    assert "not a directory" in messages and f"an interrupted save (no {COMMIT_MARKER})" in messages
    names = sorted(p.name for p in tmp_path.iterdir())
    assert len(names) == 2 and all(re.fullmatch(rf"[35]{STAMP}", n) for n in names)


# ---------------------------------------------------------------- the lock on --out

_HOLD_LOCK = """
import sys, time
from pathlib import Path
from meshlm.io.run_lock import RunLock
RunLock(Path(sys.argv[1])).acquire()
print("locked", flush=True)
time.sleep(300)
"""


def _holder(directory):
    """Another process holding the run lock on ``directory``, as a running `meshlm train` does."""
    argv = [sys.executable, "-c", _HOLD_LOCK, str(directory)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    if proc.stdout.readline().strip() != "locked":
        proc.kill()
        pytest.fail("the lock holder did not start")
    return proc


def test_second_run_on_a_locked_directory_fails_at_once(corpus, tmp_path):
    holder = _holder(tmp_path)
    try:
        with pytest.raises(CheckpointError) as info:
            _train(corpus, tmp_path, 2)
    finally:
        holder.kill()
        holder.wait()
    message = str(info.value)
    assert f"in use by another run (pid {holder.pid} on host " in message
    assert "wait for it or choose another --out" in message and "\n" not in message
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_FILE]  # nothing written


def test_cli_on_a_locked_directory_is_one_line(corpus, tmp_path, capsys):
    holder = _holder(tmp_path)
    try:
        code = run_cli(*train_args(corpus, tmp_path, 2))
    finally:
        holder.kill()
        holder.wait()
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and f"pid {holder.pid}" in err and "choose another --out" in err


def test_stale_lock_of_a_dead_run_is_taken_over(corpus, tmp_path):
    holder = _holder(tmp_path)
    holder.send_signal(signal.SIGKILL)  # dies holding it: the file stays, the flock goes
    holder.wait()
    assert str(holder.pid) in (tmp_path / LOCK_FILE).read_text()
    with pytest.warns(UserWarning, match=rf"took over the stale run lock .* of pid {holder.pid} on host"):
        summary = _train(corpus, tmp_path, 2)
    assert summary["step"] == 2
    assert not (tmp_path / LOCK_FILE).exists()  # released at the end of the run


# ---------------------------------------------------------------- --fresh


def test_fresh_refuses_leftover_outputs_of_a_previous_run(corpus, tmp_path):
    rows = '{"step": 1, "loss": 5.0, "lr": 0.0, "grad_norm": 1.0, "tokens_per_s": 1.0}\n'
    (tmp_path / "metrics.jsonl").write_text(rows)
    (tmp_path / "tensorboard").mkdir()
    refused = r"--fresh: .* already holds metrics.jsonl, tensorboard of a previous run"
    with pytest.raises(CheckpointError, match=refused):
        build_run(_tcfg(corpus, tmp_path, 2, fresh=True), make_mesh(1, 2))
    assert (tmp_path / "metrics.jsonl").read_text() == rows  # untouched
    assert not (tmp_path / LOCK_FILE).exists()  # the refused run released its lock
