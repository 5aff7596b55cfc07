"""The same mesh across processes (JAX distributed runtime, gloo on loopback) via `meshlm launch`."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from meshlm.checkpoint import Checkpointer

TEXT = "def f(x):\n    return x * 2 + 1  # a comment\n" * 400


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    for i in range(6):
        (d / f"f{i}.py").write_text(TEXT.replace("f(", f"g{i}("))
    return str(d)


def _meshlm(*args, timeout=300, **kw):
    return subprocess.run(
        [sys.executable, "-m", "meshlm", *args], capture_output=True, text=True, timeout=timeout, **kw
    )


def _train_args(corpus, out, steps=10):
    return [
        "train",
        "--config",
        "tiny-lm",
        "--data",
        corpus,
        "--steps",
        str(steps),
        "--batch-size",
        "8",
        "--seq-len",
        "32",
        "--eval-every",
        "5",
        "--save-every",
        "5",
        "--sample-tokens",
        "0",
        "--mesh",
        "2x2",
        "--out",
        str(out),
    ]


def _losses(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def test_launch_verify_spans_both_processes():
    out = _meshlm(
        "launch",
        "-n",
        "2",
        "--devices-per-process",
        "2",
        "--",
        "verify",
        "--config",
        "tiny",
        "--mesh",
        "2x2",
        "--json",
    )
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["ok"] and report["mesh"] == {"dp": 2, "mp": 2}
    assert len(report["controls"]) >= 4 and all(c["detected"] for c in report["controls"])


def test_two_processes_train_like_one_and_checkpoint_restores_in_one(corpus, tmp_path):
    two = _meshlm(
        "launch", "-n", "2", "--devices-per-process", "2", "--", *_train_args(corpus, tmp_path / "two")
    )
    assert two.returncode == 0, two.stderr[-2000:]
    one = _meshlm(*_train_args(corpus, tmp_path / "one"), "--devices", "4")
    assert one.returncode == 0, one.stderr[-2000:]
    np.testing.assert_allclose(_losses(tmp_path / "two"), _losses(tmp_path / "one"), rtol=1e-6)
    assert Checkpointer(tmp_path / "two").all_steps() == [5, 10]
    # written by 2 processes, read by 1 on a different mesh: the proof runs from it
    v = _meshlm("verify", "--checkpoint", str(tmp_path / "two"), "--mesh", "1x4", "--devices", "4", "--json")
    assert v.returncode == 0 and json.loads(v.stdout)["ok"], v.stdout[-3000:] + v.stderr[-2000:]


def test_wrong_process_count_fails_fast():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.time()
    out = _meshlm(
        "verify",
        "--config",
        "tiny",
        "--coordinator",
        f"127.0.0.1:{port}",
        "--num-processes",
        "2",
        "--process-id",
        "0",
        "--devices",
        "2",
        "--init-timeout",
        "5",
        timeout=90,
    )
    assert out.returncode != 0 and time.time() - t0 < 60
    assert "not all processes joined" in out.stderr


def test_coordinator_port_in_use_is_a_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = _meshlm(
            "verify",
            "--config",
            "tiny",
            "--coordinator",
            f"127.0.0.1:{port}",
            "--num-processes",
            "2",
            "--process-id",
            "0",
            "--devices",
            "2",
            timeout=90,
        )
    assert out.returncode == 2 and "is already in use" in out.stderr, out.stderr[-1000:]


def _children(pid):
    out = subprocess.run(
        ["ps", "-ww", "-o", "pid=,args=", "--ppid", str(pid)], capture_output=True, text=True
    ).stdout
    return {int(line.split()[0]): line for line in out.splitlines() if line.strip()}


def test_peer_killed_mid_run_stops_all_and_keeps_checkpoint(corpus, tmp_path):
    args = _train_args(corpus, tmp_path, steps=400)
    args[args.index("--save-every") + 1] = "3"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "meshlm", "launch", "-n", "2", "--devices-per-process", "2", "--", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 240
    while time.time() < deadline and not Checkpointer(tmp_path).all_steps():
        time.sleep(0.2)
    assert Checkpointer(tmp_path).all_steps(), "no checkpoint was written"
    victim = next(pid for pid, line in _children(launcher.pid).items() if "--process-id 1" in line)
    os.kill(victim, signal.SIGKILL)
    t0 = time.time()
    _, err = launcher.communicate(timeout=90)
    assert launcher.returncode != 0 and time.time() - t0 < 60
    assert "process 1" in err
    steps = Checkpointer(tmp_path).all_steps()
    assert steps
    resumed = _meshlm(
        *_train_args(corpus, tmp_path, steps=steps[-1] + 2)[:-2], "--out", str(tmp_path), "--devices", "4"
    )
    # a different --steps is allowed; the resumed run starts from the last complete checkpoint
    assert "resuming from" in resumed.stderr, resumed.stderr[-2000:]
