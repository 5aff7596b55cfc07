"""Hugging Face transformers checkpoints (GPT-J, Llama) to and from meshlm parameters.

Our conventions were chosen to be HF's, so weights map by transpose and reshape only:
  * GPT-J's q/k rotate interleaved pairs (x0, x1), (x2, x3), ... over the first ``rotary_dim`` dims of
    each head (``rotate_every_two``); meshlm's "interleaved" style does the same, base 10000.
  * HF Llama q/k weights are stored for ``rotate_half`` (Meta's permutation is undone when a Meta
    checkpoint is converted to HF format); meshlm's "half" style is rotate_half over the whole head.
  * torch Linear weights are [out, in]; ours are [in, out]. Head projections split their output
    dimension head-major (index = head * head_dim + e), as HF's ``view(..., -1, head_dim)`` does.

Anything HF can express that meshlm does not compute (rope scaling, biases we do not have, other
activations, dropout) is a ``ConfigError`` naming the field: a conversion never silently changes
the model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from meshlm.errors import CheckpointError, ConfigError
from meshlm.model.config import FAMILY_ROTARY, ModelConfig

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
ARCHITECTURES = {"gptj": "GPTJForCausalLM", "llama": "LlamaForCausalLM"}
# Activation names transformers' ACT2FN maps to the very function meshlm computes.
ACTIVATIONS = {"gptj": ("gelu_new", "gelu_pytorch_tanh"), "llama": ("silu", "swish")}
GPTJ_ROPE_THETA = 10000.0  # hard-coded in transformers' GPT-J
DROPOUT_FIELDS = {"gptj": ("resid_pdrop", "embd_pdrop", "attn_pdrop"), "llama": ("attention_dropout",)}
ROPE_KEYS = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}


# --- configs ------------------------------------------------------------------------------------


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
    if cfg.family == "gptj":
        return {
            **common,
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
    return {
        **common,
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


# --- tensor names and layouts -------------------------------------------------------------------

# our path -> (HF name, layout). Layouts: "copy" same array; "linear" torch [out, in] <-> ours
# [in, out]; "q" / "kv" [heads*E, D] <-> [D, heads, E]; "o" [D, H*E] <-> [H, E, D].
GPTJ_TOP = {
    "embed/embeddings": ("transformer.wte.weight", "copy"),
    "final_ln/scale": ("transformer.ln_f.weight", "copy"),
    "final_ln/offset": ("transformer.ln_f.bias", "copy"),
    "head/w": ("lm_head.weight", "linear"),
    "head/b": ("lm_head.bias", "copy"),
}
GPTJ_LAYER = {
    "ln/scale": ("ln_1.weight", "copy"),
    "ln/offset": ("ln_1.bias", "copy"),
    "attn/wq": ("attn.q_proj.weight", "q"),
    "attn/wk": ("attn.k_proj.weight", "kv"),
    "attn/wv": ("attn.v_proj.weight", "kv"),
    "attn/wo": ("attn.out_proj.weight", "o"),
    "mlp/w_in": ("mlp.fc_in.weight", "linear"),
    "mlp/b_in": ("mlp.fc_in.bias", "copy"),
    "mlp/w_out": ("mlp.fc_out.weight", "linear"),
    "mlp/b_out": ("mlp.fc_out.bias", "copy"),
}
LLAMA_TOP = {
    "embed/embeddings": ("model.embed_tokens.weight", "copy"),
    "final_ln/scale": ("model.norm.weight", "copy"),
    "head/w": ("lm_head.weight", "linear"),
}
LLAMA_LAYER = {
    "ln/scale": ("input_layernorm.weight", "copy"),
    "ln2/scale": ("post_attention_layernorm.weight", "copy"),
    "attn/wq": ("self_attn.q_proj.weight", "q"),
    "attn/wk": ("self_attn.k_proj.weight", "kv"),
    "attn/wv": ("self_attn.v_proj.weight", "kv"),
    "attn/wo": ("self_attn.o_proj.weight", "o"),
    "mlp/w_gate": ("mlp.gate_proj.weight", "linear"),
    "mlp/w_up": ("mlp.up_proj.weight", "linear"),
    "mlp/w_down": ("mlp.down_proj.weight", "linear"),
}
LAYER_PREFIX = {"gptj": "transformer.h.{i}.", "llama": "model.layers.{i}."}


def name_map(cfg: ModelConfig) -> dict[str, tuple[list[str], str]]:
    """Our path -> (HF names, one per layer for stacked parameters, layout)."""
    top, layer = (GPTJ_TOP, GPTJ_LAYER) if cfg.family == "gptj" else (LLAMA_TOP, LLAMA_LAYER)
    out = {path: ([name], kind) for path, (name, kind) in top.items()}
    if cfg.tie_embeddings:
        del out["head/w"]  # logits reuse the embedding table
    prefix = LAYER_PREFIX[cfg.family]
    for path, (name, kind) in layer.items():
        out[f"layers/{path}"] = ([prefix.format(i=i) + name for i in range(cfg.n_layers)], kind)
    return out


def _torch_shape(shape: tuple[int, ...], kind: str) -> tuple[int, ...]:
    """The HF tensor shape of one (per-layer) parameter of ours with ``shape``."""
    if kind == "linear":
        return shape[::-1]
    if kind in ("q", "kv"):  # ours [D, heads, E]
        return (shape[1] * shape[2], shape[0])
    if kind == "o":  # ours [H, E, D]
        return (shape[2], shape[0] * shape[1])
    return shape


def _from_torch(w: np.ndarray, kind: str, shape: tuple[int, ...]) -> np.ndarray:
    """HF tensor -> ours with per-layer ``shape`` (the caller checked ``_torch_shape``)."""
    if kind == "copy":
        return w
    return w.T.reshape(shape)  # heads split head-major, as HF's view(..., -1, head_dim)


def _to_torch(w: np.ndarray, kind: str) -> np.ndarray:
    if kind in ("q", "kv"):
        return w.reshape(w.shape[0], -1).T
    if kind == "o":
        return w.reshape(-1, w.shape[-1]).T
    return w.T if kind == "linear" else w


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Our flat parameter path -> (global shape, dtype), from the model itself (no device memory)."""
    from meshlm.model.params import flat_params
    from meshlm.model.transformer import param_shapes

    return {path: (tuple(s.shape), np.dtype(s.dtype)) for path, s in flat_params(param_shapes(cfg)).items()}


