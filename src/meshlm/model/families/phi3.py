"""Phi-3 (mini, medium; transformers' model_type "phi3"): Llama's blocks (RMSNorm, sequential pre-norm
attention then SwiGLU, rotate-half rotary, grouped-query attention, no biases) with three differences,
all in the checkpoint and config.json:

- fused projections: ``qkv_proj`` is q, k and v stacked on the output dimension ([H*E + 2*K*E, D]:
  H*E query rows, then K*E key rows, then K*E value rows) and ``gate_up_proj`` the gate and up
  projections ([2F, D], gate first: transformers' ``chunk(2)`` then ``up * act(gate)``). meshlm keeps
  them apart (each is sharded over mp with its own heads or columns); ``io.hf_weights`` splits them on
  import and fuses them on export (the "fused_*" layouts), the split sizes from the config.
- a sliding window (``sliding_window``, 2047 in the 4k models): transformers 5 masks with
  ``create_sliding_window_causal_mask`` whenever it is set, keys j with i - window < j <= i, in every
  layer, which is meshlm's ``sliding_window`` (Mistral's); null or absent: full causal attention.
- partial rotary (``partial_rotary_factor``, Phi-4-mini's 0.75): rotate-half over the first
  int(head_dim * factor) dims of each head, the rest passed through, as meshlm's ``rotary_dim``.

LongRoPE (``rope_scaling`` type "longrope", "su" or "yarn": the 128k models) switches between two
factor lists by sequence length and rescales cos/sin; meshlm does not implement it and refuses it by
name. Dropouts (``resid_pdrop``, ``embd_pdrop``, ``attention_dropout``) must be 0.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import meshlm.model.families.llama as llama
from meshlm.errors import ConfigError
from meshlm.model.families.hf_fields import SIZE, field, rope_fields, unsupported
from meshlm.ranges import Range

# transformers' Phi3Config defaults for fields a config.json may leave out, where they are not Llama's.
DEFAULTS = {"max_position_embeddings": 4096, "rms_norm_eps": 1e-5}
ROPE_FIELDS = ("rope_parameters", "rope_scaling")
LONGROPE = ("longrope", "su", "yarn")  # Phi3Config turns "su" and "yarn" into "longrope"
FACTOR = Range(float, 0, 1, low_open=True)


def _partial_factor(hf: dict) -> float:
    """partial_rotary_factor: a rope dict's own, else the top-level one (Phi3Config's precedence), 1."""
    factor = hf.get("partial_rotary_factor")
    for name in ROPE_FIELDS:
        params = hf.get(name)
        if isinstance(params, dict) and params.get("partial_rotary_factor") is not None:
            factor = params["partial_rotary_factor"]
    factor = 1.0 if factor is None else factor
    problem = FACTOR.problem("partial_rotary_factor", factor)
    if problem:
        raise ConfigError(f"HF config {problem}; correct it in config.json")
    return float(factor)


def _without_partial(hf: dict) -> dict:
    """``hf`` without partial_rotary_factor (read here, not by Llama's reader, which refuses it); a
    LongRoPE type is refused, naming the field."""
    out = {k: v for k, v in hf.items() if k != "partial_rotary_factor"}
    for name in ROPE_FIELDS:
        params = hf.get(name)
        if not isinstance(params, dict):
            continue
        kind = params.get("rope_type", params.get("type", "default"))
        if kind in LONGROPE:
            raise unsupported(
                f"{name}.rope_type",
                kind,
                "LongRoPE (the 128k models) is not implemented; use a 4k model",
            )
        if kind != "default":
            raise unsupported(
                f"{name}.rope_type", kind, "transformers' Phi-3 has 'default' or 'longrope' RoPE"
            )
        out[name] = {k: v for k, v in params.items() if k != "partial_rotary_factor"}
    return out


def read(hf: dict) -> dict[str, Any]:
    """Phi3Config: Llama's fields with Phi-3's defaults, its sliding window and partial rotary."""
    fields = llama.read({**DEFAULTS, **_without_partial(hf)})
    head_dim = fields["head_dim"] or fields["d_model"] // fields["n_heads"]  # as Llama's reader checked
    rotary = int(head_dim * _partial_factor(hf))  # transformers' own rounding
    if rotary % 2 or rotary < 2:
        raise ConfigError(
            f"HF config partial_rotary_factor gives {rotary} rotary dims of head_dim={head_dim}; meshlm "
            "rotates an even number >= 2: correct config.json"
        )
    window = field(hf, "sliding_window", SIZE, 0, nullable=True)  # null or absent: none
    return {**fields, "rotary_dim": 0 if rotary == head_dim else rotary, "sliding_window": window}


def check_export(cfg) -> None:
    if cfg.rope_scaling is not None:
        raise ConfigError(
            "rope_scaling (Llama 3's): transformers' Phi-3 has plain RoPE; set rope_scaling=None"
        )
    if int(cfg.dim_per_head * (cfg.rot_dim / cfg.dim_per_head)) != cfg.rot_dim:
        raise ConfigError(
            f"rotary_dim={cfg.rotary_dim} is not a partial_rotary_factor transformers can express"
        )


def write(cfg) -> dict[str, Any]:
    factor = cfg.rot_dim / cfg.dim_per_head
    fields = {k: v for k, v in llama.write(cfg).items() if k not in ("mlp_bias", "rope_scaling")}
    return {
        **fields,
        "rope_parameters": {**rope_fields(cfg), "partial_rotary_factor": factor},
        "partial_rotary_factor": factor,  # where transformers 4.x reads it
        "original_max_position_embeddings": cfg.max_seq_len,
        "sliding_window": cfg.sliding_window or None,  # null: no window
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
    }


# Llama's tensors, q/k/v and gate/up each fused into one ("fused_<layout>": a slice of the HF tensor's
# rows, the slices in this order: q, k, v and gate, up).
_QKV, _GATE_UP = "self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight"
HF = replace(
    llama.HF,
    model_type="phi3",
    architecture="Phi3ForCausalLM",
    dropout_fields=("attention_dropout", "resid_pdrop", "embd_pdrop"),
    read=read,
    write=write,
    check_export=check_export,
    layer={
        **llama.HF.layer,
        "attn/wq": (_QKV, "fused_q"),
        "attn/wk": (_QKV, "fused_kv"),
        "attn/wv": (_QKV, "fused_kv"),
        "mlp/w_gate": (_GATE_UP, "fused_linear"),
        "mlp/w_up": (_GATE_UP, "fused_linear"),
    },
)
FAMILY = replace(llama.FAMILY, name="phi3", hf=HF)

# ``ModelConfig`` fields by preset name (the registry adds ``family``).
PRESETS: dict[str, dict] = {
    # GQA (4 KV heads of 8: the fused q/k/v split sizes differ) and a window of 16 < verify's 64
    # positions (Phi-3-mini's 2047 of 4096, scaled down).
    "tiny-phi3": dict(llama.TINY_LLAMA, sliding_window=16),
    # microsoft/Phi-3-mini-4k-instruct's config.json: vocabulary 32064 (padded to 32128 on mp).
    "phi3-mini": dict(
        vocab_size=32064,
        d_model=3072,
        n_layers=32,
        d_ff=8192,
        n_heads=32,
        max_seq_len=4096,
        norm_eps=1e-5,
        sliding_window=2047,
    ),
}
