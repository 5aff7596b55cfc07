"""SmolLM3: Llama's blocks with no rotary on every fourth layer (NoPE: ``no_rope_layers``, by default
from ``no_rope_layer_interval`` 4: layer i is rotated unless (i + 1) % 4 == 0) and tied embeddings. The
NoPE layers are meshlm's global layer kind with its rotary off (``global_every`` the interval,
``global_nope``: ``attention.kind_tables``), the others the local kind without a window; both keep the
whole context, so the KV cache is one array (``kv_kinds.mixed_kinds``). transformers' optional sliding
window (``use_sliding_window``, on the NoPE layers) is refused. YaRN (``rope_scaling``) scales every rotated
layer (``Family.rope_scales_local``: the local kind's rotary is the model's), as transformers' one rotary."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import meshlm.model.families.llama as llama
from meshlm.errors import ConfigError
from meshlm.model.families.hf_fields import SIZE, field, flag, unsupported

# transformers' SmolLM3Config defaults for fields a config.json may leave out, where they are not Llama's.
DEFAULTS = {"tie_word_embeddings": True, "max_position_embeddings": 32768, "num_key_value_heads": 4}


def no_rope_layers(n_layers: int, every: int) -> list[int]:
    """transformers' no_rope_layers (1: rotated, 0: NoPE) of a NoPE layer every ``every`` (0: none)."""
    return [int(not every or (i + 1) % every != 0) for i in range(n_layers)]


def nope_every(hf: dict) -> int:
    """``no_rope_layers`` (else ``no_rope_layer_interval``) as meshlm's ``global_every``: the NoPE layers
    must repeat, every N-th; 0 where every layer is rotated."""
    n = field(hf, "num_hidden_layers", SIZE)
    every = field(hf, "no_rope_layer_interval", SIZE, 4)
    layers = hf.get("no_rope_layers")
    if layers is None:
        return every if every <= n else 0
    if not isinstance(layers, list) or len(layers) != n or any(v not in (0, 1) for v in layers):
        raise unsupported("no_rope_layers", layers, f"give num_hidden_layers={n} of 1 (rotated) / 0 (NoPE)")
    every = layers.index(0) + 1 if 0 in layers else 0
    if layers != no_rope_layers(n, every):
        raise unsupported("no_rope_layers", layers, "meshlm takes a repeating pattern: every N-th layer NoPE")
    return every


def read(hf: dict) -> dict[str, Any]:
    """SmolLM3Config: Llama's fields with SmolLM3's defaults and its NoPE layers; full attention only."""
    if flag(hf, "use_sliding_window"):
        raise unsupported("use_sliding_window", True, "meshlm's SmolLM3 attends to the whole context")
    kinds = hf.get("layer_types") or []
    if not isinstance(kinds, list) or any(k != "full_attention" for k in kinds):
        raise unsupported("layer_types", kinds, "meshlm's SmolLM3 has only 'full_attention' layers")
    hf = {**DEFAULTS, **hf}
    every = nope_every(hf)
    return {**llama.read(hf), "global_every": every, "global_nope": bool(every)}


def write(cfg) -> dict[str, Any]:
    fields = {k: v for k, v in llama.write(cfg).items() if k != "mlp_bias"}
    nope = {
        "no_rope_layers": no_rope_layers(cfg.n_layers, cfg.global_every),
        "no_rope_layer_interval": cfg.global_every or 4,
    }
    window = {
        "use_sliding_window": False,
        "sliding_window": None,
        "layer_types": ["full_attention"] * cfg.n_layers,
    }
    return {**fields, **nope, **window}


def check_export(cfg) -> None:
    """What transformers' SmolLM3 cannot express: rotated global layers with their own base, a window."""
    llama.check_export(cfg)
    if cfg.global_every and not cfg.global_nope:
        raise ConfigError("global_every without global_nope: transformers' SmolLM3's other kind is NoPE")
    if cfg.sliding_window or cfg.rope_local_theta or cfg.rope_linear or cfg.attn_scalar:
        raise ConfigError("transformers' SmolLM3 has no window, one rotary base and 1/sqrt(head_dim) scores")


HF = replace(llama.HF, model_type="smollm3", architecture="SmolLM3ForCausalLM", read=read, write=write,
             check_export=check_export)  # fmt: skip
FAMILY = replace(llama.FAMILY, name="smollm3", hf=HF, rope_scales_local=True)

# ``ModelConfig`` fields by preset name (the registry adds ``family``); smollm3-3b: HuggingFaceTB/SmolLM3-3B's
# config.json (vocabulary 128256 = 1002 x 128: no padding; NoPE on layers 4, 8, ..., 36).
PRESETS: dict[str, dict] = {
    # 4 layers, the fourth NoPE (chunks of 4 on pp: one pattern each), tied, 2 KV heads.
    "tiny-smollm3": dict(
        llama.TINY, n_layers=4, n_kv_heads=2, tie_embeddings=True, global_every=4, global_nope=True
    ),
    "smollm3-3b": dict(
        vocab_size=128256,
        d_model=2048,
        n_layers=36,
        d_ff=11008,
        n_heads=16,
        n_kv_heads=4,
        rope_theta=5e6,
        max_seq_len=65536,
        norm_eps=1e-6,
        tie_embeddings=True,
        global_every=4,
        global_nope=True,
    ),
}
