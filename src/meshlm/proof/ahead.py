"""Compiling the controls' programs ahead: XLA compiles them on a thread pool while the main thread
traces, runs and compares (issue 66: most of a proof's time was XLA compiling one control's program
after another).

The programs do not depend on each other: each control's planted program is compiled from its own
lowered module, and ``Lowered.compile`` releases the GIL while XLA works. Tracing and lowering stay on
the main thread: a control's plant replaces module functions while its program traces
(``control_record.replaced``), which a trace on another thread would see.

What stays as the sequential proof had it: XLA's output does not depend on the thread that compiled
it, so each control runs the executable it ran before and every figure is bit for bit the same; rows
come in the controls' order; an exception tracing, lowering or compiling a control's program is raised
in that control's run (``run_control``: its row, a type-check rejection, or the crash it names).

Bounds: ``workers`` threads compile: the cores this process may use (``os.sched_getaffinity``) that
are idle, less the main thread's -- none on one core, or where the load already fills the cores: there
a compiling thread only competes with the others' work for the same cores (measured on the 2-core
machine under a load of 12: no faster, and 350 MB more held), and each program is compiled when its
control runs, as before. At most ``prover.AHEAD_MIN`` programs, or two per worker, are prepared ahead of
the one that runs (each holds its module and executable until its control has run), so memory grows
with the workers, not with the number of controls.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor


def cores() -> int:
    """The CPU cores this process may run on (its affinity: a container's or ``taskset``'s limit)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform (macOS)
        return os.cpu_count() or 1


def idle_workers(n_cores: int, load: float) -> int:
    """Compiling threads for ``n_cores`` cores under a 1-minute ``load`` average (this process's own
    thread among it): the cores the load leaves idle, at most all but the main thread's."""
    return max(0, min(n_cores - 1, n_cores - round(load)))


def _load() -> float:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):  # no load average on this platform: the cores alone decide
        return 0.0


class Compiler:
    """A pool of ``workers`` compiling threads (default: ``idle_workers`` of this process's cores and
    the machine's load); 0 compiles inline."""

    def __init__(self, workers: int | None = None):
        self.workers = max(0, idle_workers(cores(), _load()) if workers is None else workers)
        self._pool = ThreadPoolExecutor(self.workers, "meshlm-compile") if self.workers else None

    def submit(self, fn: Callable, *args) -> Future:
        """``fn(*args)`` on the pool (inline without one); its exception is kept for ``result()``."""
        if self._pool is not None:
            return self._pool.submit(fn, *args)
        return settled(fn, *args)

    def __enter__(self) -> Compiler:
        return self

    def __exit__(self, *exc) -> None:
        if self._pool is not None:  # programs never asked for (a proof that stopped early) are dropped
            self._pool.shutdown(wait=True, cancel_futures=True)


def settled(fn: Callable, *args) -> Future:
    """A future already holding ``fn(*args)``'s result or exception."""
    out: Future = Future()
    try:
        out.set_result(fn(*args))
    except Exception as e:  # kept: raised where the result is asked for, as the sequential proof did
        out.set_exception(e)
    return out


def failure(e: BaseException) -> Future:
    """A future already holding the exception ``e``."""
    out: Future = Future()
    out.set_exception(e)
    return out


class Ahead:
    """``(item, prepare(item))`` for each of ``items`` in order, each prepared ``window`` items before
    it is handed out: ``prepare`` (on the calling thread) starts its work on a ``Compiler``'s pool, so
    that work runs while the items before it are consumed. The first ``window`` are prepared at once."""

    def __init__(self, items: Iterable, prepare: Callable, window: int):
        self._items, self._prepare, self._window = deque(items), prepare, max(1, window)
        self._ready: deque = deque()
        self._fill()

    def _fill(self) -> None:
        while self._items and len(self._ready) < self._window:
            item = self._items.popleft()
            self._ready.append((item, self._prepare(item)))

    def __iter__(self) -> Iterator[tuple]:
        while self._ready:
            item, prepared = self._ready.popleft()
            self._fill()  # the next one's compile starts before this one runs
            yield item, prepared
