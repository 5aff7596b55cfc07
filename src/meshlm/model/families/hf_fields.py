"""Reading and writing transformers config.json fields, as plain dicts: what the families' readers and
writers share (``HFNames.read`` / ``write``). No files and no ``io``: ``io.hf_config`` reads the file.

Anything HF can express that meshlm does not compute is a ``ConfigError`` naming the field, in HF's
name (the one the user sees in the file): a conversion never silently changes the model. A float
where an int belongs, a bool or a string is refused, never coerced.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from meshlm.errors import ConfigError
from meshlm.model.rope import RopeScaling, YarnScaling
from meshlm.ranges import Range

SIZE = Range(int, 1)
POSITIVE = Range(float, 0, low_open=True)
DROPOUT = Range(float, 0, 1)
_REQUIRED = object()
ROPE_KEYS = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
# Llama 3's rope_type "llama3" parameters (``model.rope.RopeScaling``), in transformers' names.
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
# YaRN's (``model.rope.YarnScaling``); a null mscale / mscale_all_dim / attention_factor reads as 0.
YARN_KEYS = (
    "factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
)
YARN_KEYS += ("attention_factor", "truncate")


def field(hf: dict, key: str, valid: Range, default: Any = _REQUIRED, nullable: bool = False):
    """hf[key] if ``valid`` accepts it; ``default`` when absent (or null, where transformers itself
    reads null as "the default"); a required field that is absent or null is an error."""
    value = hf.get(key)
    if key not in hf or (value is None and (nullable or default is _REQUIRED)):
        if default is _REQUIRED:
            raise ConfigError(f"HF config has no {key!r}; a {hf.get('model_type')} config.json must set it")
        return default
    problem = valid.problem(key, value)
    if problem:
        raise ConfigError(f"HF config {problem}; correct it in config.json")
    return value


def flag(hf: dict, key: str) -> bool:
    value = hf.get(key, False)
    if not isinstance(value, bool):
        raise ConfigError(f"HF config {key} must be true or false, got {value!r}; correct it in config.json")
    return value


def unsupported(name: str, value, fix: str) -> ConfigError:
    return ConfigError(f"HF config {name}={value!r} is not supported by meshlm; {fix}")


def rope(hf: dict) -> tuple[float, RopeScaling | None]:
    """(rotary base, Llama 3 scaling or None) from rope_parameters / rope_scaling (transformers 5) or
    top-level rope_theta. Plain RoPE ("default") and "llama3" convert; any other rope_type, and any
    key the type does not use, is an error naming the field, never dropped."""
    theta = float(field(hf, "rope_theta", POSITIVE, 10000.0, nullable=True))
    factor, scaling = hf.get("partial_rotary_factor"), None
    for name in ("rope_parameters", "rope_scaling"):
        params = hf.get(name)
        if params is None:
            continue
        if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
            raise unsupported(name, params, "only one flat dict of RoPE parameters converts")
        kind = params.get("rope_type", params.get("type", "default"))
        if kind not in ("default", "llama3", "yarn"):
            raise unsupported(
                f"{name}.rope_type", kind, "meshlm implements 'default', 'llama3' and 'yarn' RoPE"
            )
        known = ROPE_KEYS | set({"llama3": LLAMA3_KEYS, "yarn": YARN_KEYS}.get(kind, ()))
        extra = sorted(set(params) - known)
        if extra:
            raise unsupported(f"{name} keys", extra, f"known keys for {kind!r}: {sorted(known)}")
        theta = float(field(params, "rope_theta", POSITIVE, theta))
        factor = params.get("partial_rotary_factor", factor)
        if kind == "llama3":
            scaling = _llama3_scaling(params, name, hf)
        elif kind == "yarn":
            scaling = _yarn_scaling(params, name, hf)
    if factor is not None and (isinstance(factor, bool) or factor != 1):  # True == 1 in Python
        raise unsupported("partial_rotary_factor", factor, "Llama rotates the whole head dim in meshlm")
    return theta, scaling


def plain_rope_theta(hf: dict, family: str) -> float:
    """The rotary base of a family with plain RoPE only: Llama 3's scaling there is an error."""
    theta, scaling = rope(hf)
    if scaling is not None:
        raise unsupported("rope_parameters.rope_type", "llama3", f"transformers' {family} has plain RoPE")
    return theta


def _llama3_scaling(params: dict, name: str, hf: dict) -> RopeScaling:
    """transformers' llama3 parameters; original_max_position_embeddings defaults, as there, to
    max_position_embeddings."""
    values = {k: field(params, k, POSITIVE if k != LLAMA3_KEYS[-1] else SIZE, None) for k in LLAMA3_KEYS}
    if values[LLAMA3_KEYS[-1]] is None:
        values[LLAMA3_KEYS[-1]] = field(hf, "max_position_embeddings", SIZE, 2048)
    missing = [k for k, v in values.items() if v is None]
    if missing:
        raise ConfigError(f"HF config {name} of rope_type 'llama3' has no {missing}; correct config.json")
    try:
        return RopeScaling(**values)
    except ConfigError as e:
        raise ConfigError(f"HF config {name}: {e}; correct config.json") from None


def _yarn_scaling(params: dict, name: str, hf: dict) -> YarnScaling:
    """transformers' yarn parameters: a null factor is max_position_embeddings over the original
    context (DeepSeek's note there); nulls of the optional ones are absent."""
    values = {k: params[k] for k in YARN_KEYS if params.get(k) is not None}
    if "original_max_position_embeddings" not in values:
        raise ConfigError(f"HF config {name} of rope_type 'yarn' has no original_max_position_embeddings")
    if "factor" not in values:
        values["factor"] = (
            field(hf, "max_position_embeddings", SIZE) / values["original_max_position_embeddings"]
        )
    try:
        return YarnScaling(**values)
    except (ConfigError, TypeError) as e:
        raise ConfigError(f"HF config {name}: {e}; correct config.json") from None


def check_heads(d: int, heads: int, names: tuple[str, str], head_dim: int | None) -> int:
    """The per-head width; messages name HF's fields (meshlm's own checks would name ours)."""
    if head_dim is None and d % heads:
        raise ConfigError(f"HF config {names[0]}={d} is not divisible by {names[1]}={heads}; fix config.json")
    return head_dim or d // heads


def rope_fields(cfg) -> dict[str, Any]:
    """transformers 5's rope_parameters of ``cfg``: plain RoPE, Llama 3's scaling or YaRN (0s: absent)."""
    if cfg.rope_scaling is None:
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if isinstance(cfg.rope_scaling, YarnScaling):
        fields = {
            k: v for k, v in dataclasses.asdict(cfg.rope_scaling).items() if v != 0.0 or k == "truncate"
        }
        return {**fields, "rope_theta": cfg.rope_theta}
    return {"rope_type": "llama3", "rope_theta": cfg.rope_theta, **dataclasses.asdict(cfg.rope_scaling)}
