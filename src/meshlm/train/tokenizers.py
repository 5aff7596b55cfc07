"""Which tokenizer a run, or a checkpoint, uses: recorded with every checkpoint, found without being told.

A checkpoint carries its tokenizer (``meshlm.data.tokenizer_files``): ``checkpoint_tokenizer`` loads it
for ``generate``, ``verify`` and ``convert``. ``run_tokenizer`` picks a training run's: the one its run
directory or ``--checkpoint`` already has, else ``--tokenizer`` (a tokenizer.json, a directory holding
one, "bytes", or ``bpe-N``: a byte-level BPE of N ids trained on the run's training split and saved into
the run directory), else ``bpe-1024`` when training on the embedded stdlib corpus (the main job's
default), else bytes. From scratch the tokenizer sets the model's ``vocab_size``.

The file work (finding, reading, checking and carrying a tokenizer with its companions) is
``data.tokenizer_files``'; this module adds what needs a checkpoint's metadata or the model: which
tokenizer a command uses (``tokenizer_at``, ``checkpoint_or_given``, ``lora_input``), saving it into a
run directory on process 0 (``tokenizer_meta``), and the vocabulary check.
"""

from __future__ import annotations

import dataclasses
import re
import sys
import warnings
from pathlib import Path

from meshlm.data.bpe import check_vocab_size, train_bpe
from meshlm.data.hf_tokenizer import HFTokenizer
from meshlm.data.tokenizer import BYTES, ByteTokenizer, Tokenizer
from meshlm.data.tokenizer_files import (
    EOS_KEY,
    NONE_ENTRY,
    TOKENIZER_FILE,
    checkpoint_of,
    directory_tokenizer,
    load_tokenizer,
    model_tokenizer,
    save_tokenizer,
    tokenizer_from_meta,
)
from meshlm.errors import CheckpointError, ConfigError
from meshlm.io.layout import complete_steps, resolve
from meshlm.io.model_io import read_config
from meshlm.model.config import ModelConfig
from meshlm.parallel import distributed
from meshlm.train.config import from_scratch_tokenizer

BPE_SPEC = re.compile(r"^bpe-(\d+)$")


def tokenizer_meta(directory: str | Path, tok: Tokenizer | None) -> dict:
    """Save ``tok`` and the files it comes with into the run directory (process 0; unless bytes) and
    return the checkpoint meta entry; None (a model converted without a tokenizer): the "none" entry."""
    import jax

    if tok is None:
        return dict(NONE_ENTRY)
    return save_tokenizer(directory, tok, write=jax.process_index() == 0)


def check_vocab(cfg: ModelConfig, tok: Tokenizer, where: str) -> None:
    """A model must take every id its tokenizer makes. Bytes on a smaller vocabulary are left to the
    id range checks (a test model of 64 ids takes the ASCII digits)."""
    if cfg.vocab_size < tok.vocab_size and not isinstance(tok, ByteTokenizer):
        raise CheckpointError(
            f"{where} has vocab_size={cfg.vocab_size}, smaller than its tokenizer's {tok.vocab_size} "
            "ids, so some tokens have no embedding; use the tokenizer the model was made with"
        )


def checkpoint_tokenizer(path: str | Path, required: bool = True) -> Tokenizer | None:
    """The tokenizer of the checkpoint at ``path`` (run or step directory), checked against its model.
    A checkpoint without one (converted from a directory without tokenizer.json) is an error when
    ``required``, else None."""
    directory, _ = resolve(path)
    cfg, meta = read_config(path)
    tok = tokenizer_from_meta(directory, meta, str(path))
    if tok is None and required:
        raise CheckpointError(
            f"checkpoint {path} has no tokenizer (it was converted from a model directory without "
            "tokenizer.json), so it takes token ids only; convert it again with the tokenizer.json "
            "next to config.json, or pass --tokenizer where the command has it"
        )
    if tok is not None:
        check_vocab(cfg, tok, f"checkpoint {path}")
    return tok


def tokenizer_at(spec: str | Path | None) -> Tokenizer:
    """The tokenizer a --tokenizer names, with the files it comes with: a checkpoint's own, each file
    checked against the SHA-256 its meta records (as --checkpoint's), else ``directory_tokenizer``
    ("bytes", a tokenizer.json or a directory holding one). Every command's --tokenizer reads this."""
    if (checkpoint := checkpoint_of(spec)) is not None:
        return checkpoint_tokenizer(checkpoint)
    return directory_tokenizer(spec)


def checkpoint_or_given(checkpoint: str | Path, spec: str | None) -> Tokenizer | None:
    """``generate``'s and ``eval``'s tokenizer: the checkpoint's own; --tokenizer (``spec``, read by
    ``tokenizer_at``) only where it has none, or the same one."""
    own = checkpoint_tokenizer(checkpoint, required=not spec)
    if not spec:
        return own
    tok = tokenizer_at(spec)
    if own is not None and own.fingerprint != tok.fingerprint:
        raise ConfigError(
            f"--tokenizer {spec} differs from the tokenizer checkpoint {checkpoint} carries "
            f"({own.describe()}); leave out --tokenizer to use that one"
        )
    check_vocab(read_config(checkpoint)[0], tok, f"checkpoint {checkpoint}")
    return tok


