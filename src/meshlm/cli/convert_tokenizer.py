"""The tokenizer every ``meshlm convert`` direction carries: read from a transformers directory, a peft
directory or a checkpoint with the files it comes with (``meshlm.data.tokenizer_files.COMPANIONS``: the
chat template, the special tokens, generation_config.json), recorded into a new checkpoint, or written
out verbatim for transformers and peft. The only place a conversion handles a tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

from meshlm.errors import ConfigError

EOS_KEY = "eos_token_ids"  # a converted checkpoint's meta: the model's own EOS ids (config.json's)
TOKENIZER_CONFIG = "tokenizer_config.json"


def directory_tokenizer(directory: str | Path):
    """A model (or peft) directory's tokenizer.json with its companions (its EOD from
    tokenizer_config.json), or None: the summary line then says that the model takes token ids only."""
    from meshlm.data.tokenizer_files import directory_tokenizer as load

    return load(directory, model=True) if (Path(directory) / "tokenizer.json").is_file() else None


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


def entry(out: str | Path, tok) -> dict:
    """The tokenizer entry of a new checkpoint at ``out``, its files written there (a collective)."""
    from meshlm.data.tokenizer_files import NONE_ENTRY
    from meshlm.train.tokenizers import tokenizer_meta

    return tokenizer_meta(out, tok) if tok is not None else dict(NONE_ENTRY)


def lora_input(path: str | Path, meta: dict, base: str | Path | None):
    """(tokenizer, EOS ids) for a checkpoint made from a LoRA checkpoint or a peft directory at
    ``path`` (``meta``: the LoRA checkpoint's, or None for a peft directory): its own where it has one,
    else its base checkpoint's (``base``)."""
    from meshlm.io.model_io import read_config
    from meshlm.train.tokenizers import checkpoint_tokenizer

    if meta is None:
        tok = directory_tokenizer(path)
    else:
        tok = checkpoint_tokenizer(path, required=False) if "tokenizer" in meta else None
    base_meta = read_config(base)[1] if base and Path(base).exists() else {}  # gone: load_model says
    if tok is None and base_meta:
        tok = checkpoint_tokenizer(base, required=False)
    return tok, (meta or {}).get(EOS_KEY) or base_meta.get(EOS_KEY)


def says(tok) -> str:
    if tok is None:
        return (
            "none (no tokenizer.json in the model directory): the model can only take token ids; "
            "generate and train need a tokenizer (train --tokenizer, or convert with tokenizer.json)"
        )
    if tok.kind == "bytes":
        return tok.describe()
    template = " (with its chat template)" if has_chat_template(tok.files) else ""
    return f"{tok.describe()}: {', '.join(['tokenizer.json', *sorted(tok.files)])}{template}"


def has_chat_template(files: dict) -> bool:
    if "chat_template.jinja" in files or "chat_template.json" in files:
        return True
    try:
        return bool(json.loads(files.get(TOKENIZER_CONFIG, "{}")).get("chat_template"))
    except (ValueError, AttributeError):
        return False


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
    """Write the tokenizer's ``export_files`` into ``out`` (process 0), and for a model (not ``peft``)
    the EOD (or the model's own EOS ids, ``eos``) as config.json's eos_token_id so that transformers'
    generate stops where meshlm's does."""
    import jax

    if jax.process_index() != 0:
        return
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
