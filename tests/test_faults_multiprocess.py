"""Multi-process faults: a frozen peer is named in one line (never a C++ stack dump), the launched
coordinator listens on loopback only, an interrupted run exits 128 + signal after saving, and a mesh
that does not fit under `meshlm launch` names the launcher's flag.

Every run is bounded by a subprocess timeout; nothing asserts on timing."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import meshlm_argv, run_meshlm, train_args, train_rows, wait_for, write_corpus

from meshlm.io.checkpoint import Checkpointer
from meshlm.parallel import distributed
from meshlm.parallel.heartbeat import HEARTBEAT_EXIT_CODE, Heartbeat, _report_if_stopped
from meshlm.parallel.launch import DEVICES_ENV, free_port
from meshlm.parallel.mesh import _more_devices_hint

WORKER = str(Path(__file__).with_name("mp_worker.py"))
LAUNCH = ["launch", "-n", "2", "--devices-per-process", "2", "--"]
# `main_launch` of tests/mp_worker.py in a process of its own, so a test can signal it.
LAUNCH_WORKER = (
    "import sys; from meshlm.parallel.launch import main_launch; "
    f"sys.exit(main_launch(2, 2, sys.argv[1:], prefix=[sys.executable, {WORKER!r}]))"
)


pytestmark = pytest.mark.usefixtures("children_import_meshlm")  # conftest.py


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def _children(pid: int) -> dict[int, str]:
    ps = ["ps", "-ww", "-o", "pid=,args=", "--ppid", str(pid)]
    out = subprocess.run(ps, capture_output=True, text=True).stdout
    return {int(line.split()[0]): line for line in out.splitlines() if line.strip()}


def _child(launcher_pid: int, process_id: int) -> tuple[int, str]:
    """(pid, command line) of the launched process ``process_id``, once it is running."""
    found: dict = {}

    def running() -> bool:
        found.update(_children(launcher_pid))
        return any(f"--process-id {process_id}" in line for line in found.values())

    assert wait_for(running, timeout_s=60), "the launcher started no such process"
    return next((pid, line) for pid, line in found.items() if f"--process-id {process_id}" in line)


def _worker(port: int, process_id: int, *extra: str) -> subprocess.Popen:
    flags = ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--devices", "2"]
    return subprocess.Popen(
        [sys.executable, WORKER, *flags, "--process-id", str(process_id), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _joined(proc: subprocess.Popen) -> bool:
    """Read ``proc``'s stdout until it says it joined the job (False if it exits first)."""
    for line in proc.stdout:
        if line.startswith("hello from"):
            return True
    return False


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()  # also ends a stopped process
    proc.communicate(timeout=30)


# --- a frozen peer ------------------------------------------------------------------------------


def test_launcher_names_a_stopped_process_and_stops_all(tmp_path):
    argv = ["--mode", "spin", "--init-timeout", "10", "--pid-dir", str(tmp_path)]
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCH_WORKER, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert wait_for(lambda: len(list(tmp_path.glob("*.pid"))) == 2, timeout_s=60)
        time.sleep(0.2)  # let the pid files' writers finish writing
        victim = int((tmp_path / "1.pid").read_text())
        os.kill(victim, signal.SIGSTOP)
        _, err = launcher.communicate(timeout=120)
    finally:
        _kill(launcher)
    assert launcher.returncode == HEARTBEAT_EXIT_CODE, err[-2000:]  # 76: a peer stopped responding
    assert "process 1 was stopped (SIGSTOP)" in err, err[-2000:]
    assert "Check failure" not in err and "Traceback" not in err, err[-2000:]
    for pid in (int((tmp_path / f"{i}.pid").read_text()) for i in range(2)):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.parametrize(
    "victim, message",
    [
        (1, "meshlm: error: process 1 stopped responding (no heartbeat for 5 s); stopping"),
        (0, "meshlm: error: process 0 (the coordinator) stopped responding (no answer for 5 s); stopping"),
    ],
)
def test_heartbeat_without_launcher_names_the_frozen_peer(victim, message):
    port = free_port()
    procs = [_worker(port, i, "--mode", "spin", "--init-timeout", "5") for i in range(2)]
    try:
        assert _joined(procs[victim]), "the victim never joined"
        os.kill(procs[victim].pid, signal.SIGSTOP)
        _, err = procs[1 - victim].communicate(timeout=120)
    finally:
        for proc in procs:
            _kill(proc)
    assert procs[1 - victim].returncode == HEARTBEAT_EXIT_CODE, err[-2000:]
    # The frozen peer is on this host: the survivor ends it (it could never go on alone).
    ended = (
        f"{message[: -len('; stopping')]}, so it was ended (pid {procs[victim].pid} on this host); stopping"
    )
    assert ended in err.splitlines() and "Check failure" not in err, err[-2000:]
    assert procs[victim].wait(timeout=60) == -signal.SIGKILL
    assert distributed.HEARTBEAT_EXIT_CODE == HEARTBEAT_EXIT_CODE != distributed.TIMEOUT_EXIT_CODE


