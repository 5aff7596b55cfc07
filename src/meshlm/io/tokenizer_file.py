"""The tokenizer a checkpoint carries: ``DIR/tokenizer.json`` in its run directory, or "bytes".

Every step's meta holds a ``tokenizer`` entry: ``{"kind": "bytes"}``, ``{"kind": "none"}`` (a model
converted without a tokenizer: it takes token ids only), or ``{"kind": "hf", "file": "tokenizer.json",
"sha256", "fingerprint", "vocab_size", "eod_token"}``. The meta is covered by the
integrity record's SHA-256 (``meshlm.io.integrity``), and the file by the ``sha256`` in the meta, so an
edited or damaged tokenizer.json is found before it can turn ids into the wrong text. One run directory
holds one tokenizer: a different one is refused rather than replacing it under older steps. Meta
without the entry (older checkpoints) means bytes.

This module handles text and JSON only: the tokenizer objects live in ``meshlm.data``.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import jax

from meshlm.errors import CheckpointError

TOKENIZER_FILE = "tokenizer.json"
BYTES_ENTRY = {"kind": "bytes"}
NONE_ENTRY = {"kind": "none"}
KINDS = ("bytes", "none", "hf")


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def save_tokenizer(directory: str | Path, entry: dict, text: str | None) -> dict:
    """Write ``text`` as ``directory``/tokenizer.json (process 0, atomically) unless the same file is
    there; return the meta entry with its ``file`` and ``sha256``. ``text`` None: the byte entry."""
    if text is None:
        return dict(BYTES_ENTRY)
    path = Path(directory) / TOKENIZER_FILE
    digest = sha256(text)
    if path.exists() and _digest_of(path) != digest:
        raise CheckpointError(
            f"{path} already holds a different tokenizer; a run directory has one tokenizer: "
            "use a new --out, or the tokenizer it was made with"
        )
    if not path.exists() and jax.process_index() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{TOKENIZER_FILE}.tmp-{os.getpid()}")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    return {**entry, "kind": "hf", "file": TOKENIZER_FILE, "sha256": digest}


def _digest_of(path: Path) -> str | None:
    try:
        return sha256(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError):
        return None


def tokenizer_entry(meta: dict) -> dict:
    """The meta's tokenizer entry (bytes for checkpoints saved before tokenizers were recorded)."""
    entry = meta.get("tokenizer", BYTES_ENTRY)
    if not isinstance(entry, dict) or entry.get("kind") not in KINDS:
        raise CheckpointError(f"checkpoint meta has an unknown tokenizer entry {entry!r}; re-create it")
    return entry


def read_tokenizer_text(directory: str | Path, meta: dict) -> tuple[dict, str | None]:
    """(entry, tokenizer.json text, or None for bytes and none) of a checkpoint in run directory
    ``directory``, the text checked against the SHA-256 in its meta."""
    entry = tokenizer_entry(meta)
    if entry["kind"] != "hf":
        return entry, None
    path = Path(directory) / str(entry.get("file", TOKENIZER_FILE))
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(
            f"checkpoint {directory} needs its tokenizer {path}, which cannot be read "
            f"({getattr(e, 'strerror', None) or e}); restore the file or re-create the checkpoint"
        ) from e
    if sha256(text) != entry.get("sha256"):
        raise CheckpointError(
            f"{path} was modified or damaged after the checkpoint was saved (its SHA-256 differs from "
            "the one in the checkpoint's metadata); restore it or re-create the checkpoint"
        )
    return entry, text
