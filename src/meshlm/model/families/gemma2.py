"""Gemma 2: Gemma's GeGLU MLP (tanh GELU), (1 + w) RMSNorm, embeddings times sqrt(d_model) and tied
head, in a "sandwich" block (each branch normalized before and after: input_layernorm,
post_attention_layernorm, pre_feedforward_layernorm, post_feedforward_layernorm), with local and global
layers alternating (``layer_types``: the local ones see ``sliding_window`` keys; ``global_every`` 2),
attention scores scaled by 1/sqrt(query_pre_attn_scalar) and soft-capped (``attn_logit_softcapping``),
and the output logits soft-capped (``final_logit_softcapping``). One rotary base on every layer.

The readers of ``layer_types``, the attention scale and the soft-caps are shared with Gemma 3
(``gemma3``)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import meshlm.model.families.llama as llama
from meshlm.errors import ConfigError
from meshlm.model.families.hf_fields import POSITIVE, SIZE, field, unsupported

LOCAL, GLOBAL = "sliding_attention", "full_attention"  # transformers' layer_types
# transformers' Gemma2Config defaults for fields a config.json may leave out, where they are not Llama's.
DEFAULTS = {
    "head_dim": 256,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
    "num_key_value_heads": 4,
}
SOFTCAPS = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}  # Gemma2Config's defaults
ACTIVATIONS = ("gelu_pytorch_tanh",)


def global_every(hf: dict, default: int) -> int:
    """``layer_types`` as meshlm's ``global_every``: the local/global pattern must repeat (every N-th
    layer global, the others local, as in every released Gemma 2 and 3); absent: every ``default``-th.
    With no global layer at all, N is past the last layer."""
    n = field(hf, "num_hidden_layers", SIZE)
    kinds = hf.get("layer_types")
    if kinds is None:
        return default
    if not isinstance(kinds, list) or len(kinds) != n or any(k not in (LOCAL, GLOBAL) for k in kinds):
        raise unsupported("layer_types", kinds, f"give num_hidden_layers={n} of {LOCAL!r} / {GLOBAL!r}")
    every = kinds.index(GLOBAL) + 1 if GLOBAL in kinds else n + 1
    if kinds != layer_types(n, every):
        raise unsupported("layer_types", kinds, "meshlm takes a repeating pattern: every N-th layer global")
    return every


def layer_types(n_layers: int, every: int) -> list[str]:
    """transformers' layer_types of ``global_every`` = ``every`` (0: every layer local)."""
    return [GLOBAL if every and (i + 1) % every == 0 else LOCAL for i in range(n_layers)]


def _softcap(hf: dict, key: str, default: float | None) -> float:
    """A soft-cap field: absent means transformers' default, null none (0 in meshlm)."""
    if (key in hf and hf[key] is None) or (key not in hf and default is None):
        return 0.0
    return float(field(hf, key, POSITIVE, default))


def attention_fields(hf: dict, head_dim: int, every: int, softcaps: dict) -> dict[str, Any]:
    """What Gemma 2 and 3 share: the window, the layer kinds, the attention scale, the soft-caps."""
    if hf.get("use_bidirectional_attention") not in (None, False):
        raise unsupported("use_bidirectional_attention", True, "meshlm's Gemma attends causally")
    scalar = field(hf, "query_pre_attn_scalar", POSITIVE, 256)
    return dict(
        sliding_window=field(hf, "sliding_window", SIZE, 4096),
        global_every=global_every(hf, every),
        attn_scalar=0.0 if scalar == head_dim else float(scalar),  # 0: 1/sqrt(head_dim)
        attn_softcap=_softcap(hf, "attn_logit_softcapping", softcaps["attn_logit_softcapping"]),
        final_softcap=_softcap(hf, "final_logit_softcapping", softcaps["final_logit_softcapping"]),
    )


def read(hf: dict) -> dict[str, Any]:
    """Gemma2Config: Llama's fields with Gemma 2's defaults, plus the alternating layers, the attention
    scale and the soft-caps. One rotary base, plain RoPE (no released Gemma 2 scales it)."""
    fields = llama.read({**DEFAULTS, **hf})  # hidden_act: transformers' Gemma 2 reads hidden_activation
    if fields["rope_scaling"] is not None:
        raise unsupported("rope_parameters.rope_type", "llama3", "Gemma 2 has plain RoPE")
    head_dim = fields["head_dim"] or fields["d_model"] // fields["n_heads"]
    return {**fields, **attention_fields({**DEFAULTS, **hf}, head_dim, 2, SOFTCAPS)}


