"""Gemma 4 (text; transformers' ``Gemma4TextConfig`` / ``Gemma4ForCausalLM``): Gemma 3's sandwich block
and local/global layers with their own rotary (the global ones "proportional": only the first
``partial_rotary_factor`` of each head's pairs rotate), plus (``model.per_layer``): RMSNorms times w
(not 1 + w), per-head q/k norms, values RMS-normed without a weight, scores unscaled (``scaling`` 1),
each layer's output times its ``layer_scalar``, per-layer input embeddings
(``hidden_size_per_layer_input``), keys reused as values on the global layers (``attention_k_eq_v``)
and the last ``num_kv_shared_layers`` layers reading the keys and values of the last earlier layer of
their kind. The final logits soft-capped (``final_logit_softcapping``). The global layers may have an
attention shape of their own (``global_head_dim``: 512 where config.json leaves it out, as transformers;
with keys as values ``num_global_key_value_heads``; or transformers' saved ``per_layer_config``): their
parameters then stack apart (``model.per_layer_runs``), their rotary of their own head width.

The MoE block (``enable_moe_block``: the 26B-A4B) is the record ``MOE`` ("gemma4_moe", the reader
names it): every layer's feed-forward the dense MLP and ``num_experts`` experts side by side
(``model.per_layer.block``), each branch normed before and after, their sum normed; the router
(``model.moe``) reads the residual stream RMS-normed without a weight, times its ``scale`` [D] and
D^-0.5, then a softmax top ``top_k_experts``, renormalised, times the chosen experts'
``per_expert_scale``; the experts gelu-tanh gated, ``moe_intermediate_size`` units. transformers keeps
them fused ([E, 2I, D] gate then up, [E, D, I] down) in memory and on disk: read and written fused.

Refused in one line each (not built): the double-wide MLP of the shared layers
(``use_double_wide_mlp``: the E2B), bidirectional attention.

Each stack's layers are uniform (one scan per run): a shared layer's ``wk``, ``wv`` and a keys-as-values
layer's ``wv`` exist but are never read; they convert from zeros (transformers has none) and are not
written back (``HFNames.absent``)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import meshlm.model.families.gemma2 as gemma2
import meshlm.model.families.gemma3 as gemma3
import meshlm.model.families.llama as llama
from meshlm.errors import ConfigError
from meshlm.model.families.hf_fields import POSITIVE, SIZE, field, flag, unsupported
from meshlm.ranges import Range

DEFAULTS = {  # Gemma4TextConfig's defaults, where a config.json may leave a field out
    "head_dim": 256,
    "num_key_value_heads": 4,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": True,
    "sliding_window": 512,
    "hidden_size_per_layer_input": 256,
    "vocab_size_per_layer_input": 262144,
}
THETA = {gemma2.LOCAL: 1e4, gemma2.GLOBAL: 1e6}
REFUSED = {  # field -> (the value meshlm builds, why)
    "use_double_wide_mlp": (False, "the shared layers' double-wide MLP is not built yet"),
    "use_bidirectional_attention": (None, "meshlm's Gemma attends causally"),
    "attention_bias": (False, "Gemma 4 has no attention biases"),
}


def _rope(hf: dict) -> dict[str, Any]:
    """The two kinds' rotary: plain on the local layers, plain or "proportional" on the global ones."""
    params = hf.get("rope_parameters") or {
        gemma2.LOCAL: {"rope_type": "default", "rope_theta": 1e4},
        gemma2.GLOBAL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
    }
    if not isinstance(params, dict) or set(params) != set(THETA):
        raise unsupported("rope_parameters", params, f"give one dict per layer kind, {sorted(THETA)}")
    fields = {}
    for kind, one in params.items():
        kind_type = one.get("rope_type", "default") if isinstance(one, dict) else None
        allowed = ("default", "proportional") if kind == gemma2.GLOBAL else ("default",)
        if kind_type not in allowed:
            raise unsupported(f"rope_parameters.{kind}.rope_type", kind_type, f"meshlm implements {allowed}")
        extra = sorted(set(one) - {"rope_type", "rope_theta", "partial_rotary_factor", "factor"})
        if extra or one.get("factor", 1.0) != 1.0:
            raise unsupported(f"rope_parameters.{kind}", one, "rope_type, rope_theta, partial_rotary_factor")
        theta = float(field({"rope_theta": THETA[kind], **one}, "rope_theta", POSITIVE))
        fields["rope_theta" if kind == gemma2.GLOBAL else "rope_local_theta"] = theta
        if kind_type == "proportional":
            fraction = float(one.get("partial_rotary_factor", 1.0))
            fields["rope_global_fraction"] = 0.0 if fraction == 1.0 else fraction
    return fields


