"""Qwen3 (dense): Llama's blocks with an RMSNorm on each query and key head before rotary (weights
[head_dim], shared by the heads: ``Family.qk_norm`` "head"), no q/k/v biases (Qwen2's are gone), an
explicit head_dim (128 in the released models, whatever hidden_size / heads), rope_theta 1e6, tied
embeddings on the small models only. No sliding window (``use_sliding_window`` is refused, as Qwen2's)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import meshlm.model.families.llama as llama
from meshlm.model.families.hf_fields import flag, unsupported

# transformers' Qwen3Config defaults for fields a config.json may leave out, where they are not Llama's.
DEFAULTS = {"head_dim": 128, "max_position_embeddings": 32768}


def read(hf: dict) -> dict[str, Any]:
    """Qwen3Config: Llama's fields with Qwen3's defaults; no sliding window, full-attention layers only
    (``attention_bias`` is refused by the shared checks: Qwen3 has none)."""
    if flag(hf, "use_sliding_window"):
        raise unsupported("use_sliding_window", True, "meshlm's qwen3 attends to the whole context")
    kinds = hf.get("layer_types") or []
    if not isinstance(kinds, list) or any(k != "full_attention" for k in kinds):
        raise unsupported("layer_types", kinds, "meshlm's qwen3 has only 'full_attention' layers")
    return llama.read({**DEFAULTS, **hf})


def write(cfg) -> dict[str, Any]:
    fields = {k: v for k, v in llama.write(cfg).items() if k != "mlp_bias"}
    window = {"use_sliding_window": False, "sliding_window": None, "max_window_layers": cfg.n_layers}
    return {**fields, **window, "layer_types": ["full_attention"] * cfg.n_layers}


# Llama's tensors plus the per-head q/k norms ([head_dim] in both).
HF = replace(
    llama.HF,
    model_type="qwen3",
    architecture="Qwen3ForCausalLM",
    read=read,
    write=write,
    layer={
        **llama.HF.layer,
        "attn/q_norm/scale": ("self_attn.q_norm.weight", "copy"),
        "attn/k_norm/scale": ("self_attn.k_norm.weight", "copy"),
    },
)
FAMILY = replace(llama.FAMILY, name="qwen3", hf=HF, qk_norm="head")

# ``ModelConfig`` fields by preset name (the registry adds ``family``); qwen3-8b and qwen3-32b: the
# config.json of Qwen/Qwen3-8B and Qwen/Qwen3-32B (vocabulary 151936, a multiple of 128: no padding);
# qwen3-0.6b and qwen3-1.7b: Qwen/Qwen3-0.6B and Qwen3-1.7B's (tied embeddings), models that fill one
# 16 GiB chip (docs/memory.md: `meshlm plan` on one chip).
PRESETS: dict[str, dict] = {
    # head_dim 16 != d_model / n_heads = 8 (as Qwen3-32B's 128 != 5120 / 64), 2 KV heads (replicated
    # on mp = 4), an untied head.
    "tiny-qwen3": dict(llama.TINY, n_kv_heads=2, head_dim=16, rope_theta=1e6),
    "qwen3-8b": dict(
        vocab_size=151936,
        d_model=4096,
        n_layers=36,
        d_ff=12288,
        n_heads=32,
        n_kv_heads=8,
        rope_theta=1e6,
        max_seq_len=40960,
        norm_eps=1e-6,
    ),
    "qwen3-32b": dict(
        vocab_size=151936,
        d_model=5120,
        n_layers=64,
        d_ff=25600,
        n_heads=64,
        n_kv_heads=8,
        head_dim=128,
        rope_theta=1e6,
        max_seq_len=40960,
        norm_eps=1e-6,
    ),
    "qwen3-0.6b": dict(
        vocab_size=151936,
        d_model=1024,
        n_layers=28,
        d_ff=3072,
        n_heads=16,
        n_kv_heads=8,
        head_dim=128,  # != 1024 / 16: Qwen3's explicit head_dim
        rope_theta=1e6,
        max_seq_len=40960,
        norm_eps=1e-6,
        tie_embeddings=True,
    ),
    "qwen3-1.7b": dict(
        vocab_size=151936,
        d_model=2048,
        n_layers=28,
        d_ff=6144,
        n_heads=16,
        n_kv_heads=8,
        head_dim=128,
        rope_theta=1e6,
        max_seq_len=40960,
        norm_eps=1e-6,
        tie_embeddings=True,
    ),
}
