"""Hugging Face transformers configs (GPT-J, Llama 2/3.x, Qwen2/2.5, Mistral, Gemma) to and from meshlm's
``ModelConfig``.

Our conventions were chosen to be HF's (the weights then map by transpose and reshape only, see
``meshlm.io.hf_weights``):
  * GPT-J's q/k rotate interleaved pairs (x0, x1), (x2, x3), ... over the first ``rotary_dim`` dims of
    each head (``rotate_every_two``); meshlm's "interleaved" style does the same, base 10000.
  * HF Llama q/k weights are stored for ``rotate_half`` (Meta's permutation is undone when a Meta
    checkpoint is converted to HF format); meshlm's "half" style is rotate_half over the whole head.

Anything HF can express that meshlm does not compute (rope scaling other than Llama 3's, biases we do
not have, sliding windows, other activations, dropout) is a ``ConfigError`` naming the field: a
conversion never silently changes the model.
"""

from __future__ import annotations

from typing import Any

from meshlm.errors import ConfigError
from meshlm.model.config import ModelConfig
from meshlm.model.family import FAMILIES, HFNames
from meshlm.model.rope import RopeScaling
from meshlm.ranges import Range

# The families transformers can express, by model_type (= our family name): their ``HFNames``.
HF: dict[str, HFNames] = {name: f.hf for name, f in FAMILIES.items() if f.hf is not None}
ARCHITECTURES = {name: names.architecture for name, names in HF.items()}
GPTJ_ROPE_THETA = 10000.0  # hard-coded in transformers' GPT-J
ROPE_KEYS = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
# Llama 3's rope_type "llama3" parameters (``model.rope.RopeScaling``), in transformers' names.
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
# What each numeric field read from config.json accepts; messages use HF's field names, the ones the
# user sees in the file. A float where an int belongs, a bool or a string is refused, never coerced.
SIZE = Range(int, 1)
POSITIVE = Range(float, 0, low_open=True)
DROPOUT = Range(float, 0, 1)
_REQUIRED = object()
MISTRAL_WINDOW = 4096  # transformers' MistralConfig.sliding_window when config.json has none
# transformers' defaults for fields a config.json may leave out, where they are not Llama's.
MISTRAL_DEFAULTS = {"max_position_embeddings": 4096 * 32}
GEMMA_DEFAULTS = {"head_dim": 256, "max_position_embeddings": 8192, "tie_word_embeddings": True}
# Fields of Gemma 2 (and later) that a model_type "gemma" config must not set: never silently dropped.
GEMMA2_FIELDS = (
    "final_logit_softcapping",
    "attn_logit_softcapping",
    "query_pre_attn_scalar",
    "sliding_window",
    "layer_types",
    "use_bidirectional_attention",
)


# --- from transformers ---------------------------------------------------------------------------


def _field(hf: dict, key: str, valid: Range, default: Any = _REQUIRED, nullable: bool = False):
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


def _flag(hf: dict, key: str) -> bool:
    value = hf.get(key, False)
    if not isinstance(value, bool):
        raise ConfigError(f"HF config {key} must be true or false, got {value!r}; correct it in config.json")
    return value


def _unsupported(field: str, value, fix: str) -> ConfigError:
    return ConfigError(f"HF config {field}={value!r} is not supported by meshlm; {fix}")


def _check_common(hf: dict, family: str) -> None:
    """Fields whose non-default values would change the model we compute."""
    names = HF[family]
    archs = hf.get("architectures") or [names.architecture]
    if archs != [names.architecture]:
        raise _unsupported("architectures", archs, f"only [{names.architecture!r}] converts")
    act_key = names.activation_key
    act = hf.get(act_key, names.activations[0])
    if act not in names.activations:
        raise _unsupported(act_key, act, f"{family} models use {names.activations[0]!r}")
    for key in names.dropout_fields:
        if _field(hf, key, DROPOUT, 0.0):
            raise _unsupported(key, hf[key], "meshlm trains without dropout; set it to 0.0 to convert")
    for key in ("attention_bias", "mlp_bias"):
        if _flag(hf, key):
            raise _unsupported(key, hf[key], f"meshlm's {family} has no such biases")


