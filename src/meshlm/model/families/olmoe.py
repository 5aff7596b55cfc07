"""OLMoE: Llama's pre-norm blocks (``x + attn(norm(x))``, then ``x + moe(norm(x))``: not OLMo 2's post-norm)
with an RMSNorm over the whole q and k projections before rotary (weights [H*E] and [K*E], split over mp
with the heads, the mean square gathered: ``Family.qk_norm`` "proj", as OLMo 2's) and a mixture-of-experts
feed-forward (``Family.moe``; ``model.moe``): a router ``mlp.gate`` over ``num_experts`` gated-SiLU experts
of ``intermediate_size`` hidden units, softmax then the top ``num_experts_per_tok`` *not* renormalised
(``norm_topk_prob`` False, transformers' default and the released model's). Its RMSNorms cast before the
weight product, as Llama's (transformers' OlmoeRMSNorm; OLMo 2's multiplies first).

Weights: the expert and router names are Qwen3-MoE's (``model.families.qwen3_moe``: per-expert tensors on
disk, transformers 5's fused ``gate_up_proj`` / ``down_proj`` in memory). ``clip_qkv`` (clamping q, k, v)
is refused unless null; the q/k norms are sized from hidden_size / num_attention_heads, so an explicit
``head_dim`` must equal it."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import meshlm.model.families.llama as llama
import meshlm.model.families.olmo2 as olmo2
import meshlm.model.families.qwen3_moe as qwen3_moe
from meshlm.errors import ConfigError
from meshlm.model.families.hf_fields import unsupported

NAME = "olmoe"  # the family's name and its config.json model_type
# transformers' OlmoeConfig defaults for fields a config.json may leave out, where they are not Llama's.
DEFAULTS = {
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "intermediate_size": 2048,
    "router_aux_loss_coef": 0.01,
}


def read(hf: dict) -> dict[str, Any]:
    """OlmoeConfig: Llama's fields with OLMoE's defaults, the experts' (``intermediate_size`` is the
    experts' width: ``d_ff`` the same, no dense layer uses it); no clip_qkv, no sliding window."""
    hf = {**DEFAULTS, **hf}
    for key, fix in (("clip_qkv", "meshlm does not clamp q, k and v"), ("sliding_window", "no window")):
        if hf.get(key) is not None:
            raise unsupported(key, hf[key], f"{fix}; set it to null to convert")
    fields = llama.read(hf)
    if fields["head_dim"]:
        fix = f"{NAME}'s q/k norms are sized by hidden_size / num_attention_heads"
        raise unsupported("head_dim", hf["head_dim"], fix)
    return {**fields, **qwen3_moe.experts(hf, "num_experts", "intermediate_size", (64, 8, 2048))}


def write(cfg) -> dict[str, Any]:
    fields = {k: v for k, v in llama.write(cfg).items() if k != "mlp_bias"}
    return {**fields, "intermediate_size": cfg.moe_d_ff, "clip_qkv": None, **qwen3_moe.write_experts(cfg)}


def check_export(cfg) -> None:
    qwen3_moe.check_export(cfg)
    if cfg.head_dim:
        raise ConfigError(
            f"head_dim={cfg.head_dim}: transformers' {NAME} sizes its q/k norms by d_model / n_heads; "
            "set head_dim=0"
        )


# Llama's tensors (its pre-norms), OLMo 2's whole-projection q/k norms ("heads": ours [heads, E] <-> HF
# [heads*E]) and the experts.
_QK_NORMS = {k: v for k, v in olmo2.HF.layer.items() if k.startswith(("attn/q_norm", "attn/k_norm"))}
HF = replace(
    llama.HF,
    model_type=NAME,
    architecture="OlmoeForCausalLM",
    read=read,
    write=write,
    check_export=check_export,
    layer=qwen3_moe.moe_layer({**llama.HF.layer, **_QK_NORMS}),
    fused=qwen3_moe.MOE_FUSED,
)
FAMILY = replace(llama.FAMILY, name=NAME, hf=HF, qk_norm="proj", moe=True)

# ``ModelConfig`` fields by preset name (the registry adds ``family``). olmoe-1b-7b:
# allenai/OLMoE-1B-7B-0924's config.json as written from memory (not downloaded here): 16 layers, 64
# experts of 1024, 8 per token not renormalised, vocabulary 50304 (a multiple of 128: no padding); 6.92B
# parameters (``meshlm configs``), ~1.3B active per token.
PRESETS: dict[str, dict] = {
    # tiny-olmo2's attention (2 KV heads: split on mp = 2, replicated on mp = 4); 4 experts, 2 per token
    # not renormalised, moe_d_ff 32 splitting on mp = 2 and 4; the aux and z losses on for the proof.
    "tiny-olmoe": dict(
        llama.TINY,
        n_kv_heads=2,
        rope_theta=1e4,
        d_ff=32,
        n_experts=4,
        experts_per_token=2,
        moe_d_ff=32,
        norm_topk_prob=False,
        router_aux_loss_coef=0.01,
        router_z_loss_coef=0.001,
    ),
    "olmoe-1b-7b": dict(
        vocab_size=50304,
        d_model=2048,
        n_layers=16,
        d_ff=1024,
        n_heads=16,
        rope_theta=1e4,
        max_seq_len=4096,
        norm_eps=1e-5,
        n_experts=64,
        experts_per_token=8,
        moe_d_ff=1024,
        norm_topk_prob=False,
        router_aux_loss_coef=0.01,
    ),
}
