"""Integrity records: the shape, dtype and a bit fingerprint of every array of a checkpoint, and a
SHA-256 of its meta dict, written with each save (``integrity/metadata``) and checked on restore.

The fingerprint exists because orbax does not notice every corruption: a flipped byte inside a
chunk file decodes (zstd without checksums) into wrong values without any error. The meta digest
exists because the meta holds the model config: an edited ``rope_theta`` loads fine and generates
different text.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from meshlm.errors import CheckpointError
from meshlm.io.layout import JSON_FILE, META

# Version of the integrity record, bumped if its meaning changes. 2 added "meta_sha256"; records of
# format 1 (older meshlm) are still read, with a warning that their meta is unprotected.
FORMAT = 2
READABLE = (1, 2)
_warned_unprotected: set[str] = set()  # step directories warned about once per process


class CorruptCheckpoint(CheckpointError):
    """A step whose files are missing or damaged: restore(step=None) falls back past it."""


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


def describe(state: Any) -> dict[str, dict[str, Any]]:
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


def meta_digest(meta: dict) -> str:
    """SHA-256 of the canonical JSON of ``meta`` as it reads back (tuples as lists, keys as strings)."""
    canonical = json.dumps(json.loads(json.dumps(meta)), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def make_record(state: Any, meta: dict) -> dict[str, Any]:
    """The integrity record saved next to ``state`` and ``meta``."""
    return {"format": FORMAT, "arrays": describe(state), "meta_sha256": meta_digest(meta)}


def _check_format(record: dict, where: Path) -> None:
    fmt = record.get("format")
    if isinstance(fmt, int) and not isinstance(fmt, bool) and fmt > FORMAT:
        # Not corruption (resume must not set it aside): a newer meshlm wrote it.
        raise CheckpointError(
            f"{where} has integrity format {fmt}, newer than this meshlm reads ({FORMAT}); "
            "upgrade meshlm to load this checkpoint"
        )
    if fmt not in READABLE or not isinstance(record.get("arrays"), dict):
        raise CorruptCheckpoint(f"{where} is not a meshlm record")


def saved_arrays(record: dict, where: Path) -> dict[str, dict]:
    """The per-array entries of a record read from ``where``; a foreign record is corruption."""
    _check_format(record, where)
    return record["arrays"]


def check_meta(record: dict, meta: dict, step_dir: Path, record_path: Path) -> None:
    """Raise ``CorruptCheckpoint`` if ``meta`` (read from ``step_dir``) is not what was saved."""
    _check_format(record, record_path)
    if record["format"] == 1:
        if str(step_dir) not in _warned_unprotected:
            _warned_unprotected.add(str(step_dir))
            warnings.warn(
                f"checkpoint {step_dir} was saved by an older meshlm (integrity format 1): its "
                "metadata (model config) is not protected against edits or damage; "
                "save it again with this version to protect it",
                stacklevel=5,
            )
        return
    if record.get("meta_sha256") != meta_digest(meta):
        raise CorruptCheckpoint(
            f"the metadata of checkpoint {step_dir} ({META}/{JSON_FILE}) was modified or damaged "
            "after saving (it does not match the SHA-256 in its integrity record), so the checkpoint "
            "cannot be trusted; restore from an older step or re-create it"
        )


# ---------------------------------------------------------------- checks on restore


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


def check_abstract(saved: dict[str, dict], abstract: Any, where: str, partial: bool = False) -> None:
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


def verify(state: Any, saved: dict[str, dict], where: Path) -> None:
    """Raise ``CorruptCheckpoint`` if an array read back differs from the one that was saved."""
    for key, info in describe(state).items():
        if info["fingerprint"] != saved[key]["fingerprint"]:
            raise CorruptCheckpoint(
                f"array {key} read from {where} differs from what was "
                "saved (fingerprint mismatch): its data files are damaged"
            )
