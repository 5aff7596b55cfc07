"""Hugging Face transformers configs (GPT-J, Llama) to and from meshlm's ``ModelConfig``.

Our conventions were chosen to be HF's (the weights then map by transpose and reshape only, see
``meshlm.io.hf_weights``):
  * GPT-J's q/k rotate interleaved pairs (x0, x1), (x2, x3), ... over the first ``rotary_dim`` dims of
    each head (``rotate_every_two``); meshlm's "interleaved" style does the same, base 10000.
  * HF Llama q/k weights are stored for ``rotate_half`` (Meta's permutation is undone when a Meta
    checkpoint is converted to HF format); meshlm's "half" style is rotate_half over the whole head.

Anything HF can express that meshlm does not compute (rope scaling, biases we do not have, other
activations, dropout) is a ``ConfigError`` naming the field: a conversion never silently changes
the model.
"""

from __future__ import annotations

from typing import Any

from meshlm.errors import ConfigError
from meshlm.model.config import FAMILY_ROTARY, ModelConfig

ARCHITECTURES = {"gptj": "GPTJForCausalLM", "llama": "LlamaForCausalLM"}
# Activation names transformers' ACT2FN maps to the very function meshlm computes.
ACTIVATIONS = {"gptj": ("gelu_new", "gelu_pytorch_tanh"), "llama": ("silu", "swish")}
GPTJ_ROPE_THETA = 10000.0  # hard-coded in transformers' GPT-J
DROPOUT_FIELDS = {"gptj": ("resid_pdrop", "embd_pdrop", "attn_pdrop"), "llama": ("attention_dropout",)}
ROPE_KEYS = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}


# --- from transformers ---------------------------------------------------------------------------


def _required(hf: dict, key: str):
    if hf.get(key) is None:
        raise ConfigError(f"HF config has no {key!r}; a {hf.get('model_type')} config.json must set it")
    return hf[key]


def _unsupported(field: str, value, fix: str) -> ConfigError:
    return ConfigError(f"HF config {field}={value!r} is not supported by meshlm; {fix}")


def _check_common(hf: dict, family: str) -> None:
    """Fields whose non-default values would change the model we compute."""
    archs = hf.get("architectures") or [ARCHITECTURES[family]]
    if archs != [ARCHITECTURES[family]]:
        raise _unsupported("architectures", archs, f"only [{ARCHITECTURES[family]!r}] converts")
    act_key = "activation_function" if family == "gptj" else "hidden_act"
    act = hf.get(act_key, ACTIVATIONS[family][0])
    if act not in ACTIVATIONS[family]:
        raise _unsupported(act_key, act, f"{family} models use {ACTIVATIONS[family][0]!r}")
    for key in DROPOUT_FIELDS[family]:
        if hf.get(key):
            raise _unsupported(key, hf[key], "meshlm trains without dropout; set it to 0.0 to convert")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise _unsupported(key, hf[key], f"meshlm's {family} has no such biases")


def _rope_theta(hf: dict) -> float:
    """The rotary base, from rope_parameters / rope_scaling (transformers 5) or top-level rope_theta.

    Only plain RoPE ("default") is supported; every other key is an error, never dropped.
    """
    theta = float(hf.get("rope_theta") or 10000.0)
    factor = hf.get("partial_rotary_factor")
    for field in ("rope_parameters", "rope_scaling"):
        rope = hf.get(field)
        if rope is None:
            continue
        if not isinstance(rope, dict) or any(isinstance(v, dict) for v in rope.values()):
            raise _unsupported(field, rope, "only one flat dict of default RoPE parameters converts")
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default":
            raise _unsupported(f"{field}.rope_type", kind, "meshlm implements only plain RoPE ('default')")
        extra = sorted(set(rope) - ROPE_KEYS)
        if extra:
            raise _unsupported(f"{field} keys", extra, f"known keys: {sorted(ROPE_KEYS)}")
        theta = float(rope.get("rope_theta", theta))
        factor = rope.get("partial_rotary_factor", factor)
    if factor not in (None, 1, 1.0):
        raise _unsupported("partial_rotary_factor", factor, "Llama rotates the whole head dim in meshlm")
    return theta


