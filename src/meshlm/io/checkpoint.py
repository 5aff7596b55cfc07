"""Sharded, atomic checkpoints (orbax-checkpoint) that restore onto any mesh.

Layout written by orbax-checkpoint 0.12.8 on a local filesystem (``DIR`` is the run directory)::

    DIR/<step>.orbax-checkpoint-tmp/   a save in progress, or one that crashed: never loaded
    DIR/<step>/                        a finished save: the tmp directory renamed atomically
        commit_success.txt             written just before the rename: our completion marker
        _CHECKPOINT_METADATA           orbax's step metadata (item handlers, timestamps)
        state/                         the array pytree: tensorstore zarr chunks in an OCDBT store
            manifest.ocdbt, d/*        root b-tree (small arrays are inlined in its nodes)
            ocdbt.process_<i>/d/*      the chunk data each process wrote
            _METADATA, _sharding       tree structure and the sharding it was saved with
        meta/metadata                  the caller's JSON dict (configs, data position, seed, ...)
        integrity/metadata             ours: shape, dtype and a bit fingerprint of every array

The fingerprint exists because orbax does not notice every corruption: a flipped byte inside a
chunk file decodes (zstd without checksums) into wrong values without any error.
"""

from __future__ import annotations

import json
import re
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from meshlm.errors import CheckpointError

STATE, META, INTEGRITY = "state", "meta", "integrity"  # orbax item names = subdirectory names
COMMIT_MARKER = ocp.path.atomicity.COMMIT_SUCCESS_FILE  # "commit_success.txt"
TMP_SUFFIX = ocp.path.atomicity.TMP_DIR_SUFFIX  # ".orbax-checkpoint-tmp"
_JSON_FILE = "metadata"  # the file name orbax's JSON handler uses inside its item directory
_FORMAT = 1  # version of the integrity record, bumped if its meaning changes

_T = TypeVar("_T")


class _CorruptCheckpoint(CheckpointError):
    """A step whose files are missing or damaged: restore(step=None) falls back past it."""


def _how_to_make(directory: Path) -> str:
    return f"make one with `meshlm train --out {directory}`"


def _no_checkpoint(directory: Path) -> CheckpointError:
    return CheckpointError(f"no checkpoint in {directory}: {_how_to_make(directory)}")


def is_complete_step(path: Path) -> bool:
    """A finalized step directory: a numeric name (orbax renames the tmp directory only when
    done) and the commit marker (orbax also relies on it alone on filesystems without rename)."""
    return path.name.isdigit() and path.is_dir() and (path / COMMIT_MARKER).is_file()


def complete_steps(directory: Path) -> list[int]:
    """Steps of ``directory`` whose save finished, oldest first."""
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if is_complete_step(p))


def incomplete_saves(directory: Path) -> list[Path]:
    """Step directories left by interrupted saves: orbax tmp names, or a numeric name without the
    commit marker."""
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if p.is_dir() and TMP_SUFFIX in p.name]
    found += [p for p in directory.iterdir() if p.name.isdigit() and not is_complete_step(p)]
    return sorted(found, key=lambda p: p.name)


def _step_of(path: Path) -> int | None:
    m = re.match(r"(\d+)", path.name)
    return int(m.group(1)) if m else None


def resolve(path: str | Path) -> tuple[Path, int | None]:
    """A run directory -> (it, None: use the latest); one step's directory -> (run dir, step)."""
    p = Path(path).absolute()
    if not p.exists():
        raise CheckpointError(f"no checkpoint at {p}: the path does not exist")
    interrupted = p.name.isdigit() and (p / STATE).is_dir() and not is_complete_step(p)
    if TMP_SUFFIX in p.name or interrupted:
        raise CheckpointError(
            f"{p} is an incomplete checkpoint (its save was interrupted); "
            f"pass {p.parent} to load the latest complete one"
        )
    if is_complete_step(p):
        return p.parent, int(p.name)
    if not complete_steps(p):
        raise _no_checkpoint(p)
    return p, None


def is_checkpoint_dir(path: str | Path) -> bool:
    """True for a run directory holding a complete checkpoint, or a complete step directory."""
    try:
        resolve(path)
    except CheckpointError:
        return False
    return True


# ---------------------------------------------------------------- integrity fingerprints


