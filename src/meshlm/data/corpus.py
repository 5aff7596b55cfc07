"""Byte-level training data: tokenizer, file sources, a split by file, and stateless batches.

Tokenizer. A token id is one UTF-8 byte of the text, so the vocabulary is ``VOCAB_SIZE = 256``
and one token is one byte (which is why ``bits_per_byte`` is just the loss in bits). Id
``EOD = 0``, the NUL byte, ends every document: text files do not contain NUL, and any NUL byte
that does occur (in a file, or in text given to ``encode``) is dropped, so a 0 in a stream always
means end-of-document.

Sources. ``resolve_files`` takes files, directories (walked recursively, hidden entries skipped)
and glob patterns. With no paths the corpus is the ``.py`` files of the running interpreter's
standard library: present on every machine, no download. It is capped at a deterministic subset
of about ``DEFAULT_MAX_BYTES``.

Split. Files, not bytes, go to train or validation, by a stable hash of each file's path relative
to the directory (or glob base) it was found under, so the split does not depend on where the
corpus lives or on the order of the paths. A single file is the exception: its last
``val_fraction`` of bytes is validation.

Batches. The batch at step s is a pure function of (seed, s), so training resumes without any
data-loader state, and each data-parallel shard slices only its own rows.

This module must not import jax: it runs before the CLI has chosen the devices.
"""

from __future__ import annotations

import glob
import hashlib
import math
import os
import posixpath
import sys
import sysconfig
import warnings
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from meshlm.errors import DataError

VOCAB_SIZE = 256
EOD = 0  # end-of-document id: the NUL byte
DEFAULT_MAX_BYTES = 8 * 2**20  # default corpus cap: loads in well under 2 s
MAX_FILE_BYTES = 50 * 2**20  # larger files inside directories/globs are skipped with a warning
EVAL_SEED = 0x5EED_E7A1  # validation batches must not move when the training seed changes
_GLOB_CHARS = "*?["
_STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})

PathArg = str | os.PathLike[str]


# --- tokenizer ---------------------------------------------------------------------------------


def encode(text: str) -> np.ndarray:
    """UTF-8 bytes of ``text`` as int32 ids. NUL characters are dropped: 0 is reserved for EOD."""
    # "replace" so lone surrogates (e.g. from odd file names) cannot make encoding raise.
    data = text.encode("utf-8", errors="replace").replace(b"\0", b"")
    return np.frombuffer(data, dtype=np.uint8).astype(np.int32)


def decode(ids: Iterable[int] | np.ndarray) -> str:
    """Text of integer ``ids``; never raises. Invalid UTF-8 and ids outside [0, 256) become U+FFFD.

    EOD ids decode to "\\x00"; split on it to get documents.
    """
    arr = np.asarray(ids, dtype=np.int64).reshape(-1)
    bad = (arr < 0) | (arr >= VOCAB_SIZE)
    if not bad.any():
        return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")
    # Decode the runs between bad ids separately so a bad id never glues bytes across itself.
    parts, start = [], 0
    for i in np.flatnonzero(bad):
        parts.append(decode(arr[start:i]))
        start = int(i) + 1
    parts.append(decode(arr[start:]))
    return "\ufffd".join(parts)


def bits_per_byte(loss_nats: float) -> float:
    """Mean cross-entropy in nats per token -> bits per byte (loss / ln 2: one token is one byte).

    Unlike the loss of a subword model, this is comparable across tokenizers and to compressors.
    """
    return float(loss_nats) / math.log(2)


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
    if size <= MAX_FILE_BYTES:
        return True
    warnings.warn(
        f"skipping {path}: {size / 2**20:.0f} MB is over the {MAX_FILE_BYTES / 2**20:.0f} MB limit"
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
    # An existing path is literal even if its name contains glob characters.
    if any(c in raw for c in _GLOB_CHARS) and not os.path.exists(raw):
        return _expand_glob(raw)
    path = Path(raw)
    if path.is_dir():
        sources = list(_walk(path))
        if not sources:
            raise DataError(
                f"data directory {raw!r} holds no usable files (hidden files and files over"
                f" {MAX_FILE_BYTES // 2**20} MB are skipped); add text files or pass other paths"
            )
        return sources
    if path.is_file():
        return [Source(path.resolve(), path.name)]
    raise DataError(
        f"data path {raw!r} does not exist; check the spelling, or omit data paths to train on"
        " the default corpus (the Python standard library)"
    )


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


def _check_fraction(val_fraction: float) -> None:
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"val_fraction must be in (0, 1), e.g. 0.05; got {val_fraction}")


