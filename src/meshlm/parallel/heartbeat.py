"""Peer liveness in a multi-process job: one clear line instead of JAX's C++ abort.

A process that stops responding (frozen by SIGSTOP, a hung host) leaves its peers blocked in a
collective; JAX's own heartbeat check then ends them with ``LOG(FATAL)`` and a C++ stack dump.
Here each process runs a daemon thread that bumps a counter in JAX's distributed key-value store
every few seconds and reads every peer's counter with one directory read (two small RPCs per
beat, whatever the process count). A counter that has not moved for ``timeout_s`` ends this
process with one line and ``HEARTBEAT_EXIT_CODE``; JAX's own heartbeat timeout is set longer
(see ``distributed``) so this check always comes first.

A process that finishes normally writes ``done`` before JAX's shutdown barrier (an atexit handler,
run before JAX's), so a peer that is simply finished is never reported; while it waits there for
slower peers it keeps watching them, and gives up with one line after ``shutdown_s`` (JAX's own
shutdown timeout, a grace longer, would abort with a stack dump).
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

# Exit status of a process that gave up on a peer that stopped responding (EX_PROTOCOL).
HEARTBEAT_EXIT_CODE = 76
_PREFIX = "meshlm/heartbeat/"
_DONE = "done"


def report_and_exit(message: str) -> None:
    """The default reaction to a stale peer: one line, then exit without the shutdown barrier
    (the peer would never arrive there either)."""
    sys.stderr.write(f"meshlm: error: {message}; stopping\n")
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(HEARTBEAT_EXIT_CODE)


class Heartbeat:
    """Beat and watch the peers through ``client`` (a ``DistributedRuntimeClient``)."""

    def __init__(
        self,
        client: Any,
        process_id: int,
        num_processes: int,
        timeout_s: float,
        shutdown_s: float,
        on_stale: Callable[[str], None] = report_and_exit,
    ):
        self.client, self.me, self.on_stale = client, process_id, on_stale
        self.timeout_s, self.shutdown_s = timeout_s, shutdown_s
        # About ten beats per timeout, so a live peer is never late by chance; at most one per
        # 0.5 s (cheap) and at least one per 5 s.
        self.interval = min(5.0, max(0.5, timeout_s / 10))
        now = time.monotonic()
        self.peers = [p for p in range(num_processes) if p != process_id]
        self.seen = dict.fromkeys(self.peers, now)  # when each peer's counter last moved
        self.values: dict[int, str] = {}
        self.owners: dict[int, tuple[int, str]] = {}  # peer -> (pid, host), from its beats
        self.done: set[int] = set()
        self.answered = now  # when the coordinator last answered a whole beat
        self.ticked = now  # when the watch last ran: a later gap means this process was stopped
        self.finished_at: float | None = None  # when this process finished (then it beats "done")
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._beat, name="meshlm-heartbeat", daemon=True),
            threading.Thread(target=self._watch, name="meshlm-heartbeat-watch", daemon=True),
        ]

    def start(self) -> Heartbeat:
        for thread in self._threads:
            thread.start()
        _on_continue(lambda: _report_if_stopped(self))
        # atexit runs handlers last-in first-out, and JAX registered its shutdown (with the
        # barrier) at import: ours runs before it.
        atexit.register(self.finish)
        return self

    def finish(self) -> None:
        """Tell the peers this process is finished, not frozen; keep watching those still busy."""
        if self.finished_at is not None:
            return
        self.finished_at = time.monotonic()
        self._put(_DONE)  # now, not at the next beat: a peer may be about to judge us

    def stop(self) -> None:
        """Stop both threads (the job is over for this process)."""
        self._stop.set()

    def _put(self, value: str) -> bool:
        try:
            self.client.key_value_set(_PREFIX + str(self.me), value, allow_overwrite=True)
        except Exception:  # noqa: BLE001 - an unreachable coordinator shows as no answer
            return False
        return True

    def _beat(self) -> None:
        count = 0
        while not self._stop.is_set():
            count += 1
            entries = None
            if self._put(_beat_value(self, count)):
                try:
                    entries = self.client.key_value_dir_get(_PREFIX)
                except Exception:  # noqa: BLE001 - as in _put
                    entries = None
            if entries is not None and not self._stop.is_set():
                self._record(entries, time.monotonic())
            if self.finished_at is not None and len(self.done) == len(self.peers):
                self.stop()  # everyone is finished: JAX's barrier completes now
            self._stop.wait(self.interval)

    def _record(self, entries: list[tuple[str, str]], now: float) -> None:
        self.answered = now
        for key, value in entries:
            peer = int(key.rsplit("/", 1)[1])
            if peer in self.seen and value != self.values.get(peer):
                self.values[peer], self.seen[peer] = value, now
                if value == _DONE:
                    self.done.add(peer)
                parts = value.split()
                if len(parts) == 3 and parts[1].isdigit():
                    self.owners[peer] = (int(parts[1]), parts[2])

    def _watch(self) -> None:
        period = min(1.0, self.timeout_s / 10)  # well below the jump that resets the clocks
        last = time.monotonic()
        while not self._stop.wait(period):
            now = time.monotonic()
            if now - last > self.timeout_s / 2:
                # We ourselves were not running (stopped, or starved): we cannot judge the peers
                # for that time, so give them a fresh window rather than a false alarm.
                self.answered = now
                self.seen = dict.fromkeys(self.seen, now)
            last = self.ticked = now
            message = self.stale_message(now)
            if message is not None and not self._stop.is_set():
                self.on_stale(message + _end_silent(self, now))
                return

    def stale_message(self, now: float) -> str | None:
        """The line to report if a peer (or the coordinator) is overdue at ``now``, else None."""
        seconds = f"{self.timeout_s:g} s"
        busy = [p for p in self.peers if p not in self.done]
        if self.finished_at is not None and now - self.finished_at > self.shutdown_s:
            return (
                f"{_processes(busy)} did not finish within {self.shutdown_s:g} s after this one "
                f"(process {self.me}) did"
            )
        if _coordinator_silent(self, now):
            # Every key-value call goes through the coordination service in process 0.
            return f"process 0 (the coordinator) stopped responding (no answer for {seconds})"
        stale = [p for p in busy if now - self.seen[p] > self.timeout_s]
        if not stale:
            return None
        return f"{_processes(stale)} stopped responding (no heartbeat for {seconds})"


def _coordinator_silent(beat: Heartbeat, now: float) -> bool:
    """Whether process 0's coordination service stopped answering. Its own beat goes stale up to
    two beat periods before our last answer does (we read its value once per period), so once
    process 0 is overdue, an answer missing for longer than a few periods already means the
    service is down with it: the report names the coordinator, whichever clock crosses first."""
    if now - beat.answered > beat.timeout_s:
        return True
    quiet = now - beat.answered > min(3 * beat.interval, beat.timeout_s / 2)
    return quiet and 0 in beat.peers and 0 not in beat.done and now - beat.seen[0] > beat.timeout_s


def _beat_value(beat: Heartbeat, count: int) -> str:
    """A beat names its process (pid, host): a peer on this host that stops responding is ended by
    whoever gives up on it (``_end``), so that it never continues alone."""
    return _DONE if beat.finished_at is not None else f"{count} {os.getpid()} {socket.gethostname()}"


def introduce(beat: Heartbeat) -> Heartbeat:
    """Before ``start``: publish this process's first beat and wait (at most ``timeout_s``) for
    every peer's, so that each peer's pid and host are known even if it freezes at once."""
    beat._put(_beat_value(beat, 0))
    deadline = time.monotonic() + beat.timeout_s
    while len(beat.owners) < len(beat.peers) and time.monotonic() < deadline:
        try:
            beat._record(beat.client.key_value_dir_get(_PREFIX), time.monotonic())
        except Exception:  # noqa: BLE001 - as in _put
            pass
        time.sleep(0.05)
    return beat


def _report_if_stopped(beat: Heartbeat) -> None:
    """SIGCONT: this process was stopped. Stopped longer than the timeout, its peers have given up
    on it (or are about to): say so and leave at once, before JAX's client finds the job gone
    and aborts with a C++ stack dump (or a collective fails with a Gloo traceback)."""
    gap = time.monotonic() - beat.ticked
    if gap > beat.timeout_s and not beat._stop.is_set():
        beat.on_stale(
            f"this process (process {beat.me}) was stopped for {gap:.0f} s, longer than the "
            f"{beat.timeout_s:g} s heartbeat timeout: its peers have given up on it"
        )


def _end_silent(beat: Heartbeat, now: float) -> str:
    """SIGKILL the peers on this host whose heartbeat stopped (frozen: stopped, hung), as
    ``meshlm launch`` does: continued later, one would find its peers gone and die with a Gloo
    traceback and a C++ abort. Returns what to add to the report ("" if none)."""
    busy = [p for p in beat.peers if p not in beat.done]
    silent = [p for p in busy if now - beat.seen[p] > beat.timeout_s]
    if _coordinator_silent(beat, now) and 0 in busy:
        silent = [0]  # the coordinator: with it, every peer looks silent
    host, ended = socket.gethostname(), []
    for peer in silent:
        pid, where = beat.owners.get(peer, (0, ""))
        if pid and where == host:
            try:
                os.kill(pid, signal.SIGKILL)
                ended.append(f"pid {pid}")
            except OSError:
                pass  # gone already, or not ours to end
    return f", so it was ended ({', '.join(ended)} on this host)" if ended else ""


def _on_continue(callback: Callable[[], None]) -> None:
    """Call ``callback`` in a thread of its own the moment this process is continued (SIGCONT), even
    while the main thread is blocked in a collective: Python's C-level handler writes each signal
    to the wakeup fd at once, and that thread is waiting on it. Only from the main thread (where
    handlers are set); the wakeup fd is this process's only one from then on."""
    if threading.current_thread() is not threading.main_thread():
        return
    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.signal(signal.SIGCONT, lambda signum, frame: None)  # a Python handler: the C trampoline
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)

    def wait() -> None:
        while True:
            if signal.SIGCONT in os.read(read, 64):
                callback()

    threading.Thread(target=wait, name="meshlm-continued", daemon=True).start()


def _processes(indices: list[int]) -> str:
    names = ", ".join(map(str, indices))
    return f"process {names}" if len(indices) == 1 else f"processes {names}"
