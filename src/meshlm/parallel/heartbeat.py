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
        self.done: set[int] = set()
        self.answered = now  # when the coordinator last answered a whole beat
        self.finished_at: float | None = None  # when this process finished (then it beats "done")
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._beat, name="meshlm-heartbeat", daemon=True),
            threading.Thread(target=self._watch, name="meshlm-heartbeat-watch", daemon=True),
        ]

    def start(self) -> Heartbeat:
        for thread in self._threads:
            thread.start()
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
            if self._put(_DONE if self.finished_at is not None else str(count)):
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
            last = now
            message = self.stale_message(now)
            if message is not None and not self._stop.is_set():
                self.on_stale(message)
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
        if now - self.answered > self.timeout_s:
            # Every key-value call goes through the coordination service in process 0.
            return f"process 0 (the coordinator) stopped responding (no answer for {seconds})"
        stale = [p for p in busy if now - self.seen[p] > self.timeout_s]
        if not stale:
            return None
        return f"{_processes(stale)} stopped responding (no heartbeat for {seconds})"


def _processes(indices: list[int]) -> str:
    names = ", ".join(map(str, indices))
    return f"process {names}" if len(indices) == 1 else f"processes {names}"
