"""Qwen3.5-MoE (text: model_type qwen3_5_moe_text, Qwen3_5MoeForCausalLM): Qwen3.5's hybrid
(``model.families.qwen3_5``: Gated DeltaNet linear-attention layers among gated full-attention layers
with partial rotary) whose every layer's feed-forward, the linear layers' too, is a mixture of experts
(``model.moe``) with a shared expert: Qwen2-MoE's, a gated MLP of ``shared_expert_intermediate_size``
times sigmoid(x @ ``shared_expert_gate``). The router: softmax over ``num_experts``, the top
``num_experts_per_tok``, always renormalised (transformers' ``Qwen3_5MoeTopKRouter`` has no
``norm_topk_prob``). No dense layers (no ``intermediate_size``: ``d_ff`` is kept at the experts' width).

Weights on disk as Qwen2-MoE's (one tensor per expert, ``mlp.gate``, ``mlp.shared_expert.*``,
``mlp.shared_expert_gate``; transformers 5 fuses the experts in memory); the linear layers' fused
``in_proj_qkv`` and ``conv1d`` as Qwen3.5's.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import meshlm.model.families.qwen2_moe as qwen2_moe
import meshlm.model.families.qwen3_5 as qwen3_5
from meshlm.model.families.hf_fields import SIZE, field, unsupported
from meshlm.model.router_fields import check_softmax_export
from meshlm.ranges import Range

# transformers' Qwen3_5MoeTextConfig defaults for the experts' fields.
DEFAULTS = {
    "num_experts": 256,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "router_aux_loss_coef": 0.001,
}


def read(hf: dict) -> dict[str, Any]:
    """Qwen3_5MoeTextConfig: Qwen3.5's fields and the experts' (renormalised, a shared expert)."""
    hf = {**DEFAULTS, **hf}
    if not field(hf, "shared_expert_intermediate_size", Range(int, 0)):
        raise unsupported("shared_expert_intermediate_size", 0, "meshlm's qwen3_5_moe has a shared expert")
    moe_d_ff = field(hf, "moe_intermediate_size", SIZE)
    fields = qwen3_5.read({"intermediate_size": moe_d_ff, **hf})
    return {
        **fields,
        "n_experts": field(hf, "num_experts", SIZE),
        "experts_per_token": field(hf, "num_experts_per_tok", SIZE),
        "moe_d_ff": moe_d_ff,
        "norm_topk_prob": True,
        "shared_expert_d_ff": field(hf, "shared_expert_intermediate_size", SIZE),
        "router_aux_loss_coef": float(field(hf, "router_aux_loss_coef", Range(float, 0))),
    }


def write(cfg) -> dict[str, Any]:
    return {
        **{k: v for k, v in qwen3_5.write(cfg).items() if k != "intermediate_size"},
        "num_experts": cfg.n_experts,
        "num_experts_per_tok": cfg.experts_per_token,
        "moe_intermediate_size": cfg.moe_d_ff,
        "shared_expert_intermediate_size": cfg.shared_expert_d_ff,
        "router_aux_loss_coef": cfg.router_aux_loss_coef,
        "output_router_logits": False,
    }


def check_export(cfg) -> None:
    """What transformers' Qwen3.5-MoE cannot express: a router without renormalisation, no shared
    expert, dense layers (a z-loss is dropped on export: ``io.hf_config.dropped_on_export``)."""
    qwen3_5.check_export(cfg)
    check_softmax_export(cfg)
    for name, bad, why in (
        ("norm_topk_prob", not cfg.norm_topk_prob, "transformers' router always renormalises"),
        ("shared_expert_d_ff", not cfg.shared_expert_d_ff, "transformers' Qwen3.5-MoE has one"),
        ("dense_layers", bool(cfg.dense_layers), "transformers' Qwen3.5-MoE has none"),
    ):
        if bad:
            raise unsupported(name, getattr(cfg, name), why)


_MOE = {path: hf for path, hf in qwen2_moe.HF.layer.items() if path.startswith("moe/")}
HF = replace(
    qwen3_5.HF,
    model_type="qwen3_5_moe_text",
    architecture="Qwen3_5MoeForCausalLM",
    read=read,
    write=write,
    check_export=check_export,
    layer={**{p: hf for p, hf in qwen3_5.HF.layer.items() if not p.startswith("mlp/")}, **_MOE},
    fused=qwen2_moe.HF.fused,
)
FAMILY = replace(qwen3_5.FAMILY, name="qwen3_5_moe", hf=HF, moe=True)

# ``ModelConfig`` fields by preset name (the registry adds ``family``).
PRESETS: dict[str, dict] = {
    # one period of tiny-qwen3.5's hybrid (1 linear, then 1 full layer) with 4 experts of 32, 2 per token
    # and a shared expert of 48 in both: every width splits on mp = 2 and the experts on ep = 2; aux loss on.
    "tiny-qwen3.5-moe": dict(
        qwen3_5.PRESETS["tiny-qwen3.5"],
        n_layers=2,
        d_ff=32,
        n_experts=4,
        experts_per_token=2,
        moe_d_ff=32,
        norm_topk_prob=True,
        shared_expert_d_ff=48,
        router_aux_loss_coef=0.02,
    ),
    # transformers' Qwen3_5MoeTextConfig defaults (its docstring's Qwen/Qwen3.5-35B-A3B): planning only.
    "qwen3.5-35b-a3b": dict(
        vocab_size=248320,
        d_model=2048,
        n_layers=40,
        d_ff=512,
        n_heads=16,
        n_kv_heads=2,
        head_dim=256,
        rotary_dim=64,
        rope_theta=1e7,
        norm_eps=1e-6,
        max_seq_len=32768,
        full_attn_every=4,
        linear_key_heads=16,
        linear_value_heads=32,
        linear_key_dim=128,
        linear_value_dim=128,
        n_experts=256,
        experts_per_token=8,
        moe_d_ff=512,
        norm_topk_prob=True,
        shared_expert_d_ff=512,
        router_aux_loss_coef=0.001,
    ),
}