def _rope(hf: dict) -> tuple[float, RopeScaling | None]:
    """(rotary base, Llama 3 scaling or None) from rope_parameters / rope_scaling (transformers 5) or
    top-level rope_theta. Plain RoPE ("default") and "llama3" convert; any other rope_type, and any
    key the type does not use, is an error naming the field, never dropped."""
    theta = float(_field(hf, "rope_theta", POSITIVE, 10000.0, nullable=True))
    factor, scaling = hf.get("partial_rotary_factor"), None
    for field in ("rope_parameters", "rope_scaling"):
        rope = hf.get(field)
        if rope is None:
            continue
        if not isinstance(rope, dict) or any(isinstance(v, dict) for v in rope.values()):
            raise _unsupported(field, rope, "only one flat dict of RoPE parameters converts")
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ("default", "llama3"):
            raise _unsupported(f"{field}.rope_type", kind, "meshlm implements 'default' and 'llama3' RoPE")
        known = ROPE_KEYS | (set(LLAMA3_KEYS) if kind == "llama3" else set())
        extra = sorted(set(rope) - known)
        if extra:
            raise _unsupported(f"{field} keys", extra, f"known keys for {kind!r}: {sorted(known)}")
        theta = float(_field(rope, "rope_theta", POSITIVE, theta))
        factor = rope.get("partial_rotary_factor", factor)
        if kind == "llama3":
            scaling = _llama3_scaling(rope, field, hf)
    if factor is not None and (isinstance(factor, bool) or factor != 1):  # True == 1 in Python
        raise _unsupported("partial_rotary_factor", factor, "Llama rotates the whole head dim in meshlm")
    return theta, scaling


def _rope_theta(hf: dict, family: str = "gptj") -> float:
    """The rotary base of a family with plain RoPE only: Llama 3's scaling there is an error."""
    theta, scaling = _rope(hf)
    if scaling is not None:
        raise _unsupported("rope_parameters.rope_type", "llama3", f"transformers' {family} has plain RoPE")
    return theta


def _llama3_scaling(rope: dict, field: str, hf: dict) -> RopeScaling:
    """transformers' llama3 parameters; original_max_position_embeddings defaults, as there, to
    max_position_embeddings."""
    values = {k: _field(rope, k, POSITIVE if k != LLAMA3_KEYS[-1] else SIZE, None) for k in LLAMA3_KEYS}
    if values[LLAMA3_KEYS[-1]] is None:
        values[LLAMA3_KEYS[-1]] = _field(hf, "max_position_embeddings", SIZE, 2048)
    missing = [k for k, v in values.items() if v is None]
    if missing:
        raise ConfigError(f"HF config {field} of rope_type 'llama3' has no {missing}; correct config.json")
    try:
        return RopeScaling(**values)
    except ConfigError as e:
        raise ConfigError(f"HF config {field}: {e}; correct config.json") from None


def _check_heads(d: int, heads: int, names: tuple[str, str], head_dim: int | None) -> int:
    """The per-head width; messages name HF's fields (meshlm's own checks would name ours)."""
    if head_dim is None and d % heads:
        raise ConfigError(f"HF config {names[0]}={d} is not divisible by {names[1]}={heads}; fix config.json")
    return head_dim or d // heads


def _gptj_config(hf: dict) -> ModelConfig:
    d, heads = _field(hf, "n_embd", SIZE), _field(hf, "n_head", SIZE)
    if _flag(hf, "tie_word_embeddings"):
        raise _unsupported("tie_word_embeddings", True, "meshlm's gptj head is untied (it has a bias)")
    if "rotary_dim" in hf and hf["rotary_dim"] is None:
        raise _unsupported("rotary_dim", None, "set rotary_dim to the number of rotated dims per head")
    theta = _rope_theta(hf, "GPT-J")
    if theta != GPTJ_ROPE_THETA:
        raise _unsupported("rope_theta", theta, f"transformers' GPT-J always uses {GPTJ_ROPE_THETA}")
    per_head = _check_heads(d, heads, ("n_embd", "n_head"), None)
    rotary = _field(hf, "rotary_dim", SIZE, 64)
    if rotary % 2 or rotary > per_head:
        raise ConfigError(f"HF config rotary_dim={rotary} must be even and <= n_embd/n_head={per_head}")
    return ModelConfig(
        family="gptj",
        vocab_size=_field(hf, "vocab_size", SIZE),
        d_model=d,
        n_layers=_field(hf, "n_layer", SIZE),
        d_ff=_field(hf, "n_inner", SIZE, 4 * d, nullable=True),  # HF: n_inner None means 4 * n_embd
        n_heads=heads,
        rotary_dim=0 if rotary == per_head else rotary,  # 0 = the whole head, our canonical form
        max_seq_len=_field(hf, "n_positions", SIZE, 2048),
        norm_eps=float(_field(hf, "layer_norm_epsilon", POSITIVE, 1e-5)),
    )


