"""The on-disk layout of a checkpoint run directory: which step directories are complete, and paths.

Layout written by orbax-checkpoint 0.12.8 on a local filesystem (``DIR`` is the run directory)::

    DIR/<step>.orbax-checkpoint-tmp/   a save in progress, or one that crashed: never loaded
    DIR/<step>.corrupt-<UTC time>/     a step directory a resumed run moved aside: never loaded
                                       (``meshlm.io.set_aside``)
    DIR/<step>/                        a finished save: the tmp directory renamed atomically
        commit_success.txt             written just before the rename: our completion marker
        _CHECKPOINT_METADATA           orbax's step metadata (item handlers, timestamps)
        state/                         the array pytree: tensorstore zarr chunks in an OCDBT store
            manifest.ocdbt, d/*        root b-tree (small arrays are inlined in its nodes)
            ocdbt.process_<i>/d/*      the chunk data each process wrote
            _METADATA, _sharding       tree structure and the sharding it was saved with
        meta/metadata                  the caller's JSON dict (configs, data position, seed, ...)
        integrity/metadata             ours: shape, dtype and a bit fingerprint of every array,
                                       and a SHA-256 of meta/metadata
                                       (``meshlm.io.integrity``)
"""

from __future__ import annotations

import json
import re
import shutil
import warnings
from pathlib import Path

import orbax.checkpoint as ocp

from meshlm.errors import CheckpointError

STATE, META, INTEGRITY = "state", "meta", "integrity"  # orbax item names = subdirectory names
COMMIT_MARKER = ocp.path.atomicity.COMMIT_SUCCESS_FILE  # "commit_success.txt"
TMP_SUFFIX = ocp.path.atomicity.TMP_DIR_SUFFIX  # ".orbax-checkpoint-tmp"
JSON_FILE = "metadata"  # the file name orbax's JSON handler uses inside its item directory
SET_ASIDE_TAG = ".corrupt-"  # <step>.corrupt-<time>: not a number, so never taken for a step


def how_to_make(directory: Path) -> str:
    return f"make one with `meshlm train --out {directory}`"


def no_checkpoint(directory: Path) -> CheckpointError:
    return CheckpointError(f"no checkpoint in {directory}: {how_to_make(directory)}")


def is_complete_step(path: Path) -> bool:
    """A finalized step directory: a numeric name (orbax renames the tmp directory only when
    done) and the commit marker (orbax also relies on it alone on filesystems without rename)."""
    return path.name.isdigit() and path.is_dir() and (path / COMMIT_MARKER).is_file()


def complete_steps(directory: Path) -> list[int]:
    """Steps of ``directory`` whose save finished, oldest first."""
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if is_complete_step(p))


def require_step(directory: Path, step: int) -> int:
    """``step`` if it is complete in ``directory``, else an error listing the complete ones."""
    steps = complete_steps(directory)
    if step not in steps:
        found = ", ".join(map(str, steps)) or "none"
        raise CheckpointError(
            f"no complete checkpoint for step {step} in {directory} (complete steps: {found})"
        )
    return step


def incomplete_saves(directory: Path) -> list[Path]:
    """Step directories left by interrupted saves: orbax tmp names, or a numeric name without the
    commit marker."""
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if p.is_dir() and TMP_SUFFIX in p.name]
    found += [p for p in directory.iterdir() if p.name.isdigit() and not is_complete_step(p)]
    return sorted(found, key=lambda p: p.name)


def step_of(path: Path) -> int | None:
    m = re.match(r"(\d+)", path.name)
    return int(m.group(1)) if m else None


def warn_interrupted(directory: Path, steps: list[int], stacklevel: int, numeric: bool = True) -> None:
    """Warn about each interrupted save newer than the newest of the complete ``steps``. With
    ``numeric=False`` only about tmp directories: the caller reports the numeric ones."""
    for path in incomplete_saves(directory):
        if not numeric and TMP_SUFFIX not in path.name:
            continue
        if not steps or (step_of(path) or -1) > steps[-1]:
            why = "never renamed to its final name" if TMP_SUFFIX in path.name else f"no {COMMIT_MARKER}"
            warnings.warn(f"ignoring {path}: an interrupted save ({why})", stacklevel=stacklevel + 1)


def remove_interrupted(directory: Path, up_to: int) -> None:
    """Remove debris of crashed saves up to the step just committed; later ones may be
    in progress on other processes."""
    for path in incomplete_saves(directory):
        step = step_of(path)
        if step is not None and step <= up_to and TMP_SUFFIX in path.name:
            shutil.rmtree(path, ignore_errors=True)


def resolve(path: str | Path) -> tuple[Path, int | None]:
    """A run directory -> (it, None: use the latest); one step's directory -> (run dir, step)."""
    p = Path(path).absolute()
    if not p.exists():
        raise CheckpointError(f"no checkpoint at {p}: the path does not exist")
    if not p.is_dir():
        raise CheckpointError(
            f"{p} is a file, not a checkpoint directory: pass a run directory (the --out of "
            "`meshlm train` or `meshlm convert`, which loads its newest step) or one step's "
            "directory in it (e.g. RUN/100)"
        )
    interrupted = p.name.isdigit() and (p / STATE).is_dir() and not is_complete_step(p)
    if SET_ASIDE_TAG in p.name:
        raise CheckpointError(
            f"{p} was moved aside by a resumed run (corrupt or incomplete); "
            f"pass {p.parent} to load the latest complete checkpoint"
        )
    if TMP_SUFFIX in p.name or interrupted:
        raise CheckpointError(
            f"{p} is an incomplete checkpoint (its save was interrupted); "
            f"pass {p.parent} to load the latest complete one"
        )
    if is_complete_step(p):
        return p.parent, int(p.name)
    if not complete_steps(p):
        raise no_checkpoint(p)
    return p, None


def peek_model_config(path: str | Path) -> dict | None:
    """The model config dict of the checkpoint at ``path`` (its newest complete step, or the step
    directory given), read straight from its meta JSON: no orbax, no devices, no integrity check, for
    checks of flags against the model before devices start. None where it cannot be read that way:
    the checked read (``io.model_io.read_config``) then says why."""
    try:
        directory, step = resolve(path)
        step = step if step is not None else complete_steps(directory)[-1]
        meta = json.loads((directory / str(step) / META / JSON_FILE).read_text())
    except (CheckpointError, OSError, ValueError, IndexError):
        return None
    found = meta.get("model_config") if isinstance(meta, dict) else None
    return found if isinstance(found, dict) else None


def is_checkpoint_dir(path: str | Path) -> bool:
    """True for a run directory holding a complete checkpoint, or a complete step directory."""
    try:
        resolve(path)
    except CheckpointError:
        return False
    return True
