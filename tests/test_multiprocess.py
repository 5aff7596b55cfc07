"""The same mesh across processes (JAX distributed runtime, gloo on loopback) via `meshlm launch`.

Fault tests bound each run with a subprocess timeout (the requirement: a clear error and a non-zero
exit within 60 s, never a hang) instead of timing assertions."""

import json
import os
import signal
import socket
import subprocess

import numpy as np
import pytest
from helpers import meshlm_argv, run_meshlm, train_args, train_rows, wait_for, write_corpus

from meshlm.io.checkpoint import Checkpointer
from meshlm.parallel.launch import free_port

LAUNCH = ["launch", "-n", "2", "--devices-per-process", "2", "--"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def _losses(out):
    return [r["loss"] for r in train_rows(out)]


def _lone_process_zero(port: int, *extra: str) -> list[str]:
    """verify as process 0 of a 2-process job whose process 1 never comes."""
    flags = f"--coordinator 127.0.0.1:{port} --num-processes 2 --process-id 0 --devices 2"
    return ["verify", "--config", "tiny", *flags.split(), *extra]


def _launched_verify(*extra: str) -> dict:
    """``meshlm verify --config tiny --mesh 2x2`` over 2 processes: its report, passing, with its
    controls detected and the data pipeline's rows (each process builds its own rows; assembled, they
    equal the one-device batch)."""
    out = run_meshlm(*LAUNCH, "verify", "--config", "tiny", "--mesh", "2x2", "--json", *extra)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["ok"] and report["mesh"] == {"dp": 2, "mp": 2}
    assert len(report["controls"]) >= 4 and all(c["detected"] for c in report["controls"])
    data = [c for c in report["checks"] if c["name"].startswith("data pipeline")]
    assert len(data) == 2 and all(c["ok"] for c in data)
    return report


# The quick tier: the proof across processes without the communication check (its train step and the
# extra all-reduce's compiled again in each process); the check itself is quick in one process
# (tests/test_prover.py::test_communication_is_minimal_and_an_extra_all_reduce_is_caught)
def test_launch_verify_spans_both_processes():
    _launched_verify("--no-collectives")


# slow: the same proof with the communication check (its cost: two more train steps compiled in each
# process); the multi-process bug class (one mesh across processes) is caught quick by
# test_launch_verify_spans_both_processes
@pytest.mark.slow
def test_launch_verify_counts_the_collectives_across_processes():
    report = _launched_verify()
    assert any(c["name"] == "all-reduces per step" for c in report["checks"]), report["checks"]


# slow: its cost (two processes train, then a restore in one: ~1 CPU-min); the multi-process bug class (one
# mesh across processes) is test_launch_verify_spans_both_processes's, quick
@pytest.mark.slow
def test_two_processes_train_like_one_and_checkpoint_restores_in_one(corpus, tmp_path):
    two = run_meshlm(*LAUNCH, *train_args(corpus, tmp_path / "two", 10, save_every=5, eval_every=5))
    assert two.returncode == 0, two.stderr[-2000:]
    one = run_meshlm(*train_args(corpus, tmp_path / "one", 10, save_every=5, eval_every=5), "--devices", "4")
    assert one.returncode == 0, one.stderr[-2000:]
    np.testing.assert_allclose(_losses(tmp_path / "two"), _losses(tmp_path / "one"), rtol=1e-6)
    assert Checkpointer(tmp_path / "two").all_steps() == [5, 10]
    # written by 2 processes, read by 1 on a different mesh: the proof runs from it
    v = run_meshlm(
        "verify", "--checkpoint", str(tmp_path / "two"), "--mesh", "1x4", "--devices", "4", "--json"
    )
    assert v.returncode == 0 and json.loads(v.stdout)["ok"], v.stdout[-3000:] + v.stderr[-2000:]


def test_wrong_process_count_fails_fast():
    out = run_meshlm(*_lone_process_zero(free_port(), "--init-timeout", "5"), timeout=60)
    assert out.returncode != 0 and "not all processes joined" in out.stderr, out.stderr[-1000:]


def test_coordinator_port_in_use_is_a_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        out = run_meshlm(*_lone_process_zero(s.getsockname()[1]), timeout=60)
    assert out.returncode == 2 and "is already in use" in out.stderr, out.stderr[-1000:]


def _children(pid):
    ps = ["ps", "-ww", "-o", "pid=,args=", "--ppid", str(pid)]
    out = subprocess.run(ps, capture_output=True, text=True).stdout
    return {int(line.split()[0]): line for line in out.splitlines() if line.strip()}


# slow: its cost (a two-process run trained until a checkpoint, then a kill); a dying peer stopping the
# others: tests/test_distributed.py::test_failing_process_stops_the_others and test_faults_multiprocess.py's
# stopped peer, quick
@pytest.mark.slow
def test_peer_killed_mid_run_stops_all_and_keeps_checkpoint(corpus, tmp_path):
    launcher = subprocess.Popen(
        meshlm_argv(*LAUNCH, *train_args(corpus, tmp_path, 400)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for(lambda: bool(Checkpointer(tmp_path).all_steps()), poll_s=0.2)
    assert Checkpointer(tmp_path).all_steps(), "no checkpoint was written"
    victim = next(pid for pid, line in _children(launcher.pid).items() if "--process-id 1" in line)
    os.kill(victim, signal.SIGKILL)
    _, err = launcher.communicate(timeout=60)  # raises (fails) if the launcher does not stop in time
    assert launcher.returncode != 0 and "process 1 exited with code -9" in err, err[-2000:]
    steps = Checkpointer(tmp_path).all_steps()
    assert steps
    resumed = run_meshlm(*train_args(corpus, tmp_path, steps[-1] + 2), "--devices", "4")
    assert resumed.returncode == 0 and "resuming from" in resumed.stderr, resumed.stderr[-2000:]
