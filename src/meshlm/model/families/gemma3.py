"""Gemma 3 (text: model_type gemma3_text, Gemma3ForCausalLM): Gemma 2's sandwich block, with an
RMSNorm of Gemma's (1 + w) kind on each query and key head before rotary (``Family.qk_norm``
"head_plus_one": weights [head_dim], shared by the heads), no attention soft-capping, local and global
layers 5:1 (``layer_types``) with their own rotary bases: ``rope_local_base_freq`` (1e4) on the local
layers, ``rope_theta`` (1e6) on the global ones, which alone take the linear scaling of the 4B and
larger models (``rope_scaling`` {"rope_type": "linear", "factor": 8}: meshlm's ``rope_linear``).

config.json spells the rotary fields two ways: transformers 5's ``rope_parameters`` by layer kind
({"sliding_attention": {...}, "full_attention": {...}}), or the released files' ``rope_theta``,
``rope_local_base_freq`` and ``rope_scaling`` (the global layers'); both read as transformers does."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import meshlm.model.families.gemma2 as gemma2
import meshlm.model.families.llama as llama
from meshlm.errors import ConfigError
from meshlm.model.families.hf_fields import POSITIVE, SIZE, field, unsupported

# transformers' Gemma3TextConfig defaults for fields a config.json may leave out, where not Llama's.
DEFAULTS = {**gemma2.DEFAULTS, "max_position_embeddings": 131072}
SOFTCAPS = {"attn_logit_softcapping": None, "final_logit_softcapping": None}
THETA = {gemma2.GLOBAL: 1e6, gemma2.LOCAL: 1e4}  # Gemma3TextConfig.default_theta
LEGACY_THETA = {gemma2.GLOBAL: "rope_theta", gemma2.LOCAL: "rope_local_base_freq"}


def _rope_by_kind(hf: dict) -> dict[str, dict]:
    """{layer kind: its RoPE parameters}, as Gemma3TextConfig.convert_rope_params_to_dict makes them:
    ``rope_parameters`` by kind, ``rope_scaling`` merged into the global layers', each kind's base from
    its legacy field (or the default) where the parameters name none."""
    params = hf.get("rope_parameters") or {}
    if not isinstance(params, dict) or set(params) - set(THETA):
        raise unsupported("rope_parameters", params, f"give one dict per layer kind, {sorted(THETA)}")
    out = {}
    for kind in THETA:
        one = params.get(kind) or {}
        scaling = hf.get("rope_scaling") if kind == gemma2.GLOBAL else None
        if not isinstance(one, dict) or not isinstance(scaling or {}, dict):
            raise unsupported(f"rope_parameters.{kind}", one, "give a dict of RoPE parameters")
        one = {"rope_type": "default", **one, **(scaling or {})}
        one.setdefault("rope_theta", hf.get(LEGACY_THETA[kind], THETA[kind]))
        out[kind] = one
    return out


def _rope(hf: dict) -> dict[str, Any]:
    """rope_theta, rope_local_theta and rope_linear from ``_rope_by_kind``: plain RoPE on the local
    layers, plain or linear on the global ones; any other type or key is an error naming it."""
    fields = {}
    for kind, params in _rope_by_kind(hf).items():
        rope_type = params.get("rope_type", params.get("type"))
        allowed = ("default", "linear") if kind == gemma2.GLOBAL else ("default",)
        if rope_type not in allowed:
            raise unsupported(f"rope_parameters.{kind}.rope_type", rope_type, f"meshlm implements {allowed}")
        known = {"rope_type", "type", "rope_theta"} | ({"factor"} if rope_type == "linear" else set())
        extra = sorted(set(params) - known)
        if extra:
            raise unsupported(f"rope_parameters.{kind} keys", extra, f"known keys: {sorted(known)}")
        theta = float(field(params, "rope_theta", POSITIVE))
        fields["rope_theta" if kind == gemma2.GLOBAL else "rope_local_theta"] = theta
        if rope_type == "linear":
            fields["rope_linear"] = float(field(params, "factor", POSITIVE))
    return fields


def read(hf: dict) -> dict[str, Any]:
    """Gemma3TextConfig: Gemma 2's fields with Gemma 3's defaults (layers 5:1 unless ``layer_types``
    or ``sliding_window_pattern`` say otherwise), its two rotary bases and no attention soft-capping
    (transformers' Gemma 3 does not apply one: a config.json that sets it is refused)."""
    if hf.get("attn_logit_softcapping") is not None:
        raise unsupported(
            "attn_logit_softcapping", hf["attn_logit_softcapping"], "transformers' Gemma 3 ignores it: null"
        )
    hf = {**DEFAULTS, **hf}
    fields = llama.read({**hf, "rope_parameters": None, "rope_scaling": None, "rope_theta": None})
    head_dim = fields["head_dim"] or fields["d_model"] // fields["n_heads"]
    every = field(hf, "sliding_window_pattern", SIZE, 6)
    return {**fields, **gemma2.attention_fields(hf, head_dim, every, SOFTCAPS), **_rope(hf)}


def rope_written(cfg) -> dict[str, Any]:
    """transformers 5's rope_parameters by kind, and the released files' fields (transformers 4.x)."""
    full = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_linear:
        full = {"rope_type": "linear", "rope_theta": cfg.rope_theta, "factor": cfg.rope_linear}
    local = cfg.rope_local_theta or cfg.rope_theta
    return {
        "rope_parameters": {gemma2.GLOBAL: full, gemma2.LOCAL: {"rope_type": "default", "rope_theta": local}},
        "rope_theta": cfg.rope_theta,
        "rope_local_base_freq": local,
    }


def write(cfg) -> dict[str, Any]:
    return {**gemma2.write(cfg), **rope_written(cfg)}


def check_export(cfg) -> None:
    """What transformers' Gemma 3 cannot express: no window, attention soft-capping (it ignores the
    field), Llama 3's RoPE scaling."""
    llama.check_export(cfg)
    if not cfg.sliding_window:
        raise ConfigError("sliding_window=0: transformers' Gemma 3 local layers have a window; set one")
    if cfg.attn_softcap:
        raise ConfigError(f"attn_softcap={cfg.attn_softcap}: transformers' Gemma 3 ignores it; set it to 0")
    if cfg.rope_scaling is not None:
        raise ConfigError("rope_scaling (Llama 3's): transformers' Gemma 3 scales linearly (rope_linear)")


# Gemma 2's tensors plus the per-head q/k norms ([head_dim] in both).
HF = replace(
    gemma2.HF,
    model_type="gemma3_text",
    architecture="Gemma3ForCausalLM",
    read=read,
    write=write,
    check_export=check_export,
    layer={
        **gemma2.LAYER,
        "attn/q_norm/scale": ("self_attn.q_norm.weight", "copy"),
        "attn/k_norm/scale": ("self_attn.k_norm.weight", "copy"),
    },
)
FAMILY = replace(gemma2.FAMILY, name="gemma3", qk_norm="head_plus_one", hf=HF)

# ``ModelConfig`` fields by preset name (the registry adds ``family``); gemma3-1b: google/gemma-3-1b-pt's
# config.json (vocabulary 262144 = 2048 x 128: no padding; 1 KV head, replicated on any mp).
PRESETS: dict[str, dict] = {
    # 6 layers, every third global (local, local, global, twice: chunks of 3 on pp = 2), the global ones
    # with rope_theta 1e6 scaled linearly by 8 (as Gemma 3 4B+), the local ones with base 1e4.
    "tiny-gemma3": dict(
        gemma2.TINY, n_layers=6, global_every=3, rope_theta=1e6, rope_local_theta=1e4, rope_linear=8.0
    ),
    "gemma3-1b": dict(
        vocab_size=262144,
        d_model=1152,
        n_layers=26,
        d_ff=6912,
        n_heads=4,
        n_kv_heads=1,
        head_dim=256,
        max_seq_len=32768,
        norm_eps=1e-6,
        tie_embeddings=True,
        sliding_window=512,
        global_every=6,
        rope_theta=1e6,
        rope_local_theta=1e4,
    ),
}
