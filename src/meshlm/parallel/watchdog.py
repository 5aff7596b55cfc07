"""No command waits forever on a device program that never finishes (issue 59).

A device program can hang with every thread idle and nothing failing: devices that wait on each other
in a collective some never reach, or a library kernel waiting for a thread pool that it itself fills
(jaxlib 0.10's batched LAPACK solve on XLA:CPU: ``model.deltanet.unit_lower_solve``). The host's read
of the program's output then waits forever. Multi-process runs have the heartbeat
(``parallel.heartbeat``) for a peer that stops; this is its counterpart for a process's own devices.

Each blocking host read of a program's output is watched (``waiting``: ``placement.to_host``, the train
loop's ``block_until_ready``). A read that lasts longer than the stall limit ends the process with one
line naming the program (``program``: set by the command, e.g. "the sharded train step") and its mesh,
and exit code 3 (``STALL_EXIT_CODE``). Only reads count: compiling and dispatching are not watched, and
every completed read is progress (the next read starts a fresh limit), so a healthy run of many steps
never meets it; only a single program running longer than the limit would (raise it then).

The limit: ``MESHLM_STALL_TIMEOUT`` seconds (default 1800; 0 turns the watch off), checked by every
command before its work starts (``check_settings``).
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

from meshlm.errors import ConfigError

STALL_EXIT_CODE = 3  # the verifier-error code: no answer either way
ENV = "MESHLM_STALL_TIMEOUT"
DEFAULT_LIMIT_S = 1800.0  # generous: a tiny model's step takes well under a second, a large one minutes
UNNAMED = "a device program"  # a read outside any ``program``: the mesh still comes from its array


@dataclass(frozen=True)
class StallSettings:
    limit_s: float = DEFAULT_LIMIT_S  # how long one blocking read may last; 0: not watched

    @classmethod
    def from_env(cls) -> StallSettings:
        raw = os.environ.get(ENV, "").strip()
        if not raw:
            return cls()
        try:
            limit = float(raw)
        except ValueError:
            limit = math.nan
        if not (math.isfinite(limit) and limit >= 0):
            raise ConfigError(
                f"{ENV}={raw!r} is not a number of seconds >= 0; set it to the longest a single device"
                f" program may take (e.g. {ENV}=3600; 0 turns the stall watch off) or unset it"
                f" (default {DEFAULT_LIMIT_S:g})"
            )
        return cls(limit)


def check_settings() -> StallSettings:
    """The settings, read now: a bad ``MESHLM_STALL_TIMEOUT`` is one line (exit 2) before any work."""
    return StallSettings.from_env()


class _Watch:
    """The process's one watch: the programs' names (a stack: the innermost names the read), the read
    in progress (when it began, what it reads), and the daemon thread that judges it."""

    def __init__(self):
        self.lock = threading.Lock()
        self.names: list[tuple[str, str]] = []  # (program, mesh) from ``program``, innermost last
        self.depth = 0  # nested reads count as one (the outermost)
        self.since: float | None = None  # when the read in progress began
        self.what = (UNNAMED, "")
        self.thread: threading.Thread | None = None
        self.limit_s = 0.0

    def begin(self, mesh: str, limit_s: float) -> None:
        with self.lock:
            self.depth += 1
            if self.depth > 1:
                return
            self.since, self.limit_s = time.monotonic(), limit_s
            self.what = self.names[-1] if self.names else (UNNAMED, mesh)
            if self.thread is None:
                self.thread = threading.Thread(target=self._judge, name="meshlm-stall-watch", daemon=True)
                self.thread.start()

    def end(self) -> None:
        with self.lock:
            self.depth -= 1
            if self.depth == 0:
                self.since = None  # progress

    def _judge(self) -> None:
        last = time.monotonic()
        while True:
            time.sleep(min(5.0, max(0.05, self.limit_s / 10)))
            now = time.monotonic()
            with self.lock:
                if now - last > self.limit_s / 2 and self.since is not None:
                    self.since = now  # this process was not running (stopped, starved): no verdict
                last = now
                if self.since is not None and now - self.since > self.limit_s:
                    stalled(*self.what, self.limit_s)


_WATCH = _Watch()


def stalled(name: str, mesh: str, limit_s: float) -> None:
    """One line, then leave at once: the devices' threads never return, so no teardown would either.
    The line starts a line of its own (a progress bar drawn with carriage returns may hold the
    terminal's), and says both things a read this long can be: a program that never finishes, or a
    single step longer than the limit."""
    where = f" on mesh {mesh}" if mesh else ""
    sys.stderr.write(
        f"{_line_break()}meshlm: error: {name}{where} made no progress for {limit_s:g} s: no read of its"
        " output returned (a device program that never finishes, its devices waiting on each other, or"
        f" one step longer than that); stopping ({ENV} sets the limit: raise it for steps that long, 0"
        " turns the watch off)\n"
    )
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(STALL_EXIT_CODE)


def _line_break() -> str:
    """A newline where a live progress bar (tqdm: the train loop's, eval's, data prepare's) holds the
    line, so the error never reads as the end of the bar."""
    tqdm = getattr(sys.modules.get("tqdm"), "tqdm", None)
    bars = list(getattr(tqdm, "_instances", ()) or ())
    return "\n" if any(not getattr(bar, "disable", True) for bar in bars) else ""


@contextmanager
def program(name: str, mesh: str):
    """Name the program whose outputs the reads inside wait for, and its mesh (``Layout.label``)."""
    with _WATCH.lock:
        _WATCH.names.append((name, mesh))
    try:
        yield
    finally:
        with _WATCH.lock:
            _WATCH.names.pop()


@contextmanager
def waiting(mesh: str = ""):
    """A blocking host read of a program's output: ended with exit 3 past the stall limit. ``mesh``:
    the array's (``mesh_of``), named when no ``program`` is."""
    limit = StallSettings.from_env().limit_s
    if not limit:
        yield
        return
    _WATCH.begin(mesh, limit)
    try:
        yield
    finally:
        _WATCH.end()


def mesh_of(x) -> str:
    """The mesh an array lives on, as "dp=1 x mp=2 x cp=2" ("" for a single-device or host value)."""
    mesh = getattr(getattr(x, "sharding", None), "mesh", None)
    shape = getattr(mesh, "shape", None)
    return " x ".join(f"{axis}={size}" for axis, size in shape.items()) if shape else ""
