"""Llama 4 (text), its attention side: chunked attention (a query sees only the keys of its chunk,
``attention_chunk_size``: ``attn_chunk``, a mask rule of the variant record) on the rotated layers and
NoPE global layers on the rest (``no_rope_layers``: every fourth layer, meshlm's global layer kind with
its rotary off, ``global_nope``), which see the whole context.

What meshlm does not compute yet is refused in one line before any work: the L2 q/k norm, the attention
temperature on the NoPE layers (``attn_temperature_tuning``, ``floor_scale``, ``attn_scale``) and the
top-1 MoE with a shared expert. So no Llama 4 config.json converts today; ``tiny-llama4`` proves the
chunks and NoPE layers under a dense SwiGLU MLP."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import meshlm.model.families.llama as llama
from meshlm.errors import ConfigError
from meshlm.model.families.hf_fields import unsupported

MISSING = (
    "Llama 4's L2 q/k norm, attention temperature and top-1 MoE with a shared expert are not in meshlm yet"
)


def read(hf: dict) -> dict[str, Any]:
    """Llama4TextConfig: refused (``MISSING``)."""
    raise unsupported("use_qk_norm", hf.get("use_qk_norm", True), MISSING)


def check_export(cfg) -> None:
    raise ConfigError(f"export to transformers' Llama 4: {MISSING}; keep the meshlm checkpoint")


HF = replace(
    llama.HF, model_type="llama4_text", architecture="Llama4ForCausalLM", read=read, check_export=check_export
)
FAMILY = replace(llama.FAMILY, name="llama4", hf=HF)

# ``ModelConfig`` fields by preset name (the registry adds ``family``).
PRESETS: dict[str, dict] = {
    # 4 layers: three chunked (chunks of 8 under verify's 64 positions) and rotated, the fourth NoPE
    # with the whole context; 2 KV heads.
    "tiny-llama4": dict(llama.TINY, n_layers=4, n_kv_heads=2, attn_chunk=8, global_every=4, global_nope=True),
}
