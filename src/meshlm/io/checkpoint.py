"""Sharded, atomic checkpoints (orbax-checkpoint) that restore onto any mesh.

``Checkpointer`` saves and restores (state pytree, meta JSON) per step under one run directory. The
on-disk layout is described in ``meshlm.io.layout``; ``meshlm.io.integrity`` records a fingerprint of
every array, so that a restore notices damaged data that orbax decodes without any error.
"""

from __future__ import annotations

import json
import logging
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import jax
import orbax.checkpoint as ocp

from meshlm.errors import CheckpointError, is_disk_full
from meshlm.io.integrity import (
    CorruptCheckpoint,
    check_abstract,
    check_meta,
    make_record,
    saved_arrays,
    verify,
)
from meshlm.io.layout import (
    INTEGRITY,
    JSON_FILE,
    META,
    STATE,
    complete_steps,
    is_complete_step,
    no_checkpoint,
    remove_interrupted,
    require_step,
    warn_interrupted,
)
from meshlm.io.set_aside import set_aside_newer
from meshlm.io.state_files import array_names, error_line, file_of, missing_data
from meshlm.parallel.distributed import agree

_T = TypeVar("_T")


# ---------------------------------------------------------------- checks on save and restore


def _check_saveable(directory: Path, step: int, meta: dict) -> None:
    try:
        json.dumps(meta, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"meta must be a JSON dict of plain values: {e}") from e
    if step < 0 or (directory / str(step)).exists():
        raise CheckpointError(
            f"cannot save step {step} in {directory}: "
            + ("it already exists" if step >= 0 else "negative step")
        )


def _diff(saved: Any, expected: Any, name: str) -> list[str]:
    """Human-readable differences, recursing into dicts so the message names the leaf field."""
    if isinstance(saved, dict) and isinstance(expected, dict):
        return [m for k in expected for m in _diff(saved.get(k, "<missing>"), expected[k], f"{name}.{k}")]
    return [] if saved == expected else [f"{name}: saved {saved!r}, expected {expected!r}"]


def _check_meta(saved: dict, expect: dict | None, where: str) -> None:
    if not expect:
        return
    expect = json.loads(json.dumps(expect))  # tuples -> lists, as they were saved
    problems = [m for k in expect for m in _diff(saved.get(k, "<missing>"), expect[k], k)]
    if problems:
        raise CheckpointError(f"{where} was saved with a different configuration: " + "; ".join(problems))


# ---------------------------------------------------------------- orbax reads and writes


def _make_manager(directory: Path) -> ocp.CheckpointManager:
    # create=False: only save() makes the directory, so a mistyped path when restoring
    # reports "no checkpoint" instead of leaving an empty directory behind. No max_to_keep:
    # orbax would prune before knowing the new step committed; _prune runs after.
    options = ocp.CheckpointManagerOptions(create=False, enable_async_checkpointing=False)
    handlers = {
        STATE: ocp.StandardCheckpointHandler(),
        META: ocp.JsonCheckpointHandler(),
        INTEGRITY: ocp.JsonCheckpointHandler(),
    }
    return ocp.CheckpointManager(directory, options=options, item_handlers=handlers)


def _save_args(state: Any, meta: dict, integrity: dict) -> ocp.args.Composite:
    return ocp.args.Composite(
        **{
            STATE: ocp.args.StandardSave(state),
            META: ocp.args.JsonSave(meta),
            INTEGRITY: ocp.args.JsonSave(integrity),
        }
    )


def _prune(manager: ocp.CheckpointManager, directory: Path, keep: int) -> None:
    """Delete complete steps older than the newest ``keep``: runs only after a commit, so the
    newest good checkpoint is never among them."""
    steps = complete_steps(directory)
    if len(steps) <= keep:
        return
    manager.reload()  # orbax deletes only steps it has listed
    for step in steps[:-keep]:
        try:
            manager.delete(step)
        except OSError as e:  # the new step is safe; an old one left behind is not an error
            warnings.warn(f"could not delete old checkpoint {directory / str(step)}: {e}", stacklevel=3)


def _read_json(manager: ocp.CheckpointManager, step: int, step_dir: Path, item: str) -> dict:
    path = step_dir / item / JSON_FILE
    try:
        out = manager.restore(step, args=ocp.args.Composite(**{item: ocp.args.JsonRestore()}))
        value = out[item]
    except Exception as e:  # missing or garbled file: orbax raises assorted types
        raise CorruptCheckpoint(f"cannot read {path}: {error_line(e)}") from e
    if not isinstance(value, dict):
        raise CorruptCheckpoint(f"cannot read {path}: not a JSON object")
    return value


