"""Token stores: a corpus tokenized once (``meshlm data prepare``) into memory-mapped token files, and
the streams ``meshlm train --data DIR`` samples windows from without reading the corpus into memory.

A store directory holds:
  ``index.json``     format, tokenizer (kind, fingerprint, vocab_size, eod_id), token dtype, how the
                     corpus was split, and per split: its token file, token and text-byte counts, the
                     file's CRC-32 and its documents ({path, tokens, bytes}; a record file's rows in
                     the split are one entry, with their number under "rows"); ``index_sha256`` covers
                     the rest of the index (an edited count or fingerprint is refused, as in checkpoints)
  ``train.tokens``, ``val.tokens``  each split's documents, each ended by the tokenizer's EOD, as raw
                     little-endian uint16 (when the vocabulary fits) or uint32: what the loader's
                     ``TokenStream`` would hold for the same corpus and tokenizer, in the same order
  ``tokenizer.json`` the tokenizer (Hugging Face ones), for ``--tokenizer DIR/tokenizer.json``
  ``.meshlm-token-store``  written first: a directory holding it but no index is an unfinished store

Opening a store checks the index and every token file's size and CRC-32 (read in chunks, not mapped:
resident memory stays flat; CRC-32, as zip and gzip use, catches damage at the speed of reading a
multi-GB corpus, where SHA-256 would take several seconds per GB); ``index.json`` is written last,
so an interrupted ``prepare`` leaves no loadable store; and ``.meshlm-token-store`` first, so that
such a directory is refused as an incomplete store, never read as text files.

This module must not import jax: it runs before the CLI has chosen the devices.
"""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from meshlm.data.records import Skipped
from meshlm.data.stream import TokenStream, splits_info
from meshlm.data.tokenizer import Tokenizer
from meshlm.errors import DataError

FORMAT = "meshlm-token-store-v1"
PAIR_FORMAT = "meshlm-pairs-1"  # a pair store's (``data.pair_store``): refused here, by name
INDEX = "index.json"
MARKER = ".meshlm-token-store"  # written first; hidden, so never read as text
TOKENIZER_JSON = "tokenizer.json"
SPLITS = ("train", "val")
CHUNK = 16 * 2**20  # bytes per read when checksumming: memory independent of the corpus size