def _qwen2_config(hf: dict) -> ModelConfig:
    """Qwen2 / Qwen2.5: Llama's fields (its q/k/v biases are the family's); no sliding window."""
    if _flag(hf, "use_sliding_window"):
        raise _unsupported("use_sliding_window", True, "meshlm's qwen2 attends to the whole context")
    for key in ("use_mrope",):  # Qwen2-VL's multimodal rotary
        if _flag(hf, key):
            raise _unsupported(key, True, "meshlm's qwen2 has plain 1-D rotary positions")
    kinds = hf.get("layer_types") or []
    if not isinstance(kinds, list) or any(k != "full_attention" for k in kinds):
        raise _unsupported("layer_types", kinds, "meshlm's qwen2 has only 'full_attention' layers")
    return _llama_config(hf, "qwen2")


def _llama_config(hf: dict, family: str = "llama") -> ModelConfig:
    d, heads = _field(hf, "hidden_size", SIZE), _field(hf, "num_attention_heads", SIZE)
    kv = _field(hf, "num_key_value_heads", SIZE, heads, nullable=True)
    if heads % kv:
        raise ConfigError(
            f"HF config num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}; "
            "correct config.json"
        )
    head_dim = _field(hf, "head_dim", SIZE, None, nullable=True)
    head_dim = _check_heads(d, heads, ("hidden_size", "num_attention_heads"), head_dim)
    theta, scaling = _rope(hf)
    return ModelConfig(
        family=family,
        vocab_size=_field(hf, "vocab_size", SIZE),
        d_model=d,
        n_layers=_field(hf, "num_hidden_layers", SIZE),
        d_ff=_field(hf, "intermediate_size", SIZE),
        n_heads=heads,
        n_kv_heads=0 if kv == heads else kv,  # 0 = n_heads, our canonical form
        head_dim=0 if d % heads == 0 and head_dim == d // heads else head_dim,
        rope_theta=theta,
        rope_scaling=scaling,
        max_seq_len=_field(hf, "max_position_embeddings", SIZE, 2048),
        norm_eps=float(_field(hf, "rms_norm_eps", POSITIVE, 1e-6)),
        tie_embeddings=_flag(hf, "tie_word_embeddings"),
    )


def _mistral_config(hf: dict) -> ModelConfig:
    """Llama's fields plus ``sliding_window``: absent means transformers' default (``MISTRAL_WINDOW``),
    null means none (v0.3)."""
    if hf.get("layer_types") is not None:
        raise _unsupported(
            "layer_types", hf["layer_types"], "meshlm's mistral uses one window in every layer"
        )
    null = "sliding_window" in hf and hf["sliding_window"] is None
    window = 0 if null else _field(hf, "sliding_window", SIZE, MISTRAL_WINDOW)
    return _llama_config({**MISTRAL_DEFAULTS, **hf}).replace(family="mistral", sliding_window=window)


def _gemma_config(hf: dict) -> ModelConfig:
    """Llama's fields with GemmaConfig's defaults; Gemma 2's fields (soft-capping, alternating local
    and global layers, ...) are refused by name: transformers' Gemma would ignore them."""
    for key in GEMMA2_FIELDS:
        if hf.get(key) not in (None, False):
            raise _unsupported(key, hf[key], "it is Gemma 2's; meshlm implements Gemma 1 (model_type gemma)")
    act = hf.get("hidden_activation")  # the legacy key; transformers 5 reads hidden_act only
    if act not in (None, HF["gemma"].activations[0]):
        raise _unsupported("hidden_activation", act, f"Gemma uses {HF['gemma'].activations[0]!r}")
    return _llama_config({**GEMMA_DEFAULTS, **hf}).replace(family="gemma")


def config_from_hf(hf_cfg: dict[str, Any]) -> ModelConfig:
    """A meshlm ModelConfig from a transformers config.json dict (model_type: a key of ``READERS``)."""
    if not isinstance(hf_cfg, dict):
        raise ConfigError(f"HF config must be a JSON object of fields, got a {type(hf_cfg).__name__}")
    family = hf_cfg.get("model_type")
    if not isinstance(family, str) or family not in ARCHITECTURES:  # a list is not even hashable
        raise _unsupported("model_type", family, f"meshlm converts {sorted(ARCHITECTURES)}")
    _check_common(hf_cfg, family)
    return READERS[family](hf_cfg)


# The family-specific halves of the reader, by model_type: config.json -> ModelConfig (the writers,
# ModelConfig -> config.json, are ``io.hf_config_export``'s).
READERS = {
    "gptj": _gptj_config,
    "llama": _llama_config,
    "qwen2": _qwen2_config,
    "mistral": _mistral_config,
    "gemma": _gemma_config,
}


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The transformers config.json dict for ``cfg`` (``io.hf_config_export``)."""
    from meshlm.io.hf_config_export import config_to_hf as export

    return export(cfg)