def _words(x: jax.Array) -> jax.Array:
    """The array's bits as uint32 words: 8/16-bit types widened, 64-bit types split in two."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    bits = x.dtype.itemsize * 8
    if bits == 64:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)  # adds a trailing axis of 2
    return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{bits}")).astype(jnp.uint32)


def _mix(z: jax.Array) -> jax.Array:
    """murmur3's 32-bit finalizer: every input bit flips about half the output bits."""
    z = (z ^ (z >> 16)) * np.uint32(0x85EBCA6B)
    z = (z ^ (z >> 13)) * np.uint32(0xC2B2AE35)
    return z ^ (z >> 16)


def _flat_index(shape: tuple[int, ...]) -> jax.Array:
    """Row-major element index (mod 2**32) built from iotas, so it keeps the array's sharding
    instead of reshaping (which could move data between devices)."""
    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(len(shape))):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * np.uint32(stride)
        stride = (stride * shape[axis]) % 2**32
    return index


@jax.jit
def _fingerprint(x: jax.Array) -> jax.Array:
    """Two uint32 sums over (position, bits). Integer sums are exact in any order, so the result
    does not depend on the mesh, and the work stays on the devices (multi-process safe)."""
    words = _words(x)
    index = _flat_index(words.shape)
    weighted = jnp.sum(words * (index * np.uint32(2) + np.uint32(1)), dtype=jnp.uint32)
    mixed = jnp.sum(_mix(words ^ _mix(index)), dtype=jnp.uint32)
    return jnp.stack([weighted, mixed])


@jax.jit
def _fingerprints(leaves: list) -> list:
    return [_fingerprint(leaf) for leaf in leaves]


def _describe(state: Any) -> dict[str, dict[str, Any]]:
    """{path: {shape, dtype, fingerprint}} for every leaf of ``state``."""
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    # One program for the whole tree: every process of a job runs the same single computation
    # (per-leaf programs were seen to deadlock a 2-process gloo job mid-save).
    prints = _fingerprints([leaf for _, leaf in leaves])
    out = {}
    for (path, leaf), fingerprint in zip(leaves, prints, strict=True):
        a, b = (int(v) for v in np.asarray(fingerprint))
        out[jax.tree_util.keystr(path)] = {
            "shape": list(np.shape(leaf)),
            "dtype": np.dtype(leaf.dtype).name,
            "fingerprint": f"{a:08x}{b:08x}",
        }
    return out


# ---------------------------------------------------------------- checks on restore


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


def _target_problem(key: str, leaf: Any) -> str | None:
    """Why ``leaf`` cannot be a restore target, caught here so that it is not mistaken for a
    damaged checkpoint (orbax fails the same way for both)."""
    sharding = getattr(leaf, "sharding", None)
    if sharding is None:
        return f"{key}: no sharding; use jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(...))"
    try:
        sharding.shard_shape(tuple(leaf.shape))
    except ValueError as e:
        return f"{key}: {e}"
    return None


