"""A tokenizer with the files it comes with: found, read, checked and carried, in one module.

Finding: ``load_tokenizer`` turns a spec ("bytes", a tokenizer.json, or a directory holding one) into a
tokenizer, its end-of-document token from the tokenizer_config.json beside it; ``directory_tokenizer``
adds the companions next to it, ``model_tokenizer`` a model directory's (generation_config.json too),
``tokenizer_from_meta`` a checkpoint's. ``train.tokenizers.tokenizer_at`` picks between a checkpoint's
(``checkpoint_of``) and a directory's for every --tokenizer.

The files a transformers tokenizer comes with (``COMPANIONS``: its tokenizer_config.json with the chat
template and special tokens, chat_template.jinja, special_tokens_map.json, and the model's
generation_config.json) are carried verbatim next to tokenizer.json, each recorded in the checkpoint
entry's ``files`` with its SHA-256: every conversion and every training run copies them through this
module (``read_companions``, ``save_tokenizer``, ``read_checked_companions``), so a chat model
converted, fine-tuned and exported keeps its template and special tokens. Checking: a JSON companion
that is not UTF-8 JSON of an object is one line naming it (``json_object``), wherever it is read; a
checkpoint's files are read only against the SHA-256 its meta records. The chat template of a
tokenizer (``chat_template_of``), the model's stop ids (``hf_eos_ids``, ``stop_ids``) and the files
of an export (``export_files``, ``write_export``) are read from the same carried files.

Every step's meta holds a ``tokenizer`` entry: ``{"kind": "bytes"}``, ``{"kind": "none"}`` (a model
converted without a tokenizer: it takes token ids only), or ``{"kind": "hf", "file": "tokenizer.json",
"sha256", "fingerprint", "vocab_size", "eod_token"}``. The meta is covered by the
integrity record's SHA-256 (``meshlm.io.integrity``), and the file by the ``sha256`` in the meta, so an
edited or damaged tokenizer.json is found before it can turn ids into the wrong text. One run directory
holds one tokenizer: a different one is refused rather than replacing it under older steps. Meta
without the entry (older checkpoints) means bytes.

This module must not import jax: it runs before the CLI has chosen the devices (the caller says which
process writes).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from meshlm.data.hf_tokenizer import HFTokenizer
from meshlm.data.tokenizer import BYTES, ByteTokenizer, Tokenizer
from meshlm.errors import CheckpointError, ConfigError, DataError

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
TOKENIZER_CONFIG = "tokenizer_config.json"
EOS_KEY = "eos_token_ids"  # a converted checkpoint's meta: the model's own EOS ids (config.json's)


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


def checkpoint_of(spec: str | Path | None) -> Path | None:
    """The meshlm checkpoint ``spec`` names, or None: a run directory with step directories, one step's
    directory, or the tokenizer.json in a run directory (the file a checkpoint carries). Its tokenizer
    is then read from its meta, each file checked against the SHA-256 recorded there
    (``train.tokenizers.tokenizer_at``), never as a plain tokenizer directory. Without JAX: by the step
    directories' names and their ``meta`` item."""
    if spec is None or str(spec) == BYTES:
        return None
    path = Path(spec)
    if path.name == TOKENIZER_FILE and path.is_file():
        path = path.parent
    steps = [path] if path.name.isdigit() else sorted(path.iterdir()) if path.is_dir() else []
    return path if any(step.name.isdigit() and (step / "meta").is_dir() for step in steps) else None


# ---------------------------------------------------------------- finding: specs, directories, configs


def load_tokenizer(spec: str | os.PathLike | Tokenizer | None) -> Tokenizer:
    """ "bytes" (or None) -> the byte tokenizer; a tokenizer.json or a directory holding one -> the
    Hugging Face tokenizer. A file that does not load is a one-line ``DataError``."""
    if isinstance(spec, Tokenizer):
        return spec
    if spec is None or str(spec) == BYTES:
        return ByteTokenizer()
    path = Path(spec)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise DataError(
            f"tokenizer {spec}: no such file; pass a tokenizer.json, a directory holding one, or "
            f"'{BYTES}' (make one with `meshlm tokenizer train`)"
        )
    return HFTokenizer.from_file(path, eod_token=_eos_from_config(path))


def _first_line(err: Exception) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def json_object(text: str, path) -> dict:
    """A tokenizer's JSON companion (tokenizer_config.json, generation_config.json, ...) as a dict:
    JSON of anything else is one line naming the file (a tokenizer must not run on half its config)."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise DataError(
            f"{path} is not valid JSON ({_first_line(e)}); it goes with the tokenizer: restore it, or "
            "remove it to go without it"
        ) from None
    if not isinstance(value, dict):
        raise DataError(
            f"{path} holds a JSON {type(value).__name__}, not an object; it goes with the tokenizer: "
            "restore it, or remove it to go without it"
        )
    return value


def read_json_object(path: Path) -> dict:
    """``json_object`` of the file at ``path``, which must be UTF-8 (one line naming it otherwise)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(
            f"{path} cannot be read ({getattr(e, 'strerror', None) or _first_line(e)}); it goes with the "
            "tokenizer: restore it, or remove it to go without it"
        ) from None
    return json_object(text, path)


def _eos_from_config(path: Path) -> str | None:
    """``eos_token`` of the tokenizer_config.json next to ``path``, if there is one (a damaged one is
    an error: its EOD is never silently replaced by a guess)."""
    config = path.parent / "tokenizer_config.json"
    if not config.is_file():
        return None
    eos = read_json_object(config).get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    return eos if isinstance(eos, str) else None


