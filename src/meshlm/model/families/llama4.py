"""Llama 4 (text): chunked attention (a query sees only the keys of its chunk, ``attention_chunk_size``:
``attn_chunk``, a mask rule of the variant record) on the rotated layers and NoPE global layers on the
rest (``no_rope_layers``: every fourth layer, meshlm's global layer kind with its rotary off,
``global_nope``), which see the whole context. Rotary is Meta's complex pairs (meshlm's "interleaved").
The attention variant's query rules (``Variant.queries``): an L2 norm of each rotated q and k head
(``use_qk_norm``: ``qk_l2_norm``, the rotated layers only, as transformers), and on the NoPE layers the
queries times the temperature log1p(floor((p + 1) / floor_scale)) attn_scale + 1
(``attn_temperature_tuning``: ``attn_floor_scale``, ``attn_temp_scale``).

The feed-forward of every ``interleave_moe_layer_step``-th layer (``moe_layers``) is a mixture of
experts: the router's top-1 logit, its sigmoid the weight (``router_score`` "sigmoid", not
renormalised), which multiplies the token *before* its expert (``weights_on_input``), plus one always-on
shared expert of the experts' width (``n_shared_experts`` 1); the other layers are dense MLPs of
``intermediate_size_mlp`` units (``d_ff``; the experts' ``intermediate_size`` is ``moe_d_ff``). The
experts' fused ``gate_up_proj`` [E, D, 2I] is gate then up on its last dim (``HFNames.concatenated``)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import meshlm.model.families.llama as llama
import meshlm.model.families.qwen3_moe as qwen3_moe
import meshlm.model.families.smollm3 as smollm3
from meshlm.errors import ConfigError
from meshlm.model.families.hf_fields import POSITIVE, SIZE, field, flag, unsupported
from meshlm.model.rope import RopeScaling

NAME = "llama4"
# Llama4TextConfig's defaults where a config.json may leave a field out and Llama's differ.
DEFAULTS = {
    "intermediate_size": 8192,
    "intermediate_size_mlp": 16384,
    "num_local_experts": 16,
    "num_experts_per_tok": 1,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072,
    "router_aux_loss_coef": 0.001,
    "use_qk_norm": True,
    "attention_chunk_size": 8192,
    "attn_temperature_tuning": True,
    "floor_scale": 8192,
    "attn_scale": 0.1,
}
# The router record's fields Llama 4 fixes (``model.router_fields``).
ROUTER = dict(router_score="sigmoid", norm_topk_prob=False, weights_on_input=True, n_shared_experts=1)


def moe_layers(hf: dict, n_layers: int) -> list[int]:
    """transformers' ``moe_layers`` (else every ``interleave_moe_layer_step``-th layer, the last of each
    step) -> meshlm's ``dense_layers``, the others."""
    step = field(hf, "interleave_moe_layer_step", SIZE, 1)
    moe = hf.get("moe_layers")
    moe = list(range(step - 1, n_layers, step)) if moe is None else moe
    if not isinstance(moe, list) or any(not isinstance(i, int) or not 0 <= i < n_layers for i in moe):
        raise unsupported("moe_layers", moe, f"give layer indices below num_hidden_layers={n_layers}")
    return [i for i in range(n_layers) if i not in moe]


def read(hf: dict) -> dict[str, Any]:
    """Llama4TextConfig: Llama's fields with Llama 4's defaults, its chunks, NoPE layers, query rules and
    top-1 experts with a shared expert."""
    hf = {**DEFAULTS, **hf}
    if hf.get("router_jitter_noise"):
        raise unsupported("router_jitter_noise", hf["router_jitter_noise"], "meshlm routes without noise")
    if hf.get("layer_types") is not None and hf["layer_types"] != _layer_types(hf):
        raise unsupported(
            "layer_types", hf["layer_types"], "chunked on the rotated layers, full on NoPE ones"
        )
    fields = llama.read({**hf, "intermediate_size": hf["intermediate_size_mlp"]})
    every = smollm3.nope_every(hf)
    moe = qwen3_moe.experts(hf, "num_local_experts", "intermediate_size", (16, 1, 8192))
    temperature = flag(hf, "attn_temperature_tuning") and bool(every)
    return {
        **fields,
        **moe,
        **ROUTER,
        "dense_layers": tuple(moe_layers(hf, fields["n_layers"])),
        "global_every": every,
        "global_nope": bool(every),
        "attn_chunk": field(hf, "attention_chunk_size", SIZE, 0, nullable=True),
        "qk_l2_norm": flag(hf, "use_qk_norm"),
        "attn_floor_scale": float(field(hf, "floor_scale", POSITIVE)) if temperature else 0.0,
        "attn_temp_scale": float(field(hf, "attn_scale", POSITIVE)) if temperature else 0.0,
    }


def _layer_types(hf: dict) -> list[str]:
    """transformers' default layer_types: chunked where rotated (and chunks are on), else full."""
    n, chunk = field(hf, "num_hidden_layers", SIZE), hf.get("attention_chunk_size")
    rotated = hf.get("no_rope_layers") or smollm3.no_rope_layers(
        n, field(hf, "no_rope_layer_interval", SIZE, 4)
    )
    return ["chunked_attention" if r and chunk is not None else "full_attention" for r in rotated]


