"""Mistral: Llama's blocks and tensors; what differs is in its config, a sliding attention window
(``ModelConfig.sliding_window``; none on v0.3)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import meshlm.model.families.llama as llama
from meshlm.model.families.hf_fields import SIZE, field, unsupported

WINDOW = 4096  # transformers' MistralConfig.sliding_window when config.json has none
# transformers' defaults for fields a config.json may leave out, where they are not Llama's.
DEFAULTS = {"max_position_embeddings": 4096 * 32}


def read(hf: dict) -> dict[str, Any]:
    """Llama's fields plus ``sliding_window``: absent means transformers' default (``WINDOW``), null
    means none (v0.3)."""
    if hf.get("layer_types") is not None:
        raise unsupported("layer_types", hf["layer_types"], "meshlm's mistral uses one window in every layer")
    null = "sliding_window" in hf and hf["sliding_window"] is None
    window = 0 if null else field(hf, "sliding_window", SIZE, WINDOW)
    return {**llama.read({**DEFAULTS, **hf}), "sliding_window": window}


def write(cfg) -> dict[str, Any]:
    return {**llama.write(cfg), "sliding_window": cfg.sliding_window or None}  # null: no window


HF = replace(llama.HF, model_type="mistral", architecture="MistralForCausalLM", read=read, write=write)
FAMILY = replace(llama.FAMILY, name="mistral", hf=HF)

# ``ModelConfig`` fields by preset name (the registry adds ``family``).
PRESETS: dict[str, dict] = {
    # Llama's blocks with a sliding window (16 < verify's 64 positions: the window is exercised).
    "tiny-mistral": dict(llama.TINY_LLAMA, sliding_window=16),
    # A window of 10: with blocks of 8 a K/V block ends exactly at some query block's oldest visible
    # key (8a - 10 + 1 = 8(a - 2) + 7), where the block-skip rule's off-by-one shows (a window that is
    # a multiple of the block never puts the window's edge at a block's end).
    "tiny-mistral-w10": dict(llama.TINY_LLAMA, sliding_window=10),
    # Mistral-7B v0.1 (its config.json; v0.3 differs: vocab 32768, rope_theta 1e6, no window).
    "mistral-7b": dict(llama.LLAMA2_7B, d_ff=14336, n_kv_heads=8, max_seq_len=32768, sliding_window=4096),
}
