"""An advisory lock on a run directory, so that two `meshlm train` never write one ``--out`` (and two
``data prepare`` or ``convert`` never one output directory: ``lock_new_dir``).

``DIR/.lock`` holds the owner's pid and host, and the owner holds ``fcntl.flock`` on it. The kernel
drops a flock when its holder exits, however it dies, so a lock file nobody holds was left by a dead
run: it is taken over, with a warning naming that run. Releasing removes the file while still
holding the lock; whoever opened the old file meanwhile notices it was replaced and tries again.

Only process 0 of a multi-process run locks (``lock_run``); the others follow its outcome.
"""

from __future__ import annotations

import fcntl
import os
import socket
import warnings
from pathlib import Path

from meshlm.errors import CheckpointError, MeshlmError

LOCK_FILE = ".lock"
_HELD: dict[str, list[int]] = {}  # lock path -> [fd, holders]: re-entrant within one process


class RunLock:
    """A held lock on ``directory`` (see the module doc). ``release`` is idempotent."""

    def __init__(self, directory: Path):
        self.path = Path(directory).absolute() / LOCK_FILE
        self._held = False

    def acquire(self) -> RunLock:
        if self._held:
            return self
        key = str(self.path)
        if key not in _HELD:
            _HELD[key] = [_take(self.path), 0]
        _HELD[key][1] += 1
        self._held = True
        return self

    def release(self) -> None:
        key = str(self.path)
        if not self._held or key not in _HELD:
            return
        self._held = False
        _HELD[key][1] -= 1
        if _HELD[key][1] == 0:
            fd = _HELD.pop(key)[0]
            self.path.unlink(missing_ok=True)  # while still locked: see the module doc
            os.close(fd)  # drops the flock


def lock_run(directory: Path) -> RunLock | None:
    """Process 0 locks ``directory`` (creating it); every process raises if that failed. A
    collective: call it on all processes. Returns the lock on process 0, None on the others."""
    from meshlm.parallel import distributed  # here: `data prepare` locks without starting JAX

    lock, error = None, None
    if distributed.is_main():
        try:
            lock = RunLock(directory).acquire()
        except MeshlmError as e:
            error = e
    if not distributed.agree(error is None):
        raise error or CheckpointError(f"process 0 could not lock {directory}; see its error")
    return lock


def lock_new_dir(directory: Path, *, multi_process: bool = True) -> RunLock | None:
    """Lock ``directory`` (creating it) for a command that writes a new output there, then check it
    holds nothing but the lock: another command that passed its own emptiness check a moment ago and
    wrote first is refused here, never mixed into. ``multi_process``: a collective (``lock_run``);
    False locks in this process alone (no JAX). Returns the lock (None on processes other than 0)."""
    lock = lock_run(directory) if multi_process else RunLock(directory).acquire()
    others = sorted(p.name for p in Path(directory).iterdir() if p.name != LOCK_FILE)
    if others:
        if lock is not None:
            lock.release()
        raise CheckpointError(
            f"--out {directory} exists and is not an empty directory (another command wrote "
            f"{others[0]} meanwhile); choose a new path or remove it"
        )
    return lock


def check_free(directory: Path) -> None:
    """Refuse ``directory`` as an output now, before any work, if it is a symbolic link (a run writes
    only inside the directory it was given, never where a link leads) or a live command holds its lock
    (one line naming the owner, whatever the directory already holds: a live command's partial output
    is not an interrupted one). Writes nothing; the lock itself is taken later (``lock_new_dir``)."""
    path = Path(directory).absolute() / LOCK_FILE
    _refuse_link(path.parent)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return  # no lock file (or none to open): nobody holds it; taking it later says more if need be
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)  # free: only looked
    except BlockingIOError:
        raise _in_use(path, _owner(fd)) from None
    except OSError:
        pass  # no flock on this filesystem: taking the lock warns
    finally:
        os.close(fd)


def _refuse_link(directory: Path) -> None:
    if directory.is_symlink():
        raise CheckpointError(
            f"--out {directory} is a symbolic link (to {os.readlink(directory)}); pass the directory "
            "it leads to, or another --out (a run writes only inside the directory it is given)"
        )


def _take(path: Path) -> int:
    """An fd of ``path`` holding its flock, the file naming this process."""
    for _ in range(20):
        fd = _open(path)
        if not _flock(fd, path):
            return fd  # no flock on this filesystem: unprotected, as _flock warned
        if _is_current(fd, path):
            _claim(fd, path)
            return fd
        os.close(fd)  # released and removed by its owner after we opened it: try the new one
    raise CheckpointError(f"cannot lock {path}: it keeps being replaced; choose another --out")


def _open(path: Path) -> int:
    _refuse_link(path.parent)
    if path.parent.exists() and not path.parent.is_dir():
        raise CheckpointError(
            f"cannot use {path.parent} as a run directory: not a directory; choose another --out"
        )
    if path.is_symlink():  # never write through a link planted in the run directory
        raise CheckpointError(
            f"{path} is a symbolic link (to {os.readlink(path)}); remove it and rerun "
            "(a run writes only inside its --out, never through a link)"
        )
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        raise CheckpointError(
            f"cannot create the run lock {path}: {e.strerror}; choose a writable --out"
        ) from e


def _flock(fd: int, path: Path) -> bool:
    """Lock ``fd`` without waiting: True when held, False when the filesystem cannot lock."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        owner = _owner(fd)
        os.close(fd)
        raise _in_use(path, owner) from None
    except OSError as e:  # e.g. ENOLCK on some network filesystems
        warnings.warn(f"cannot lock {path} ({e.strerror}): nothing stops a second run there", stacklevel=5)
        return False


def _in_use(path: Path, owner: str) -> CheckpointError:
    return CheckpointError(
        f"{path.parent} is in use by another run ({owner or 'owner unknown'}, lock {path}): "
        "wait for it or choose another --out"
    )


def _is_current(fd: int, path: Path) -> bool:
    try:
        return os.fstat(fd).st_ino == path.stat().st_ino
    except FileNotFoundError:
        return False


def _claim(fd: int, path: Path) -> None:
    """Write this process into the file; warn if it named another (a run that died holding it)."""
    previous = _owner(fd)
    if previous:
        warnings.warn(
            f"took over the stale run lock {path} of {previous}, which no longer holds it "
            "(that run ended without releasing it)",
            stacklevel=5,
        )
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
    except OSError as e:  # e.g. a full disk: this process holds the lock but cannot say so
        os.close(fd)
        raise CheckpointError(
            f"cannot write the run lock {path}: {e.strerror}; free space or choose a writable --out"
        ) from e


def _owner(fd: int) -> str:
    """'pid P on host H' from the lock file, '' if empty."""
    text = os.pread(fd, 4096, 0).decode(errors="replace").strip()
    parts = text.split()
    if len(parts) == 2 and parts[0].isdigit():
        return f"pid {parts[0]} on host {parts[1]}"
    return f"owner {text!r}" if text else ""
