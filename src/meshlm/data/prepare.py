"""``meshlm data prepare``'s work: tokenize a corpus once, in parallel over files, into a token store
(``meshlm.data.store``).

The corpus is resolved and split exactly as the training loader does (``resolve_sources``,
``split_sources`` by file; one text file: its last ``val_fraction`` of bytes validates; one record
file: by row, ``row_is_val``), and each document is tokenized exactly as ``load_splits`` would, so a
store trains on the same tokens, in the same order, as ``--data`` on the raw files. The parent reads
record files a batch of rows at a time (``meshlm.data.records``); a process pool tokenizes the pieces
(a text file's document, or a batch of rows); the parent writes them in order as they arrive (a
bounded window of them in flight: memory does not grow with the corpus), checksumming each token file
as it writes it, with a progress bar on stderr.

This module must not import jax: it runs before the CLI has chosen the devices.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import sys
import threading
import time
import warnings
import zlib
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from itertools import islice
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from meshlm.data.records import (
    DEFAULT_FIELD,
    ROW_SPLIT,
    Skipped,
    check_file,
    is_record_file,
    one_sided,
    read_rows,
    row_is_val,
)
from meshlm.data.sources import DEFAULT_MAX_BYTES, PathArg, check_fraction, resolve_sources, split_sources
from meshlm.data.store import (
    FORMAT,
    INDEX,
    MARKER,
    SPLITS,
    TOKENIZER_JSON,
    looks_like_store,
    store_dtype,
    tokenizer_entry,
    write_index,
    write_marker,
)
from meshlm.data.stream import invalid_utf8, read_document
from meshlm.data.tokenizer import ByteTokenizer, Tokenizer
from meshlm.errors import DataError
from meshlm.units import format_bytes

TOKENIZER_CONFIG = "tokenizer_config.json"  # the tokenizer's EOD, for loading DIR/tokenizer.json


class Piece(NamedTuple):
    """One piece of work: a text file's document (a byte range, after NULs are dropped), or a batch of
    a record file's rows, for one split."""

    split: str  # "train" or "val"
    path: str  # the file
    start: int  # first byte (text files)
    end: int | None  # one past the last byte (None: to the end)
    size: int  # bytes of the file this piece accounts for, for the progress bar
    docs: tuple[bytes, ...] | None = None  # a record file's documents (None: read the text file)


# --- the workers ---------------------------------------------------------------------------------

_TOKENIZER: Tokenizer | None = None  # each worker's own tokenizer (set by _init)


def _init(tokenizer_json: str | None, eod_token: str | None, parent: int) -> None:
    global _TOKENIZER
    _die_with(parent)
    if tokenizer_json is None:
        _TOKENIZER = ByteTokenizer()
    else:
        from meshlm.data.hf_tokenizer import HFTokenizer

        _TOKENIZER = HFTokenizer.from_str(tokenizer_json, eod_token=eod_token)


