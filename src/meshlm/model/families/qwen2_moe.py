"""Qwen2-MoE (Qwen1.5-MoE): Qwen2's attention blocks (q/k/v biases) whose feed-forward is a mixture of
experts (``Family.moe``; ``model.moe``): a router over ``num_experts`` gated-SiLU experts of
``moe_intermediate_size``, the top ``num_experts_per_tok`` of the softmax (renormalised only with
``norm_topk_prob``: false in Qwen1.5-MoE), plus a shared expert (a dense gated MLP of
``shared_expert_intermediate_size`` on every token) times sigmoid(x @ ``shared_expert_gate``).

Dense layers among the MoE layers: layer i is sparse iff i is not in ``mlp_only_layers`` and
(i + 1) % ``decoder_sparse_step`` == 0 (transformers' Qwen2MoeDecoderLayer); the others are Qwen2's
dense MLP of ``intermediate_size`` (``ModelConfig.dense_layers``; their parameters stack apart:
``model.layer_kinds``). transformers' load-balancing loss pools the sparse layers' router logits only,
as meshlm's statistics do.

Weights: on disk one tensor per expert (``mlp.experts.{e}.gate_proj/up_proj/down_proj.weight``), the
router ``mlp.gate.weight``, ``mlp.shared_expert.*`` and ``mlp.shared_expert_gate.weight``; transformers 5
fuses the experts in memory (``mlp.experts.gate_up_proj`` [E, 2I, D], ``mlp.experts.down_proj``).
``io.hf_weights`` reads both and writes the on-disk names."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import meshlm.model.families.llama as llama
import meshlm.model.families.qwen2 as qwen2
from meshlm.errors import ConfigError
from meshlm.model.families.hf_fields import SIZE, field, flag, unsupported
from meshlm.model.router_fields import check_softmax_export
from meshlm.ranges import Range

# Qwen2MoeConfig's defaults for the fields a config.json may leave out (transformers 5.24).
DEFAULTS = {
    "max_position_embeddings": 32768,
    "router_aux_loss_coef": 0.001,
    "qkv_bias": True,
    "decoder_sparse_step": 1,
    "num_experts": 60,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 5632,
}


def dense_layers(hf: dict, n_layers: int) -> list[int]:
    """The layers transformers builds with a dense MLP: i in mlp_only_layers, or (i + 1) %
    decoder_sparse_step != 0."""
    step = field(hf, "decoder_sparse_step", SIZE)
    only = hf.get("mlp_only_layers") or []
    if not isinstance(only, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in only):
        raise ConfigError(f"HF config mlp_only_layers must be a list of layer indices, got {only!r}")
    return [i for i in range(n_layers) if i in only or (i + 1) % step]


def read(hf: dict) -> dict[str, Any]:
    """Qwen2MoeConfig: Qwen2's fields (``intermediate_size``: the dense layers'), the experts'."""
    hf = {**DEFAULTS, **hf}
    if hf.get("qkv_bias") is not True:
        raise unsupported("qkv_bias", hf.get("qkv_bias"), "meshlm's qwen2_moe has q/k/v biases")
    if not field(hf, "shared_expert_intermediate_size", Range(int, 0)):
        raise unsupported("shared_expert_intermediate_size", 0, "meshlm's qwen2_moe has a shared expert")
    fields = qwen2.read(hf)
    return {
        **fields,
        "n_experts": field(hf, "num_experts", SIZE),
        "experts_per_token": field(hf, "num_experts_per_tok", SIZE),
        "moe_d_ff": field(hf, "moe_intermediate_size", SIZE),
        "norm_topk_prob": flag(hf, "norm_topk_prob"),
        "shared_expert_d_ff": field(hf, "shared_expert_intermediate_size", SIZE),
        "router_aux_loss_coef": float(field(hf, "router_aux_loss_coef", Range(float, 0))),
        "dense_layers": tuple(dense_layers(hf, fields["n_layers"])),
    }


