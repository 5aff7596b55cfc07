"""gpt-oss, its attention side: learned attention sinks (a logit per query head joining each softmax's
normaliser: ``attn_sinks``, the variant's ``finish``) on every layer, a 128-token sliding window on
alternate layers (``layer_types``: sliding, full, ...; meshlm's local and global layer kinds,
``global_every`` 2), grouped-query attention with head_dim 64.

What meshlm does not compute yet is refused in one line before any work: the mixture of experts (router
and expert biases, the clamped SwiGLU: ``swiglu_alpha``, ``swiglu_limit``), the q/k/v/o biases and YaRN.
So no gpt-oss config.json converts today; ``tiny-gpt-oss`` proves the attention side (sinks and windows)
under a dense SwiGLU MLP, and the real sizes are planned when the experts land."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import meshlm.model.families.llama as llama
from meshlm.errors import ConfigError
from meshlm.model.families.hf_fields import unsupported

MOE_MISSING = "gpt-oss's mixture of experts (router and expert biases, clamped SwiGLU) is not in meshlm yet"


def read(hf: dict) -> dict[str, Any]:
    """GptOssConfig: refused (``MOE_MISSING``): every gpt-oss layer's feed-forward is its MoE."""
    raise unsupported("num_local_experts", hf.get("num_local_experts", 128), MOE_MISSING)


def check_export(cfg) -> None:
    raise ConfigError(f"export to transformers' gpt-oss: {MOE_MISSING}; keep the meshlm checkpoint")


HF = replace(
    llama.HF, model_type="gpt_oss", architecture="GptOssForCausalLM", read=read, check_export=check_export
)
FAMILY = replace(llama.FAMILY, name="gpt_oss", hf=HF)

# ``ModelConfig`` fields by preset name (the registry adds ``family``).
PRESETS: dict[str, dict] = {
    # 4 layers (sliding, full, sliding, full) with sinks, a window of 8 under verify's 64-token text,
    # 2 KV heads (split on mp = 2, replicated on mp = 4).
    "tiny-gpt-oss": dict(
        llama.TINY, n_layers=4, n_kv_heads=2, sliding_window=8, global_every=2, attn_sinks=True
    ),
}
