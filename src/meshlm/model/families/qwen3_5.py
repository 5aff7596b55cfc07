"""Qwen3.5 (text, dense: model_type qwen3_5_text, Qwen3_5ForCausalLM): a hybrid of Gated DeltaNet
linear-attention layers and gated full-attention layers, 3:1 (``layer_types`` / ``full_attention_interval``
4: ``ModelConfig.full_attn_every``; ``model.linear_attention``), in Llama's sequential pre-norm block
with Gemma's (1 + w) RMSNorm everywhere (the q/k norms too: ``Family.qk_norm`` "head_plus_one"), SwiGLU.

The full-attention layers: an output gate from the query projection (q_proj gives each head's query,
then its gate: ``Family.attn_gate``; it multiplies the head's output after the kernel, before o_proj,
so it lives in the attention layer, not in the kernels' ``Variant``), partial rotary (rotate-half over
the first ``partial_rotary_factor`` = 0.25 of each head: ``rotary_dim``, the variant's rotary
frequencies). Qwen3.5's mRoPE (``mrope_section``) gives text tokens the same position on its three
axes, so its sections recombine frequencies of one 1-D position: plain RoPE for text.

transformers fuses the linear layers' q, k, v projections (``in_proj_qkv``: rows q, k, v) and their
convolutions (``conv1d.weight`` [C, 1, K], channels in the same order); they split into our per-head
parameters by rows, and join again on export (``io.hf_fused``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import meshlm.model.families.llama as llama
import meshlm.model.families.qwen3 as qwen3
from meshlm.errors import ConfigError
from meshlm.model.families.hf_fields import POSITIVE, SIZE, field, unsupported

# transformers' Qwen3_5TextConfig defaults where they are not Llama's.
DEFAULTS = {"head_dim": 256, "max_position_embeddings": 32768}
LINEAR = {  # ours -> (config.json field, transformers' default)
    "linear_conv": ("linear_conv_kernel_dim", 4),
    "linear_key_dim": ("linear_key_head_dim", 128),
    "linear_value_dim": ("linear_value_head_dim", 128),
    "linear_key_heads": ("linear_num_key_heads", 16),
    "linear_value_heads": ("linear_num_value_heads", 32),
}
ROPE_TEXT_ONLY = ("mrope_section", "mrope_interleaved")  # one position on every mRoPE axis for text


def layer_types(n_layers: int, every: int) -> list[str]:
    """transformers' layer_types for a full-attention layer every ``every`` layers."""
    return ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n_layers)]


def _full_every(hf: dict, n_layers: int) -> int:
    """``full_attn_every`` from layer_types (or full_attention_interval, default 4): only the periodic
    pattern transformers itself makes converts."""
    kinds = hf.get("layer_types")
    if kinds is None:
        return field(hf, "full_attention_interval", SIZE, 4)
    for every in range(1, n_layers + 1):
        if kinds == layer_types(n_layers, every):
            return every
    raise unsupported("layer_types", kinds, "meshlm's qwen3_5 has a full-attention layer every N layers")


def read(hf: dict) -> dict[str, Any]:
    """Qwen3_5TextConfig: Llama's fields with Qwen3.5's defaults, the partial rotary factor and the
    linear-attention fields; mRoPE's sections are dropped (text: 1-D positions)."""
    params = dict(hf.get("rope_parameters") or {})
    factor = params.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
    for key in ROPE_TEXT_ONLY:
        params.pop(key, None)
    factor = field({"partial_rotary_factor": factor}, "partial_rotary_factor", POSITIVE)
    plain = {k: v for k, v in hf.items() if k != "partial_rotary_factor"}
    fields = llama.read({**DEFAULTS, **plain, "rope_parameters": params or None})
    head_dim = fields["head_dim"] or fields["d_model"] // fields["n_heads"]
    rot = int(head_dim * factor)
    if rot % 2 or rot < 2 or factor > 1:
        raise ConfigError(f"HF config partial_rotary_factor={factor} gives {rot} rotary dims of {head_dim}")
    linear = {ours: field(hf, name, SIZE, default) for ours, (name, default) in LINEAR.items()}
    every = _full_every(hf, fields["n_layers"])
    return {**fields, **linear, "rotary_dim": 0 if rot == head_dim else rot, "full_attn_every": every}