def split_sources(sources: Sequence[Source], val_fraction: float) -> Split:
    """(train, validation) by file: validation iff sha1(key) % 1000 < val_fraction * 1000.

    With >= 2 files neither side is empty: if hashing leaves one empty, the file with the
    smallest hash moves there from the other. With one file one side is empty; ``load_splits``
    splits that file's bytes instead.
    """
    _check_fraction(val_fraction)
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


# --- token streams -----------------------------------------------------------------------------


def _read(path: Path) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as err:
        raise DataError(
            f"cannot read data file {path}: {err.strerror}; fix it or leave it out of the paths"
        ) from err
    return data.replace(b"\0", b"")  # NUL is EOD: a stray NUL must not end a document early


class TokenStream:
    """The tokens of one split: each document followed by EOD. Stored as uint8, served as int32."""

    def __init__(self, tokens: np.ndarray | Sequence[int], files: Sequence[Path] = ()):
        arr = np.asarray(tokens)
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise DataError(f"tokens must be a 1-D integer array, got {arr.dtype} {arr.shape}")
        if arr.size and (arr.min() < 0 or arr.max() >= VOCAB_SIZE):
            raise DataError(f"token ids must be in [0, {VOCAB_SIZE}) for the byte vocabulary")
        self.tokens = arr.astype(np.uint8)  # a private copy, a quarter of int32's memory
        self.tokens.setflags(write=False)
        self.files = tuple(files)  # the files it was read from (for reports and tests)

    @classmethod
    def from_documents(cls, docs: Iterable[bytes], files: Sequence[Path] = ()) -> TokenStream:
        """Concatenate byte documents, dropping NULs and ending each with EOD."""
        parts = []
        for doc in docs:
            parts += [doc.replace(b"\0", b""), bytes([EOD])]
        return cls(np.frombuffer(b"".join(parts), dtype=np.uint8), files)

    @classmethod
    def from_files(cls, paths: Sequence[Path]) -> TokenStream:
        """One document per file, in the given order."""
        return cls.from_documents((_read(p) for p in paths), paths)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_docs(self) -> int:
        return int(np.count_nonzero(self.tokens == EOD))

    def windows(self, starts: np.ndarray | Sequence[int], length: int) -> np.ndarray:
        """int32[len(starts), length]: the tokens at starts[i] : starts[i] + length."""
        starts = np.asarray(starts, dtype=np.int64).reshape(-1)
        if starts.size and (starts.min() < 0 or starts.max() + length > len(self)):
            raise DataError(f"window of {length} tokens out of range of a {len(self)}-token stream")
        return self.tokens[starts[:, None] + np.arange(length)].astype(np.int32)


# --- batches -----------------------------------------------------------------------------------


StreamLike = TokenStream | np.ndarray


