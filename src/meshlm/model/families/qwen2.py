"""Qwen2 / Qwen2.5: Llama's blocks plus biases on the q/k/v projections (column-parallel: sliced with
their heads), no output-projection bias; tied embeddings on the small models; rope_theta 1e6. No
sliding window (transformers' ``use_sliding_window`` is refused)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import meshlm.model.families.llama as llama
from meshlm.model.families.hf_fields import flag, unsupported


def read(hf: dict) -> dict[str, Any]:
    """Qwen2Config: Llama's fields (its q/k/v biases are the family's); no sliding window."""
    if flag(hf, "use_sliding_window"):
        raise unsupported("use_sliding_window", True, "meshlm's qwen2 attends to the whole context")
    for key in ("use_mrope",):  # Qwen2-VL's multimodal rotary
        if flag(hf, key):
            raise unsupported(key, True, "meshlm's qwen2 has plain 1-D rotary positions")
    kinds = hf.get("layer_types") or []
    if not isinstance(kinds, list) or any(k != "full_attention" for k in kinds):
        raise unsupported("layer_types", kinds, "meshlm's qwen2 has only 'full_attention' layers")
    return llama.read(hf)


def write(cfg) -> dict[str, Any]:
    fields = {k: v for k, v in llama.write(cfg).items() if k not in ("attention_bias", "mlp_bias")}
    window = {"use_sliding_window": False, "sliding_window": None, "max_window_layers": cfg.n_layers}
    return {**fields, **window, "layer_types": ["full_attention"] * cfg.n_layers}


# Llama's tensors plus the q/k/v biases ("heads": ours [heads, E] <-> HF [heads*E]).
HF = replace(
    llama.HF,
    model_type="qwen2",
    architecture="Qwen2ForCausalLM",
    read=read,
    write=write,
    layer={
        **llama.HF.layer,
        "attn/bq": ("self_attn.q_proj.bias", "heads"),
        "attn/bk": ("self_attn.k_proj.bias", "heads"),
        "attn/bv": ("self_attn.v_proj.bias", "heads"),
    },
)
# Llama's blocks with biases on q/k/v (column-parallel: sliced with their heads).
FAMILY = replace(llama.FAMILY, name="qwen2", hf=HF, qkv_bias=True)

# ``ModelConfig`` fields by preset name (the registry adds ``family``); qwen2.5-7b: Qwen/Qwen2.5-7B's
# config.json (its vocabulary a multiple of 128: no padding).
PRESETS: dict[str, dict] = {
    # Qwen2.5-0.5B-style: q/k/v biases, 2 KV heads, tied embeddings, rope_theta 1e6.
    "tiny-qwen2": dict(llama.TINY, n_kv_heads=2, rope_theta=1e6, tie_embeddings=True),
    "qwen2.5-7b": dict(
        vocab_size=152064,
        d_model=3584,
        n_layers=28,
        d_ff=18944,
        n_heads=28,
        n_kv_heads=4,
        rope_theta=1e6,
        max_seq_len=131072,
        norm_eps=1e-6,
    ),
}