def test_a_frozen_peer_continued_after_the_others_gave_up_says_nothing_more():
    """SIGCONT after its peer gave up: no Gloo traceback, no C++ abort. On this host the peer ended it
    (SIGKILL works on a stopped process); on another host it reports itself in one line (below)."""
    port = free_port()
    procs = [_worker(port, i, "--mode", "spin", "--init-timeout", "3") for i in range(2)]
    try:
        assert _joined(procs[1]), "the victim never joined"
        os.kill(procs[1].pid, signal.SIGSTOP)
        _, err0 = procs[0].communicate(timeout=120)
        os.kill(procs[1].pid, signal.SIGCONT)
        _, err1 = procs[1].communicate(timeout=120)
    finally:
        for proc in procs:
            _kill(proc)
    assert procs[0].returncode == HEARTBEAT_EXIT_CODE and "so it was ended" in err0, err0[-2000:]
    assert procs[1].returncode == -signal.SIGKILL, err1[-2000:]
    assert "Traceback" not in err1 and "Check failure" not in err1 and "Gloo" not in err1, err1[-2000:]


def test_a_process_continued_after_its_peers_gave_up_reports_itself():
    reports: list[str] = []
    beat = Heartbeat(_FakeClient(), 1, 2, timeout_s=3, shutdown_s=3, on_stale=reports.append)
    _report_if_stopped(beat)  # continued at once: not stopped long enough for anyone to give up
    beat.ticked -= 7  # stopped for 7 s
    _report_if_stopped(beat)
    assert reports == [
        "this process (process 1) was stopped for 7 s, longer than the 3 s heartbeat timeout: "
        "its peers have given up on it"
    ]


def test_a_finished_peer_is_not_reported_as_frozen():
    # Process 1 exits at once; process 0 stays three heartbeat timeouts longer before it exits.
    port = free_port()
    procs = [_worker(port, i, "--mode", "linger", "--init-timeout", "3") for i in range(2)]
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-2000:]
        assert "stopped responding" not in err and "Check failure" not in err, err[-2000:]


class _FakeClient:
    """The two key-value calls the heartbeat makes; ``down`` makes them fail like an unreachable
    coordinator."""

    def __init__(self, values=None, down=False):
        self.values, self.down = dict(values or {}), down

    def key_value_set(self, key, value, allow_overwrite=False):
        if self.down:
            raise RuntimeError("UNAVAILABLE")
        self.values[key] = value

    def key_value_dir_get(self, prefix):
        if self.down:
            raise RuntimeError("UNAVAILABLE")
        return [(k, v) for k, v in self.values.items() if k.startswith(prefix)]


def _first_report(client, process_id=0, n=3) -> str:
    reports: list[str] = []
    beat = Heartbeat(client, process_id, n, timeout_s=1, shutdown_s=1, on_stale=reports.append).start()
    try:
        assert wait_for(lambda: bool(reports), timeout_s=30)
    finally:
        beat.stop()
    return reports[0]


def test_heartbeat_names_only_the_silent_peer():
    # Process 2 finished (done) and process 1 never beats: only process 1 is reported.
    report = _first_report(_FakeClient({"meshlm/heartbeat/2": "done"}))
    assert report == "process 1 stopped responding (no heartbeat for 1 s)"


def test_heartbeat_names_an_unreachable_coordinator():
    assert _first_report(_FakeClient(down=True), process_id=1).startswith("process 0 (the coordinator)")


def test_a_frozen_coordinator_is_named_whichever_clock_crosses_first():
    # Process 0's beat is read once per period, so its value goes stale before our last answer
    # does: with the service quiet for several periods as well, the report names the coordinator.
    beat = Heartbeat(_FakeClient(), 1, 2, timeout_s=5, shutdown_s=1, on_stale=lambda m: None)
    start = beat.answered
    beat.seen[0], beat.answered = start, start + 1.0
    expected = "process 0 (the coordinator) stopped responding (no answer for 5 s)"
    assert beat.stale_message(start + 5.5) == expected
    # The service still answering (a beat a moment ago) while process 0's counter stands still:
    # process 0's own loop is stuck, and that is what the report says.
    beat.answered = start + 5.2
    assert beat.stale_message(start + 5.5) == "process 0 stopped responding (no heartbeat for 5 s)"


