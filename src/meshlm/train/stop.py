"""SIGINT/SIGTERM in ``meshlm train``: at any moment, one line and exit 128 + the signal; never a
traceback, a crash, or a run that goes on.

From the first thing ``meshlm train`` does (before JAX is even imported) until the run ends, the two
signals only set a flag. Python then never raises inside JAX's start-up, a compile or a save: a
KeyboardInterrupt raised there ended runs with a traceback and, out of XLA's compiler, a
segmentation fault, or was swallowed by a callback while the run went on to the end. The flag is
acted on at fixed points: during start-up (``check_startup``, after the data, after the state is
built, after the first evaluation) the run stops with ``Interrupted``, since nothing has run and
nothing needs saving; in the loop, at the next step boundary, after saving a checkpoint.

This module must not import jax: the CLI installs ``Stop`` before choosing the devices.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

from meshlm.errors import Interrupted

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stop:
    """The flag the signals set, and the points that act on it. ``restore`` puts the previous
    handlers back. Handlers can only be set in the main thread; elsewhere the flag stays unset."""

    def __init__(self):
        self.signal: int | None = None  # set by the handler, in this process
        self.agreed: int | None = None  # the signal every process acts on
        self._old = {}
        if threading.current_thread() is threading.main_thread():
            self._old = {s: signal.signal(s, self._handle) for s in SIGNALS}

    def _handle(self, signum, frame):
        self.signal = signum

    def requested(self) -> bool:
        """Whether any process got a signal. Processes see a signal at different points, but what
        follows (a save, or leaving) must happen on all of them at the same point, so they agree
        first (one tiny collective per call; nothing in a single-process run). A collective."""
        if self.agreed is None:
            from meshlm.parallel import distributed  # here: JAX is started once this is called

            self.agreed = distributed.max_over_processes(self.signal or 0) or None
        return self.agreed is not None

    def check_startup(self) -> None:
        """During start-up: stop here (``Interrupted``) if any process got a signal. A collective."""
        if self.requested():
            raise Interrupted(self.agreed)

    def restore(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old = {}


@contextlib.contextmanager
def deferred_signals() -> Iterator[None]:
    """Hold SIGINT/SIGTERM back for the duration, then deliver them to whatever handled them before
    (a KeyboardInterrupt, the ``Stop`` flag, the default action). Around JAX's import and start-up:
    a KeyboardInterrupt raised inside jaxlib's import crashed the process (a segmentation fault)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    old = {s: signal.signal(s, lambda signum, frame: got.append(signum)) for s in SIGNALS}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        for s in dict.fromkeys(got):
            signal.raise_signal(s)
