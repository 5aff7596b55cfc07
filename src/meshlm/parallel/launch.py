"""``meshlm launch -n N --devices-per-process D -- <command> [args]``: N local JAX processes.

Each process gets ``--coordinator 127.0.0.1:PORT --num-processes N --process-id I --devices D``
appended to its command. Output stays readable: process 0's stdout passes through unchanged,
every other stream is prefixed ``[i] `` and goes to our stderr. If any process fails, or is
stopped (SIGSTOP) for more than a few seconds, the rest are stopped at once, so a crashed or
frozen peer never leaves the others hanging in a collective.

Exit status: 0 iff every process exited 0; a failed process's code (128 + s for one killed by
signal s); 128 + s after our signal s (forwarded, so each process saves and exits 128 + s itself);
76 (``HEARTBEAT_EXIT_CODE``, as a process that gives up on a peer exits) for a process stopped
(SIGSTOP, SIGTSTP) past the grace time.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO, Any

from meshlm.errors import DistributedError
from meshlm.parallel.heartbeat import HEARTBEAT_EXIT_CODE

_POLL_S = 0.05
# The environment variable telling a launched process its --devices come from the launcher.
DEVICES_ENV = "MESHLM_LAUNCH_DEVICES_PER_PROCESS"
# A process exiting with one of these was interrupted (SIGINT, SIGTERM) and saved its state.
INTERRUPTED_CODES = (128 + signal.SIGINT, 128 + signal.SIGTERM)
_write_lock = threading.Lock()  # one line at a time, so lines of different processes never mix


def main_launch(
    n: int,
    devices_per_process: int,
    command: list[str],
    *,
    python: str = sys.executable,
    prefix: Sequence[str] | None = None,
    kill_after_s: float = 5.0,
    save_grace_s: float = 120.0,
    stopped_grace_s: float = 5.0,
) -> int:
    """Run ``python -m meshlm <command...>`` as N cooperating processes; 0 iff all exit 0.

    ``prefix`` replaces ``[python, "-m", "meshlm"]`` (e.g. ``[python, "worker.py"]``) so any
    program taking the four distributed flags can be launched. On failure of one process, the
    others get SIGTERM, then SIGKILL after ``kill_after_s``. Our SIGINT/SIGTERM is forwarded and
    the processes get ``save_grace_s`` to save and exit (a second signal cuts it short). A process
    stopped for ``stopped_grace_s`` is killed and the others stopped.
    """
    graces = (kill_after_s, save_grace_s, stopped_grace_s)
    _validate(n, devices_per_process, graces)
    argv0 = list(prefix) if prefix is not None else [python, "-m", "meshlm"]
    coordinator = f"127.0.0.1:{free_port()}"
    procs: list[subprocess.Popen[bytes]] = []
    pumps: list[threading.Thread] = []
    try:
        for i in range(n):
            flags = ["--coordinator", coordinator, "--num-processes", str(n)]
            flags += ["--process-id", str(i), "--devices", str(devices_per_process)]
            procs.append(_spawn([*argv0, *command, *flags], devices_per_process))
            pumps += _start_pumps(i, procs[-1])
        code = _supervise(procs, *graces)
    finally:
        _stop(procs, kill_after_s)  # no-op when all exited; covers errors while spawning
        for pump in pumps:
            pump.join(timeout=kill_after_s)
    return code


def free_port() -> int:
    """A loopback TCP port that was free a moment ago (the OS picks it: bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _validate(n: Any, devices_per_process: Any, graces: tuple[float, ...]) -> None:
    for name, value in (("-n", n), ("--devices-per-process", devices_per_process)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise DistributedError(f"meshlm launch {name} must be an int >= 1, got {value!r}")
    for name, value in zip(("kill_after_s", "save_grace_s", "stopped_grace_s"), graces, strict=True):
        if not value > 0:
            raise DistributedError(f"{name} must be > 0, got {value!r}")


def _spawn(argv: list[str], devices_per_process: int) -> subprocess.Popen[bytes]:
    # PYTHONUNBUFFERED: lines reach us as printed, not at exit. DEVICES_ENV: a mesh that does
    # not fit can name the flag the user actually controls (--devices-per-process).
    env = {**os.environ, "PYTHONUNBUFFERED": "1", DEVICES_ENV: str(devices_per_process)}
    # A session of its own: a terminal's Ctrl-C reaches the children once, through our forward,
    # not twice (directly and forwarded).
    return subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        start_new_session=True,
    )


def _start_pumps(i: int, proc: subprocess.Popen[bytes]) -> list[threading.Thread]:
    """Threads copying the child's pipes to ours (a full pipe would block the child)."""
    out_prefix = "" if i == 0 else f"[{i}] "
    out_to = "stdout" if i == 0 else "stderr"
    pumps = [
        threading.Thread(target=_pump, args=(proc.stdout, out_prefix, out_to), daemon=True),
        threading.Thread(target=_pump, args=(proc.stderr, f"[{i}] ", "stderr"), daemon=True),
    ]
    for pump in pumps:
        pump.start()
    return pumps


def _pump(pipe: IO[bytes], prefix: str, stream_name: str) -> None:
    for raw in iter(pipe.readline, b""):
        line = raw.decode("utf-8", errors="replace")
        with _write_lock:
            # Looked up per line: sys.stdout/err may be replaced (e.g. by test capture).
            stream = getattr(sys, stream_name)
            stream.write(prefix + line if line.endswith("\n") else prefix + line + "\n")
            stream.flush()
    pipe.close()


def _supervise(
    procs: list[subprocess.Popen[bytes]], kill_after_s: float, save_grace_s: float, stopped_grace_s: float
) -> int:
    """Wait for all processes; on the first failure, freeze or signal, stop the rest and say why."""
    received: list[int] = []
    restore = _forward_signals(procs, received)
    stopped_since: dict[int, float] = {}
    try:
        while True:
            codes = [p.poll() for p in procs]
            interrupted = [i for i, c in enumerate(codes) if c in INTERRUPTED_CODES]
            if received or interrupted:
                # Every process got the signal (or will stop at the same step as the one that
                # did): give them the time to save and exit cleanly.
                _wait(procs, save_grace_s, until=lambda: len(received) > 1)
                _stop(procs, kill_after_s)
                why = f"got signal {received[0]}" if received else f"process {interrupted[0]} was interrupted"
                _say(f"meshlm launch: {why}; stopped all processes")
                return 128 + received[0] if received else codes[interrupted[0]]
            failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                return _after_failure(procs, codes, failed, kill_after_s)
            if all(c == 0 for c in codes):
                return 0
            frozen = _frozen(procs, stopped_since, stopped_grace_s)
            if frozen is not None:
                return _after_freeze(procs, *frozen)
            time.sleep(_POLL_S)
    finally:
        restore()


def _after_failure(
    procs: list[subprocess.Popen[bytes]], codes: list, failed: list[int], kill_after_s: float
) -> int:
    # Name every process that has failed by now: a peer's death can make others fail within the
    # same poll, and the lowest index is not necessarily the cause.
    code = codes[failed[0]]
    others = sum(c is None for c in codes)
    which = ", ".join(f"process {i} exited with code {codes[i]}" for i in failed)
    _say(f"meshlm launch: {which}; stopping the {others} still running")
    _stop(procs, kill_after_s)
    return code if code > 0 else 128 - code  # killed by signal s: 128 + s


def _frozen(
    procs: list[subprocess.Popen[bytes]], since: dict[int, float], grace_s: float
) -> tuple[int, int] | None:
    """(index, stop signal) of a process stopped for ``grace_s`` seconds without a break, if any.

    A launched process has a session of its own (no terminal job control stops it), so a stop
    that lasts is a fault or a deliberate freeze: its peers sit in a collective meanwhile.
    """
    now = time.monotonic()
    for i, proc in enumerate(procs):
        sig = _stop_signal(proc)
        if sig is None:
            since.pop(i, None)
        elif now - since.setdefault(i, now) >= grace_s:
            return i, sig
    return None


def _stop_signal(proc: subprocess.Popen[bytes]) -> int | None:
    """The signal that stopped ``proc`` if it is stopped now, else None (WNOWAIT: the state stays
    for ``Popen.poll`` to collect, and a continued process no longer reports as stopped)."""
    if not hasattr(os, "waitid") or proc.returncode is not None:
        return None
    try:
        info = os.waitid(os.P_PID, proc.pid, os.WSTOPPED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # exited meanwhile: poll() reports it
        return None
    return info.si_status if info is not None and info.si_code == os.CLD_STOPPED else None


def _after_freeze(procs: list[subprocess.Popen[bytes]], i: int, sig: int) -> int:
    try:
        name = signal.Signals(sig).name
    except ValueError:
        name = f"signal {sig}"
    _say(
        f"meshlm launch: process {i} was stopped ({name}) and its peers cannot go on without "
        f"it; stopping all {len(procs)} processes"
    )
    # SIGKILL for all, the frozen one last: the others sit in a collective that cannot complete
    # (no signal handler runs there, nothing could be saved without the frozen peer), and killing
    # it first would only make them print its lost connection. SIGTERM would not even reach it.
    for proc in [*procs[:i], *procs[i + 1 :], procs[i]]:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        proc.wait()
    return HEARTBEAT_EXIT_CODE  # a peer stopped responding, whatever stopped it


def _forward_signals(procs: list[subprocess.Popen[bytes]], received: list[int]) -> Any:
    """Forward SIGINT/SIGTERM to live children; returns a function restoring old handlers."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None  # only the main thread may set handlers; nothing to forward then

    def forward(signum: int, frame: Any) -> None:
        received.append(signum)
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    old = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    return lambda: [signal.signal(sig, handler) for sig, handler in old.items()]


def _stop(procs: list[subprocess.Popen[bytes]], kill_after_s: float) -> None:
    """SIGTERM every live process, then SIGKILL whatever is still alive after the grace time."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    _wait(procs, kill_after_s)
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _wait(procs: list[subprocess.Popen[bytes]], seconds: float, until: Any = lambda: False) -> None:
    """Wait until every process has exited, ``seconds`` have passed or ``until()``, whichever is first."""
    deadline = time.monotonic() + seconds
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline and not until():
        time.sleep(_POLL_S)


def _say(message: str) -> None:
    with _write_lock:
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
