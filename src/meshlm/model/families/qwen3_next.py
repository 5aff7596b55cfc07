"""Qwen3-Next (model_type qwen3_next, Qwen3NextForCausalLM): the hybrid Qwen3.5 grew from (Gated DeltaNet
linear-attention layers among gated full-attention layers with partial rotary, (1 + w) RMSNorms;
``model.families.qwen3_5``), every layer's feed-forward a mixture of experts with a sigmoid-gated
shared expert (``model.families.qwen3_5_moe``), the router renormalised only with ``norm_topk_prob``
(transformers' default True). Qwen2-MoE's ``mlp_only_layers`` / ``decoder_sparse_step`` must leave
every layer sparse (dense layers beside the linear ones are not built); ``intermediate_size`` is kept as
``d_ff`` so that config.json round-trips.

Its own fused projections: ``in_proj_qkvz`` holds, per key head j, [q_j (dk), k_j (dk), v and z of its
r = Vh/Kh value heads (r dv each)] and ``in_proj_ba`` [b, a of those r heads]; ``regroup`` reorders the
rows into the parts one after another (q, k, v, z; b, a) for ``io.hf_fused``'s slices, and back on
export. ``conv1d`` is Qwen3.5's (channels q, k, v).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

import meshlm.model.families.qwen2_moe as qwen2_moe
import meshlm.model.families.qwen3_5_moe as qwen3_5_moe
from meshlm.errors import ConfigError
from meshlm.model.families.hf_fields import SIZE, field, flag

# transformers' Qwen3NextConfig defaults where they are not Qwen3.5-MoE's.
DEFAULTS = {"intermediate_size": 5632, "num_experts": 512, "num_experts_per_tok": 10, "norm_topk_prob": True}


def read(hf: dict) -> dict[str, Any]:
    """Qwen3NextConfig: Qwen3.5-MoE's fields, ``norm_topk_prob``, and every layer sparse."""
    hf = {**qwen3_5_moe.DEFAULTS, **DEFAULTS, **hf}
    fields = qwen3_5_moe.read(hf)
    if qwen2_moe.dense_layers({"decoder_sparse_step": 1, **hf}, fields["n_layers"]):
        raise ConfigError(
            f"HF config mlp_only_layers={hf.get('mlp_only_layers')} / decoder_sparse_step="
            f"{hf.get('decoder_sparse_step')} make dense layers; meshlm's qwen3_next has every layer sparse"
        )
    d_ff = field(hf, "intermediate_size", SIZE)
    return {**fields, "d_ff": d_ff, "norm_topk_prob": flag(hf, "norm_topk_prob")}


def write(cfg) -> dict[str, Any]:
    sparse = {"decoder_sparse_step": 1, "mlp_only_layers": [], "intermediate_size": cfg.d_ff}
    return {**qwen3_5_moe.write(cfg), **sparse, "norm_topk_prob": cfg.norm_topk_prob}


def check_export(cfg) -> None:
    qwen3_5_moe.check_export(cfg.replace(norm_topk_prob=True))  # either router rule exports here


def _parts(cfg) -> tuple[int, dict[str, list[int]]]:
    """(key heads Kh, per fused tensor the rows of each part in one head group)."""
    kh, dk, dv = cfg.linear_key_heads, cfg.linear_key_dim, cfg.linear_value_dim
    r = cfg.linear_value_heads // kh
    return kh, {
        "linear_attn.in_proj_qkvz.weight": [dk, dk, r * dv, r * dv],
        "linear_attn.in_proj_ba.weight": [r, r],
    }


def regroup(cfg, tensors: dict, to_hf: bool) -> None:
    """Each linear layer's in_proj_qkvz and in_proj_ba rows: transformers' per key head groups <-> the
    parts one after another (a tensor of another size is left for the shape check to name)."""
    kh, parts = _parts(cfg)
    prefix = cfg.arch.hf.layer_prefix
    for i in cfg.linear_layers:
        for name, sizes in parts.items():
            key = prefix.format(i=i) + name
            w = tensors.get(key)
            if w is None or w.shape[0] != kh * sum(sizes):
                continue
            if to_hf:  # [part][group, rows] -> [group][part, rows]
                split = np.split(w, np.cumsum([kh * s for s in sizes])[:-1])
                grouped = np.concatenate([p.reshape(kh, s, -1) for p, s in zip(split, sizes, strict=True)], 1)
                tensors[key] = grouped.reshape(w.shape)
            else:
                grouped = w.reshape(kh, sum(sizes), -1)
                split = np.split(grouped, np.cumsum(sizes)[:-1], axis=1)
                tensors[key] = np.concatenate([p.reshape(-1, w.shape[1]) for p in split])


_LINEAR = {  # in each fused tensor's part order (``io.hf_fused`` slices in map order)
    "linear/wq": ("linear_attn.in_proj_qkvz.weight", "fused_q"),
    "linear/wk": ("linear_attn.in_proj_qkvz.weight", "fused_kv"),
    "linear/wv": ("linear_attn.in_proj_qkvz.weight", "fused_kv"),
    "linear/wz": ("linear_attn.in_proj_qkvz.weight", "fused_kv"),
    "linear/wb": ("linear_attn.in_proj_ba.weight", "fused_linear"),
    "linear/wa": ("linear_attn.in_proj_ba.weight", "fused_linear"),
}
HF = replace(
    qwen3_5_moe.HF,
    model_type="qwen3_next",
    architecture="Qwen3NextForCausalLM",
    read=read,
    write=write,
    check_export=check_export,
    layer={**{p: hf for p, hf in qwen3_5_moe.HF.layer.items() if p not in _LINEAR}, **_LINEAR},
    regroup=regroup,
)
FAMILY = replace(qwen3_5_moe.FAMILY, name="qwen3_next", hf=HF)

# ``ModelConfig`` fields by preset name (the registry adds ``family``).
PRESETS: dict[str, dict] = {
    # tiny-qwen3.5-moe's shapes, the router renormalised (Qwen3-Next's released rule).
    "tiny-qwen3-next": dict(qwen3_5_moe.PRESETS["tiny-qwen3.5-moe"]),
    # transformers' Qwen3NextConfig defaults (its docstring's Qwen/Qwen3-Next-80B-A3B): planning only.
    "qwen3-next-80b-a3b": dict(
        qwen3_5_moe.PRESETS["qwen3.5-35b-a3b"],
        vocab_size=151936,
        n_layers=48,
        d_ff=5632,
        n_experts=512,
        experts_per_token=10,
        rope_theta=1e4,
    ),
}
