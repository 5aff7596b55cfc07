"""Naming the damaged file of a step's ``state/`` before orbax reads it.

A deleted or truncated chunk file makes tensorstore report only the OCDBT database ("Truncated
Zstd-compressed stream", "Error reading Byte range ..."), and orbax then leaves reads in flight that
print "Event loop is closed" tracebacks once its event loop is gone. So ``missing_data`` walks the
OCDBT b-tree first (``tensorstore.ocdbt.dump``: metadata only, no array data) and checks that every
file it references exists and is long enough; orbax is called only if they are all there.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import tensorstore as ts

MANIFEST = "manifest.ocdbt"
# A dumped reference: "value:<base>:<relative path>:<offset>:<length>" (an array chunk) or
# "btreenode:<base>:<relative path>:<offset>:<length>" (an index node), paths relative to state/.
_REF = re.compile(r"^(value|btreenode):([^:]*):([^:]+):(\d+):(\d+)$")


def error_line(e: BaseException) -> str:
    """The informative line of an orbax/tensorstore error (those embed pages of spec dumps)."""
    chain = []
    while e is not None and len(chain) < 8:
        chain.append(e)
        e = e.__cause__ or e.__context__
    lines = [line for err in reversed(chain) for line in str(err).splitlines()]  # root cause first
    named = [line for line in lines if re.search(r"local file|No such file|not found", line)]
    line = (named or lines or [type(chain[-1]).__name__])[0]
    return line.split(" [tensorstore_spec")[0].strip()[:400]


def array_names(abstract: Any) -> set[str]:
    """The names orbax stores the leaves of ``abstract`` under: the tree keys joined by dots."""
    part = lambda k: str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))
    return {".".join(map(part, path)) for path, _ in jax.tree_util.tree_flatten_with_path(abstract)[0]}


def _file_problem(state_dir: Path, ref: re.Match) -> str | None:
    path = state_dir / ref[2] / ref[3]
    end = int(ref[4]) + int(ref[5])
    if not path.is_file():
        return f"missing file: {path} (deleted or moved)"
    size = path.stat().st_size
    if size < end:
        return f"damaged file: {path} is truncated ({size} bytes, its data runs to byte {end})"
    return None


def _refs(node: Any) -> Iterator[tuple[str, re.Match]]:
    """(the entry's key, reference) for every reference in a dumped b-tree node."""
    for entry in node.get("entries", []) if isinstance(node, dict) else []:
        key = entry.get("key", b"")
        key = key.decode(errors="replace") if isinstance(key, bytes) else str(key)
        for value in entry.values():
            if isinstance(value, str) and (m := _REF.match(value)):
                yield key, m


class _BadNode(Exception):
    """A b-tree node that does not decode; the message names its file."""


def _dump(kv: ts.KvStore, state_dir: Path, node: re.Match) -> Any:
    try:
        return ts.ocdbt.dump(kv, node[0]).result()
    except Exception as e:  # tensorstore raises ValueError and others
        raise _BadNode(f"damaged file: {state_dir / node[2] / node[3]} ({error_line(e)})") from e


def _chunks(kv: ts.KvStore, state_dir: Path, node: re.Match) -> Iterator[tuple[str, re.Match | str]]:
    """(key, reference) of every chunk stored outside the index under the b-tree ``node``;
    ("", problem) for an index node whose file is missing or short."""
    for key, ref in _refs(_dump(kv, state_dir, node)):
        if ref[1] != "btreenode":
            yield key, ref
        elif problem := _file_problem(state_dir, ref):  # interior keys are only bounds: descend all
            yield "", problem
        else:
            yield from _chunks(kv, state_dir, ref)


def _root(state_dir: Path) -> tuple[ts.KvStore, re.Match | None]:
    """The OCDBT store of ``state_dir`` and its root node's reference (None if it is empty)."""
    kv = ts.KvStore.open(state_dir.absolute().as_uri() + "/").result()
    versions = ts.ocdbt.dump(kv).result().get("versions") or []
    return kv, _REF.match(versions[-1]["root"].get("location", "") if versions else "")


def missing_data(state_dir: Path, wanted: set[str] | None = None) -> str | None:
    """None if every file the arrays named ``wanted`` (default: all) need is present and long
    enough, else one line naming the first that is not."""
    if not (state_dir / MANIFEST).is_file():
        return f"missing file: {state_dir / MANIFEST} (the index of the arrays; deleted or moved)"
    if problem := _damaged_process_manifest(state_dir):
        return problem
    try:
        kv, root = _root(state_dir)
        if root is None:
            return None
        if problem := _file_problem(state_dir, root):
            return problem
        for key, ref in _chunks(kv, state_dir, root):
            array = key.rsplit("/", 1)[0]
            if isinstance(ref, str):
                return ref
            if (wanted is None or array in wanted) and (problem := _file_problem(state_dir, ref)):
                return f"{problem}; it holds array {array}"
    except _BadNode as e:
        return str(e)
    except Exception as e:  # a garbled manifest: tensorstore raises ValueError and others
        return f"cannot read the array index in {state_dir}: {error_line(e)}"
    return None


def _damaged_process_manifest(state_dir: Path) -> str | None:
    """Each process's own OCDBT manifest (``ocdbt.process_<i>/manifest.ocdbt``) must decode too. orbax
    reads the arrays through the root index, so a zero-length one restores unnoticed; but a step with a
    damaged file is not trusted (an emptied file says the copy or the disk failed), so it is refused
    here and a resume falls back past it, as for any damaged file."""
    for manifest in sorted(state_dir.glob(f"ocdbt.process_*/{MANIFEST}")):
        try:
            kv = ts.KvStore.open(manifest.parent.absolute().as_uri() + "/").result()
            ts.ocdbt.dump(kv).result()
        except Exception as e:  # tensorstore raises ValueError and others
            size = manifest.stat().st_size
            return f"damaged file: {manifest} ({size} bytes: {error_line(e)})"
    return None


def file_of(state_dir: Path, error: str) -> str:
    """The file of the chunk an orbax error line names ('Error reading "KEY" in OCDBT ...'), as
    " (in file PATH)", so a chunk that fails to decode is named by its file; "" if not found."""
    m = re.search(r'Error reading "([^"]+)" in OCDBT', error)
    if not m:
        return ""
    try:
        kv, root = _root(state_dir)
        refs = [ref for key, ref in _chunks(kv, state_dir, root) if key == m[1]] if root else []
    except Exception:  # only a better message was at stake
        return ""
    if not refs or isinstance(refs[0], str):
        return ""
    return f" (in file {state_dir / refs[0][2] / refs[0][3]})"