def write(cfg) -> dict[str, Any]:
    return {
        **qwen2.write(cfg),  # intermediate_size: d_ff, the dense layers' width
        "qkv_bias": True,
        "num_experts": cfg.n_experts,
        "num_experts_per_tok": cfg.experts_per_token,
        "moe_intermediate_size": cfg.moe_d_ff,
        "shared_expert_intermediate_size": cfg.shared_expert_d_ff,
        "norm_topk_prob": cfg.norm_topk_prob,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(cfg.dense_layers),
        "router_aux_loss_coef": cfg.router_aux_loss_coef,
        "output_router_logits": False,
    }


def check_export(cfg) -> None:
    llama.check_export(cfg)
    check_softmax_export(cfg)
    if not cfg.shared_expert_d_ff:  # a z-loss is dropped on export (``io.hf_config.dropped_on_export``)
        raise unsupported("shared_expert_d_ff", cfg.shared_expert_d_ff, "transformers' Qwen2-MoE has one")


# Qwen2's attention, norm and dense-MLP tensors (the dense layers'); the experts (layout "experts"), the
# router and the shared expert with its gate ([1, D] <-> ours [D, 1]).
HF = replace(
    qwen2.HF,
    model_type="qwen2_moe",
    architecture="Qwen2MoeForCausalLM",
    read=read,
    write=write,
    check_export=check_export,
    layer={
        **qwen2.HF.layer,
        "moe/router/w": ("mlp.gate.weight", "linear"),
        "moe/experts/w_gate": ("mlp.experts.{e}.gate_proj.weight", "experts"),
        "moe/experts/w_up": ("mlp.experts.{e}.up_proj.weight", "experts"),
        "moe/experts/w_down": ("mlp.experts.{e}.down_proj.weight", "experts"),
        "moe/shared/w_gate": ("mlp.shared_expert.gate_proj.weight", "linear"),
        "moe/shared/w_up": ("mlp.shared_expert.up_proj.weight", "linear"),
        "moe/shared/w_down": ("mlp.shared_expert.down_proj.weight", "linear"),
        "moe/shared_gate/w": ("mlp.shared_expert_gate.weight", "linear"),
    },
    fused={
        "mlp.experts.gate_up_proj": ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight"),
        "mlp.experts.down_proj": ("mlp.experts.{e}.down_proj.weight",),
    },
)
FAMILY = replace(qwen2.FAMILY, name="qwen2_moe", hf=HF, moe=True)

# ``ModelConfig`` fields by preset name (the registry adds ``family``).
PRESETS: dict[str, dict] = {
    # 4 experts, 2 per token, not renormalised (Qwen1.5-MoE's rule); a shared expert; 3 layers, the
    # first dense (mlp_only_layers=[0]); every width splits on mp = 2 (moe_d_ff 32, the shared
    # expert's 48, the dense layer's 64); aux and z losses on, so the proof covers them.
    "tiny-qwen2-moe": dict(
        qwen2.PRESETS["tiny-qwen2"],
        tie_embeddings=False,
        n_layers=3,
        d_ff=64,
        n_experts=4,
        experts_per_token=2,
        moe_d_ff=32,
        norm_topk_prob=False,
        shared_expert_d_ff=48,
        dense_layers=(0,),
        router_aux_loss_coef=0.02,
        router_z_loss_coef=0.001,
    ),
    # Qwen/Qwen1.5-MoE-A2.7B's config.json, written from memory (not downloaded here): 24 layers, all
    # sparse (decoder_sparse_step 1, no mlp_only_layers), 60 experts of 1408, 4 per token, not
    # renormalised, a shared expert of 5632, router_aux_loss_coef 0.001; 14.3B parameters, 2.7B active.
    "qwen2-moe-a2.7b": dict(
        vocab_size=151936,
        d_model=2048,
        n_layers=24,
        d_ff=5632,
        n_heads=16,
        rope_theta=1e6,
        max_seq_len=8192,
        norm_eps=1e-6,
        n_experts=60,
        experts_per_token=4,
        moe_d_ff=1408,
        norm_topk_prob=False,
        shared_expert_d_ff=5632,
        router_aux_loss_coef=0.001,
    ),
}
