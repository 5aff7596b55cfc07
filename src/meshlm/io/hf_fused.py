"""Fused Hugging Face tensors (Phi-3's ``qkv_proj`` and ``gate_up_proj``): several parameters of ours
stacked on torch's output dimension, in the family map's order; "fused_<layout>" names one row slice
(sized by the config: q H*E, k and v K*E). Also each layout's torch shape (``_torch_shape``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from meshlm.errors import CheckpointError
from meshlm.io import hf_experts
from meshlm.model.params import is_stacked

FUSED = "fused_"  # layout prefix: a row slice of an HF tensor that several parameters of ours share


def _fused_parts(names: dict) -> dict[str, list[str]]:
    """HF tensor name -> our paths that are row slices of it, in the map's order (q, k, v)."""
    parts: dict[str, list[str]] = {}
    for path, (hf_names, kind) in names.items():
        if kind.startswith(FUSED):
            for name in hf_names:
                parts.setdefault(name, []).append(path)
    return parts


def _part(name: str, path: str) -> str:  # the key a row slice of fused ``name`` is held under
    return f"{name}[{path}]"


def _unfused(name_list: list[str], kind: str, path: str) -> tuple[list[str], str]:
    """(HF names, layout) of our ``path``: for a fused layout its slices' keys and the slice's layout."""
    fused = kind.startswith(FUSED)
    return ([_part(n, path) for n in name_list], kind[len(FUSED) :]) if fused else (name_list, kind)


def _split_fused(tensors: dict, names: dict, shapes: dict, where: Path) -> None:
    """Each fused HF tensor replaced in ``tensors`` by its row slices (``_part`` keys), one per
    parameter of ours; their sizes are our per-layer shapes' (``shapes``: global, [L, ...] stacked)."""
    for name, paths in _fused_parts(names).items():
        w = tensors.pop(name)
        one = lambda path: shapes[path][0][1:] if is_stacked(path) else shapes[path][0]
        parts = [_torch_shape(one(path), names[path][1][len(FUSED) :]) for path in paths]
        rows = [p[0] for p in parts]
        want = (sum(rows), *parts[0][1:])
        if tuple(w.shape) != want:
            raise CheckpointError(
                f"{where}: tensor {name} has shape {tuple(w.shape)} but config.json implies {want} ("
                f"{' + '.join(map(str, rows))} rows: {', '.join(paths)}); the weights do not belong to it"
            )
        for path, part in zip(paths, np.split(w, np.cumsum(rows)[:-1]), strict=True):
            tensors[_part(name, path)] = part


def _torch_shape(shape: tuple[int, ...], kind: str) -> tuple[int, ...]:
    """The HF tensor shape of one (per-layer) parameter of ours with ``shape``."""
    if kind == "linear":
        return shape[::-1]
    if kind in ("q", "kv"):  # ours [D, heads, E]
        return (shape[1] * shape[2], shape[0])
    if kind == "o":  # ours [H, E, D]
        return (shape[2], shape[0] * shape[1])
    if kind == "heads":  # ours [heads, E]
        return (shape[0] * shape[1],)
    if kind == "conv":  # ours [K, heads, E]: a depthwise Conv1d's [channels, 1, K]
        return (shape[1] * shape[2], 1, shape[0])
    if kind == hf_experts.EXPERTS:  # ours [E, in, out]
        return (shape[0], shape[2], shape[1])
    return shape
