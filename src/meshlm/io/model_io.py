"""Model checkpoints as users load them: a config plus parameters, sharded onto any mesh.

A meshlm checkpoint (``meshlm.io.checkpoint``) holds ``state = {"params", ["opt_state", "step"]}`` and
``meta = {"format", "model_config", ...}``. ``meshlm train --out DIR`` and ``meshlm convert`` both
write it; ``generate``, ``verify``, ``convert --to-hf`` and ``train --checkpoint`` read it here.
"""

from __future__ import annotations

from pathlib import Path

import jax

from meshlm.errors import CheckpointError, ConfigError
from meshlm.io.checkpoint import Checkpointer
from meshlm.io.layout import resolve
from meshlm.model.config import ModelConfig, from_dict
from meshlm.parallel.layout import Layout
from meshlm.sharding.rules import model_specs, shardings
from meshlm.sharding.stage_slots import canonical_shardings, slots_of, to_device

FORMAT = "meshlm-checkpoint-v1"


def abstract_params(cfg: ModelConfig, where, dtype=None):
    """ShapeDtypeStructs of the parameters, with their NamedShardings on ``where`` (a Layout, or a jax
    Mesh): the rules table's specs, with weights split over dp when the layout has ``fsdp``."""
    from meshlm.model.transformer import param_shapes

    layout = Layout.of(where)
    shapes = param_shapes(cfg)
    # uneven pp stages: the canonical stack (a checkpoint's), pp moved off its layer dimension
    sh = canonical_shardings(
        shardings(model_specs(cfg, shapes, layout), layout.mesh), shapes, slots_of(cfg, layout)
    )
    return jax.tree.map(lambda s, h: jax.ShapeDtypeStruct(s.shape, dtype or s.dtype, sharding=h), shapes, sh)


def save_model(out: str | Path, cfg: ModelConfig, params, *, step: int = 0, meta: dict | None = None) -> None:
    """A parameters-only checkpoint (what ``meshlm convert --from-hf`` writes)."""
    with Checkpointer(out, keep=1) as ckpt:
        ckpt.save(step, {"params": params}, {"format": FORMAT, "model_config": cfg.to_dict(), **(meta or {})})


def read_config(path: str | Path) -> tuple[ModelConfig, dict]:
    """The model config and meta of the checkpoint at ``path`` (a run directory or one step's)."""
    directory, step = resolve(path)
    with Checkpointer(directory) as ckpt:
        meta, step = ckpt.read_meta_at(step)
    if meta.get("format") != FORMAT or not isinstance(meta.get("model_config"), dict):
        raise CheckpointError(f"{path} is not a meshlm checkpoint (meta format {meta.get('format')!r})")
    try:
        return from_dict(meta["model_config"]), meta
    except ConfigError as e:  # say which checkpoint: the message alone reads like a flag's
        raise CheckpointError(
            f"checkpoint {directory / str(step)} holds an invalid model config: {e}; "
            "it cannot be loaded: use another step or re-create it"
        ) from e


def load_model(path: str | Path, where, dtype=None) -> tuple[ModelConfig, dict, int]:
    """(config, params sharded on ``where``, step) from a run directory (its newest complete
    checkpoint) or one step's directory: ``where`` is a Layout or a jax Mesh (then no FSDP).
    Optimizer state, if saved, is not read."""
    directory, step = resolve(path)
    cfg, meta = read_config(path)
    abstract, base = abstract_params(cfg, where), None
    if cfg.lora_rank:  # LoRA adapters alone: their base read from where the meta says, and checked
        from meshlm.model import lora

        abstract, base = lora.adapters(abstract), _lora_base(path, meta, where)
    with Checkpointer(directory) as ckpt:
        state, _, step = ckpt.restore(
            {"params": abstract}, step, expect_meta={"format": FORMAT}, partial=True
        )
    params = state["params"] if base is None else lora.combine(base, state["params"])
    params = to_device(params, slots_of(cfg, Layout.of(where)))  # uneven pp stages: padded on the devices
    if dtype is not None:
        params = jax.tree.map(lambda p: p.astype(dtype), params)
    return cfg, params, step


# A LoRA checkpoint's meta: its base's fingerprint and where the base was read from.
LORA_BASE, LORA_BASE_PATH = "lora_base", "lora_base_path"


def base_fingerprint(params) -> str:
    """A digest of a model's arrays (shape, dtype and bits of each: ``io.integrity.describe``)."""
    import hashlib
    import json

    from meshlm.io.integrity import describe

    return hashlib.sha256(json.dumps(describe(params), sort_keys=True).encode()).hexdigest()[:16]


def _lora_base(path, meta: dict, where) -> dict:
    """The base parameters of the LoRA checkpoint at ``path``: loaded from its meta's base path, and
    refused in one line when their fingerprint is not the one the adapters were trained on."""
    base_path = meta.get(LORA_BASE_PATH) or meta.get("train_config", {}).get("checkpoint")
    if not base_path or not Path(base_path).exists():
        raise CheckpointError(
            f"{path} holds LoRA adapters whose base {base_path!r} is not there; restore the base checkpoint "
            "at that path"
        )
    _, base, _ = load_model(base_path, where)
    if (got := base_fingerprint(base)) != meta.get(LORA_BASE):
        raise CheckpointError(
            f"{path} holds LoRA adapters of a base with fingerprint {meta.get(LORA_BASE)}, but {base_path} "
            f"is {got}: the base changed since; restore the one the adapters were trained on"
        )
    return base
