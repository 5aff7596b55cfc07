"""The third reliability pass (issue 27): the wrong answers of an adversarial probe, each reproduced.

One line on stderr naming the problem and the fix, the documented exit code, nothing lost, nothing
half-written taken for whole, one owner per output directory. Subprocesses are bounded by timeouts;
nothing asserts on timing."""

from __future__ import annotations

import dataclasses
import errno
import gc
import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import meshlm_argv, run_cli, train_args, train_rows, wait_for, write_corpus

from meshlm.data import prepare as prepare_mod
from meshlm.data.bpe import train_bpe
from meshlm.data.store import open_store, store_arg
from meshlm.data.stream import TokenStream
from meshlm.data.tokenizer import ByteTokenizer
from meshlm.errors import DataError
from meshlm.io import hf_weights
from meshlm.io.checkpoint import Checkpointer
from meshlm.io.model_io import save_model
from meshlm.io.run_lock import LOCK_FILE
from meshlm.model.config import get_config
from meshlm.parallel.mesh import make_mesh
from meshlm.train import outputs
from meshlm.train.config import TrainConfig
from meshlm.train.loop import train
from meshlm.train.resume import check_resumable
from meshlm.train.run import build_run
from meshlm.train.step import init_model
from meshlm.train.tokenizers import tokenizer_meta


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


# ---------------------------------------------------------------- convert --to-hf: file modes


def _zeros(cfg) -> dict:
    return {p: np.zeros(s, d) for p, (s, d) in hf_weights.expected_shapes(cfg).items()}


def test_exported_weights_have_the_mode_of_every_other_output(tmp_path):
    cfg = get_config("tiny-llama")
    flat = _zeros(cfg)
    old = os.umask(0o022)
    try:
        out = hf_weights.save_hf(cfg, flat, tmp_path / "hf")
    finally:
        os.umask(old)
    assert _mode(out / hf_weights.CONFIG_FILE) == 0o644
    assert _mode(out / hf_weights.WEIGHTS_FILE) == 0o644  # safetensors alone wrote 0600
    assert sorted(p.name for p in out.iterdir()) == [hf_weights.CONFIG_FILE, hf_weights.WEIGHTS_FILE]


# ---------------------------------------------------------------- one owner per output directory

_HOLD_LOCK = """
import sys, time
from pathlib import Path
from meshlm.io.run_lock import RunLock
RunLock(Path(sys.argv[1])).acquire()
print("locked", flush=True)
time.sleep(300)
"""


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def _other_prepare_meanwhile(monkeypatch, out, corpus):
    """Make ``plan`` (called after the --out check, before any write) first let another `data prepare`
    run to the end on the same --out: two prepares started at once."""
    real = prepare_mod.plan
    calls = []

    def plan(*args, **kwargs):
        if not calls:
            calls.append(1)
            prepare_mod.prepare([str(Path(corpus) / "f0.py")], ByteTokenizer(), out, workers=1)
        return real(*args, **kwargs)

    monkeypatch.setattr(prepare_mod, "plan", plan)


def test_two_prepares_on_one_out_one_is_refused(corpus, tmp_path, monkeypatch, capsys):
    out = tmp_path / "store"
    _other_prepare_meanwhile(monkeypatch, out, corpus)
    code = run_cli("data", "prepare", "--data", corpus, "--out", str(out), "--workers", "1")
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "not an empty directory" in err[-1] and "prepared" not in "\n".join(err), err
    store = open_store(out)  # the other prepare's store, whole and untouched
    assert [d["path"] for d in store.index["splits"]["train"]["documents"]] == [str(Path(corpus) / "f0.py")]
    assert not (out / LOCK_FILE).exists()


