"""``meshlm data prepare``'s work: tokenize a corpus once, in parallel over files, into a token store
(``meshlm.data.store``).

The corpus is resolved and split exactly as the training loader does (``resolve_sources``,
``split_sources`` by file; one file: its last ``val_fraction`` of bytes validates), and each document
is tokenized exactly as ``TokenStream.from_files`` would, so a store trains on the same tokens, in
the same order, as ``--data`` on the raw files. A process pool tokenizes the documents; the parent
writes them in order as they arrive (a bounded window of them in flight: memory does not grow with
the corpus), checksumming each token file as it writes it, with a progress bar on stderr.

This module must not import jax: it runs before the CLI has chosen the devices.
"""

from __future__ import annotations

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

from meshlm.data.sources import DEFAULT_MAX_BYTES, PathArg, check_fraction, resolve_sources, split_sources
from meshlm.data.store import (
    FORMAT,
    INDEX,
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


class Doc(NamedTuple):
    """One document to tokenize: a file, or a byte range of the single file (after NULs are dropped)."""

    path: str  # the file
    start: int  # first byte
    end: int | None  # one past the last byte (None: to the end)
    size: int  # bytes, for the progress bar


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


def tokenize(doc: Doc, dtype: str) -> tuple[bytes, int, int, int]:
    """(the document's ids then EOD, as ``dtype`` bytes; their number; its text bytes, EOD counted 1;
    its invalid UTF-8 sequences, each a U+FFFD for a text tokenizer): what ``TokenStream.from_texts``
    makes of the same document."""
    tok = _TOKENIZER
    data = read_document(Path(doc.path))[doc.start : doc.end]
    invalid = 0
    if isinstance(tok, ByteTokenizer):
        ids, n_bytes = np.frombuffer(data, np.uint8), len(data) + 1
    else:
        text = data.decode("utf-8", errors="replace")
        ids, n_bytes = tok.encode(text), len(text.encode("utf-8", errors="replace")) + 1
        invalid = invalid_utf8(data, text)
    out = np.empty(len(ids) + 1, dtype)
    out[:-1], out[-1] = ids, tok.eod_id
    return out.tobytes(), len(out), n_bytes, invalid


# --- the parent ----------------------------------------------------------------------------------


def progress_bar(total_bytes: int, stream=None):
    """The progress bar on stderr: megabytes of text tokenized, rate, time left."""
    from tqdm import tqdm

    return tqdm(total=total_bytes, unit="B", unit_scale=True, desc="prepare", file=stream or sys.stderr)


def _in_order(pool, docs: Iterable[Doc], dtype: str, ahead: int) -> Iterator[tuple[bytes, int, int]]:
    """Results of ``tokenize`` in document order, with at most ``ahead`` documents in flight."""
    it, pending = iter(docs), deque()
    for doc in islice(it, ahead):
        pending.append(pool.submit(tokenize, doc, dtype))
    while pending:
        yield pending.popleft().result()
        for doc in islice(it, 1):
            pending.append(pool.submit(tokenize, doc, dtype))


def _write_split(path: Path, docs: Sequence[Doc], results, progress) -> dict[str, Any]:
    """Write one split's token file; its index entry."""
    crc, documents, tokens, n_bytes, invalid = 0, [], 0, 0, []
    with open(path, "wb") as f:
        for doc, (data, n_tokens, doc_bytes, doc_invalid) in zip(docs, results, strict=True):
            f.write(data)
            invalid += [doc_invalid] if doc_invalid else []
            crc = zlib.crc32(data, crc)
            documents.append({"path": doc.path, "tokens": n_tokens, "bytes": doc_bytes})
            tokens, n_bytes = tokens + n_tokens, n_bytes + doc_bytes
            progress.update(doc.size)
    return {
        "file": path.name,
        "tokens": tokens,
        "bytes": n_bytes,
        "crc32": f"{crc:08x}",
        "documents": documents,
        "invalid_utf8": invalid,  # for the note; not in the index
    }


def plan(paths: Sequence[PathArg] | None, val_fraction: float, max_bytes: int | None) -> tuple[dict, str]:
    """({"train": docs, "val": docs}, how the corpus was split): the loader's split, as documents."""
    check_fraction(val_fraction)
    sources = resolve_sources(paths, max_bytes)
    if len(sources) == 1:
        path = sources[0].path
        n = len(read_document(path))
        if n < 2:
            raise DataError(f"data file {path} has {n} bytes; one file needs >= 2 to split")
        cut = n - min(n - 1, max(1, round(n * val_fraction)))
        docs = {"train": [Doc(str(path), 0, cut, cut)], "val": [Doc(str(path), cut, None, n - cut)]}
        return docs, f"one file: its last {val_fraction:.0%} of bytes is validation"
    train, val = split_sources(sources, val_fraction)
    as_docs = lambda srcs: [Doc(str(s.path), 0, None, s.path.stat().st_size) for s in srcs]
    return {"train": as_docs(train), "val": as_docs(val)}, "by file (sha1 of relative path)"


def prepare(
    paths: Sequence[PathArg] | None,
    tokenizer: Tokenizer,
    out: str | Path,
    *,
    val_fraction: float = 0.05,
    max_bytes: int | None = None,
    workers: int = 0,
    progress_stream=None,
) -> dict[str, Any]:
    """Tokenize the corpus into the (new or empty) directory ``out``; returns the index written."""
    out = Path(out)
    docs, how = plan(paths, val_fraction, max_bytes)
    all_docs = docs["train"] + docs["val"]
    dtype = store_dtype(tokenizer.vocab_size)
    out.mkdir(parents=True, exist_ok=True)
    write_marker(out)  # first: until index.json seals it, this is an incomplete store, never text
    text = tokenizer.to_json()
    if text is not None:  # with its EOD named, so loading DIR/tokenizer.json gives the same tokenizer
        (out / TOKENIZER_JSON).write_text(text, encoding="utf-8")
        eos = json.dumps({"eos_token": tokenizer.eod_token})
        (out / "tokenizer_config.json").write_text(eos + "\n", encoding="utf-8")
    workers = max(1, min(workers or multiprocessing.cpu_count(), len(all_docs)))
    progress = progress_bar(sum(d.size for d in all_docs), progress_stream)
    init = (text, getattr(tokenizer, "eod_token", None), os.getpid())
    ctx = multiprocessing.get_context("spawn")  # no fork of a process that may hold threads
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_init, initargs=init)
    with pool, progress:
        splits = {
            name: _write_split(
                out / f"{name}.tokens",
                docs[name],
                _in_order(pool, docs[name], dtype.str, 4 * workers),
                progress,
            )
            for name in ("train", "val")
        }
    invalid = [n for split in splits.values() for n in split.pop("invalid_utf8")]
    if invalid:
        warnings.warn(
            f"{len(invalid)} of {len(all_docs)} documents are not valid UTF-8: {sum(invalid):,} invalid "
            f"byte sequences became U+FFFD for the {tokenizer.describe()} (re-encode them as UTF-8 to "
            "keep their text; the byte tokenizer keeps every byte)",
            stacklevel=2,
        )
    cap = max_bytes if max_bytes is not None or paths else DEFAULT_MAX_BYTES
    index = {
        "format": FORMAT,
        "tokenizer": tokenizer_entry(tokenizer),
        "dtype": dtype.str,
        "source": _describe(paths, len(all_docs), cap),
        "split": how,
        "val_fraction": val_fraction,
        "max_bytes": cap,
        "splits": splits,
    }
    write_index(out, index)
    return index


def _describe(paths, n_files: int, cap: int | None) -> str:
    where = "the Python standard library's .py files" if not paths else ", ".join(map(str, list(paths)[:3]))
    more = f" and {len(paths) - 3} more" if paths and len(paths) > 3 else ""
    capped = f", capped at {cap / 2**20:g} MB" if cap is not None else ""
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