def write(cfg) -> dict[str, Any]:
    fields = {k: v for k, v in llama.write(cfg).items() if k != "mlp_bias"}
    moe = [i for i in range(cfg.n_layers) if i not in cfg.dense_layers]
    return {
        **fields,
        "intermediate_size": cfg.moe_d_ff,
        "intermediate_size_mlp": cfg.d_ff,
        "num_local_experts": cfg.n_experts,
        "num_experts_per_tok": cfg.experts_per_token,
        "router_aux_loss_coef": cfg.router_aux_loss_coef,
        "output_router_logits": False,
        "moe_layers": moe,
        "no_rope_layers": smollm3.no_rope_layers(cfg.n_layers, cfg.global_every),
        "no_rope_layer_interval": cfg.global_every or 4,
        "attention_chunk_size": cfg.attn_chunk or None,
        "use_qk_norm": cfg.qk_l2_norm,
        "attn_temperature_tuning": bool(cfg.attn_floor_scale),
        "floor_scale": int(cfg.attn_floor_scale or DEFAULTS["floor_scale"]),  # an int there
        "attn_scale": cfg.attn_temp_scale or DEFAULTS["attn_scale"],
    }


def check_export(cfg) -> None:
    """What transformers' Llama 4 cannot express: another router or experts, rotated global layers, a
    window or other score rules."""
    llama.check_export(cfg)
    bad = {k: getattr(cfg, k) for k, v in ROUTER.items() if getattr(cfg, k) != v}
    others = (
        "n_group",
        "routed_scaling_factor",
        "router_bias",
        "balance_bias",
        "expert_bias",
        "swiglu_limit",
    )
    bad.update({k: getattr(cfg, k) for k in others if getattr(cfg, k) not in (0, 1.0)})
    if cfg.attn_floor_scale % 1:
        bad["attn_floor_scale"] = cfg.attn_floor_scale  # transformers' floor_scale is an int
    if cfg.shared_expert_d_ff or cfg.global_every and not cfg.global_nope or cfg.sliding_window:
        bad.update(shared_expert_d_ff=cfg.shared_expert_d_ff, global_nope=cfg.global_nope)
    if bad or cfg.rope_local_theta or cfg.attn_scalar or cfg.attn_softcap:
        raise ConfigError(f"transformers' Llama 4 cannot express {bad or 'this rotary or score rule'}")


# Our path -> (transformers' name, layout): Llama's attention and norms, the MoE layers' feed_forward.
_MLP = {k: v for k, v in llama.HF.layer.items() if k.startswith("mlp/")}
LAYER = {
    **{k: v for k, v in llama.HF.layer.items() if not k.startswith("mlp/")},
    **{k: (v[0].replace("mlp.", "feed_forward."), v[1]) for k, v in _MLP.items()},  # the dense layers
    "moe/router/w": ("feed_forward.router.weight", "linear"),
    "moe/experts/w_gate": ("feed_forward.experts.gate_proj", "copy"),
    "moe/experts/w_up": ("feed_forward.experts.up_proj", "copy"),
    "moe/experts/w_down": ("feed_forward.experts.down_proj", "copy"),
    **{
        f"moe/shared_experts/{k[4:]}": (v[0].replace("mlp.", "feed_forward.shared_expert."), v[1])
        for k, v in _MLP.items()
    },
}
CONCATENATED = {
    "feed_forward.experts.gate_up_proj": ("feed_forward.experts.gate_proj", "feed_forward.experts.up_proj")
}

HF = replace(
    llama.HF,
    model_type="llama4_text",
    architecture="Llama4ForCausalLM",
    read=read,
    write=write,
    check_export=check_export,
    layer=LAYER,
    concatenated=CONCATENATED,
)
FAMILY = replace(llama.FAMILY, name=NAME, hf=HF, moe=True, rotary="interleaved", rope_scales_local=True)

# ``ModelConfig`` fields by preset name (the registry adds ``family``).
PRESETS: dict[str, dict] = {
    # 4 layers: three chunked (chunks of 8 under verify's 64 positions), rotated and L2-normed, the
    # fourth NoPE with the whole context and the temperature (floor 4: it changes every 4 positions);
    # 2 KV heads; layers 1 and 3 a MoE of 4 experts of 32 (top-1, its sigmoid on the input) with a
    # shared expert, layers 0 and 2 dense MLPs of 64.
    "tiny-llama4": dict(
        llama.TINY,
        n_layers=4,
        n_kv_heads=2,
        attn_chunk=8,
        global_every=4,
        global_nope=True,
        d_ff=64,
        qk_l2_norm=True,
        attn_floor_scale=4.0,
        attn_temp_scale=0.1,
        n_experts=4,
        experts_per_token=1,
        moe_d_ff=32,
        dense_layers=(0, 2),
        router_aux_loss_coef=0.02,
        **ROUTER,
    ),  # fmt: skip
    # meta-llama/Llama-4-Scout-17B-16E's text config.json as written from memory (not downloaded here):
    # 48 layers, all MoE (16 experts of 8192, top-1, a shared expert), chunks of 8192, NoPE every fourth
    # layer; its llama3 rope scaling has high_freq_factor = low_freq_factor = 1: no ramp, every
    # frequency of a wavelength above 8192 divided by 16 (transformers' formula, ``rope.inv_freq``).
    "llama4-scout": dict(
        vocab_size=202048,
        d_model=5120,
        n_layers=48,
        d_ff=16384,
        n_heads=40,
        n_kv_heads=8,
        head_dim=128,
        rope_theta=500000.0,
        rope_scaling=RopeScaling(
            factor=16.0, low_freq_factor=1.0, high_freq_factor=1.0, original_max_position_embeddings=8192
        ),
        max_seq_len=10485760,
        norm_eps=1e-5,
        attn_chunk=8192,
        global_every=4,
        global_nope=True,
        qk_l2_norm=True,
        attn_floor_scale=8192.0,
        attn_temp_scale=0.1,
        n_experts=16,
        experts_per_token=1,
        moe_d_ff=8192,
        router_aux_loss_coef=0.001,
        **ROUTER,
    ),  # fmt: skip
}