@pytest.mark.parametrize("command", ["prepare", "convert"])
def test_a_locked_out_is_refused_naming_its_owner(corpus, tmp_path, capsys, command):
    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        if command == "prepare":
            code = run_cli("data", "prepare", "--data", corpus, "--out", str(out), "--workers", "1")
        else:
            cfg = get_config("tiny-llama")
            hf = hf_weights.save_hf(cfg, _zeros(cfg), tmp_path / "hf")
            code = run_cli("convert", "--from-hf", str(hf), "--out", str(out), "--mesh", "1x2")
    finally:
        holder.kill()
        holder.wait()
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and f"in use by another run (pid {holder.pid} on host" in err[-1], err
    assert sorted(p.name for p in out.iterdir()) == [LOCK_FILE]  # nothing written


# ---------------------------------------------------------------- an interrupted prepare is no store


@pytest.mark.parametrize("stage", ["write_index", "progress_bar"])
def test_interrupted_prepare_is_refused_by_train(corpus, tmp_path, capsys, monkeypatch, stage):
    """Killed before its commit record (index.json): with the token files written, or (a BPE) with
    only tokenizer.json there. Neither is read as raw text by `train --data DIR`."""
    out = tmp_path / "store"

    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # stands for a kill at this point: nothing after it runs

    tok = ByteTokenizer() if stage == "write_index" else train_bpe([Path(corpus, "f0.py").read_text()], 300)
    with monkeypatch.context() as m, pytest.raises(KeyboardInterrupt):
        m.setattr(prepare_mod, stage, killed)
        prepare_mod.prepare([corpus], tok, out, workers=1)
    with pytest.raises(DataError, match="incomplete token store .*no index.json.*re-run `meshlm data"):
        store_arg([out])
    code = run_cli(*train_args(str(out), tmp_path / "run", 2), "--devices", "4")
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "incomplete token store" in err[-1], err[-3:]
    assert not (tmp_path / "run").exists()  # refused before the run directory was made
    code = run_cli("data", "prepare", "--data", corpus, "--out", str(out))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "interrupted `meshlm data prepare`" in err[-1], err[-3:]


# ---------------------------------------------------------------- metrics of an earlier run, no checkpoint


def test_earlier_metrics_without_a_checkpoint_are_set_aside_not_rewritten(corpus, tmp_path):
    rows = "".join(
        json.dumps({"step": s, "loss": 5.0, "lr": 0.1, "grad_norm": 1.0}) + "\n" for s in range(1, 13)
    )
    (tmp_path / "metrics.jsonl").write_text(rows)
    moved = r"metrics.jsonl holds 12 rows of an earlier run.*no checkpoint.*moved it aside to metrics"
    tcfg = TrainConfig(
        config="tiny-lm", data=(corpus,), batch_size=8, seq_len=32, warmup_steps=2, eval_every=0,
        eval_batches=1, save_every=2, sample_tokens=0, steps=2, out=str(tmp_path),
    )  # fmt: skip
    with pytest.warns(UserWarning, match=moved):
        train(tcfg, make_mesh(1, 2))
    (aside,) = tmp_path.glob("metrics.jsonl.earlier-*")
    assert aside.read_text() == rows  # nothing lost
    assert [r["step"] for r in train_rows(tmp_path)] == [1, 2]


# ---------------------------------------------------------------- generate: a prompt that is not UTF-8


@pytest.fixture(scope="module")
def bpe_checkpoint(tmp_path_factory, corpus):
    out = tmp_path_factory.mktemp("bpe") / "ckpt"
    tok = train_bpe([Path(corpus, "f0.py").read_text()], 300)
    cfg = get_config("tiny-lm").replace(vocab_size=tok.vocab_size)
    save_model(out, cfg, init_model(cfg, make_mesh(1, 1), 0)[0], meta={"tokenizer": tokenizer_meta(out, tok)})
    return out


def test_generate_refuses_a_prompt_that_is_not_utf8(bpe_checkpoint, capsys):
    prompt = b"def \xff(".decode("utf-8", "surrogateescape")  # what Python makes of such an argv
    argv = ["generate", "--checkpoint", str(bpe_checkpoint), "--max-new-tokens", "2", "--mesh", "1x1"]
    code = run_cli(*argv, "--prompt", "def ", "--prompt", prompt)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("meshlm: error: prompt 1 is not valid UTF-8"), err[-3:]
    assert "0xff at byte 4" in err[-1] and "Traceback" not in "\n".join(err)
    assert run_cli(*argv, "--prompt", "def ") == 0  # the checkpoint itself generates