def _existing(tcfg) -> tuple[Tokenizer | None, str]:
    """The tokenizer the run already has: its run directory's newest checkpoint, else --checkpoint's."""
    out = Path(tcfg.out)
    # complete_steps reads the listing only: every process of a job must take the same branch, and
    # a Checkpointer (orbax syncs processes when it opens a directory) only where steps exist.
    if not tcfg.fresh and out.is_dir() and complete_steps(out):
        from meshlm.io.checkpoint import Checkpointer  # JAX and orbax: not at the CLI's import

        with Checkpointer(out) as ckpt, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # resuming reports interrupted and corrupt steps, once
            return tokenizer_from_meta(out, ckpt.read_meta(), str(out)), f"--out {out}"
    if tcfg.checkpoint:  # one converted without a tokenizer takes any --tokenizer that fits it
        tok = checkpoint_tokenizer(tcfg.checkpoint, required=not tcfg.tokenizer)
        return tok, f"--checkpoint {tcfg.checkpoint}"
    return None, ""


def _train_bpe_into(tcfg, vocab_size: int) -> Tokenizer:
    """``bpe-N``: reuse DIR/tokenizer.json of an earlier attempt, else train on the training split."""
    from meshlm.data.corpus import load_splits

    check_vocab_size(vocab_size)
    saved = Path(tcfg.out) / TOKENIZER_FILE
    if saved.is_file():
        tok = load_tokenizer(saved)
        if tok.vocab_size <= vocab_size:  # a small corpus can have fewer merges than asked for
            return tok
    train, _, info = load_splits(list(tcfg.data) or None, text_field=tcfg.text_field)
    docs = bytes(train.tokens).split(b"\0")[:-1]  # the byte stream: documents end with NUL
    distributed.print0(
        f"training a {vocab_size}-id byte-level BPE on {info['train_bytes']:,} bytes", file=sys.stderr
    )
    return train_bpe([d.decode("utf-8", errors="replace") for d in docs], vocab_size, length=len(docs))


def _requested(tcfg) -> Tokenizer | None:
    spec = tcfg.tokenizer
    if not spec:
        return None
    if match := BPE_SPEC.match(spec):
        return _train_bpe_into(tcfg, int(match.group(1)))
    return tokenizer_at(spec) if spec == BYTES or Path(spec).exists() else _no_tokenizer(spec)


def _no_tokenizer(spec: str):
    raise ConfigError(
        f"--tokenizer {spec}: no such file; pass a tokenizer.json (see `meshlm tokenizer train`), "
        f"a directory holding one, '{BYTES}', or bpe-N to train an N-id BPE into the run directory"
    )


def _from_scratch(tcfg) -> Tokenizer:
    """Neither the run directory nor --checkpoint has a tokenizer: the default (``bpe-1024`` on the
    embedded corpus, bytes with --data)."""
    spec = from_scratch_tokenizer(tcfg)
    return _requested(dataclasses.replace(tcfg, tokenizer=spec)) if spec else ByteTokenizer()


def _differs(tcfg, existing: Tokenizer, where: str):
    raise ConfigError(
        f"--tokenizer {tcfg.tokenizer} differs from the tokenizer {where} already has "
        f"({existing.describe()}); leave out --tokenizer to use that one"
    )


def run_tokenizer(tcfg, cfg: ModelConfig) -> tuple[Tokenizer, ModelConfig]:
    """(the run's tokenizer, the model config it trains): see the module docstring."""
    existing, where = _existing(tcfg)
    bpe = BPE_SPEC.match(tcfg.tokenizer)
    if existing is not None and bpe:  # resuming a bpe-N run: it must be that run's tokenizer
        if not (isinstance(existing, HFTokenizer) and existing.vocab_size <= int(bpe.group(1))):
            _differs(tcfg, existing, where)
        tok = existing
    else:
        tok = _requested(tcfg)
    if existing is not None and tok is not None and tok.fingerprint != existing.fingerprint:
        _differs(tcfg, existing, where)
    tok = existing or tok or _from_scratch(tcfg)  # the same: the one saved, with the files it carries
    if not tcfg.checkpoint and not isinstance(tok, ByteTokenizer):
        cfg = dataclasses.replace(cfg, vocab_size=tok.vocab_size)
    if tcfg.checkpoint:  # from scratch the data's own range check names the ids (bytes on a small preset)
        check_vocab(cfg, tok, f"--checkpoint {tcfg.checkpoint}")
    return tok, cfg


def lora_input(path: str | Path, meta: dict, base: str | Path | None):
    """(tokenizer, EOS ids) for a checkpoint made from a LoRA checkpoint or a peft directory at
    ``path`` (``meta``: the LoRA checkpoint's, or None for a peft directory): its own where it has one,
    else its base checkpoint's (``base``)."""
    if meta is None:
        tok = model_tokenizer(path)
    else:
        tok = checkpoint_tokenizer(path, required=False) if "tokenizer" in meta else None
    base_meta = read_config(base)[1] if base and Path(base).exists() else {}  # gone: load_model says
    if tok is None and base_meta:
        tok = checkpoint_tokenizer(base, required=False)
    return tok, (meta or {}).get(EOS_KEY) or base_meta.get(EOS_KEY)
