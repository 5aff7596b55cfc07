"""DeepSeek-V3 / R1 / V3.1 and Kimi K2 (transformers' ``deepseek_v3``): Llama's sequential RMSNorm
blocks with multi-head latent attention (``model.mla``: ``q_lora_rank``, ``kv_lora_rank``, a shared
rotary key of ``qk_rope_head_dim`` next to ``qk_nope_head_dim`` per head, ``v_head_dim``), YaRN
(``model.rope``: its attention factor on cos and sin, its ``mscale_all_dim`` squared on the softmax
scale), the first ``first_k_dense_replace`` layers dense and the rest a mixture of experts.

Rotary: with ``rope_interleave`` (the released models) transformers rotates the pairs (x0, x1), (x2,
x3), ... of q's and k's rotary parts and lays the results out de-interleaved, the same for both, so
the scores are GPT-J's "interleaved" rotation's: weights map by transpose and reshape only. Without
it, rotate-half ("half").

What converts today: the attention, the dense layers and YaRN, exactly. DeepSeek's router (sigmoid
scores plus ``e_score_correction_bias``, group-limited top-k over ``n_group`` / ``topk_group``,
``routed_scaling_factor``, ungated shared experts) is the router record's, not built yet: a config.json
with MoE layers (``first_k_dense_replace`` < ``num_hidden_layers``) is refused in one line, and an
all-dense one reads as ``DENSE``, this family's dense record. The family's own presets (``FAMILY``)
run meshlm's softmax router (``model.moe``), and the real sizes' shared expert is meshlm's gated one
(D more parameters per MoE layer than DeepSeek's): for the planner and the proof, not to import.
Multi-token prediction (``num_nextn_predict_layers``) is not built: its layers are not read.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import meshlm.model.families.llama as llama
from meshlm.errors import ConfigError
from meshlm.model.families.hf_fields import SIZE, field, rope, rope_fields, unsupported
from meshlm.model.rope import YarnScaling
from meshlm.ranges import Range

# DeepseekV3Config's defaults for the fields a config.json may leave out (transformers 5.24).
DEFAULTS = {"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128}
DEFAULTS |= {"v_head_dim": 128, "first_k_dense_replace": 3, "rope_interleave": True, "rms_norm_eps": 1e-6}
DEFAULTS |= {"max_position_embeddings": 4096}


def read(hf: dict) -> dict[str, Any]:
    """DeepseekV3Config -> the dense record's fields (``DENSE``), or a one-line refusal."""
    hf = {**DEFAULTS, **hf}
    layers, dense = field(hf, "num_hidden_layers", SIZE), field(hf, "first_k_dense_replace", Range(int, 0))
    if dense < layers:
        raise unsupported(
            "first_k_dense_replace",
            dense,
            f"DeepSeek's MoE router (sigmoid + e_score_correction_bias, n_group/topk_group, "
            f"routed_scaling_factor) is not built yet; only an all-dense model (first_k_dense_replace >= "
            f"num_hidden_layers={layers}) converts",
        )
    if hf.get("q_lora_rank") is None:
        raise unsupported("q_lora_rank", None, "meshlm converts DeepSeek-V3's low-rank queries only")
    if hf.get("attention_bias"):
        raise unsupported("attention_bias", True, "meshlm's MLA has no projection biases")
    nope, rot = field(hf, "qk_nope_head_dim", SIZE), field(hf, "qk_rope_head_dim", SIZE)
    theta, scaling = rope({**hf, "head_dim": rot})
    return dict(
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
    )


def check_export(cfg) -> None:
    if cfg.arch.moe or not cfg.q_lora_rank or not cfg.mla:
        raise ConfigError(
            "transformers' deepseek_v3 is exported from an all-dense MLA model with q_lora_rank > 0 only "
            "(meshlm's MoE router is softmax, DeepSeek's sigmoid: not built)"
        )
    if cfg.rope_scaling is not None and not isinstance(cfg.rope_scaling, YarnScaling):
        raise ConfigError("rope_scaling (Llama 3's): transformers' deepseek_v3 takes YaRN or none")


def write(cfg) -> dict[str, Any]:
    out = {k: v for k, v in llama.write(cfg).items() if k not in ("mlp_bias", "head_dim", "rope_scaling")}
    return {
        **out,
        "num_key_value_heads": cfg.n_heads,
        "q_lora_rank": cfg.q_lora_rank,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.head_dim - cfg.rot_dim,
        "qk_rope_head_dim": cfg.rot_dim,
        "v_head_dim": cfg.v_head_dim,
        "rope_interleave": cfg.rotary_kind == "interleaved",
        "rope_parameters": rope_fields(cfg),
        "first_k_dense_replace": cfg.n_layers,  # every layer dense: no router is written
        "num_nextn_predict_layers": 0,
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
_LLAMA_ATTN = ("attn/wq", "attn/wk", "attn/wv", "attn/wo")
HF = replace(
    llama.HF,
    model_type="deepseek_v3",
    architecture="DeepseekV3ForCausalLM",
    read=read,
    write=write,
    check_export=check_export,
    layer={**{k: v for k, v in llama.HF.layer.items() if k not in _LLAMA_ATTN}, **_ATTN},
)
FAMILY = replace(llama.FAMILY, name="deepseek_v3", rotary="interleaved", hf=HF, moe=True)
DENSE = replace(FAMILY, name="deepseek_v3_dense", moe=False)  # an all-dense config.json's record
MORE = (DENSE,)  # the registry lists these beside ``FAMILY``

_MLA_TINY = dict(head_dim=24, rotary_dim=8, v_head_dim=16, q_lora_rank=32, kv_lora_rank=32)
_YARN_TINY = YarnScaling(factor=4, original_max_position_embeddings=16, mscale=1.0, mscale_all_dim=0.5)
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
    shared_expert_d_ff=2048,
    dense_layers=(0, 1, 2),
    router_aux_loss_coef=0.0001,
)
# ``ModelConfig`` fields by preset name (the registry adds ``family``): the tiny one for the proof
# (8 heads: mp up to 8; YaRN's attention factor and score mscale both != 1; layer 0 dense, layer 1 4
# experts of 32 units, 2 per token, meshlm's softmax router); the real ones from the published
# config.json files (deepseek-ai/DeepSeek-V3, moonshotai/Kimi-K2-Instruct), without the MTP layer.
PRESETS: dict[str, dict] = {
    "tiny-deepseek-v3": dict(
        llama.TINY,
        **_MLA_TINY,
        rope_scaling=_YARN_TINY,
        n_experts=4,
        experts_per_token=2,
        moe_d_ff=32,
        dense_layers=(0,),
        router_aux_loss_coef=0.02,
    ),
    "deepseek-v3": _V3,
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
        dense_layers=(0,),
    ),
}
