"""Hugging Face transformers configs (config.json dicts) to and from meshlm's ``ModelConfig``: what
every family shares. Each family's own fields are its module's (``model.families``: ``HFNames.read``,
``write`` and ``check_export``, pure dict translation, found here by ``model_type``).

Our conventions were chosen to be HF's (the weights then map by transpose and reshape only, see
``meshlm.io.hf_weights``; each family module says how its rotary convention matches transformers').
Anything HF can express that meshlm does not compute (rope scaling other than Llama 3's, biases we do
not have, sliding windows, other activations, dropout) is a ``ConfigError`` naming the field: a
conversion never silently changes the model.
"""

from __future__ import annotations

from typing import Any

from meshlm.errors import ConfigError
from meshlm.model.attention_variants import EXPORTED_AS
from meshlm.model.config import ModelConfig
from meshlm.model.families import FAMILIES, by_model_type
from meshlm.model.families.hf_fields import DROPOUT, field, flag, unsupported
from meshlm.model.family import Family


def architectures() -> dict[str, str]:
    """model_type -> transformers architecture, for every family that converts."""
    return {model_type: f.hf.architecture for model_type, f in by_model_type().items()}


# --- from transformers ---------------------------------------------------------------------------


def _check_common(hf: dict, family: Family) -> None:
    """Fields whose non-default values would change the model we compute."""
    names = family.hf
    archs = hf.get("architectures") or [names.architecture]
    if archs != [names.architecture]:
        raise unsupported("architectures", archs, f"only [{names.architecture!r}] converts")
    act_key = names.activation_key
    act = hf.get(act_key, names.activations[0])
    if act not in names.activations:
        raise unsupported(act_key, act, f"{family.name} models use {names.activations[0]!r}")
    for key in names.dropout_fields:
        if field(hf, key, DROPOUT, 0.0):
            raise unsupported(key, hf[key], "meshlm trains without dropout; set it to 0.0 to convert")
    for key in ("attention_bias", "mlp_bias"):
        if flag(hf, key) and not (key == "attention_bias" and family.o_bias):  # gpt-oss's q/k/v/o
            raise unsupported(key, hf[key], f"meshlm's {family.name} has no such biases")


def config_from_hf(hf_cfg: dict[str, Any]) -> ModelConfig:
    """A meshlm ModelConfig from a transformers config.json dict (model_type: one a family declares)."""
    if not isinstance(hf_cfg, dict):
        raise ConfigError(f"HF config must be a JSON object of fields, got a {type(hf_cfg).__name__}")
    model_type, known = hf_cfg.get("model_type"), by_model_type()
    if not isinstance(model_type, str) or model_type not in known:  # a list is not even hashable
        raise unsupported("model_type", model_type, f"meshlm converts {sorted(known)}")
    family = known[model_type]
    _check_common(hf_cfg, family)
    return ModelConfig(**{"family": family.name, **family.hf.read(hf_cfg)})  # a reader may name a sibling


# --- to transformers -----------------------------------------------------------------------------


def _check_exportable(cfg: ModelConfig) -> None:
    """Configs meshlm can train but transformers cannot express."""
    if cfg.arch.hf is None:
        exports = " and ".join(name for name, f in FAMILIES.items() if f.hf is not None)
        raise ConfigError(f"family {cfg.family!r} has no transformers equivalent; only {exports} export")
    own = cfg.arch.rotary
    if cfg.rotary_style not in ("", own):
        raise ConfigError(f"rotary_style={cfg.rotary_style!r}: transformers' {cfg.family} uses {own!r}")
    if cfg.embed_bias:
        raise ConfigError("embed_bias=True has no transformers equivalent; only embed_bias=False exports")
    cfg.arch.hf.check_export(cfg)


# Training-only losses that no transformers config holds (MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig
# and OlmoeConfig have router_aux_loss_coef, no z-loss field): the logits do not depend on them, so an
# export drops them and says so, as the lost part of the training recipe, not of the model.
TRAINING_ONLY = {"router_z_loss_coef": "the router z-loss"}


def dropped_on_export(cfg: ModelConfig) -> dict[str, float]:
    """The training-only fields (``TRAINING_ONLY``) set in ``cfg`` that its export leaves out."""
    return {name: getattr(cfg, name) for name in TRAINING_ONLY if getattr(cfg, name)}


def dropped_note(cfg: ModelConfig) -> str:
    """One clause saying what the export of ``cfg`` dropped, or "" where nothing was."""
    dropped = dropped_on_export(cfg)
    if not dropped:
        return ""
    what = ", ".join(f"{name}={value} ({TRAINING_ONLY[name]})" for name, value in dropped.items())
    return (
        f"dropped {what}: a training-only loss, the logits do not depend on it and transformers' "
        f"{cfg.arch.hf.architecture} has no field for it"
    )


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The transformers config.json dict for ``cfg`` (float32 weights; no tokenizer ids: meshlm does
    not know the tokenizer, so bos/eos/pad are null)."""
    _check_exportable(cfg)
    names = cfg.arch.hf
    common = {
        "architectures": [names.architecture],
        "model_type": names.model_type,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": cfg.tie_embeddings,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "dtype": "float32",
        "torch_dtype": "float32",  # the name transformers < 4.56 reads
    }
    fields = names.write(cfg)
    if cfg.sliding_window and "sliding_window" not in fields:
        raise ConfigError(
            f"sliding_window={cfg.sliding_window}: transformers' {cfg.family} has no sliding window "
            "(mistral has); set sliding_window=0 to export"
        )
    for ours, (theirs, what) in EXPORTED_AS.items():  # the attention variant's score rules
        if getattr(cfg, ours) and theirs not in fields:
            value, family = getattr(cfg, ours), cfg.family
            raise ConfigError(f"{ours}={value}: transformers' {family} has no {what}; set {ours}=0 to export")
    return {**common, **fields}