def _refused(hf: dict) -> None:
    for key, (built, why) in REFUSED.items():
        if hf.get(key, built) not in (built, None if built is False else built):
            raise unsupported(key, hf[key], f"{why}; meshlm reads {built}")


def _global_shape(hf: dict, every: int) -> dict[str, int]:
    """The global layers' head width and KV heads (0: the local layers'): transformers' saved
    ``per_layer_config``, else ``global_head_dim`` (transformers' default 512) and, only with keys as
    values (transformers' rule), ``num_global_key_value_heads`` (the hub's config.json fields)."""
    head, kv = field(hf, "head_dim", SIZE), field(hf, "num_key_value_heads", SIZE)
    n = field(hf, "num_hidden_layers", SIZE)
    full = {str(i) for i in range(n) if (i + 1) % every == 0}
    if hf.get("per_layer_config") is not None:
        g_head, g_kv = _per_layer_config(hf["per_layer_config"], full, head, kv)
    else:
        g_head = field(hf, "global_head_dim", SIZE, 512)
        keyed = flag(hf, "attention_k_eq_v")
        g_kv = field(hf, "num_global_key_value_heads", SIZE, kv, nullable=True) if keyed else kv
    if not full:  # no global layer: nothing of theirs
        g_head, g_kv = head, kv
    return {"global_head_dim": 0 if g_head == head else g_head, "global_kv_heads": 0 if g_kv == kv else g_kv}


def _per_layer_config(value, full: set[str], head: int, kv: int) -> tuple[int, int]:
    """(head width, KV heads) of transformers' ``per_layer_config`` (sparse: each layer's fields that
    differ from the config's): ``head_dim`` and ``num_key_value_heads`` overrides, the same on every
    full_attention layer and none on another."""
    fix = "meshlm reads one head_dim (and num_key_value_heads) override on every full_attention layer"
    index = lambda k: str(int(k)) if isinstance(k, int) or str(k).isdigit() else str(k)  # saved: "05"
    if not isinstance(value, dict) or not {index(k) for k in value} <= full:
        raise unsupported("per_layer_config", value, fix)
    layers = {index(k): one for k, one in value.items()}
    shapes = set()
    for i in full:
        one = layers.get(i, {})
        if not isinstance(one, dict) or set(one) - {"head_dim", "num_key_value_heads"}:
            raise unsupported("per_layer_config", value, fix)
        shapes.add((field(one, "head_dim", SIZE, head), field(one, "num_key_value_heads", SIZE, kv)))
    if len(shapes) > 1:
        raise unsupported("per_layer_config", value, fix)
    return shapes.pop() if shapes else (head, kv)


def _experts(hf: dict) -> dict[str, Any]:
    """The MoE block's fields (``enable_moe_block``: the record ``MOE``), none without it."""
    if not flag(hf, "enable_moe_block"):
        return {}
    return {
        "family": MOE_NAME,
        "n_experts": field(hf, "num_experts", SIZE),
        "experts_per_token": field(hf, "top_k_experts", SIZE),
        "moe_d_ff": field(hf, "moe_intermediate_size", SIZE),
        # not a Gemma4TextConfig field (transformers computes no aux loss for it): meshlm's, kept
        "router_aux_loss_coef": float(field(hf, "router_aux_loss_coef", Range(float, 0), 0.0)),
        **ROUTER,
    }