def _read_arrays(
    manager: ocp.CheckpointManager, step: int, step_dir: Path, abstract: Any, partial: bool = False
) -> tuple[Any, str | None]:
    """(state, None), or (None, the error) so that all processes can agree on failure first."""
    # Checked first: orbax names no file for a missing one, and its failed reads print tracebacks.
    if problem := missing_data(step_dir / STATE, array_names(abstract) if partial else None):
        return None, problem
    args = ocp.args.Composite(**{STATE: ocp.args.StandardRestore(abstract)})
    try:
        if partial:  # read only the subtree asked for (e.g. parameters, not optimizer state)
            restore_args = ocp.checkpoint_utils.construct_restore_args(abstract)
            part = ocp.args.PyTreeRestore(item=abstract, restore_args=restore_args, partial_restore=True)
            with ocp.PyTreeCheckpointer() as reader:
                return reader.restore(step_dir / STATE, args=part), None
        return manager.restore(step, args=args)[STATE], None
    except Exception as e:  # tensorstore reports damage as ValueError, Exception, ...
        line = error_line(e)
        return None, line + file_of(step_dir / STATE, line)


def _read_checked_meta(manager: ocp.CheckpointManager, step: int, step_dir: Path) -> tuple[dict, dict]:
    """(meta, integrity record) of ``step``, the meta checked against the record's digest."""
    meta = _read_json(manager, step, step_dir, META)
    record = _read_json(manager, step, step_dir, INTEGRITY)
    check_meta(record, meta, step_dir, step_dir / INTEGRITY / JSON_FILE)
    return meta, record


def _load(directory: Path, load: Callable[[int], _T], step: int | None) -> _T:
    """``load`` the given complete step, or with ``step=None`` the newest one that loads."""
    return load(require_step(directory, step)) if step is not None else _load_newest(directory, load)


def _load_newest(directory: Path, load: Callable[[int], _T], skipped: dict | None = None) -> _T:
    """``load`` the newest step that loads, warning about each one skipped. With ``skipped`` the
    caller reports them instead (``resume`` moves them aside): each corrupt step's error goes there,
    and interrupted saves with a step's name are left to it."""
    steps = complete_steps(directory)
    # stacklevel: this function, _load, the Checkpointer method, its caller (from resume: one less)
    warn_interrupted(directory, steps, stacklevel=4 if skipped is None else 3, numeric=skipped is None)
    if not steps:
        raise no_checkpoint(directory)
    failures = []
    for step in reversed(steps):
        try:
            return load(step)
        except CorruptCheckpoint as e:
            if skipped is None:
                warnings.warn(f"skipping corrupt checkpoint step {step}: {e}", stacklevel=4)
            else:
                skipped[step] = str(e)
            failures.append(f"step {step}: {e}")
    raise CheckpointError(
        f"no loadable checkpoint in {directory}, all of steps {steps} failed; newest {failures[0]}. "
        "Move the damaged step directories out of it, or use another directory"
    )


class _NoThreadErrors(logging.Filter):
    """orbax logs each failed save thread's error with its traceback; the save's own error reports it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "_SignalingThread.run() raised" not in str(record.msg)


class _NoOrbaxTaskErrors(logging.Filter):
    """A failed save leaves orbax's other write tasks (``async_serialize_from_host``) with the same
    error, never awaited; asyncio logs each when the task is collected, at a moment of the garbage
    collector's choosing (after the one-line error in 1 of 18 full-disk test runs). Only orbax's tasks."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = str(record.msg)
        return not (text.startswith("Task exception was never retrieved") and "/orbax/" in text)


def _quiet_orbax_threads() -> None:
    """A failed save is one line, not pages: drop orbax's per-thread error logs, asyncio's reports of
    orbax's abandoned write tasks, and the "Event loop is closed" errors of tensorstore's callbacks for
    writes that finish after orbax gave up (reported as unraisable, some at exit). Every other record
    and unraisable error passes. Idempotent."""
    for name, kind in (("absl", _NoThreadErrors), ("asyncio", _NoOrbaxTaskErrors)):
        logger = logging.getLogger(name)
        if not any(isinstance(f, kind) for f in logger.filters):
            logger.addFilter(kind())
    previous = sys.unraisablehook
    if getattr(previous, "_meshlm", False):
        return

    def hook(unraisable) -> None:
        if not (unraisable.exc_type is RuntimeError and str(unraisable.exc_value) == "Event loop is closed"):
            previous(unraisable)

    hook._meshlm = True
    sys.unraisablehook = hook


# ---------------------------------------------------------------- the checkpointer