def _gptj_config(hf: dict) -> ModelConfig:
    d, heads = _required(hf, "n_embd"), _required(hf, "n_head")
    if hf.get("tie_word_embeddings"):
        raise _unsupported("tie_word_embeddings", True, "meshlm's gptj head is untied (it has a bias)")
    if "rotary_dim" in hf and hf["rotary_dim"] is None:
        raise _unsupported("rotary_dim", None, "set rotary_dim to the number of rotated dims per head")
    theta = _rope_theta(hf)
    if theta != GPTJ_ROPE_THETA:
        raise _unsupported("rope_theta", theta, f"transformers' GPT-J always uses {GPTJ_ROPE_THETA}")
    rotary = int(hf.get("rotary_dim", 64))
    return ModelConfig(
        family="gptj",
        vocab_size=_required(hf, "vocab_size"),
        d_model=d,
        n_layers=_required(hf, "n_layer"),
        d_ff=hf.get("n_inner") or 4 * d,  # HF: n_inner None means 4 * n_embd
        n_heads=heads,
        rotary_dim=0 if rotary == d // heads else rotary,  # 0 = the whole head, our canonical form
        max_seq_len=hf.get("n_positions", 2048),
        norm_eps=hf.get("layer_norm_epsilon", 1e-5),
    )


def _llama_config(hf: dict) -> ModelConfig:
    d, heads = _required(hf, "hidden_size"), _required(hf, "num_attention_heads")
    kv = hf.get("num_key_value_heads") or heads
    head_dim = hf.get("head_dim") or d // heads
    return ModelConfig(
        family="llama",
        vocab_size=_required(hf, "vocab_size"),
        d_model=d,
        n_layers=_required(hf, "num_hidden_layers"),
        d_ff=_required(hf, "intermediate_size"),
        n_heads=heads,
        n_kv_heads=0 if kv == heads else kv,  # 0 = n_heads, our canonical form
        head_dim=0 if d % heads == 0 and head_dim == d // heads else head_dim,
        rope_theta=_rope_theta(hf),
        max_seq_len=hf.get("max_position_embeddings", 2048),
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )


def config_from_hf(hf_cfg: dict[str, Any]) -> ModelConfig:
    """A meshlm ModelConfig from a transformers config.json dict (model_type "gptj" or "llama")."""
    family = hf_cfg.get("model_type")
    if family not in ARCHITECTURES:
        raise _unsupported("model_type", family, f"meshlm converts {sorted(ARCHITECTURES)}")
    _check_common(hf_cfg, family)
    return _gptj_config(hf_cfg) if family == "gptj" else _llama_config(hf_cfg)


# --- to transformers -----------------------------------------------------------------------------


def _check_exportable(cfg: ModelConfig) -> None:
    """Configs meshlm can train but transformers' GPT-J / Llama cannot express."""
    own = FAMILY_ROTARY.get(cfg.family)
    if own is None:
        raise ConfigError(f"family {cfg.family!r} has no transformers equivalent; only gptj and llama export")
    if cfg.rotary_style not in ("", own):
        raise ConfigError(f"rotary_style={cfg.rotary_style!r}: transformers' {cfg.family} uses {own!r}")
    if cfg.embed_bias:
        raise ConfigError("embed_bias=True has no transformers equivalent; only embed_bias=False exports")
    if cfg.family == "llama" and cfg.rot_dim != cfg.dim_per_head:
        raise ConfigError(f"rotary_dim={cfg.rotary_dim}: transformers' Llama rotates the whole head")
    if cfg.family == "gptj":
        if cfg.tie_embeddings or cfg.kv_heads != cfg.n_heads or cfg.dim_per_head * cfg.n_heads != cfg.d_model:
            raise ConfigError(
                "transformers' GPT-J needs tie_embeddings=False, n_kv_heads=n_heads and "
                f"head_dim=d_model/n_heads; got {cfg.tie_embeddings}, {cfg.kv_heads}, {cfg.dim_per_head}"
            )
        if cfg.rope_theta != GPTJ_ROPE_THETA:
            raise ConfigError(f"rope_theta={cfg.rope_theta}: transformers' GPT-J uses {GPTJ_ROPE_THETA}")


def _gptj_fields(cfg: ModelConfig) -> dict[str, Any]:
    return {
        **{k: 0.0 for k in DROPOUT_FIELDS["gptj"]},
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
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_theta": cfg.rope_theta,  # where transformers 4.x reads it
    }


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The transformers config.json dict for ``cfg`` (float32 weights; no tokenizer ids: meshlm does
    not know the tokenizer, so bos/eos/pad are null)."""
    _check_exportable(cfg)
    common = {
        "architectures": [ARCHITECTURES[cfg.family]],
        "model_type": cfg.family,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": cfg.tie_embeddings,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "dtype": "float32",
        "torch_dtype": "float32",  # the name transformers < 4.56 reads
    }
    return {**common, **(_gptj_fields(cfg) if cfg.family == "gptj" else _llama_fields(cfg))}
