"""``meshlm launch -n N --devices-per-process D -- <command> [args]``: N local JAX processes.

Each process gets ``--coordinator 127.0.0.1:PORT --num-processes N --process-id I --devices D``
appended to its command. Output stays readable: process 0's stdout passes through unchanged,
every other stream is prefixed ``[i] `` and goes to our stderr. If any process fails, the rest
are stopped at once, so a crashed peer never leaves the others hanging in a collective.
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

_POLL_S = 0.05
_write_lock = threading.Lock()  # one line at a time, so lines of different processes never mix


def main_launch(
    n: int,
    devices_per_process: int,
    command: list[str],
    *,
    python: str = sys.executable,
    prefix: Sequence[str] | None = None,
    kill_after_s: float = 5.0,
) -> int:
    """Run ``python -m meshlm <command...>`` as N cooperating processes; 0 iff all exit 0.

    ``prefix`` replaces ``[python, "-m", "meshlm"]`` (e.g. ``[python, "worker.py"]``) so any
    program taking the four distributed flags can be launched. On failure of one process, the
    others get SIGTERM, then SIGKILL after ``kill_after_s``; our SIGINT/SIGTERM is forwarded.
    """
    _validate(n, devices_per_process, kill_after_s)
    argv0 = list(prefix) if prefix is not None else [python, "-m", "meshlm"]
    coordinator = f"127.0.0.1:{free_port()}"
    procs: list[subprocess.Popen[bytes]] = []
    pumps: list[threading.Thread] = []
    try:
        for i in range(n):
            flags = ["--coordinator", coordinator, "--num-processes", str(n)]
            flags += ["--process-id", str(i), "--devices", str(devices_per_process)]
            procs.append(_spawn([*argv0, *command, *flags]))
            pumps += _start_pumps(i, procs[-1])
        code = _supervise(procs, kill_after_s)
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


def _validate(n: Any, devices_per_process: Any, kill_after_s: float) -> None:
    for name, value in (("-n", n), ("--devices-per-process", devices_per_process)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise DistributedError(f"meshlm launch {name} must be an int >= 1, got {value!r}")
    if not kill_after_s > 0:
        raise DistributedError(f"kill_after_s must be > 0, got {kill_after_s!r}")


def _spawn(argv: list[str]) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # lines reach us as printed, not at exit
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


def _supervise(procs: list[subprocess.Popen[bytes]], kill_after_s: float) -> int:
    """Wait for all processes; on the first failure or signal, stop the rest and say why."""
    received: list[int] = []
    restore = _forward_signals(procs, received)
    try:
        while True:
            if received:
                # The children got the signal too: give them the grace time to exit cleanly.
                _wait(procs, kill_after_s)
                _stop(procs, kill_after_s)
                _say(f"meshlm launch: got signal {received[0]}; stopped all processes")
                return 128 + received[0]
            codes = [p.poll() for p in procs]
            failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                # Name every process that has failed by now: a peer's death can make others fail
                # within the same poll, and the lowest index is not necessarily the cause.
                code = codes[failed[0]]
                others = sum(c is None for c in codes)
                which = ", ".join(f"process {i} exited with code {codes[i]}" for i in failed)
                _say(f"meshlm launch: {which}; stopping the {others} still running")
                _stop(procs, kill_after_s)
                return code if code > 0 else 128 - code  # killed by signal s: 128 + s
            if all(c == 0 for c in codes):
                return 0
            time.sleep(_POLL_S)
    finally:
        restore()


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


def _wait(procs: list[subprocess.Popen[bytes]], seconds: float) -> None:
    """Wait until every process has exited or ``seconds`` have passed, whichever is first."""
    deadline = time.monotonic() + seconds
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(_POLL_S)


def _say(message: str) -> None:
    with _write_lock:
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