# ---------------------------------------------------------------- Ctrl-C at any moment of start-up


def _jax_loaded(pid: int) -> bool:
    try:
        return "jaxlib" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


_POINTS = {  # a moment of start-up, seen from outside: what must exist before the signal is sent
    "importing jax": lambda proc, out, err: _jax_loaded(proc.pid),
    "data loaded": lambda proc, out, err: "data: " in err.read_text(),
    "outputs opened": lambda proc, out, err: (out / "tensorboard").exists(),
}


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads Linux's /proc")
@pytest.mark.parametrize(
    "sig, point",
    [(signal.SIGINT, "importing jax"), (signal.SIGINT, "data loaded"), (signal.SIGTERM, "outputs opened")],
)
def test_a_signal_during_startup_is_one_line_and_128_plus_signal(corpus, tmp_path, sig, point):
    out, err = tmp_path / "run", tmp_path / "stderr"
    with err.open("w") as f:
        argv = meshlm_argv(*train_args(corpus, out, 30), "--devices", "4")
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=f)
    try:
        reached = wait_for(lambda: proc.poll() is not None or _POINTS[point](proc, out, err), timeout_s=120)
        assert reached and proc.poll() is None, err.read_text()[-2000:]
        proc.send_signal(sig)
        proc.wait(timeout=120)
    finally:
        proc.kill()
        proc.wait()
    name, text = signal.Signals(sig).name, err.read_text()
    # The run's own report lines (data, model and mesh, the progress bar) are not messages about the signal.
    report = ("data: ", "model: ", "train:", "starting a fresh run in ")
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith(report)]
    assert proc.returncode == 128 + sig, text[-3000:]  # not 139 (a segfault), not 0 (a run that went on)
    assert len(lines) == 1 and "Traceback" not in text, text[-3000:]
    ckpts = Checkpointer(out).all_steps() if out.exists() else []
    if ckpts:  # the signal came after start-up: the loop saved and stopped at once
        assert lines[0].startswith(f"{name}: saved a checkpoint at step {ckpts[-1]}"), lines
        assert train_rows(out)[-1]["step"] == ckpts[-1]
    else:
        assert lines[0].startswith(f"meshlm: {name} during start-up: stopped before the first step"), lines
        assert not (out / "metrics.jsonl").exists() or not train_rows(out)
    assert not (out / LOCK_FILE).exists()


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads Linux's /proc")
def test_ctrl_c_in_another_command_is_one_line_and_130(tmp_path):
    err = tmp_path / "stderr"
    with err.open("w") as f:
        argv = meshlm_argv("verify", "--config", "tiny", "--mesh", "1x2", "--devices", "2", "--steps", "3")
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=f)
    try:
        assert wait_for(lambda: proc.poll() is not None or _jax_loaded(proc.pid), timeout_s=120)
        assert proc.poll() is None, err.read_text()[-2000:]
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 130 and err.read_text().strip() == "meshlm: SIGINT: stopped", err.read_text()[
        -2000:
    ]


# ---------------------------------------------------------------- a full disk

_FULL_DISK = """
set -u
mount -t tmpfs -o size=700k tmpfs "$1" || exit 97
shift
"$@" > "$LOGS/1.out" 2> "$LOGS/1.err"; echo $? > "$LOGS/1.rc"
dd if=/dev/zero of="$MNT/filler" bs=4k 2> /dev/null  # the rest of the disk: it stays full
"$@" > "$LOGS/2.out" 2> "$LOGS/2.err"; echo $? > "$LOGS/2.rc"
"""


