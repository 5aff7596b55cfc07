"""Hugging Face transformers weights (GPT-J, Llama safetensors) to and from meshlm parameters.

Our conventions were chosen to be HF's, so weights map by transpose and reshape only (the rotary
conventions that make this hold are in each family's module, ``meshlm.model.families``):
  * torch Linear weights are [out, in]; ours are [in, out]. Head projections split their output
    dimension head-major (index = head * head_dim + e), as HF's ``view(..., -1, head_dim)`` does.
  * A depthwise Conv1d weight [channels, 1, K] is ours [K, heads, E] ("conv"; Qwen3.5's).
  * A fused HF tensor (Phi-3's ``qkv_proj``) is our parameters stacked on torch's output dimension, in
    the family map's order: "fused_<layout>" is one row slice (sized by the config: q H*E, k and v K*E).
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import numpy as np

from meshlm.errors import CheckpointError, ConfigError
from meshlm.io import hf_experts, hf_mtp, mxfp4
from meshlm.io.hf_config import architectures, config_from_hf, config_to_hf
from meshlm.io.hf_fused import FUSED, _split_fused, _torch_shape, _unfused
from meshlm.model.config import ModelConfig
from meshlm.model.layer_kinds import DENSE_STACK, LINEAR_STACK, stacks
from meshlm.model.padding import VOCAB_AXIS, resize, resize_flat
from meshlm.model.params import is_stacked

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


# --- tensor names and layouts (each family's ``HFNames``, its module in ``model.families``) ------


def name_map(cfg: ModelConfig) -> dict[str, tuple[list[str], str]]:
    """Our path -> (HF names, one per layer for stacked parameters, layout)."""
    names = cfg.arch.hf  # the family's transformers names (``model.family.HFNames``)
    out = {path: ([name], kind) for path, (name, kind) in names.top.items()}
    prefix = names.layer_prefix
    for stack, indices in stacks(cfg).items():  # "layers" (and a mixture of experts' "dense_layers")
        for path, (name, kind) in names.layer.items():
            if _in_stack(cfg, stack, path):
                out[f"{stack}/{path}"] = ([prefix.format(i=i) + name for i in indices], kind)
    out = out | hf_mtp.names(cfg, lambda stack, path: _in_stack(cfg, stack, path))  # MTP's depths
    shapes = expected_shapes(cfg)  # what the config turns on (tied embeddings: no head; Gemma 4's inputs)
    return {path: names for path, names in out.items() if path in shapes}


def _in_stack(cfg: ModelConfig, stack: str, path: str) -> bool:
    """Whether the layer tensor ``path`` is one of ``stack``'s layers': a mixture of experts' MoE layers
    have no dense MLP (its tensors are the dense layers', ``model.layer_kinds``) and the dense layers
    no experts; a shared expert only where the config has one. A hybrid's linear-attention layers have
    the "linear/" mixer, its other layers the "attn/" one."""
    mixer = path.split("/", 1)[0]
    if mixer in ("attn", "linear"):
        return (mixer == "linear") == (stack == LINEAR_STACK)
    if not cfg.arch.moe or cfg.per_layer:  # Gemma 4's MoE layers keep their MLP beside the experts
        return True
    if any(path.startswith(piece) and not on for piece, on in _optional(cfg).items()):
        return False
    return not path.startswith("moe/" if stack == DENSE_STACK else "mlp/")  # a hybrid's both stacks: MoE


def _optional(cfg: ModelConfig) -> dict[str, bool]:
    """A mixture of experts' optional pieces (path prefixes) -> whether ``cfg`` has them."""
    shared = bool(cfg.shared_expert_d_ff)  # Qwen2-MoE's gated one; DeepSeek's ungated ``shared_experts``
    return {
        "moe/shared/": shared,
        "moe/shared_gate/": shared,
        "moe/shared_experts/": bool(cfg.n_shared_experts),
        "moe/router/balance_bias": cfg.balance_bias,
    }


def _from_torch(w: np.ndarray, kind: str, shape: tuple[int, ...]) -> np.ndarray:
    """HF tensor -> ours with per-layer ``shape`` (the caller checked ``_torch_shape``)."""
    if kind == "copy":
        return w
    if kind == "heads":
        return w.reshape(shape)
    if kind == hf_experts.EXPERTS:
        return w.transpose(0, 2, 1)
    return w.T.reshape(shape)  # heads split head-major, as HF's view(..., -1, head_dim)


def _to_torch(w: np.ndarray, kind: str) -> np.ndarray:
    if kind == hf_experts.EXPERTS:
        return w.transpose(0, 2, 1)
    if kind == "heads":
        return w.reshape(-1)
    if kind in ("q", "kv"):
        return w.reshape(w.shape[0], -1).T
    if kind == "conv":  # ours [K, heads, E] -> torch's depthwise Conv1d [channels, 1, K]
        return w.reshape(w.shape[0], -1).T[:, None, :]
    if kind == "o":
        return w.reshape(-1, w.shape[-1]).T
    return w.T if kind == "linear" else w


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Our flat parameter path -> (global shape, dtype), from the model itself (no device memory)."""
    from meshlm.model.params import flat_params
    from meshlm.model.transformer import param_shapes

    return {path: (tuple(s.shape), np.dtype(s.dtype)) for path, s in flat_params(param_shapes(cfg)).items()}


# --- safetensors files --------------------------------------------------------------------------


def _inside(directory: Path, name: str, source: Path) -> Path:
    """directory/name, refused unless it is a file inside the model directory: a downloaded index
    (absolute paths, "..") or symlink must never make meshlm read a file elsewhere. The exception is
    the Hugging Face hub cache, whose snapshots/<rev>/ files link to ../../blobs/."""
    path = directory / name
    try:
        real, root = path.resolve(), directory.resolve()
        roots = [root, root.parent.parent / "blobs"] if root.parent.name == "snapshots" else [root]
        inside = not Path(name).is_absolute() and ".." not in Path(name).parts
        inside = inside and any(real.is_relative_to(r) for r in roots)
    except (OSError, RuntimeError, ValueError):  # a symlink loop, a NUL byte in the name
        real, inside = None, False
    if not inside:
        what = f"{path} is a link to" if source == directory else f"{source} names"
        raise CheckpointError(
            f"{what} a file outside the model directory ({name!r} -> {real}); meshlm reads only files "
            f"inside {directory}: copy them into it"
        )
    return path


def _read_json(path: Path, error: type) -> dict:
    """The JSON object in ``path``, or one line (an ``error``) naming the file and what is wrong."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:  # ValueError: bad UTF-8 or bad JSON
        raise error(f"{path} is not readable JSON ({' '.join(str(e).split())}); re-download it") from None
    if not isinstance(data, dict):
        what = {list: "an array", str: "a string"}.get(type(data), f"the value {data!r}")
        raise error(f"{path} holds {what}, not a JSON object of fields; re-download it")
    return data


def _index_files(directory: Path) -> list[Path]:
    """Every file the sharded index's weight_map names (a {tensor name: file name} object)."""
    index = _inside(directory, INDEX_FILE, directory)
    weight_map = _read_json(index, CheckpointError).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(
            f"{index} has no weight_map object naming each tensor's file (got {weight_map!r:.80}); "
            "re-download it or re-save the model with save_pretrained"
        )
    for tensor, name in weight_map.items():
        if not isinstance(name, str) or not name:
            raise CheckpointError(f"{index}: weight_map[{tensor!r}] must be a file name, got {name!r:.80}")
    return [_inside(directory, name, index) for name in sorted(set(weight_map.values()))]


def _weight_files(directory: Path) -> list[Path]:
    """model.safetensors, or every file the sharded index names."""
    if (directory / WEIGHTS_FILE).is_file():
        return [_inside(directory, WEIGHTS_FILE, directory)]
    if (directory / INDEX_FILE).is_file():
        return _index_files(directory)
    raise CheckpointError(
        f"{directory} has neither {WEIGHTS_FILE} nor {INDEX_FILE}; save the model with "
        f"save_pretrained(..., safe_serialization=True) (meshlm reads safetensors only)"
    )


def _load_file(path: Path) -> dict[str, np.ndarray]:
    import safetensors.numpy

    try:
        return safetensors.numpy.load_file(path)  # bfloat16 arrives as ml_dtypes.bfloat16
    # AttributeError: what it raises for a dtype numpy lacks (float8).
    except (safetensors.SafetensorError, OSError, ValueError, TypeError, AttributeError) as e:
        raise CheckpointError(
            f"{path} is not a readable safetensors file ({' '.join(str(e).split())}); "
            "re-download it or re-save it with save_pretrained"
        ) from None


def _read_tensors(directory: Path) -> dict[str, np.ndarray]:
    tensors: dict[str, np.ndarray] = {}
    seen: dict[str, Path] = {}
    for path in _weight_files(directory):
        if not path.is_file():
            raise CheckpointError(f"{path} is listed in {INDEX_FILE} but missing; re-download the model")
        for name, value in _load_file(path).items():
            if name in seen:  # two shards, one tensor: which one is right is unknowable
                raise CheckpointError(f"tensor {name} is in both {seen[name]} and {path}; re-download")
            tensors[name], seen[name] = value, path
    return tensors


def _check_names(tensors: dict, wanted: set[str], directory: Path) -> None:
    missing, unknown = sorted(wanted - set(tensors)), sorted(set(tensors) - wanted)
    if missing or unknown:
        raise CheckpointError(
            f"{directory}: tensors do not match its config.json: missing {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''}, unexpected {unknown[:8]}"
            f"{' ...' if len(unknown) > 8 else ''}; is this a {sorted(architectures().values())} checkpoint?"
        )


def _untie(cfg: ModelConfig, tensors: dict, directory: Path) -> None:
    """A tied model may still store lm_head.weight; accept it only if it is the embedding table."""
    head = tensors.pop(cfg.arch.hf.top["head/w"][0], None)
    if head is not None and not np.array_equal(head, tensors.get(cfg.arch.hf.top["embed/embeddings"][0])):
        raise CheckpointError(
            f"{directory}: tie_word_embeddings is true but lm_head.weight differs from the embedding "
            f"table; set tie_word_embeddings=false in config.json"
        )


def _is_float(dtype: np.dtype) -> bool:
    import ml_dtypes

    try:  # bfloat16 and float8 are ml_dtypes floats, of kind "V" to numpy
        return dtype.kind == "f" or (dtype.kind == "V" and ml_dtypes.finfo(dtype) is not None)
    except ValueError:
        return False


def _checked(name: str, w: np.ndarray, dtype, where: Path) -> np.ndarray:
    """``w`` as ``dtype``; integer / bool tensors and NaN or Inf values are corrupt weights, refused."""
    if not _is_float(w.dtype):
        raise CheckpointError(
            f"{where}: tensor {name} has dtype {w.dtype}, not floating point; re-save the model's weights "
            "in float32, float16 or bfloat16"
        )
    with np.errstate(over="ignore", invalid="ignore"):  # float64 overflow: counted just below
        out = w.astype(dtype)
    bad = out.size - int(np.count_nonzero(np.isfinite(out)))
    if bad:
        raise CheckpointError(
            f"{where}: tensor {name} has {bad} non-finite value(s) (NaN or Inf) of {out.size}; "
            "the weights are corrupt: re-download them"
        )
    return out


def _convert(tensors: dict, hf_names: list[str], kind: str, shape, dtype, stacked: bool, where, absent):
    """HF tensors (one per layer when ``stacked``; zeros for those ``absent``) -> our array of ``shape``."""
    one = shape[1:] if stacked else shape
    parts = []
    for name in hf_names:
        pop = lambda n: hf_experts.pop(tensors, n, kind, one[0] if kind == hf_experts.EXPERTS else 0)
        w = np.zeros(_torch_shape(one, kind), dtype) if name in absent else pop(name)
        if tuple(w.shape) != _torch_shape(one, kind):
            raise CheckpointError(
                f"{where}: tensor {name} has shape {tuple(w.shape)} but config.json implies "
                f"{_torch_shape(one, kind)}; the weights do not belong to this config"
            )
        parts.append(_checked(name, _from_torch(w, kind, one), dtype, where))
    return np.ascontiguousarray(np.stack(parts) if stacked else parts[0])


def load_hf(directory: str | Path) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """(config, flat params {"module/param": numpy array} in meshlm's layout and dtype, float32)
    from a transformers directory: config.json plus model.safetensors or a sharded index. The
    vocabulary is padded to ``cfg.padded_vocab`` rows (zeros; never chosen: masked out)."""
    directory = Path(directory)
    if not (directory / CONFIG_FILE).is_file():
        raise CheckpointError(f"{directory} has no {CONFIG_FILE}: not a transformers model directory")
    config_path = _inside(directory, CONFIG_FILE, directory)
    hf_cfg = _read_json(config_path, ConfigError)
    try:
        cfg = config_from_hf(hf_cfg)
    except ConfigError as e:  # name the file: the user edits it, not meshlm's ModelConfig
        raise ConfigError(f"{config_path}: {e}") from None
    tensors, hf = _read_tensors(directory), cfg.arch.hf
    cfg = hf_mtp.without_absent(cfg, tensors, directory)  # transformers' own save: no MTP tensors
    mxfp4.dequantise_all(tensors)  # gpt-oss's MXFP4 experts: the float values transformers uses
    if cfg.tie_embeddings:
        _untie(cfg, tensors, directory)
    hf_experts.unfuse(tensors, hf.fused, hf.layer_prefix, cfg.n_layers)
    hf_experts.split_last(tensors, hf, cfg.n_layers)  # gate_up tensors (gpt-oss, Llama 4)
    names = name_map(cfg)
    hf_mtp.drop_copies(cfg, tensors, names, directory)  # MTP's copies of the table and the head
    wanted = {
        n for hf_names, kind in names.values() for n in hf_experts.expand(hf_names, kind, cfg.n_experts)
    }
    absent = cfg.arch.hf.absent(cfg) if cfg.arch.hf.absent else set()
    _check_names(tensors, wanted - absent, directory)
    shapes, flat = expected_shapes(cfg.replace(vocab_multiple=1)), {}  # HF: unpadded
    if cfg.arch.hf.regroup is not None:  # rows grouped per head group -> the parts one after another
        cfg.arch.hf.regroup(cfg, tensors, to_hf=False)
    _split_fused(tensors, names, shapes, directory)
    for path, (shape, dtype) in shapes.items():
        hf_names, kind = _unfused(*names[path], path)
        flat[path] = _convert(tensors, hf_names, kind, shape, dtype, is_stacked(path), directory, absent)
    return cfg, resize_flat(flat, cfg.padded_vocab)  # zero rows: the padding is masked out


def save_hf(cfg: ModelConfig, flat_params: dict[str, Any], out_dir: str | Path) -> Path:
    """Write config.json + model.safetensors (float32) that transformers' from_pretrained loads.

    ``flat_params``: {"module/param": array} in meshlm's layout (numpy or fully addressable jax
    arrays), vocabulary padded; the padding is stripped (transformers sees ``cfg.vocab_size`` rows).
    Tied embeddings write no lm_head (transformers ties it on load).
    """
    from safetensors.numpy import save_file

    hf_cfg = config_to_hf(cfg)
    names, shapes = name_map(cfg), expected_shapes(cfg)
    missing, unknown = sorted(set(shapes) - set(flat_params)), sorted(set(flat_params) - set(shapes))
    if missing or unknown:
        raise CheckpointError(f"parameters do not match the config: missing {missing}, unexpected {unknown}")
    tensors: dict[str, Any] = {}
    absent = cfg.arch.hf.absent(cfg) if cfg.arch.hf.absent else set()
    for path, (hf_names, kind) in names.items():
        value = np.asarray(flat_params[path], dtype=np.float32)
        if value.shape != shapes[path][0]:
            raise CheckpointError(
                f"parameter {path} has shape {value.shape}, but the config implies {shapes[path][0]}"
            )
        if path in VOCAB_AXIS:
            value = resize(value, VOCAB_AXIS[path], cfg.vocab_size)
        parts = list(value) if is_stacked(path) else [value]
        for name, part in zip(hf_names, parts, strict=True):
            if name in absent:  # never read by the model: transformers has no such tensor
                continue
            if kind.startswith(FUSED):  # a row slice: the fused tensor is its slices in map order
                tensors.setdefault(name, []).append(_to_torch(part, kind[len(FUSED) :]))
            else:  # experts stacked on a leading E dim are split into per-expert tensors
                tensors.update(hf_experts.split(name, _to_torch(part, kind), kind))
    hf_experts.join_for_disk(tensors, cfg)
    hf_mtp.write_copies(cfg, tensors, names)
    tensors = {n: np.concatenate(t) if isinstance(t, list) else t for n, t in tensors.items()}
    if cfg.arch.hf.regroup is not None:
        cfg.arch.hf.regroup(cfg, tensors, to_hf=True)
    tensors = {n: np.ascontiguousarray(t) for n, t in tensors.items()}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG_FILE).write_text(json.dumps(hf_cfg, indent=2, sort_keys=True) + "\n")
    # Through a temporary name (a half-written file is never taken for the weights), then given
    # config.json's mode: safetensors creates its file 0600, every other output follows the umask.
    tmp = out / f".{WEIGHTS_FILE}.{os.getpid()}.tmp"
    try:
        save_file(tensors, tmp, metadata={"format": "pt"})  # transformers checks "format"
        os.chmod(tmp, stat.S_IMODE(os.stat(out / CONFIG_FILE).st_mode))
        os.replace(tmp, out / WEIGHTS_FILE)
    finally:
        tmp.unlink(missing_ok=True)
    return out
