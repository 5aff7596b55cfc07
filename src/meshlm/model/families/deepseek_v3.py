"""DeepSeek-V3 / R1 / V3.1 and Kimi K2 (transformers' ``deepseek_v3``): Llama's sequential RMSNorm
blocks with multi-head latent attention (``model.mla``: ``q_lora_rank``, ``kv_lora_rank``, a shared
rotary key of ``qk_rope_head_dim`` next to ``qk_nope_head_dim`` per head, ``v_head_dim``), YaRN
(``model.rope``: its attention factor on cos and sin, its ``mscale_all_dim`` squared on the softmax
scale), the first ``first_k_dense_replace`` layers dense and the rest a mixture of experts.

Rotary: with ``rope_interleave`` (the released models) transformers rotates the pairs (x0, x1), (x2,
x3), ... of q's and k's rotary parts and lays the results out de-interleaved, the same for both, so
the scores are GPT-J's "interleaved" rotation's: weights map by transpose and reshape only. Without
it, rotate-half ("half").

Its MoE (layers ``first_k_dense_replace`` onwards; the first ones dense, Llama's MLP of
``intermediate_size``: ``ModelConfig.dense_layers``, their parameters stacked apart) is the router
record's (``model.routers``): sigmoid scores, ``e_score_correction_bias`` as the selection bias
(``moe/router/balance_bias``: frozen on import of a config without meshlm's ``moe_bias_rate``;
DeepSeek-V3 trained it at 1e-3 then froze it), the top ``topk_group`` of ``n_group`` groups by
their top-2 sums, ``norm_topk_prob`` with its 1e-20, ``routed_scaling_factor``;
``n_routed_experts`` gated-SiLU experts of ``moe_intermediate_size`` and ``n_shared_experts``
always-on ungated ones (one MLP of n x ``moe_intermediate_size``: ``model.moe``'s
``shared_experts``). transformers' DeepseekV3 computes no balance loss and moves no bias:
``router_aux_loss_coef`` and ``moe_bias_rate`` are meshlm's, written beside the model's fields so
an export keeps them (transformers ignores the keys).
Multi-token prediction (``num_nextn_predict_layers``: ``model.mtp``): its layers after the main ones,
read from and written to the safetensors by ``io.hf_mtp`` (transformers drops them).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import meshlm.model.families.llama as llama
import meshlm.model.families.qwen3_moe as qwen3_moe
from meshlm.errors import ConfigError
from meshlm.model.families.hf_fields import POSITIVE, SIZE, field, flag, rope, rope_fields, unsupported
from meshlm.model.rope import YarnScaling
from meshlm.ranges import Range

# DeepseekV3Config's defaults for the fields a config.json may leave out (transformers 5.24).
DEFAULTS = {"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128}
DEFAULTS |= {"v_head_dim": 128, "first_k_dense_replace": 3, "rope_interleave": True, "rms_norm_eps": 1e-6}
DEFAULTS |= {"max_position_embeddings": 4096}
MOE_DEFAULTS = {"n_routed_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 2048}
MOE_DEFAULTS |= {"n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "n_shared_experts": 1}
MOE_DEFAULTS |= {"norm_topk_prob": True}


def read(hf: dict) -> dict[str, Any]:
    """DeepseekV3Config -> ``ModelConfig`` fields: ``FAMILY``'s with MoE layers, or the all-dense
    record's (``DENSE``) where ``first_k_dense_replace`` >= ``num_hidden_layers``."""
    hf = {**DEFAULTS, **hf}
    if hf.get("q_lora_rank") is None:
        raise unsupported("q_lora_rank", None, "meshlm converts DeepSeek-V3's low-rank queries only")
    if hf.get("attention_bias"):
        raise unsupported("attention_bias", True, "meshlm's MLA has no projection biases")
    nope, rot = field(hf, "qk_nope_head_dim", SIZE), field(hf, "qk_rope_head_dim", SIZE)
    theta, scaling = rope({**hf, "head_dim": rot})
    fields = dict(
        llama.read({**hf, "head_dim": nope + rot, "num_key_value_heads": None}),  # MLA: a latent per head
        family=DENSE.name,
        n_kv_heads=0,
        head_dim=nope + rot,
        rotary_dim=rot,
        rotary_style="" if hf["rope_interleave"] is True else "half",
        rope_theta=theta,
        rope_scaling=scaling,
        q_lora_rank=field(hf, "q_lora_rank", SIZE),
        kv_lora_rank=field(hf, "kv_lora_rank", SIZE),
        v_head_dim=field(hf, "v_head_dim", SIZE),
        **_read_mtp(hf),
    )
    dense = field(hf, "first_k_dense_replace", Range(int, 0))
    return fields if dense >= fields["n_layers"] else {**fields, **_read_moe(hf, dense)}


