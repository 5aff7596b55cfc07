"""Multi-process runs on loopback: real cross-process collectives, fail-fast, bounded timeouts."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest

from meshlm.errors import DistributedError
from meshlm.parallel import distributed
from meshlm.parallel.distributed import TIMEOUT_EXIT_CODE
from meshlm.parallel.launch import free_port, main_launch

WORKER = str(Path(__file__).with_name("mp_worker.py"))
PREFIX = [sys.executable, WORKER]


pytestmark = pytest.mark.usefixtures("children_import_meshlm")  # conftest.py


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _pids(folder: Path, n: int) -> list[int]:
    return [int((folder / f"{i}.pid").read_text()) for i in range(n)]


def test_two_processes_psum_over_all_global_devices(capsys):
    start = time.monotonic()
    code = main_launch(2, 2, [], prefix=PREFIX)
    out, err = capsys.readouterr()
    assert code == 0, err
    # 0..15 as a 4x4 over a 2x2 mesh: the sum of the four 2x2 blocks.
    assert "RESULT [[20.0, 24.0], [36.0, 40.0]]" in out
    assert out.count("RESULT") == 1  # print0: process 0 only
    assert "hello from 0" in out and "hello from 1" not in out
    assert "[1] hello from 1" in err and "[0] stderr from 0" in err and "[1] stderr from 1" in err
    assert time.monotonic() - start < 30


def test_failing_process_stops_the_others(tmp_path, capsys):
    start = time.monotonic()
    argv = ["--mode", "fail", "--fail-code", "3", "--pid-dir", str(tmp_path)]
    code = main_launch(2, 2, argv, prefix=PREFIX, kill_after_s=2)
    err = capsys.readouterr().err
    assert code == 3, err
    assert "process 1 exited with code 3" in err
    # Process 0 was blocked in the psum waiting for process 1; the launcher must have ended it.
    assert all(_gone(pid) for pid in _pids(tmp_path, 2))
    assert time.monotonic() - start < 30


def test_uncaught_exception_fails_fast(capsys):
    # Without meshlm's excepthook the raiser would wait in JAX's shutdown barrier for its peer.
    start = time.monotonic()
    code = main_launch(2, 1, ["--mode", "raise"], prefix=PREFIX, kill_after_s=2)
    err = capsys.readouterr().err
    assert code == 1, err
    assert "[1] RuntimeError: worker failed on purpose" in err
    assert "process 1 exited with code 1" in err
    assert time.monotonic() - start < 30


def test_missing_peer_fails_with_clear_error_in_bounded_time():
    # Process 0 of 2 waits for a process 1 that never comes; process 1 of 2 has no coordinator.
    start = time.monotonic()
    procs = [
        subprocess.Popen(
            [*PREFIX, "--coordinator", f"127.0.0.1:{free_port()}", "--num-processes", "2"]
            + ["--process-id", str(i), "--init-timeout", "5"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    for i, proc in enumerate(procs):
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == TIMEOUT_EXIT_CODE, err
        assert f"DistributedError: process {i} of 2" in err
        assert "not all processes joined within 5 s" in err
    assert time.monotonic() - start < 30


def test_launcher_forwards_sigterm(tmp_path):
    code = (
        "import sys; from meshlm.parallel.launch import main_launch; "
        f"sys.exit(main_launch(2, 1, sys.argv[1:], prefix=[sys.executable, {WORKER!r}]))"
    )
    argv = ["--mode", "sleep", "--pid-dir", str(tmp_path)]
    launcher = subprocess.Popen(
        [sys.executable, "-c", code, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + 30
    while len(list(tmp_path.glob("*.pid"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)  # let the pid files' writers finish writing
    launcher.send_signal(signal.SIGTERM)
    _, err = launcher.communicate(timeout=30)
    assert launcher.returncode == 128 + signal.SIGTERM, err
    assert all(_gone(pid) for pid in _pids(tmp_path, 2))


@pytest.mark.parametrize(
    "coordinator, num_processes, process_id, match",
    [
        ("127.0.0.1:1234", 2, 2, r"process_id must be an int in \[0, 2\)"),
        ("127.0.0.1:1234", 2, -1, "process_id"),
        ("127.0.0.1:1234", 2, "0", "process_id"),
        ("127.0.0.1:1234", 0, 0, "num_processes must be an int >= 1"),
        ("127.0.0.1:1234", True, 0, "num_processes"),
        ("127.0.0.1:1234", 2.0, 0, "num_processes"),
        ("localhost", 2, 0, "HOST:PORT"),
        ("127.0.0.1:0", 2, 0, "HOST:PORT"),
        ("127.0.0.1:70000", 2, 0, "HOST:PORT"),
        ("http://127.0.0.1:1234", 2, 0, "HOST:PORT"),
        (":1234", 2, 0, "HOST:PORT"),
        (None, 2, 0, "must be given together"),
        ("127.0.0.1:1234", 2, None, "must be given together"),
    ],
)
def test_initialize_rejects_bad_arguments(coordinator, num_processes, process_id, match):
    # Validation happens before JAX is touched, so this is safe in the test process.
    with pytest.raises(DistributedError, match=match):
        distributed.initialize(coordinator, num_processes, process_id)


def test_initialize_rejects_bad_timeout():
    with pytest.raises(DistributedError, match="init_timeout_s"):
        distributed.initialize("127.0.0.1:1234", 2, 0, init_timeout_s=0)


@pytest.mark.parametrize("coordinator", ["[::1]:1234", "node-1.cluster.local:8476", "10.0.0.1:1"])
def test_accepts_coordinator_forms(coordinator):
    distributed._validate(coordinator, 4, 3)


def test_no_arguments_and_no_job_environment_is_single_process(monkeypatch):
    for var in ("JAX_COORDINATOR_ADDRESS", "SLURM_JOB_ID", "OMPI_MCA_orte_hnp_uri"):
        monkeypatch.delenv(var, raising=False)
    distributed.initialize(None, None, None)
    assert not jax.distributed.is_initialized()
    assert distributed.is_main()


@pytest.mark.parametrize("n, devices, match", [(0, 1, "-n"), (2, 0, "--devices-per-process"), (1.5, 1, "-n")])
def test_launch_rejects_bad_arguments(n, devices, match):
    with pytest.raises(DistributedError, match=match):
        main_launch(n, devices, [], prefix=PREFIX)
