"""meshlm convert's LoRA directions: ``--to-peft CK`` (a LoRA checkpoint's adapters as a peft adapter
directory), ``--from-peft DIR --base CK`` (a peft directory as a LoRA checkpoint of the meshlm base CK)
and ``--merge CK`` (the adapters merged into their base: a plain checkpoint, W + (alpha / R) A B)."""

from __future__ import annotations

from pathlib import Path

from meshlm.errors import ConfigError


def _lora_checkpoint(path: str, flag: str):
    from meshlm.io.model_io import read_config

    cfg, meta = read_config(path)
    if not cfg.lora_rank:
        raise ConfigError(f"{flag} {path}: not a LoRA checkpoint (no adapters); train one with --lora-rank")
    return cfg, meta


def to_peft(args, layout, owned, summary) -> dict:
    from meshlm.io.model_io import load_model
    from meshlm.io.peft import to_peft as write
    from meshlm.model import lora
    from meshlm.model.params import flat_params
    from meshlm.parallel.placement import to_host

    _lora_checkpoint(args.to_peft, "--to-peft")
    cfg, params, step = load_model(args.to_peft, layout)  # the base too: checked against its fingerprint
    flat = {p: to_host(v) for p, v in flat_params(lora.adapters(params)).items()}
    with owned(args.out):
        write(cfg, flat, args.out)
    return {**summary(args.to_peft, args.out, "peft adapter", cfg, flat), "step": step, "skipped_steps": []}


def merge(args, layout, owned, summary) -> dict:
    from meshlm.io.model_io import load_model, save_model
    from meshlm.model import lora

    cfg, meta = _lora_checkpoint(args.merge, "--merge")
    cfg, params, step = load_model(args.merge, layout)
    plain = lora.without_lora(cfg)
    merged = lora.merged(cfg, params)
    with owned(args.out):
        save_model(args.out, plain, merged, meta={"merged_from": str(Path(args.merge).absolute())})
    return {**summary(args.merge, args.out, "meshlm checkpoint (merged)", plain, _flat(merged)), "step": step,
            "skipped_steps": []}  # fmt: skip


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

    if not args.base:
        raise ConfigError(
            "--from-peft needs --base CK: the meshlm checkpoint of the model the adapters adapt"
        )
    base_cfg, base, _ = load_model(args.base, layout)
    cfg = base_cfg.replace(**read_peft_config(args.from_peft, base_cfg))
    flat = read(args.from_peft, cfg)
    targets = flat_params(lora.adapters(abstract_params(cfg, layout)))
    placed = {p: put_global(v, targets[p].sharding) for p, v in flat.items()}
    meta = {LORA_BASE: base_fingerprint(base), LORA_BASE_PATH: str(Path(args.base).absolute())}
    meta["converted_from"] = str(Path(args.from_peft).absolute())
    with owned(args.out):
        save_model(args.out, cfg, unflatten(placed), meta=meta)
    return summary(args.from_peft, args.out, "meshlm LoRA checkpoint", cfg, flat)


def _flat(params) -> dict:
    from meshlm.model.params import flat_params

    return flat_params(params)
