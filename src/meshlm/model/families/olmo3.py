"""OLMo 3: OLMo 2's block (norms after each branch, q/k RMSNorm over the whole projection) with a
sliding window on three of every four layers (``layer_types``: meshlm's local layer kind, the fourth
layer global, ``global_every`` 4, as Gemma 2/3's kinds: ``attention.kind_tables``; the KV cache rolls
in the local layers, ``kv_kinds``). Each kind has its own RoPE parameters (``rope_parameters`` by layer
type, or the legacy ``rope_theta`` for both and ``rope_scaling`` for the full layers); the released
models scale the full layers' with YaRN (``rope_scaling``: their frequencies and their cos and sin,
``attention_variants.rotary_scale``; the sliding layers' plain RoPE is unscaled, as transformers')."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import meshlm.model.families.gemma2 as gemma2
import meshlm.model.families.olmo2 as olmo2
from meshlm.errors import ConfigError
from meshlm.model.families.hf_fields import POSITIVE, SIZE, field, rope, rope_fields, unsupported
from meshlm.model.rope import YarnScaling

THETA = 5e5  # Olmo3Config.default_theta: both kinds' base where config.json names none
DEFAULTS = {"sliding_window": 4096, "rms_norm_eps": 1e-5}  # Olmo3Config's, where not Llama's


def _rope(hf: dict) -> dict[str, Any]:
    """rope_theta and rope_scaling (the full layers': plain, Llama 3's or YaRN, ``hf_fields.rope``) and
    rope_local_theta (the sliding ones', plain RoPE; 0 where the bases are equal), as
    Olmo3Config.convert_rope_params_to_dict: ``rope_parameters`` by layer type, the legacy
    ``rope_scaling`` joining the full layers', each kind's base from the legacy ``rope_theta`` (else
    5e5) where it names none."""
    params = hf.get("rope_parameters") or {}
    if not isinstance(params, dict) or set(params) - {gemma2.LOCAL, gemma2.GLOBAL}:
        raise unsupported(
            "rope_parameters", params, f"give one dict per layer type, {[gemma2.LOCAL, gemma2.GLOBAL]}"
        )
    base = field(hf, "rope_theta", POSITIVE, THETA, nullable=True) or THETA
    kinds = {}
    for kind in (gemma2.LOCAL, gemma2.GLOBAL):
        scaling = hf.get("rope_scaling") if kind == gemma2.GLOBAL else None
        one = {"rope_type": "default", "rope_theta": base, **(params.get(kind) or {}), **(scaling or {})}
        kinds[kind] = rope({**hf, "rope_parameters": one, "rope_scaling": None, "rope_theta": None})
    local, (full, scaling) = kinds[gemma2.LOCAL], kinds[gemma2.GLOBAL]
    if local[1] is not None:
        raise unsupported(
            f"rope_parameters.{gemma2.LOCAL}.rope_type", local[1].rope_type or "llama3",
            "meshlm scales the full layers' RoPE only (the sliding ones are plain, as released)",
        )  # fmt: skip
    local_theta = 0.0 if local[0] == full else local[0]
    return {"rope_theta": full, "rope_scaling": scaling, "rope_local_theta": local_theta}


def read(hf: dict) -> dict[str, Any]:
    """Olmo3Config: OLMo 2's fields, the window, the layer kinds (3 sliding, 1 full unless
    ``layer_types`` says another repeating pattern) and each kind's rotary base."""
    hf = {**DEFAULTS, **hf}
    rotary = _rope(hf)
    fields = olmo2.read({**hf, "rope_parameters": None, "rope_scaling": None, "rope_theta": None})
    every = gemma2.global_every(hf, 4)
    return {**fields, **rotary, "sliding_window": field(hf, "sliding_window", SIZE), "global_every": every}


def write(cfg) -> dict[str, Any]:
    fields = {k: v for k, v in olmo2.write(cfg).items() if k not in ("rope_scaling",)}
    local = {"rope_type": "default", "rope_theta": cfg.rope_local_theta or cfg.rope_theta}
    kinds = {gemma2.LOCAL: local, gemma2.GLOBAL: rope_fields(cfg)}
    types = gemma2.layer_types(cfg.n_layers, cfg.global_every)
    return {**fields, "rope_parameters": kinds, "sliding_window": cfg.sliding_window, "layer_types": types}


def check_export(cfg) -> None:
    """What transformers' OLMo 3 cannot express: no window, a RoPE scaling, NoPE, Gemma's score rules."""
    olmo2.HF.check_export(cfg)
    if not cfg.sliding_window:
        raise ConfigError("sliding_window=0: transformers' OLMo 3 sliding layers have a window; set one")
    if cfg.rope_linear or cfg.global_nope or cfg.attn_scalar or cfg.attn_softcap:
        raise ConfigError("transformers' OLMo 3 has no linear RoPE, NoPE layers or other score rules")


HF = replace(olmo2.HF, model_type="olmo3", architecture="Olmo3ForCausalLM", read=read, write=write,
             check_export=check_export)  # fmt: skip
FAMILY = replace(olmo2.FAMILY, name="olmo3", hf=HF)

# ``ModelConfig`` fields by preset name (the registry adds ``family``); olmo3-7b: allenai/Olmo-3-1025-7B's
# sizes (vocabulary 100278, padded to 100352) and the YaRN of its full layers (x8 over 8192, attention
# factor 0.1 ln 8 + 1), written from memory (not downloaded here).
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
        rope_scaling=YarnScaling(
            factor=8.0, original_max_position_embeddings=8192, attention_factor=1.2079441541679836
        ),
    ),
}
