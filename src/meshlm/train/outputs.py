"""Writing run outputs inside ``--out`` without ever writing through a link out of it.

The rule, one for every output (``metrics.jsonl``, ``loss_curve.png``, ``tensorboard/`` and the
event files in it): before a run writes any of them, ``check_outputs`` refuses, with one line
naming the path, where it points and the fix (remove it), if one is a symbolic link or not the
kind of entry the run writes there (a FIFO where a file goes, a file where ``tensorboard/`` goes).
Refusing, rather than replacing a link, leaves the user's entries untouched and one rule for all.
``--out`` itself may not be a link either (``io.run_lock`` refuses it when locking): a run writes
only inside the directory it is given.

Writes then hold even if a link appears after the check: a whole file is written to a new
temporary file in the same directory (a random name, ``O_CREAT | O_EXCL | O_NOFOLLOW``) that
``os.replace`` renames over the target; a rename replaces a link itself, it never writes through
it. Appends and reads open with ``O_NOFOLLOW`` and ``O_NONBLOCK`` (a FIFO would block).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import secrets
import shutil
import stat
import sys
import tempfile
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import BinaryIO

from meshlm.errors import CheckpointError
from meshlm.parallel import distributed

_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFSOCK: "a socket",
    stat.S_IFREG: "a regular file",
}


def kind(mode: int) -> str:
    """'a FIFO', 'a directory', ... for an ``st_mode``."""
    return _KINDS.get(stat.S_IFMT(mode), "a special file")


def _problem(path: Path, want_dir: bool) -> str | None:
    """What stops the run from writing ``path`` (None if it is absent or of the right kind)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"cannot look at {path}: {e.strerror}"
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a symbolic link (to {os.readlink(path)})"
    if want_dir != stat.S_ISDIR(st.st_mode) or not (want_dir or stat.S_ISREG(st.st_mode)):
        need = "a directory" if want_dir else "a regular file"
        return f"{path} is {kind(st.st_mode)}, not {need}"
    if not want_dir:
        return None
    try:  # the event files go in here: none of its entries may lead out either
        entries = sorted(path.iterdir())
    except OSError as e:
        return f"cannot list {path}: {e.strerror}"
    return next(filter(None, (_problem(p, p.is_dir()) for p in entries)), None)


def check_outputs(out: Path, files: tuple[str, ...], dirs: tuple[str, ...] = ()) -> None:
    """Refuse (CheckpointError, on every process) if an output of ``out`` is a link or of the
    wrong kind; see the module doc. Process 0 looks; a collective: call it on all processes."""
    problem = None
    if distributed.is_main():
        found = [_problem(out / n, False) for n in files] + [_problem(out / n, True) for n in dirs]
        problem = next(filter(None, found), None)
    if not distributed.agree(problem is None):
        raise CheckpointError(
            f"{problem}; remove it and rerun (a run writes only inside its --out, never through a link)"
            if problem
            else f"process 0 refused the outputs in {out}; see its error"
        )


def _refused(path: Path, e: OSError) -> CheckpointError:
    return CheckpointError(
        f"cannot open {path}: {e.strerror} (a symbolic link or a special file put there after the "
        "run started?); remove it and rerun"
    )


def _open(path: Path, flags: int) -> int:
    """An fd of ``path``, never through a link, never blocking on a FIFO; only a regular file."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise _refused(path, e) from e
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise CheckpointError(f"{path} is {kind(mode)}, not a regular file; remove it and rerun")
    return fd


def append_text(path: Path, text: str) -> None:
    """Append ``text`` to ``path`` (created if absent)."""
    with os.fdopen(_open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "a") as f:
        f.write(text)


def read_text(path: Path) -> str | None:
    """The text of ``path``, None if it does not exist."""
    if not os.path.lexists(path):
        return None
    with os.fdopen(_open(path, os.O_RDONLY), "r") as f:
        return f.read()


def replace_file(path: Path, write: Callable[[BinaryIO], None]) -> Path:
    """Write ``path`` whole: ``write(f)`` fills a new temporary file, renamed over ``path``."""
    # A new name (O_EXCL): not mkstemp, whose 0600 would make outputs less readable than before.
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = _open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def replace_text(path: Path, text: str) -> Path:
    return replace_file(path, lambda f: f.write(text.encode()))


def lines(path: Path) -> Iterator[str]:
    """The lines of ``path`` (none if it does not exist)."""
    yield from (read_text(path) or "").splitlines()


def isolate_matplotlib() -> None:
    """Call before importing matplotlib. On its first import it makes its config directory and writes
    its font cache under $HOME (~/.config/matplotlib, ~/.cache/matplotlib): a write outside --out.
    Unless the user chose a directory (MPLCONFIGDIR) or matplotlib is already imported, both go to a
    temporary directory, removed when the process exits. Not the run directory: it stays the run's."""
    if "matplotlib" in sys.modules or os.environ.get("MPLCONFIGDIR"):
        return
    tmp = tempfile.mkdtemp(prefix="meshlm-matplotlib-")
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    os.environ["MPLCONFIGDIR"] = tmp


def entries(out: Path) -> frozenset[str] | None:
    """The names ``out`` holds now (None: no such directory): what a refused start leaves as it was."""
    try:
        return frozenset(os.listdir(out))
    except OSError:
        return None


def undo_refused_start(out: Path, before: frozenset[str] | None, names: Collection[str], release) -> None:
    """A start refused before it saved anything (a bad value found while building the run or compiling
    its first programs) leaves ``out`` as it found it: each of ``names`` (the run's outputs, its
    tokenizer.json) that it holds now but not ``before`` is removed, never anything that was there;
    then ``release()`` (the run lock), then ``out`` itself if the start made it and it is empty again.
    Process 0 writes, so process 0 removes; call on every process (``release`` is a collective's)."""
    if distributed.is_main():
        for name in set(names) - (before or frozenset()):
            path = out / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
    release()
    if before is None and distributed.is_main():
        with contextlib.suppress(OSError):  # not empty: another command's now
            out.rmdir()