def _in_a_small_filesystem(mnt: Path, logs: Path, argv: list[str]) -> None:
    """Run ``argv`` twice on a 700 KiB tmpfs at ``mnt`` (a mount namespace of its own: nothing to clean
    up), the second time with the disk full. Skips where user namespaces are not allowed."""
    mnt.mkdir()
    logs.mkdir()
    env = {**os.environ, "LOGS": str(logs), "MNT": str(mnt)}
    cmd = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", _FULL_DISK, "sh", str(mnt), *argv]
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    except FileNotFoundError:
        pytest.skip("no unshare(1) to make a small filesystem")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs in a user namespace here: {done.stderr.strip()[:200]}")


@pytest.mark.skipif(sys.platform != "linux", reason="a tmpfs in a Linux mount namespace")
def test_a_full_disk_is_one_line_then_and_on_the_rerun(corpus, tmp_path):
    out = tmp_path / "mnt" / "run"
    argv = meshlm_argv(*train_args(corpus, out, 3), "--devices", "4")
    _in_a_small_filesystem(tmp_path / "mnt", tmp_path / "logs", argv)
    for run, says in (("1", "could not save step 3 to "), ("2", "cannot write the run lock ")):
        err = (tmp_path / "logs" / f"{run}.err").read_text()
        lines = [
            line for line in err.splitlines() if line.strip() and not line.startswith(("data: ", "train:"))
        ]
        rc = int((tmp_path / "logs" / f"{run}.rc").read_text())
        assert rc == 2 and lines[-1].startswith(f"meshlm: error: {says}"), err[-3000:]
        assert "no space left on device" in lines[-1].lower() and "free space" in lines[-1], lines[-1]
        report = ("step 0: val_loss", "model: ", "starting a fresh run in ")  # the run's own report lines
        noise = [line for line in lines[:-1] if not line.startswith(report)]
        assert not noise and "Traceback" not in err, err[-3000:]


def _disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "the/file")