class Checkpointer:
    """Saves and restores (state pytree, meta JSON) per step under one run directory."""

    def __init__(self, directory: str | Path, keep: int = 3):
        self.directory = Path(directory).absolute()
        if keep < 1:
            raise CheckpointError(f"keep must be >= 1 (checkpoints to keep), got {keep}")
        if self.directory.exists() and not self.directory.is_dir():
            raise CheckpointError(f"cannot use {self.directory} for checkpoints: not a directory")
        self.keep = keep
        self._manager = _make_manager(self.directory)

    def close(self) -> None:
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def all_steps(self) -> list[int]:
        return complete_steps(self.directory)

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def step_dir(self, step: int) -> Path:
        return self.directory / str(step)

    # ------------------------------------------------------------ save

    def save(self, step: int, state: Any, meta: dict) -> None:
        """Write ``step`` and wait until it is committed; then drop all but the newest ``keep``.
        Call from every process. A failure leaves only a tmp directory that loading ignores."""
        step = int(step)
        _check_saveable(self.directory, step, meta)
        self._write(step, _save_args(state, meta, make_record(state, meta)))
        if not is_complete_step(self.step_dir(step)):
            raise CheckpointError(f"save of step {step} to {self.directory} did not commit")
        _prune(self._manager, self.directory, self.keep)
        if jax.process_index() == 0:
            remove_interrupted(self.directory, up_to=step)

    def _write(self, step: int, args: ocp.args.Composite) -> None:
        _quiet_orbax_threads()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._manager.save(step, args=args, force=True)
            self._manager.wait_until_finished()
        except Exception as e:  # any failure here is a failed save; the cause stays chained
            if is_disk_full(e):
                newest = self.latest_step()
                then = "start again" if newest is None else f"resume from step {newest}"
                raise CheckpointError(
                    f"could not save step {step} to {self.directory}: no space left on device; free "
                    f"space (earlier checkpoints there are untouched), then run the same command to {then}"
                ) from e
            raise CheckpointError(
                f"could not save step {step} to {self.directory} (unwritable or full?): "
                f"{error_line(e)}; earlier checkpoints there are untouched"
            ) from e

    # ------------------------------------------------------------ restore

    def restore(
        self,
        abstract_state: Any,
        step: int | None = None,
        expect_meta: dict | None = None,
        partial: bool = False,
    ) -> tuple[Any, dict, int]:
        """Load ``step`` (default: the newest loadable) onto the shardings in ``abstract_state``,
        a pytree of ``jax.ShapeDtypeStruct(shape, dtype, sharding=...)``. Returns
        (state, meta, step). ``expect_meta`` keys must equal the saved ones. ``partial`` loads
        only the subtree ``abstract_state`` names (e.g. ``{"params": ...}`` for inference)."""
        load = lambda s: self._restore_step(abstract_state, s, expect_meta, partial)
        return _load(self.directory, load, step)

    def resume(self, abstract_state: Any, expect_meta: dict | None = None) -> tuple[Any, dict, int] | None:
        """``restore`` the newest loadable step (None if there is no complete step), then move
        aside every step directory newer than it (corrupt, or an interrupted save): left in place,
        it would stop the resumed run from saving that step again. Call from every process."""
        skipped: dict[int, str] = {}
        resumed = None
        if self.all_steps():
            load = lambda s: self._restore_step(abstract_state, s, expect_meta)
            resumed = _load_newest(self.directory, load, skipped)
        set_aside_newer(self.directory, resumed[2] if resumed else 0, skipped)
        self._manager.reload()  # orbax lists steps once: it would still refuse to save those moved
        return resumed

    def read_meta(self, step: int | None = None) -> dict:
        """The saved meta dict (checked against its integrity record), without reading any array."""
        return self.read_meta_at(step)[0]

    def read_meta_at(self, step: int | None = None) -> tuple[dict, int]:
        """(meta, the step it was read from): ``read_meta``, also saying which step loaded."""
        load = lambda s: (_read_checked_meta(self._manager, s, self.step_dir(s))[0], s)
        return _load(self.directory, load, step)

    def _restore_step(
        self, abstract: Any, step: int, expect_meta: dict | None, partial: bool = False
    ) -> tuple[Any, dict, int]:
        where = self.step_dir(step)
        meta, record = _read_checked_meta(self._manager, step, where)
        _check_meta(meta, expect_meta, f"checkpoint {where}")  # after the digest: edits are damage
        saved = saved_arrays(record, where / INTEGRITY / JSON_FILE)
        check_abstract(saved, abstract, f"checkpoint {where}", partial)
        state, error = _read_arrays(self._manager, step, where, abstract, partial)
        if not agree(error is None):  # all processes fall back to the same step
            raise CorruptCheckpoint(
                f"cannot read arrays of {where / STATE}: " + (error or "failed on another process")
            )
        verify(state, saved, where / STATE)
        return state, meta, step
