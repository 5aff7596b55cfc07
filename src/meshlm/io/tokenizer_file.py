"""The tokenizer a checkpoint carries: ``DIR/tokenizer.json`` in its run directory, or "bytes".

Every step's meta holds a ``tokenizer`` entry: ``{"kind": "bytes"}``, ``{"kind": "none"}`` (a model
converted without a tokenizer: it takes token ids only), or ``{"kind": "hf", "file": "tokenizer.json",
"sha256", "fingerprint", "vocab_size", "eod_token"}``. The meta is covered by the
integrity record's SHA-256 (``meshlm.io.integrity``), and the file by the ``sha256`` in the meta, so an
edited or damaged tokenizer.json is found before it can turn ids into the wrong text. One run directory
holds one tokenizer: a different one is refused rather than replacing it under older steps. Meta
without the entry (older checkpoints) means bytes.

The files a transformers tokenizer comes with (``COMPANIONS``: its tokenizer_config.json with the chat
template and special tokens, chat_template.jinja, special_tokens_map.json, and the model's
generation_config.json) are carried verbatim next to tokenizer.json, each recorded in the entry's
``files`` with its SHA-256: every conversion and every training run copies them through this module
(``read_companions``, ``save_tokenizer``, ``read_checked_companions``), so a chat model converted,
fine-tuned and exported keeps its template and special tokens.

This module handles text and JSON only: the tokenizer objects live in ``meshlm.data``.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import jax

from meshlm.errors import CheckpointError

TOKENIZER_FILE = "tokenizer.json"
BYTES_ENTRY = {"kind": "bytes"}
NONE_ENTRY = {"kind": "none"}
KINDS = ("bytes", "none", "hf")
# Carried verbatim with tokenizer.json (see the module docstring). generation_config.json is the model's
# (its EOS ids, sampling defaults): taken from a model directory, never from a --tokenizer directory.
COMPANIONS = (
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
MODEL_ONLY = ("generation_config.json",)


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def read_companions(directory: str | Path, model: bool = True) -> dict[str, str]:
    """name -> text of the ``COMPANIONS`` in ``directory`` (``model``: generation_config.json too)."""
    out = {}
    for name in COMPANIONS:
        path = Path(directory) / name
        if not path.is_file() or (name in MODEL_ONLY and not model):
            continue
        try:
            out[name] = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise CheckpointError(
                f"{path} cannot be read ({getattr(e, 'strerror', None) or e}): it goes with the "
                "tokenizer; restore it, or remove it to go without it"
            ) from e
        if name.endswith(".json"):
            _check_json_object(out[name], path)
    return out


def _check_json_object(text: str, path: Path) -> None:
    """A JSON companion is carried only if it is a JSON object: a conversion never copies a file that
    transformers (or meshlm, on the way back) cannot read."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise CheckpointError(
            f"{path} is not valid JSON ({str(e).splitlines()[0] if str(e) else type(e).__name__}); it "
            "goes with the tokenizer: restore it, or remove it to go without it"
        ) from None
    if not isinstance(value, dict):
        raise CheckpointError(
            f"{path} holds a JSON {type(value).__name__}, not an object; it goes with the tokenizer: "
            "restore it, or remove it to go without it"
        )


def save_tokenizer(directory: str | Path, entry: dict, text: str | None, files: dict | None = None) -> dict:
    """Write ``text`` as ``directory``/tokenizer.json and ``files`` (companions: name -> text) next to
    it (process 0, atomically) unless the same file is there; return the meta entry with its ``file``,
    ``sha256`` and the companions' ``files`` (name -> SHA-256). ``text`` None: the byte entry."""
    if text is None:
        return dict(BYTES_ENTRY)
    out = {**entry, "kind": "hf", "file": TOKENIZER_FILE, "sha256": _save(directory, TOKENIZER_FILE, text)}
    if files:
        out["files"] = {name: _save(directory, name, files[name]) for name in sorted(files)}
    return out


def _save(directory: str | Path, name: str, text: str) -> str:
    """``directory``/``name`` holding ``text`` (written unless the same is there); its SHA-256."""
    if name != TOKENIZER_FILE and name not in COMPANIONS:
        raise CheckpointError(f"{name!r} is not a tokenizer file ({TOKENIZER_FILE}, {', '.join(COMPANIONS)})")
    path = Path(directory) / name
    digest = sha256(text)
    if path.exists() and _digest_of(path) != digest:
        raise CheckpointError(
            f"{path} already holds a different tokenizer{'' if name == TOKENIZER_FILE else ' file'}; a run "
            "directory has one tokenizer: use a new --out, or the tokenizer it was made with"
        )
    if not path.exists() and jax.process_index() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{name}.tmp-{os.getpid()}")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    return digest


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
    return entry, _read_recorded(directory, path, entry.get("sha256"), "tokenizer")


def _read_recorded(directory, path: Path, digest, what: str) -> str:
    """The text of a checkpoint's tokenizer file, checked against the SHA-256 its meta records."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(
            f"checkpoint {directory} needs its {what} {path}, which cannot be read "
            f"({getattr(e, 'strerror', None) or e}); restore the file or re-create the checkpoint"
        ) from e
    if sha256(text) != digest:
        raise CheckpointError(
            f"{path} was modified or damaged after the checkpoint was saved (its SHA-256 differs from "
            "the one in the checkpoint's metadata); restore it or re-create the checkpoint"
        )
    return text


def read_checked_companions(directory: str | Path, entry: dict) -> dict[str, str]:
    """name -> text of the companions a checkpoint's tokenizer entry records, each checked against its
    SHA-256 (an entry saved before companions were carried has none)."""
    files = entry.get("files", {})
    if not isinstance(files, dict) or any(name not in COMPANIONS for name in files):
        raise CheckpointError(f"checkpoint meta has an unknown tokenizer files entry {files!r}; re-create it")
    return {
        name: _read_recorded(directory, Path(directory) / name, d, "tokenizer file")
        for name, d in files.items()
    }
