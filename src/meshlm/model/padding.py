"""Vocabulary padding: which parameters have a vocabulary dimension, and moving trees between the
padded model (``cfg.padded_vocab`` rows, what meshlm stores and shards) and the real vocabulary
(``cfg.vocab_size`` rows, what Hugging Face files and the unpadded reference hold).

Padded rows are inert: initialised to zero, their logits masked out of the softmax (so their
gradients, Adam moments and weight decay are all exactly zero: they stay zero), and stripped
from any logits or weights handed to users. Padding a tree therefore fills zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from meshlm.model.params import param_path

# Parameter path -> its vocabulary dimension (global shapes: embeddings [V, D], head w [D, V], b [V]).
VOCAB_AXIS = {"embed/embeddings": 0, "head/w": 1, "head/b": 0}


def resize(x, axis: int, rows: int):
    """``x`` with dimension ``axis`` cut or zero-padded to ``rows`` (numpy stays numpy)."""
    have = x.shape[axis]
    if have == rows:
        return x
    if have > rows:
        return x[(slice(None),) * axis + (slice(0, rows),)]
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, rows - have)
    return np.pad(x, widths) if isinstance(x, np.ndarray) else jnp.pad(x, widths)


def resize_flat(flat: dict, rows: int) -> dict:
    """A flat {"module/param": array} dict with every vocabulary dimension resized to ``rows``."""
    return {p: resize(v, VOCAB_AXIS[p], rows) if p in VOCAB_AXIS else v for p, v in flat.items()}


def _vocab_axis(key_path, leaf) -> int | None:
    """The vocabulary dimension of ``leaf``, found by its last two dict keys ({module: {name: leaf}}:
    parameters, gradients and the optimizer's moments alike), or None."""
    keys = [k.key for k in key_path if isinstance(k, jax.tree_util.DictKey)]
    if len(keys) < 2 or not hasattr(leaf, "ndim"):
        return None
    axis = VOCAB_AXIS.get(param_path(str(keys[-2]), str(keys[-1])))
    return axis if axis is not None and leaf.ndim > axis else None


def resize_tree(tree, rows: int):
    """Any pytree holding parameter-shaped Haiku dicts, every vocabulary dimension resized to ``rows``."""

    def one(key_path, leaf):
        axis = _vocab_axis(key_path, leaf)
        return leaf if axis is None else resize(leaf, axis, rows)

    return jax.tree_util.tree_map_with_path(one, tree)


def padding_of(tree, vocab_size: int) -> dict[str, object]:
    """{"module/param": the padded slice (ids >= vocab_size)} of every vocabulary leaf of ``tree``."""
    out = {}

    def one(key_path, leaf):
        axis = _vocab_axis(key_path, leaf)
        if axis is not None and leaf.shape[axis] > vocab_size:
            keys = [str(k.key) for k in key_path if isinstance(k, jax.tree_util.DictKey)]
            out[param_path(*keys[-2:])] = leaf[(slice(None),) * axis + (slice(vocab_size, None),)]
        return leaf

    jax.tree_util.tree_map_with_path(one, tree)
    return out
