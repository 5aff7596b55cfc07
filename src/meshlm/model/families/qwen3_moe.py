"""Qwen3-MoE: Qwen3's attention (an RMSNorm on each query and key head before rotary: ``Family.qk_norm``
"head"; explicit head_dim) whose feed-forward is a mixture of experts (``Family.moe``; ``model.moe``): a
router ``mlp.gate`` over ``num_experts`` gated-SiLU experts of ``moe_intermediate_size`` hidden units,
softmax then the top ``num_experts_per_tok``, renormalised only with ``norm_topk_prob`` (transformers'
default False; True in the released Qwen3-30B-A3B and 235B-A22B).

Weights: on disk one tensor per expert (``mlp.experts.{e}.gate_proj/up_proj/down_proj.weight``) and the
router ``mlp.gate.weight`` [E, D]; transformers 5 fuses the experts in memory (``mlp.experts.gate_up_proj``
[E, 2I, D], ``mlp.experts.down_proj`` [E, D, I]). ``io.hf_weights`` reads both and writes the on-disk one.

Dense layers among the MoE layers (``mlp_only_layers``, ``decoder_sparse_step``: Qwen2-MoE's rule,
``model.families.qwen2_moe.dense_layers``; none in the released models) are Qwen3's dense MLP of
``intermediate_size`` (``d_ff``; kept so that config.json round-trips where no layer uses it). The
aux-loss coefficient is ``router_aux_loss_coef`` (transformers adds it only with
``output_router_logits``; meshlm always trains with it: 0 turns it off).
OLMoE (``model.families.olmoe``) shares the expert tensor names (``MOE_LAYER``, ``MOE_FUSED``)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import meshlm.model.families.llama as llama
import meshlm.model.families.qwen2_moe as qwen2_moe
import meshlm.model.families.qwen3 as qwen3
from meshlm.model.families.hf_fields import SIZE, field, flag, unsupported
from meshlm.model.router_fields import check_softmax_export

NAME = "qwen3_moe"  # the family's name and its config.json model_type
# transformers' Qwen3MoeConfig defaults for fields a config.json may leave out, where they are not Llama's
# (no head_dim field: head_dim defaults to hidden_size / num_attention_heads, as Llama's).
DEFAULTS = {
    "max_position_embeddings": 32768,
    "intermediate_size": 6144,
    "router_aux_loss_coef": 0.001,
    "decoder_sparse_step": 1,
}


def experts(hf: dict, count: str, width: str, defaults: tuple[int, int, int]) -> dict[str, Any]:
    """The MoE fields of a config.json whose expert count is ``count`` (transformers' attribute_map also
    accepts ``num_local_experts`` for it) and expert width ``width``: (count, per token, width) default
    to ``defaults``; ``norm_topk_prob`` to False (both families' transformers default)."""
    if "num_local_experts" in hf and count not in hf:
        hf = {**hf, count: hf["num_local_experts"]}
    return {
        "n_experts": field(hf, count, SIZE, defaults[0]),
        "experts_per_token": field(hf, "num_experts_per_tok", SIZE, defaults[1]),
        "moe_d_ff": field(hf, width, SIZE, defaults[2]),
        "norm_topk_prob": flag(hf, "norm_topk_prob"),
        "router_aux_loss_coef": float(hf["router_aux_loss_coef"]),
    }


def read(hf: dict) -> dict[str, Any]:
    """Qwen3MoeConfig: Llama's fields with Qwen3-MoE's defaults, the experts'; no sliding window."""
    hf = {**DEFAULTS, **hf}
    if flag(hf, "use_sliding_window"):
        raise unsupported("use_sliding_window", True, f"meshlm's {NAME} attends to the whole context")
    if hf.get("router_jitter_noise"):
        raise unsupported("router_jitter_noise", hf["router_jitter_noise"], "meshlm routes without noise")
    fields = llama.read(hf)
    moe = experts(hf, "num_experts", "moe_intermediate_size", (128, 8, 768))
    return {**fields, **moe, "dense_layers": tuple(qwen2_moe.dense_layers(hf, fields["n_layers"]))}


def write_experts(cfg) -> dict[str, Any]:
    """The MoE fields both families write (``experts``' reverse)."""
    return {
        "num_experts": cfg.n_experts,
        "num_experts_per_tok": cfg.experts_per_token,
        "norm_topk_prob": cfg.norm_topk_prob,
        "router_aux_loss_coef": cfg.router_aux_loss_coef,
        "output_router_logits": False,
    }


def write(cfg) -> dict[str, Any]:
    fields = {k: v for k, v in llama.write(cfg).items() if k != "mlp_bias"}
    window = {"use_sliding_window": False, "sliding_window": None, "max_window_layers": cfg.n_layers}
    sparse = {
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(cfg.dense_layers),
        "moe_intermediate_size": cfg.moe_d_ff,
    }
    return {**fields, **window, **sparse, **write_experts(cfg)}


def check_export(cfg) -> None:
    """What transformers' Qwen3-MoE and OLMoE cannot express beyond Llama's: a shared expert (a z-loss
    is dropped on export: ``io.hf_config.dropped_on_export``)."""
    llama.check_export(cfg)
    check_softmax_export(cfg)
    if cfg.shared_expert_d_ff:
        raise unsupported(
            "shared_expert_d_ff",
            cfg.shared_expert_d_ff,
            f"transformers' {cfg.family} has no shared expert: set it to 0 to export",
        )


# The experts (layout "experts": [E, out, in] <-> ours [E, in, out]) and the router ([E, D] <-> [D, E]),
# as Qwen2-MoE's checkpoints name them (OLMoE's too); transformers 5's fused in-memory names.
_DENSE_MLP = ("mlp/w_gate", "mlp/w_up", "mlp/w_down")
MOE_LAYER = {
    "moe/router/w": ("mlp.gate.weight", "linear"),
    "moe/experts/w_gate": ("mlp.experts.{e}.gate_proj.weight", "experts"),
    "moe/experts/w_up": ("mlp.experts.{e}.up_proj.weight", "experts"),
    "moe/experts/w_down": ("mlp.experts.{e}.down_proj.weight", "experts"),
}
MOE_FUSED = {
    "mlp.experts.gate_up_proj": ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight"),
    "mlp.experts.down_proj": ("mlp.experts.{e}.down_proj.weight",),
}


def moe_layer(dense: dict) -> dict:
    """A dense family's layer tensors with the MoE feed-forward in place of its MLP."""
    return {**{k: v for k, v in dense.items() if k not in _DENSE_MLP}, **MOE_LAYER}


HF = replace(
    qwen3.HF,
    model_type=NAME,
    architecture="Qwen3MoeForCausalLM",
    read=read,
    write=write,
    check_export=check_export,
    layer={**qwen3.HF.layer, **MOE_LAYER},  # the dense MLP's names: its dense layers'
    fused=MOE_FUSED,
)
FAMILY = replace(qwen3.FAMILY, name=NAME, hf=HF, moe=True)

# ``ModelConfig`` fields by preset name (the registry adds ``family``). qwen3-30b-a3b: Qwen/Qwen3-30B-A3B's
# config.json as written from memory (not downloaded here): 48 layers, 128 experts of 768, 8 per token
# renormalised, head_dim 128 != 2048 / 32; 30.53B parameters in all (``meshlm configs``), ~3.3B active.
PRESETS: dict[str, dict] = {
    # tiny-qwen3's attention (head_dim 16 != 64 / 8, 2 KV heads split on mp = 2); 4 experts, 2 per token,
    # moe_d_ff 32 splitting on mp = 2 and 4; the aux and z losses on, so the proof covers them.
    "tiny-qwen3-moe": dict(
        qwen3.PRESETS["tiny-qwen3"],
        n_experts=4,
        experts_per_token=2,
        moe_d_ff=32,
        router_aux_loss_coef=0.02,
        router_z_loss_coef=0.001,
    ),
    # Today's MoE recipe at CPU size (issue 42): 64 experts of 128 units, top 8 in each token's best 2
    # of 4 groups of 16, sigmoid scores, a selection bias balanced without an aux loss (DeepSeek-V3's
    # rate 1e-3), the weights renormalised and scaled by 2.5, one always-on shared expert; cpu's sizes
    "cpu-moe": dict(
        llama.PRESETS["cpu"],
        n_kv_heads=4,
        n_experts=64,
        experts_per_token=8,
        moe_d_ff=128,
        norm_topk_prob=True,
        router_score="sigmoid",
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        balance_bias=True,
        moe_bias_rate=1e-3,
        n_shared_experts=1,
    ),
    # cpu-moe's router at tiny-qwen3-moe's size, for the tests: 8 experts in 4 groups of 2, each token's
    # best 2 groups then its top 2; a faster bias rate, so a few steps move the load
    "tiny-cpu-moe": dict(
        qwen3.PRESETS["tiny-qwen3"],
        n_experts=8,
        experts_per_token=2,
        moe_d_ff=32,
        router_score="sigmoid",
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        balance_bias=True,
        moe_bias_rate=1e-2,
        n_shared_experts=1,
    ),
    "qwen3-30b-a3b": dict(
        vocab_size=151936,
        d_model=2048,
        n_layers=48,
        d_ff=6144,
        n_heads=32,
        n_kv_heads=4,
        head_dim=128,
        rope_theta=1e6,
        max_seq_len=40960,
        norm_eps=1e-6,
        n_experts=128,
        experts_per_token=8,
        moe_d_ff=768,
        router_aux_loss_coef=0.001,
    ),
    # the chip's MoE bench model (docs/benchmarks.md, "On a TPU chip"; issue 57): llama-100m's width and
    # vocabulary with Qwen3's attention, 4 layers of 32 experts of 256 units, 4 per token (active width
    # 4 x 256 = 1024 against dense-eq's): the shape issue 57 measured the dispatches on
    "qwen3-moe-100m": dict(
        vocab_size=16384,
        d_model=768,
        n_layers=4,
        d_ff=3072,
        n_heads=12,
        n_kv_heads=4,
        head_dim=64,
        rope_theta=1e6,
        max_seq_len=8192,
        norm_eps=1e-6,
        n_experts=32,
        experts_per_token=4,
        moe_d_ff=256,
        router_aux_loss_coef=0.001,
    ),
    # qwen3-30b-a3b's expert shape on one 16 GiB chip (issue 64: the experts against dense-eq at a real
    # shape): its d_model 2048, expert width 768, attention and rotary; 2 layers of 16 experts, 2 per
    # token (the real model's k / E = 1/16 of a batch's rows per expert: groups of its size), the chip
    # presets' 16384-token vocabulary. 256M parameters, 2.86 GiB with AdamW's moments in float32: two MoE
    # copies (two dispatches) and dense-eq fit one bench run
    "qwen3-moe-a3b-chip": dict(
        vocab_size=16384,
        d_model=2048,
        n_layers=2,
        d_ff=6144,
        n_heads=32,
        n_kv_heads=4,
        head_dim=128,
        rope_theta=1e6,
        max_seq_len=8192,
        norm_eps=1e-6,
        n_experts=16,
        experts_per_token=2,
        moe_d_ff=768,
        router_aux_loss_coef=0.001,
    ),
}
