"""LoRA dropout (peft's ``lora_dropout``): an adapter computes ``B(A(dropout(x))) * alpha / R``, in the
train step only; the base's ``dense(x, W)`` sees ``x`` whole.

The mask must not depend on the mesh, so nothing is drawn per shard: every element's keep bit is
threefry's hash (``jax.random.fold_in``) of (its token's seed, its layer, its target, its global input
feature). The train step gives each target token of the step batch a distinct uint32 seed
(``with_seeds``: a random offset of the step plus the token's index in the global step batch, an entry
of the batch), so the batch's own slicing -- dp rows, cp chunks, accumulation micro-batches -- brings
each token's seed to the shard that holds its activations; the layer stack passes each layer its index
(``indexed``); a row-parallel base's input features (o, down: split over mp) are numbered from this
shard's offset. Kept elements are scaled by 1 / (1 - P), as ``torch.nn.Dropout``.

Only the train step's batch carries seeds (``SEEDS``): eval, generate, the merge and DPO (trl's
``disable_dropout``) compute without dropout. A pipeline's stages number their layers from 0, so
``--pp`` refuses it (``sharding.pipelined``); so do stacks of two layer kinds (``lora_fields``).
"""

from __future__ import annotations

import contextlib
import math

import jax
import jax.numpy as jnp
import numpy as np

from meshlm.errors import ConfigError
from meshlm.model.lora_fields import NAMES, targets

SEEDS = "lora_seeds"  # the train step's batch entry: uint32 [B, T], each target token's seed
ROW_PARALLEL = frozenset({"o", "down"})  # targets whose input features are split over mp
_KEY = 0x10AD  # the root of every mask's key
_scopes: list[dict] = []  # the seeds (and layer index) of the loss being traced; [] outside one


def with_seeds(batch: dict, seed: int, step) -> dict:
    """``batch`` with ``SEEDS`` [B, T] (or [A, B, T]), on the global arrays: the step's random offset
    (of ``seed`` and the step number ``step``) plus each token's index in the step batch."""
    shape = batch["inputs"].shape
    offset = jax.random.bits(jax.random.fold_in(jax.random.PRNGKey(seed), step), (), jnp.uint32)
    index = jnp.arange(math.prod(shape), dtype=jnp.uint32).reshape(shape)
    return {**batch, SEEDS: index + offset}  # uint32 wraps: distinct within a step while B·T < 2^32


@contextlib.contextmanager
def scope(cfg, seeds):
    """While a loss traces: the adapters drop with this shard's ``seeds`` [B, T] (None: no dropout)."""
    if not cfg.lora_dropout or seeds is None:
        yield
        return
    _scopes.append({"seeds": seeds, "layer": None})
    try:
        yield
    finally:
        _scopes.pop()


def indexed(layer, kinds, n_layers: int):
    """(layer, per-layer inputs): ``layer`` taking its kind and index together, and the stack's
    per-layer inputs with each layer's index [L] beside its kind (``kinds``, None: one kind); the
    layer and ``kinds`` as they are outside a dropout ``scope``."""
    if not _scopes:
        return layer, kinds

    def run(x, positions, c, starts, k):
        kind, index = k
        saved, _scopes[-1]["layer"] = _scopes[-1]["layer"], index
        try:
            return layer(x, positions, c, starts, kind)
        finally:
            _scopes[-1]["layer"] = saved

    return run, (kinds, np.arange(n_layers, dtype=np.uint32))


def dropped(cfg, par, path: str, x, in_shape):
    """``x`` [..., *in_shape] (per shard; the leading dims this shard's [B, T] tokens) with dropout on,
    inside a ``scope``; else ``x``."""
    if not _scopes:
        return x
    seeds, layer = par.tap("lora_seeds", _scopes[-1]["seeds"]), _scopes[-1]["layer"]
    if layer is None:
        raise ConfigError(f"--lora-dropout: {path}'s layer has no index here; drop --lora-dropout")
    name = {p: n for n, p in targets(cfg).items()}[path]
    k = math.prod(in_shape)
    offset = par.shard_index().astype(jnp.uint32) * k if name in ROW_PARALLEL else jnp.uint32(0)
    offset = par.tap("lora_feature_offset", offset)  # where this shard's input features start
    key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(_KEY), layer), NAMES.index(name))
    features = offset + jnp.arange(k, dtype=jnp.uint32)  # global input features

    def token(seed):
        own = jax.random.fold_in(key, seed)
        return jax.vmap(lambda f: jax.random.fold_in(own, f)[0])(features)  # [k] uint32 bits

    bits = jax.vmap(token)(seeds.reshape(-1)).reshape(x.shape)  # x's lead: the seeds' [B, T]
    keep = bits >= jnp.uint32(int(cfg.lora_dropout * 2**32))  # kept with probability 1 - p
    return jnp.where(keep, x / jnp.asarray(1 - cfg.lora_dropout, x.dtype), jnp.zeros_like(x))