def test_finished_process_gives_up_on_peers_that_never_finish():
    client = _FakeClient()
    reports: list[str] = []
    beat = Heartbeat(client, 0, 2, timeout_s=30, shutdown_s=1, on_stale=reports.append).start()
    try:
        # A live peer (it keeps beating) that never finishes.
        beat.finish()
        assert client.values["meshlm/heartbeat/0"] == "done"
        count = 0

        def peer_beats() -> bool:
            nonlocal count
            count += 1
            client.values["meshlm/heartbeat/1"] = str(count)
            return bool(reports)

        assert wait_for(peer_beats, timeout_s=30)
    finally:
        beat.stop()
    assert reports[0] == "process 1 did not finish within 1 s after this one (process 0) did"


# --- the coordinator listens on loopback only ---------------------------------------------------


def _listening_addresses(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp{,6} writes them) of sockets listening on ``port``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.append(address)
    return found


def _is_loopback(address: str) -> bool:
    # IPv4 127.0.0.1 in host byte order, IPv6 ::1, and IPv4-mapped ::ffff:127.0.0.1.
    return address in ("0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F")


@pytest.mark.skipif(not Path("/proc/net/tcp6").exists(), reason="reads Linux's /proc/net")
def test_launched_coordinator_listens_on_loopback_only(tmp_path):
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCH_WORKER, "--mode", "spin"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        _, line = _child(launcher.pid, 0)
        port = int(line.split("--coordinator 127.0.0.1:")[1].split()[0])
        assert wait_for(lambda: bool(_listening_addresses(port)), timeout_s=60), "no coordinator listened"
        addresses = _listening_addresses(port)
    finally:
        launcher.send_signal(signal.SIGTERM)
        launcher.communicate(timeout=60)
    assert addresses and all(map(_is_loopback, addresses)), addresses


@pytest.mark.parametrize(
    "coordinator, bound",
    [("127.0.0.1:1234", True), ("localhost:1234", True), ("[::1]:1234", True), ("10.0.0.1:1234", False)],
)
def test_only_a_loopback_coordinator_is_bound_to_loopback(coordinator, bound, monkeypatch):
    monkeypatch.delenv("JAX_COORDINATOR_BIND_ADDRESS", raising=False)
    assert distributed._bind_loopback(coordinator) == (
        {"coordinator_bind_address": coordinator} if bound else {}
    )
    monkeypatch.setenv("JAX_COORDINATOR_BIND_ADDRESS", "[::]:1234")  # the user's choice wins
    assert distributed._bind_loopback(coordinator) == {}


# --- exit codes: 0 only for a finished run ------------------------------------------------------


def _interrupt_after_two_rows(argv: list[str], out: Path) -> subprocess.CompletedProcess:
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    try:
        wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3, poll_s=0.2)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        _kill(proc)
    return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)


# slow: the same SIGTERM save as tests/test_train.py::test_sigterm_saves_and_exits_143 (quick), with another
# corpus length
@pytest.mark.slow
def test_sigterm_saves_and_exits_143_standalone(corpus, tmp_path):
    done = _interrupt_after_two_rows(
        meshlm_argv(*train_args(corpus, tmp_path, 400), "--devices", "4"), tmp_path
    )
    assert done.returncode == 128 + signal.SIGTERM, done.stderr[-2000:]
    assert "SIGTERM: saved a checkpoint at step" in done.stderr
    assert Checkpointer(tmp_path).latest_step() == train_rows(tmp_path)[-1]["step"]


def test_sigterm_under_launch_saves_and_exits_143(corpus, tmp_path):
    argv = meshlm_argv(*LAUNCH, *train_args(corpus, tmp_path, 400, save_every=1000))
    done = _interrupt_after_two_rows(argv, tmp_path)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr[-3000:]
    assert "SIGTERM: saved a checkpoint at step" in done.stderr and "Check failure" not in done.stderr
    # Both processes stopped at the same step (they agree), so the save completed there.
    assert Checkpointer(tmp_path).latest_step() == train_rows(tmp_path)[-1]["step"]


# --- the mesh hint under launch -----------------------------------------------------------------


def test_mesh_error_under_launch_names_devices_per_process():
    launch = ["launch", "-n", "2", "--devices-per-process", "1", "--"]
    out = run_meshlm(*launch, "verify", "--config", "tiny", "--mesh", "2x2", timeout=180)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "pass --devices-per-process 2 to meshlm launch (-n 2)" in out.stderr, out.stderr[-2000:]
    assert "pass --devices 4" not in out.stderr


def test_mesh_hint_without_launch_names_devices(monkeypatch):
    monkeypatch.delenv(DEVICES_ENV, raising=False)
    assert _more_devices_hint(8, 1) == "pass --devices 8 (CPU)"
    monkeypatch.setenv(DEVICES_ENV, "2")
    assert _more_devices_hint(8, 3) == "pass --devices-per-process 3 to meshlm launch (-n 3)"