def read(hf: dict) -> dict[str, Any]:
    """Gemma4TextConfig (a multimodal config.json's ``text_config`` is not read: convert the text model)."""
    hf = {**DEFAULTS, **hf}
    _refused(hf)
    fields = llama.read({**hf, "rope_parameters": None, "rope_scaling": None, "rope_theta": None})
    ple = field(hf, "hidden_size_per_layer_input", Range(int, 0), 0, nullable=True)
    every = gemma2.global_every(hf, 6)
    return {
        **fields,
        **_experts(hf),
        "sliding_window": field(hf, "sliding_window", SIZE),
        "global_every": every,
        **_global_shape(hf, every),
        "attn_scalar": 1.0,  # transformers' scaling 1.0: the q/k norms set the scale
        "final_softcap": gemma2._softcap(hf, "final_logit_softcapping", None),
        **_rope(hf),
        "ple_dim": ple,
        "ple_vocab": _ple_vocab(hf, fields["vocab_size"]) if ple else 0,
        "kv_shared_layers": field(hf, "num_kv_shared_layers", Range(int, 0), 0),
        "k_eq_v": flag(hf, "attention_k_eq_v"),
        "value_norm": True,
        "layer_scalar": True,
    }


def _ple_vocab(hf: dict, vocab: int) -> int:
    """The per-layer table's rows, 0 where they are the vocabulary's (the canonical form)."""
    rows = field(hf, "vocab_size_per_layer_input", SIZE)
    return 0 if rows == vocab else rows


def write(cfg) -> dict[str, Any]:
    fields = gemma3.write(cfg)
    for key in ("query_pre_attn_scalar", "attn_logit_softcapping", "rope_theta", "rope_local_base_freq"):
        fields.pop(key, None)
    full = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_global_fraction:
        full = {"rope_type": "proportional", "rope_theta": cfg.rope_theta}
        full["partial_rotary_factor"] = cfg.rope_global_fraction
    local = {"rope_type": "default", "rope_theta": cfg.rope_local_theta or cfg.rope_theta}
    return {
        **fields,
        "rope_parameters": {gemma2.GLOBAL: full, gemma2.LOCAL: local},
        "use_bidirectional_attention": None,
        "hidden_size_per_layer_input": cfg.ple_dim,
        "vocab_size_per_layer_input": cfg.ple_vocab or cfg.vocab_size,
        "num_kv_shared_layers": cfg.kv_shared_layers,
        "attention_k_eq_v": cfg.k_eq_v,
        "global_head_dim": cfg.global_view().dim_per_head,
        "num_global_key_value_heads": cfg.global_view().kv_heads if cfg.k_eq_v else None,
        "enable_moe_block": cfg.arch.moe,
        "num_experts": cfg.n_experts or None,
        "top_k_experts": cfg.experts_per_token or None,
        "moe_intermediate_size": cfg.moe_d_ff or None,
        **({"router_aux_loss_coef": cfg.router_aux_loss_coef} if cfg.arch.moe else {}),
        "use_double_wide_mlp": False,
    }


def check_export(cfg) -> None:
    """What transformers' Gemma 4 cannot express."""
    llama.check_export(cfg)
    if not (cfg.sliding_window and cfg.global_every and cfg.n_layers % cfg.global_every == 0):
        raise ConfigError("transformers' Gemma 4 has local layers with a window and a global last layer")
    if cfg.attn_softcap or cfg.attn_scalar != 1.0 or cfg.rope_scaling or cfg.rope_linear:
        raise ConfigError("transformers' Gemma 4 has unscaled, uncapped scores and no RoPE scaling")
    if not (cfg.value_norm and cfg.layer_scalar):
        raise ConfigError("transformers' Gemma 4 norms the values and scales each layer: set both")
    if cfg.arch.moe and (cfg.shared_expert_d_ff or any(getattr(cfg, n) != v for n, v in ROUTER.items())):
        fixed = ", ".join(f"{n}={v!r}" for n, v in ROUTER.items())
        raise ConfigError(f"transformers' Gemma 4 routes with {fixed} and no shared expert; set them so")
    if cfg.global_view().kv_heads != cfg.kv_heads and not cfg.k_eq_v:
        raise ConfigError(
            "transformers' Gemma 4 gives the global layers KV heads of their own only with keys as values: "
            "set k_eq_v, or global_kv_heads=0"
        )