# --- safetensors files --------------------------------------------------------------------------


def _weight_files(directory: Path) -> list[Path]:
    """model.safetensors, or every file the sharded index names."""
    if (directory / WEIGHTS_FILE).is_file():
        return [directory / WEIGHTS_FILE]
    if (directory / INDEX_FILE).is_file():
        weight_map = json.loads((directory / INDEX_FILE).read_text())["weight_map"]
        return [directory / f for f in sorted(set(weight_map.values()))]
    raise CheckpointError(
        f"{directory} has neither {WEIGHTS_FILE} nor {INDEX_FILE}; save the model with "
        f"save_pretrained(..., safe_serialization=True) (meshlm reads safetensors only)"
    )


def _read_tensors(directory: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    tensors: dict[str, np.ndarray] = {}
    for path in _weight_files(directory):
        if not path.is_file():
            raise CheckpointError(f"{path} is listed in {INDEX_FILE} but missing; re-download the model")
        tensors.update(load_file(path))  # bfloat16 arrives as ml_dtypes.bfloat16
    return tensors


def _check_names(tensors: dict, wanted: set[str], directory: Path) -> None:
    missing, unknown = sorted(wanted - set(tensors)), sorted(set(tensors) - wanted)
    if missing or unknown:
        raise CheckpointError(
            f"{directory}: tensors do not match its config.json: missing {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''}, unexpected {unknown[:8]}"
            f"{' ...' if len(unknown) > 8 else ''}; is this a {sorted(ARCHITECTURES.values())} checkpoint?"
        )


def _untie(tensors: dict, directory: Path) -> None:
    """A tied model may still store lm_head.weight; accept it only if it is the embedding table."""
    head = tensors.pop("lm_head.weight", None)
    if head is not None and not np.array_equal(head, tensors.get(LLAMA_TOP["embed/embeddings"][0])):
        raise CheckpointError(
            f"{directory}: tie_word_embeddings is true but lm_head.weight differs from the embedding "
            f"table; set tie_word_embeddings=false in config.json"
        )


def _convert(tensors: dict, hf_names: list[str], kind: str, shape, dtype, stacked: bool, where: Path):
    """HF tensors (one per layer when ``stacked``) -> our array of ``shape`` (global) and ``dtype``."""
    one = shape[1:] if stacked else shape
    parts = []
    for name in hf_names:
        w = tensors.pop(name)
        if tuple(w.shape) != _torch_shape(one, kind):
            raise CheckpointError(
                f"{where}: tensor {name} has shape {tuple(w.shape)} but config.json implies "
                f"{_torch_shape(one, kind)}; the weights do not belong to this config"
            )
        parts.append(_from_torch(w, kind, one).astype(dtype))
    return np.ascontiguousarray(np.stack(parts) if stacked else parts[0])


def load_hf(directory: str | Path) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """(config, flat params {"module/param": numpy array} in meshlm's layout and dtype, float32)
    from a transformers directory: config.json plus model.safetensors or a sharded index."""
    directory = Path(directory)
    if not (directory / CONFIG_FILE).is_file():
        raise CheckpointError(f"{directory} has no {CONFIG_FILE}: not a transformers model directory")
    cfg = config_from_hf(json.loads((directory / CONFIG_FILE).read_text()))
    tensors = _read_tensors(directory)
    if cfg.tie_embeddings:
        _untie(tensors, directory)
    names = name_map(cfg)
    _check_names(tensors, {n for hf_names, _ in names.values() for n in hf_names}, directory)
    flat = {}
    for path, (shape, dtype) in expected_shapes(cfg).items():
        hf_names, kind = names[path]
        flat[path] = _convert(tensors, hf_names, kind, shape, dtype, path.startswith("layers/"), directory)
    return cfg, flat


def save_hf(cfg: ModelConfig, flat_params: dict[str, Any], out_dir: str | Path) -> Path:
    """Write config.json + model.safetensors (float32) that transformers' from_pretrained loads.

    ``flat_params``: {"module/param": array} in meshlm's layout (numpy or fully addressable jax
    arrays). Tied embeddings write no lm_head (transformers ties it on load).
    """
    from safetensors.numpy import save_file

    hf_cfg = config_to_hf(cfg)
    names, shapes = name_map(cfg), expected_shapes(cfg)
    missing, unknown = sorted(set(shapes) - set(flat_params)), sorted(set(flat_params) - set(shapes))
    if missing or unknown:
        raise CheckpointError(f"parameters do not match the config: missing {missing}, unexpected {unknown}")
    tensors = {}
    for path, (hf_names, kind) in names.items():
        value = np.asarray(flat_params[path], dtype=np.float32)
        if value.shape != shapes[path][0]:
            raise CheckpointError(
                f"parameter {path} has shape {value.shape}, but the config implies {shapes[path][0]}"
            )
        parts = list(value) if path.startswith("layers/") else [value]
        for name, part in zip(hf_names, parts, strict=True):
            tensors[name] = np.ascontiguousarray(_to_torch(part, kind))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG_FILE).write_text(json.dumps(hf_cfg, indent=2, sort_keys=True) + "\n")
    save_file(tensors, out / WEIGHTS_FILE, metadata={"format": "pt"})  # transformers checks "format"
    return out
