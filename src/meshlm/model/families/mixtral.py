"""Mixtral: Mistral's attention blocks (Llama's, with an optional sliding window) whose feed-forward is a
mixture of experts (``Family.moe``; ``model.moe``): a router over ``num_local_experts`` gated-SiLU
experts, the top ``num_experts_per_tok`` renormalised (softmax, top-k, divided by their sum).

Weights: transformers 5 loads the experts fused in memory (``mlp.experts.gate_up_proj`` [E, 2I, D],
``mlp.experts.down_proj`` [E, D, I], ``mlp.gate.weight`` [E, D]); Mixtral checkpoints on disk keep one
tensor per expert (``block_sparse_moe.experts.{e}.w1/w3/w2.weight``, ``block_sparse_moe.gate.weight``).
``io.hf_weights`` reads both and writes the on-disk one, which transformers converts at load.

Every layer is sparse (Mixtral's are); the aux-loss coefficient is config.json's
``router_aux_loss_coef`` (0.02 in the released models; transformers adds it to the loss only with
``output_router_logits``, meshlm always trains with it: set it to 0 to train without)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import meshlm.model.families.llama as llama
import meshlm.model.families.mistral as mistral
from meshlm.model.families.hf_fields import SIZE, field, unsupported
from meshlm.model.router_fields import check_softmax_export

DEFAULTS = {"max_position_embeddings": 4096 * 32, "router_aux_loss_coef": 0.001}  # MixtralConfig's


def read(hf: dict) -> dict[str, Any]:
    """MixtralConfig: Mistral's fields (its window: null in the released models), the experts'."""
    hf = {**DEFAULTS, **hf}
    if hf.get("router_jitter_noise"):
        raise unsupported("router_jitter_noise", hf["router_jitter_noise"], "meshlm routes without noise")
    experts = field(hf, "num_local_experts", SIZE, 8)
    fields = mistral.read({"sliding_window": None, **hf})
    return {
        **fields,
        "n_experts": experts,
        "experts_per_token": field(hf, "num_experts_per_tok", SIZE, 2),
        "moe_d_ff": fields["d_ff"],  # d_ff: the same (no dense layer uses it)
        "router_aux_loss_coef": float(hf["router_aux_loss_coef"]),
    }


def write(cfg) -> dict[str, Any]:
    out = {k: v for k, v in mistral.write(cfg).items() if k != "mlp_bias"}
    return {
        **out,
        "intermediate_size": cfg.moe_d_ff,
        "num_local_experts": cfg.n_experts,
        "num_experts_per_tok": cfg.experts_per_token,
        "router_aux_loss_coef": cfg.router_aux_loss_coef,
        "router_jitter_noise": 0.0,
        "output_router_logits": False,
    }


def check_export(cfg) -> None:
    llama.check_export(cfg)
    check_softmax_export(cfg)
    if not cfg.norm_topk_prob or cfg.shared_expert_d_ff:  # a z-loss is dropped (``io.hf_config``)
        raise unsupported(
            "norm_topk_prob/shared_expert_d_ff",
            (cfg.norm_topk_prob, cfg.shared_expert_d_ff),
            "transformers' Mixtral renormalises and has no shared expert",
        )


# Llama's attention and norm tensors; the experts (layout "experts": [E, out, in] <-> ours [E, in, out],
# read from per-expert tensors or transformers' fused ones) and the router ([E, D] <-> [D, E]).
_DENSE_MLP = ("mlp/w_gate", "mlp/w_up", "mlp/w_down")
HF = replace(
    mistral.HF,
    model_type="mixtral",
    architecture="MixtralForCausalLM",
    read=read,
    write=write,
    check_export=check_export,
    layer={
        **{k: v for k, v in llama.HF.layer.items() if k not in _DENSE_MLP},
        "moe/router/w": ("block_sparse_moe.gate.weight", "linear"),
        "moe/experts/w_gate": ("block_sparse_moe.experts.{e}.w1.weight", "experts"),
        "moe/experts/w_up": ("block_sparse_moe.experts.{e}.w3.weight", "experts"),
        "moe/experts/w_down": ("block_sparse_moe.experts.{e}.w2.weight", "experts"),
    },
    fused={
        "mlp.gate.weight": ("block_sparse_moe.gate.weight",),
        "mlp.experts.gate_up_proj": (
            "block_sparse_moe.experts.{e}.w1.weight",
            "block_sparse_moe.experts.{e}.w3.weight",
        ),
        "mlp.experts.down_proj": ("block_sparse_moe.experts.{e}.w2.weight",),
    },
)
FAMILY = replace(mistral.FAMILY, name="mixtral", hf=HF, moe=True)

MIXTRAL_8X7B = dict(
    vocab_size=32000,
    d_model=4096,
    n_layers=32,
    d_ff=14336,  # as moe_d_ff (config.json's intermediate_size; no dense layer uses it)
    n_heads=32,
    n_kv_heads=8,
    rope_theta=1e6,
    max_seq_len=32768,
    norm_eps=1e-5,
    n_experts=8,
    experts_per_token=2,
    moe_d_ff=14336,
    router_aux_loss_coef=0.02,
)
# ``ModelConfig`` fields by preset name (the registry adds ``family``); the real ones: the config.json of
# mistralai/Mixtral-8x7B-v0.1 and Mixtral-8x22B-v0.1 (no sliding window).
PRESETS: dict[str, dict] = {
    # 4 experts, 2 per token, 2 layers; moe_d_ff 32 splits on mp = 2 and 4 (8 heads, 4 KV heads: as
    # tiny-llama); the aux and z losses on, so the proof covers them.
    "tiny-mixtral": dict(
        llama.TINY_LLAMA,
        d_ff=32,
        n_experts=4,
        experts_per_token=2,
        moe_d_ff=32,
        router_aux_loss_coef=0.02,
        router_z_loss_coef=0.001,
    ),
    "mixtral-8x7b": MIXTRAL_8X7B,
    "mixtral-8x22b": dict(
        MIXTRAL_8X7B,
        vocab_size=32768,
        d_model=6144,
        n_layers=56,
        n_heads=48,
        d_ff=16384,
        moe_d_ff=16384,
        max_seq_len=65536,
        router_aux_loss_coef=0.001,
    ),
}