def _read_mtp(hf: dict) -> dict[str, Any]:
    """Multi-token prediction (``model.mtp``): ``num_nextn_predict_layers`` depths (transformers' default
    1), weighted by meshlm's ``mtp_weight`` where an export wrote it, else 0.1 (DeepSeek-V3's lambda over
    its last 4.8T tokens)."""
    depths = field(hf, "num_nextn_predict_layers", Range(int, 0), 1)
    weight = float(field(hf, "mtp_weight", Range(float, 0), 0.1)) if depths else 0.0
    return dict(mtp_layers=depths, mtp_weight=weight)


def _read_moe(hf: dict, dense: int) -> dict[str, Any]:
    """The MoE fields of a config.json with MoE layers (``first_k_dense_replace`` = ``dense`` of them
    dense); the scoring and top-k rules the original configs name must be the ones built."""
    hf = {**MOE_DEFAULTS, **hf}
    for key, value in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if hf.get(key, value) != value:
            raise unsupported(key, hf[key], f"meshlm's deepseek_v3 router is {value!r}")
    return dict(
        family=FAMILY.name,
        n_experts=field(hf, "n_routed_experts", SIZE),
        experts_per_token=field(hf, "num_experts_per_tok", SIZE),
        moe_d_ff=field(hf, "moe_intermediate_size", SIZE),
        norm_topk_prob=flag(hf, "norm_topk_prob"),
        router_score="sigmoid",
        n_group=field(hf, "n_group", SIZE),
        topk_group=field(hf, "topk_group", SIZE),
        routed_scaling_factor=float(field(hf, "routed_scaling_factor", POSITIVE)),
        balance_bias=True,  # e_score_correction_bias; frozen unless meshlm's own export set a rate
        moe_bias_rate=float(field(hf, "moe_bias_rate", Range(float, 0), 0.0)),
        n_shared_experts=field(hf, "n_shared_experts", SIZE),
        router_aux_loss_coef=float(field(hf, "router_aux_loss_coef", Range(float, 0), 0.0)),
        dense_layers=tuple(range(dense)),
    )


def check_export(cfg) -> None:
    if not cfg.q_lora_rank or not cfg.mla:
        raise ConfigError("transformers' deepseek_v3 is exported from an MLA model with q_lora_rank > 0 only")
    if cfg.rope_scaling is not None and not isinstance(cfg.rope_scaling, YarnScaling):
        raise ConfigError("rope_scaling (Llama 3's): transformers' deepseek_v3 takes YaRN or none")
    if not cfg.arch.moe:
        return
    want = dict(router_score="sigmoid", balance_bias=True, shared_expert_d_ff=0, router_bias=False)
    want |= dict(expert_bias=False, swiglu_limit=0.0, swiglu_alpha=0.0)
    bad = {k: getattr(cfg, k) for k, v in want.items() if getattr(cfg, k) != v}
    if bad or not cfg.n_shared_experts or not cfg.n_group:
        raise ConfigError(
            f"transformers' deepseek_v3 routes by sigmoid scores with e_score_correction_bias "
            f"(balance_bias=true), n_group >= 1 groups and n_shared_experts >= 1 ungated shared experts: "
            f"{bad or dict(n_shared_experts=cfg.n_shared_experts, n_group=cfg.n_group)} cannot be exported"
        )
    if cfg.dense_layers != tuple(range(len(cfg.dense_layers))):
        raise ConfigError(
            f"dense_layers={list(cfg.dense_layers)}: transformers' deepseek_v3 has its dense layers first "
            f"(first_k_dense_replace); use dense_layers=[0, ..., k - 1] to export"
        )


