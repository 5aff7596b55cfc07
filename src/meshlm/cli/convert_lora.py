"""meshlm convert's LoRA directions: ``--to-peft CK`` (a LoRA checkpoint's adapters as a peft adapter
directory), ``--from-peft DIR --base CK`` (a peft directory as a LoRA checkpoint of the meshlm base CK)
and ``--merge CK`` (the adapters merged into their base: a plain checkpoint, W + (alpha / R) A B)."""

from __future__ import annotations

from pathlib import Path

from meshlm.data import tokenizer_files as tf
from meshlm.errors import ConfigError


def _lora_checkpoint(path: str, flag: str):
    from meshlm.io.model_io import read_config

    cfg, meta = read_config(path)
    if not cfg.lora_rank:
        raise ConfigError(f"{flag} {path}: not a LoRA checkpoint (no adapters); train one with --lora-rank")
    return cfg, meta


def to_peft(args, layout, owned, summary) -> dict:
    import jax

    from meshlm.io.model_io import load_model
    from meshlm.io.peft import to_peft as write
    from meshlm.model import lora
    from meshlm.model.params import flat_params
    from meshlm.parallel.placement import to_host
    from meshlm.train import tokenizers as tt  # JAX and orbax: not at the CLI's import

    _, meta = _lora_checkpoint(args.to_peft, "--to-peft")
    tok, _ = tt.lora_input(args.to_peft, meta, base_path(meta))
    cfg, params, step = load_model(args.to_peft, layout)  # the base too: checked against its fingerprint
    flat = {p: to_host(v) for p, v in flat_params(lora.adapters(params)).items()}
    with owned(args.out):
        write(cfg, flat, args.out)
        if jax.process_index() == 0:  # AutoTokenizer loads it from the adapter's directory
            tf.write_export(Path(args.out), tok, cfg, peft=True)
    out = {**summary(args.to_peft, args.out, "peft adapter", cfg, flat), "step": step, "skipped_steps": []}
    return out | {"tokenizer": tf.says(tok)}


def merge(args, layout, owned, summary) -> dict:
    from meshlm.io.model_io import load_model, save_model
    from meshlm.model import lora
    from meshlm.train import tokenizers as tt  # JAX and orbax: not at the CLI's import

    cfg, meta = _lora_checkpoint(args.merge, "--merge")
    tok, eos = tt.lora_input(args.merge, meta, base_path(meta))
    cfg, params, step = load_model(args.merge, layout)
    plain = lora.without_lora(cfg)
    merged = lora.merged(cfg, params)
    with owned(args.out):
        out_meta = {
            "merged_from": str(Path(args.merge).absolute()),
            "tokenizer": tt.tokenizer_meta(args.out, tok),
        }
        save_model(args.out, plain, merged, meta=out_meta | ({tf.EOS_KEY: eos} if eos else {}))
    return {**summary(args.merge, args.out, "meshlm checkpoint (merged)", plain, _flat(merged)), "step": step,
            "skipped_steps": [], "tokenizer": tf.says(tok)}  # fmt: skip


def base_path(meta: dict) -> str | None:
    """Where a LoRA checkpoint's base is (its meta says; older runs: their --checkpoint)."""
    from meshlm.io.model_io import LORA_BASE_PATH

    return meta.get(LORA_BASE_PATH) or meta.get("train_config", {}).get("checkpoint")


def from_peft(args, layout, owned, summary) -> dict:
    from meshlm.io.model_io import (
        LORA_BASE,
        LORA_BASE_PATH,
        abstract_params,
        base_fingerprint,
        load_model,
        save_model,
    )
    from meshlm.io.peft import from_peft as read
    from meshlm.io.peft import read_peft_config
    from meshlm.model import lora
    from meshlm.model.params import flat_params, unflatten
    from meshlm.parallel.placement import put_global
    from meshlm.train import tokenizers as tt  # JAX and orbax: not at the CLI's import
    from meshlm.train.tokenizers import check_vocab

    if not args.base:
        raise ConfigError(
            "--from-peft needs --base CK: the meshlm checkpoint of the model the adapters adapt"
        )
    base_cfg, base, _ = load_model(args.base, layout)
    cfg = base_cfg.replace(**read_peft_config(args.from_peft, base_cfg))
    flat = read(args.from_peft, cfg)
    tok, eos = tt.lora_input(args.from_peft, None, args.base)  # the adapter's own tokenizer, else the base's
    if tok is not None:
        check_vocab(cfg, tok, f"the model of --base {args.base}")
    targets = flat_params(lora.adapters(abstract_params(cfg, layout)))
    placed = {p: put_global(v, targets[p].sharding) for p, v in flat.items()}
    meta = {LORA_BASE: base_fingerprint(base), LORA_BASE_PATH: str(Path(args.base).absolute())}
    meta["converted_from"] = str(Path(args.from_peft).absolute())
    with owned(args.out):
        meta |= {"tokenizer": tt.tokenizer_meta(args.out, tok), **({tf.EOS_KEY: eos} if eos else {})}
        save_model(args.out, cfg, unflatten(placed), meta=meta)
    out = summary(args.from_peft, args.out, "meshlm LoRA checkpoint", cfg, flat)
    return out | {"tokenizer": tf.says(tok)}


def _flat(params) -> dict:
    from meshlm.model.params import flat_params

    return flat_params(params)
