"""Corpus sources (the files training reads) and their split into train and validation, by file.

Sources. ``resolve_files`` takes files, directories (walked recursively, hidden entries skipped)
and glob patterns. With no paths the corpus is the ``.py`` files of the running interpreter's
standard library: present on every machine, no download. It is capped at a deterministic subset
of about ``DEFAULT_MAX_BYTES``.

Record files (JSONL, Parquet, Arrow; ``meshlm.data.records``) are found the same way, and a directory
``datasets``' ``save_to_disk`` wrote stands for its arrow shards; they are exempt from the size limit
for files found in directories (they are read in batches).

Split. Files, not bytes, go to train or validation, by a stable hash of each file's path relative
to the directory (or glob base) it was found under, so the split does not depend on where the
corpus lives or on the order of the paths. A single file is the exception: its last
``val_fraction`` of bytes is validation (``meshlm.data.corpus.load_splits``); a single record file
is split by row, by a hash of each row's text (``meshlm.data.records.row_is_val``).

This module must not import jax: it runs before the CLI has chosen the devices.
"""

from __future__ import annotations

import glob
import hashlib
import os
import posixpath
import stat
import sysconfig
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

from meshlm.data.records import dataset_files, is_record_file, is_saved_dataset
from meshlm.errors import DataError
from meshlm.units import format_bytes

DEFAULT_MAX_BYTES = 8 * 2**20  # default corpus cap: loads in well under 2 s
MAX_FILE_BYTES = 50 * 2**20  # larger files inside directories/globs are skipped with a warning
_GLOB_CHARS = "*?["
_STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})

PathArg = str | os.PathLike[str]
_SPECIAL = {  # st_mode file types that are neither regular files nor directories
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFSOCK: "a socket",
}


# --- sources -----------------------------------------------------------------------------------


class Source(NamedTuple):
    path: Path  # absolute path, used to read the file and to de-duplicate
    key: str  # posix path relative to the directory / glob base it was found under: what we hash


Split = tuple[list[Source], list[Source]]  # (train, validation)


def _stable_hash(key: str, salt: str = "") -> int:
    # sha1, not hash(): Python's str hash is salted per process, and the split must be reproducible.
    digest = hashlib.sha1((salt + key).encode("utf-8", errors="surrogateescape")).digest()
    return int.from_bytes(digest[:8], "big")


def _small_enough(path: Path) -> bool:
    size = path.stat().st_size
    if size <= MAX_FILE_BYTES or is_record_file(path):  # record files are read in batches
        return True
    warnings.warn(
        f"skipping {path}: {format_bytes(size, 'MiB', 0)} is over the "
        f"{format_bytes(MAX_FILE_BYTES, 'MiB', 0)} limit"
        " for files found in directories or globs; name the file directly to include it",
        stacklevel=2,
    )
    return False


def _walk(
    root: Path, *, suffix: str = "", skip: frozenset[str] = frozenset(), strict: bool = True
) -> Iterator[Source]:
    """Regular, non-hidden files under ``root`` (sorted), keyed relative to ``root``.

    ``strict``: an unlistable subdirectory is an error (user data), not a silent gap.
    """

    def fail(err: OSError) -> None:
        if strict:
            raise DataError(
                f"cannot list {err.filename}: {err.strerror}; fix its permissions or leave it out"
            )

    base = root.resolve()
    for dirpath, dirnames, filenames in os.walk(base, onerror=fail):
        if is_saved_dataset(dirpath):  # `datasets`' save_to_disk: its arrow shards, not its JSON
            dirnames[:] = []
            yield from (Source(p, p.relative_to(base).as_posix()) for p in dataset_files(dirpath))
            continue
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in skip)
        for name in sorted(filenames):
            path = Path(dirpath, name)
            if name.startswith(".") or not name.endswith(suffix) or not path.is_file():
                continue
            if _small_enough(path):
                yield Source(path, path.relative_to(base).as_posix())


def _glob_base(pattern: str) -> str:
    """The literal directory prefix of a glob pattern: keys are relative to it."""
    parts = Path(pattern).parts
    literal = []
    for part in parts[:-1]:
        if any(c in part for c in _GLOB_CHARS):
            break
        literal.append(part)
    return os.path.join(*literal) if literal else "."


def _expand_glob(pattern: str) -> list[Source]:
    base = _glob_base(pattern)
    sources = []
    for match in sorted(glob.glob(pattern, recursive=True)):
        # Keys from the unresolved match: a symlink in the tree must not change the hash.
        key = Path(os.path.relpath(match, base)).as_posix()
        path = Path(match)
        if path.is_dir():
            # Walked files keep keys relative to the glob base, not to the matched directory.
            sources += [Source(s.path, posixpath.normpath(f"{key}/{s.key}")) for s in _walk(path)]
        elif path.is_file() and _small_enough(path):
            sources.append(Source(path.resolve(), key))
    if not sources:
        raise DataError(
            f"glob {pattern!r} matched no files; check the pattern (use ** to reach"
            " subdirectories) and quote it so the shell passes it through unexpanded"
        )
    return sources


def _expand(raw: str) -> list[Source]:
    if not raw:  # Path("") is the working directory: an empty value would read it whole
        raise DataError("a data path is empty (''); pass a file, directory or glob ('.' for this directory)")
    # An existing path is literal even if its name contains glob characters.
    if any(c in raw for c in _GLOB_CHARS) and not os.path.exists(raw):
        return _expand_glob(raw)
    path = Path(raw)
    if path.is_dir():
        sources = list(_walk(path))
        if not sources:
            raise DataError(
                f"data directory {raw!r} holds no usable files (hidden files and files over"
                f" {format_bytes(MAX_FILE_BYTES, 'MiB', 0)} are skipped); add text files or pass other paths"
            )
        return sources
    if path.is_file():
        return [Source(path.resolve(), path.name)]
    raise DataError(_not_usable(raw))


