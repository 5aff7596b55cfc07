"""Moving aside step directories that would block a resumed run.

A run resumed from step S saves steps after S again, and a save refuses a step whose directory
exists. So a newer step directory that resume fell back past (an interrupted save, an empty
directory, a corrupt checkpoint) would stop the run at that step on every rerun. It is renamed,
never deleted, to ``<step>.corrupt-<UTC time>``: not a number, so nothing treats it as a step.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path

from meshlm.errors import CheckpointError
from meshlm.io.layout import COMMIT_MARKER, SET_ASIDE_TAG
from meshlm.parallel import distributed


def newer_step_dirs(directory: Path, step: int) -> list[Path]:
    """Entries of ``directory`` named as a step after ``step``, oldest first."""
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if p.name.isdigit() and int(p.name) > step]
    return sorted(found, key=lambda p: int(p.name))


def _what_is_wrong(path: Path, corrupt: dict[int, str], step: int) -> str:
    if int(path.name) in corrupt:
        return f"corrupt ({corrupt[int(path.name)]})"
    if not path.is_dir():
        return "not a directory"
    if not any(path.iterdir()):
        return "an empty directory"
    if not (path / COMMIT_MARKER).is_file():
        return f"an interrupted save (no {COMMIT_MARKER})"
    return f"newer than step {step}, the newest that loads"  # a complete step that failed to load


def _free_name(path: Path) -> Path:
    """``<step>.corrupt-<UTC time>``, with a counter if that name is taken (same second)."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = path.with_name(f"{path.name}{SET_ASIDE_TAG}{stamp}")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}{SET_ASIDE_TAG}{stamp}-{n}")
    return target


def _move_all(directory: Path, step: int, corrupt: dict[int, str]) -> str | None:
    """Rename each newer step directory; None, or the error that stopped it."""
    for path in newer_step_dirs(directory, step):
        why = _what_is_wrong(path, corrupt, step)
        target = _free_name(path)
        try:
            path.rename(target)
        except OSError as e:
            return (
                f"cannot move {path} ({why}) aside to {target.name}: {e.strerror}; "
                f"move or delete it yourself, then rerun"
            )
        warnings.warn(
            f"moved {path} aside to {target.name}: {why}; the run continues from step {step} "
            f"and saves step {path.name} again",
            stacklevel=4,
        )
    return None


def set_aside_newer(directory: Path, step: int, corrupt: dict[int, str]) -> None:
    """Move aside every step directory after ``step`` (the step the run resumes from, 0 if none);
    ``corrupt`` holds the load error of each complete step that was skipped. A collective: process 0
    renames (one writer), and all processes return or raise together, after the renames."""
    error = _move_all(directory, step, corrupt) if distributed.is_main() else None
    if not distributed.agree(error is None):
        raise CheckpointError(error or f"process 0 could not move aside a step directory of {directory}")
