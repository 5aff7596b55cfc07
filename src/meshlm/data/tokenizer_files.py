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

``directory_tokenizer`` loads a tokenizer.json (or a directory holding one) with the companions next
to it, each JSON companion checked to be a JSON object; ``tokenizer_from_meta`` a checkpoint's, each
file checked against the SHA-256 its meta records. Every reader (``data prepare``, ``train``,
``generate``, ``convert``) takes a tokenizer and its chat template through these two.

This module must not import jax: it runs before the CLI has chosen the devices (the caller says which
process writes).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from meshlm.data.hf_tokenizer import HFTokenizer, json_object
from meshlm.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
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
            json_object(out[name], path)  # a file transformers (or meshlm) could not read is refused
    return out


def save_tokenizer(directory: str | Path, tok: Tokenizer, write: bool = True) -> dict:
    """Write ``tok``'s tokenizer.json and the files it comes with (companions: name -> text) into
    ``directory`` (atomically, where ``write``: process 0 of a job) unless the same file is there;
    return the checkpoint meta entry with its ``file``, ``sha256`` and the companions' ``files`` (name
    -> SHA-256). The byte tokenizer: the byte entry."""
    text = tok.to_json()
    if text is None:
        return dict(BYTES_ENTRY)
    entry = {"fingerprint": tok.fingerprint, "vocab_size": tok.vocab_size}
    if isinstance(tok, HFTokenizer):
        entry["eod_token"] = tok.eod_token
    save = lambda name, text: _save(directory, name, text, write)  # noqa: E731
    out = {**entry, "kind": "hf", "file": TOKENIZER_FILE, "sha256": save(TOKENIZER_FILE, text)}
    if tok.files:
        out["files"] = {name: save(name, tok.files[name]) for name in sorted(tok.files)}
    return out


def _save(directory: str | Path, name: str, text: str, write: bool) -> str:
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
    if not path.exists() and write:
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


def tokenizer_from_meta(directory: str | Path, meta: dict, where: str) -> Tokenizer | None:
    """The tokenizer a checkpoint's ``meta`` records in run directory ``directory``, its tokenizer.json
    and companions checked against their SHA-256; None for a model converted without one (it takes
    ids only)."""
    entry, text = read_tokenizer_text(directory, meta)
    if text is None:
        return ByteTokenizer() if entry["kind"] == "bytes" else None
    source = f"the tokenizer of checkpoint {where}"
    tok = HFTokenizer.from_str(text, eod_token=entry.get("eod_token"), source=source)
    tok.files = read_checked_companions(directory, entry)
    return tok


def directory_tokenizer(spec: str | Path | None, model: bool = False) -> Tokenizer:
    """``load_tokenizer(spec)`` ("bytes", a tokenizer.json or a directory holding one) with the files
    next to its tokenizer.json (``COMPANIONS``, each JSON one checked; ``model``: the model's
    generation_config.json too, for a model directory's own tokenizer)."""
    tok = load_tokenizer(spec)
    if isinstance(tok, HFTokenizer):
        path = Path(spec)
        tok.files = read_companions(path if path.is_dir() else path.parent, model=model)
    return tok


def is_checkpoint(spec: str | Path | None) -> bool:
    """Whether ``spec`` names a meshlm checkpoint (a run directory with step directories, or one step's
    directory): its tokenizer is then read from its meta, each file checked against the SHA-256 recorded
    there (``train.tokenizers.tokenizer_at``), never as a plain tokenizer directory. Without JAX: by
    the step directories' names and their ``meta`` item."""
    if spec is None:
        return False
    path = Path(spec)
    steps = [path] if path.name.isdigit() else sorted(path.iterdir()) if path.is_dir() else []
    return any(step.name.isdigit() and (step / "meta").is_dir() for step in steps)