def store_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits, else uint32 (little-endian on disk, whatever the machine)."""
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


def tokenizer_entry(tok: Tokenizer) -> dict[str, Any]:
    """What the index records of the tokenizer: enough to refuse a store made with another one."""
    return {
        "kind": tok.kind,
        "fingerprint": tok.fingerprint,
        "vocab_size": tok.vocab_size,
        "eod_id": tok.eod_id,
    }


def file_crc32(path: Path) -> str:
    """The CRC-32 of a file's bytes, as 8 hex digits."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def index_digest(index: dict) -> str:
    body = {k: v for k, v in index.items() if k != "index_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode("utf-8")).hexdigest()


def is_store(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a token store directory (it has an index.json)."""
    return Path(path).is_dir() and (Path(path) / INDEX).is_file()


def index_format(directory: str | os.PathLike) -> str | None:
    """The ``format`` of ``directory``/index.json (a token, chat or pair store), None without one. An
    index.json that is not UTF-8 JSON of an object is one line naming it (never a traceback)."""
    path = Path(directory) / INDEX
    if not path.is_file():
        return None
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        why = " ".join(str(e).split()) or type(e).__name__
        raise DataError(
            f"{path} is not readable JSON ({why}): the store is damaged; re-create it with "
            "`meshlm data prepare`"
        ) from None
    if not isinstance(index, dict):
        raise DataError(
            f"{path} holds {type(index).__name__} JSON, not a store's index (an object): the store is "
            "damaged; re-create it with `meshlm data prepare`"
        )
    return index.get("format") if isinstance(index.get("format"), str) else None


def looks_like_store(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a token store, complete or not: ``prepare`` writes ``MARKER`` before anything
    else, so a store it never sealed (killed, disk full) is never taken for a directory of text."""
    names = (INDEX, MARKER, *(f"{s}.tokens" for s in SPLITS))
    return Path(path).is_dir() and any((Path(path) / n).exists() for n in names)


def write_marker(directory: Path) -> None:
    """The first file of a new store (see ``looks_like_store``)."""
    (directory / MARKER).write_text(FORMAT + "\n", encoding="utf-8")


def write_index(directory: Path, index: dict) -> None:
    """Seal the store: the index with its digest, written atomically (last, after the token files)."""
    index = {**index, "index_sha256": index_digest(index)}
    tmp = directory / f".{INDEX}.tmp"
    tmp.write_text(json.dumps(index, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, directory / INDEX)


# --- reading ---------------------------------------------------------------------------------------


class StoredStream(TokenStream):
    """One split of a store, memory-mapped read-only: a batch reads only its windows' pages, so resident
    memory does not grow with the corpus. Counts come from the index, never from a scan."""

    def __init__(self, *, path: Path, split: dict, dtype: np.dtype, tokenizer: dict, row_len: int = 0):
        count = int(split["tokens"])
        mapped = np.memmap(path, dtype=dtype, mode="r", shape=(count,)) if count else np.zeros(0, dtype)
        self.tokens = mapped  # [count] token ids, never copied
        if "mask_file" in split:  # a chat store (``data.chat_store``): packed rows and their loss mask
            mask = path.parent / split["mask_file"]
            self.loss_mask = (
                np.memmap(mask, np.uint8, mode="r", shape=(count,)) if count else np.zeros(0, np.uint8)
            )
            self.row_len = row_len
        self.vocab_size, self.eod_id = int(tokenizer["vocab_size"]), int(tokenizer["eod_id"])
        self.files = tuple(Path(d["path"]) for d in split["documents"])
        self.text_bytes = int(split["bytes"])
        self._num_docs = sum(int(d.get("rows", 1)) for d in split["documents"])  # rows: a record file

    @property
    def num_docs(self) -> int:
        return self._num_docs


@dataclass(frozen=True, kw_only=True)
class TokenStore:
    """An opened, checked store: its index and directory."""

    directory: Path  # the store directory
    index: dict  # the parsed, verified index.json

    @property
    def tokenizer(self) -> dict:
        return self.index["tokenizer"]

    def stream(self, split: str) -> StoredStream:
        entry = self.index["splits"][split]
        dtype = np.dtype(self.index["dtype"])
        row_len = int(self.index.get("chat", {}).get("row_tokens", 0))
        return StoredStream(
            path=self.directory / entry["file"],
            split=entry,
            dtype=dtype,
            tokenizer=self.tokenizer,
            row_len=row_len,
        )

    def check_tokenizer(self, tok: Tokenizer) -> None:
        """A store is only meaningful with the tokenizer that made it."""
        have = self.tokenizer
        if have["fingerprint"] != tok.fingerprint:
            hint = (
                f"--tokenizer {self.directory / TOKENIZER_JSON}"
                if have["kind"] != "bytes"
                else "--tokenizer bytes"
            )
            raise DataError(
                f"token store {self.directory} was made with another tokenizer ({have['kind']}, "
                f"{have['vocab_size']} ids, fingerprint {have['fingerprint'][:12]}) than the model's "
                f"({tok.describe()}); train with {hint}, or re-run `meshlm data prepare` with the "
                "model's tokenizer"
            )

    def splits(self, tok: Tokenizer, vocab_size: int) -> tuple[StoredStream, StoredStream, dict[str, Any]]:
        """(train, validation, info) as ``load_splits`` returns them, for a model of ``vocab_size``
        ids, after the tokenizer check (the store's ids are below its tokenizer's vocabulary size)."""
        self.check_tokenizer(tok)
        if tok.vocab_size > vocab_size:
            raise DataError(
                f"token store {self.directory} holds ids up to {tok.vocab_size - 1} ({tok.describe()}), "
                f"but the model has vocab_size={vocab_size}; use a config whose vocab_size covers them"
            )
        train, val = self.stream("train"), self.stream("val")
        if len(train) <= train.num_docs:
            raise DataError(
                f"token store {self.directory} has no training tokens; prepare it from non-empty files"
            )
        source = f"token store {self.directory} ({self.index['source']})"
        info = splits_info(source, self.index["split"], train, val, tok)
        skipped = self.index.get("skipped_rows")  # rows `prepare` left out (record files)
        info["skipped"] = Skipped(skipped).describe(self.index["text_field"]) if skipped else ""
        return train, val, info


def _damaged(directory: Path, problem: str) -> DataError:
    return DataError(
        f"token store {directory} is damaged: {problem}; re-create it with `meshlm data prepare`"
    )


def _read_index(directory: Path) -> dict:
    path = directory / INDEX
    if not path.is_file() and looks_like_store(directory):
        raise DataError(
            f"{directory} is an incomplete token store (no {INDEX}: its `meshlm data prepare` was "
            "interrupted or failed); re-run `meshlm data prepare` into a new or empty --out"
        )
    if not path.is_file():
        raise DataError(
            f"{directory} is not a token store (no {INDEX}): pass a directory `meshlm data prepare` "
            "wrote, or re-run it if it was interrupted"
        )
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise _damaged(directory, f"{INDEX} is not readable JSON ({' '.join(str(e).split())})") from None
    if isinstance(index, dict) and index.get("format") == PAIR_FORMAT:
        raise DataError(
            f"{directory} is a pair store (`meshlm data prepare --pairs`): preference pairs, which only "
            "`train --objective dpo` trains on; for language-model or chat SFT training prepare text "
            "(`meshlm data prepare`) or conversations (`meshlm data prepare --chat`)"
        )
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        got = index.get("format") if isinstance(index, dict) else type(index).__name__
        raise _damaged(directory, f"{INDEX} has format {got!r}, not {FORMAT!r}")
    if index.get("index_sha256") != index_digest(index):
        raise _damaged(directory, f"{INDEX} does not match its own SHA-256 (edited or corrupted)")
    return index


def _check_split(directory: Path, name: str, entry: dict, itemsize: int) -> None:
    path = directory / entry["file"]
    if Path(entry["file"]).name != entry["file"] or not path.is_file():
        raise _damaged(directory, f"the {name} token file {entry['file']!r} is missing")
    size = path.stat().st_size
    if size != int(entry["tokens"]) * itemsize:
        raise _damaged(
            directory, f"{path.name} has {size} bytes, the index says {int(entry['tokens']) * itemsize}"
        )
    if file_crc32(path) != entry["crc32"]:
        raise _damaged(directory, f"{path.name} does not match its CRC-32 in {INDEX}")
    if "mask_file" in entry:  # a chat store's loss mask: one byte per token
        mask = directory / entry["mask_file"]
        if Path(entry["mask_file"]).name != entry["mask_file"] or not mask.is_file():
            raise _damaged(directory, f"the {name} loss-mask file {entry['mask_file']!r} is missing")
        if mask.stat().st_size != int(entry["tokens"]) or file_crc32(mask) != entry["mask_crc32"]:
            raise _damaged(directory, f"{mask.name} does not match its size or CRC-32 in {INDEX}")


def open_store(path: str | os.PathLike) -> TokenStore:
    """The store at ``path``, its index and token files checked; any damage is a one-line DataError."""
    directory = Path(path)
    index = _read_index(directory)
    try:
        itemsize = np.dtype(index["dtype"]).itemsize
        for name in SPLITS:
            _check_split(directory, name, index["splits"][name], itemsize)
        tok = index["tokenizer"]
        _present = (tok["kind"], tok["fingerprint"], int(tok["vocab_size"]), int(tok["eod_id"]))
        _present += (index["source"], index["split"])
    except (KeyError, TypeError, ValueError) as e:
        raise _damaged(directory, f"{INDEX} lacks or mangles a field ({type(e).__name__}: {e})") from None
    return TokenStore(directory=directory, index=index)


def store_arg(paths, tokenizer_spec: str = "") -> TokenStore | None:
    """``train --data``: a single token store directory opens it; anything else is raw text (None).
    ``tokenizer_spec``: train's --tokenizer; ``bpe-N`` trains on raw text, which a store is not."""
    paths = list(paths or ())
    if len(paths) == 1 and looks_like_store(paths[0]):
        if tokenizer_spec.startswith("bpe-"):
            raise DataError(
                f"--tokenizer {tokenizer_spec} trains a tokenizer on raw text, but --data {paths[0]} is a "
                f"token store, already tokenized; pass --tokenizer {Path(paths[0]) / TOKENIZER_JSON} or bytes"
            )
        return open_store(paths[0])
    stores = [p for p in paths if looks_like_store(p)]
    if stores:
        raise DataError(
            f"--data {stores[0]} is a token store: pass it alone (a store is the whole corpus, already split)"
        )
    return None
