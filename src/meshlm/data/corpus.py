"""Training data, loaded: the train and validation token streams of a corpus (bytes, or any tokenizer).

The pieces: the tokenizers (``meshlm.data.tokenizer``), file sources and the split by file
(``meshlm.data.sources``), token streams and stateless batches (``meshlm.data.stream``).

This module must not import jax: it runs before the CLI has chosen the devices.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from meshlm.data.records import (
    DEFAULT_FIELD,
    ROW_SPLIT,
    Skipped,
    documents,
    is_record_file,
    one_sided,
    row_is_val,
)
from meshlm.data.sources import (
    DEFAULT_MAX_BYTES,
    PathArg,
    check_fraction,
    resolve_sources,
    split_sources,
    stdlib_root,
)
from meshlm.data.stream import TokenStream, read_document, splits_info
from meshlm.data.tokenizer import ByteTokenizer, Tokenizer
from meshlm.errors import DataError
from meshlm.units import format_bytes


def _split_single(path: Path, val_fraction: float, tok: Tokenizer) -> tuple[TokenStream, TokenStream]:
    """One file: the first (1 - val_fraction) of its bytes train, the rest validate."""
    data = read_document(path)
    if len(data) < 2:
        raise DataError(f"data file {path} has {len(data)} bytes; one file needs >= 2 to split")
    val_len = min(len(data) - 1, max(1, round(len(data) * val_fraction)))
    cut = len(data) - val_len
    train = TokenStream.from_texts([data[:cut]], tok, [path])
    return train, TokenStream.from_texts([data[cut:]], tok, [path])


def _split_rows(path: Path, val_fraction: float, tok: Tokenizer, field: str, skipped: Skipped):
    """One record file: rows by ``row_is_val`` (a hash of each row's text)."""
    train, val = [], []
    for doc in documents(path, field, skipped):
        (val if row_is_val(doc, val_fraction) else train).append(doc)
    if not (train and val):
        raise one_sided(path, len(train), len(val), val_fraction)
    return TokenStream.from_texts(train, tok, [path]), TokenStream.from_texts(val, tok, [path])


def _from_files(paths: Sequence[Path], tok: Tokenizer, field: str, skipped: Skipped) -> TokenStream:
    """One document per text file, one per row of a record file, in order."""
    if not any(map(is_record_file, paths)):
        return TokenStream.from_files(paths, tok)
    return TokenStream.from_texts(_documents(paths, field, skipped), tok, paths)


def _documents(paths: Sequence[Path], field: str, skipped: Skipped | None = None) -> list[bytes]:
    docs = []
    for path in paths:
        docs += documents(path, field, skipped) if is_record_file(path) else [read_document(path)]
    return docs


def _describe(paths: Sequence[PathArg] | None, n_files: int, max_bytes: int | None) -> str:
    cap = f", capped at {format_bytes(max_bytes, 'MiB', None)}" if max_bytes is not None else ""
    if paths is None:
        cap = f", capped at {format_bytes(max_bytes or DEFAULT_MAX_BYTES, 'MiB', None)}"
        where = f"Python {sys.version.split()[0]} standard library .py files under {stdlib_root()}"
        return f"{where} ({n_files} files{cap})"
    if isinstance(paths, str | os.PathLike):
        paths = [paths]
    shown = ", ".join(os.fspath(p) for p in list(paths)[:3])
    more = f" and {len(paths) - 3} more" if len(paths) > 3 else ""
    return f"{shown}{more} ({n_files} files{cap})"


def load_splits(
    paths: Sequence[PathArg] | None,
    val_fraction: float = 0.05,
    max_bytes: int | None = None,
    tokenizer: Tokenizer | None = None,
    text_field: str = DEFAULT_FIELD,
) -> tuple[TokenStream, TokenStream, dict[str, Any]]:
    """(train, validation, info) token streams of ``paths`` through ``tokenizer`` (default: bytes);
    see ``resolve_sources``. Record files (``meshlm.data.records``) give one document per row, its
    ``text_field``.

    Files are split by ``split_sources``; a single text file is split by bytes (its last
    ``val_fraction`` is validation), a single record file by row (``row_is_val``). ``info`` counts
    files, bytes and tokens (EOD included), and under "skipped" the rows without a string text field.
    """
    check_fraction(val_fraction)
    tok = tokenizer or ByteTokenizer()
    sources = resolve_sources(paths, max_bytes)
    source = _describe(paths, len(sources), max_bytes)
    skipped = Skipped()
    if len(sources) == 1 and is_record_file(sources[0].path):
        train, val = _split_rows(sources[0].path, val_fraction, tok, text_field, skipped)
        how = ROW_SPLIT.format(val_fraction)
    elif len(sources) == 1:
        train, val = _split_single(sources[0].path, val_fraction, tok)
        how = f"one file: its last {val_fraction:.0%} of bytes is validation"
    else:
        train_src, val_src = split_sources(sources, val_fraction)
        train = _from_files([s.path for s in train_src], tok, text_field, skipped)
        val = _from_files([s.path for s in val_src], tok, text_field, skipped)
        how = "by file (sha1 of relative path)"
    if len(train) <= train.num_docs:
        raise DataError(f"the training data is empty: {source}; pass non-empty files")
    info = splits_info(source, how, train, val, tok)
    info["skipped"] = skipped.describe(text_field) if skipped else ""
    return train, val, info


def load_all(
    paths: Sequence[PathArg], tokenizer: Tokenizer, text_field: str = DEFAULT_FIELD
) -> tuple[TokenStream, str]:
    """(every document of ``paths``, in path order, as one stream; its description): an evaluation set,
    not split. Text files are one document each, record files one per row."""
    sources = resolve_sources(paths)
    skipped = Skipped()
    stream = _from_files([s.path for s in sources], tokenizer, text_field, skipped)
    note = f"; {skipped.describe(text_field)}" if skipped else ""
    return stream, _describe(paths, len(sources), None) + note


def corpus_documents(paths: Sequence[PathArg] | None, text_field: str = DEFAULT_FIELD) -> list[bytes]:
    """Every document of ``paths`` (default: the stdlib subset): a text file's bytes, a record file's rows."""
    return _documents([s.path for s in resolve_sources(paths)], text_field)