def model_tokenizer(directory: str | Path) -> Tokenizer | None:
    """A model (or peft) directory's tokenizer.json with its companions, generation_config.json
    included, or None: the model then takes token ids only (``says``)."""
    found = (Path(directory) / TOKENIZER_FILE).is_file()
    return directory_tokenizer(directory, model=True) if found else None


def chat_template_of(files) -> str | None:
    """The chat template among a tokenizer's companions: chat_template.jinja, else chat_template.json's
    ``chat_template``, else tokenizer_config.json's (a string, or named templates: "default")."""
    if "chat_template.jinja" in files:
        return files["chat_template.jinja"]
    for name in ("chat_template.json", TOKENIZER_CONFIG):
        template = json_object(files[name], name).get("chat_template") if name in files else None
        if isinstance(template, list):  # named templates, as transformers saves several
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if isinstance(template, str) and template:
            return template
    return None


def tokenizer_config(tok) -> dict:
    """The tokenizer_config.json ``tok`` comes with, as a dict ({} without one)."""
    return json_object(tok.files[TOKENIZER_CONFIG], TOKENIZER_CONFIG) if TOKENIZER_CONFIG in tok.files else {}


# ---------------------------------------------------------------- a model's stop ids, exports


def hf_eos_ids(directory: Path) -> list[int]:
    """The ids ``generate(do_sample=False)`` stops at: generation_config.json's eos_token_id, else
    config.json's; an int or a list (Llama 3 Instruct: three). [] where neither names one. A
    generation_config.json that cannot be read is an error naming it (it is carried with the model)."""
    for name in ("generation_config.json", "config.json"):
        path = directory / name
        if not path.is_file():
            continue
        if name == "config.json":  # its own errors are reported by load_hf
            try:
                text = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
        else:
            text = _readable(path)
        if ids := _eos_ids(text, path, strict=name != "config.json"):
            return ids
    return []


def _readable(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(
            f"{path} cannot be read ({getattr(e, 'strerror', None) or e}); restore it, or remove it to "
            "go without it"
        ) from None


def _eos_ids(text: str, where, strict: bool = False) -> list[int]:
    """The eos_token_id of a config's ``text``; ``strict``: JSON that is not an object is an error."""
    try:
        config = json.loads(text)
    except (ValueError, RecursionError) as e:
        config = e
    if not isinstance(config, dict):
        if not strict:
            return []
        found = f"not valid JSON ({config})" if isinstance(config, Exception) else "not a JSON object"
        raise ConfigError(f"{where} is {found}; restore it, or remove it to go without it")
    eos = config.get("eos_token_id")
    ids = [eos] if isinstance(eos, int) and not isinstance(eos, bool) else eos
    if eos is None:
        return []
    if not isinstance(ids, list) or not all(type(i) is int and i >= 0 for i in ids):
        raise ConfigError(f"{where}: eos_token_id={eos!r} must be a token id or a list of ids; correct it")
    return ids  # an id >= the vocabulary (GPT-J's default 50256 on a small model) is never produced


def stop_ids(meta: dict, tok) -> list[int]:
    """The model's own EOS ids: a conversion's record in ``meta``, else those of the
    generation_config.json its tokenizer carries (a run trained from a converted checkpoint)."""
    if meta.get(EOS_KEY):
        return list(meta[EOS_KEY])
    text = tok.files.get("generation_config.json") if tok is not None else None
    return _eos_ids(text, "the checkpoint's generation_config.json") if text else []


def says(tok) -> str:
    if tok is None:
        return (
            "none (no tokenizer.json in the model directory): the model can only take token ids; "
            "generate and train need a tokenizer (train --tokenizer, or convert with tokenizer.json)"
        )
    if tok.kind == "bytes":
        return tok.describe()
    template = " (with its chat template)" if chat_template_of(tok.files) is not None else ""
    return f"{tok.describe()}: {', '.join(['tokenizer.json', *sorted(tok.files)])}{template}"


def export_files(tok, cfg) -> dict[str, str]:
    """The tokenizer's files for a transformers or peft directory: its own, verbatim, and a
    tokenizer_config.json naming its EOD where it came without one (``AutoTokenizer`` loads them)."""
    files = {"tokenizer.json": tok.to_json(), **tok.files}
    if TOKENIZER_CONFIG not in files:
        minimal = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": tok.eod_token,
            "model_max_length": cfg.max_seq_len,
            "clean_up_tokenization_spaces": False,
        }
        files[TOKENIZER_CONFIG] = json.dumps(minimal, indent=2) + "\n"
    return files


def write_export(out: Path, tok, cfg, eos: list[int] | None = None, peft: bool = False) -> None:
    """Write the tokenizer's ``export_files`` into ``out`` (the caller: process 0 of a job), and for a
    model (not ``peft``) the EOD (or the model's own EOS ids, ``eos``) as config.json's eos_token_id so
    that transformers' generate stops where meshlm's does."""
    if eos and not peft:
        _set_eos(out, eos if len(eos) > 1 else eos[0])
    if tok is None or tok.kind == "bytes":
        return  # bytes: transformers has no byte tokenizer to name; ids are the UTF-8 bytes
    for name, text in export_files(tok, cfg).items():
        (out / name).write_text(text, encoding="utf-8")
    if not eos and not peft:
        _set_eos(out, tok.eod_id)


def _set_eos(out: Path, eos: int | list[int]) -> None:
    config = json.loads((out / "config.json").read_text())
    config["eos_token_id"] = eos
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