def absent(cfg) -> set[str]:
    """transformers' per-layer tensors a Gemma 4 layer does not have: a shared layer's k/v projections
    and norm, a keys-as-values (global) layer's v projection (ours: never read; zeros on import)."""
    kinds = gemma2.layer_types(cfg.n_layers, cfg.global_every)
    out = set()
    for i, kind in enumerate(kinds):
        prefix = HF.layer_prefix.format(i=i) + "self_attn."
        if i >= cfg.first_shared:
            out |= {prefix + name for name in ("k_proj.weight", "v_proj.weight", "k_norm.weight")}
        elif cfg.k_eq_v and kind == gemma2.GLOBAL:
            out.add(prefix + "v_proj.weight")
    return out


LAYER = {  # Gemma 3's tensors; its per-layer input and scalar
    **gemma3.HF.layer,
    "ple/gate/w": ("per_layer_input_gate.weight", "linear"),
    "ple/out/w": ("per_layer_projection.weight", "linear"),
    "ple/ple_ln/scale": ("post_per_layer_input_norm.weight", "copy"),
    "layer_scalar/scale": ("layer_scalar", "copy"),
}
TOP = {
    **gemma3.HF.top,
    "embed_per_layer/embeddings": ("model.embed_tokens_per_layer.weight", "copy"),
    "ple_proj/w": ("model.per_layer_model_projection.weight", "linear"),
    "ple_norm/scale": ("model.per_layer_projection_norm.weight", "copy"),
}
# The MoE block's (``MOE``): its norms, router and experts (fused in transformers' files: ``MOE_HF``)
MOE_LAYER = {
    **LAYER,
    "post_mlp_ln1/scale": ("post_feedforward_layernorm_1.weight", "copy"),
    "moe_ln/scale": ("pre_feedforward_layernorm_2.weight", "copy"),
    "post_moe_ln/scale": ("post_feedforward_layernorm_2.weight", "copy"),
    "moe/router/w": ("router.proj.weight", "linear"),
    "moe/router/scale": ("router.scale", "copy"),
    "moe/router/expert_scale": ("router.per_expert_scale", "copy"),
    "moe/experts/w_gate": ("experts.{e}.gate_proj", "experts"),
    "moe/experts/w_up": ("experts.{e}.up_proj", "experts"),
    "moe/experts/w_down": ("experts.{e}.down_proj", "experts"),
}
MOE_FUSED = {  # transformers' tensor -> the per-expert ones it concatenates on dim 1 (gate, then up)
    "experts.gate_up_proj": ("experts.{e}.gate_proj", "experts.{e}.up_proj"),
    "experts.down_proj": ("experts.{e}.down_proj",),
}
# The router record's fields Gemma 4 fixes (``model.router_fields``)
ROUTER = dict(
    router_score="softmax", norm_topk_prob=True, n_group=0, topk_group=0, routed_scaling_factor=1.0,
    router_bias=False, balance_bias=False, n_shared_experts=0, expert_bias=False, swiglu_limit=0.0,
    swiglu_alpha=0.0, weights_on_input=False, router_norm=True, expert_scale=True, expert_glu="geglu",
)  # fmt: skip
MOE_NAME = "gemma4_moe"
HF = replace(
    gemma3.HF,
    model_type="gemma4_text",
    architecture="Gemma4ForCausalLM",
    read=read,
    write=write,
    check_export=check_export,
    top=TOP,
    layer=LAYER,
    absent=absent,
)
FAMILY = replace(
    gemma3.FAMILY, name="gemma4", block="per_layer", norm="rms_product_first", qk_norm="head", hf=HF
)
MOE_HF = replace(HF, layer=MOE_LAYER, fused=MOE_FUSED, fused_on_disk=True)
# the 26B-A4B's record (``read`` names it): a third row-parallel sum per layer, the experts' beside the MLP's
MOE = replace(FAMILY, name=MOE_NAME, moe=True, hf=MOE_HF, row_sums=FAMILY.row_sums + 1)
MORE = (MOE,)  # the registry lists it beside ``FAMILY``

