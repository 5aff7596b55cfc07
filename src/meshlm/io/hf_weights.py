"""Hugging Face transformers weights (GPT-J, Llama safetensors) to and from meshlm parameters.

Our conventions were chosen to be HF's, so weights map by transpose and reshape only (the rotary
conventions that make this hold are in ``meshlm.io.hf_config``):
  * torch Linear weights are [out, in]; ours are [in, out]. Head projections split their output
    dimension head-major (index = head * head_dim + e), as HF's ``view(..., -1, head_dim)`` does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from meshlm.errors import CheckpointError
from meshlm.io.hf_config import ARCHITECTURES, config_from_hf, config_to_hf
from meshlm.model.config import ModelConfig
from meshlm.model.params import STACKED_PREFIX, is_stacked

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


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
        out[f"{STACKED_PREFIX}{path}"] = ([prefix.format(i=i) + name for i in range(cfg.n_layers)], kind)
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
        flat[path] = _convert(tensors, hf_names, kind, shape, dtype, is_stacked(path), directory)
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
        parts = list(value) if is_stacked(path) else [value]
        for name, part in zip(hf_names, parts, strict=True):
            tensors[name] = np.ascontiguousarray(_to_torch(part, kind))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG_FILE).write_text(json.dumps(hf_cfg, indent=2, sort_keys=True) + "\n")
    save_file(tensors, out / WEIGHTS_FILE, metadata={"format": "pt"})  # transformers checks "format"
    return out
