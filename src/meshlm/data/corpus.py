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
) -> tuple[TokenStream, TokenStream, dict[str, Any]]:
    """(train, validation, info) token streams of ``paths`` through ``tokenizer`` (default: bytes);
    see ``resolve_sources``.

    Files are split by ``split_sources``; a single file is split by bytes (its last
    ``val_fraction`` is validation). ``info`` counts files, bytes and tokens (EOD included).
    """
    check_fraction(val_fraction)
    tok = tokenizer or ByteTokenizer()
    sources = resolve_sources(paths, max_bytes)
    source = _describe(paths, len(sources), max_bytes)
    if len(sources) == 1:
        train, val = _split_single(sources[0].path, val_fraction, tok)
        how = f"one file: its last {val_fraction:.0%} of bytes is validation"
    else:
        train_src, val_src = split_sources(sources, val_fraction)
        train = TokenStream.from_files([s.path for s in train_src], tok)
        val = TokenStream.from_files([s.path for s in val_src], tok)
        how = "by file (sha1 of relative path)"
    if len(train) <= train.num_docs:
        raise DataError(f"the training data is empty: {source}; pass non-empty files")
    return train, val, splits_info(source, how, train, val, tok)