# Gemma 4's own pieces, in every preset: no query scaling, two rotary bases (the global layers rotate a
# quarter of their pairs), the value norm and the layers' scalars
ARCH = dict(
    attn_scalar=1.0,
    rope_theta=1e6,
    rope_local_theta=1e4,
    rope_global_fraction=0.25,
    value_norm=True,
    layer_scalar=True,
)
REAL = dict(  # what the real Gemma 4 text models share
    ARCH,
    vocab_size=262144,
    head_dim=256,
    global_head_dim=512,
    norm_eps=1e-6,
    tie_embeddings=True,
    global_every=6,
    final_softcap=30.0,
)
TINY = dict(gemma2.TINY, **ARCH, n_layers=6, global_every=3, final_softcap=0.5, ple_dim=16)
TINY |= dict(kv_shared_layers=2, k_eq_v=True)
# ``ModelConfig`` fields by preset name (the registry adds ``family``).
PRESETS: dict[str, dict] = {
    # 6 layers (local, local, global, twice), a window of 8 < verify's 64 positions; the last 2 layers
    # read the KV of layers 3 (local) and 2 (global); per-layer inputs of 16; keys as values on the
    # global layers; the global layers rotate a quarter of their pairs.
    "tiny-gemma4": TINY,
    # tiny-gemma4's features with the MoE block beside every layer's MLP: 8 experts of 16 units, 2 per
    # token (the record ``MOE``), an aux loss so the routing statistics reach the loss (with 4 experts
    # the proof's planted 3-way router tie makes the loss blind to how the statistics are summed).
    "tiny-gemma4-moe": dict(TINY, **ROUTER, family=MOE_NAME, n_experts=8, experts_per_token=2, moe_d_ff=16)
    | dict(router_aux_loss_coef=0.01),
    # google/gemma-4-E4B and gemma-4-31B's text config.json, written from memory (no hub here): heads
    # of 256 on the local layers (window 512 / 1024), 512 on every sixth, global layer (proportional
    # RoPE, a quarter of its pairs); E4B per-layer inputs of 256 and the last 18 layers reading the KV
    # of the last earlier layer of their kind; 31B 4 KV heads of its own on the global layers, keys as
    # values there. (The E2B's shared layers have a double-wide MLP, not built: no preset.)
    "gemma4-e4b": dict(
        REAL, d_model=2560, n_layers=42, d_ff=10240, n_heads=8, n_kv_heads=2, sliding_window=512
    )
    | dict(max_seq_len=131072, ple_dim=256, kv_shared_layers=18),
    # google/gemma-4-26B-A4B's text config.json, written from memory (no hub here; `meshlm configs` gives
    # 25.2B parameters, 3.8B active, the name's 26B and A4B): 30 layers of 2816, 16 heads, 8 KV heads of
    # 256 local (window 1024), 2 of 512 on the global ones with keys as values; beside each layer's MLP
    # of 2112, 128 experts of 704 units, 8 per token.
    "gemma4-26b-a4b": dict(REAL, **ROUTER, family=MOE_NAME, d_model=2816, n_layers=30, d_ff=2112)
    | dict(n_heads=16, n_kv_heads=8, max_seq_len=262144, sliding_window=1024, global_kv_heads=2, k_eq_v=True)
    | dict(n_experts=128, experts_per_token=8, moe_d_ff=704),
    "gemma4-31b": dict(REAL, d_model=5376, n_layers=60, d_ff=21504, n_heads=32, n_kv_heads=16)
    | dict(max_seq_len=262144, sliding_window=1024, global_kv_heads=4, k_eq_v=True),
}