def write(cfg) -> dict[str, Any]:
    out = {k: v for k, v in llama.write(cfg).items() if k not in ("mlp_bias", "head_dim", "rope_scaling")}
    out |= {
        "num_key_value_heads": cfg.n_heads,
        "q_lora_rank": cfg.q_lora_rank,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.head_dim - cfg.rot_dim,
        "qk_rope_head_dim": cfg.rot_dim,
        "v_head_dim": cfg.v_head_dim,
        "rope_interleave": cfg.rotary_kind == "interleaved",
        "rope_parameters": rope_fields(cfg),
        "first_k_dense_replace": cfg.n_layers,  # every layer dense: no router is written
        "num_nextn_predict_layers": cfg.mtp_layers,  # their tensors: ``io.hf_mtp``
    }
    if cfg.mtp_layers:  # meshlm's, kept for the round trip (``_read_mtp``); transformers ignores it
        out["mtp_weight"] = cfg.mtp_weight
    if not cfg.arch.moe:
        return out
    return {
        **out,
        "first_k_dense_replace": len(cfg.dense_layers),
        "n_routed_experts": cfg.n_experts,
        "num_experts_per_tok": cfg.experts_per_token,
        "moe_intermediate_size": cfg.moe_d_ff,
        "norm_topk_prob": cfg.norm_topk_prob,
        "n_group": cfg.n_group,
        "topk_group": cfg.topk_group,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "n_shared_experts": cfg.n_shared_experts,
        # meshlm's training fields (``read``), kept for the round trip; transformers ignores them
        "router_aux_loss_coef": cfg.router_aux_loss_coef,
        "moe_bias_rate": cfg.moe_bias_rate,
    }


_ATTN = {
    "attn/wq_a": ("self_attn.q_a_proj.weight", "linear"),
    "attn/q_a_norm/scale": ("self_attn.q_a_layernorm.weight", "copy"),
    "attn/wq_b": ("self_attn.q_b_proj.weight", "q"),
    "attn/wkv_a": ("self_attn.kv_a_proj_with_mqa.weight", "linear"),
    "attn/kv_a_norm/scale": ("self_attn.kv_a_layernorm.weight", "copy"),
    "attn/wkv_b": ("self_attn.kv_b_proj.weight", "q"),  # [H (N + Ev), r] <-> [r, H, N + Ev]
    "attn/wo": ("self_attn.o_proj.weight", "o"),
}
# The MoE layers' (Qwen-MoE's expert names; the selection bias a buffer of the router, ``gate``).
_MOE = {
    **qwen3_moe.MOE_LAYER,
    "moe/router/balance_bias": ("mlp.gate.e_score_correction_bias", "copy"),
    "moe/shared_experts/w_gate": ("mlp.shared_experts.gate_proj.weight", "linear"),
    "moe/shared_experts/w_up": ("mlp.shared_experts.up_proj.weight", "linear"),
    "moe/shared_experts/w_down": ("mlp.shared_experts.down_proj.weight", "linear"),
}
_LLAMA_ATTN = ("attn/wq", "attn/wk", "attn/wv", "attn/wo")
HF = replace(
    llama.HF,
    model_type="deepseek_v3",
    architecture="DeepseekV3ForCausalLM",
    read=read,
    write=write,
    check_export=check_export,
    layer={**{k: v for k, v in llama.HF.layer.items() if k not in _LLAMA_ATTN}, **_ATTN, **_MOE},
    fused=qwen3_moe.MOE_FUSED,
)
FAMILY = replace(llama.FAMILY, name="deepseek_v3", rotary="interleaved", hf=HF, moe=True)
DENSE = replace(FAMILY, name="deepseek_v3_dense", moe=False)  # an all-dense config.json's record
MORE = (DENSE,)  # the registry lists these beside ``FAMILY``

