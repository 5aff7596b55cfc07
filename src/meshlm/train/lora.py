"""LoRA fine-tuning of a checkpoint (``meshlm train --checkpoint CK --lora-rank R``): the flags, the
adapted model, its starting state, and what its checkpoints hold.

A LoRA run's checkpoints hold the adapters and their AdamW state only, plus the base's fingerprint
(``lora_base`` in the meta: a digest of every base array's bits, ``io.integrity.describe``); the base
is read again from ``--checkpoint`` at every start, and a resume onto another base is refused. The
adapters are ``model.lora``'s; the step trains them alone (``train.optim.trainable``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from meshlm.errors import CheckpointError, ConfigError
from meshlm.model.lora_fields import NAMES, RANGES
from meshlm.ranges import Range
from meshlm.settings import setting

# --base-dtype: float32 keeps the base in the master dtype (float64 under verify --x64); bf16 stores it
# in bfloat16 (``stored_base``), and a step casts it to its compute dtype (``sharding.spmd``)
BASE_DTYPES = ("float32", "bf16")
META_KEY = "lora_base"  # the checkpoint meta's entry: the base's fingerprint (``io.model_io.LORA_BASE``)


@dataclass(frozen=True)
class LoraSettings:
    """The LoRA flags (a base of ``TrainConfig`` and ``VerifySettings``, as ``MoESettings``)."""

    lora_rank: int = setting(
        0, "LoRA: train rank-R adapters of --checkpoint's frozen weights (0: train every weight)",
        resume_must_match=True, valid=Range(int, 0, note="0: off"),
    )  # fmt: skip
    lora_alpha: float = setting(
        0.0, "LoRA: the adapters' scale is alpha / rank", resume_must_match=True,
        shown_default="the rank (a scale of 1)", valid=Range(float, 0, note="0: the rank"),
    )  # fmt: skip
    lora_targets: str = setting(
        "q,k,v,o", f"LoRA: the weights adapted, comma-separated names of {','.join(NAMES)}",
        resume_must_match=True,
    )  # fmt: skip
    lora_dropout: float = setting(
        0.0, "LoRA: dropout probability of the adapters' input, in training only (peft's lora_dropout)",
        resume_must_match=True, valid=RANGES["lora_dropout"],
    )  # fmt: skip
    base_dtype: str | None = setting(
        None, "LoRA: the frozen base's stored dtype, float32 or bf16 (the adapters and their AdamW state "
        "stay float32; a step computes in the compute dtype either way)", choices=BASE_DTYPES,
        resume_must_match=True,
        shown_default="bf16 under --bf16 (the step casts the base to bf16 anyway: the same step, half "
        "the base's bytes), else float32",
    )  # fmt: skip


def with_lora(settings, cfg):
    """``cfg`` with the settings' adapters (none without --lora-rank): one-line errors for unknown
    targets or a family without any (``lora_fields.check_lora``)."""
    check_lora_flags(settings)
    if not settings.lora_rank:
        return cfg
    return cfg.replace(
        lora_rank=settings.lora_rank,
        lora_alpha=settings.lora_alpha,
        lora_targets=settings.lora_targets,
        lora_dropout=settings.lora_dropout,
    )


def check_lora_flags(settings) -> None:
    """Without --lora-rank there are no adapters: a LoRA-only flag given (not at its default) is
    refused in one line, not silently dropped (a full fine-tune the user did not ask for)."""
    if settings.lora_rank:
        return
    given = [
        "--" + f.name.replace("_", "-")
        for f in fields(LoraSettings)
        if f.name != "lora_rank" and getattr(settings, f.name) != f.default
    ]
    if given:
        flags = " and ".join(given)
        raise ConfigError(
            f"{flags} appl{'ies' if len(given) == 1 else 'y'} to LoRA adapters; give --lora-rank R > 0, "
            f"or drop {flags} for a full fine-tune"
        )


def check_early(settings, checkpoint: str, config: str) -> None:
    """The LoRA flags against the model before devices start (e.g. --lora-rank above its targets'
    widths, ``lora_fields.check_lora``): ``checkpoint``'s model, read straight from its meta
    (``io.layout.peek_model_config``; unreadable, or itself adapters: the run's checked read reports
    it), else the preset ``config``."""
    from meshlm.model.config import from_dict, get_config

    if not settings.lora_rank:
        return
    if not checkpoint:
        with_lora(settings, get_config(config))
        return
    from meshlm.io.layout import peek_model_config

    found = peek_model_config(checkpoint)
    try:
        model = None if found is None else from_dict(found)
    except ConfigError:
        return  # an invalid saved config: the checked read names the checkpoint
    if model is not None and not model.lora_rank:
        with_lora(settings, model)


def base_dtype(settings) -> str:
    """--base-dtype resolved: as given, else bf16 when the run computes in bf16 (``compute_dtype``:
    ``--bf16``; a command without it computes in its master dtype) and float32 otherwise. Without
    adapters: float32 (no base is frozen)."""
    if not settings.lora_rank:
        return "float32"
    if settings.base_dtype:
        return settings.base_dtype
    return "bf16" if getattr(settings, "compute_dtype", "float32") == "bfloat16" else "float32"


def stored_base(params, dtype: str):
    """``params`` with the frozen base as ``dtype`` (``BASE_DTYPES``) stores it: bf16 casts every
    floating base leaf to bfloat16 (its sharding kept), the adapters untouched (float32 master weights,
    as their AdamW state); float32 returns ``params``. Arrays or ShapeDtypeStructs. A mixture of experts'
    selection bias is state its rule updates in float32 (``balance_update``), not a weight: kept."""
    import jax
    import jax.numpy as jnp

    from meshlm.model import lora

    if dtype == "float32":
        return params

    def narrow(name, p):
        if name == "balance_bias" or not jnp.issubdtype(p.dtype, jnp.floating):
            return p
        if isinstance(p, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(p.shape, jnp.bfloat16, sharding=p.sharding)
        return p.astype(jnp.bfloat16)

    base = {m: {n: narrow(n, p) for n, p in leaves.items()} for m, leaves in lora.base(params).items()}
    return lora.combine(base, lora.adapters(params))


def check_needs_base(tcfg) -> None:
    """LoRA adapts a model: --lora-rank needs --checkpoint (the base), at every start and resume."""
    if tcfg.lora_rank and not tcfg.checkpoint:
        raise ConfigError(
            "--lora-rank needs --checkpoint BASE: the frozen model the adapters adapt (a converted or "
            "trained checkpoint; pass it again to resume a LoRA run)"
        )


def base_meta(tcfg, base_params) -> dict:
    """The meta a LoRA run's checkpoints carry: the base's fingerprint and its absolute path."""
    from pathlib import Path

    from meshlm.io.model_io import LORA_BASE_PATH, base_fingerprint

    return {META_KEY: base_fingerprint(base_params), LORA_BASE_PATH: str(Path(tcfg.checkpoint).absolute())}


def check_same_base(meta: dict | None, base: dict, tcfg) -> None:
    """A LoRA run resumes only onto the base it started from (its checkpoints hold the adapters alone);
    ``base``: ``base_meta``'s."""
    saved, base_print = (meta or {}).get(META_KEY), base[META_KEY]
    if meta is not None and saved != base_print:
        raise CheckpointError(
            f"--out {tcfg.out} holds LoRA adapters of another base (fingerprint {saved}; --checkpoint "
            f"{tcfg.checkpoint} is {base_print}); pass the base the run started from, or another --out"
        )


def start_params(cfg, layout, specs, base_params, seed: int):
    """The adapted model's parameters: ``base_params`` (on their shardings) and fresh adapters (A
    random from ``seed``, B zero), each created on its own shards; the base's part is not initialised."""
    import jax

    from meshlm.model import lora
    from meshlm.model.transformer import init_fn
    from meshlm.sharding.rules import init_sharded

    init, example = init_fn(cfg)
    adapters, _ = init_sharded(
        lambda rng, ex: lora.adapters(init(rng, ex)),
        jax.random.PRNGKey(seed),
        example,
        specs_fn=lambda _: lora.adapters(specs),
        mesh=layout.mesh,
    )
    dtype = jax.tree.leaves(base_params)[0].dtype  # the base's (float32 master weights)
    adapters = jax.tree.map(lambda a: a.astype(dtype), adapters)
    return lora.combine(base_params, adapters)
