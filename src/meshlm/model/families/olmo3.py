"""OLMo 3: OLMo 2's block (norms after each branch, q/k RMSNorm over the whole projection) with a
sliding window on three of every four layers (``layer_types``: meshlm's local layer kind, the fourth
layer global, ``global_every`` 4, as Gemma 2/3's kinds: ``attention.kind_tables``; the KV cache rolls
in the local layers, ``kv_kinds``). Each kind has its own RoPE parameters (``rope_parameters`` by layer
type, or the legacy ``rope_theta`` for both and ``rope_scaling`` for the full layers); the released
models scale the full layers' with YaRN, which meshlm's rope does not compute yet: refused
(``refuse_yarn``)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import meshlm.model.families.gemma2 as gemma2
import meshlm.model.families.olmo2 as olmo2
from meshlm.errors import ConfigError
from meshlm.model.families.hf_fields import POSITIVE, SIZE, field, unsupported

THETA = 5e5  # Olmo3Config.default_theta: both kinds' base where config.json names none
DEFAULTS = {"sliding_window": 4096, "rms_norm_eps": 1e-5}  # Olmo3Config's, where not Llama's


def refuse_yarn(hf: dict) -> None:
    """YaRN anywhere in config.json's RoPE parameters (flat, or by layer type) is one ConfigError naming
    the missing piece: meshlm's rope (model/rope.py) has no YaRN scaling yet."""
    for name in ("rope_parameters", "rope_scaling"):
        params = hf.get(name) or {}
        each = (
            [params, *(v for v in params.values() if isinstance(v, dict))] if isinstance(params, dict) else []
        )
        if any(p.get("rope_type", p.get("type")) == "yarn" for p in each):
            raise unsupported(f"{name}.rope_type", "yarn", "YaRN rope scaling is not in meshlm's rope yet")


def _rope(hf: dict) -> dict[str, float]:
    """rope_theta (the full layers') and rope_local_theta (the sliding ones', 0 where equal), as
    Olmo3Config.convert_rope_params_to_dict: ``rope_parameters`` by layer type, each kind's base from
    the legacy ``rope_theta`` (else 5e5) where it names none; plain RoPE only."""
    refuse_yarn(hf)
    params = hf.get("rope_parameters") or {}
    if not isinstance(params, dict) or set(params) - {gemma2.LOCAL, gemma2.GLOBAL}:
        raise unsupported(
            "rope_parameters", params, f"give one dict per layer type, {[gemma2.LOCAL, gemma2.GLOBAL]}"
        )
    theta, base = {}, field(hf, "rope_theta", POSITIVE, THETA, nullable=True) or THETA
    for kind in (gemma2.LOCAL, gemma2.GLOBAL):
        scaling = hf.get("rope_scaling") if kind == gemma2.GLOBAL else None
        one = {"rope_type": "default", "rope_theta": base, **(params.get(kind) or {}), **(scaling or {})}
        if one.get("rope_type", one.get("type")) != "default" or set(one) - {
            "rope_type",
            "type",
            "rope_theta",
        }:
            raise unsupported(f"rope_parameters.{kind}", one, "meshlm's OLMo 3 has plain RoPE on both kinds")
        theta[kind] = float(field(one, "rope_theta", POSITIVE))
    local = theta[gemma2.LOCAL]
    return {
        "rope_theta": theta[gemma2.GLOBAL],
        "rope_local_theta": 0.0 if local == theta[gemma2.GLOBAL] else local,
    }


def read(hf: dict) -> dict[str, Any]:
    """Olmo3Config: OLMo 2's fields, the window, the layer kinds (3 sliding, 1 full unless
    ``layer_types`` says another repeating pattern) and each kind's rotary base."""
    hf = {**DEFAULTS, **hf}
    rope = _rope(hf)
    fields = olmo2.read({**hf, "rope_parameters": None, "rope_scaling": None, "rope_theta": None})
    every = gemma2.global_every(hf, 4)
    return {**fields, **rope, "sliding_window": field(hf, "sliding_window", SIZE), "global_every": every}


def write(cfg) -> dict[str, Any]:
    fields = {k: v for k, v in olmo2.write(cfg).items() if k not in ("rope_scaling",)}
    local = {"rope_type": "default", "rope_theta": cfg.rope_local_theta or cfg.rope_theta}
    rope = {gemma2.LOCAL: local, gemma2.GLOBAL: {"rope_type": "default", "rope_theta": cfg.rope_theta}}
    types = gemma2.layer_types(cfg.n_layers, cfg.global_every)
    return {**fields, "rope_parameters": rope, "sliding_window": cfg.sliding_window, "layer_types": types}


def check_export(cfg) -> None:
    """What transformers' OLMo 3 cannot express: no window, a RoPE scaling, NoPE, Gemma's score rules."""
    olmo2.HF.check_export(cfg)
    if not cfg.sliding_window:
        raise ConfigError("sliding_window=0: transformers' OLMo 3 sliding layers have a window; set one")
    if (
        cfg.rope_scaling is not None
        or cfg.rope_linear
        or cfg.global_nope
        or cfg.attn_scalar
        or cfg.attn_softcap
    ):
        raise ConfigError("transformers' OLMo 3 has plain RoPE on every layer and 1/sqrt(head_dim) scores")


HF = replace(olmo2.HF, model_type="olmo3", architecture="Olmo3ForCausalLM", read=read, write=write,
             check_export=check_export)  # fmt: skip
FAMILY = replace(olmo2.FAMILY, name="olmo3", hf=HF)

# ``ModelConfig`` fields by preset name (the registry adds ``family``); olmo3-7b: allenai/Olmo-3-1025-7B's
# sizes (vocabulary 100278, padded to 100352), planned without the YaRN of its full layers (not in meshlm
# yet: its config.json is refused, naming it).
PRESETS: dict[str, dict] = {
    # 4 layers (sliding, sliding, sliding, full), a window of 8 under verify's 64-token text, 2 KV heads.
    "tiny-olmo3": dict(olmo2.PRESETS["tiny-olmo2"], n_layers=4, sliding_window=8, global_every=4),
    "olmo3-7b": dict(
        vocab_size=100278,
        d_model=4096,
        n_layers=32,
        d_ff=11008,
        n_heads=32,
        rope_theta=5e5,
        max_seq_len=65536,
        norm_eps=1e-6,
        sliding_window=4096,
        global_every=4,
    ),
}
