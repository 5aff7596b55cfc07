"""``meshlm data prepare --pairs``: preference pairs tokenised once into a store for large sets.

The store is a directory: ``index.json`` (``FORMAT``, ``seq_len``, the rendering rule, the tokenizer's
entry, per split the pair count and the SHA-256 of its arrays, the pairs dropped), and per split
``{split}.tokens.npy`` (int32 [2N, seq_len + 1]) and ``{split}.mask.npy`` (uint8 [2N, seq_len]): the
rows of ``data.pairs`` exactly as ``train --objective dpo`` makes them from JSONL (same rule, same
split). ``train --objective dpo --data STORE`` memory-maps them; a store made with another tokenizer
or another ``--seq-len`` than the run's is one clear error. Plain ``.npy`` (never pickled objects).

This module must not import jax: it runs before the CLI has chosen the devices.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from meshlm.data.pairs import PairRows, Renderer, encode_pairs, read_pairs
from meshlm.data.store import PAIR_FORMAT, index_format, tokenizer_entry
from meshlm.errors import DataError
from meshlm.ranges import STORE_SEQ_LEN

FORMAT = PAIR_FORMAT
INDEX = "index.json"
SPLITS = ("train", "val")


def is_pair_store(path) -> bool:
    """Whether ``path`` is a pair store (a damaged index.json is one error naming it)."""
    return Path(path).is_dir() and index_format(path) == FORMAT


def _digest(rows: PairRows) -> str:
    return hashlib.sha256(
        np.ascontiguousarray(rows.tokens).tobytes() + np.ascontiguousarray(rows.mask).tobytes()
    ).hexdigest()


def prepare_pairs(paths, render: Renderer, out: Path, seq_len: int) -> dict:
    """Write the store into the (new or empty) directory ``out``; returns the index."""
    if problem := STORE_SEQ_LEN.problem("--seq-len", seq_len):  # library callers: the CLI checked it
        raise DataError(problem)
    train, val, dropped = encode_pairs(read_pairs(paths), render, seq_len, render.tok.eod_id)
    out.mkdir(parents=True, exist_ok=True)
    splits = {}
    for name, rows in zip(SPLITS, (train, val), strict=True):
        np.save(out / f"{name}.tokens.npy", rows.tokens)
        np.save(out / f"{name}.mask.npy", rows.mask)
        splits[name] = {"pairs": rows.pairs, "sha256": _digest(rows)}
    index = {
        "format": FORMAT,
        "source": ", ".join(map(str, paths)),
        "seq_len": seq_len,
        "rule": render.rule,
        "tokenizer": tokenizer_entry(render.tok),
        "dropped": dropped,
        "splits": splits,
    }
    (out / INDEX).write_text(json.dumps(index, indent=1) + "\n", encoding="utf-8")  # last: complete
    return index


def load_pair_store(path, tok, seq_len: int) -> tuple[PairRows, PairRows, dict]:
    """(train rows, validation rows, index) of the store at ``path``, memory-mapped and checked."""
    path = Path(path)
    index_format(path)  # UTF-8 JSON of an object, else one line naming it
    index = json.loads((path / INDEX).read_text(encoding="utf-8"))
    try:
        fingerprint, stored_len = index["tokenizer"]["fingerprint"], index["seq_len"]
        digests = {name: index["splits"][name]["sha256"] for name in SPLITS}
        _ = (index["dropped"], index["rule"])  # what train's data line reads
    except (KeyError, TypeError) as e:
        raise DataError(
            f"--data {path}: its {INDEX} lacks or mangles a field ({type(e).__name__}: {e}); prepare it again"
        ) from None
    if fingerprint != tok.fingerprint:
        raise DataError(
            f"--data {path} was prepared with another tokenizer than the run's ({tok.describe()}); "
            "prepare it with the run's --tokenizer (a --checkpoint's own)"
        )
    if stored_len != seq_len:
        raise DataError(f"--data {path} holds rows of --seq-len {stored_len}; train with that --seq-len")
    rows = []
    for name in SPLITS:
        try:
            split = PairRows(*(np.load(path / f"{name}.{k}.npy", mmap_mode="r") for k in ("tokens", "mask")))
        except (OSError, ValueError) as e:
            raise DataError(
                f"--data {path}: its {name} arrays cannot be read ({e}); prepare it again"
            ) from None
        if _digest(split) != digests[name]:
            raise DataError(f"--data {path}: its {name} arrays do not match index.json; prepare it again")
        rows.append(split)
    return rows[0], rows[1], index
