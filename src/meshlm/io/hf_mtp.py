"""Multi-token prediction's tensors in a transformers checkpoint (DeepSeek-V3's layout; ``model.mtp``).

DeepSeek-V3 stores depth d's module as layer ``n_layers + d`` (``model.layers.61.`` for the 671B): a
whole decoder layer of the main kind (its attention, MoE and norms under the layer names), plus
``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``, and copies of the embedding table
(``embed_tokens``) and the output head (``shared_head.head``). transformers drops these tensors on
load; ``meshlm convert`` reads them from the safetensors (the copies must equal the model's own: meshlm
shares one table and one head) and ``export`` writes them all back, the copies included (vLLM and
SGLang read them). transformers also saves none: a checkpoint it wrote (config.json still saying
``num_nextn_predict_layers``) converts without multi-token prediction, with one warning
(``without_absent``); one holding some depths but not all is refused.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np

from meshlm.errors import CheckpointError
from meshlm.model.layer_kinds import MOE_STACK
from meshlm.model.mtp import MODULE

# meshlm's depth parameters -> their transformers names under the depth's layer prefix
OWN = {
    "enorm/scale": ("enorm.weight", "copy"),
    "hnorm/scale": ("hnorm.weight", "copy"),
    "eh_proj/w": ("eh_proj.weight", "linear"),
    "head_norm/scale": ("shared_head.norm.weight", "copy"),
}
COPIES = {"embed/embeddings": "embed_tokens.weight", "head/w": "shared_head.head.weight"}  # of the model's


def _prefixes(cfg) -> list[str]:
    return [cfg.arch.hf.layer_prefix.format(i=cfg.n_layers + d) for d in range(cfg.mtp_layers)]


def names(cfg, in_stack) -> dict[str, tuple[list[str], str]]:
    """Our MTP paths -> ([their HF name], layout), as ``hf_weights.name_map``'s; ``in_stack(stack, path)``
    says which layer tensors the main kind's layer has (``MOE_STACK``: the MoE layers, or every layer)."""
    out = {}
    layer = {p: v for p, v in cfg.arch.hf.layer.items() if in_stack(MOE_STACK, p)}
    for d, prefix in enumerate(_prefixes(cfg)):
        for path, (name, kind) in {**layer, **OWN}.items():
            out[f"{MODULE.format(d=d)}/{path}"] = ([prefix + name], kind)
    return out


def without_absent(cfg, tensors: dict, directory: Path):
    """``cfg`` without multi-token prediction when the weights hold none of its depths' tensors (a
    checkpoint transformers saved: it drops them), said in one warning; else ``cfg``."""
    prefixes = _prefixes(cfg)
    if not prefixes or any(name.startswith(tuple(prefixes)) for name in tensors):
        return cfg
    warnings.warn(
        f"{directory}: config.json has num_nextn_predict_layers={cfg.mtp_layers} but the weights have no "
        f"{prefixes[0]}* tensors (transformers drops the MTP layers on save): converting without "
        "multi-token prediction (the checkpoint has no MTP depth; --mtp-weight is refused on it)",
        stacklevel=2,
    )
    return cfg.replace(mtp_layers=0, mtp_weight=0.0)


def drop_copies(cfg, tensors: dict, names_of: dict, directory: Path) -> None:
    """Remove each depth's copies of the embedding table and the head from ``tensors``, refusing a copy
    that differs from the model's own, and a checkpoint with some of its depths' tensors but not all
    (none at all: ``without_absent``)."""
    for prefix in _prefixes(cfg):
        if not any(name.startswith(prefix) for name in tensors):
            raise CheckpointError(
                f"{directory}: config.json has num_nextn_predict_layers={cfg.mtp_layers} but the weights "
                f"have no {prefix}* tensors, though they have another depth's: restore them, or set "
                "num_nextn_predict_layers to the depths the weights hold"
            )
        for path, name in COPIES.items():
            copy = tensors.pop(prefix + name, None)
            own = tensors.get(names_of[path][0][0]) if path in names_of else None
            if copy is not None and own is not None and not np.array_equal(copy, own):
                raise CheckpointError(
                    f"{directory}: {prefix + name} differs from {names_of[path][0][0]}; meshlm's "
                    "multi-token prediction shares the model's embedding and head"
                )


def write_copies(cfg, tensors: dict, names_of: dict) -> None:
    """Add each depth's copies of the embedding table and the head (the model's own) to ``tensors``."""
    for prefix in _prefixes(cfg):
        for path, name in COPIES.items():
            own = names_of.get(path, names_of["embed/embeddings"])[0][0]  # tied: the table
            tensors[prefix + name] = tensors[own]