def attention_written(cfg) -> dict[str, Any]:
    """The config.json fields of ``attention_fields`` (transformers 5's names; ints stay ints: its
    config classes are strict about them)."""
    scalar = cfg.attn_scalar or cfg.dim_per_head
    return {
        "hidden_activation": ACTIVATIONS[0],
        "query_pre_attn_scalar": int(scalar) if float(scalar).is_integer() else scalar,
        "sliding_window": cfg.sliding_window,
        "layer_types": layer_types(cfg.n_layers, cfg.global_every),
        "attn_logit_softcapping": cfg.attn_softcap or None,
        "final_logit_softcapping": cfg.final_softcap or None,
        "use_bidirectional_attention": False,
    }


def write(cfg) -> dict[str, Any]:
    dropped = ("hidden_act", "mlp_bias", "rope_scaling")
    fields = {k: v for k, v in llama.write(cfg).items() if k not in dropped}
    return {**fields, **attention_written(cfg)}


def check_export(cfg) -> None:
    """What transformers' Gemma 2 cannot express: no window (its local layers always have one), a
    second rotary base or scaled RoPE."""
    llama.check_export(cfg)
    if not cfg.sliding_window:
        raise ConfigError("sliding_window=0: transformers' Gemma 2 local layers have a window; set one")
    for name in ("rope_local_theta", "rope_linear", "rope_scaling"):
        if getattr(cfg, name):
            raise ConfigError(f"{name}={getattr(cfg, name)}: transformers' Gemma 2 has one plain RoPE; unset")


# Gemma's tensors in the sandwich block: the input norms and the norms after each branch.
LAYER = {
    **{k: v for k, v in llama.HF.layer.items() if k not in ("ln/scale", "ln2/scale")},
    "ln/scale": ("input_layernorm.weight", "copy"),
    "post_attn_ln/scale": ("post_attention_layernorm.weight", "copy"),
    "ln2/scale": ("pre_feedforward_layernorm.weight", "copy"),
    "post_mlp_ln/scale": ("post_feedforward_layernorm.weight", "copy"),
}
HF = replace(
    llama.HF,
    model_type="gemma2",
    architecture="Gemma2ForCausalLM",
    activation_key="hidden_activation",
    activations=ACTIVATIONS,
    read=read,
    write=write,
    check_export=check_export,
    layer=LAYER,
)
FAMILY = replace(
    llama.FAMILY, name="gemma2", block="sandwich", norm="rms_plus_one", mlp="geglu", hf=HF, embed_scale=True
)

# The tiny shape Gemma 2 and 3 share: 4 heads of 32 on d_model 64 (head_dim != d_model / heads), 2 KV
# heads (replicated on mp = 4), tied head, a window of 8 < verify's 64 positions, and an attention
# scalar 24 != head_dim (so the scale matters).
TINY = dict(
    llama.TINY, n_heads=4, n_kv_heads=2, head_dim=32, tie_embeddings=True, sliding_window=8, attn_scalar=24.0
)
# ``ModelConfig`` fields by preset name (the registry adds ``family``); gemma2-9b and gemma2-27b: the
# config.json of google/gemma-2-9b and google/gemma-2-27b (vocabulary 256000 = 2000 x 128: no padding).
GEMMA2 = dict(
    vocab_size=256000,
    max_seq_len=8192,
    norm_eps=1e-6,
    tie_embeddings=True,
    sliding_window=4096,
    global_every=2,
    attn_softcap=50.0,
    final_softcap=30.0,
)
PRESETS: dict[str, dict] = {
    # 4 layers: local, global, local, global. Caps small enough to bend the tiny model's scores and
    # logits (the released 50 and 30 would barely touch them).
    "tiny-gemma2": dict(TINY, n_layers=4, global_every=2, attn_softcap=0.1, final_softcap=0.5),
    "gemma2-9b": dict(GEMMA2, d_model=3584, n_layers=42, d_ff=14336, n_heads=16, n_kv_heads=8, head_dim=256),
    "gemma2-27b": dict(
        GEMMA2,
        d_model=4608,
        n_layers=46,
        d_ff=36864,
        n_heads=32,
        n_kv_heads=16,
        head_dim=128,
        attn_scalar=144.0,
    ),
}