_MLA_TINY = dict(head_dim=24, rotary_dim=8, v_head_dim=16, q_lora_rank=32, kv_lora_rank=32)
_YARN_TINY = YarnScaling(factor=4, original_max_position_embeddings=16, mscale=1.0, mscale_all_dim=0.5)
# DeepSeek-V3's router (``model.routers``): sigmoid scores, the selection bias (balanced without an aux
# loss at DeepSeek's 1e-3), groups ranked by their top-2 sums, renormalised, scaled; one ungated shared
# expert of moe_d_ff units
_ROUTER = dict(router_score="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5, balance_bias=True)
_ROUTER |= dict(n_shared_experts=1)
_V3 = dict(
    vocab_size=129280,
    d_model=7168,
    n_layers=61,
    d_ff=18432,
    n_heads=128,
    head_dim=192,
    rotary_dim=64,
    v_head_dim=128,
    q_lora_rank=1536,
    kv_lora_rank=512,
    max_seq_len=163840,
    norm_eps=1e-6,
    rope_scaling=YarnScaling(
        factor=40, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=1.0
    ),
    n_experts=256,
    experts_per_token=8,
    moe_d_ff=2048,
    n_group=8,
    topk_group=4,
    moe_bias_rate=1e-3,
    **_ROUTER,
    dense_layers=(0, 1, 2),
    router_aux_loss_coef=0.0001,
    mtp_layers=1,
    mtp_weight=0.1,
)
# ``ModelConfig`` fields by preset name (the registry adds ``family``): the tiny one for the proof
# (8 heads: mp up to 8; YaRN's attention factor and score mscale both != 1; layer 0 dense, layers 1 and 2
# DeepSeek's MoE, two so that --pp 2 splits them (the dense layer runs with the embedding): 8 experts
# of 32 units in 4 groups of 2, each token's best 2 groups then its top 2, so that the proof's
# planted tie between experts 0 and E/ep = 4 can decide a choice under --ep 2
# (with 2 groups of 4 and topk_group 1 the ep shards are the groups: no cross-shard tie is ever ranked);
# a faster bias rate so two steps move the bias, the aux loss on so the proof covers it too); the real
# ones from the published config.json files (deepseek-ai/DeepSeek-V3, moonshotai/Kimi-K2-Instruct),
# with their one MTP layer (num_nextn_predict_layers: 1) at DeepSeek-V3's final lambda 0.1.
PRESETS: dict[str, dict] = {
    "tiny-deepseek-v3": dict(
        llama.TINY,
        n_layers=3,  # one dense, two MoE: --pp 2 runs one MoE layer per stage
        **_MLA_TINY,
        rope_scaling=_YARN_TINY,
        n_experts=8,
        experts_per_token=2,
        moe_d_ff=32,
        n_group=4,
        topk_group=2,
        moe_bias_rate=1e-2,
        **_ROUTER,
        dense_layers=(0,),
        router_aux_loss_coef=0.02,
        mtp_layers=1,
        mtp_weight=0.3,
    ),
    "deepseek-v3": _V3,
    # Kimi K2: 384 experts in one group (n_group 1, topk_group 1: plain top-8), scaling 2.827, one
    # dense layer, 64 heads
    "kimi-k2": dict(
        _V3,
        vocab_size=163840,
        n_heads=64,
        max_seq_len=131072,
        rope_theta=50000.0,
        rope_scaling=YarnScaling(
            factor=32,
            original_max_position_embeddings=4096,
            beta_fast=1,
            beta_slow=1,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
        n_experts=384,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.827,
        dense_layers=(0,),
    ),
}
