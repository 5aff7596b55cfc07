"""gpt-oss: learned attention sinks (a logit per query head joining each softmax's normaliser:
``attn_sinks``, the variant's ``finish``) on every layer, a 128-token sliding window on alternate layers
(``layer_types``: sliding, full, ...; meshlm's local and global layer kinds, ``global_every`` 2), one
rotary (YaRN in the released models) on both kinds (``Family.rope_scales_local``), grouped-query
attention with head_dim 64 and biases on q/k/v/o (``qkv_bias``, ``o_bias``).

Every layer's feed-forward is a mixture of experts (``model.moe``) through the router record: the
router's logits with a bias (``router_bias``), the top k of them softmaxed (= the softmax over all E
renormalised over the top k: ``norm_topk_prob``), each expert's clamped SwiGLU (up + 1) * gate *
sigmoid(alpha gate) with gate <= limit, |up| <= limit (``swiglu_alpha`` 1.702, ``swiglu_limit`` 7) and
biases on its gate/up and down projections (``expert_bias``; every dispatch adds them per row's expert).

Weights: transformers' fused ``mlp.experts.gate_up_proj`` [E, D, 2I] (x @ W, not torch's [out, in])
interleaves gate and up on its last dim (gate at the even columns), as its bias [E, 2I] does
(``INTERLEAVED``); ``down_proj`` [E, I, D] and its bias [E, D] are ours as they are. The released
checkpoints hold the expert weights in MXFP4 (``*_blocks``, ``*_scales``): ``io.mxfp4`` dequantises
them on import to the values transformers computes with; an export writes them dense (float32)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import meshlm.model.families.gemma2 as gemma2
import meshlm.model.families.llama as llama
import meshlm.model.families.qwen3_moe as qwen3_moe
from meshlm.errors import ConfigError
from meshlm.model.families.hf_fields import POSITIVE, SIZE, field, unsupported
from meshlm.model.rope import YarnScaling

NAME = "gpt_oss"
# GptOssConfig's defaults where a config.json may leave a field out and Llama's differ; without any
# rope parameters its rotary is YaRN (``YARN``) over theta 150000.
DEFAULTS = {
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "head_dim": 64,
    "num_key_value_heads": 8,
    "sliding_window": 128,
    "num_local_experts": 128,
    "num_experts_per_tok": 4,
    "intermediate_size": 2880,
    "router_aux_loss_coef": 0.001,
    "swiglu_alpha": 1.702,
    "swiglu_limit": 7.0,
    "rope_theta": 150000.0,
}
YARN = dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
            original_max_position_embeddings=4096)  # fmt: skip
# The router record's fields gpt-oss fixes (``model.router_fields``): its router and experts exactly.
ROUTER = dict(
    router_score="softmax", norm_topk_prob=True, n_group=0, topk_group=0, routed_scaling_factor=1.0,
    router_bias=True, balance_bias=False, moe_bias_rate=0.0, n_shared_experts=0, shared_expert_d_ff=0,
    expert_bias=True, dense_layers=(),
)  # fmt: skip


def read(hf: dict) -> dict[str, Any]:
    """GptOssConfig: Llama's attention fields with gpt-oss's defaults, its windows and sinks, its
    experts (``ROUTER``, ``swiglu_*``), through the default (sorted) dispatch."""
    if hf.get("attention_bias", True) is not True:
        raise unsupported("attention_bias", hf["attention_bias"], "gpt-oss's attention has q/k/v/o biases")
    if hf.get("rope_parameters") is None and hf.get("rope_scaling") is None:
        hf = {**hf, "rope_parameters": YARN}
    hf = {**DEFAULTS, **hf}
    fields = llama.read(hf)
    moe = qwen3_moe.experts(hf, "num_local_experts", "intermediate_size", (128, 4, 2880))
    swiglu = {k: float(field(hf, k, POSITIVE)) for k in ("swiglu_alpha", "swiglu_limit")}
    window = {"sliding_window": field(hf, "sliding_window", SIZE), "global_every": gemma2.global_every(hf, 2)}
    return {**fields, **moe, **ROUTER, **swiglu, **window, "attn_sinks": True}


def write(cfg) -> dict[str, Any]:
    fields = {k: v for k, v in llama.write(cfg).items() if k != "mlp_bias"}
    return {
        **fields,
        "attention_bias": True,
        "intermediate_size": cfg.moe_d_ff,
        "num_local_experts": cfg.n_experts,
        "num_experts_per_tok": cfg.experts_per_token,
        "router_aux_loss_coef": cfg.router_aux_loss_coef,
        "output_router_logits": False,
        "swiglu_alpha": cfg.swiglu_alpha,
        "swiglu_limit": cfg.swiglu_limit,
        "sliding_window": cfg.sliding_window,
        "layer_types": gemma2.layer_types(cfg.n_layers, cfg.global_every),
    }


def check_export(cfg) -> None:
    """What transformers' gpt-oss cannot express: another router or experts than ``ROUTER``'s, no clamp
    (its SwiGLU always clamps and gates by alpha), no sinks or window, a dense width of its own."""
    llama.check_export(cfg)
    bad = {k: getattr(cfg, k) for k, v in ROUTER.items() if getattr(cfg, k) != v}
    bad.update({k: getattr(cfg, k) for k in ("swiglu_alpha", "swiglu_limit") if not getattr(cfg, k)})
    bad.update(
        {k: getattr(cfg, k) for k in ("attn_sinks", "sliding_window", "global_every") if not getattr(cfg, k)}
    )
    if cfg.d_ff != cfg.moe_d_ff:
        bad["d_ff"] = cfg.d_ff
    if bad or cfg.rope_scaling is not None and not isinstance(cfg.rope_scaling, YarnScaling):
        what = ", ".join(f"{k}={v!r}" for k, v in bad.items()) or f"rope_scaling={cfg.rope_scaling!r}"
        raise ConfigError(f"transformers' gpt-oss cannot express {what}; keep the meshlm checkpoint")


# Our path -> (transformers' name, layout): Llama's attention and norms, the biases, sinks and experts.
# The experts' gate/up are two halves of one interleaved tensor (``INTERLEAVED``, split on import).
LAYER = {
    **{k: v for k, v in llama.HF.layer.items() if not k.startswith("mlp/")},
    "attn/bq": ("self_attn.q_proj.bias", "heads"),
    "attn/bk": ("self_attn.k_proj.bias", "heads"),
    "attn/bv": ("self_attn.v_proj.bias", "heads"),
    "attn/bo": ("self_attn.o_proj.bias", "copy"),
    "attn/sinks": ("self_attn.sinks", "copy"),
    "moe/router/w": ("mlp.router.weight", "linear"),
    "moe/router/b": ("mlp.router.bias", "copy"),
    "moe/experts/w_gate": ("mlp.experts.gate_proj", "copy"),
    "moe/experts/w_up": ("mlp.experts.up_proj", "copy"),
    "moe/experts/w_down": ("mlp.experts.down_proj", "copy"),
    "moe/experts/b_gate": ("mlp.experts.gate_proj_bias", "copy"),
    "moe/experts/b_up": ("mlp.experts.up_proj_bias", "copy"),
    "moe/experts/b_down": ("mlp.experts.down_proj_bias", "copy"),
}
# transformers' tensor -> the names its last dim interleaves (``io.hf_experts.deinterleave``).
INTERLEAVED = {
    "mlp.experts.gate_up_proj": ("mlp.experts.gate_proj", "mlp.experts.up_proj"),
    "mlp.experts.gate_up_proj_bias": ("mlp.experts.gate_proj_bias", "mlp.experts.up_proj_bias"),
}

HF = replace(
    llama.HF,
    model_type=NAME,
    architecture="GptOssForCausalLM",
    read=read,
    write=write,
    check_export=check_export,
    layer=LAYER,
    interleaved=INTERLEAVED,
)
FAMILY = replace(llama.FAMILY, name=NAME, hf=HF, moe=True, qkv_bias=True, o_bias=True, rope_scales_local=True)

BIG = dict(
    vocab_size=201088, d_model=2880, d_ff=2880, n_heads=64, n_kv_heads=8, head_dim=64, rope_theta=150000.0,
    max_seq_len=131072, norm_eps=1e-5, sliding_window=128, global_every=2, attn_sinks=True,
    experts_per_token=4, moe_d_ff=2880, router_aux_loss_coef=0.001, swiglu_alpha=1.702, swiglu_limit=7.0,
    **{k: v for k, v in ROUTER.items() if k != "dense_layers"},
    rope_scaling=YarnScaling(factor=32.0, original_max_position_embeddings=4096, truncate=False),
)  # fmt: skip
# ``ModelConfig`` fields by preset name (the registry adds ``family``).
PRESETS: dict[str, dict] = {
    # 4 layers (sliding, full, sliding, full) with sinks, a window of 8 under verify's 64-token text,
    # 2 KV heads (split on mp = 2, replicated on mp = 4); 4 experts of 32 units, 2 per token, with
    # gpt-oss's router and expert biases; a clamp of 0.1 that bites at this init's scale (7 would not);
    # YaRN over an original context of 16 on both kinds of layer.
    "tiny-gpt-oss": dict(
        llama.TINY,
        n_layers=4,
        n_kv_heads=2,
        sliding_window=8,
        global_every=2,
        attn_sinks=True,
        d_ff=32,
        n_experts=4,
        experts_per_token=2,
        moe_d_ff=32,
        router_aux_loss_coef=0.02,
        **{k: v for k, v in ROUTER.items() if k != "dense_layers"},
        swiglu_alpha=1.702,
        swiglu_limit=0.1,
        rope_scaling=YarnScaling(
            factor=4.0, original_max_position_embeddings=16, beta_fast=32.0, beta_slow=1.0
        ),  # fmt: skip
    ),
    # openai/gpt-oss-20b and -120b's config.json as written from memory (not downloaded here): 24 and
    # 36 layers of 32 and 128 experts of 2880, 4 per token; YaRN x32 over 4096 on theta 150000.
    "gpt-oss-20b": dict(BIG, n_layers=24, n_experts=32),
    "gpt-oss-120b": dict(BIG, n_layers=36, n_experts=128),
}
