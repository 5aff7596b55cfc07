"""Gemma 1: Llama's sequential blocks with a GeGLU MLP (tanh GELU), RMSNorm times (1 + w), embeddings
times sqrt(d_model), a tied head (its presets) and head_dim 256 whatever d_model / n_heads. Llama's
tensor names."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import meshlm.model.families.llama as llama
from meshlm.model.families.hf_fields import unsupported

# transformers' GemmaConfig defaults for fields a config.json may leave out, where they are not Llama's.
DEFAULTS = {"head_dim": 256, "max_position_embeddings": 8192, "tie_word_embeddings": True}
# Fields of Gemma 2 (and later) that a model_type "gemma" config must not set: never silently dropped.
GEMMA2_FIELDS = (
    "final_logit_softcapping",
    "attn_logit_softcapping",
    "query_pre_attn_scalar",
    "sliding_window",
    "layer_types",
    "use_bidirectional_attention",
)
# Its activation is tanh GELU ("gelu" is transformers' legacy spelling of the same: GemmaConfig turns
# it into "gelu_pytorch_tanh").
ACTIVATIONS = ("gelu_pytorch_tanh", "gelu")


def read(hf: dict) -> dict[str, Any]:
    """Llama's fields with GemmaConfig's defaults; Gemma 2's fields (soft-capping, alternating local
    and global layers, ...) are refused by name: transformers' Gemma would ignore them."""
    for key in GEMMA2_FIELDS:
        if hf.get(key) not in (None, False):
            raise unsupported(key, hf[key], "it is Gemma 2's; meshlm implements Gemma 1 (model_type gemma)")
    act = hf.get("hidden_activation")  # the legacy key; transformers 5 reads hidden_act only
    if act not in (None, ACTIVATIONS[0]):
        raise unsupported("hidden_activation", act, f"Gemma uses {ACTIVATIONS[0]!r}")
    return llama.read({**DEFAULTS, **hf})


def write(cfg) -> dict[str, Any]:
    return {**llama.write(cfg), "hidden_act": ACTIVATIONS[0]}


HF = replace(
    llama.HF,
    model_type="gemma",
    architecture="GemmaForCausalLM",
    activations=ACTIVATIONS,
    read=read,
    write=write,
)
FAMILY = replace(llama.FAMILY, name="gemma", norm="rms_plus_one", mlp="geglu", hf=HF, embed_scale=True)

# ``ModelConfig`` fields by preset name (the registry adds ``family``).
PRESETS: dict[str, dict] = {
    # head_dim 32 != d_model / n_heads = 16 (as Gemma-7b's 256 != 3072 / 16), tied head.
    "tiny-gemma": dict(llama.TINY_LLAMA, n_heads=4, n_kv_heads=0, head_dim=32, tie_embeddings=True),
    # tiny-gemma with Gemma 2's two soft-caps, near the scores' and logits' size at initialisation
    # (tanh neither linear nor saturated there, so the cap and its slope both matter): the proof of
    # soft-capping in every attention (plain, blockwise, each --cp strategy). Not exportable.
    "tiny-gemma-softcap": dict(
        llama.TINY_LLAMA,
        n_heads=4,
        n_kv_heads=0,
        head_dim=32,
        tie_embeddings=True,
        attn_softcap=0.05,
        final_softcap=0.2,
    ),
    # Gemma-7B (its config.json): 16 heads of 256 on d_model 3072, vocabulary 256000, tied head.
    "gemma-7b": dict(
        vocab_size=256000,
        d_model=3072,
        n_layers=28,
        d_ff=24576,
        n_heads=16,
        head_dim=256,
        max_seq_len=8192,
        norm_eps=1e-6,
        tie_embeddings=True,
    ),
}