def write(cfg) -> dict[str, Any]:
    fields = {k: v for k, v in llama.write(cfg).items() if k not in ("mlp_bias", "rope_theta")}
    rope = {**fields["rope_parameters"], "partial_rotary_factor": cfg.rot_dim / cfg.dim_per_head}
    linear = {name: getattr(cfg, ours) for ours, (name, _) in LINEAR.items()}
    kinds = layer_types(cfg.n_layers, cfg.full_attn_every or 1)
    return {**fields, **linear, "rope_parameters": rope, "layer_types": kinds}


def check_export(cfg) -> None:
    if cfg.full_attn_every and cfg.n_layers >= cfg.full_attn_every:
        return
    raise ConfigError(f"full_attn_every={cfg.full_attn_every}: a qwen3_5 export needs a full-attention layer")


_LINEAR_TENSORS = {
    "linear/wq": ("linear_attn.in_proj_qkv.weight", "fused_q"),  # rows: q, k, v
    "linear/wk": ("linear_attn.in_proj_qkv.weight", "fused_kv"),
    "linear/wv": ("linear_attn.in_proj_qkv.weight", "fused_kv"),
    "linear/conv_q": ("linear_attn.conv1d.weight", "fused_conv"),  # channels: q, k, v
    "linear/conv_k": ("linear_attn.conv1d.weight", "fused_conv"),
    "linear/conv_v": ("linear_attn.conv1d.weight", "fused_conv"),
    "linear/wz": ("linear_attn.in_proj_z.weight", "q"),
    "linear/wa": ("linear_attn.in_proj_a.weight", "linear"),
    "linear/wb": ("linear_attn.in_proj_b.weight", "linear"),
    "linear/a_log": ("linear_attn.A_log", "copy"),
    "linear/dt_bias": ("linear_attn.dt_bias", "copy"),
    "linear/norm/scale": ("linear_attn.norm.weight", "copy"),
    "linear/wo": ("linear_attn.out_proj.weight", "o"),
}
HF = replace(
    qwen3.HF,
    model_type="qwen3_5_text",
    architecture="Qwen3_5ForCausalLM",
    read=read,
    write=write,
    check_export=check_export,
    layer={**qwen3.HF.layer, **_LINEAR_TENSORS},  # attn/wq: q_proj [H * 2E, D], each head's query then gate
)
FAMILY = replace(
    qwen3.FAMILY, name="qwen3_5", hf=HF, norm="rms_plus_one", qk_norm="head_plus_one", attn_gate=True
)

# ``ModelConfig`` fields by preset name (the registry adds ``family``).
PRESETS: dict[str, dict] = {
    # 4 layers: linear, full, linear, full (the released models' 3:1 is full_attn_every=4; periods of 2
    # keep the proof's compile short, and two periods let --pp 2 give each stage a linear and a full
    # layer); 4 key heads and 8 value heads (r = 2: a key head serves two), so mp = 4 splits both; chunks
    # of 8 tokens (verify's sequences span several); partial rotary 4 of 16; 2 KV heads (replicated on
    # mp = 4). The suite proves one period of it (``n_layers=2``: the same code, half the compile).
    "tiny-qwen3.5": dict(
        llama.TINY,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        rotary_dim=4,
        rope_theta=1e7,
        full_attn_every=2,
        linear_key_heads=4,
        linear_value_heads=8,
        linear_key_dim=8,
        linear_value_dim=8,
        linear_chunk=8,
    ),
    # transformers' Qwen3_5TextConfig defaults (its docstring's Qwen/Qwen3.5 shape): planning only.
    "qwen3.5-text": dict(
        vocab_size=248320,
        d_model=4096,
        n_layers=32,
        d_ff=12288,
        n_heads=16,
        n_kv_heads=4,
        head_dim=256,
        rotary_dim=64,
        rope_theta=1e7,
        max_seq_len=32768,
        full_attn_every=4,
        linear_key_heads=16,
        linear_value_heads=32,
        linear_key_dim=128,
        linear_value_dim=128,
    ),
}