def _check_abstract(saved: dict[str, dict], abstract: Any, where: str, partial: bool = False) -> None:
    """Structure, shape, dtype and sharding of the target against the checkpoint, by parameter.
    With ``partial``, the target may be a subtree (e.g. parameters without optimizer state)."""
    want = {jax.tree_util.keystr(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(abstract)[0]}
    problems = (
        [] if partial else [f"{k}: in the checkpoint, not in the model" for k in saved if k not in want]
    )
    problems += [f"{k}: in the model, not in the checkpoint" for k in want if k not in saved]
    for key in (k for k in want if k in saved):
        have = (tuple(saved[key]["shape"]), saved[key]["dtype"])
        need = (tuple(want[key].shape), np.dtype(want[key].dtype).name)
        if have != need:
            problems.append(
                f"{key}: checkpoint has shape {have[0]} {have[1]}, model expects {need[0]} {need[1]}"
            )
        elif problem := _target_problem(key, want[key]):
            problems.append(problem)
    if problems:
        raise CheckpointError(
            f"{where} does not match the model: "
            + "; ".join(problems[:8])
            + (f" (and {len(problems) - 8} more)" if len(problems) > 8 else "")
        )


def _verify(state: Any, saved: dict[str, dict], where: Path) -> None:
    for key, info in _describe(state).items():
        if info["fingerprint"] != saved[key]["fingerprint"]:
            raise _CorruptCheckpoint(
                f"array {key} read from {where} differs from what was "
                "saved (fingerprint mismatch): its data files are damaged"
            )


def _error_line(e: BaseException) -> str:
    """The informative line of an orbax/tensorstore error (those embed pages of spec dumps)."""
    chain = []
    while e is not None and len(chain) < 8:
        chain.append(e)
        e = e.__cause__ or e.__context__
    lines = [line for err in reversed(chain) for line in str(err).splitlines()]  # root cause first
    named = [line for line in lines if re.search(r"local file|No such file|not found", line)]
    line = (named or lines or [type(chain[-1]).__name__])[0]
    return line.split(" [tensorstore_spec")[0].strip()[:400]


def _sized_like(error: str, directory: Path) -> str:
    """Tensorstore names only the OCDBT database when a chunk file is short ("not valid for value of
    size N"); the file of that size under ``directory`` is the damaged one."""
    m = re.search(r"for value of size (\d+)", error)
    if not m:
        return ""
    files = [p for p in directory.rglob("*") if p.is_file() and p.stat().st_size == int(m.group(1))]
    return f" (damaged file: {files[0]})" if len(files) == 1 else ""


def _agree(ok: bool) -> bool:
    """True only if every process succeeded, so all processes fall back to the same step."""
    if jax.process_count() == 1:
        return ok
    from jax.experimental import multihost_utils  # noqa: PLC0415 - multi-process only

    return bool(np.all(multihost_utils.process_allgather(np.array(ok))))


class Checkpointer:
    """Saves and restores (state pytree, meta JSON) per step under one run directory."""

    def __init__(self, directory: str | Path, keep: int = 3):
        self.directory = Path(directory).absolute()
        if keep < 1:
            raise CheckpointError(f"keep must be >= 1 (checkpoints to keep), got {keep}")
        if self.directory.exists() and not self.directory.is_dir():
            raise CheckpointError(f"cannot use {self.directory} for checkpoints: not a directory")
        self.keep = keep
        # create=False: only save() makes the directory, so a mistyped path when restoring
        # reports "no checkpoint" instead of leaving an empty directory behind. No max_to_keep:
        # orbax would prune before knowing the new step committed; _prune runs after.
        options = ocp.CheckpointManagerOptions(create=False, enable_async_checkpointing=False)
        handlers = {
            STATE: ocp.StandardCheckpointHandler(),
            META: ocp.JsonCheckpointHandler(),
            INTEGRITY: ocp.JsonCheckpointHandler(),
        }
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

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
        try:
            json.dumps(meta, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"meta must be a JSON dict of plain values: {e}") from e
        if step < 0 or self.step_dir(step).exists():
            raise CheckpointError(
                f"cannot save step {step} in {self.directory}: "
                + ("it already exists" if step >= 0 else "negative step")
            )
        integrity = {"format": _FORMAT, "arrays": _describe(state)}
        self._write(step, state, meta, integrity)
        if not is_complete_step(self.step_dir(step)):
            raise CheckpointError(f"save of step {step} to {self.directory} did not commit")
        self._prune()
        self._remove_interrupted(up_to=step)

    def _write(self, step: int, state: Any, meta: dict, integrity: dict) -> None:
        args = ocp.args.Composite(
            **{
                STATE: ocp.args.StandardSave(state),
                META: ocp.args.JsonSave(meta),
                INTEGRITY: ocp.args.JsonSave(integrity),
            }
        )
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._manager.save(step, args=args, force=True)
            self._manager.wait_until_finished()
        except Exception as e:  # any failure here is a failed save; the cause stays chained
            raise CheckpointError(
                f"could not save step {step} to {self.directory} (unwritable or full?): "
                f"{_error_line(e)}; earlier checkpoints there are untouched"
            ) from e

    def _prune(self) -> None:
        """Delete complete steps older than the newest ``keep``: runs only after a commit, so the
        newest good checkpoint is never among them."""
        steps = self.all_steps()
        if len(steps) <= self.keep:
            return
        self._manager.reload()  # orbax deletes only steps it has listed
        for step in steps[: -self.keep]:
            try:
                self._manager.delete(step)
            except OSError as e:  # the new step is safe; an old one left behind is not an error
                warnings.warn(f"could not delete old checkpoint {self.step_dir(step)}: {e}", stacklevel=3)

    def _remove_interrupted(self, up_to: int) -> None:
        """Remove debris of crashed saves up to the step just committed; later ones may be
        in progress on other processes."""
        if jax.process_index() != 0:
            return
        for path in incomplete_saves(self.directory):
            step = _step_of(path)
            if step is not None and step <= up_to and TMP_SUFFIX in path.name:
                shutil.rmtree(path, ignore_errors=True)

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
        return load(self._check_step(step)) if step is not None else self._newest(load)

    def read_meta(self, step: int | None = None) -> dict:
        """The saved meta dict, without reading any array."""
        load = lambda s: self._read_json(s, META)
        return load(self._check_step(step)) if step is not None else self._newest(load)

    def _check_step(self, step: int) -> int:
        if step not in self.all_steps():
            found = ", ".join(map(str, self.all_steps())) or "none"
            raise CheckpointError(
                f"no complete checkpoint for step {step} in {self.directory} (complete steps: {found})"
            )
        return step

    def _newest(self, load: Callable[[int], _T]) -> _T:
        """``load`` the newest step that loads, warning about each one skipped."""
        steps = self.all_steps()
        for path in incomplete_saves(self.directory):
            if not steps or (_step_of(path) or -1) > steps[-1]:
                why = "never renamed to its final name" if TMP_SUFFIX in path.name else f"no {COMMIT_MARKER}"
                warnings.warn(f"ignoring {path}: an interrupted save ({why})", stacklevel=3)
        if not steps:
            raise _no_checkpoint(self.directory)
        failures = []
        for step in reversed(steps):
            try:
                return load(step)
            except _CorruptCheckpoint as e:
                warnings.warn(f"skipping corrupt checkpoint step {step}: {e}", stacklevel=3)
                failures.append(f"step {step}: {e}")
        raise CheckpointError(
            f"no loadable checkpoint in {self.directory}, all of steps {steps} failed; newest {failures[0]}"
        )

    def _read_json(self, step: int, item: str) -> dict:
        path = self.step_dir(step) / item / _JSON_FILE
        try:
            out = self._manager.restore(step, args=ocp.args.Composite(**{item: ocp.args.JsonRestore()}))
            value = out[item]
        except Exception as e:  # missing or garbled file: orbax raises assorted types
            raise _CorruptCheckpoint(f"cannot read {path}: {_error_line(e)}") from e
        if not isinstance(value, dict):
            raise _CorruptCheckpoint(f"cannot read {path}: not a JSON object")
        return value

    def _restore_step(
        self, abstract: Any, step: int, expect_meta: dict | None, partial: bool = False
    ) -> tuple[Any, dict, int]:
        where = self.step_dir(step)
        meta = self._read_json(step, META)
        _check_meta(meta, expect_meta, f"checkpoint {where}")
        integrity = self._read_json(step, INTEGRITY)
        if integrity.get("format") != _FORMAT or not isinstance(integrity.get("arrays"), dict):
            raise _CorruptCheckpoint(f"{where / INTEGRITY / _JSON_FILE} is not a meshlm record")
        _check_abstract(integrity["arrays"], abstract, f"checkpoint {where}", partial)
        state, error = self._read_arrays(step, abstract, partial)
        if not _agree(error is None):
            raise _CorruptCheckpoint(
                f"cannot read arrays of {where / STATE}: " + (error or "failed on another process")
            )
        _verify(state, integrity["arrays"], where / STATE)
        return state, meta, step

    def _read_arrays(self, step: int, abstract: Any, partial: bool = False) -> tuple[Any, str | None]:
        args = ocp.args.Composite(**{STATE: ocp.args.StandardRestore(abstract)})
        try:
            if partial:  # read only the subtree asked for (e.g. parameters, not optimizer state)
                restore_args = ocp.checkpoint_utils.construct_restore_args(abstract)
                part = ocp.args.PyTreeRestore(item=abstract, restore_args=restore_args, partial_restore=True)
                with ocp.PyTreeCheckpointer() as reader:
                    return reader.restore(self.step_dir(step) / STATE, args=part), None
            return self._manager.restore(step, args=args)[STATE], None
        except Exception as e:  # tensorstore reports damage as ValueError, Exception, ...
            line = _error_line(e)
            return None, line + _sized_like(line, self.step_dir(step) / STATE)
