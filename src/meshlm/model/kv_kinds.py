"""The KV cache of a model whose layers mix windowed (local) and full (global) attention, Gemma 2/3.

A local layer sees only its last ``sliding_window`` = W positions, so its decode cache rolls over W
slots (position p in slot p % W, ``attention.cache_update``); a global layer keeps the whole context.
The two cannot share one stacked array [L, B, S, Kc, E], so the cache holds two (per shard):
  "k", "v"              [L_global, B, S, Kc, E]   the global layers', in layer order
  "k_local", "v_local"  [L_local, B, W, Kc, E]    the local layers', in layer order
Each layer's per-layer inputs are its kind and its index among the layers of its kind (``kind_index``);
the two arrays travel through the layer stack as part of its carry, and a layer reads and writes its
own slice (``kinds_cache_attend``). A model with no global layer (fewer layers than ``global_every``)
has one kind of layer: its cache is Mistral's (``attention.cache_window``), not this one.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from meshlm.model.attention import cache_update, layer_kinds
from meshlm.model.blockwise import varying_like
from meshlm.model.config import ModelConfig

LOCAL_KEYS = ("k_local", "v_local")


def mixed_kinds(cfg: ModelConfig) -> bool:
    """True when the layers are of both kinds, so the cache is this module's two arrays."""
    kinds = layer_kinds(cfg)
    return kinds is not None and 0 < int(kinds.sum()) < cfg.n_layers


def kind_counts(cfg: ModelConfig) -> tuple[int, int]:
    """(L_local, L_global): the layers of each kind."""
    n_global = int(layer_kinds(cfg).sum())
    return cfg.n_layers - n_global, n_global


def kind_index(cfg: ModelConfig) -> np.ndarray:
    """[n_layers] int32: each layer's index among the layers of its kind (its slice of its cache)."""
    kinds = layer_kinds(cfg)
    return np.asarray([int((kinds[:i] == k).sum()) for i, k in enumerate(kinds)], np.int32)


def kinds_cache_attend(cfg: ModelConfig, cache: dict, q, k, v, positions, kind, attend):
    """One layer's attention with the two-array cache: (out [B, T, h, E], new cache).

    cache: the stacks above plus "index", this layer's index among its kind (traced). ``kind`` (traced,
    0 local) picks the branch: a local layer writes k, v [B, T, Kc, E] into its W-slot slice (rolling,
    or full while the prefill holds all S slots: ``keep_window`` cuts them after) and attends with the
    window; a global one into its S-slot slice, without one. ``attend(q, k, v, key_pos, window)``."""
    index = cache["index"]
    # both branches return all four arrays: typed alike (inside shard_map), varying as k and v do
    stacks = varying_like({name: cache[name] for name in ("k", "v", *LOCAL_KEYS)}, k, v)

    def branch(names, window):
        def run(stacks):
            pairs = list(zip("kv", names, strict=True))  # ("k", its array's name), ("v", ...)
            own = {n: lax.dynamic_index_in_dim(stacks[name], index, 0, False) for n, name in pairs}
            own, key_pos = cache_update(own, k, v, positions, window)
            new = dict(stacks)
            for n, name in pairs:
                new[name] = lax.dynamic_update_index_in_dim(stacks[name], own[n], index, 0)
            return attend(q, own["k"].astype(q.dtype), own["v"].astype(q.dtype), key_pos, window), new

        return run

    local, full = branch(LOCAL_KEYS, cfg.sliding_window), branch(("k", "v"), 0)
    out, stacks = lax.cond(kind == 0, local, full, stacks)
    return out, {**stacks, "index": index}


def kinds_stack(cfg: ModelConfig, stacked, body, x, cache):
    """``transformer._stack`` with the two-array cache: ``stacked`` a layer stack with per-layer
    inputs; ``body(x, cache, kind)`` one layer. The cache rides in the carry -> (x, new cache): inside
    shard_map it must vary over every axis its keys and values do (``programs``' prefill types it)."""

    def step(carry, kind, index):
        x, stacks = carry
        x, new = body(x, {**stacks, "index": index}, kind)
        return (x, {name: new[name] for name in stacks}), None

    (x, cache), _ = stacked(step)((x, cache), jnp.asarray(layer_kinds(cfg)), jnp.asarray(kind_index(cfg)))
    return x, cache