class Batcher:
    """Random windows of a stream; the batch at a step depends only on (seed, step).

    Row r of step s starts at offset ``default_rng([seed, s]).integers(0, len - seq_len, B)[r]``;
    inputs are tokens [o, o + seq_len) and targets the same window shifted by one token.
    """

    def __init__(self, stream: StreamLike, seq_len: int, global_batch: int, seed: int = 0):
        self.stream = stream if isinstance(stream, TokenStream) else TokenStream(stream)
        if seq_len < 1:
            raise DataError(f"seq_len must be >= 1, got {seq_len}")
        if global_batch < 1:
            raise DataError(f"global_batch must be >= 1, got {global_batch}")
        if seed < 0:
            raise DataError(f"seed must be >= 0 (numpy seeds are non-negative), got {seed}")
        n = len(self.stream)
        if seq_len >= n - 1:
            raise DataError(
                f"seq_len={seq_len} needs at least {seq_len + 2} tokens but this split has {n};"
                " use a shorter seq_len or more data (for validation: a larger val_fraction)"
            )
        self.seq_len, self.global_batch, self.seed = seq_len, global_batch, seed
        self._num_offsets = n - seq_len  # offsets 0 .. n-seq_len-1: a window needs seq_len+1

    def offsets(self, step: int) -> np.ndarray:
        """Start offsets of all global rows of ``step`` (cheap: B integers)."""
        if step < 0:
            raise DataError(f"step must be >= 0, got {step}")
        return self._draw(np.random.default_rng([self.seed, step]))

    def _draw(self, rng: np.random.Generator) -> np.ndarray:
        return rng.integers(0, self._num_offsets, size=self.global_batch, dtype=np.int64)

    def _rows(self, shard: int, num_shards: int) -> slice:
        if num_shards < 1 or not 0 <= shard < num_shards:
            raise DataError(f"need 0 <= shard < num_shards, got shard={shard} of {num_shards}")
        if self.global_batch % num_shards:
            up = -(-self.global_batch // num_shards) * num_shards
            raise DataError(
                f"global_batch={self.global_batch} is not divisible by {num_shards} data shards;"
                f" use a multiple of {num_shards}, e.g. {up}"
            )
        per = self.global_batch // num_shards
        return slice(shard * per, (shard + 1) * per)

    def _make(self, offsets: np.ndarray) -> dict[str, np.ndarray]:
        window = self.stream.windows(offsets, self.seq_len + 1)
        return {
            "inputs": np.ascontiguousarray(window[:, :-1]),
            "targets": np.ascontiguousarray(window[:, 1:]),
        }

    def batch(self, step: int, *, shard: int = 0, num_shards: int = 1) -> dict[str, np.ndarray]:
        """{"inputs", "targets"}: int32[global_batch // num_shards, seq_len], rows of ``shard``.

        All offsets are drawn (so every shard agrees) but only this shard's windows are built.
        """
        rows = self._rows(shard, num_shards)
        return self._make(self.offsets(step)[rows])

    def eval_batches(self, num_batches: int) -> list[dict[str, np.ndarray]]:
        """``num_batches`` full batches from ``EVAL_SEED``: the same for every seed and step."""
        if num_batches < 0:
            raise DataError(f"num_batches must be >= 0, got {num_batches}")
        batches = []
        for i in range(num_batches):
            rng = np.random.default_rng([EVAL_SEED, i])
            batches.append(self._make(self._draw(rng)))
        return batches


# --- loading -----------------------------------------------------------------------------------


def _split_single(path: Path, val_fraction: float) -> tuple[TokenStream, TokenStream]:
    """One file: the first (1 - val_fraction) of its bytes train, the rest validate."""
    data = _read(path)
    if len(data) < 2:
        raise DataError(f"data file {path} has {len(data)} bytes; one file needs >= 2 to split")
    val_len = min(len(data) - 1, max(1, round(len(data) * val_fraction)))
    cut = len(data) - val_len
    train = TokenStream.from_documents([data[:cut]], [path])
    return train, TokenStream.from_documents([data[cut:]], [path])


def _describe(paths: Sequence[PathArg] | None, n_files: int, max_bytes: int | None) -> str:
    cap = f", capped at {max_bytes / 2**20:g} MB" if max_bytes is not None else ""
    if paths is None:
        cap = f", capped at {(max_bytes or DEFAULT_MAX_BYTES) / 2**20:g} MB"
        where = f"Python {sys.version.split()[0]} standard library .py files under {stdlib_root()}"
        return f"{where} ({n_files} files{cap})"
    if isinstance(paths, str | os.PathLike):
        paths = [paths]
    shown = ", ".join(os.fspath(p) for p in list(paths)[:3])
    more = f" and {len(paths) - 3} more" if len(paths) > 3 else ""
    return f"{shown}{more} ({n_files} files{cap})"


def load_splits(
    paths: Sequence[PathArg] | None, val_fraction: float = 0.05, max_bytes: int | None = None
) -> tuple[TokenStream, TokenStream, dict[str, Any]]:
    """(train, validation, info) token streams of ``paths``; see ``resolve_sources``.

    Files are split by ``split_sources``; a single file is split by bytes (its last
    ``val_fraction`` is validation). ``info`` counts files and bytes (= tokens, EOD included).
    """
    _check_fraction(val_fraction)
    sources = resolve_sources(paths, max_bytes)
    source = _describe(paths, len(sources), max_bytes)
    if len(sources) == 1:
        train, val = _split_single(sources[0].path, val_fraction)
        how = f"one file: its last {val_fraction:.0%} of bytes is validation"
    else:
        train_src, val_src = split_sources(sources, val_fraction)
        train = TokenStream.from_files([s.path for s in train_src])
        val = TokenStream.from_files([s.path for s in val_src])
        how = "by file (sha1 of relative path)"
    if len(train) <= train.num_docs:
        raise DataError(f"the training data is empty: {source}; pass non-empty files")
    info = {
        "source": source,
        "split": how,
        "train_files": len(train.files),
        "val_files": len(val.files),
        "train_bytes": len(train),
        "val_bytes": len(val),
    }
    return train, val, info
