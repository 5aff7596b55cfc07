"""A mixture of experts' tensors in transformers checkpoints (``io.hf_weights`` calls these).

On disk a Mixtral checkpoint holds one tensor per expert (``experts.{e}.w1.weight`` [I, D], ...); our
parameters stack them on a leading E dim (layout "experts": [E, out, in] <-> ours [E, in, out]). A
family's ``HFNames.layer`` names the per-expert tensors with ``{e}``; its ``HFNames.fused`` lists the
names transformers 5 uses in memory (and ``save_pretrained`` may write), each the per-expert tensors
it concatenates along dim 1 of [E, out, in] (gate then up), or a plain rename. Both are read; the
per-expert names are written (transformers fuses them at load), or where transformers reads only the
fused ones (``HFNames.fused_on_disk``: Gemma 4) the fused ones (``fuse``).
"""

from __future__ import annotations

import numpy as np

EXPERTS = "experts"  # the layout of stacked per-expert linear weights


def expand(names: list[str], kind: str, n_experts: int) -> list[str]:
    """Every tensor name ``names`` stands for: with layout "experts" one per expert."""
    if kind != EXPERTS:
        return names
    return [n.format(e=e) for n in names for e in range(n_experts)]


def pop(tensors: dict, name: str, kind: str, n_experts: int) -> np.ndarray:
    """The tensor ``name``; with layout "experts" the per-expert tensors stacked [E, out, in]."""
    if kind != EXPERTS:
        return tensors.pop(name)
    return np.stack([tensors.pop(name.format(e=e)) for e in range(n_experts)])


def split(name: str, w: np.ndarray, kind: str) -> dict[str, np.ndarray]:
    """One of our (per-layer, torch-layout) tensors -> {name: tensor}, per expert for "experts"."""
    if kind != EXPERTS:
        return {name: w}
    return {name.format(e=e): np.ascontiguousarray(w[e]) for e in range(w.shape[0])}


def unfuse(tensors: dict, fused: dict, prefix: str, n_layers: int) -> None:
    """Rewrite transformers' in-memory names (``fused``: name -> the per-expert names it holds) to the
    per-expert ones, in place; a checkpoint already per-expert is left as it is."""
    for i in range(n_layers):
        at = prefix.format(i=i)
        for name, parts in fused.items():
            w = tensors.pop(at + name, None)
            if w is None:
                continue
            if "{e}" not in parts[0]:
                tensors[at + parts[0]] = w
                continue
            for part, piece in zip(parts, np.split(w, len(parts), axis=1), strict=True):
                tensors.update({at + part.format(e=e): piece[e] for e in range(piece.shape[0])})


def fuse(tensors: dict, fused: dict, prefix: str, n_layers: int, n_experts: int) -> None:
    """``unfuse``'s reverse, in place: each layer's per-expert tensors joined into transformers' fused
    ones (stacked on E, the parts concatenated on dim 1)."""
    for i in range(n_layers):
        at = prefix.format(i=i)
        for name, parts in fused.items():
            if "{e}" not in parts[0] or at + parts[0].format(e=0) not in tensors:
                continue
            stacked = [np.stack([tensors.pop(at + p.format(e=e)) for e in range(n_experts)]) for p in parts]
            tensors[at + name] = np.concatenate(stacked, axis=1)


def split_last(tensors: dict, hf, n_layers: int) -> None:
    """Split each layer tensor the family's ``HFNames.interleaved`` (its last dim alternating its parts:
    gpt-oss's ``gate_up_proj``, gate at the even columns) or ``HFNames.concatenated`` (its parts one
    after another: Llama 4's, gate then up) names into those parts, in place; absent ones are left."""
    for i in range(n_layers):
        at = hf.layer_prefix.format(i=i)
        for spec, alternate in ((hf.interleaved, True), (hf.concatenated, False)):
            for name, parts in spec.items():
                w = tensors.pop(at + name, None)
                if w is None:
                    continue
                pieces = [w[..., j :: len(parts)] for j in range(len(parts))] if alternate else None
                pieces = pieces or np.split(w, len(parts), axis=-1)
                tensors.update({at + part: piece for part, piece in zip(parts, pieces, strict=True)})


def join_last(tensors: dict, hf, n_layers: int) -> None:
    """``split_last``'s reverse, in place: the parts joined column by column, or one after another."""
    for i in range(n_layers):
        at = hf.layer_prefix.format(i=i)
        for spec, alternate in ((hf.interleaved, True), (hf.concatenated, False)):
            for name, parts in spec.items():
                if at + parts[0] not in tensors:  # a dense layer among the MoE layers
                    continue
                pieces = [tensors.pop(at + part) for part in parts]
                joined = np.stack(pieces, axis=-1).reshape(*pieces[0].shape[:-1], -1) if alternate else None
                tensors[at + name] = joined if alternate else np.concatenate(pieces, axis=-1)


def join_for_disk(tensors: dict, cfg) -> None:
    """Each layer's parts joined as transformers stores them, in place: ``split_last``'s parts, and
    where the family keeps its experts fused on disk (Gemma 4: ``HFNames.fused_on_disk``) the experts."""
    hf = cfg.arch.hf
    join_last(tensors, hf, cfg.n_layers)
    if hf.fused_on_disk:
        fuse(tensors, hf.fused, hf.layer_prefix, cfg.n_layers, cfg.n_experts)
