"""OLMo 2: Llama's attention and SwiGLU MLP with each branch's output normalized before the residual
add (``x + norm(attn(x))``, ``x + norm(mlp(x))``; no norm on a branch's input: block "post_norm"), and
an RMSNorm over the whole q and k projections before rotary (weights [H*E] and [K*E], split over mp
with the heads, the mean square gathered: ``Family.qk_norm`` "proj"). Every RMSNorm takes the product
with its weight in float32 before the cast, as transformers' Olmo2RMSNorm ("rms_product_first")."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import meshlm.model.families.llama as llama

# transformers' Olmo2Config defaults for fields a config.json may leave out, where they are not Llama's.
DEFAULTS = {"rms_norm_eps": 1e-5}


def read(hf: dict) -> dict[str, Any]:
    """Olmo2Config: Llama's fields with OLMo 2's defaults (``attention_bias`` is refused by the shared
    checks: meshlm's olmo2 has no biases)."""
    return llama.read({**DEFAULTS, **hf})


def write(cfg) -> dict[str, Any]:
    return {k: v for k, v in llama.write(cfg).items() if k != "mlp_bias"}


# Llama's tensors but the input norms: the post-branch norms, and the whole-projection q/k norms
# ("heads": ours [heads, E] <-> HF [heads*E]).
_LAYER = {k: v for k, v in llama.HF.layer.items() if k not in ("ln/scale", "ln2/scale")}
HF = replace(
    llama.HF,
    model_type="olmo2",
    architecture="Olmo2ForCausalLM",
    read=read,
    write=write,
    layer={
        **_LAYER,
        "post_attn_ln/scale": ("post_attention_layernorm.weight", "copy"),
        "post_mlp_ln/scale": ("post_feedforward_layernorm.weight", "copy"),
        "attn/q_norm/scale_heads": ("self_attn.q_norm.weight", "heads"),
        "attn/k_norm/scale_heads": ("self_attn.k_norm.weight", "heads"),
    },
)
FAMILY = replace(
    llama.FAMILY, name="olmo2", block="post_norm", norm="rms_product_first", qk_norm="proj", hf=HF
)

# ``ModelConfig`` fields by preset name (the registry adds ``family``); olmo2-7b: allenai/OLMo-2-1124-7B's
# config.json (vocabulary 100352, a multiple of 128: no padding).
PRESETS: dict[str, dict] = {
    # 2 KV heads: split on mp = 2, replicated on mp = 4 (the k norm's statistic then counts each KV
    # head mp / 2 times before its division).
    "tiny-olmo2": dict(llama.TINY, n_kv_heads=2, rope_theta=5e5),
    "olmo2-7b": dict(
        vocab_size=100352,
        d_model=4096,
        n_layers=32,
        d_ff=11008,
        n_heads=32,
        rope_theta=5e5,
        max_seq_len=4096,
        norm_eps=1e-6,
    ),
}
