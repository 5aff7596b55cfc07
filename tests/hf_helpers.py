"""What the transformers comparisons share: both models' logits and their relative difference."""

import haiku as hk
import numpy as np

from meshlm.model.params import unflatten
from meshlm.model.transformer import logits_fn
from meshlm.parallel.context import Parallel


def rel(got, want) -> float:
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def hf_logits(model, tokens) -> np.ndarray:
    """A transformers model's logits [B, T, V] (torch imported only here: the test extra has it)."""
    import torch

    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


def our_logits(cfg, flat, tokens) -> np.ndarray:
    """The unsharded model's logits [B, T, V] from flat converted parameters."""
    return np.asarray(hk.transform(logits_fn(cfg, Parallel())).apply(unflatten(flat), None, tokens))