def _die_with(parent: int) -> None:
    """End this worker soon after ``parent`` (the prepare) is gone, however it died: a SIGKILLed
    parent never tells its pool, whose workers then lived on for minutes."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.2)
        os._exit(1)

    threading.Thread(target=watch, name="meshlm-prepare-parent", daemon=True).start()


def _ids(tok: Tokenizer, data: bytes) -> tuple[np.ndarray, int, int]:
    """(ids of one document, its text bytes with EOD counted 1, its invalid UTF-8 sequences: each a
    U+FFFD for a text tokenizer), as ``TokenStream.from_texts``."""
    if isinstance(tok, ByteTokenizer):
        return np.frombuffer(data, np.uint8), len(data) + 1, 0
    text = data.decode("utf-8", errors="replace")
    return tok.encode(text), len(text.encode("utf-8", errors="replace")) + 1, invalid_utf8(data, text)


def tokenize(piece: Piece, dtype: str) -> tuple[bytes, int, int, int, list[int]]:
    """(the piece's documents' ids, each then EOD, as ``dtype`` bytes; their number; text bytes, each
    EOD counted 1; documents; the invalid UTF-8 sequences of each document that has some): what
    ``TokenStream.from_texts`` makes of the same documents."""
    tok = _TOKENIZER
    docs = piece.docs
    if docs is None:
        docs = [read_document(Path(piece.path))[piece.start : piece.end]]
    parts, n_bytes, invalid = [], 0, []
    for data in docs:
        ids, doc_bytes, doc_invalid = _ids(tok, data)
        out = np.empty(len(ids) + 1, dtype)
        out[:-1], out[-1] = ids, tok.eod_id
        parts.append(out.tobytes())
        n_bytes += doc_bytes
        invalid += [doc_invalid] if doc_invalid else []
    data = b"".join(parts)
    return data, len(data) // np.dtype(dtype).itemsize, n_bytes, len(docs), invalid


# --- the parent ----------------------------------------------------------------------------------


def progress_bar(total_bytes: int, stream=None):
    """The progress bar on stderr: megabytes of text tokenized, rate, time left."""
    from tqdm import tqdm

    return tqdm(total=total_bytes, unit="B", unit_scale=True, desc="prepare", file=stream or sys.stderr)


def _in_order(pool, pieces: Iterable[Piece], dtype: str, ahead: int) -> Iterator[tuple[Piece, tuple]]:
    """(piece, ``tokenize``'s result) in order, with at most ``ahead`` pieces in flight."""
    it, pending = iter(pieces), deque()
    for piece in islice(it, ahead):
        pending.append((piece, pool.submit(tokenize, piece, dtype)))
    while pending:
        piece, future = pending.popleft()
        yield piece, future.result()
        for nxt in islice(it, 1):
            pending.append((nxt, pool.submit(tokenize, nxt, dtype)))


def _write_splits(out: Path, results, progress) -> tuple[dict[str, dict[str, Any]], list[int]]:
    """Write both splits' token files from the pieces in order; (their index entries, the invalid UTF-8
    sequences of each document that has some). A text file's
    document is one entry; a record file's rows in a split are one entry with their number ("rows")."""
    files = {name: open(out / f"{name}.tokens", "wb") for name in SPLITS}  # noqa: SIM115 - closed below
    empty = lambda name: {"file": f"{name}.tokens", "tokens": 0, "bytes": 0, "crc": 0, "documents": []}
    invalid = []  # per document with invalid UTF-8: how many sequences became U+FFFD (for the note)
    splits = {name: empty(name) for name in SPLITS}
    try:
        for piece, (data, n_tokens, n_bytes, n_docs, piece_invalid) in results:
            files[piece.split].write(data)
            invalid += piece_invalid
            s = splits[piece.split]
            s["crc"] = zlib.crc32(data, s["crc"])
            s["tokens"], s["bytes"] = s["tokens"] + n_tokens, s["bytes"] + n_bytes
            docs = s["documents"]
            if piece.docs is None:
                docs.append({"path": piece.path, "tokens": n_tokens, "bytes": n_bytes})
            elif docs and docs[-1]["path"] == piece.path and "rows" in docs[-1]:
                for key, n in (("tokens", n_tokens), ("bytes", n_bytes), ("rows", n_docs)):
                    docs[-1][key] += n
            else:
                docs.append({"path": piece.path, "tokens": n_tokens, "bytes": n_bytes, "rows": n_docs})
            progress.update(piece.size)
    finally:
        for f in files.values():
            f.close()
    for s in splits.values():
        s["crc32"] = f"{s.pop('crc'):08x}"
    return splits, invalid


class Plan(NamedTuple):
    """What ``prepare`` reads, in order: (split, path, start, end, size) per text-file document or
    record file; split None: one record file, split by row (``row_is_val``)."""

    units: list[tuple[str | None, str, int, int | None, int]]
    how: str  # how the corpus was split, for the index
    files: int  # source files


def plan(
    paths: Sequence[PathArg] | None,
    val_fraction: float,
    max_bytes: int | None,
    text_field: str = DEFAULT_FIELD,
) -> Plan:
    """The loader's split, as units of work; every record file's field is checked (fails before work)."""
    check_fraction(val_fraction)
    sources = resolve_sources(paths, max_bytes)
    for src in sources:
        if is_record_file(src.path):
            check_file(src.path, text_field)
    if len(sources) == 1:
        path = sources[0].path
        if is_record_file(path):
            return Plan([(None, str(path), 0, None, path.stat().st_size)], ROW_SPLIT.format(val_fraction), 1)
        n = len(read_document(path))
        if n < 2:
            raise DataError(f"data file {path} has {n} bytes; one file needs >= 2 to split")
        cut = n - min(n - 1, max(1, round(n * val_fraction)))
        units = [("train", str(path), 0, cut, cut), ("val", str(path), cut, None, n - cut)]
        return Plan(units, f"one file: its last {val_fraction:.0%} of bytes is validation", 1)
    train, val = split_sources(sources, val_fraction)
    parts = (("train", train), ("val", val))
    units = [(name, str(s.path), 0, None, s.path.stat().st_size) for name, part in parts for s in part]
    return Plan(units, "by file (sha1 of relative path)", len(sources))


def pieces(p: Plan, text_field: str, val_fraction: float, skipped: Skipped) -> Iterator[Piece]:
    """The plan's pieces of work in order; record files are read here, a batch of rows at a time."""
    for split, path, start, end, size in p.units:
        if not is_record_file(path):
            yield Piece(split, path, start, end, size)
            continue
        done = 0
        for docs, position in read_rows(Path(path), text_field, skipped):
            step, done = position - done, position
            if split is not None:
                yield Piece(split, path, 0, None, step, tuple(docs))
                continue
            sides = {True: [], False: []}
            for d in docs:
                sides[row_is_val(d, val_fraction)].append(d)
            yield Piece("train", path, 0, None, step, tuple(sides[False]))
            yield Piece("val", path, 0, None, 0, tuple(sides[True]))


def prepare(
    paths: Sequence[PathArg] | None,
    tokenizer: Tokenizer,
    out: str | Path,
    *,
    val_fraction: float = 0.05,
    max_bytes: int | None = None,
    workers: int = 0,
    text_field: str = DEFAULT_FIELD,
    progress_stream=None,
) -> dict[str, Any]:
    """Tokenize the corpus into the (new or empty) directory ``out``; returns the index written. A
    refusal or failure (an empty record file, a truncated .gz, a full disk) removes what it wrote,
    ``out`` too if it made it: nothing is left to block the rerun. Ctrl-C or a kill leaves the unfinished
    store, which its marker says is one (``meshlm.data.store``)."""
    out = Path(out)
    existed = out.exists()
    before = set(os.listdir(out)) if out.is_dir() else set()
    try:
        return _prepare(paths, tokenizer, out, val_fraction, max_bytes, workers, text_field, progress_stream)
    except Exception:
        _remove_written(out, before, existed)
        raise


def _remove_written(out: Path, before: set[str], existed: bool) -> None:
    """Remove the entries ``prepare`` writes that were not in ``out`` before (never anything else)."""
    ours = {MARKER, TOKENIZER_JSON, TOKENIZER_CONFIG, INDEX, f".{INDEX}.tmp"}
    ours |= {f"{name}.tokens" for name in SPLITS}
    for name in ours - before:
        with contextlib.suppress(FileNotFoundError):
            (out / name).unlink()
    if not existed:
        with contextlib.suppress(OSError):  # not empty (a run lock, others' files): left
            out.rmdir()


def _prepare(paths, tokenizer, out: Path, val_fraction, max_bytes, workers, text_field, progress_stream):
    work = plan(paths, val_fraction, max_bytes, text_field)
    dtype = store_dtype(tokenizer.vocab_size)
    out.mkdir(parents=True, exist_ok=True)
    write_marker(out)  # first: until index.json seals it, this is an incomplete store, never text
    text = tokenizer.to_json()
    if text is not None:  # with its EOD named, so loading DIR/tokenizer.json gives the same tokenizer
        (out / TOKENIZER_JSON).write_text(text, encoding="utf-8")
        eos = json.dumps({"eos_token": tokenizer.eod_token})
        (out / TOKENIZER_CONFIG).write_text(eos + "\n", encoding="utf-8")
    workers = workers or multiprocessing.cpu_count()
    if not any(is_record_file(u[1]) for u in work.units):  # one piece per text file: no more workers
        workers = max(1, min(workers, len(work.units)))
    progress = progress_bar(sum(u[-1] for u in work.units), progress_stream)
    init = (text, getattr(tokenizer, "eod_token", None), os.getpid())
    ctx = multiprocessing.get_context("spawn")  # no fork of a process that may hold threads
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_init, initargs=init)
    skipped = Skipped()
    with pool, progress:
        work_pieces = pieces(work, text_field, val_fraction, skipped)
        splits, invalid = _write_splits(out, _in_order(pool, work_pieces, dtype.str, 4 * workers), progress)
    if work.units[0][0] is None:  # one record file, split by row: both sides need rows
        rows = [sum(d.get("rows", 1) for d in splits[name]["documents"]) for name in SPLITS]
        if not all(rows):
            raise one_sided(Path(work.units[0][1]), *rows, val_fraction)
    if invalid:
        documents = sum(d.get("rows", 1) for s in splits.values() for d in s["documents"])
        warnings.warn(
            f"{len(invalid)} of {documents} documents are not valid UTF-8: {sum(invalid):,} invalid "
            f"byte sequences became U+FFFD for the {tokenizer.describe()} (re-encode them as UTF-8 to "
            "keep their text; the byte tokenizer keeps every byte)",
            stacklevel=2,
        )
    cap = max_bytes if max_bytes is not None or paths else DEFAULT_MAX_BYTES
    index = {
        "format": FORMAT,
        "tokenizer": tokenizer_entry(tokenizer),
        "dtype": dtype.str,
        "source": _describe(paths, work.files, cap),
        "split": work.how,
        "val_fraction": val_fraction,
        "max_bytes": cap,
        "text_field": text_field,
        "skipped_rows": dict(sorted(skipped.items())),
        "splits": splits,
    }
    write_index(out, index)
    return index


def _describe(paths, n_files: int, cap: int | None) -> str:
    where = "the Python standard library's .py files" if not paths else ", ".join(map(str, list(paths)[:3]))
    more = f" and {len(paths) - 3} more" if paths and len(paths) > 3 else ""
    capped = f", capped at {format_bytes(cap, 'MiB', None)}" if cap is not None else ""
    return f"{where}{more} ({n_files} files{capped})"


def check_out(out: str | Path, ignore: tuple[str, ...] = ()) -> None:
    """Never mix a store into existing files (entries named in ``ignore`` aside: the run lock)."""
    path = Path(out)
    if looks_like_store(path) and not (path / INDEX).exists():
        raise DataError(
            f"--out {out} holds an interrupted `meshlm data prepare` (no {INDEX}); remove it and rerun"
        )
    if path.exists() and (not path.is_dir() or any(p.name not in ignore for p in path.iterdir())):
        raise DataError(f"--out {out} exists and is not an empty directory; choose a new path or remove it")