def test_disk_full_while_writing_metrics_is_one_line(corpus, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(outputs, "append_text", _disk_full)
    code = run_cli(*train_args(corpus, tmp_path, 3), "--devices", "4")
    err = [
        line
        for line in capsys.readouterr().err.splitlines()
        if line.strip() and not line.startswith(("data", "model: ", "starting a fresh run in "))
    ]
    assert code == 2 and err[-1].startswith("meshlm: error: no space left on device writing the/file"), err
    assert len([line for line in err if not line.startswith("train:")]) == 1, err


def test_disk_full_while_preparing_is_one_line_and_no_store(corpus, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(prepare_mod, "_write_splits", _disk_full)
    code = run_cli("data", "prepare", "--data", corpus, "--out", str(tmp_path / "s"), "--workers", "1")
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip() and "prepare:" not in line]
    assert code == 2 and err == ["meshlm: error: no space left on device writing the/file; free space (or "
                                 "choose another --out), then run the same command again"], err  # fmt: skip
    assert not (tmp_path / "s").exists()  # what it wrote is removed: the same command can run again


# ---------------------------------------------------------------- a SIGKILLed prepare leaves no workers


def _workers(pid: int) -> list[int]:
    ps = subprocess.run(["ps", "-ww", "-o", "pid=,args=", "--ppid", str(pid)], capture_output=True, text=True)
    return [int(line.split()[0]) for line in ps.stdout.splitlines() if "multiprocessing" in line]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads Linux's /proc")
def test_sigkilled_prepare_leaves_no_pool_workers(corpus, tmp_path):
    argv = meshlm_argv("data", "prepare", "--data", corpus, "--out", str(tmp_path / "s"), "--workers", "2")
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    found: set[int] = set()

    def both_started() -> bool:  # they start as the first documents are handed out
        found.update(_workers(proc.pid))
        return len(found) >= 2

    try:
        assert wait_for(both_started, timeout_s=120)
        proc.kill()
        proc.wait()
        assert wait_for(lambda: not any(map(_alive, found)), timeout_s=60), "workers outlived their prepare"
    finally:
        proc.kill()
        for pid in found:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


# ---------------------------------------------------------------- the probe's unclear cases, decided


def test_verify_refuses_an_absurd_step_count(capsys):
    with pytest.raises(SystemExit) as exit_:
        run_cli("verify", "--steps", "99999999999999999999")
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and "argument --steps: must be an integer in [0, 10000]" in err[-1], err


def test_generate_help_says_an_explicit_max_new_tokens_must_fit(capsys):
    with pytest.raises(SystemExit):
        run_cli("generate", "--help")
    assert "a value given here must fit" in " ".join(capsys.readouterr().out.split())


def test_resuming_with_other_steps_says_the_schedule_changes(capsys):
    meta = {"train_config": TrainConfig(steps=10).to_dict(), "data": {"next_step": 4}}
    check_resumable(meta, TrainConfig(steps=10), Path("runs/x"))
    assert capsys.readouterr().err == ""
    check_resumable(meta, TrainConfig(steps=20), Path("runs/x"))
    err = capsys.readouterr().err
    assert err.startswith("note: --steps 20 differs from the 10 the run in runs/x was started with") and (
        "schedule" in err and "from step 4 on" in err
    )


def test_fsdp_on_dp_1_says_it_saves_nothing(corpus, tmp_path, capsys):
    tcfg = TrainConfig(config="tiny-lm", data=(corpus,), batch_size=2, seq_len=16, steps=1, out=str(tmp_path))
    build_run(dataclasses.replace(tcfg, fsdp=True), make_mesh(1, 2)).release()
    assert "note: --fsdp on a mesh with dp=1 saves no memory" in capsys.readouterr().err


def test_invalid_utf8_through_a_bpe_is_counted(corpus, tmp_path, capsys):
    tok = train_bpe([Path(corpus, "f0.py").read_text()], 300)
    with pytest.warns(UserWarning, match=r"1 of 2 documents are not valid UTF-8: 2 invalid byte sequences"):
        TokenStream.from_texts([b"ok \xef\xbf\xbd", b"def f(x): \xfe\xfe"], tok)  # U+FFFD itself is text
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "a.py").write_bytes(b"x = 1\n\xff\n")
    (tmp_path / "c" / "b.py").write_bytes(b"y = 2\n")
    with pytest.warns(UserWarning, match=r"1 of 2 documents are not valid UTF-8: 1 invalid byte sequences"):
        prepare_mod.prepare([tmp_path / "c"], tok, tmp_path / "s", workers=1)


def _collected_failed_task(source_dir: Path) -> None:
    """A task of a coroutine defined in ``source_dir`` fails, is never awaited, and is collected:
    asyncio then logs "Task exception was never retrieved" (what orbax's abandoned writes do)."""
    import asyncio
    import importlib.util

    source_dir.mkdir(parents=True)
    module = source_dir / "fake_serialization.py"
    module.write_text("async def async_serialize_from_host():\n    raise ValueError('no space left')\n")
    spec = importlib.util.spec_from_file_location(f"fake_{source_dir.parent.name}", module)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    loop = asyncio.new_event_loop()
    task = loop.create_task(mod.async_serialize_from_host())
    loop.run_until_complete(asyncio.sleep(0))
    loop.close()
    del task
    gc.collect()


def test_orbax_abandoned_write_tasks_are_not_logged_after_the_one_line(tmp_path, caplog):
    """A failed save is one line: asyncio's report of orbax's never-awaited failed write tasks is
    dropped; a failed task of any other code is still reported."""
    from meshlm.io.checkpoint import _quiet_orbax_threads

    _quiet_orbax_threads()
    with caplog.at_level("ERROR", logger="asyncio"):
        _collected_failed_task(tmp_path / "a" / "orbax")
        assert not caplog.records
        _collected_failed_task(tmp_path / "b" / "other")
    assert [r.getMessage().splitlines()[0] for r in caplog.records] == ["Task exception was never retrieved"]