def _not_usable(raw: str) -> str:
    """Why ``raw``, neither a regular file nor a directory, cannot be data. Only stat, never open:
    opening a FIFO would block until a writer came."""
    try:
        mode = os.stat(raw).st_mode
    except OSError:
        if os.path.islink(raw):
            return f"data path {raw!r} is a broken symbolic link (to {os.readlink(raw)}); fix or remove it"
        return (
            f"data path {raw!r} does not exist; check the spelling, or omit data paths to train on"
            " the default corpus (the Python standard library)"
        )
    what = _SPECIAL.get(stat.S_IFMT(mode), "a special file")
    return f"data path {raw!r} is not a regular file ({what}): pass text files, directories or globs"


def _user_sources(paths: Sequence[PathArg]) -> list[Source]:
    if isinstance(paths, str | os.PathLike):
        paths = [paths]  # one path, not a sequence of one-character paths
    if not paths:
        raise DataError(
            "the list of data paths is empty; pass files, directories or glob patterns, or pass"
            " None for the default corpus"
        )
    found: dict[Path, Source] = {}
    for raw in paths:
        for src in _expand(os.path.expanduser(os.fspath(raw))):
            # A file named twice keeps the key from its outermost root, whatever the path order.
            old = found.get(src.path, src)
            found[src.path] = max(old, src, key=lambda s: (s.key.count("/"), s.key))
    for src in found.values():
        if not os.access(src.path, os.R_OK):
            raise DataError(f"data file {src.path} is not readable; fix its permissions")
    return sorted(found.values(), key=lambda s: s.path)


def stdlib_root() -> Path:
    """Directory of the running interpreter's standard library: the default corpus."""
    return Path(sysconfig.get_paths()["stdlib"])


def _stdlib_sources() -> list[Source]:
    root = stdlib_root()
    walk = _walk(root, suffix=".py", skip=_STDLIB_SKIP_DIRS, strict=False)
    sources = list(walk) if root.is_dir() else []
    if not sources:
        raise DataError(
            f"the default corpus is the standard library's .py files, but none were found under"
            f" {root} (this Python may ship it zipped or compiled); pass data paths instead"
        )
    return sources


def _cap(sources: list[Source], max_bytes: int) -> list[Source]:
    """A deterministic subset of about ``max_bytes``: files in stable pseudo-random order."""
    if max_bytes < 1:
        raise DataError(f"max_bytes must be >= 1, got {max_bytes}")
    # Hash order samples the whole tree instead of the alphabetically first packages; the salt
    # keeps the choice independent of the train/validation hash.
    order = sorted(sources, key=lambda s: (_stable_hash(s.key, "subset:"), s.path))
    chosen, total = [], 0
    for src in order:
        size = src.path.stat().st_size
        if total + size <= max_bytes:
            chosen.append(src)
            total += size
    if not chosen:
        raise DataError(f"max_bytes={max_bytes} is smaller than every data file; raise it")
    return sorted(chosen, key=lambda s: s.path)


def resolve_sources(paths: Sequence[PathArg] | None, max_bytes: int | None = None) -> list[Source]:
    """Files of ``paths`` (files, directories, globs) with their hash keys, sorted by path.

    ``paths=None`` is the standard library's ``.py`` files (no site-/dist-packages). ``max_bytes``
    caps the corpus at a deterministic subset; ``None`` means ``DEFAULT_MAX_BYTES`` for the
    default corpus and no cap for explicit paths. A file reached through several paths appears
    once, keyed relative to its outermost root, so the order of ``paths`` does not matter.
    """
    if paths is None:
        sources = _stdlib_sources()
        max_bytes = DEFAULT_MAX_BYTES if max_bytes is None else max_bytes
    else:
        sources = _user_sources(paths)
    return sources if max_bytes is None else _cap(sources, max_bytes)


def resolve_files(paths: Sequence[PathArg] | None, max_bytes: int | None = None) -> list[Path]:
    """Sorted, de-duplicated absolute paths of the corpus; see ``resolve_sources``."""
    return [src.path for src in resolve_sources(paths, max_bytes)]


# --- split -------------------------------------------------------------------------------------


def check_fraction(val_fraction: float) -> None:
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"val_fraction must be in (0, 1), e.g. 0.05; got {val_fraction}")


def split_sources(sources: Sequence[Source], val_fraction: float) -> Split:
    """(train, validation) by file: validation iff sha1(key) % 1000 < val_fraction * 1000.

    With >= 2 files neither side is empty: if hashing leaves one empty, the file with the
    smallest hash moves there from the other. With one file one side is empty; ``load_splits``
    splits that file's bytes instead.
    """
    check_fraction(val_fraction)
    threshold = val_fraction * 1000
    train = [s for s in sources if _stable_hash(s.key) % 1000 >= threshold]
    val = [s for s in sources if _stable_hash(s.key) % 1000 < threshold]
    if len(sources) >= 2 and not (train and val):
        # Small corpora can hash entirely to one side; a run needs both.
        donor, receiver = (train, val) if train else (val, train)
        moved = min(donor, key=lambda s: (_stable_hash(s.key), s.path))
        donor.remove(moved)
        receiver.append(moved)
        receiver.sort(key=lambda s: s.path)
    return train, val
