"""Facts about parameter paths, in one place: how Haiku names are joined, and what kind of parameter a
path names. Every module that asks "is this a weight matrix?" or "is this the embedding?" calls these.

A path is ``"module/param"`` with Haiku's ``/~/`` separators collapsed, e.g. ``layers/attn/wq``.
Naming convention of meshlm's layers: matmul weights are ``w*``; biases ``b*``; norms ``scale`` /
``offset``; the embedding table is ``embed/embeddings``.
"""

from __future__ import annotations

STACKED_PREFIX = "layers/"  # parameters stacked by layer_stack: a leading [n_layers] dimension
# A mixture of experts with dense layers among its MoE layers stacks those apart (``model.layer_kinds``):
# a leading [len(dense_layers)] dimension; "layers/" then holds the MoE layers alone.
DENSE_STACKED_PREFIX = "dense_layers/"
LINEAR_STACKED_PREFIX = "linear_layers/"  # a hybrid's linear-attention layers (``model.layer_kinds``)
GLOBAL_STACKED_PREFIX = "global_layers/"  # global layers of their own attention shape (Gemma 4's)
EMBED_PREFIX = "embed/"
MTP_PREFIX = "mtp_"  # a multi-token prediction depth's parameters: mtp_0/..., mtp_1/... (``model.mtp``)
EXPERTS_MODULE = "experts"  # a MoE layer's expert weights [E, ...] live in a module of this name


def param_path(module: str, name: str) -> str:
    return f"{module}/{name}".replace("/~/", "/")


def leaf_name(path: str) -> str:
    return path.rsplit("/", 1)[1]


def is_stacked(path: str) -> bool:
    prefixes = (STACKED_PREFIX, DENSE_STACKED_PREFIX, LINEAR_STACKED_PREFIX, GLOBAL_STACKED_PREFIX)
    return path.startswith(prefixes)


def is_mtp(path: str) -> bool:
    """A multi-token prediction depth's parameter (``model.mtp``: ``mtp_0/...``)."""
    return path.startswith(MTP_PREFIX)


def is_embedding(path: str) -> bool:
    return path.startswith(EMBED_PREFIX)


def is_table(path: str) -> bool:
    """A lookup table: the embedding, or another (Gemma 4's per-layer inputs, ``embed_per_layer``)."""
    return leaf_name(path) == "embeddings"


def is_matmul_weight(path: str) -> bool:
    """A weight used in a matmul (``w*``): never a norm's scale/offset or a bias (``b*``)."""
    return leaf_name(path).startswith("w")


def is_expert_weight(path: str) -> bool:
    """A mixture-of-experts layer's expert weight ([E, ...]: ``model.moe``), of any layer stack."""
    return path.rsplit("/", 2)[-2:-1] == [EXPERTS_MODULE]


def decays(path: str) -> bool:
    """Whether AdamW's weight decay applies: matmul weights, not norms, biases or embeddings."""
    return is_matmul_weight(path) and not is_embedding(path)


def flat_params(params) -> dict[str, object]:
    """{"module/param": leaf} in Haiku's sorted order (for tables and conversion)."""
    return {param_path(m, n): v for m, leaves in sorted(params.items()) for n, v in sorted(leaves.items())}


def unflatten(flat: dict[str, object]) -> dict[str, dict[str, object]]:
    out: dict[str, dict] = {}
    for path, v in flat.items():
        mod, name = path.rsplit("/", 1)
        out.setdefault(mod, {})[name] = v
    return out
