"""meshlm's ``ModelConfig`` to a Hugging Face transformers config.json dict (the export half of
``io.hf_config``): the checks that a config is expressible in transformers, then its fields."""

from __future__ import annotations

import dataclasses
from typing import Any

from meshlm.errors import ConfigError
from meshlm.io.hf_config import GPTJ_ROPE_THETA, HF
from meshlm.model.config import ModelConfig


def _check_exportable(cfg: ModelConfig) -> None:
    """Configs meshlm can train but transformers' GPT-J / Llama cannot express."""
    if cfg.family not in HF:
        exports = " and ".join(HF)
        raise ConfigError(f"family {cfg.family!r} has no transformers equivalent; only {exports} export")
    own = cfg.arch.rotary
    if cfg.rotary_style not in ("", own):
        raise ConfigError(f"rotary_style={cfg.rotary_style!r}: transformers' {cfg.family} uses {own!r}")
    if cfg.embed_bias:
        raise ConfigError("embed_bias=True has no transformers equivalent; only embed_bias=False exports")
    WRITERS[cfg.family][0](cfg)


def _gptj_exportable(cfg: ModelConfig) -> None:
    if cfg.tie_embeddings or cfg.kv_heads != cfg.n_heads or cfg.dim_per_head * cfg.n_heads != cfg.d_model:
        raise ConfigError(
            "transformers' GPT-J needs tie_embeddings=False, n_kv_heads=n_heads and "
            f"head_dim=d_model/n_heads; got {cfg.tie_embeddings}, {cfg.kv_heads}, {cfg.dim_per_head}"
        )
    if cfg.rope_theta != GPTJ_ROPE_THETA:
        raise ConfigError(f"rope_theta={cfg.rope_theta}: transformers' GPT-J uses {GPTJ_ROPE_THETA}")


def _llama_exportable(cfg: ModelConfig) -> None:
    if cfg.rot_dim != cfg.dim_per_head:
        raise ConfigError(f"rotary_dim={cfg.rotary_dim}: transformers' Llama rotates the whole head")


def _gptj_fields(cfg: ModelConfig) -> dict[str, Any]:
    return {
        **{k: 0.0 for k in HF["gptj"].dropout_fields},
        "n_embd": cfg.d_model,
        "n_layer": cfg.n_layers,
        "n_head": cfg.n_heads,
        "n_inner": cfg.d_ff,
        "rotary_dim": cfg.rot_dim,
        "n_positions": cfg.max_seq_len,
        "layer_norm_epsilon": cfg.norm_eps,
        "activation_function": "gelu_new",
    }


def _llama_fields(cfg: ModelConfig) -> dict[str, Any]:
    return {
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.dim_per_head,
        "intermediate_size": cfg.d_ff,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "rope_parameters": _rope_fields(cfg),
        "rope_theta": cfg.rope_theta,  # where transformers 4.x reads it
        **({"rope_scaling": _rope_fields(cfg)} if cfg.rope_scaling else {}),  # and its scaling
    }


def _mistral_fields(cfg: ModelConfig) -> dict[str, Any]:
    return {**_llama_fields(cfg), "sliding_window": cfg.sliding_window or None}  # null: no window


def _gemma_fields(cfg: ModelConfig) -> dict[str, Any]:
    return {**_llama_fields(cfg), "hidden_act": HF["gemma"].activations[0]}


def _rope_fields(cfg: ModelConfig) -> dict[str, Any]:
    if cfg.rope_scaling is None:
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}
    return {"rope_type": "llama3", "rope_theta": cfg.rope_theta, **dataclasses.asdict(cfg.rope_scaling)}


def _qwen2_fields(cfg: ModelConfig) -> dict[str, Any]:
    fields = {k: v for k, v in _llama_fields(cfg).items() if k not in ("attention_bias", "mlp_bias")}
    window = {"use_sliding_window": False, "sliding_window": None, "max_window_layers": cfg.n_layers}
    return {**fields, **window, "layer_types": ["full_attention"] * cfg.n_layers}


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The transformers config.json dict for ``cfg`` (float32 weights; no tokenizer ids: meshlm does
    not know the tokenizer, so bos/eos/pad are null)."""
    _check_exportable(cfg)
    common = {
        "architectures": [HF[cfg.family].architecture],
        "model_type": cfg.family,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": cfg.tie_embeddings,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "dtype": "float32",
        "torch_dtype": "float32",  # the name transformers < 4.56 reads
    }
    fields = WRITERS[cfg.family][1](cfg)
    if cfg.sliding_window and "sliding_window" not in fields:
        raise ConfigError(
            f"sliding_window={cfg.sliding_window}: transformers' {cfg.family} has no sliding window "
            "(mistral has); set sliding_window=0 to export"
        )
    return {**common, **fields}


# The family-specific halves of the writer, by model_type: ModelConfig -> (export checks, config.json fields).
WRITERS = {
    "gptj": (_gptj_exportable, _gptj_fields),
    "llama": (_llama_exportable, _llama_fields),
    "qwen2": (_llama_exportable, _qwen2_fields),
    "mistral": (_llama_exportable, _mistral_fields),
    "gemma": (_llama_exportable, _gemma_fields),
}
